#!/usr/bin/env python
"""Per-step CPU profile of our decode loop (issue 13, lever 1): where a step's time goes, per method.

For each method (default: ``ar, chain:4, specexec:8, specexec:32, ngram, default``; ``default`` is what
``specexec generate`` runs with no tuning flags) a few prompts (bench_cpu's code / prose / grounded sets, built
from the standard library) are generated greedily, and every step is split into

  draft fwd      the draft model's forward passes (passes/step x seconds/pass)
  target fwd     the target's forward pass over the tree (inside ``score_tree``)
  draft glue     the rest of proposing: tree growth bookkeeping (top-k, masks, pruning), the budget choice
                 and (CPU auto policy) trimming the proposal
  n-gram         prompt lookup: ``NGramDraft.propose/merge_into`` while proposing, ``NGramDraft.commit`` after
  verify glue    ``score_tree`` minus the target's forward (ancestry mask, positions)
  accept         the acceptance walk / speculative sampling (``accept``)
  commit         target KV compaction (``TargetState.commit``) + draft KV compaction (``DraftModel.commit``)
  other          the step's remainder: syncs, the EOS cut, proposer bookkeeping (step - the sum of the above)
  between steps  outside the step: yielding, detokenizing, the budget policy's update, stats

so ``step = draft fwd + target fwd + (everything else)`` and the gap between "passes x pass cost" and the measured
step is accounted for term by term. The step (``draft_s + target_s``) comes from the engine's own per-step hook
(``engine.stream(on_step=...)``); the terms come from timers wrapped around those library functions for the run
(restored afterwards; about a microsecond each per call). Greedy outputs of every method are checked against AR.

``--cprofile``: extra runs under cProfile, top 25 functions by cumulative time per method. ``--torch-profiler DIR``:
extra runs of ``--profile-steps`` steps per method under torch.profiler (phases labelled with record_function),
a Chrome trace per method in DIR and the top ops table. Both run after the timed runs and do not affect them.

    flock /tmp/realpair.lock python scripts/profile_cpu.py --out docs/profile_cpu.json --cprofile

``--smoke`` (with tiny models given by --target/--draft) checks the script's logic and measures nothing.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import platform
import pstats
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
METHODS = "ar,chain:4,specexec:8,specexec:32,ngram,default"
SETS = ("code", "prose", "grounded")
# timed library functions (inclusive seconds per step)
TIMED = (
    "draft_forward",
    "target_forward",
    "score_tree",
    "accept",
    "commit_target",
    "commit_draft",
    "ngram_propose",
    "ngram_commit",
)
# the reported split of a step, in ms per step (see the module docstring)
PARTS = (
    "draft_fwd",
    "target_fwd",
    "draft_glue",
    "ngram",
    "verify_glue",
    "accept",
    "commit_target",
    "commit_draft",
    "other",
)


# ---------------------------------------------------------------------------------------------- timers


class PhaseTimer:
    """Inclusive seconds spent in the library's step functions since the last :meth:`take` (a context manager
    that wraps them for its duration). Time spent in a prefill is dropped: each step's bucket holds that step's
    work only. ``ranges``: also mark each call as a torch.profiler range (record_function)."""

    def __init__(self, draft: Any, ranges: bool = False) -> None:
        self.draft, self.ranges = draft, ranges
        self.acc = dict.fromkeys(TIMED, 0.0)
        self._undo: list[tuple[Any, str, Any]] = []

    def take(self) -> dict[str, float]:
        out, self.acc = self.acc, dict.fromkeys(TIMED, 0.0)
        return out

    def _timed(self, label: str | Callable[[Any], str], fn: Callable) -> Callable:
        import torch

        acc = self

        def wrapper(*args: Any, **kw: Any) -> Any:
            name = label if isinstance(label, str) else label(args[0])
            t = time.perf_counter()
            try:
                if acc.ranges:
                    with torch.profiler.record_function(name):
                        return fn(*args, **kw)
                return fn(*args, **kw)
            finally:
                acc.acc[name] += time.perf_counter() - t

        return wrapper

    def _patch(self, owner: Any, attr: str, new: Callable) -> None:
        self._undo.append((owner, attr, owner.__dict__[attr]))
        setattr(owner, attr, new)

    def __enter__(self) -> PhaseTimer:
        from specexec.decoding import loop as decode
        from specexec.model.transformer import Transformer
        from specexec.propose.draft_model import DraftModel
        from specexec.propose.ngram import NGramDraft

        draft = self.draft
        forward = Transformer.forward
        self._patch(
            Transformer,
            "forward",
            self._timed(lambda m: "draft_forward" if m is draft else "target_forward", forward),
        )
        self._patch(decode, "score_tree", self._timed("score_tree", decode.score_tree))
        self._patch(decode, "accept", self._timed("accept", decode.accept))
        self._patch(decode.TargetState, "commit", self._timed("commit_target", decode.TargetState.commit))
        self._patch(DraftModel, "commit", self._timed("commit_draft", DraftModel.commit))
        self._patch(NGramDraft, "propose", self._timed("ngram_propose", NGramDraft.propose))
        self._patch(NGramDraft, "merge_into", self._timed("ngram_propose", NGramDraft.merge_into))
        self._patch(NGramDraft, "commit", self._timed("ngram_commit", NGramDraft.commit))
        from specexec.propose import ChainDraft, NoDraft, TreeDraft

        def then_drop(f: Any) -> Any:  # the prefills (the target's, then the proposer's begin) are no step's
            def g(*a: Any, **k: Any) -> Any:
                out = f(*a, **k)
                self.take()
                return out

            return g

        self._patch(decode.TargetState, "prefill", then_drop(decode.TargetState.prefill))
        for cls in (TreeDraft, ChainDraft, NGramDraft, NoDraft):
            self._patch(cls, "begin", then_drop(cls.begin))
        return self

    def __exit__(self, *exc: Any) -> None:
        while self._undo:
            owner, attr, old = self._undo.pop()
            setattr(owner, attr, old)


def split(step: dict[str, float]) -> dict[str, float]:
    """One step's record (``draft_s``, ``target_s`` and the TIMED seconds) → the PARTS, in seconds; they sum to
    ``draft_s + target_s`` exactly."""
    draft_side = step["draft_s"] - step["draft_forward"] - step["ngram_propose"]
    target_side = (
        step["target_s"]
        - step["score_tree"]
        - step["accept"]
        - step["commit_target"]
        - step["commit_draft"]
        - step["ngram_commit"]
    )
    return {
        "draft_fwd": step["draft_forward"],
        "target_fwd": step["target_forward"],
        "draft_glue": draft_side,
        "ngram": step["ngram_propose"] + step["ngram_commit"],
        "verify_glue": step["score_tree"] - step["target_forward"],
        "accept": step["accept"],
        "commit_target": step["commit_target"],
        "commit_draft": step["commit_draft"],
        "other": target_side,
    }


# ---------------------------------------------------------------------------------------------- methods


def parse_methods(spec: str) -> list[str]:
    out: list[str] = []
    for item in (m.strip() for m in spec.split(",")):
        if not item:
            continue
        name, _, param = item.partition(":")
        if name in ("ar", "ngram", "default") and not param:
            pass
        elif name == "chain" and param.isdigit() and int(param) >= 1:
            pass
        elif name == "specexec" and (param == "auto" or param.isdigit() and int(param) >= 1):
            pass
        else:
            raise SystemExit(f"error: --methods {item}: use ar, ngram, default, chain:G or specexec:N / specexec:auto")
        if item not in out:
            out.append(item)
    if not out:
        raise SystemExit("error: --methods is empty")
    return out


def method_kwargs(item: str, default_tree: Any) -> dict[str, Any]:
    """``engine.stream`` arguments of a method spec (trees as ``specexec generate`` builds them)."""
    from specexec.config import ChainConfig

    name, _, param = item.partition(":")
    if name == "default":
        return {"method": None, "tree": default_tree}
    if name == "chain":
        return {"method": "chain", "chain": ChainConfig(gamma=int(param))}
    if name == "specexec" and param != "auto":
        return {"method": "specexec", "tree": replace(default_tree, budget=int(param), auto=False)}
    return {"method": name, "tree": default_tree}


# ---------------------------------------------------------------------------------------------- running


class Profiler:
    def __init__(self, args: argparse.Namespace, methods: list[str]) -> None:
        from scripts.bench_cpu import default_tree
        from specexec import api

        self.args, self.methods = args, methods
        self.tree = default_tree()
        fixed = [int(m.split(":")[1]) for m in methods if m.startswith("specexec:") and m[9:].isdigit()]
        extra = {"draft_vocab": args.draft_vocab} if args.draft_vocab is not None else {}
        self.engine = api.load(
            args.target,
            args.draft,
            device="cpu",
            dtype=args.dtype,
            draft_dtype=args.draft_dtype,
            context=args.context,
            tree=default_tree(max([2048, *fixed])),  # room for every method's tree: no run reallocates
            progress=False,
            **extra,
        )
        self.tok = self.engine.tokenizer.tokenizer

    def encode(self, p: Any) -> list[int]:
        from specexec.decoding.text import encode_text, render_chat

        if p.chat and getattr(self.tok, "chat_template", None):
            return render_chat(self.tok, [{"role": "user", "content": p.text}])
        return encode_text(self.tok, p.text)

    def generate(self, item: str, ids: list[int], max_new: int, on_step: Callable | None = None) -> Any:
        self.engine.reset()  # cold caches: every method prefills the prompt
        g = self.engine.stream(ids, max_new, on_step=on_step, **method_kwargs(item, self.tree))
        for _ in g:
            pass
        assert g.result is not None
        return g.result

    def timed(self, item: str, ids: list[int], max_new: int) -> dict[str, Any]:
        """One generation with every step split (see :func:`split`)."""
        steps: list[dict[str, Any]] = []
        with PhaseTimer(self.engine.draft) as timer:

            def record(info: Any) -> None:
                steps.append(
                    {
                        "draft_s": info.draft_s,
                        "target_s": info.target_s,
                        "passes": info.passes,
                        "tree_size": info.tree_size,
                        "budget": info.budget,
                        "tokens": len(info.tokens),
                        **timer.take(),
                    }
                )

            r = self.generate(item, ids, max_new, record)
        s = r.stats
        return {
            "method": item,
            "prompt_tokens": len(ids),
            "tokens": list(r.tokens),
            "steps": steps,
            "decode_s": s.wall_s - s.prefill_s,
            "prefill_s": s.prefill_s,
            "stats_steps": s.steps,
        }

    def cprofile(self, item: str, prompts: list[list[int]], max_new: int, top: int = 25) -> str:
        prof = cProfile.Profile()
        for ids in prompts:
            prof.enable()
            self.generate(item, ids, max_new)
            prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top)
        return out.getvalue()

    def torch_profile(self, item: str, ids: list[int], max_new: int, steps: int, out_dir: Path) -> str:
        from torch.profiler import ProfilerActivity, profile

        out_dir.mkdir(parents=True, exist_ok=True)
        with PhaseTimer(self.engine.draft, ranges=True), profile(activities=[ProfilerActivity.CPU]) as prof:
            self.generate(item, ids, max_new, lambda info: info.index + 1 < steps)  # cancelled after ``steps``
        prof.export_chrome_trace(str(out_dir / f"{item.replace(':', '-')}.json"))
        return str(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


# ---------------------------------------------------------------------------------------------- summary


def summarize(runs: list[dict[str, Any]], item: str, ar_tokens: dict[int, list[int]] | None) -> dict[str, Any]:
    mine = [r for r in runs if r["method"] == item]
    steps = [s for r in mine for s in r["steps"]]
    n = max(len(steps), 1)
    parts = {k: 0.0 for k in PARTS}
    for s in steps:
        for k, v in split(s).items():
            parts[k] += v
    step_s = sum(s["draft_s"] + s["target_s"] for s in steps)
    decode_s = sum(r["decode_s"] for r in mine)
    tokens = sum(len(r["tokens"]) for r in mine)
    passes = sum(s["passes"] for s in steps)
    out: dict[str, Any] = {
        "runs": len(mine),
        "steps": len(steps),
        "tokens": tokens,
        "tokens_per_step": tokens / n,
        "decode_tok_s": tokens / decode_s if decode_s > 0 else 0.0,
        "step_ms": 1e3 * step_s / n,
        "parts_ms": {k: 1e3 * v / n for k, v in parts.items()},
        "between_steps_ms": 1e3 * (decode_s - step_s) / n,
        "draft_passes_per_step": passes / n,
        "draft_pass_ms": 1e3 * parts["draft_fwd"] / passes if passes else None,
        "target_pass_ms": 1e3 * parts["target_fwd"] / n,
        "mean_tree_size": sum(s["tree_size"] for s in steps) / n,
    }
    out["passes_x_cost_ms"] = out["parts_ms"]["draft_fwd"] + out["parts_ms"]["target_fwd"]
    out["gap_ms"] = out["step_ms"] - out["passes_x_cost_ms"]
    if ar_tokens is not None:
        out["mismatches_vs_ar"] = sum(r["tokens"] != ar_tokens[i] for i, r in enumerate(mine))
    return out


def table(summary: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    heads = [
        "method",
        "steps",
        "tok/step",
        "tok/s",
        "step ms",
        "draft fwd",
        "target fwd",
        "draft glue",
        "n-gram",
        "verify glue",
        "accept",
        "commit t+d",
        "other",
        "between",
    ]
    title = (
        f"Per-step CPU profile: {meta['target']} + {meta['draft']}, {meta['dtype']}, {meta['threads']} threads, "
        f"{meta['max_new_tokens']} new tokens x {meta['prompts']} prompts (ms per step)"
        + (" **SMOKE RUN (tiny models): the numbers mean nothing.**" if meta["smoke"] else "")
    )
    lines = [title, "", "| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for item, s in summary.items():
        p = s["parts_ms"]
        fwd = (
            f"{p['draft_fwd']:.2f} ({s['draft_passes_per_step']:.1f} x {s['draft_pass_ms']:.2f})"
            if s["draft_pass_ms"] is not None
            else "-"
        )
        cells = [
            item,
            str(s["steps"]),
            f"{s['tokens_per_step']:.2f}",
            f"{s['decode_tok_s']:.1f}",
            f"{s['step_ms']:.2f}",
            fwd,
            f"{p['target_fwd']:.2f}",
            f"{p['draft_glue']:.2f}",
            f"{p['ngram']:.2f}",
            f"{p['verify_glue']:.2f}",
            f"{p['accept']:.2f}",
            f"{p['commit_target']:.2f}+{p['commit_draft']:.2f}",
            f"{p['other']:.2f}",
            f"{s['between_steps_ms']:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "step = draft fwd + target fwd + draft glue + n-gram + verify glue + accept + commit + other; 'between' is "
        "per-step time outside the step (yield, detokenize, policy update). draft fwd: passes/step x ms/pass.",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=TARGET)
    p.add_argument("--draft", default=DRAFT)
    p.add_argument("--methods", default=METHODS, help=f"comma-separated (default {METHODS})")
    p.add_argument("--prompts-per-set", type=int, default=None, help="default 1 per set (code, prose, grounded)")
    p.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, from {', '.join(SETS)}")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 64 (8 with --smoke)")
    p.add_argument("--dtype", default="auto", help="the engine's dtype (auto: what generate uses)")
    p.add_argument("--draft-dtype", default=None, help="the draft's dtype (default: --dtype; int8 for int8 weights)")
    p.add_argument("--draft-vocab", type=int, default=None, help="FR-Spec draft head size (default: the library's)")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    p.add_argument("--cprofile", action="store_true", help="print the top 25 cumulative functions per method")
    p.add_argument("--torch-profiler", type=Path, default=None, metavar="DIR", help="write Chrome traces here")
    p.add_argument("--profile-steps", type=int, default=8, help="steps per method under --torch-profiler")
    p.add_argument("--smoke", action="store_true", help="logic check on tiny models (give --target/--draft)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    args = p.parse_args(argv)
    if args.smoke and (args.target == TARGET or args.draft == DRAFT):
        p.error("--smoke runs on tiny models: give --target and --draft")
    if args.prompts_per_set is None:
        args.prompts_per_set = 1
    if args.max_new_tokens is None:
        args.max_new_tokens = 8 if args.smoke else 64
    if args.prompts_per_set < 1 or args.max_new_tokens < 1 or args.profile_steps < 1:
        p.error("--prompts-per-set, --max-new-tokens and --profile-steps must be >= 1")
    sets = tuple(s.strip() for s in args.sets.split(",") if s.strip())
    bad = [s for s in sets if s not in SETS]
    if bad or not sets:
        p.error(f"--sets: unknown {', '.join(bad) or '(empty)'}; choose from {', '.join(SETS)}")
    args.sets = sets
    return args


def main(argv: list[str] | None = None) -> int:
    import torch

    from scripts.bench_cpu import build_prompts

    args = parse_args(argv)
    methods = parse_methods(args.methods)
    log = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    prompts = [p for ps in build_prompts(args.sets, args.prompts_per_set).values() for p in ps]
    log(f"loading {args.target} + {args.draft}")
    prof = Profiler(args, methods)
    ids = [prof.encode(p) for p in prompts]
    for item in methods:  # warm-up: allocations, lazy imports, the measured policy's first choices
        prof.generate(item, ids[0], 2 if args.smoke else 8)
    runs: list[dict[str, Any]] = []
    for i, p_ids in enumerate(ids):
        for item in methods:
            runs.append({"prompt": i, **prof.timed(item, p_ids, args.max_new_tokens)})
            log(f"prompt {i + 1}/{len(ids)} {item}: {len(runs[-1]['steps'])} steps")
    ar = {r["prompt"]: r["tokens"] for r in runs if r["method"] == "ar"} if "ar" in methods else None
    summary = {item: summarize(runs, item, ar) for item in methods}
    if args.cprofile:
        for item in methods:
            summary[item]["cprofile_top"] = prof.cprofile(item, ids, args.max_new_tokens)
    if args.torch_profiler is not None:
        for item in methods:
            summary[item]["torch_top"] = prof.torch_profile(
                item, ids[0], args.max_new_tokens, args.profile_steps, args.torch_profiler
            )
    engine = prof.engine
    meta = {
        "target": args.target,
        "draft": args.draft,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()} {platform.system()}",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": str(engine.target.dtype).replace("torch.", ""),
        "draft_dtype": str(engine.draft.dtype).replace("torch.", "") if engine.draft is not None else None,
        "draft_vocab": args.draft_vocab,
        "max_new_tokens": args.max_new_tokens,
        "prompts": len(ids),
        "prompt_names": [p.name for p in prompts],
        "methods": methods,
        "smoke": args.smoke,
    }
    print(table(summary, meta))
    for item in methods:
        for key, label in (("cprofile_top", "cProfile, top 25 by cumulative time"), ("torch_top", "torch.profiler")):
            if key in summary[item]:
                print(f"\n### {item}: {label}\n\n{summary[item][key]}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "methods": summary, "runs": runs}, indent=1) + "\n")
        log(f"wrote {args.out}")
    bad = sum(s.get("mismatches_vs_ar") or 0 for s in summary.values())
    if bad:
        print(f"error: {bad} greedy runs differ from AR (a bug)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
