#!/usr/bin/env python
"""Draft precision against resident target layers under a VRAM cap (issue 16, item 2): the memory side, exactly.

For 70B-class targets streamed from pinned RAM (Llama-2-70B with a Llama-2-7B-shaped draft; Llama-3.1-70B with a
Llama-3.1-8B-shaped one; NF4 and bf16 target layers) under 24, 16 and 12 GB caps, the library's own memory plan
(:func:`offload.plan.make_plan`, charged with :func:`specexec.model.sizes.plan_reservations` as ``specexec.load`` does)
places the target's layers next to a draft kept in bf16, int8 or NF4 (:func:`specexec.model.sizes.model_weight_bytes`).

Per row: the draft's bytes, the target layers that stay resident, the bytes every target pass streams, and that
pass's floor at the measured H100 pinned bandwidth (55.1 GB/s, docs/GPU facts) and at a PCIe4 desktop's 25 GB/s.
``keep`` is the break-even: the fraction of the bf16 draft's tokens per step a lighter draft must keep to be
faster, when the step is the streamed pass (the draft hidden behind it, issue 16's goal): the ratio of the two
floors. Everything here is arithmetic over exact byte counts -- no timing, no GPU. The acceptance a lighter draft
actually keeps is measured elsewhere (``scripts/bench_self_draft.py``: on the CPU demo pair an int8 0.5B draft kept
0.88 of the fp32 draft's tokens per pass at budget 8); on a GPU it remains to be measured.

A second table (``--self-draft``) answers, with the same plan: does a **self-derived** draft -- the target's own
layers, all of them, resident in nf4 or the group-wise q4 / q3 / q2 (:mod:`specexec.formats.groupquant`), with its own
KV
cache of the target's shape -- fit beside the streamed target's globals, ring, KV caches and workspace, and how
many target layers stay resident? Llama-2-70B and Llama-3-70B and a Qwen2.5-32B shape at 24 GB, Llama-3-8B at 8 GB,
each against a separate NF4 draft of its family. Besides the plan's floors it gives each draft's HBM traffic per
draft pass: its weight bytes (the floor of a fused low-bit kernel) and, as implemented here (dequantize to 16 bits,
then one GEMM; no fused kernel), plus a 16-bit copy of every quantized weight written and read again.

    python scripts/plan_draft_tradeoff.py --out docs/plan_draft_tradeoff.json
    python scripts/plan_draft_tradeoff.py --self-draft --out docs/plan_self_draft.json
    python scripts/plan_draft_tradeoff.py --partial --out docs/plan_partial_self_draft.json

``--partial``: the same question for a *partial* self-derived draft (``--draft-layers``: a subset of the target's
layers, the rest skipped; :mod:`specexec.loading.layer_select`), NF4 target layers: per format, drafts keeping 3/4, 1/2,
3/8 and 1/4 of the layers, and the most layers that fit with no target layer resident and with half as many
resident as beside the separate NF4 draft.
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
    "llama3.2-1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_heads=32,
        num_kv_heads=8,
        num_layers=16,
        head_dim=64,
        tie_word_embeddings=True,
    ),
    "qwen2.5-32b": dict(
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=27648,
        num_heads=40,
        num_kv_heads=8,
        num_layers=64,
        qkv_bias=True,
    ),
    "qwen2.5-1.5b": dict(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_heads=12,
        num_kv_heads=2,
        num_layers=28,
        qkv_bias=True,
        tie_word_embeddings=True,
    ),
}
PAIRS = (("llama2-70b", "llama2-7b"), ("llama3-70b", "llama3-8b"))
DRAFT_FORMATS = ("bf16", "int8", "nf4")
CAPS = (24.0, 16.0, 12.0)


def config(name: str):
    from specexec.model.transformer import ModelConfig

    shape: dict[str, Any] = {"head_dim": 128, **SHAPES[name]}
    return ModelConfig(max_position_embeddings=8192, **shape)


def row(
    target: str,
    draft: str,
    target_fmt: str,
    draft_fmt: str,
    cap: float,
    context: int,
    budget: int,
    kept: int | None = None,
):
    """One placement: the plan's resident layers for this draft format under ``cap`` GB (None: does not fit).
    ``draft`` == ``target``: a self-derived draft (the target's shape, so its KV cache is the target's size);
    ``kept``: a partial one with that many of the target's layers (weights and KV cache shrink with them)."""
    from dataclasses import replace

    import torch

    from offload.plan import OffloadConfig, PlanModel, Resources, make_plan
    from specexec.config import TreeConfig
    from specexec.errors import OutOfMemory
    from specexec.model.sizes import model_weight_bytes, plan_reservations

    t_cfg, d_cfg = config(target), config(draft)
    if kept is not None:
        d_cfg = replace(d_cfg, num_layers=kept)
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
        "draft_layers": d_cfg.num_layers,
        "cap_gb": cap,
        "draft_gb": d_bytes / GB,
        "kv_and_buffers_gb": res.kv_bytes / GB,
    }
    try:
        plan = make_plan(machine, model, OffloadConfig(mode="ram", gpu_memory_gb=cap, target_dtype=target_fmt))
    except OutOfMemory as e:
        out.update(fits=False, why=str(e).split(":")[0])
        if e.need is not None and e.have is not None:
            out["short_gb"] = (e.need - e.have) / GB
        return out
    streamed = plan.bytes_per_forward
    out.update(
        fits=True,
        vram_left_gb=(plan.vram_budget - plan.vram_need) / GB if plan.vram_budget is not None else None,
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


SELF_CASES = (  # (target, cap GB, the separate draft to compare with)
    ("llama2-70b", 24.0, "llama2-7b"),
    ("llama3-70b", 24.0, "llama3-8b"),
    ("qwen2.5-32b", 24.0, "qwen2.5-1.5b"),
    ("llama3-8b", 8.0, "llama3.2-1b"),
)
SELF_FORMATS = ("nf4", "q4", "q3", "q2")


def quantized_params(name: str, layers: int | None = None) -> int:
    """Parameters a low-bit model of this shape (with ``layers`` of its layers) holds quantized: every layer's four
    linears and the lm_head."""
    from dataclasses import replace

    from specexec.model.sizes import layer_params

    cfg = config(name)
    if layers is not None:
        cfg = replace(cfg, num_layers=layers)
    d = cfg.hidden_size
    small = 2 * d + ((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim if cfg.qkv_bias else 0)
    return cfg.num_layers * (layer_params(cfg) - small) + cfg.vocab_size * d


def self_table(context: int, budget: int) -> list[dict[str, Any]]:
    """Per case and target layer format: the separate NF4 draft, then the self-derived draft in each format."""
    rows = []
    for target, cap, other in SELF_CASES:
        for target_fmt in ("nf4", "bf16"):
            group = [row(target, other, target_fmt, "nf4", cap, context, budget)]
            group += [row(target, target, target_fmt, f, cap, context, budget) for f in SELF_FORMATS]
            base = group[0] if group[0]["fits"] else None
            for r in group:
                r["self_derived"] = r["draft"] == target
                q = quantized_params(r["draft"], r["draft_layers"])
                r["draft_pass_gb_fused"] = r["draft_gb"]  # every weight byte read once
                r["draft_pass_gb_dequant"] = r["draft_gb"] + 4 * q / GB  # + a bf16 copy written, then read
                if r["fits"] and base is not None:
                    r["keep_vs_separate_nf4"] = r["floor_s_pcie4"] / base["floor_s_pcie4"]
            rows += group
    return rows


PARTIAL_FRACTIONS = (0.75, 0.5, 0.375, 0.25)


def most_layers(target: str, target_fmt: str, fmt: str, cap: float, context: int, budget: int, resident: int) -> int:
    """The most of the target's layers a partial self draft in ``fmt`` may keep with at least ``resident`` target
    layers still resident (0: none fits)."""
    lo, hi = 0, config(target).num_layers
    while lo < hi:  # fitting is monotone in the kept layers
        mid = (lo + hi + 1) // 2
        r = row(target, target, target_fmt, fmt, cap, context, budget, kept=mid)
        if r["fits"] and r["resident_layers"] >= resident:
            lo = mid
        else:
            hi = mid - 1
    return lo


def partial_table(context: int, budget: int) -> list[dict[str, Any]]:
    """Per case (NF4 target layers): the separate NF4 draft; then per format the partial self drafts keeping a
    fraction of the layers, and the most layers that fit with none / half the separate draft's resident layers."""
    rows = []
    for target, cap, other in SELF_CASES:
        base = row(target, other, "nf4", "nf4", cap, context, budget)
        base.update(self_derived=False, draft_pass_gb_fused=base["draft_gb"])
        base["draft_pass_gb_dequant"] = base["draft_gb"] + 4 * quantized_params(other) / GB
        rows.append(base)
        n = config(target).num_layers
        for fmt in ("q4", "q3", "q2"):
            counts = {round(f * n) for f in PARTIAL_FRACTIONS}
            if base["fits"]:
                for need in (0, base["resident_layers"] // 2):
                    counts.add(most_layers(target, "nf4", fmt, cap, context, budget, need))
            for k in sorted(counts, reverse=True):
                if k <= 0:
                    continue
                r = row(target, target, "nf4", fmt, cap, context, budget, kept=k)
                r["self_derived"] = True
                q = quantized_params(target, k)
                r["draft_pass_gb_fused"] = r["draft_gb"]
                r["draft_pass_gb_dequant"] = r["draft_gb"] + 4 * q / GB
                if r["fits"] and base["fits"]:
                    r["keep_vs_separate_nf4"] = r["floor_s_pcie4"] / base["floor_s_pcie4"]
                rows.append(r)
    return rows


def self_markdown(rows: list[dict[str, Any]], context: int, budget: int) -> str:
    lines = [
        f"Context {context} tokens, tree budget {budget}; target layers streamed from pinned RAM; bytes exact "
        "(the library's sizes and plan); times are floors (streamed bytes / bandwidth), not measurements.",
        "",
        "| target | layers | cap GB | draft | draft GB | draft KV+buffers GB | resident layers | streamed GB/pass "
        "| floor s @25 GB/s | break-even tokens/step (x separate nf4) | draft pass GB: fused / dequant |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = f"{r['draft']} {r['draft_format']}"
        if r["self_derived"]:
            name = f"self {r['draft_format']}"
            if r["draft_layers"] < config(r["target"]).num_layers:
                name += f", {r['draft_layers']} layers"
        head = f"| {r['target']} | {r['target_format']} | {r['cap_gb']:.0f} | {name} | {r['draft_gb']:.2f} | "
        head += f"{r['kv_and_buffers_gb']:.2f} | "
        tail = f" {r['draft_pass_gb_fused']:.1f} / {r['draft_pass_gb_dequant']:.1f} |"
        if not r["fits"]:
            short = f" (short {r['short_gb']:.1f} GB)" if "short_gb" in r else ""
            lines.append(head + f"does not fit{short} | - | - | - |" + tail)
            continue
        keep = r.get("keep_vs_separate_nf4")
        lines.append(
            head + f"{r['resident_layers']}/{r['layers']} | {r['streamed_gb_per_pass']:.1f} | "
            f"{r['floor_s_pcie4']:.3f} | " + (f"{keep:.3f} |" if keep is not None else "- |") + tail
        )
    return "\n".join(lines) + "\n"


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
    p.add_argument("--self-draft", action="store_true", help="the self-derived draft table (nf4, q4, q3, q2)")
    p.add_argument(
        "--partial", action="store_true", help="partial self-derived drafts (a subset of the layers; q4, q3, q2)"
    )
    args = p.parse_args(argv)
    if args.partial:
        rows = partial_table(args.context, args.budget)
        print(self_markdown(rows, args.context, args.budget))
    elif args.self_draft:
        rows = self_table(args.context, args.budget)
        print(self_markdown(rows, args.context, args.budget))
    else:
        rows = table(args.context, args.budget)
        print(markdown(rows, args.context, args.budget))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"context": args.context, "budget": args.budget, "h100_gbps": H100_GBPS, "pcie4_gbps": PCIE4_GBPS}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
