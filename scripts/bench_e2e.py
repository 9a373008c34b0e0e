#!/usr/bin/env python
"""End-to-end speed at 70B scale (needs a CUDA GPU): SpecExec vs offloaded autoregressive decoding.

No 70B weights exist here, so a Llama-2-70B-shaped target and a Llama-2-7B-shaped draft are built from random
weights (time does not depend on the values) and acceptance — tokens per step and the shape of the draft trees —
comes from the real Qwen2.5-Coder pair (``scripts/bench_acceptance.py`` writes both into its JSON).

Per format (NF4, bf16) the target streams from pinned RAM under a ``--gpu-memory`` cap (default 24 GB) with the
automatic resident-layer plan (the draft, the KV caches, the ring and the workspace are charged first), and the
draft is resident in bf16. Host RAM holds a few distinct random layers that the streamed layers cycle through:
the PCIe traffic is the same as for 80 distinct layers.

Per budget, measured in this run:
  * draft pass seconds by tokens per pass (the library's ``DraftModel.forward``: static/CUDA-graphed passes) and
    the tree bookkeeping per level (one real ``TreeDraft.grow`` minus its passes replayed at the same sizes);
    the draft tree time of a step is the recorded real-pair tree shape at this budget (draft passes x tokens per
    pass) costed with those pass times plus the bookkeeping;
  * target verify time: one ``Transformer.forward`` over budget+1 tree tokens with the tree streamed;
  * AR step time: the same streamed target at 1 token.
From these, a PROJECTION (no decode loop runs here; the fields are named ``projected_*`` and the JSON says
"projection from replayed step costs, not measured"): projected tok/s = tokens per step / (draft + verify),
its ratio to our offloaded AR, and the same on a PCIe4 desktop (each streamed pass at least streamed bytes /
25 GB/s). Measured end-to-end speed comes from a real engine run (``specexec bench``), never from this script.

    python scripts/bench_e2e.py --acceptance docs/bench_acceptance.json --out bench_out/e2e.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

GB = 1e9
LLAMA2_70B = dict(
    vocab_size=32000,
    hidden_size=8192,
    intermediate_size=28672,
    num_heads=64,
    num_kv_heads=8,
    head_dim=128,
    num_layers=80,
)
LLAMA2_7B = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_heads=32,
    num_kv_heads=32,
    head_dim=128,
    num_layers=32,
)
BUDGETS = (64, 128, 256, 512, 1024, 2048)
PCIE4_GBPS = 25.0
# Fallback acceptance (real pair, code, greedy) if no bench_acceptance JSON is given: tokens/step and tree shape.
PROJECTION_NOTE = (
    "projection from replayed step costs, not measured: projected_* = tokens/step from the acceptance "
    "source / (draft_s + verify_s); draft_s replays the recorded tree shape through draft passes "
    "timed here; verify_s and ar_step_s are measured here"
)
LEGACY_COMPOSED = ("tokens_per_s", "speedup_vs_ar", "pcie4_tokens_per_s", "pcie4_ar_tokens_per_s")  # older JSONs
FALLBACK = {
    b: {"tokens_per_step": t, "passes": p}
    for b, t, p in ((64, 5.0, 12), (128, 5.8, 14), (256, 6.5, 16), (512, 7.0, 18), (1024, 7.5, 20), (2048, 7.9, 22))
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--acceptance",
        type=Path,
        default=Path("docs/bench_acceptance.json"),
        help="bench_acceptance.py JSON (tokens/step and tree shapes per budget)",
    )
    p.add_argument("--domain", default="code", help="which acceptance domain to use (code, prose)")
    p.add_argument("--formats", default="nf4,bf16")
    p.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    p.add_argument("--gpu-memory", type=float, default=24.0, help="VRAM cap in GB (a consumer card)")
    p.add_argument("--context", type=int, default=512, help="prefix tokens already in the KV caches")
    p.add_argument("--host-layers", type=int, default=6, help="distinct random layers in pinned RAM")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--no-graphs", action="store_true", help="eager draft passes (for the before/after)")
    p.add_argument(
        "--draft-dtype",
        choices=("bf16", "int8", "nf4"),
        default="bf16",
        help="the 7B draft's weights: bf16, or int8 / nf4 through bitsandbytes (frees VRAM for target layers)",
    )
    p.add_argument("--out", type=Path, default=Path("bench_out/e2e.json"))
    p.add_argument(
        "--recompute",
        type=Path,
        default=None,
        help="no GPU: redo tokens/s from a previous run's JSON (its measured times) with --acceptance",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes on the CPU: checks the script's logic, measures nothing meaningful",
    )
    return p.parse_args(argv)


def load_acceptance(path: Path, domain: str, budgets: list[int]) -> tuple[dict[int, dict[str, Any]], str]:
    """Per budget: tokens_per_step, passes and beams_per_pass from bench_acceptance's JSON (else FALLBACK)."""
    if not path.is_file():
        return {b: dict(FALLBACK.get(b, FALLBACK[2048])) for b in budgets}, "fallback (no acceptance JSON)"
    d = json.loads(path.read_text())
    out = {}
    shapes = d.get("tree_shapes", {})
    shapes = shapes.get(domain, shapes)
    greedy = d.get("greedy", {}).get(domain, {})  # bench_acceptance: {"specexec:64": {"tokens_per_step": ...}}
    tps = {k.split(":")[1]: v["tokens_per_step"] for k, v in greedy.items() if k.startswith("specexec:")}
    for b in budgets:
        s = shapes.get(str(b)) or {}
        out[b] = {
            "tokens_per_step": tps.get(str(b), FALLBACK.get(b, FALLBACK[2048])["tokens_per_step"]),
            "passes": s.get("passes", FALLBACK.get(b, FALLBACK[2048])["passes"]),
            "beams_per_pass": s.get("beams_per_pass"),
        }
    return out, str(path)


