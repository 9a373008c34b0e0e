"""CPU matmul orientation: ``F.linear(x, w)`` vs ``w @ x.T`` for the demo target's shapes, and what
``specexec.formats.dense.linear`` (which picks ``w @ x.T`` for 5..48 rows on a CPU) makes of a target pass.

Prints a markdown table and writes JSON. Ratios are from one run on one machine:

    python scripts/bench_cpu_matmul.py --out docs/bench_cpu_matmul.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# Qwen2.5-Coder-1.5B: fused qkv, fused gate/up, down, lm_head (out, in)
SHAPES = {"qkv": (2048, 1536), "gate_up": (17920, 1536), "down": (1536, 8960), "lm_head": (151936, 1536)}
ROWS = (1, 2, 4, 5, 9, 17, 33, 48, 64)


def best_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e3


def target_passes(target: str) -> list[dict]:
    """Seconds of one target pass (after a 100-token prefix) by tokens: F.linear everywhere vs model.linear."""
    from specexec import api
    from specexec.model import transformer as model_mod

    engine = api.load(target, None, device="cpu", dtype="fp32", context=512, progress=False)
    m, n = engine.target, 100
    cache = m.new_cache(512)
    pos = torch.arange(n)
    m.forward(torch.randint(0, 1000, (n,)), pos, pos, pos[None, :] <= pos[:, None], cache, logits_rows=slice(-1, None))
    ours = model_mod.linear

    def plain(x, w):
        return F.linear(x, w) if isinstance(w, torch.Tensor) else w.linear(x)

    out = []
    print("\n| tokens | F.linear s | model.linear s | ratio |\n|---:|---:|---:|---:|")
    for k in (1, 4, 9, 17, 33, 65):
        p = torch.arange(n, n + k)
        t = torch.randint(0, 1000, (k,))
        mask = torch.ones(k, n + k, dtype=torch.bool)
        mask[:, n:] = torch.tril(torch.ones(k, k, dtype=torch.bool))
        res = {}
        for label, fn in (("linear", plain), ("ours", ours)):
            model_mod.linear = fn
            try:
                res[label] = best_ms(lambda: m.forward(t, p, p, mask, cache), 1) / 1e3
            finally:
                model_mod.linear = ours
        out.append(
            {"tokens": k, "linear_s": res["linear"], "ours_s": res["ours"], "ratio": res["linear"] / res["ours"]}
        )
        print(f"| {k} | {res['linear']:.3f} | {res['ours']:.3f} | {res['linear'] / res['ours']:.2f} |", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench_out/bench_cpu_matmul.json"))
    ap.add_argument("--skip-lm-head", action="store_true", help="leave out the 0.9 GB lm_head shape")
    ap.add_argument(
        "--target",
        default="qwen2.5-coder-1.5b",
        help="also time whole target passes with both orientations ('none' to skip)",
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    rows_out = []
    print("| weight | rows | F.linear ms | w @ x.T ms | ratio |\n|---|---:|---:|---:|---:|")
    for name, (n, k) in SHAPES.items():
        if name == "lm_head" and args.skip_lm_head:
            continue
        w = torch.randn(n, k)
        reps = 3 if name == "lm_head" else 10
        for m in ROWS:
            x = torch.randn(m, k)
            a = best_ms(lambda: F.linear(x, w), reps)
            b = best_ms(lambda: torch.mm(w, x.T).T.contiguous(), reps)
            rows_out.append({"weight": name, "shape": [n, k], "rows": m, "linear_ms": a, "wxT_ms": b, "ratio": a / b})
            print(f"| {name} {n}x{k} | {m} | {a:.2f} | {b:.2f} | {a / b:.2f} |", flush=True)
        del w
    passes = target_passes(args.target) if args.target != "none" else []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows_out, "target_passes": passes},
            indent=1,
        )
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
