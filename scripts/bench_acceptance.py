#!/usr/bin/env python
"""Acceptance and speed of SpecExec trees vs chain speculative decoding vs AR: real engine runs on the demo pair.

Every number comes from real generations through the library's one decode loop (``Engine.generate``): per
prompt, AR, chain at each ``--gammas`` and specexec at each ``--budgets``, greedy, ``--new-tokens`` tokens each.
Per run the engine's :class:`~specexec.decoding.loop.Stats` are kept whole (``to_json(shapes=True)``: tokens per step,
draft passes, every step's tree shape, the accepted-tokens histogram, measured draft / target / decode seconds).
Greedy runs must reproduce AR's tokens exactly; the script checks it and exits 1 on a mismatch.

Prompts are taken at run time from offline text shipped with every Python: chunks of CPython's stdlib sources
(code) and of ``pydoc_data/topics.py`` (English prose), at fixed files and offsets, cut at line boundaries
(``--min/max-prompt-tokens``). tok/s is measured: new tokens / decode seconds (prefill excluded, as
``Stats.tokens_per_s``), as noisy as the machine it runs on.

``--grow-cost`` chooses what the trees' early stop weighs: ``engine`` (default: the engine's own fixed-budget
policy -- on a CPU, early stop with the step costs it measures as it runs), ``off`` (full growth up to
``max_depth`` levels), or a ``scripts/bench_e2e.py`` JSON (the early stop weighs that GPU's measured draft-pass and
verify costs: the trees are the ones that GPU would grow; their tokens/step are real, their CPU tok/s is not
what that GPU would see).

``--project-gpu`` JSON (a bench_e2e JSON such as docs/bench_e2e_h100.json; implied by a JSON ``--grow-cost``)
adds a PROJECTION, never a measurement: ``projected_tok_s_gpu`` = tokens / the sum over the SAME real runs'
recorded steps of that GPU's step cost (graphed draft-pass seconds for each recorded pass's tokens + tree
bookkeeping per level + the NF4 70B-shaped verify seconds for the tree size; AR: its measured streamed step).
It is labelled "projection from replayed step costs, not measured" in the JSON and the tables.

Sampling (``--sampling-prompts``, temperature / top-p): the real engine on the first prompts, tokens/step next to
greedy's on the same prompts. ``max_depth`` (default 32) caps a step at 33 tokens.

    nice -n 10 python scripts/bench_acceptance.py                  # docs/bench_acceptance.{json,md,png}
    nice -n 10 python scripts/bench_acceptance.py --quick          # a small run, to check the pipeline
    python scripts/bench_acceptance.py --budgets 64,256 --gammas 8 --grow-cost off \\
        --out docs/bench_acceptance_full_growth.json --md docs/bench_acceptance_full_growth.md \\
        --png docs/bench_acceptance_full_growth.png                # full growth
    python scripts/bench_acceptance.py --report-only               # re-render md/png from the JSON
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import sysconfig
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
BUDGETS = (8, 16, 32, 64, 128, 256, 512, 1024)
GAMMAS = tuple(range(1, 9))
KINDS = ("code", "prose")
PROJECTION = "projection from replayed step costs, not measured"

# (stdlib file, where the chunk starts as a fraction of its lines). Deterministic; missing files are skipped.
CODE_SOURCES = (
    ("textwrap.py", 0.30),
    ("json/decoder.py", 0.40),
    ("json/encoder.py", 0.55),
    ("heapq.py", 0.50),
    ("functools.py", 0.35),
    ("dataclasses.py", 0.60),
    ("argparse.py", 0.45),
    ("difflib.py", 0.20),
    ("shlex.py", 0.50),
    ("fractions.py", 0.40),
    ("csv.py", 0.35),
    ("string.py", 0.55),
    ("configparser.py", 0.65),
    ("statistics.py", 0.45),
    ("tokenize.py", 0.50),
    ("pprint.py", 0.40),
)
# (pydoc topic, start fraction): prose of the language reference.
PROSE_SOURCES = (
    ("naming", 0.05),
    ("execmodel", 0.30),
    ("exceptions", 0.10),
    ("import", 0.25),
    ("assignment", 0.05),
    ("function", 0.40),
    ("class", 0.20),
    ("try", 0.30),
    ("with", 0.15),
    ("customization", 0.10),
    ("calls", 0.50),
    ("types", 0.30),
    ("compound", 0.60),
    ("formatstrings", 0.05),
    ("specialnames", 0.40),
    ("typesseq", 0.10),
)


@dataclass
class Prompt:
    kind: str  # "code" | "prose"
    source: str  # stdlib file or pydoc topic
    lines: tuple[int, int]  # [first, last) line numbers (0-based) in the source
    text: str
    ids: list[int] = field(repr=False)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def key(method: str, v: int) -> str:
    return "ar" if method == "ar" else f"{method}:{v}"


# -- prompts ------------------------------------------------------------------------------------------------------
def _chunk(lines: list[str], start: int, tok: Any, min_tok: int, max_tok: int, prose: bool) -> tuple[int, int, str]:
    """Lines [s, e) from about ``start``: begin at a non-blank line (a paragraph start for prose), stop once the
    text has >= min_tok tokens (and never add a line that passes max_tok). Falls back to earlier starts."""

    def n_tok(text: str) -> int:
        return len(tok(text.rstrip())["input_ids"])

    def ok_start(i: int) -> bool:
        if not lines[i].strip():
            return False
        return not prose or i == 0 or (not lines[i - 1].strip() and not lines[i].startswith((" ", "*", "=")))

    def grow(s: int) -> tuple[int, int, str] | None:
        text, e = "", s
        while e < len(lines):
            nxt = text + lines[e]
            if text and n_tok(nxt) > max_tok:
                return None
            text, e = nxt, e + 1
            if n_tok(text) >= min_tok:
                return s, e, text.rstrip()
        return None

    cands = [i for i in range(len(lines)) if ok_start(i)]
    for s in [i for i in cands if i >= start] + [i for i in reversed(cands) if i < start]:
        got = grow(s)
        if got is not None:
            return got
    raise ValueError("no chunk of the requested size in this source")


def make_prompts(tok: Any, n_code: int, n_prose: int, min_tok: int, max_tok: int) -> list[Prompt]:
    """Deterministic prompts: ``n_code`` stdlib chunks, then ``n_prose`` pydoc-topic chunks."""
    from pydoc_data.topics import topics

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out: list[Prompt] = []
    for name, frac in CODE_SOURCES:
        if sum(p.kind == "code" for p in out) >= n_code:
            break
        f = stdlib / name
        if f.is_file():
            lines = f.read_text(encoding="utf-8").splitlines(keepends=True)
            s, e, text = _chunk(lines, int(frac * len(lines)), tok, min_tok, max_tok, prose=False)
            out.append(Prompt("code", name, (s, e), text, tok(text)["input_ids"]))
    for name, frac in PROSE_SOURCES:
        if sum(p.kind == "prose" for p in out) >= n_prose:
            break
        if name in topics:
            lines = topics[name].splitlines(keepends=True)
            s, e, text = _chunk(lines, int(frac * len(lines)), tok, min_tok, max_tok, prose=True)
            out.append(Prompt("prose", f"pydoc_data/topics.py[{name!r}]", (s, e), text, tok(text)["input_ids"]))
    if sum(p.kind == "code" for p in out) < n_code or sum(p.kind == "prose" for p in out) < n_prose:
        raise SystemExit(f"only {len(out)} prompts available here; lower --prompts")
    return out


# -- a GPU's measured step costs: the early stop's costs (--grow-cost JSON) and the projection (--project-gpu) ------
@dataclass
class GpuCosts:
    """Step costs measured by ``scripts/bench_e2e.py`` on a GPU (7B-shaped graphed draft, NF4 70B-shaped target)."""

    source: str
    device: str
    pass_s: dict[int, float]  # graphed draft pass seconds by tokens in the pass (static-shape buckets)
    per_level: float  # tree bookkeeping seconds per growth level
    verify_s: dict[int, float]  # the target's verify seconds by budget (budget + 1 tree tokens)
    ar_s: float  # the target's streamed 1-token step

    @classmethod
    def load(cls, path: str | Path) -> GpuCosts:
        e = json.loads(Path(path).read_text())
        nf4 = [r for r in e["runs"] if r["format"] == "nf4"]
        return cls(
            str(path),
            e.get("device", "GPU"),
            {int(k): v for k, v in e["draft_pass_s_graphed"].items()},
            e["bookkeeping_s_per_level"],
            {r["budget"]: r["verify_s"] for r in nf4},
            nf4[0]["ar_step_s"],
        )

    def pass_seconds(self, tokens: int) -> float:
        """A static-shape pass costs its bucket's time (the smallest measured size >= tokens)."""
        return self.pass_s[next((b for b in sorted(self.pass_s) if b >= tokens), max(self.pass_s))]

    def step_seconds(self, verify_budget: int, beams: list[int]) -> float:
        """One step: the recorded draft passes (tokens per pass) + bookkeeping per level + the target's verify."""
        from specexec.decoding.budget import interp

        draft = sum(self.pass_seconds(k) for k in beams) + self.per_level * len(beams)
        return draft + (interp(self.verify_s, verify_budget) if verify_budget else self.ar_s)

    def describe(self) -> str:
        return (
            f"{self.device} costs from {self.source}: graphed draft pass {self.pass_s[min(self.pass_s)] * 1e3:.1f}"
            f"-{self.pass_s[max(self.pass_s)] * 1e3:.1f} ms + {self.per_level * 1e3:.1f} ms bookkeeping per level, "
            f"NF4 70B-shaped verify s by budget { {b: round(t, 3) for b, t in sorted(self.verify_s.items())} }, "
            f"AR step {self.ar_s:.3f} s"
        )