def _cfg(shape: dict[str, int], layers: int | None = None):
    from specexec.model.transformer import ModelConfig

    kw = dict(shape)
    if layers is not None:
        kw["num_layers"] = layers
    return ModelConfig(max_position_embeddings=8192, **kw)


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(fn, repeats: int) -> float:
    fn()
    _sync()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync()
    return (time.perf_counter() - t) / repeats


def build_draft(dev, fmt: str = "dense") -> Any:
    """A Llama-2-7B-shaped draft computing in bf16, resident, random weights made on the device. ``fmt``
    int8 / nf4: its linears and lm_head quantized as ``--draft-dtype int8|nf4`` loads them
    (:func:`specexec.loading.checkpoint.quantize_weight`, layer by layer, so the bf16 copy never exists whole)."""
    import torch

    from specexec.loading.checkpoint import quantize_weight
    from specexec.model.transformer import Globals, ResidentLayers, Transformer

    cfg = _cfg(LLAMA2_7B)
    g = torch.Generator(device=dev).manual_seed(0)
    D, I = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim

    def rnd(*s):
        return torch.randn(*s, generator=g, dtype=torch.bfloat16, device=dev) * 0.02

    def lin(*s):
        w = rnd(*s)
        return w if fmt == "dense" else quantize_weight(w, fmt, dev, torch.bfloat16)

    layers = [
        {
            "attn_norm": torch.ones(D, dtype=torch.bfloat16, device=dev),
            "wqkv": lin(qkv, D),
            "wo": lin(D, cfg.num_heads * cfg.head_dim),
            "mlp_norm": torch.ones(D, dtype=torch.bfloat16, device=dev),
            "w13": lin(2 * I, D),
            "w2": lin(D, I),
        }
        for _ in range(cfg.num_layers)
    ]
    embed = rnd(cfg.vocab_size, D)
    glob = Globals(embed=embed, norm=torch.ones(D, dtype=torch.bfloat16, device=dev), lm_head=lin(cfg.vocab_size, D))
    return Transformer(cfg=cfg, globals=glob, layers=ResidentLayers(layers), device=dev, dtype=torch.bfloat16)


