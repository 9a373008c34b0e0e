#!/usr/bin/env python
"""--budget auto against every fixed budget, end to end on the real demo pair (CPU by default).

Same prompts, same engine, one run: tokens/s of specexec at each fixed budget and with the automatic budget
(its one-time calibration reported separately and excluded, as a chat session pays it once). Reports auto's
tok/s as a ratio of the best fixed budget's (goal >= 0.9) and the budgets auto chose. Greedy, so every run's
tokens are also checked against the first fixed budget's (exactness for free).

    python scripts/bench_auto.py --out docs/bench_auto.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = [
    "def quicksort(arr):",
    'import os\n\ndef walk_files(root):\n    """Yield every file path under root."""\n',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "The French Revolution began in 1789 when",
    "A binary search tree is a data structure in which",
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--budgets", default="4,8,16,32,64,128")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--prompts", type=int, default=len(PROMPTS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, default=Path("docs/bench_auto.json"))
    a = p.parse_args(argv)

    import specexec
    from specexec.config import TreeConfig

    engine = specexec.load(
        a.target,
        a.draft,
        device=a.device,
        context=2048,
        progress=False,
        tree=TreeConfig(budget=64, auto=True, max_budget=1024),
    )
    prompts = PROMPTS[: a.prompts]
    configs = [("fixed", int(b)) for b in a.budgets.split(",")] + [("auto", None)]
    engine.generate(prompts[0], 4, tree=TreeConfig(budget=8))  # warm-up
    rows, ref = [], {}
    for kind, b in configs:
        tree = TreeConfig(budget=b) if kind == "fixed" else TreeConfig(budget=16, auto=True, max_budget=1024)
        toks, secs, steps, chosen, calib, same = 0, 0.0, 0, {}, 0.0, True
        for pr in prompts:
            engine.reset()
            r = engine.generate(pr, a.new_tokens, method="specexec", tree=tree)
            st = r.stats
            toks += st.new_tokens
            secs += st.wall_s - st.prefill_s
            steps += st.steps
            calib += st.calibration_s
            for k, v in st.budgets.items():
                chosen[k] = chosen.get(k, 0) + v
            if pr in ref:
                same &= ref[pr] == r.tokens
            else:
                ref[pr] = r.tokens
        row = {
            "config": kind if b is None else f"budget {b}",
            "tokens": toks,
            "decode_s": secs,
            "tokens_per_s": toks / secs,
            "tokens_per_step": toks / steps,
            "calibration_s": calib,
            "budgets_chosen": chosen if kind == "auto" else None,
            "same_tokens": same,
        }
        rows.append(row)
        print(
            f"{row['config']:>12}: {row['tokens_per_s']:.2f} tok/s, {row['tokens_per_step']:.2f} tok/step"
            + (f", chose {chosen}, calibration {calib:.1f}s" if kind == "auto" else ""),
            flush=True,
        )
    best = max((r for r in rows if r["config"] != "auto"), key=lambda r: r["tokens_per_s"])
    auto = rows[-1]
    ratio = auto["tokens_per_s"] / best["tokens_per_s"]
    print("\n| config | tok/s | tok/step | same tokens |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['tokens_per_s']:.2f} | {r['tokens_per_step']:.2f} | {r['same_tokens']} |")
    print(f"\nauto / best fixed ({best['config']}): {ratio:.2f} (goal >= 0.9: {'met' if ratio >= 0.9 else 'NOT met'})")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(
        json.dumps(
            {
                "rows": rows,
                "best_fixed": best["config"],
                "auto_over_best": ratio,
                "prompts": len(prompts),
                "new_tokens": a.new_tokens,
                "device": a.device,
                "time": time.strftime("%Y-%m-%d %H:%M"),
            },
            indent=1,
        )
    )
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
