#!/usr/bin/env python
"""Prompt-lookup branches merged into a GPU-style draft tree: tokens per target pass with and without (counts).

On a GPU with a streamed target a verified token costs nearly nothing (the pass is copy-bound), and n-gram branches
cost no draft pass, so merging the prompt-lookup continuations into every draft tree is free where they do not
match and adds tokens where the text repeats (grounded edits, quoting, code). This measures how many, on the real
pair, with the trees a GPU grows: fixed budget, fixed-width levels (``grow="static"``: the same trees as ``ahead``),
no early stop (on a GPU it stops by GPU costs; counts here must not depend on this CPU's), at most ``--max-depth``
levels. For every prompt: our AR (the reference), the tree alone, the tree with the n-gram branches merged
(``Engine.generate(ngram=NGramConfig(max_nodes=...))``); both must reproduce AR's tokens exactly.

These are counts, not times (a CPU can't time a GPU's step): tokens per step and draft passes per step, per prompt
set (``code``, ``prose``, ``grounded``: scripts/bench_cpu.py's sets, built from this Python's stdlib). It may run
beside other work::

    python scripts/bench_ngram_merge.py --sets grounded,prose,code --prompts 5 --out docs/bench_ngram_merge_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "scripts"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--dtype", default="fp32", help="compute dtype (fp32: bf16's tree-vs-AR near-ties are common)")
    p.add_argument("--draft-dtype", default=None, help="the draft's format (default: the library's)")
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        help="the draft's lm_head vocabulary (0: full, as on a GPU; a CPU's default subset grows with the tokens it "
        "sees, so a later run of the same prompt would propose better than the first)",
    )
    p.add_argument("--sets", default="code,prose,grounded")
    p.add_argument("--prompts", type=int, default=6, help="prompts per set")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--budget", type=int, default=128, help="draft tokens per tree (fixed)")
    p.add_argument("--max-depth", type=int, default=10, help="most draft levels a tree")
    p.add_argument("--ngram-nodes", type=int, default=64, help="most n-gram nodes merged into a tree")
    p.add_argument(
        "--ngram-len", type=int, default=32, help="tokens taken from each earlier occurrence (32: a GPU's default)"
    )
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = p.parse_args(argv)
    args.set_list = tuple(s for s in args.sets.split(",") if s)
    bad = [s for s in args.set_list if s not in ("code", "prose", "grounded")]
    if bad or not args.set_list:
        p.error(f"--sets: a comma-separated subset of code,prose,grounded, not {args.sets!r}")
    for name in ("prompts", "new_tokens", "budget", "max_depth", "ngram_nodes", "ngram_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def tie_check(engine: Any, ids: list[int], want: list[int], got: list[int]) -> dict[str, Any]:
    """At the first token where ``got`` left AR's ``want``: the target's top-2 gap there (one pass over the common
    prefix) and whether it is within floating-point noise (scripts/bench_cpu.py's ``NEAR_TIE``)."""
    import torch
    from bench_cpu import NEAR_TIE

    i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b) if got[: len(want)] != want else len(want)
    m = engine.target
    prefix = ids + want[:i]
    pos = torch.arange(len(prefix))
    with torch.no_grad():
        logits = m.forward(
            torch.tensor(prefix), pos, pos, pos[None, :] <= pos[:, None], m.new_cache(len(prefix) + 1),
            logits_rows=slice(-1, None),
        )[0].float()  # fmt: skip
    top2 = torch.topk(logits.double(), 2).values
    gap = float(top2[0] - top2[1])
    return {"first_diff": i, "first_diff_gap": gap, "near_tie": gap < NEAR_TIE.get(str(m.dtype)[6:], 1e-3)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from bench_cpu import build_prompts

    from specexec import api
    from specexec.config import TreeConfig
    from specexec.propose.ngram import NGramConfig

    engine = api.load(
        args.target,
        args.draft,
        device="cpu",
        dtype=args.dtype,
        draft_vocab=args.draft_vocab,
        draft_dtype=args.draft_dtype,
        context=4096,
        progress=False,
    )
    tree = TreeConfig(budget=args.budget, grow="static", early_stop=False, max_depth=args.max_depth)
    merged = NGramConfig(max_nodes=args.ngram_nodes, max_len=args.ngram_len)
    rows: list[dict[str, Any]] = []
    built = build_prompts(args.set_list, args.prompts)
    for set_name in args.set_list:  # in the order asked
        for p in built.get(set_name, []):
            ids = engine.encode(p.text, chat=p.chat)
            engine.reset()
            want = engine.generate(ids, args.new_tokens, method="ar").tokens
            row: dict[str, Any] = {"set": set_name, "prompt": p.name, "prompt_tokens": len(ids)}
            for name, ngram in (("tree", None), ("tree+ngram", merged)):
                engine.reset()  # both prefill the prompt: the same draft and target state
                r = engine.generate(ids, args.new_tokens, method="specexec", tree=tree, ngram=ngram)
                s = r.stats
                row[name] = {
                    "tokens": len(r.tokens),
                    "steps": s.steps,
                    "tokens_per_step": s.tokens_per_step,
                    "draft_passes_per_step": s.draft_passes / max(s.steps, 1),
                    "ngram_tokens": s.ngram_tokens,
                    "exact": r.tokens == want,
                }
                if r.tokens != want:  # a bug, or a floating-point near-tie between a tree pass and AR's
                    row[name].update(tie_check(engine, ids, want, r.tokens))
            rows.append(row)
            a, b = row["tree"], row["tree+ngram"]
            ties = [f"{n}: near-tie {r['first_diff_gap']:.2g}" for n, r in row.items() if isinstance(r, dict)
                    and r.get("near_tie")]  # fmt: skip
            print(
                f"{set_name:8s} {p.name[:40]:40s} tok/step {a['tokens_per_step']:5.2f} -> {b['tokens_per_step']:5.2f}"
                f"  n-gram tokens {b['ngram_tokens']:3d}  exact {a['exact'] and b['exact']} {' '.join(ties)}",
                flush=True,
            )
    summary: dict[str, Any] = {}
    for set_name in args.set_list:
        rs = [r for r in rows if r["set"] == set_name]
        if not rs:
            continue
        out: dict[str, Any] = {"prompts": len(rs)}
        for name in ("tree", "tree+ngram"):
            toks, steps = sum(r[name]["tokens"] for r in rs), sum(r[name]["steps"] for r in rs)
            out[name] = {
                "tokens_per_step": toks / max(steps, 1),
                "draft_passes_per_step": statistics.mean(r[name]["draft_passes_per_step"] for r in rs),
                "exact": all(r[name]["exact"] for r in rs),
                "ngram_tokens": sum(r[name]["ngram_tokens"] for r in rs),
                "tokens": toks,
            }
        out["gain"] = out["tree+ngram"]["tokens_per_step"] / out["tree"]["tokens_per_step"]
        summary[set_name] = out
    print("\n| set | prompts | tok/step, tree | tok/step, tree + n-grams | gain | n-gram share | exact |")
    print("|---|---|---|---|---|---|---|")
    for set_name, s in summary.items():
        ex = s["tree"]["exact"] and s["tree+ngram"]["exact"]
        print(
            f"| {set_name} | {s['prompts']} | {s['tree']['tokens_per_step']:.2f} | "
            f"{s['tree+ngram']['tokens_per_step']:.2f} | {s['gain']:.2f}x | "
            f"{s['tree+ngram']['ngram_tokens'] / max(s['tree+ngram']['tokens'], 1):.0%} | {'yes' if ex else 'NO'} |"
        )
    report = {
        "what": "counts: tokens per target pass with and without n-gram branches merged into fixed-width trees",
        "target": args.target,
        "draft": args.draft,
        "draft_dtype": engine.draft_weights if hasattr(engine, "draft_weights") else args.draft_dtype,
        "budget": args.budget,
        "max_depth": args.max_depth,
        "ngram_nodes": args.ngram_nodes,
        "ngram_len": args.ngram_len,
        "new_tokens": args.new_tokens,
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "summary": summary,
        "rows": rows,
        "all_exact": all(r[n]["exact"] or r[n].get("near_tie") for r in rows for n in ("tree", "tree+ngram")),
        "near_ties": sum(bool(r[n].get("near_tie")) for r in rows for n in ("tree", "tree+ngram")),
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return report


def main(argv: list[str] | None = None) -> int:
    return 0 if run(parse_args(argv))["all_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