@dataclass
class GpuCostBudget:
    """A fixed budget whose early stop weighs a GPU's measured costs: a budget policy for ``Engine.generate``.

    Only the correction for the draft's over- or under-confidence is learnt from the steps (as the engine's own
    fixed-budget policy does); the seconds are the GPU's, not this machine's.
    """

    budget: int
    costs: GpuCosts
    max_depth: int = 32
    acc_scale: float = 1.0

    def choose(self) -> int:
        return self.budget

    def trim(self, tree: Any) -> int:
        return 0  # fixed budgets verify what they grew

    def grow_cost(self, budget: int) -> Any:
        from specexec.decoding.budget import interp
        from specexec.propose import GrowCost

        return GrowCost(
            pass_s=self.costs.pass_s[max(self.costs.pass_s)] + self.costs.per_level,
            target_s=interp(self.costs.verify_s, budget),
            acc_scale=self.acc_scale,
        )

    def update(self, step: Any) -> None:
        if step.tree_logp:
            predicted = min(1.0 + sum(math.exp(x) for x in step.tree_logp), self.max_depth + 1.0)
            self.acc_scale = min(max(0.8 * self.acc_scale + 0.2 * step.emitted / max(predicted, 1.0), 0.2), 5.0)


# -- runs -----------------------------------------------------------------------------------------------------------
def generate(
    engine: Any, ids: list[int], n: int, method: str, v: int, args: argparse.Namespace, samp: Any = None
) -> Any:
    """One real generation through the engine (the library's decode loop)."""
    from specexec.config import ChainConfig, TreeConfig

    tree = chain = policy = None
    if method == "specexec":
        tree = TreeConfig(budget=v, early_stop={"engine": None, "off": False}.get(args.grow_cost, True))
        if args.grow_costs is not None:
            policy = GpuCostBudget(v, args.grow_costs, tree.max_depth)
    elif method == "chain":
        chain = ChainConfig(gamma=v)
    return engine.generate(ids, n, method=method, tree=tree, chain=chain, sampling_cfg=samp, policy=policy)


