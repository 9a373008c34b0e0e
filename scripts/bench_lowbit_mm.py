#!/usr/bin/env python
"""A low-bit draft's linears, per kernel: the fused Triton GEMMs (specexec.formats.lowbit_mm) vs bitsandbytes vs 16-bit.

A draft pass multiplies a level's rows (16-256 on a GPU's trees) by every weight, so it is bound by the weights'
bytes. For each linear shape of a 7B- and an 8B-shaped draft (``--shapes``) and each row count (``--rows``) this
times one call of each kernel (``--kernels``: ``dense`` = ``F.linear`` on the 16-bit weight; ``int8-bnb``,
``int8-triton``, ``nf4-bnb``, ``nf4-triton``) as the draft runs it -- replayed from a CUDA graph of ``--calls``
back-to-back calls, so launch costs are not counted -- and reports microseconds a call, the weight bandwidth
achieved (weight bytes / time) and each kernel's time against 16-bit's. A "layer" row sums a decoder layer's four
linears (q/k/v, o, gate/up, down). ``--tiles`` adds the Triton kernels with other tiles.

    python scripts/bench_lowbit_mm.py --out bench_out/lowbit.json    # on a GPU (~1-2 min)
    python scripts/bench_lowbit_mm.py --smoke                        # tiny shapes on a CPU: logic only (interpreter)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

# (out, in) of a decoder layer's four linears and the lm_head
SHAPES: dict[str, dict[str, tuple[int, int]]] = {
    "7b": {"wqkv": (12288, 4096), "wo": (4096, 4096), "w13": (22016, 4096), "w2": (4096, 11008),
           "lm_head": (32000, 4096)},
    "8b": {"wqkv": (6144, 4096), "wo": (4096, 4096), "w13": (28672, 4096), "w2": (4096, 14336),
           "lm_head": (128256, 4096)},
    "tiny": {"wqkv": (96, 64), "wo": (64, 64), "w13": (320, 64), "w2": (64, 160), "lm_head": (512, 64)},
}  # fmt: skip
LAYER = ("wqkv", "wo", "w13", "w2")
KERNELS = ("dense", "int8-bnb", "int8-triton", "nf4-bnb", "nf4-triton")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="7b,8b", help="comma-separated: " + ", ".join(SHAPES))
    p.add_argument("--rows", default="1,16,32,64,128,256", help="rows a call (a draft level's width)")
    p.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated: " + ", ".join(KERNELS))
    p.add_argument("--calls", type=int, default=20, help="calls per timed graph replay")
    p.add_argument("--repeats", type=int, default=5, help="replays timed (the median is reported)")
    p.add_argument(
        "--tiles",
        default="",
        help="the Triton kernels again with other tiles, as extra kernels '<fmt>-triton:<tile>': ';'-separated "
        "BLOCK_O,BLOCK_T_MAX,BLOCK_K,WARPS,STAGES (specexec.formats.lowbit_mm.TILE)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreted): logic only")
    p.add_argument("--out", type=Path, default=Path("bench_out/lowbit_mm.json"))
    args = p.parse_args(argv)
    if args.smoke:
        args.shapes, args.rows, args.calls, args.repeats = "tiny", "1,16,33", 2, 1
    args.shape_list = [s.strip() for s in args.shapes.split(",") if s.strip()]
    args.kernel_list = [k.strip() for k in args.kernels.split(",") if k.strip()]
    try:
        args.row_list = [int(r) for r in args.rows.split(",") if r.strip()]
    except ValueError:
        p.error(f"--rows must be comma-separated integers, not {args.rows!r}")
    for name, given, known in (("shape", args.shape_list, SHAPES), ("kernel", args.kernel_list, KERNELS)):
        bad = [g for g in given if g not in known]
        if bad or not given:
            p.error(f"unknown {name}(s) {', '.join(map(repr, bad)) or '(none given)'}; known: {', '.join(known)}")
    try:
        args.tile_list = [tuple(int(v) for v in t.split(",")) for t in args.tiles.split(";") if t.strip()]
    except ValueError:
        p.error(f"--tiles must be ';'-separated lists of 5 integers, not {args.tiles!r}")
    if any(len(t) != 5 or min(t) < 1 for t in args.tile_list):
        p.error("--tiles: each tile is 5 positive integers BLOCK_O,BLOCK_T_MAX,BLOCK_K,WARPS,STAGES")
    args.kernel_list += [
        f"{k}:{'x'.join(map(str, t))}" for t in args.tile_list for k in args.kernel_list if k.endswith("-triton")
    ]
    if not args.row_list or min(args.row_list) < 1 or args.calls < 1 or args.repeats < 1:
        p.error("--rows, --calls and --repeats must be positive")
    return args


def _timer(fn, dev, calls: int, repeats: int) -> float:
    """Seconds a call: ``calls`` calls captured in one CUDA graph, replayed ``repeats`` times (median); on a CPU
    plain wall-clock calls."""
    import torch

    fn()  # compile / warm up outside any capture
    if dev.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(calls * repeats):
            fn()
        return (time.perf_counter() - t0) / (calls * repeats)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / calls)
    return sorted(times)[len(times) // 2]


def bench(args: argparse.Namespace, dev) -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F

    from specexec.formats import lowbit_mm
    from specexec.formats.int8 import Int8Linear
    from specexec.loading.checkpoint import quantize_weight

    default_tile = lowbit_mm.TILE
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    fmts = {k.split("-")[0] for k in args.kernel_list if k != "dense"}
    rows_out: list[dict[str, Any]] = []
    for shape in args.shape_list:
        for name, (n, k) in SHAPES[shape].items():
            torch.manual_seed(0)
            w = torch.randn(n, k, dtype=torch.float32) * 0.02
            dense = w.to(dev, dtype)
            low: dict[str, Any] = {}
            if "int8" in fmts:
                low["int8"] = Int8Linear(w).to(dev)
            if "nf4" in fmts:
                low["nf4"] = quantize_weight(w, "nf4", dev, dtype)
            for m in args.row_list:
                x = torch.randn(m, k, device=dev, dtype=dtype)
                rec: dict[str, Any] = {"shape": shape, "linear": name, "out": n, "in": k, "rows": m}
                for kern in args.kernel_list:
                    name_kern, _, tile = kern.partition(":")
                    if kern == "dense":
                        fn = lambda x=x, d=dense: F.linear(x, d)  # noqa: E731
                        nbytes = dense.numel() * dense.element_size()
                    else:
                        fmt, how = name_kern.split("-")
                        lin = low[fmt]
                        lin.kernel = how
                        fn = lambda x=x, lin=lin: lin.linear(x)  # noqa: E731
                        nbytes = lin.nbytes() if fmt == "int8" else lin.packed.numel() + lin.absmax.numel() * 4
                    lowbit_mm.TILE = tuple(int(v) for v in tile.split("x")) if tile else default_tile
                    sec = _timer(fn, dev, args.calls, args.repeats)
                    rec[f"{kern}_us"] = sec * 1e6
                    rec[f"{kern}_gbps"] = nbytes / sec / 1e9
                rows_out.append(rec)
    lowbit_mm.TILE = default_tile
    return rows_out


def layer_sums(rows: list[dict[str, Any]], kernels: list[str]) -> list[dict[str, Any]]:
    """A decoder layer's four linears summed, per shape and row count."""
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for m in dict.fromkeys(r["rows"] for r in rows):
            part = [r for r in rows if r["shape"] == shape and r["rows"] == m and r["linear"] in LAYER]
            if len(part) == len(LAYER):
                out.append({"shape": shape, "linear": "layer", "rows": m,
                            **{f"{k}_us": sum(r[f"{k}_us"] for r in part) for k in kernels}})  # fmt: skip
    return out


