#!/usr/bin/env python
"""Profile one Llama-2-7B-shaped draft pass (CUDA): kernel time breakdown, eager and graphed totals.

The pass is the library's own (``specexec.propose.DraftModel.forward``: eager, or padded static shapes replayed
as CUDA graphs), over a ``--context``-token prefix, on random weights. ``--smoke``: tiny shapes on the CPU (checks
the script, measures nothing meaningful).

    python scripts/profile_draft.py --tokens 16 --context 512
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--capacity", type=int, default=4864)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script's logic")
    a = p.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from scripts import bench_e2e
    from specexec.propose import DraftModel

    if a.smoke:
        bench_e2e._shrink()
        dev = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("error: profile_draft needs a CUDA GPU (or --smoke for a CPU logic check)", file=sys.stderr)
        return 1
    else:
        dev = torch.device("cuda")
    if a.context + a.tokens >= a.capacity:
        print(f"error: --context + --tokens must be below --capacity ({a.capacity})", file=sys.stderr)
        return 1
    draft = bench_e2e.build_draft(dev)
    k, ctx = a.tokens, a.context
    toks = torch.randint(0, draft.cfg.vocab_size, (k,), device=dev)
    pos = torch.full((k,), ctx, device=dev)
    slots = torch.arange(ctx, ctx + k, device=dev)
    mask = torch.zeros(k, ctx + k, dtype=torch.bool, device=dev)
    mask[:, :ctx] = True
    mask[torch.arange(k, device=dev), slots] = True
    for static in (False, True):
        d = DraftModel(draft, a.capacity, static=static, static_rows=128)
        for _ in range(3):
            d.forward(toks, pos, slots, mask)
        bench_e2e._sync()
        t = time.perf_counter()
        for _ in range(a.repeats):
            d.forward(toks, pos, slots, mask)
        bench_e2e._sync()
        print(f"static={static}: {(time.perf_counter() - t) / a.repeats * 1e3:.2f} ms per pass of {k} tokens")
    padded = DraftModel(draft, a.capacity, static=True, static_rows=128)
    assert padded.static is not None
    padded.static.use_graphs = False  # same static shapes, eager, so the profiler sees each kernel
    fn = lambda: padded.forward(toks, pos, slots, mask)  # noqa: E731
    fn()
    bench_e2e._sync()
    activity = ProfilerActivity.CUDA if dev.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        fn()
        bench_e2e._sync()
    sort = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=14))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
