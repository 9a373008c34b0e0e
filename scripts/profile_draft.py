#!/usr/bin/env python
"""Profile one Llama-2-7B-shaped draft pass (CUDA): kernel time breakdown, eager and graphed totals.

    python scripts/profile_draft.py --tokens 16 --context 512
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--capacity", type=int, default=4864)
    a = p.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from scripts.bench_e2e import build_draft
    from specexec.draft import Drafter

    dev = torch.device("cuda")
    draft = build_draft(dev)
    k, ctx = a.tokens, a.context
    toks = torch.randint(0, 32000, (k,), device=dev)
    pos = torch.full((k,), ctx, device=dev)
    slots = torch.arange(ctx, ctx + k, device=dev)
    mask = torch.zeros(k, ctx + k, dtype=torch.bool, device=dev)
    mask[:, :ctx] = True
    mask[torch.arange(k, device=dev), slots] = True
    for static in (False, True):
        d = Drafter(draft, a.capacity, static=static, static_rows=128)
        for _ in range(3):
            d._forward(toks, pos, slots, mask)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            d._forward(toks, pos, slots, mask)
        torch.cuda.synchronize()
        print(f"static={static}: {(time.perf_counter() - t) / 10 * 1e3:.2f} ms per pass of {k} tokens")
    padded = Drafter(draft, a.capacity, static=True, static_rows=128)
    padded.static.use_graphs = False  # same static shapes, eager, so the profiler sees each kernel
    fn = lambda: padded._forward(toks, pos, slots, mask)  # noqa: E731
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