def row_of(
    i: int, p: Prompt, method: str, v: int, r: Any, ar_tokens: list[int] | None, gpu: GpuCosts | None
) -> dict[str, Any]:
    st = r.stats
    row: dict[str, Any] = {
        "prompt": i,
        "kind": p.kind,
        "config": key(method, v),
        "method": method,
        "param": v,
        "stats": st.to_json(shapes=True),
    }
    if ar_tokens is not None:
        row["tokens_equal_ar"] = r.tokens == ar_tokens
        if r.tokens != ar_tokens:
            row["first_difference"] = next(
                (j for j, (a, b) in enumerate(zip(ar_tokens, r.tokens)) if a != b), min(len(ar_tokens), len(r.tokens))
            )
    if gpu is not None:
        shapes = st.tree_shapes if method != "ar" else [[] for _ in range(st.steps)]
        row["projected_s_gpu"] = sum(gpu.step_seconds(v, b) for b in shapes)
        row["projected_tok_s_gpu"] = st.new_tokens / row["projected_s_gpu"] if row["projected_s_gpu"] else 0.0
    return row


def aggregate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Sums over prompts of the real runs' stats (tok/s measured); a projection only where the rows carry one."""
    st = [r["stats"] for r in rows]
    tokens, steps = sum(s["new_tokens"] for s in st), sum(s["steps"] for s in st)
    decode = sum(s["wall_s"] - s["prefill_s"] for s in st)
    hist: Counter[int] = Counter()
    for s in st:
        hist.update({int(k): v for k, v in s["accepted_hist"].items()})
    out = {
        "prompts": len(rows),
        "tokens": tokens,
        "steps": steps,
        "tokens_per_step": tokens / max(steps, 1),
        "tokens_per_s": tokens / decode if decode > 0 else 0.0,
        "decode_s": decode,
        "draft_s_per_step": sum(s["draft_s"] for s in st) / max(steps, 1),
        "target_s_per_step": sum(s["target_s"] for s in st) / max(steps, 1),
        "draft_passes_per_step": sum(s["draft_passes"] for s in st) / max(steps, 1),
        "mean_tree_size": sum(s["mean_tree_size"] * s["steps"] for s in st) / max(steps, 1),
        "early_stop_share": sum(s["early_stops"] for s in st) / max(steps, 1),
        "accepted_hist": {str(k): hist[k] for k in sorted(hist)},
    }
    if all("projected_s_gpu" in r for r in rows):
        out["projected_tok_s_gpu"] = tokens / sum(r["projected_s_gpu"] for r in rows)
    return out


