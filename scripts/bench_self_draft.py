#!/usr/bin/env python
"""Acceptance of a self-derived draft (the target's own weights in int8) vs a separate small draft, in counts.

Loads the target once (fp32, CPU) and pairs it with each draft in turn: ``self`` (the target's checkpoint in int8:
:func:`specexec.api.load` with ``draft="self"``), the demo's 0.5B draft in fp32 and in int8. For every draft:
greedy SpecExec trees at fixed budgets (8 and 32 by default; no early stop, so tree sizes do not depend on
timings) and a chain of ``gamma`` tokens, over a few code and prose prompts. Reports accepted tokens per target
pass (tokens per step) and checks that every configuration's tokens equal the target's own greedy (AR) output.

Counts only: no timing is taken or reported (wall-clock on a shared machine says nothing). The real pair needs
~10 GB of RAM; run it under the team's lock::

    flock /tmp/realpair.lock python scripts/bench_self_draft.py --out bench_out/self_draft.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

PROMPTS = {
    "code": [
        "def quicksort(arr):",
        "class LRUCache:\n    def __init__(self, capacity):",
        'import json\n\n\ndef load_config(path):\n    """Read a JSON config file and',
    ],
    "prose": [
        "The history of the printing press begins",
        "Once upon a time, in a small village by the sea,",
        "Photosynthesis is the process by which plants",
    ],
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b", help="target alias or path")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b", help="the separate draft to compare with")
    p.add_argument("--budgets", default="8,32", help="fixed SpecExec tree budgets (comma-separated)")
    p.add_argument("--gamma", type=int, default=4, help="chain length")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=3, help="prompts per kind (code, prose), at most 3")
    p.add_argument("--drafts", default="self,fp32,int8", help="which drafts: self (int8 target), fp32, int8 (0.5B)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from specexec import api, hub
    from specexec.config import ChainConfig, TreeConfig
    from specexec.engine import Engine
    from specexec.loading import load_model, model_dir

    budgets = [int(b) for b in args.budgets.split(",")]
    prompts = [(kind, p) for kind, ps in PROMPTS.items() for p in ps[: args.num_prompts]]
    ctx = 1024
    # the target, with its self-derived int8 draft (the first configuration)
    engine = api.load(args.target, draft="self", device="cpu", dtype="fp32", context=ctx, progress=False)
    target, tok = engine.target, engine.tokenizer
    ids = [engine.encode(p) for _, p in prompts]
    ar = [engine.generate(x, args.max_new_tokens, method="ar").tokens for x in ids]
    report: dict[str, Any] = {
        "target": args.target,
        "note": "counts only (tokens per target pass); no timings",
        "max_new_tokens": args.max_new_tokens,
        "prompts": [{"kind": k, "prompt": p} for k, p in prompts],
        "configs": [],
    }
    d_path = model_dir(hub.resolve(args.draft, progress=False))
    for name in [d.strip() for d in args.drafts.split(",")]:
        if name != "self":
            del engine
            gc.collect()
            draft = load_model(d_path, torch.device("cpu"), torch.float32, int8=name == "int8")
            engine = Engine(target, tok, draft, context=ctx)
        label = "self (target in int8)" if name == "self" else f"{args.draft} {name}"
        methods: list[tuple[str, dict[str, Any]]] = [
            (f"specexec b={b}", dict(method="specexec", tree=TreeConfig(budget=b, early_stop=False))) for b in budgets
        ]
        methods.append((f"chain g={args.gamma}", dict(method="chain", chain=ChainConfig(gamma=args.gamma))))
        for mname, kw in methods:
            per_prompt: list[dict[str, Any]] = []
            for (kind, _), x, want in zip(prompts, ids, ar, strict=True):
                r = engine.generate(x, args.max_new_tokens, **kw)
                per_prompt.append(
                    {"kind": kind, "tokens": r.stats.new_tokens, "steps": r.stats.steps, "exact": r.tokens == want}
                )
            row: dict[str, Any] = {"draft": label, "method": mname, "per_prompt": per_prompt}
            for kind in ("code", "prose", "all"):
                sel = [q for q in per_prompt if kind in ("all", q["kind"])]
                row[f"tokens_per_step_{kind}"] = sum(q["tokens"] for q in sel) / max(1, sum(q["steps"] for q in sel))
            row["exact"] = all(q["exact"] for q in per_prompt)
            report["configs"].append(row)
            print(
                f"{label:28s} {mname:14s} code {row['tokens_per_step_code']:5.2f}  prose "
                f"{row['tokens_per_step_prose']:5.2f}  all {row['tokens_per_step_all']:5.2f}  "
                f"exact={row['exact']}",
                flush=True,
            )
    report["all_exact"] = all(c["exact"] for c in report["configs"])
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return 0 if report["all_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
