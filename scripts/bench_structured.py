#!/usr/bin/env python
"""CPU end to end: JSON-schema answers with and without speculation, against the same prompts answered freely.

Configurations, each run on every prompt back to back (interleaved per prompt; the order rotates per prompt so no
configuration always runs first), all greedy:

  AR, schema        engine.generate(method="ar", constraint=the schema)
  default, schema   what ``specexec generate --json-schema FILE`` does with no tuning flags (method default, budget
                    auto: the CPU's measured policy), constraint=the schema
  default, free     the default on the same prompt with no constraint (the unconstrained speculation baseline)
  AR, free          method="ar", no constraint

Prompts: chat requests for a JSON record about a subject (a book by default; ``--schema city`` for a city record),
one fixed schema of string, number, integer, boolean and array fields per set, rendered through the target's chat
template (a tokenizer without one gets the raw request).

Reported per prompt and overall (token-weighted: total tokens / total seconds): decode tok/s (prefill excluded, from
the engine's stats), tok/s of the whole generation (new tokens / the engine's wall clock, prefill included; the
schema's compilation and a method's one-time step-cost measurement are outside it), tokens per target pass, the
forced share (tokens the grammar forced at the start of a step, proposed without a draft pass, over new tokens;
it depends on the method: a forced run that a speculative step reaches inside its tree is counted as drafted, so
the same answer shows a smaller share under speculation than under AR), and the ratios
default-schema / AR-schema (what speculation gains under the schema) and default-schema / default-free (what the
schema costs or gains speculation against answering freely).

Warm-up: every configuration once on the first prompt before timing (allocations, the grammar's view of the
tokenizer, the auto policy's step costs, measured once per engine); its time and the step-cost measurement are
reported separately, not in the timings.

Exactness: the target runs shape-invariant passes, so with greedy decoding ``default, schema`` must give
``AR, schema``'s tokens (and ``default, free`` ``AR, free``'s) exactly; any difference is a bug, counted as a
mismatch (exit 1). Every finished (finish_reason "stop") schema answer must parse with ``json.loads`` and validate
against the schema with ``jsonschema.validate`` (an invalid one: exit 1); answers cut at --max-new-tokens are
counted as unfinished, not checked.

    python scripts/bench_structured.py --out bench_out/structured.json --md bench_out/structured.md
    python scripts/bench_structured.py --schema city --prompts 4 --max-new-tokens 160
    python scripts/bench_structured.py --prompts 1 --max-new-tokens 24 --context 1024 --max-budget 512  # short RAM

``--smoke`` (with tiny models given by --target/--draft) checks the script's logic and measures nothing.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from scripts.bench_cpu import DRAFT, TARGET, _f, first_diff, git_commit, save, write_report  # noqa: E402

BOOK = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "author": {"type": "string"},
        "year": {"type": "integer"},
        "pages": {"type": "integer"},
        "rating": {"type": "number"},
        "genres": {"type": "array", "items": {"type": "string"}},
        "in_print": {"type": "boolean"},
    },
    "required": ["title", "author", "year", "pages", "rating", "genres", "in_print"],
    "additionalProperties": False,
}
CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "country": {"type": "string"},
        "population": {"type": "integer"},
        "area_km2": {"type": "number"},
        "founded": {"type": "integer"},
        "is_capital": {"type": "boolean"},
        "languages": {"type": "array", "items": {"type": "string"}},
        "landmarks": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "country", "population", "area_km2", "founded", "is_capital", "languages", "landmarks"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class SchemaSet:
    """A schema, the subjects to ask about and the request (``{subject}`` and ``{fields}`` filled in)."""

    schema: dict[str, Any]
    subjects: tuple[str, ...]
    request: str


SCHEMAS = {
    "book": SchemaSet(
        BOOK,
        (
            "the novel Dune by Frank Herbert",
            "Pride and Prejudice by Jane Austen",
            "the novel 1984 by George Orwell",
            "The Hobbit by J. R. R. Tolkien",
            "the novel Beloved by Toni Morrison",
            "One Hundred Years of Solitude by Gabriel Garcia Marquez",
        ),
        "Give me a JSON record for {subject} with these fields: {fields}.",
    ),
    "city": SchemaSet(
        CITY,
        ("Paris", "Tokyo", "Nairobi", "Buenos Aires", "Toronto", "Kyoto"),
        "Give me a JSON record for the city of {subject} with these fields: {fields}.",
    ),
}
MAX_PROMPTS = min(len(s.subjects) for s in SCHEMAS.values())


@dataclass(frozen=True)
class Prompt:
    name: str
    text: str


@dataclass(frozen=True)
class Config:
    """One thing to time: ``method`` None is the engine's default (specexec, budget auto); ``schema`` whether the
    answer is constrained by the schema."""

    name: str
    label: str
    method: str | None
    schema: bool


CONFIGS = (
    Config("ar-schema", "AR, schema", "ar", True),
    Config("default-schema", "default, schema", None, True),
    Config("default-free", "default, free", None, False),
    Config("ar-free", "AR, free", "ar", False),
)
# (run, the run whose tokens it must give): greedy on shape-invariant passes, so any difference is a bug
EXACT = (("default-schema", "ar-schema"), ("default-free", "ar-free"))
RATIOS = (("default-schema", "ar-schema"), ("default-schema", "default-free"))


def build_prompts(schema: str, n: int) -> list[Prompt]:
    s = SCHEMAS[schema]
    fields = ", ".join(s.schema["properties"])
    return [Prompt(subject, s.request.format(subject=subject, fields=fields)) for subject in s.subjects[: max(n, 0)]]


def check_answer(text: str, schema: dict[str, Any]) -> str | None:
    """None when ``text`` is JSON that validates against ``schema``; else why not (one line)."""
    import jsonschema

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return f"not JSON: {e}"
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        return f"does not validate: {e.message}"
    return None


# ---------------------------------------------------------------------------------------------- running


class Runner:
    """Holds the loaded engine and the compiled constraint; runs one (config, prompt ids) generation."""

    def __init__(self, args: argparse.Namespace) -> None:
        import specexec
        from specexec.config import SamplingConfig, TreeConfig
        from specexec.decoding.constraint import Constraint

        self.args = args
        self.schema = SCHEMAS[args.schema].schema
        self.constraint = Constraint.json_schema(self.schema)
        self.constraint.check()  # a schema that does not compile fails before the models load
        # the tree settings of `specexec generate` with no tuning flags: budget auto from 64, up to --max-budget
        self.tree = TreeConfig(budget=min(64, args.max_budget), auto=True, max_budget=args.max_budget)
        t = time.perf_counter()
        self.engine = specexec.load(
            args.target,
            args.draft,
            device="cpu",
            dtype=args.dtype,
            draft_dtype=args.draft_dtype,
            context=args.context,
            tree=self.tree,
            progress=False,
        )
        self.load_s = time.perf_counter() - t
        tok = self.engine.tokenizer.tokenizer
        self.chat = bool(getattr(tok, "chat_template", None))
        self.greedy = SamplingConfig(temperature=0.0)

    def encode(self, p: Prompt) -> list[int]:
        """The request as one user message through the chat template (raw text where the tokenizer has none)."""
        return self.engine.encode(p.text, chat=self.chat)

    def run(self, c: Config, ids: list[int], max_new: int) -> dict[str, Any]:
        self.engine.reset()  # cold cache: every configuration prefills the prompt
        t = time.perf_counter()
        r = self.engine.generate(
            ids,
            max_new,
            method=c.method,
            constraint=self.constraint if c.schema else None,
            sampling_cfg=self.greedy,
            tree=self.tree,
        )
        call_s = time.perf_counter() - t
        s = r.stats
        n = len(r.tokens)
        rec: dict[str, Any] = {
            "method": s.method,
            "tokens": n,
            "finish_reason": r.finish_reason,
            "steps": s.steps,
            "tokens_per_step": s.tokens_per_step,
            "decode_tok_s": s.tokens_per_s,
            "decode_s": s.wall_s - s.prefill_s,
            "wall_s": s.wall_s,
            "tok_s": n / s.wall_s if s.wall_s > 0 else 0.0,
            "prefill_s": s.prefill_s,
            "call_s": call_s,  # the whole generate call: also the grammar's compilation and any cost measurement
            "forced_tokens": s.forced_tokens,
            "forced_share": s.forced_tokens / n if n else 0.0,
            "draft_passes": s.draft_passes,
            "ngram_tokens": s.ngram_tokens,
            "costs_s": s.costs_s,
            "text": r.text,
            "ids": list(r.tokens),
        }
        if s.budgets:
            rec["budgets"] = {str(k): v for k, v in sorted(s.budgets.items())}
        if c.schema:
            rec["valid"] = None if r.finish_reason != "stop" else check_answer(r.text, self.schema) is None
            if rec["valid"] is False:
                rec["invalid_reason"] = check_answer(r.text, self.schema)
        return rec


def warm_up(runner: Runner, prompt: Prompt, max_new: int) -> dict[str, Any]:
    """Every configuration once (a short generation) on ``prompt``: seconds in all, and the one-time step-cost
    measurement's seconds among them."""
    ids = runner.encode(prompt)
    t = time.perf_counter()
    costs = 0.0
    for c in CONFIGS:
        costs += runner.run(c, ids, max_new)["costs_s"]
    return {"seconds": time.perf_counter() - t, "costs_s": costs, "tokens": max_new}