def shape_summary(shapes: list[list[int]]) -> dict[str, Any]:
    """Mean draft passes per step, and per pass index the mean tokens (over the steps that reached it)."""
    if not shapes:
        return {"steps": 0}
    per = [[s[i] for s in shapes if len(s) > i] for i in range(max(len(s) for s in shapes))]
    return {
        "steps": len(shapes),
        "passes": statistics.fmean(len(s) for s in shapes),
        "beams_per_pass": [round(statistics.fmean(p), 2) for p in per],
        "reach": [round(len(p) / len(shapes), 3) for p in per],
        "draft_tokens_per_step": statistics.fmean(sum(s) for s in shapes),
    }


def summarise(rows: list[dict[str, Any]], prompts: list[Prompt]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per kind (code, prose, all) and config: the aggregate, and per budget the tree-shape summary."""
    greedy: dict[str, Any] = {}
    shapes: dict[str, Any] = {}
    for kind in KINDS + ("all",):
        sel = [r for r in rows if kind == "all" or r["kind"] == kind]
        configs = list(dict.fromkeys(r["config"] for r in sel))
        greedy[kind] = {}
        for k in configs:
            mine = [r for r in sel if r["config"] == k]
            greedy[kind][k] = aggregate(mine)
            idx = {r["prompt"] for r in mine}
            if len(idx) < len({r["prompt"] for r in sel}):  # big budgets on fewer prompts: chain's best there too
                chains = {c for c in configs if c.startswith("chain:")}
                greedy[kind][k]["chain_best_same_prompts"] = max(
                    (
                        aggregate([r for r in sel if r["config"] == c and r["prompt"] in idx])["tokens_per_step"]
                        for c in chains
                    ),
                    default=None,
                )
        shapes[kind] = {
            k.split(":")[1]: shape_summary([s for r in sel if r["config"] == k for s in r["stats"]["tree_shapes"]])
            for k in configs
            if k.startswith("specexec:")
        }
    return greedy, shapes


def _spec_keys(section: dict[str, Any]) -> list[tuple[int, str]]:
    return sorted((int(k.split(":")[1]), k) for k in section if k.startswith("specexec:"))


def _chain_best(section: dict[str, Any], by: str = "tokens_per_step") -> tuple[str, float]:
    ks = [k for k in section if k.startswith("chain:")]
    if not ks:
        return "none", float("nan")
    k = max(ks, key=lambda k: section[k][by])
    return k, section[k][by]


def goals(greedy: dict[str, Any]) -> dict[str, Any]:
    g: dict[str, Any] = {}
    for kind, start in (("code", 64), ("prose", 256)):
        sec = greedy.get(kind) or {}
        ck, cb = _chain_best(sec)
        ratios = {
            str(b): round(sec[k]["tokens_per_step"] / (sec[k].get("chain_best_same_prompts") or cb), 2)
            for b, k in _spec_keys(sec)
            if b >= start
        }
        g[f"{kind}: specexec tokens/step vs chain's best"] = {
            "goal": f">= 2x from budget {start} on",
            "chain_best": f"{ck} = {cb:.2f} tokens/step",
            "ratio_by_budget": ratios,
            "met": all(v >= 2.0 for v in ratios.values()) if ratios else None,
        }
    for kind in KINDS + ("all",):
        sec = greedy.get(kind) or {}
        if "ar" not in sec or not _spec_keys(sec):
            continue
        bk = max((k for _, k in _spec_keys(sec)), key=lambda k: sec[k]["tokens_per_s"])
        ratio = sec[bk]["tokens_per_s"] / sec["ar"]["tokens_per_s"]
        g[f"{kind}: best specexec tok/s vs AR"] = {
            "goal": ">= 1.5x (measured, this machine)",
            "best": bk,
            "ratio": round(ratio, 2),
            "met": ratio >= 1.5,
        }
    return g


def run_sampling(
    engine: Any, prompts: list[Prompt], idx: list[int], greedy_rows: list[dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    """The real engine at temperature/top-p on a few prompts: tokens/step next to greedy's on the same prompts."""
    from specexec.config import SamplingConfig

    cfgs = [("chain", args.sampling_gamma)] + [("specexec", b) for b in args.sampling_budgets]
    rows = []
    for j, i in enumerate(idx):
        engine.reset()
        for m, v in cfgs:
            samp = SamplingConfig(temperature=args.temperature, top_p=args.top_p, seed=args.seed + 1000 * j + v)
            r = generate(engine, prompts[i].ids, args.new_tokens, m, v, args, samp)
            rows.append(row_of(i, prompts[i], m, v, r, None, None))
        log(
            f"sampling {j + 1}/{len(idx)}: tokens/step "
            + " ".join(f"{r['config']}={r['stats']['tokens_per_step']:.1f}" for r in rows if r["prompt"] == i)
        )
    out: dict[str, Any] = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "tokens": args.new_tokens,
        "prompts": idx,
        "configs": {},
        "runs": rows,
    }
    for m, v in cfgs:
        k = key(m, v)
        g = [r for r in greedy_rows if r["config"] == k and r["prompt"] in idx]
        s = aggregate([r for r in rows if r["config"] == k])
        out["configs"][k] = {
            "sampled_tokens_per_step": s["tokens_per_step"],
            "sampled_tokens_per_s": s["tokens_per_s"],
            "greedy_tokens_per_step": aggregate(g)["tokens_per_step"] if g else None,
        }
    return out