def table(rows: list[dict[str, Any]], kernels: list[str]) -> str:
    head = ["shape", "linear", "rows", *[f"{k} us" for k in kernels]]
    head += [f"{k} / 16-bit" for k in kernels if k != "dense" and "dense" in kernels]
    head += [f"{k} GB/s" for k in kernels if k != "dense"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["shape"], r["linear"], str(r["rows"]), *[f"{r[f'{k}_us']:.1f}" for k in kernels]]
        cells += [f"{r[f'{k}_us'] / r['dense_us']:.2f}" for k in kernels if k != "dense" and "dense" in kernels]
        cells += [f"{r[f'{k}_gbps']:.0f}" if f"{k}_gbps" in r else "" for k in kernels if k != "dense"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.smoke:
        dev = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("bench_lowbit_mm needs a CUDA GPU (or --smoke for a CPU logic check)", file=sys.stderr)
        return 1
    else:
        dev = torch.device("cuda")
    from specexec.formats import lowbit_mm

    if any("triton" in k for k in args.kernel_list) and not lowbit_mm.available():
        print("error: the triton kernel needs Triton (pip install triton)", file=sys.stderr)
        return 2
    rows = bench(args, dev)
    rows += layer_sums(rows, args.kernel_list)
    report = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "calls_per_graph": args.calls,
        "note": "one call's time from a replayed CUDA graph of back-to-back calls (launches not counted); "
        "GB/s = the weight's bytes / time",
        "rows": rows,
    }
    print(table(rows, args.kernel_list))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