def run_all(
    runner: Runner,
    prompts: list[Prompt],
    max_new: int,
    log: Callable[[str], None],
    done: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """Every configuration on each prompt, back to back; the order rotates by one per prompt. ``done`` gets the
    records so far after each prompt (the partial report a long run leaves behind if it is stopped)."""
    records = []
    for k, p in enumerate(prompts):
        ids = runner.encode(p)
        order = list(CONFIGS[k % len(CONFIGS) :] + CONFIGS[: k % len(CONFIGS)])
        got: dict[str, dict[str, Any]] = {}
        for c in order:
            rec = got[c.name] = runner.run(c, ids, max_new)
            log(
                f"{k + 1}/{len(prompts)} {p.name[:36]:36s} {c.label:16s} {rec['tokens']:4d} tok "
                f"{rec['decode_tok_s']:7.2f} decode tok/s {rec['tokens_per_step']:5.2f} tok/step "
                f"forced {rec['forced_share']:4.0%} {rec['finish_reason']}"
                + (f"  budgets {rec['budgets']}" if rec.get("budgets") else "")
                + (f"  INVALID: {rec['invalid_reason']}" if rec.get("valid") is False else "")
            )
        for run, ref in EXACT:
            d = first_diff(got[ref]["ids"], got[run]["ids"])
            got[run]["matches"] = ref
            got[run]["match"] = d is None
            got[run]["first_diff"] = d
            if d is not None:
                log(f"MISMATCH (a bug): {p.name}: {run} left {ref}'s tokens at {d}")
        for c in CONFIGS:
            rec = got[c.name]
            records.append(
                {
                    "prompt": p.name,
                    "prompt_tokens": len(ids),
                    "config": c.name,
                    "label": c.label,
                    "order": order.index(c),
                    **{key: v for key, v in rec.items() if key != "ids"},
                }
            )
        if done is not None:
            done(records)
    return records


# ---------------------------------------------------------------------------------------------- summary


def _aggregate(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """Token-weighted figures of some runs of one configuration."""
    tokens = sum(r["tokens"] for r in rs)
    decode_s, wall_s = sum(r["decode_s"] for r in rs), sum(r["wall_s"] for r in rs)
    out: dict[str, Any] = {
        "prompts": len(rs),
        "tokens": tokens,
        "decode_s": decode_s,
        "wall_s": wall_s,
        "decode_tok_s": tokens / decode_s if decode_s > 0 else 0.0,
        "tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "tokens_per_step": tokens / max(sum(r["steps"] for r in rs), 1),
        "forced_tokens": sum(r["forced_tokens"] for r in rs),
        "forced_share": sum(r["forced_tokens"] for r in rs) / tokens if tokens else 0.0,
        "finished": sum(r["finish_reason"] == "stop" for r in rs),
    }
    if any("match" in r for r in rs):
        out["mismatches"] = sum(not r["match"] for r in rs)
    if any("valid" in r for r in rs):
        out["invalid"] = sum(r.get("valid") is False for r in rs)
    return out


def _ratios(by: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for a, b in RATIOS:
        out[f"{a}/{b}"] = {key: (by[a][key] / by[b][key] if by[b][key] else None) for key in ("decode_tok_s", "tok_s")}
    return out


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Overall (token-weighted) and per prompt: each configuration's figures and the ratios."""
    overall = {c.name: _aggregate([r for r in records if r["config"] == c.name]) for c in CONFIGS}
    per_prompt = {}
    for p in dict.fromkeys(r["prompt"] for r in records):
        by = {c.name: _aggregate([r for r in records if r["prompt"] == p and r["config"] == c.name]) for c in CONFIGS}
        per_prompt[p] = {"configs": by, "ratios": _ratios(by)}
    return {
        "overall": {"configs": overall, "ratios": _ratios(overall)},
        "per_prompt": per_prompt,
        "mismatches": sum(overall[run].get("mismatches", 0) for run, _ in EXACT),
        "invalid": sum(s.get("invalid", 0) for s in overall.values()),
        "unfinished_schema_answers": sum(
            s["prompts"] - s["finished"] for n, s in overall.items() if n.endswith("-schema")
        ),
    }


def markdown(report: dict[str, Any]) -> str:
    m, summ = report["meta"], report["summary"]
    w = m["warm_up"]
    lines = [
        f"### Structured output (JSON schema: {m['schema_name']}): {m['target']} + {m['draft']}, {m['date']}",
        "",
        f"{m['machine']}; torch {m['torch']} ({m['threads']} threads), llguidance {m['llguidance']}; "
        f"dtype {m['dtype']}, draft {m['draft_dtype']}; {len(m['prompts'])} prompts"
        f"{' (chat template)' if m['chat'] else ' (raw text: the tokenizer has no chat template)'}, "
        f"greedy, at most {m['max_new_tokens']} new tokens; context {m['context']}, --max-budget {m['max_budget']}; "
        f"commit {m['commit']}. Warm-up {w['seconds']:.1f} s "
        f"(of which {w['costs_s']:.1f} s the auto policy's one-time step-cost measurement), not in the timings."
        + (" **SMOKE RUN (tiny models): the numbers mean nothing.**" if m.get("smoke") else "")
        + (f" **PARTIAL: the run stopped after {m['partial']}.**" if m.get("partial") else ""),
        "",
        "decode tok/s excludes the prefill; tok/s = new tokens / the generation's wall clock (prefill included); "
        "both token-weighted (total tokens / total seconds). forced = share of the new tokens the grammar forced "
        "at a step's start (proposed without a draft pass; a speculative step counts forced tokens it reaches inside "
        "its tree as drafted). finished = answers that ended (EOS) within the token limit.",
        "",
        "| config | tokens | decode tok/s | tok/s | tokens/step | forced | finished | checks |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in CONFIGS:
        s = summ["overall"]["configs"][c.name]
        checks = []
        if "mismatches" in s:
            ref = dict(EXACT)[c.name]
            checks.append(f"{s['mismatches']} mismatches vs {ref}" + (" **(a bug)**" if s["mismatches"] else ""))
        if "invalid" in s:
            checks.append(f"{s['invalid']} invalid" + (" **(a bug)**" if s["invalid"] else ""))
        lines.append(
            f"| {c.label} | {s['tokens']} | {s['decode_tok_s']:.2f} | {s['tok_s']:.2f} | "
            f"{s['tokens_per_step']:.2f} | {s['forced_share']:.0%} | {s['finished']}/{s['prompts']} | "
            f"{'; '.join(checks) or '-'} |"
        )
    lines += ["", "| ratio | decode tok/s | tok/s |", "|---|---|---|"]
    for key, r in summ["overall"]["ratios"].items():
        lines.append(f"| {key} | {_f(r['decode_tok_s'], suffix='×')} | {_f(r['tok_s'], suffix='×')} |")
    lines += [
        "",
        "Per prompt (decode tok/s of each configuration; ratios of decode tok/s; tokens/step and forced share of "
        "default, schema):",
        "",
        "| prompt | AR, schema | default, schema | default, free | AR, free | default-schema / AR-schema "
        "| default-schema / default-free | tokens/step | forced | schema answer |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p, d in summ["per_prompt"].items():
        cs, ra = d["configs"], d["ratios"]
        ds = cs["default-schema"]
        answer = "finished" if ds["finished"] else "cut at the limit"
        if cs["ar-schema"].get("invalid") or ds.get("invalid"):
            answer = "**invalid**"
        lines.append(
            f"| {p} | "
            + " | ".join(f"{cs[c.name]['decode_tok_s']:.2f}" for c in CONFIGS)
            + f" | {_f(ra['default-schema/ar-schema']['decode_tok_s'], suffix='×')}"
            + f" | {_f(ra['default-schema/default-free']['decode_tok_s'], suffix='×')}"
            + f" | {ds['tokens_per_step']:.2f} | {ds['forced_share']:.0%} | {answer} |"
        )
    lines += [
        "",
        f"Exactness: {summ['mismatches']} mismatches (default vs AR, schema and free); "
        f"{summ['invalid']} invalid finished schema answers; {summ['unfinished_schema_answers']} schema answers cut "
        "at the token limit (not checked).",
        "",
    ]
    return "\n".join(lines) + "\n"


def _meta(args: argparse.Namespace, runner: Runner, prompts: list[Prompt], warm: dict[str, Any]) -> dict[str, Any]:
    import torch

    e = runner.engine
    return {
        "target": args.target,
        "draft": args.draft,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()} {platform.system()}",
        "torch": torch.__version__,
        "llguidance": importlib.metadata.version("llguidance"),
        "threads": torch.get_num_threads(),
        "dtype": str(e.target.dtype).replace("torch.", ""),
        "draft_dtype": getattr(e, "draft_weights", None)
        or (str(e.draft.dtype).replace("torch.", "") if e.draft else None),
        "invariant_tiling": getattr(getattr(e, "invariance", None), "tiling", None),
        "max_new_tokens": args.max_new_tokens,
        "context": args.context,
        "max_budget": runner.tree.max_budget,
        "max_tree": getattr(e, "max_tree", None),
        "commit": git_commit(),
        "smoke": args.smoke,
        "chat": runner.chat,
        "load_s": runner.load_s,
        "warm_up": warm,
        "schema_name": args.schema,
        "schema": SCHEMAS[args.schema].schema,
        "configs": [asdict(c) for c in CONFIGS],
        "prompts": [{"name": p.name, "text": p.text} for p in prompts],
    }


# ---------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=TARGET)
    p.add_argument("--draft", default=DRAFT)
    p.add_argument("--schema", default="book", choices=sorted(SCHEMAS), help="the record asked for (default book)")
    p.add_argument("--prompts", type=int, default=None, help=f"how many subjects, 1..{MAX_PROMPTS} (default all)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 128 (24 with --smoke)")
    p.add_argument("--warmup-tokens", type=int, default=8, help="new tokens of each configuration's warm-up run")
    p.add_argument("--dtype", default="auto", help="the engine's dtype (auto: what generate uses)")
    p.add_argument("--draft-dtype", default=None, help="the draft's dtype or format (default: --dtype, as generate)")
    p.add_argument("--context", type=int, default=4096, help="as generate's --context (default 4096)")
    p.add_argument(
        "--max-budget",
        type=int,
        default=2048,
        help="as generate's --max-budget (default 2048): the largest auto tree the buffers are sized for; lower it "
        "where free RAM is short (the CPU policy's trees are far smaller, so its choices are the same)",
    )
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    p.add_argument("--md", type=Path, default=None, help="append the markdown tables to this file")
    p.add_argument("--smoke", action="store_true", help="logic check on tiny models (give --target/--draft)")
    p.add_argument("--quiet", action="store_true", help="no per-run progress lines")
    args = p.parse_args(argv)
    if args.prompts is None:
        args.prompts = MAX_PROMPTS
    if args.max_new_tokens is None:
        args.max_new_tokens = 24 if args.smoke else 128
    if not 1 <= args.prompts <= MAX_PROMPTS:
        p.error(f"--prompts must be between 1 and {MAX_PROMPTS}")
    if args.max_new_tokens < 1 or args.warmup_tokens < 1 or args.max_budget < 1:
        p.error("--max-new-tokens, --warmup-tokens and --max-budget must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    prompts = build_prompts(args.schema, args.prompts)
    log(f"loading {args.target} + {args.draft}")
    runner = Runner(args)
    warm = warm_up(runner, prompts[0], args.warmup_tokens)
    log(f"warm-up done: {warm['seconds']:.1f} s (step-cost measurement {warm['costs_s']:.1f} s)")
    meta = _meta(args, runner, prompts, warm)

    def checkpoint(records: list[dict[str, Any]]) -> None:  # a stopped run still leaves its finished prompts
        if args.out:
            n = len({r["prompt"] for r in records})
            write_report(args.out, {"meta": {**meta, "partial": f"{n} of {len(prompts)} prompts"}, "runs": records})

    records = run_all(runner, prompts, args.max_new_tokens, log, checkpoint)
    summary = summarize(records)
    report = {"meta": meta, "summary": summary, "runs": records}
    md = markdown(report)
    print(md)
    save(args, report, md, log)
    return _verdict(records, summary)


def _verdict(records: list[dict[str, Any]], summary: dict[str, Any]) -> int:
    """1 when a default run left its AR's tokens, or a finished schema answer does not validate (both bugs)."""
    for r in records:
        if r.get("match") is False:
            print(
                f"error: {r['prompt']} {r['label']}: differs from {r['matches']} at token {r['first_diff']}",
                file=sys.stderr,
            )
        if r.get("valid") is False:
            print(f"error: {r['prompt']} {r['label']}: {r['invalid_reason']}", file=sys.stderr)
    if summary["mismatches"] or summary["invalid"]:
        print(
            f"error: {summary['mismatches']} mismatches, {summary['invalid']} invalid schema answers (bugs)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