def build_target(
    fmt: str, dev, gpu_memory_gb: float, draft_bytes: int, kv_bytes: int, host_layers: int, max_tokens: int, h2d: float
) -> tuple[Any, Any, dict[str, Any]]:
    """A Llama-2-70B-shaped streamed target placed by the real memory plan under the VRAM cap."""
    import torch

    from offload.layout import LayerFormat, layer_layout, layer_shapes
    from offload.packing import quantize_layer
    from offload.plan import OffloadConfig, PlanModel, Resources, globals_bytes, make_plan, workspace_bytes
    from offload.store import HostBuffer, RamStore
    from offload.streamer import StreamedLayers
    from specexec.model.transformer import Globals, Transformer

    bf16 = torch.bfloat16
    cfg = _cfg(LLAMA2_70B)
    lfmt = LayerFormat("dense" if fmt == "bf16" else "nf4", bf16)
    layout = layer_layout(cfg, lfmt)
    # the plan: charge the draft + KV first; RAM is checked by the plan for all 80 layers, which this machine may
    # not hold in bf16 (137 GB) — then compute the same resident count directly from the VRAM budget.
    try:
        off = OffloadConfig(mode="ram", gpu_memory_gb=gpu_memory_gb, target_dtype=fmt)
        plan = make_plan(
            Resources.probe(dev, None, h2d),
            PlanModel(cfg, bf16, draft_bytes=draft_bytes, kv_bytes=kv_bytes, max_tokens=max_tokens),
            off,
        )
        resident = len(plan.resident)
        plan_text = plan.describe()
    except Exception as e:  # noqa: BLE001 - report and fall back to the same arithmetic
        ring = 2 * layout.nbytes
        fixed = globals_bytes(cfg, bf16) + workspace_bytes(cfg, lfmt, dev, max_tokens) + ring + draft_bytes + kv_bytes
        resident = max(0, int((gpu_memory_gb * GB - fixed) // layout.nbytes))
        plan_text = f"plan refused ({e}); resident layers from the VRAM budget: {resident}"
    resident = min(resident, cfg.num_layers)
    g = torch.Generator(device=dev).manual_seed(1)
    dense = {
        n: (
            torch.ones(s, dtype=bf16, device=dev)
            if n.endswith("norm")
            else torch.randn(s, generator=g, dtype=bf16, device=dev) * 0.02
        )
        for n, s in layer_shapes(cfg).items()
    }
    tensors = quantize_layer(dense, layout, dev) if fmt == "nf4" else dense
    template = torch.empty(layout.nbytes, dtype=torch.uint8, device=dev)
    layout.pack(tensors, template)
    del dense, tensors
    res = {i: template.clone() for i in range(resident)}
    host = []
    for _ in range(min(host_layers, cfg.num_layers - resident)):
        hb = HostBuffer(layout.nbytes, pin=dev.type == "cuda")
        hb.tensor.copy_(template.cpu())
        host.append(hb)
    store = (
        RamStore(layout, {i: host[i % len(host)] for i in range(resident, cfg.num_layers)}, cuda=dev.type == "cuda")
        if host
        else None
    )
    streamer = StreamedLayers(layout, cfg.num_layers, dev, res, store, lookahead=1)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g, dtype=bf16, device=dev) * 0.02
    glob = Globals(embed=embed, norm=torch.ones(cfg.hidden_size, dtype=bf16, device=dev), lm_head=embed.clone())
    model = Transformer(cfg=cfg, globals=glob, layers=streamer, device=dev, dtype=bf16)
    info = {
        "resident_layers": resident,
        "streamed_layers": cfg.num_layers - resident,
        "layer_gb": layout.nbytes / GB,
        "streamed_gb_per_pass": (cfg.num_layers - resident) * layout.nbytes / GB,
        "plan": plan_text,
    }
    return model, host, info


def tree_inputs(T: int, ctx: int, dev):
    """A random tree of T tokens below a ctx-token prefix (a chain-ish ancestry: a valid tree mask)."""
    import torch

    parents = torch.randint(0, max(T, 1), (T,), device=dev)
    parents = torch.minimum(parents, torch.arange(T, device=dev) - 1).clamp(min=-1)
    anc = torch.eye(T, dtype=torch.bool, device=dev)
    cur = parents.clone()
    for _ in range(8):  # a few ancestry levels are enough for timing
        ok = cur >= 0
        anc[torch.arange(T, device=dev)[ok], cur[ok]] = True
        cur = torch.where(ok, parents[cur.clamp(min=0)], cur)
    mask = torch.zeros(T, ctx + T, dtype=torch.bool, device=dev)
    mask[:, :ctx] = True
    mask[:, ctx:] = anc
    toks = torch.randint(0, LLAMA2_70B["vocab_size"], (T,), device=dev)
    pos = ctx + torch.arange(T, device=dev) // 4
    slots = ctx + torch.arange(T, device=dev)
    return toks, pos, slots, mask


BEAM_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


def time_draft_passes(draft, ctx: int, capacity: int, repeats: int, graphs: bool) -> dict[int, float]:
    """Seconds of one draft pass by tokens in the pass (graphed static passes, or eager), over a ctx prefix."""
    import torch

    from specexec.propose import DraftModel

    dev = draft.device
    dm = DraftModel(draft, capacity, static=graphs, static_rows=128)
    out = {}
    for k in BEAM_SIZES:
        used = ctx + 64  # a prefix plus some tree already in the cache
        toks = torch.randint(0, draft.cfg.vocab_size, (k,), device=dev)
        pos = torch.full((k,), ctx + 8, device=dev)
        slots = torch.arange(used, used + k, device=dev)
        mask = torch.zeros(k, used + k, dtype=torch.bool, device=dev)
        mask[:, :ctx] = True
        mask[torch.arange(k, device=dev), slots] = True
        out[k] = _time(lambda: dm.forward(toks, pos, slots, mask), repeats)
    return out


def time_bookkeeping(draft, budget: int, ctx: int, levels: int, grow: str = "dynamic") -> float:
    """Seconds per growth level spent outside the draft passes (top-k, pruning, masks, host syncs).

    One real ``TreeDraft.grow`` (the library's tree growth, full depth: no early stop) on the random draft, minus
    its own passes replayed at the same sizes.
    """
    return time_growth(draft, budget, ctx, levels, grow)["bookkeeping_s_per_level"]


def time_growth(draft, budget: int, ctx: int, levels: int, grow: str = "dynamic") -> dict[str, Any]:
    """One real ``TreeDraft.grow`` in growth mode ``grow`` (TreeConfig.grow), end to end: its seconds, passes and
    tokens per pass, and the seconds per level outside its passes (the same passes replayed)."""
    import torch

    from specexec.config import TreeConfig
    from specexec.propose import DraftModel, TreeDraft

    dev = draft.device
    dm = DraftModel(draft, ctx + 2 * budget + 256, static=dev.type == "cuda", static_rows=128)
    seq = torch.randint(0, draft.cfg.vocab_size, (ctx + 1,)).tolist()
    dm.prefill(seq)
    cfg = TreeConfig(budget=budget, max_beams=128, max_branch=32, max_depth=max(2, levels), early_stop=False, grow=grow)
    grower = TreeDraft(dm, cfg)
    grower.grow(seq, cfg)  # warm-up (graph capture); the committed prefix stays cached, the tree is discarded
    _sync()
    t0 = time.perf_counter()
    _, _, beams, _ = grower.grow(seq, cfg)
    _sync()
    t_grow = time.perf_counter() - t0

    def replay():
        used = ctx + 1
        for i, k in enumerate(beams):
            k = 128 if grow != "dynamic" and i > 0 else max(1, min(k, 128))  # fixed-width levels: all rows run
            toks = torch.zeros(k, dtype=torch.long, device=dev)
            pos = torch.full((k,), ctx, device=dev)
            slots = torch.arange(used, used + k, device=dev)
            mask = torch.zeros(k, used + k, dtype=torch.bool, device=dev)
            mask[:, :ctx] = True
            dm.forward(toks, pos, slots, mask)
            used += k

    t_passes = _time(replay, 1)
    return {
        "grow_s": t_grow,
        "passes": len(beams),
        "beams_per_pass": beams,
        "bookkeeping_s_per_level": max(t_grow - t_passes, 0.0) / max(len(beams), 1),
    }


def shape_for(budget: int, acc: dict[str, Any]) -> list[int]:
    """Tokens per draft pass for one tree at ``budget`` (recorded real-pair shape, else spread evenly)."""
    beams = acc.get("beams_per_pass")
    if beams:
        return [max(1, min(128, int(round(k)))) for k in beams]
    passes = max(int(round(acc["passes"])), 1)
    return [1] + [min(128, max(1, round(budget / max(passes - 1, 1))))] * (passes - 1)


def draft_seconds(beams: list[int], pass_s: dict[int, float], per_level: float) -> float:
    """Sum of pass times (each pass costs its bucket's time: static shapes) plus bookkeeping per level."""
    total = 0.0
    for k in beams:
        b = next(s for s in BEAM_SIZES if s >= k)
        total += pass_s[b]
    return total + per_level * len(beams)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    budgets = [int(b) for b in args.budgets.split(",")]
    if args.recompute is not None:
        return recompute(args, budgets)
    if args.smoke:
        _shrink()
        dev = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("bench_e2e needs a CUDA GPU (or --smoke for a CPU logic check)", file=sys.stderr)
        return 1
    else:
        dev = torch.device("cuda")
    from offload.plan import measure_h2d_bandwidth

    acc, acc_src = load_acceptance(args.acceptance, args.domain, budgets)
    h2d = measure_h2d_bandwidth(dev) if dev.type == "cuda" else 25.0
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (smoke)",
        "h2d_pinned_gbps": h2d,
        "acceptance": acc_src,
        "projection": PROJECTION_NOTE,
        "gpu_memory_cap_gb": args.gpu_memory,
        "context": args.context,
        "runs": [],
    }
    print(f"{report['device']}: pinned H2D {h2d:.1f} GB/s; acceptance from {acc_src}", flush=True)
    from specexec.model import sizes

    fmt = {"bf16": "dense", "int8": "int8", "nf4": "nf4"}[args.draft_dtype]
    draft = build_draft(dev, fmt)
    draft_bytes = sizes.model_weight_bytes(draft.cfg, fmt, 2)
    report["draft_dtype"] = args.draft_dtype
    kv_slots = args.context + 2 * max(budgets) + 256
    t_cfg, d_cfg = _cfg(LLAMA2_70B), draft.cfg
    kv_t = 2 * t_cfg.num_layers * t_cfg.num_kv_heads * t_cfg.head_dim * kv_slots * 2
    kv_d = 2 * d_cfg.num_layers * d_cfg.num_kv_heads * d_cfg.head_dim * (args.context + 2 * max(budgets) + 256) * 2
    cap = args.context + 2 * max(budgets) + 256
    pass_graphed = time_draft_passes(draft, args.context, cap, args.repeats, graphs=not args.no_graphs)
    pass_eager = time_draft_passes(draft, args.context, cap, args.repeats, graphs=False)
    from specexec.config import GROW_MODES

    b_grow = 1024 if 1024 in budgets else max(budgets)
    growth = {mode: time_growth(draft, b_grow, args.context, 16, mode) for mode in GROW_MODES if mode != "auto"}
    per_level = growth["dynamic"]["bookkeeping_s_per_level"]
    report.update(
        draft_pass_s_graphed=pass_graphed,
        draft_pass_s_eager=pass_eager,
        bookkeeping_s_per_level=per_level,
        growth_by_mode={"budget": b_grow, "levels": 16, **growth},
    )
    print(
        f"draft pass seconds by tokens: graphed {pass_graphed}\n  eager {pass_eager}\n"
        f"  bookkeeping per level {per_level * 1e3:.2f} ms",
        flush=True,
    )
    for mode, g in growth.items():  # measured end to end: one real tree growth per mode, same tree
        print(
            f"  growth ({mode}, budget {b_grow}): {g['grow_s'] * 1e3:.1f} ms, {g['passes']} passes, "
            f"{g['bookkeeping_s_per_level'] * 1e3:.2f} ms/level outside the passes",
            flush=True,
        )
    draft_cost = {}
    for b in budgets:
        beams = shape_for(b, acc[b])
        draft_cost[b] = {
            "draft_s": draft_seconds(beams, pass_graphed, per_level),
            "eager_draft_s": draft_seconds(beams, pass_eager, per_level),
            "passes": len(beams),
        }
    for fmt in args.formats.split(","):
        model, host, info = build_target(
            fmt, dev, args.gpu_memory, draft_bytes, kv_t + kv_d, args.host_layers, max(budgets) + 1, h2d
        )
        print(
            f"{fmt}: {info['resident_layers']} resident, {info['streamed_layers']} streamed "
            f"({info['streamed_gb_per_pass']:.1f} GB/pass)\n{info['plan']}",
            flush=True,
        )
        cache = model.new_cache(kv_slots)
        with torch.inference_mode():
            ar_s = _time(lambda: model.forward(*tree_inputs(1, args.context, dev), cache), args.repeats)
            floor = info["streamed_gb_per_pass"] / h2d
            for b in budgets:
                x = tree_inputs(b + 1, args.context, dev)
                v = _time(lambda: model.forward(*x, cache), args.repeats)
                d = draft_cost[b]["draft_s"]
                tps = acc[b]["tokens_per_step"]
                rate = tps / (d + v)
                # PCIe4 projection: each pass streams the same bytes at 25 GB/s (compute overlaps the copy)
                v4 = max(v, info["streamed_gb_per_pass"] / PCIE4_GBPS)
                ar4 = max(ar_s, info["streamed_gb_per_pass"] / PCIE4_GBPS)
                r = {
                    "format": fmt,
                    "budget": b,
                    "tokens_per_step": tps,
                    "draft_s": d,
                    "verify_s": v,
                    "ar_step_s": ar_s,
                    "copy_floor_s": floor,
                    "draft_over_target": d / v,
                    "projected_tok_s": rate,
                    "ar_tokens_per_s": 1 / ar_s,
                    "projected_speedup_vs_ar": rate * ar_s,
                    "projected_pcie4_tok_s": tps / (d + v4),
                    "projected_pcie4_ar_tok_s": 1 / ar4,
                    "eager_draft_s": draft_cost[b].get("eager_draft_s"),
                    **{k: info[k] for k in ("resident_layers", "streamed_gb_per_pass")},
                }
                report["runs"].append(r)
                print(
                    f"  {fmt} budget {b:5d}: draft {d:.3f}s verify {v:.3f}s (floor {floor:.3f}) AR {ar_s:.3f}s | "
                    f"{tps:.2f} tok/step -> projected {rate:.2f} tok/s, {r['projected_speedup_vs_ar']:.1f}x AR, "
                    f"draft/target {r['draft_over_target']:.3f}; PCIe4 projected {r['projected_pcie4_tok_s']:.2f} "
                    f"tok/s",
                    flush=True,
                )
        del model, cache
        for hb in host:
            hb.close()
        gc.collect()
        torch.cuda.empty_cache()
    _print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 0


