#!/usr/bin/env python
"""One draft pass, timed per weight format and draft shape: what a lighter or partial self-derived draft costs.

Issue 16 weighs draft precision against resident target layers (``scripts/plan_draft_tradeoff.py``: exact bytes)
and a partial self-derived draft (``--draft self --draft-layers``) against a separate one. Both plans need the
draft pass's *time* on the GPU, which no script measured for the group-wise formats (q4/q3/q2 dequantize to 16 bits
and then run one GEMM; no fused kernel) or for a 70B-shaped partial draft. This script builds each draft with
random weights (:func:`specexec.model.synthetic.resident_model`: every linear and the lm_head in the format, as the
loader quantizes them; a few distinct layers cycled, so memory stays small while every pass reads as many bytes as
the whole model would) and times ``Transformer.forward`` (eager, bf16 compute) over a ``--prefix``-token KV prefix
for 1, 64 and 128 rows: median of ``--repeats`` passes after a warm-up, each closed by a device sync.

Per row: ms per pass, the draft's weight bytes (:func:`specexec.model.sizes.model_weight_bytes`, the whole model's) and
those bytes / pass time (the weight bandwidth the pass achieved; a dequantizing pass also writes and reads a 16-bit
copy of each weight, which this figure does not count). Drafts (``--drafts``, comma-separated):

* ``7b-<fmt>``: a Llama-2-7B-shaped separate draft in bf16, int8, nf4, q4, q3 or q2;
* ``70b<N>-<fmt>``: a partial self-derived draft of a Llama-2-70B: N of its 80 layers in q4, q3, q2 or nf4.

    python scripts/bench_draft_pass.py --out bench_out/draft_pass.json            # on a GPU (~3 min on an H100)
    python scripts/bench_draft_pass.py --smoke                                     # tiny shapes on a CPU: logic only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

GB = 1e9
SHAPES: dict[str, dict[str, Any]] = {
    "7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_heads=32, num_kv_heads=32,
               head_dim=128, num_layers=32),
    "70b": dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_heads=64, num_kv_heads=8,
                head_dim=128, num_layers=80),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_heads=4, num_kv_heads=2, head_dim=16,
                 num_layers=4),
}  # fmt: skip
FORMATS = ("bf16", "int8", "nf4", "q4", "q3", "q2")
DEFAULT_DRAFTS = "7b-bf16,7b-int8,7b-nf4,7b-q4,7b-q3,7b-q2,70b20-q3,70b20-q4,70b33-q3,70b47-q3"
SMOKE_DRAFTS = "tiny-bf16,tiny-int8,tiny-q3,tiny2-q2"


def parse_draft(name: str) -> tuple[str, int | None, str]:
    """``7b-nf4`` -> ("7b", None, "nf4"); ``70b20-q3`` -> ("70b", 20, "q3"). A bad name raises ``ValueError``."""
    head, _, fmt = name.partition("-")
    shape = next((s for s in sorted(SHAPES, key=len, reverse=True) if head.startswith(s)), None)
    if shape is None or fmt not in FORMATS:
        raise ValueError(f"unknown draft {name!r}: <{'|'.join(SHAPES)}>[layers]-<{'|'.join(FORMATS)}>")
    rest = head[len(shape) :]
    layers = int(rest) if rest else None
    if layers is not None and not 1 <= layers <= SHAPES[shape]["num_layers"]:
        raise ValueError(f"{name!r}: {shape} has {SHAPES[shape]['num_layers']} layers")
    return shape, layers, fmt


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafts", default=None, help=f"comma-separated (default: {DEFAULT_DRAFTS})")
    p.add_argument("--rows", default="1,64,128", help="tokens per pass (a tree level's beams)")
    p.add_argument("--prefix", type=int, default=512, help="committed tokens in the draft's KV cache")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--distinct", type=int, default=2, help="distinct random layers (cycled; bytes read are the same)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the logic, times nothing)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    try:
        names = args.drafts or (SMOKE_DRAFTS if args.smoke else DEFAULT_DRAFTS)
        args.draft_list = [parse_draft(d.strip()) for d in names.split(",")]
    except ValueError as e:
        p.error(str(e))
    args.row_list = [int(r) for r in args.rows.split(",")]
    return args


def build(shape: str, layers: int | None, fmt: str, dev, dtype, distinct: int):
    import torch

    from specexec.model.synthetic import resident_model
    from specexec.model.transformer import Globals, ModelConfig

    cfg = ModelConfig(max_position_embeddings=8192, **{**SHAPES[shape], **({"num_layers": layers} if layers else {})})
    g = torch.Generator(device=dev).manual_seed(1)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g, dtype=dtype, device=dev) * 0.02
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g, dtype=dtype, device=dev) * 0.02
    glob = Globals(embed=embed, norm=torch.ones(cfg.hidden_size, dtype=dtype, device=dev), lm_head=head)
    model = resident_model(cfg, glob, dtype, dev, seed=2, distinct=distinct, fmt="dense" if fmt == "bf16" else fmt)
    return cfg, model


def time_pass(model, rows: int, prefix: int, repeats: int, dev) -> list[float]:
    import torch

    cache = model.new_cache(prefix + rows)
    tokens = torch.randint(0, model.cfg.vocab_size, (rows,), device=dev)
    slots = torch.arange(prefix, prefix + rows, device=dev)
    mask = torch.ones(rows, prefix + rows, dtype=torch.bool, device=dev)
    times = []
    for i in range(repeats + 1):  # the first is a warm-up
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        model.forward(tokens, slots, slots, mask, cache)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i:
            times.append(time.perf_counter() - t0)
    return times


def run(args: argparse.Namespace) -> dict[str, Any]:
    import gc

    import torch

    from specexec.model.sizes import model_weight_bytes

    dev = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "note": "eager draft passes, random weights, median seconds per pass; timings only on a GPU",
        "prefix": args.prefix,
        "runs": [],
    }
    for shape, layers, fmt in args.draft_list:
        cfg, model = build(shape, layers, fmt, dev, dtype, args.distinct)
        wbytes = model_weight_bytes(cfg, "dense" if fmt == "bf16" else fmt, dtype.itemsize)
        for rows in args.row_list:
            s = statistics.median(time_pass(model, rows, args.prefix, args.repeats, dev))
            r = {
                "draft": f"{shape}{layers or ''}-{fmt}",
                "shape": shape,
                "layers": cfg.num_layers,
                "format": fmt,
                "rows": rows,
                "weight_gb": wbytes / GB,
                "pass_s": s,
                "weight_gbps": wbytes / s / GB,
            }
            report["runs"].append(r)
            print(
                f"{r['draft']:12s} rows {rows:4d}: {s * 1e3:8.2f} ms/pass  weights {r['weight_gb']:6.2f} GB "
                f"-> {r['weight_gbps']:7.1f} GB/s",
                flush=True,
            )
        del model
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