# -- tables, plot -----------------------------------------------------------------------------------------------------
def write_markdown(report: dict[str, Any], path: Path) -> str:
    L: list[str] = []
    proj = report.get("projection")
    L.append(
        f"# Acceptance on the real pair ({report['device']}): {report['target']} verifies, {report['draft']} drafts\n"
    )
    L.append(f"{report['what']}\n")
    L.append(f"Early stop of the trees' growth: {report['grow_cost']}.\n")
    nk = {k: sum(p["kind"] == k for p in report["prompts"]) for k in KINDS}
    fewer = "; ".join(f"budget {b} on prompts {v} only" for b, v in report["budget_prompts"].items())
    L.append(
        f"{nk['code']} code prompts (CPython stdlib sources) and {nk['prose']} prose prompts "
        f"(pydoc_data/topics.py), {report['new_tokens']} greedy tokens each"
        + (f"; {fewer} (their ratio to chain's best uses chain on the same prompts)" if fewer else "")
        + ".\n"
    )
    if proj:
        L.append(f"**Projection, not measured**: the last columns are {proj['what']}: {proj['how']}\n")
    for kind in KINDS:
        sec = report["greedy"].get(kind) or {}
        if "ar" not in sec:
            continue
        ar = sec["ar"]["tokens_per_s"]
        L.append(f"\n## {kind.capitalize()}\n")
        head = (
            "| method | prompts | tokens/step | draft passes/step | draft s/step | target s/step "
            "| tok/s (measured) | x AR |"
        )
        if proj:
            head += " projected tok/s on GPU (projection, not measured) | projected x AR |"
        L.append(head)
        L.append("|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if proj else ""))
        rows = [("ar", "AR")] + [(k, f"chain γ={k.split(':')[1]}") for k in sec if k.startswith("chain:")]
        rows += [(k, f"specexec {b}") for b, k in _spec_keys(sec)]
        for k, name in rows:
            s = sec[k]
            line = (
                f"| {name} | {s['prompts']} | {s['tokens_per_step']:.2f} | {s['draft_passes_per_step']:.1f} | "
                f"{s['draft_s_per_step']:.3f} | {s['target_s_per_step']:.3f} | {s['tokens_per_s']:.2f} | "
                f"{s['tokens_per_s'] / ar:.2f} |"
            )
            if proj:
                line += (
                    f" {s['projected_tok_s_gpu']:.2f} | "
                    f"{s['projected_tok_s_gpu'] / sec['ar']['projected_tok_s_gpu']:.2f} |"
                )
            L.append(line)
        ck, cb = _chain_best(sec)
        L.append(f"\nChain's best: {ck.replace('chain:', 'γ=')} at {cb:.2f} tokens/step.")
    L.append("\n## Tree shapes (specexec, greedy, every step of every prompt)\n")
    L.append(
        "| budget | steps | draft passes/step | draft tokens/step | tokens per pass (mean over the steps reaching it) |"
    )
    L.append("|---:|---:|---:|---:|---|")
    for b, s in sorted(report["tree_shapes"]["all"].items(), key=lambda kv: int(kv[0])):
        if s["steps"]:
            L.append(
                f"| {b} | {s['steps']} | {s['passes']:.1f} | {s['draft_tokens_per_step']:.0f} | "
                f"{' '.join(str(round(x)) for x in s['beams_per_pass'])} |"
            )
    L.append("\nPass 0 is the catch-up pass (the tokens the draft cache lacks, the root included).\n")
    smp = report.get("sampling") or {}
    if smp:
        L.append(f"\n## Sampling (temperature {smp['temperature']}, top-p {smp['top_p']}) next to greedy\n")
        L.append(f"Real engine on prompts {smp['prompts']}, {smp['tokens']} tokens each.\n")
        L.append("| config | greedy tokens/step | sampled tokens/step | sampled tok/s (measured) |")
        L.append("|---|---:|---:|---:|")
        for k, v in smp["configs"].items():
            gr = "n/a" if v["greedy_tokens_per_step"] is None else f"{v['greedy_tokens_per_step']:.2f}"
            L.append(f"| {k} | {gr} | {v['sampled_tokens_per_step']:.2f} | {v['sampled_tokens_per_s']:.2f} |")
    bad = report["checks"]["greedy_differs_from_ar"]
    L.append(f"\nExactness: greedy tokens equal AR's in every run: {'yes' if not bad else 'NO: ' + str(bad)}.")
    L.append("\n## Goals\n")
    for name, v in report["goals"].items():
        detail = ", ".join(f"{k}: {v[k]}" for k in v if k not in ("goal", "met"))
        verdict = "not measured" if v["met"] is None else "met" if v["met"] else "NOT met"
        L.append(f"- {name} {v['goal']}: **{verdict}** ({detail})")
    L.append(f"\nWall time: {report['wall_s'] / 60:.1f} min.")
    text = "\n".join(L) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return text


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"code": "tab:blue", "prose": "tab:orange"}
    xs: list[int] = []
    for kind in KINDS:
        sec = report["greedy"].get(kind) or {}
        sk = _spec_keys(sec)
        if not sk:
            continue
        xs = [b for b, _ in sk]
        a1.plot(xs, [sec[k]["tokens_per_step"] for _, k in sk], "o-", color=colors[kind], label=f"specexec, {kind}")
        a2.plot(xs, [sec[k]["tokens_per_s"] for _, k in sk], "o-", color=colors[kind], label=f"specexec, {kind}")
        ck, cb = _chain_best(sec)
        if ck != "none":
            a1.axhline(cb, ls="--", color=colors[kind], label=f"chain's best (γ={ck.split(':')[1]}), {kind}")
            ckt, cbt = _chain_best(sec, "tokens_per_s")
            a2.axhline(cbt, ls="--", color=colors[kind], label=f"fastest chain (γ={ckt.split(':')[1]}), {kind}")
        if "ar" in sec:
            a2.axhline(sec["ar"]["tokens_per_s"], ls=":", color=colors[kind], label=f"AR, {kind}")
    for a in (a1, a2):
        a.set_xscale("log", base=2)
        if xs:
            a.set_xticks(xs, [str(x) for x in xs])
        a.set_xlabel("tree budget (draft tokens per target step)")
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    a1.set_ylabel("tokens per target step")
    a1.set_title("greedy acceptance (real engine runs)")
    a2.set_ylabel("tokens/s (measured, prefill excluded)")
    a2.set_title(f"speed on this machine ({report['device']})")
    fig.suptitle(f"{report['target']} target, {report['draft']} draft, {report['new_tokens']} tokens per prompt")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main --------------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default=TARGET)
    p.add_argument("--draft", default=DRAFT)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--context", type=int, default=4096, help="engine context (sizes the caches, as the CLI's)")
    p.add_argument("--prompts", type=int, default=20, help="prompts in all, half code and half prose")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens generated per prompt and config")
    p.add_argument("--budgets", default=",".join(map(str, BUDGETS)), help="specexec tree budgets")
    p.add_argument("--gammas", default=",".join(map(str, GAMMAS)), help="chain draft lengths")
    p.add_argument(
        "--budget-prompts",
        default="512:4,1024:4",
        help="budget:prompts pairs: run those budgets on fewer prompts (the first, half code half prose)",
    )
    p.add_argument("--min-prompt-tokens", type=int, default=100)
    p.add_argument("--max-prompt-tokens", type=int, default=200)
    p.add_argument(
        "--grow-cost",
        default="engine",
        help="the trees' early stop: 'engine' (the engine's own policy; 'cpu' is an alias), 'off' (full "
        "growth to max_depth), or a bench_e2e JSON (weigh that GPU's measured costs)",
    )
    p.add_argument(
        "--project-gpu",
        default=None,
        help=f"a bench_e2e JSON: add projected_tok_s_gpu ({PROJECTION}) from the runs' recorded steps",
    )
    p.add_argument("--sampling-prompts", type=int, default=4, help="prompts for the sampled runs (0: skip)")
    p.add_argument("--sampling-budgets", default="16,64")
    p.add_argument("--sampling-gamma", type=int, default=4)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0, help="base seed of the sampled runs")
    p.add_argument(
        "--quick", action="store_true", help="4 prompts, 16 tokens, budgets 8,32,128, gammas 1..4; 2 sampled prompts"
    )
    p.add_argument("--out", default="docs/bench_acceptance.json")
    p.add_argument("--md", default="docs/bench_acceptance.md")
    p.add_argument("--png", default="docs/bench_acceptance.png")
    p.add_argument("--report-only", action="store_true", help="re-render --md/--png from --out and exit")
    a = p.parse_args(argv)
    if a.quick:
        a.prompts, a.new_tokens, a.budgets, a.gammas = 4, 16, "8,32,128", "1,2,3,4"
        a.budget_prompts, a.sampling_prompts = "128:2", 2
    ints = lambda v: [int(x) for x in str(v).split(",") if x]  # noqa: E731
    a.budgets, a.gammas, a.sampling_budgets = ints(a.budgets), ints(a.gammas), ints(a.sampling_budgets)
    a.budget_prompts = {int(b): int(n) for b, n in (x.split(":") for x in str(a.budget_prompts).split(",") if x)}
    a.grow_cost = "engine" if a.grow_cost == "cpu" else a.grow_cost
    a.grow_costs = None if a.grow_cost in ("engine", "off") else GpuCosts.load(a.grow_cost)
    if a.project_gpu is None and a.grow_costs is not None:
        a.project_gpu = a.grow_cost
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_only:
        report = json.loads(Path(args.out).read_text())
        print(write_markdown(report, Path(args.md)))
        plot(report, Path(args.png))
        return 0
    import torch

    from specexec import api

    wall0 = time.perf_counter()
    gpu = GpuCosts.load(args.project_gpu) if args.project_gpu else None
    engine = api.load(
        args.target, args.draft, device=args.device, dtype=args.dtype, context=args.context, progress=False
    )
    n_code = (args.prompts + 1) // 2
    prompts = make_prompts(
        engine.tokenizer.tokenizer, n_code, args.prompts - n_code, args.min_prompt_tokens, args.max_prompt_tokens
    )
    log(
        f"loaded in {time.perf_counter() - wall0:.0f} s; {len(prompts)} prompts "
        f"({', '.join(str(len(p.ids)) for p in prompts)} tokens)"
    )
    by_kind = {k: [i for i, p in enumerate(prompts) if p.kind == k] for k in KINDS}

    def subset(n: int) -> list[int]:
        return by_kind["code"][: (n + 1) // 2] + by_kind["prose"][: n // 2]

    budget_set = {
        b: set(subset(args.budget_prompts[b])) if b in args.budget_prompts else set(range(len(prompts)))
        for b in args.budgets
    }
    configs = [("ar", 0)] + [("chain", g) for g in args.gammas] + [("specexec", b) for b in args.budgets]
    grow_desc = {
        "engine": "the engine's own fixed-budget policy (on a CPU: early stop, costs measured as it runs)",
        "off": "off: every tree grows up to max_depth levels",
    }.get(args.grow_cost)
    grow_desc = grow_desc or f"weighs {args.grow_costs.describe()}"
    log(f"early stop: {grow_desc}")

    for m, v in configs[:1] + configs[1:2] + configs[-1:]:  # warm-up: first-call overheads out of the timings
        engine.reset()
        generate(engine, prompts[0].ids, 2, m, v, args)
    rows: list[dict[str, Any]] = []
    for i, p in enumerate(prompts):
        t0 = time.perf_counter()
        engine.reset()  # then the prompt's prefix is reused across its configs
        ar_tokens: list[int] | None = None
        for m, v in configs:
            if m == "specexec" and i not in budget_set[v]:
                continue
            r = generate(engine, p.ids, args.new_tokens, m, v, args)
            if m == "ar":
                ar_tokens = r.tokens
            rows.append(row_of(i, p, m, v, r, ar_tokens, gpu))
        tps = " ".join(
            f"{r['config'].replace('specexec:', 's').replace('chain:', 'c')}={r['stats']['tokens_per_step']:.1f}"
            for r in rows
            if r["prompt"] == i and r["method"] != "ar"
        )
        log(
            f"prompt {i + 1}/{len(prompts)} {p.kind} {p.source} ({len(p.ids)} tok): "
            f"{time.perf_counter() - t0:.0f} s; tokens/step {tps}"
        )
    greedy, shapes = summarise(rows, prompts)
    mismatch = [
        f"prompt {r['prompt']} {r['config']}: first difference at token {r['first_difference']}"
        for r in rows
        if not r["tokens_equal_ar"]
    ]

    sampling_res: dict[str, Any] = {}
    if args.sampling_prompts:
        t0 = time.perf_counter()
        sampling_res = run_sampling(engine, prompts, subset(args.sampling_prompts), rows, args)
        sampling_res["wall_s"] = time.perf_counter() - t0

    from specexec.config import TreeConfig

    tc = TreeConfig()
    report: dict[str, Any] = {
        "what": "real engine runs (Engine.generate, the library's decode loop), greedy unless stated; tokens/step "
        "and tok/s are measured (tok/s: new tokens / decode seconds, prefill excluded).",
        "target": args.target,
        "draft": args.draft,
        "device": str(engine.target.device),
        "new_tokens": args.new_tokens,
        "tree": asdict(tc),
        "grow_cost": grow_desc,
        "cap": f"max_depth {tc.max_depth} caps a step at {tc.max_depth + 1} tokens",
        "budget_prompts": {str(b): sorted(budget_set[b]) for b in args.budgets if len(budget_set[b]) < len(prompts)},
        "env": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "nice": os.nice(0),
            "loadavg_end": os.getloadavg(),
        },
        "prompts": [
            {
                "kind": p.kind,
                "source": p.source,
                "lines": list(p.lines),
                "prompt_tokens": len(p.ids),
                "text_head": p.text[:60],
            }
            for p in prompts
        ],
        "greedy": greedy,
        "tree_shapes": shapes,
        "runs": rows,
        "sampling": sampling_res,
        "checks": {"greedy_differs_from_ar": mismatch},
        "goals": goals(greedy),
    }
    if gpu is not None:
        report["projection"] = {
            "what": PROJECTION,
            "fields": ["projected_tok_s_gpu", "projected_s_gpu"],
            "costs": gpu.describe(),
            "how": "tokens / sum over the same real runs' recorded steps of the GPU's cost of that step (graphed "
            "draft pass per recorded pass + bookkeeping per level + NF4 70B-shaped verify for the tree size; "
            "AR: its streamed 1-token step). The acceptance is this pair's; the seconds are that GPU's.",
        }
    report["wall_s"] = time.perf_counter() - wall0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(write_markdown(report, Path(args.md)))
    plot(report, Path(args.png))
    log(f"wrote {args.out}, {args.md}, {args.png}; total {report['wall_s'] / 60:.1f} min")
    if mismatch:
        log("greedy tokens differ from AR's: " + "; ".join(mismatch))
    return 1 if mismatch else 0


if __name__ == "__main__":
    sys.exit(main())