def recompute(args: argparse.Namespace, budgets: list[int]) -> int:
    """Recompute draft time and tokens/s for a new acceptance file from a GPU run's measured times."""
    old = json.loads(args.recompute.read_text())
    acc, src = load_acceptance(args.acceptance, args.domain, budgets)
    graphed = {int(k): v for k, v in old["draft_pass_s_graphed"].items()}
    eager = {int(k): v for k, v in old["draft_pass_s_eager"].items()}
    per_level = old["bookkeeping_s_per_level"]
    runs = []
    for r in old["runs"]:
        b = r["budget"]
        if b not in acc:
            continue
        beams = shape_for(b, acc[b])
        d, tps = draft_seconds(beams, graphed, per_level), acc[b]["tokens_per_step"]
        v, ar = r["verify_s"], r["ar_step_s"]
        gbp = r["streamed_gb_per_pass"]
        v4, ar4 = max(v, gbp / PCIE4_GBPS), max(ar, gbp / PCIE4_GBPS)
        measured = {k: x for k, x in r.items() if k not in LEGACY_COMPOSED}
        runs.append(
            {
                **measured,
                "tokens_per_step": tps,
                "draft_s": d,
                "eager_draft_s": draft_seconds(beams, eager, per_level),
                "draft_over_target": d / v,
                "projected_tok_s": tps / (d + v),
                "projected_speedup_vs_ar": tps / (d + v) * ar,
                "projected_pcie4_tok_s": tps / (d + v4),
                "projected_pcie4_ar_tok_s": 1 / ar4,
                "passes": len(beams),
            }
        )
    report = {
        **old,
        "acceptance": src,
        "projection": PROJECTION_NOTE,
        "recomputed_from": str(args.recompute),
        "runs": runs,
    }
    _print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 0


def _shrink() -> None:
    """--smoke: tiny shapes so the whole flow runs on a CPU in seconds."""
    LLAMA2_70B.update(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_heads=4, num_kv_heads=2, head_dim=16, num_layers=6
    )
    LLAMA2_7B.update(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=2, head_dim=16, num_layers=2
    )


def _print(report: dict[str, Any]) -> None:
    print(f"\nprojected: {PROJECTION_NOTE}")
    print(
        "| format | budget | tok/step | draft s | verify s | AR step s | draft/target | projected tok/s | "
        "projected x AR | projected PCIe4 tok/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in report["runs"]:
        print(
            f"| {r['format']} | {r['budget']} | {r['tokens_per_step']:.2f} | {r['draft_s']:.3f} "
            f"| {r['verify_s']:.3f} | "
            f"{r['ar_step_s']:.3f} | {r['draft_over_target']:.3f} | {r['projected_tok_s']:.2f} | "
            f"{r['projected_speedup_vs_ar']:.1f} | {r['projected_pcie4_tok_s']:.2f} |"
        )


if __name__ == "__main__":
    raise SystemExit(main())
