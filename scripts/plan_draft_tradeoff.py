#!/usr/bin/env python
"""Draft precision against resident target layers under a VRAM cap (issue 16, item 2): the memory side, exactly.

For 70B-class targets streamed from pinned RAM (Llama-2-70B with a Llama-2-7B-shaped draft; Llama-3.1-70B with a
Llama-3.1-8B-shaped one; NF4 and bf16 target layers) under 24, 16 and 12 GB caps, the library's own memory plan
(:func:`offload.plan.make_plan`, charged with :func:`specexec.sizes.plan_reservations` as ``specexec.load`` does)
places the target's layers next to a draft kept in bf16, int8 or NF4 (:func:`specexec.sizes.model_weight_bytes`).

Per row: the draft's bytes, the target layers that stay resident, the bytes every target pass streams, and that
pass's floor at the measured H100 pinned bandwidth (55.1 GB/s, docs/GPU facts) and at a PCIe4 desktop's 25 GB/s.
``keep`` is the break-even: the fraction of the bf16 draft's tokens per step a lighter draft must keep to be
faster, when the step is the streamed pass (the draft hidden behind it, issue 16's goal): the ratio of the two
floors. Everything here is arithmetic over exact byte counts -- no timing, no GPU. The acceptance a lighter draft
actually keeps is measured elsewhere (``scripts/bench_self_draft.py``: on the CPU demo pair an int8 0.5B draft kept
0.88 of the fp32 draft's tokens per pass at budget 8); on a GPU it remains to be measured.

    python scripts/plan_draft_tradeoff.py --out docs/plan_draft_tradeoff.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

GB = 1e9
H100_GBPS = 55.1  # pinned H2D measured on the lent H100 (PCIe Gen5 x16)
PCIE4_GBPS = 25.0
SHAPES = {
    "llama2-70b": dict(
        vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_heads=64, num_kv_heads=8, num_layers=80
    ),
    "llama2-7b": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_heads=32, num_kv_heads=32, num_layers=32
    ),
    "llama3-70b": dict(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_heads=64, num_kv_heads=8, num_layers=80
    ),
    "llama3-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8, num_layers=32
    ),
}
PAIRS = (("llama2-70b", "llama2-7b"), ("llama3-70b", "llama3-8b"))
DRAFT_FORMATS = ("bf16", "int8", "nf4")
CAPS = (24.0, 16.0, 12.0)


def config(name: str):
    from specexec.model import ModelConfig

    return ModelConfig(max_position_embeddings=8192, head_dim=128, **SHAPES[name])


def row(target: str, draft: str, target_fmt: str, draft_fmt: str, cap: float, context: int, budget: int):
    """One placement: the plan's resident layers for this draft format under ``cap`` GB (None: does not fit)."""
    import torch

    from offload.plan import OffloadConfig, PlanModel, Resources, make_plan
    from specexec.config import TreeConfig
    from specexec.errors import OutOfMemory
    from specexec.sizes import model_weight_bytes, plan_reservations

    t_cfg, d_cfg = config(target), config(draft)
    d_bytes = model_weight_bytes(d_cfg, "dense" if draft_fmt == "bf16" else draft_fmt, 2)
    tree = TreeConfig(budget=budget, max_budget=budget)
    res = plan_reservations(t_cfg, d_cfg, context, 2, 2, tree, draft_weights=d_bytes)
    machine = Resources(device="cuda", vram_free=int(cap * GB) + (1 << 30), ram_total=1 << 40, ram_available=1 << 40)
    model = PlanModel(
        t_cfg, torch.bfloat16, draft_bytes=res.draft_bytes, kv_bytes=res.kv_bytes, max_tokens=res.max_tokens
    )
    out: dict[str, Any] = {
        "target": target,
        "draft": draft,
        "target_format": target_fmt,
        "draft_format": draft_fmt,
        "cap_gb": cap,
        "draft_gb": d_bytes / GB,
        "kv_and_buffers_gb": res.kv_bytes / GB,
    }
    try:
        plan = make_plan(machine, model, OffloadConfig(mode="ram", gpu_memory_gb=cap, target_dtype=target_fmt))
    except OutOfMemory as e:
        out.update(fits=False, why=str(e).split(":")[0])
        return out
    streamed = plan.bytes_per_forward
    out.update(
        fits=True,
        resident_layers=len(plan.resident),
        layers=plan.num_layers,
        layer_gb=plan.layer_bytes / GB,
        streamed_gb_per_pass=streamed / GB,
        floor_s_h100=streamed / (H100_GBPS * GB),
        floor_s_pcie4=streamed / (PCIE4_GBPS * GB),
    )
    return out


def table(context: int, budget: int) -> list[dict[str, Any]]:
    rows = []
    for target, draft in PAIRS:
        for target_fmt in ("nf4", "bf16"):
            for cap in CAPS:
                group = [row(target, draft, target_fmt, f, cap, context, budget) for f in DRAFT_FORMATS]
                base = next((r for r in group if r["fits"] and r["draft_format"] == "bf16"), None)
                for r in group:
                    if r["fits"] and base is not None and base["floor_s_pcie4"] > 0:
                        r["keep_vs_bf16_draft"] = r["floor_s_pcie4"] / base["floor_s_pcie4"]
                rows += group
    return rows


def markdown(rows: list[dict[str, Any]], context: int, budget: int) -> str:
    lines = [
        f"Context {context} tokens, tree budget {budget}; target layers streamed from pinned RAM; bytes exact, "
        f"times are floors (streamed bytes / bandwidth), not measurements.",
        "",
        "| target | layers | cap GB | draft | draft GB | resident layers | streamed GB/pass | floor s @55.1 GB/s "
        "| floor s @25 GB/s | keep (vs bf16 draft) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['target']} | {r['target_format']} | {r['cap_gb']:.0f} | {r['draft']} {r['draft_format']} | "
        head += f"{r['draft_gb']:.2f} | "
        if not r["fits"]:
            lines.append(head + "does not fit | - | - | - | - |")
            continue
        keep = r.get("keep_vs_bf16_draft")
        lines.append(
            head + f"{r['resident_layers']}/{r['layers']} | {r['streamed_gb_per_pass']:.1f} | "
            f"{r['floor_s_h100']:.3f} | {r['floor_s_pcie4']:.3f} | "
            + (f"{keep:.3f} |" if keep is not None else "bf16 draft does not fit |")
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--budget", type=int, default=256, help="tree budget the KV room and buffers are sized for")
    p.add_argument("--out", type=Path, help="write the JSON here")
    args = p.parse_args(argv)
    rows = table(args.context, args.budget)
    print(markdown(rows, args.context, args.budget))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"context": args.context, "budget": args.budget, "h100_gbps": H100_GBPS, "pcie4_gbps": PCIE4_GBPS}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
