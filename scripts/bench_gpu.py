#!/usr/bin/env python
"""Measured end to end on a GPU: the real engine with a streamed 70B-shaped target against honest baselines.

Every speed here comes from ``Engine.generate`` -- the one decode loop (propose, verify, accept, commit) with the
offload streamer, CUDA-graphed draft passes and the policy -- timed by wall clock. What stands in for real weights
is :mod:`specexec.model.synthetic`: a target and a draft of the anchors' shapes (Llama-2-70B / 7B, Qwen2.5-32B /
0.5B, Llama-3-8B / 3.2-1B) with random layers and a planted next-token agreement set to the real Qwen pair's
(code: top-1 0.72, top-8 0.965; prose: 0.58 / 0.925). Streamed bytes, matmuls and tree shapes are real; the
tokens per step are what the engine got from the planted pair, reported beside each speed, and the realised
agreement of the built pair is measured and printed. It is a model of acceptance, not of any language.

Per setting (target shape, target format, VRAM cap), the target is placed by the library's memory plan:

* ``ar (no draft)``: our plain decoding with NO draft loaded and every byte of the cap given to resident target
  layers -- the honest offloaded baseline;
* ``ar (draft loaded)``: the same with the draft's memory charged (the earlier, kinder baseline);
* ``specexec B`` at fixed budgets (dynamic growth), the fixed-width growth modes (``--grow static|ahead``),
  overlapped growth (``--overlap N``: draft levels on a side stream beside the streamed pass, subtree reuse) and
  ``auto``.

Reported per run (measured): tokens/s, tokens/step, draft s/step, target (verify) s/step, step/verify (the goal
is <= 1.1: the draft hidden), reused nodes, speedup over ``ar (no draft)``, and whether the tokens equal the
target's greedy text (AR for the first ``--ar-tokens`` tokens; after that the target's greedy walk over its
bigram table, which is what its AR decodes: see :func:`specexec.model.synthetic.bigram_logits`). A PCIe4 column is a
PROJECTION (named ``projected_pcie4_*``): each step's verify taken as at least streamed bytes / 25 GB/s.

``accelerate``: HF accelerate ``device_map`` CPU offload of an ``--accelerate-layers``-layer 70B-shaped bf16
Llama, ``generate`` end to end, against our AR on a target of the same layers (all streamed), both measured in
this run; the 80-layer comparison scales accelerate's per-layer time (a projection, labelled).

    python scripts/bench_gpu.py --out bench_out/gpu.json                         # everything (~15 min on an H100)
    python scripts/bench_gpu.py --settings 70b-nf4@24 --no-accelerate           # one setting
    python scripts/bench_gpu.py --smoke                                          # tiny shapes on a CPU: logic only
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

from specexec.config import GROW_MODES, TreeConfig  # noqa: E402 - light (no torch at import)
from specexec.formats import nf4

GB = 1e9
PCIE4_GBPS = 25.0
SHAPES: dict[str, dict[str, Any]] = {
    "llama2-70b": dict(
        vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_heads=64, num_kv_heads=8, head_dim=128,
        num_layers=80,
    ),
    "llama2-7b": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_heads=32, num_kv_heads=32, head_dim=128,
        num_layers=32,
    ),
    "qwen2.5-32b": dict(
        vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_heads=40, num_kv_heads=8, head_dim=128,
        num_layers=64, qkv_bias=True, rope_theta=1e6,
    ),
    "qwen2.5-0.5b": dict(
        vocab_size=152064, hidden_size=896, intermediate_size=4864, num_heads=14, num_kv_heads=2, head_dim=64,
        num_layers=24, qkv_bias=True, rope_theta=1e6,
    ),
    "llama3-70b": dict(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_heads=64, num_kv_heads=8, head_dim=128,
        num_layers=80, rope_theta=5e5,
    ),
    "llama3-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8, head_dim=128,
        num_layers=32, rope_theta=5e5,
    ),
    "llama3.2-1b": dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_heads=32, num_kv_heads=8, head_dim=64,
        num_layers=16, rope_theta=5e5,
    ),
}  # fmt: skip
# where the resident target layers go: spread among the streamed ones (the library's plan, offload.plan.spread),
# or (--leading-resident, the plan before session 6) the first ones
LEADING_RESIDENT = False
# setting name -> (target shape, target format, draft shape, VRAM cap GB)
SETTINGS: dict[str, tuple[str, str, str, float]] = {
    "70b-nf4@24": ("llama2-70b", "nf4", "llama2-7b", 24.0),
    "70b-bf16@24": ("llama2-70b", "bf16", "llama2-7b", 24.0),
    "32b-nf4@24": ("qwen2.5-32b", "nf4", "qwen2.5-0.5b", 24.0),
    "8b-bf16@8": ("llama3-8b", "bf16", "llama3.2-1b", 8.0),
    # the draft-precision trade-off under smaller caps (issue 16 item 2; a bf16 7B draft does not fit 12 GB)
    "70b-nf4@16": ("llama2-70b", "nf4", "llama2-7b", 16.0),
    "70b-nf4@12": ("llama2-70b", "nf4", "llama2-7b", 12.0),
    # an 8B-shaped draft (Llama-3.1-70B / 8B): its bf16 copy (16 GB) does not fit 24 GB beside the streamed target
    "70b3-nf4@24": ("llama3-70b", "nf4", "llama3-8b", 24.0),
    "70b3-nf4@16": ("llama3-70b", "nf4", "llama3-8b", 16.0),
    "70b3-nf4@12": ("llama3-70b", "nf4", "llama3-8b", 12.0),
}
DEFAULT_SETTINGS = "70b-nf4@24,70b-bf16@24,32b-nf4@24,8b-bf16@8"
FULL = "64,256,1024,2048"  # budgets for the first setting; the others run --budgets-other
# (run label, TreeConfig overrides) of the growth-mode and overlap runs, at --mode-budget
MODE_RUNS: tuple[tuple[str, dict[str, Any]], ...] = (
    # early stop spelled out: the library's GPU default is "ahead" levels with it on ("specexec B" runs that)
    ("dynamic", dict(grow="dynamic", early_stop=False)),  # the GPU default before the H200 run
    ("static", dict(grow="static", early_stop=False)),
    ("ahead", dict(grow="ahead", early_stop=False)),
    ("ahead+early stop", dict(grow="ahead", early_stop=True)),
    ("ahead+overlap 2", dict(grow="ahead", overlap=2, reuse=True, early_stop=False)),
    ("ahead+overlap 4", dict(grow="ahead", overlap=4, reuse=True, early_stop=False)),
    ("ahead+overlap 16", dict(grow="ahead", overlap=16, reuse=True, early_stop=False)),
    ("ahead+overlap 16 frontier", dict(grow="ahead", overlap=16, reuse=True, overlap_aim="frontier", early_stop=False)),
    ("ahead+overlap auto", dict(grow="ahead", overlap=-1, reuse=True, early_stop=False)),  # config.OVERLAP_AUTO
    ("ahead+overlap auto+early stop", dict(grow="ahead", overlap=-1, reuse=True, early_stop=True)),
    ("ahead+overlap 32+early stop", dict(grow="ahead", overlap=32, reuse=True, early_stop=True)),
    # the CLI's default (--budget auto, starting at --mode-budget, up to the largest budget run) with overlap auto
    ("auto+overlap auto", dict(auto=True, grow="ahead", overlap=-1, reuse=True)),
    # overlapped levels beside a default-priority target pass (decode.VERIFY_PRIORITY off; on by default)
    (
        "ahead+overlap 32+early stop+normal priority",
        dict(grow="ahead", overlap=32, reuse=True, early_stop=True, _prio=False),
    ),
    ("dynamic+reuse", dict(grow="dynamic", reuse=True, early_stop=False)),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", default=DEFAULT_SETTINGS, help=f"comma-separated of {', '.join(SETTINGS)}")
    p.add_argument("--budgets", default=FULL, help="fixed budgets for the first setting")
    p.add_argument("--budgets-other", default="256", help="fixed budgets for the other settings")
    p.add_argument("--mode-budget", type=int, default=256, help="budget of the growth-mode / overlap runs")
    p.add_argument(
        "--grows",
        default="auto",
        help="comma-separated growth modes of the fixed-budget runs, each run per budget (TreeConfig.grow: "
        f"{', '.join(GROW_MODES)}; auto = the library's GPU default); the --budget auto run takes the first",
    )
    p.add_argument(
        "--max-beams",
        default=str(TreeConfig.max_beams),
        help="comma-separated rows a draft level expands at most (TreeConfig.max_beams), each run per budget and "
        "growth mode; the --budget auto run takes the first",
    )
    p.add_argument(
        "--calibrate",
        default="off",
        help="comma-separated on/off: greedy tree scores calibrated online (TreeConfig.calibrate) or the draft's raw "
        "log-probs (the default; calibrated runs are labelled so), each run per budget; the --budget auto run takes "
        "the first",
    )
    p.add_argument("--modes-other", action="store_true", help="run the growth modes in every setting (default: first)")
    p.add_argument(
        "--modes",
        default=None,
        help=f"comma-separated growth/overlap runs to make (default: all of {', '.join(m for m, _ in MODE_RUNS)})",
    )
    p.add_argument(
        "--sync-debug", action="store_true", help="per run, one more (untimed) generation listing host waits"
    )
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="per run, one more (untimed) generation under torch.profiler: its trace (gzipped) into DIR and a "
        "host/GPU split of the draft phase (scripts/trace_summary.py) into the JSON",
    )
    p.add_argument("--profile-runs", type=int, default=1000, help="with --profile: trace only the first N runs")
    p.add_argument(
        "--leading-resident",
        action="store_true",
        help="keep the first layers resident (the old plan) instead of spreading them among the streamed ones",
    )
    p.add_argument("--no-ar-loaded", action="store_true", help="skip the AR run with the draft's memory charged")
    p.add_argument("--domain", choices=("code", "prose"), default="code", help="planted agreement of the real pair")
    p.add_argument(
        "--echo",
        action="store_true",
        help="prompts that hold their own continuation, as an edit or a quote does (prompt lookup's best case: "
        "the n-gram branches merged into the trees by default carry it); otherwise random prompts, which never repeat",
    )
    p.add_argument("--draft-dtype", choices=("bf16", "int8", "nf4"), default="bf16")
    for fmt, default in (
        ("int8", "specexec.formats.int8.CUDA_INT8_KERNEL"),
        ("nf4", "specexec.formats.nf4.DRAFT_NF4_KERNEL"),
    ):
        p.add_argument(
            f"--{fmt}-kernel",
            choices=("auto", "triton", "bnb"),
            default="auto",
            help=f"an {fmt} draft's CUDA kernel: the fused Triton one (formats.lowbit_mm), bitsandbytes', or the "
            f"library's default ({default}: bnb)",
        )
    p.add_argument(
        "--ngram-nodes",
        type=int,
        default=None,
        help="n-gram nodes merged into every tree (default: the library's GPU default, also in a --smoke run; 0: none)",
    )
    p.add_argument(
        "--warmup-tokens",
        type=int,
        default=2,
        help="tokens of the uncounted warm-up generation before each speculative run (its first graph captures, "
        "calibration and kernel compiles; more tokens leave fewer of them in the measured steps)",
    )
    p.add_argument("--prompts", type=int, default=2, help="prompts per run")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per speculative generation")
    p.add_argument("--ar-tokens", type=int, default=12, help="tokens per AR generation (AR's rate is steady)")
    p.add_argument("--host-layers", type=int, default=6, help="distinct random layers in pinned RAM")
    p.add_argument("--no-auto", action="store_true", help="skip --budget auto")
    p.add_argument("--no-accelerate", action="store_true", help="skip the accelerate device_map baseline")
    p.add_argument("--accelerate-layers", type=int, default=4)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: the flow, not a measurement")
    p.add_argument("--out", type=Path, default=Path("bench_out/gpu.json"))
    args = p.parse_args(argv)
    args.grow_list = [g.strip() for g in args.grows.split(",") if g.strip()]
    cal = [c.strip().lower() for c in args.calibrate.split(",") if c.strip()]
    if not cal or any(c not in ("on", "off") for c in cal):
        p.error(f"--calibrate: comma-separated on/off, got {args.calibrate!r}")
    args.cal_list = [c == "on" for c in cal]
    bad = [g for g in args.grow_list if g not in GROW_MODES]
    if bad or not args.grow_list:
        p.error(f"--grows: unknown mode(s) {', '.join(map(repr, bad))}; known: {', '.join(GROW_MODES)}")
    try:
        args.beam_list = [int(w) for w in args.max_beams.split(",") if w.strip()]
    except ValueError:
        p.error(f"--max-beams takes comma-separated positive integers, not {args.max_beams!r}")
    if not args.beam_list or min(args.beam_list) < 1:
        p.error(f"--max-beams takes comma-separated positive integers, not {args.max_beams!r}")
    known = [m for m, _ in MODE_RUNS]
    args.mode_list = known if args.modes is None else [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.mode_list if m not in known]
    if bad:
        p.error(f"unknown mode(s) {', '.join(map(repr, bad))}; known: {', '.join(known)}")
    if args.echo and args.prompt_tokens < 2 * args.new_tokens + 8:
        p.error(f"--echo needs --prompt-tokens >= {2 * args.new_tokens + 8} (twice --new-tokens + 8)")
    if args.ngram_nodes is not None and not 0 <= args.ngram_nodes <= 1024:
        p.error("--ngram-nodes must be in 0..1024")
    if args.warmup_tokens < 1:
        p.error("--warmup-tokens must be at least 1")
    return args


def _cfg(shape: str):
    from specexec.model.transformer import ModelConfig

    return ModelConfig(max_position_embeddings=8192, **SHAPES[shape])


def _draft_kernel_name(dev, draft_dtype: str) -> str | None:
    """The low-bit draft's kernel on ``dev`` (specexec.formats.int8's or specexec.formats.nf4's), else None."""
    from specexec.formats.int8 import _int8_kernel

    if draft_dtype == "int8":
        return _int8_kernel(dev)
    return nf4.DRAFT_NF4_KERNEL if draft_dtype == "nf4" and dev.type == "cuda" else None


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _free(dev) -> None:
    import torch

    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def resident_layers(
    t_cfg, fmt: str, dev, cap_gb: float, draft_bytes: int, kv_bytes: int, max_tokens: int, h2d: float
) -> tuple[int, str]:
    """How many target layers the library's memory plan keeps resident under ``cap_gb`` beside ``draft_bytes`` +
    ``kv_bytes``, and the plan's text (from the VRAM budget alone where the plan refuses: it also checks RAM for
    every layer, and this script cycles a few)."""
    import torch

    from offload.layout import LayerFormat, layer_layout
    from offload.plan import OffloadConfig, PlanModel, Resources, globals_bytes, make_plan, workspace_bytes

    bf16 = torch.bfloat16
    layout = layer_layout(t_cfg, LayerFormat("dense" if fmt == "bf16" else "nf4", bf16))
    try:
        plan = make_plan(
            Resources.probe(dev, None, h2d),
            PlanModel(t_cfg, bf16, draft_bytes=draft_bytes, kv_bytes=kv_bytes, max_tokens=max_tokens),
            OffloadConfig(mode="ram", gpu_memory_gb=cap_gb, target_dtype=fmt),
        )
        resident, plan_text = len(plan.resident), plan.describe()
    except Exception as e:  # noqa: BLE001
        fixed = (
            (globals_bytes(t_cfg, bf16) + workspace_bytes(t_cfg, layout.fmt, dev, max_tokens) + 2 * layout.nbytes)
            + draft_bytes
            + kv_bytes
        )
        resident = max(0, int((cap_gb * GB - fixed) // layout.nbytes))
        plan_text = f"plan refused ({e}); resident layers from the VRAM budget: {resident}"
    return min(resident, t_cfg.num_layers), plan_text


def modelled_choice(
    t_cfg, fmt: str, d_cfg, dev, cap_gb: float, kv_bytes: int, max_tokens: int, h2d: float, hbm: float
) -> dict[str, Any]:
    """What ``--draft-dtype auto`` (:mod:`specexec.loading.draft_choice`) models for this setting: each draft format's
    placement and modelled time a token, and its pick (the VRAM cap and bandwidths as measured here)."""
    import torch

    from offload.layout import LayerFormat, layer_layout
    from specexec.loading import draft_choice
    from specexec.model import sizes

    layer = layer_layout(t_cfg, LayerFormat("dense" if fmt == "bf16" else "nf4", torch.bfloat16)).nbytes
    streamed, resident = {}, {}
    for f in ("dense", "int8", "nf4"):
        d_bytes = sizes.model_weight_bytes(d_cfg, f, 2)
        if d_bytes + kv_bytes > cap_gb * GB:
            continue
        resident[f], _ = resident_layers(t_cfg, fmt, dev, cap_gb, d_bytes, kv_bytes, max_tokens, h2d)
        streamed[f] = (t_cfg.num_layers - resident[f]) * layer
    t_fmt = "nf4" if fmt == "nf4" else "dense"
    opts = draft_choice.options(
        d_cfg, streamed, h2d, hbm, resident, draft_choice.cost_model().resident_ms(t_cfg, t_fmt)
    )
    if not opts:
        return {}
    best = draft_choice.choose(opts)
    return {
        "h2d_gbps": h2d,
        "device_gbps": hbm,
        "chosen": best.fmt,
        "options": [
            {
                "fmt": o.fmt,
                "resident_layers": t_cfg.num_layers - o.streamed_bytes // layer,
                "streamed_gb": o.streamed_bytes / GB,
                "modelled_stream_s": o.stream_s,
                "modelled_draft_s_per_step": o.draft_s,
                "modelled_pass_ms": 1e3 * draft_choice.pass_seconds(d_cfg, o.fmt, hbm),
                "keep_prior": o.keep,
                "modelled_ms_per_token": o.s_per_token * 1e3,
                "break_even_keep": o.break_even_keep,
            }
            for o in opts
        ],
    }


def place_target(
    t_cfg, fmt: str, glob, dev, cap_gb: float, draft_bytes: int, kv_bytes: int, max_tokens: int, host_n: int, h2d
) -> tuple[Any, list[Any], dict[str, Any]]:
    """The target: planted globals, random layers packed in ``fmt``, as many resident as the library's memory
    plan allows under ``cap_gb`` (after ``draft_bytes`` + ``kv_bytes``), the rest streamed from pinned RAM
    (``host_n`` distinct layers cycled: the PCIe traffic is that of all of them)."""
    import torch

    from offload.layout import LayerFormat, layer_layout
    from offload.packing import quantize_layer
    from offload.store import HostBuffer, RamStore
    from offload.streamer import StreamedLayers
    from specexec.model import synthetic
    from specexec.model.transformer import Transformer

    bf16 = torch.bfloat16
    layout = layer_layout(t_cfg, LayerFormat("dense" if fmt == "bf16" else "nf4", bf16))
    resident, plan_text = resident_layers(t_cfg, fmt, dev, cap_gb, draft_bytes, kv_bytes, max_tokens, h2d)
    templates = []
    for j in range(max(1, min(host_n, t_cfg.num_layers))):
        dense = synthetic.layer_tensors(t_cfg, bf16, dev, seed=100 + j)
        tensors = quantize_layer(dense, layout, dev) if fmt == "nf4" else dense
        buf = torch.empty(layout.nbytes, dtype=torch.uint8, device=dev)
        layout.pack(tensors, buf)
        templates.append(buf)
        del dense, tensors
    from offload.plan import spread

    where = tuple(range(resident)) if LEADING_RESIDENT else spread(resident, t_cfg.num_layers)
    res = {i: templates[i % len(templates)].clone() for i in where}
    host: list[Any] = []
    if resident < t_cfg.num_layers:
        for buf in templates:
            hb = HostBuffer(layout.nbytes, pin=dev.type == "cuda")
            hb.tensor.copy_(buf.cpu())
            host.append(hb)
    store = (
        RamStore(
            layout,
            {i: host[i % len(host)] for i in range(t_cfg.num_layers) if i not in res},
            cuda=dev.type == "cuda",
        )
        if host
        else None
    )
    del templates
    streamer = StreamedLayers(layout, t_cfg.num_layers, dev, res, store, lookahead=1)
    model = Transformer(cfg=t_cfg, globals=glob, layers=streamer, device=dev, dtype=bf16)
    streamed = t_cfg.num_layers - resident
    info = {
        "resident_layers": resident,
        "streamed_layers": streamed,
        "layer_gb": layout.nbytes / GB,
        "streamed_gb_per_pass": streamed * layout.nbytes / GB,
        "plan": plan_text,
    }
    return model, host, info


def greedy_reference(t_glob, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The target's greedy continuation from its bigram table (what its AR decodes; layers add nothing)."""
    import torch

    from specexec.model import synthetic

    out = []
    for p in prompts:
        x, seq = p[-1], []
        for _ in range(n):
            x = int(synthetic.bigram_logits(t_glob, torch.tensor([x], device=t_glob.embed.device)).argmax(-1))
            seq.append(x)
        out.append(seq)
    return out


def echo_prompt(t_glob, p: list[int], n: int) -> list[int]:
    """``p`` (same length) rewritten to hold its own greedy continuation: a quarter in, its last two ids and the
    ``n`` tokens the target then generates, and it still ends on those two ids -- so the answer repeats a passage
    of the prompt, as an edit or a quote does. The planted target is a bigram model, so the continuation depends on
    the last id alone."""
    walk = greedy_reference(t_glob, [p], n)[0]
    q = len(p) // 4
    head = p[:q] + p[-2:] + walk
    return head + p[len(head) : len(p) - 2] + p[-2:]


def run_engine(
    engine,
    label: str,
    prompts,
    n_new: int,
    method: str,
    tree,
    ref: list[list[int]],
    sync_debug: bool = False,
    profile: Path | None = None,
    warmup_tokens: int = 2,
) -> dict[str, Any]:
    """Generate for every prompt (one warm-up generation of ``warmup_tokens`` first, not counted); totals of the
    measured runs."""
    import torch

    from specexec.model import synthetic

    glob = engine.target.globals
    engine.generate(prompts[0], min(warmup_tokens, n_new), method=method, tree=tree)  # graphs, calibration, ring
    dm = engine.draft_model  # the engine's DraftModel (its static/graphed passes), built by the warm-up
    static = dm.static if dm is not None else None
    caps0 = static.captures if static is not None else 0

    def levels() -> tuple[int, int]:  # captured growth levels (grow "captured"): graphs captured, replays
        space = dm.level_space if dm is not None else None
        return (space.captures, space.replays) if space is not None else (0, 0)

    lev0 = levels()
    sums = ("tokens", "steps", "draft_s", "target_s", "decode_s", "reused", "passes", "calib", "bg", "ngram", "bg_pass")
    tot: dict[str, Any] = dict.fromkeys(sums, 0)  # totals over the prompts
    exact, first_diff = True, None
    for i, p in enumerate(prompts):
        engine.reset()
        r = engine.generate(p, n_new, method=method, tree=tree)
        s = r.stats
        tot["tokens"] += s.new_tokens
        tot["steps"] += s.steps
        tot["draft_s"] += s.draft_s
        tot["target_s"] += s.target_s
        tot["decode_s"] += s.wall_s - s.prefill_s
        tot["reused"] += s.reused_nodes
        tot["passes"] += s.draft_passes
        tot["calib"] += s.calibration_s
        tot["bg"] += s.background_s
        tot["ngram"] += s.ngram_tokens
        tot["bg_pass"] += s.background_passes
        want = ref[i][: len(r.tokens)]
        if r.tokens != want:
            exact = False
            j = next(k for k, (a, b) in enumerate(zip(r.tokens, want)) if a != b)
            prev = (p + r.tokens)[len(p) + j - 1]
            top = synthetic.bigram_logits(glob, torch.tensor([prev], device=glob.embed.device)).topk(2).values[0]
            gap = float(top[0] - top[1])  # the target's top-2 gap there (>= TARGET_MARGIN by construction)
            first_diff = first_diff or {"prompt": i, "index": j, "got": r.tokens[j], "want": want[j], "gap": gap}
    steps = max(tot["steps"], 1)
    row = {
        "run": label,
        "method": method,
        "tokens": tot["tokens"],
        "steps": tot["steps"],
        "tok_s": tot["tokens"] / tot["decode_s"] if tot["decode_s"] > 0 else 0.0,
        "tok_per_step": tot["tokens"] / steps,
        "step_s": tot["decode_s"] / steps,
        "draft_s_per_step": tot["draft_s"] / steps,
        "verify_s_per_step": tot["target_s"] / steps,
        "draft_passes_per_step": tot["passes"] / steps,
        "draft_s_per_pass": tot["draft_s"] / max(tot["passes"], 1),  # bookkeeping included
        "reused_nodes_per_step": tot["reused"] / steps,
        # tokens from the prompt-lookup branches merged into the trees (the default; the planted text has no
        # repeats, so these should be ~0 here: the runs measure what merging costs, not what it brings)
        "ngram_tokens": tot["ngram"],
        "background_host_s_per_step": tot["bg"] / steps,  # of draft s: queuing the overlapped levels
        "background_passes_per_step": tot["bg_pass"] / steps,  # overlapped levels grown beside the target's pass
        "calibration_s": tot["calib"],  # --budget auto's calibrations in the measured generations (not in tok/s)
        "auto_budgets": list(engine._auto.history) if getattr(engine, "_auto", None) is not None else None,
        "graph_captures": (static.captures if static is not None else 0) - caps0,  # in the measured generations
        # grow "captured": level graphs captured / replayed in the measured generations
        "level_graph_captures": levels()[0] - lev0[0],
        "level_graph_replays": levels()[1] - lev0[1],
        "auto_overlap_levels": dm.background_levels if dm is not None else None,  # --overlap auto's last choice
        "exact": exact,
        "first_diff": first_diff,
    }
    row["step_over_verify"] = row["step_s"] / max(row["verify_s_per_step"], 1e-12)
    if sync_debug and method != "ar" and torch.cuda.is_available():
        row["sync_sites"] = sync_sites(engine, prompts[0], n_new, method, tree)
    if profile is not None and method != "ar" and PROFILED[0] < PROFILE_LIMIT[0]:
        PROFILED[0] += 1
        name = f"{PROFILED[0]:02d}_{_slug(label)}.json.gz"
        row["profile"] = profile_run(engine, prompts[0], n_new, method, tree, profile / name)
    return row


PROFILED, PROFILE_LIMIT = [0], [1000]  # traced runs so far, and --profile-runs


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in label).strip("_")


def profile_run(engine, prompt: list[int], n_new: int, method: str, tree, path: Path) -> dict[str, Any]:
    """One more generation under torch.profiler, with the decode loop's phases and the draft's levels, passes and
    reads marked (monkeypatched here, restored after): the trace goes to ``path`` (gzipped chrome JSON) and its
    summary (:func:`scripts.trace_summary.summarize`) is returned. Not timed."""
    import gzip
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from scripts.trace_summary import summarize
    from specexec.decoding import loop as decode
    from specexec.propose import best_first as tree_mod
    from specexec.propose import draft_model, fixed_grow

    def marked(fn, name: str):  # noqa: ANN001, ANN202
        def inner(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            with record_function(name):
                return fn(*a, **kw)

        return inner

    patches = [
        (tree_mod.TreeDraft, "propose", "step.propose"),
        (decode, "score_tree", "step.verify"),
        (decode, "sync", "step.sync"),
        (fixed_grow.FixedGrowth, "level", "draft.level"),
        (draft_model.DraftModel, "forward", "draft.pass"),
        (fixed_grow._Reader, "read", "draft.read"),
        (fixed_grow._Reader, "read_all", "draft.read"),
    ]
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    engine.reset()
    try:
        for obj, attr, name in patches:
            setattr(obj, attr, marked(getattr(obj, attr), name))
        with profile(activities=acts) as prof:
            engine.generate(prompt, n_new, method=method, tree=tree)
    finally:
        for obj, attr, fn in saved:
            setattr(obj, attr, fn)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        data = raw.read_bytes()
    with gzip.open(path, "wb") as f:
        f.write(data)
    summary = summarize(json.loads(data)["traceEvents"])
    summary["trace"] = str(path)
    return summary


def sync_sites(engine, prompt: list[int], n_new: int, method: str, tree) -> list[tuple[str, int]]:
    """One more generation with CUDA's sync debug mode on: where the host waited for the device (file:line of
    the call in this library, most frequent first). Not timed."""
    import collections
    import traceback
    import warnings

    import torch

    sites: collections.Counter[str] = collections.Counter()
    root = str(Path(__file__).resolve().parents[1])

    def hook(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
        frames = [
            f for f in traceback.extract_stack()[:-1] if f.filename.startswith(root) and "scripts" not in f.filename
        ]
        where = " < ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[::-1][:3]) or f"{filename}:{lineno}"
        sites[where] += 1

    engine.reset()
    old = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode(1)
        try:
            engine.generate(prompt, n_new, method=method, tree=tree)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = old
    return sites.most_common(25)


def bench_setting(
    name: str, args: argparse.Namespace, dev, h2d: float, first: bool, save=lambda out: None
) -> dict[str, Any]:
    """One setting's runs; ``save(out)`` after each, so a run cut off by a time limit keeps what it measured."""
    import torch

    from specexec.config import NGRAM_NODES_GPU
    from specexec.decoding import loop as decode
    from specexec.decoding.engine import Engine
    from specexec.model import sizes, synthetic

    t_shape, fmt, d_shape, cap = SETTINGS[name]
    t_cfg, d_cfg = _cfg(t_shape), _cfg(d_shape)
    bf16 = torch.bfloat16
    agree, cover = synthetic.CODE if args.domain == "code" else synthetic.PROSE
    t0 = time.perf_counter()
    planted = synthetic.plant(t_cfg.vocab_size, agree, cover, hidden=(t_cfg.hidden_size, d_cfg.hidden_size))
    t_glob = synthetic.planted_globals(
        planted, planted.z_target, t_cfg.hidden_size, bf16, dev, seed=1, margin=synthetic.TARGET_MARGIN
    )
    d_glob = synthetic.planted_globals(planted, planted.z_draft, d_cfg.hidden_size, bf16, dev, seed=2)
    realised = synthetic.realised(t_glob, d_glob)
    d_fmt = {"bf16": "dense", "int8": "int8", "nf4": "nf4"}[args.draft_dtype]
    draft = synthetic.resident_model(d_cfg, d_glob, bf16, dev, seed=50, distinct=4, fmt=d_fmt)
    draft_bytes = sizes.model_weight_bytes(d_cfg, d_fmt, 2)
    budgets = [int(b) for b in (args.budgets if first else args.budgets_other).split(",")]
    context = args.prompt_tokens + max(args.new_tokens, args.ar_tokens) + 64
    # draft slots for the deepest background growth of any run
    overlap = max(TreeConfig(reuse=True, grow="ahead", overlap=kw.get("overlap", 0)).max_overlap for _, kw in MODE_RUNS)
    big = TreeConfig(budget=max(budgets + [args.mode_budget]), overlap=overlap, reuse=True, grow="ahead")
    res = sizes.plan_reservations(t_cfg, d_cfg, context, 2, 2, big, draft_weights=draft_bytes)
    res0 = sizes.plan_reservations(t_cfg, None, context, 2, 2, TreeConfig(budget=1))
    prompts = synthetic.prompts(planted, args.prompts, args.prompt_tokens)
    if args.echo:
        prompts = [echo_prompt(t_glob, p, args.new_tokens) for p in prompts]
    ref = greedy_reference(t_glob, prompts, args.new_tokens)
    tok = synthetic.tokenizer_info(t_cfg.vocab_size)
    out: dict[str, Any] = {
        "setting": name,
        "target": t_shape,
        "target_format": fmt,
        "draft": d_shape,
        "draft_dtype": args.draft_dtype,
        "draft_kernel": _draft_kernel_name(dev, args.draft_dtype),
        "gpu_memory_cap_gb": cap,
        "planted": {"domain": args.domain, "agreement": agree, "coverage": cover, **realised},
        "echo_prompts": args.echo,
        "runs": [],
    }
    print(
        f"\n== {name}: {t_shape} {fmt} + {d_shape} {args.draft_dtype}"
        f"{' (' + out['draft_kernel'] + ' kernel)' if out['draft_kernel'] else ''} draft under {cap} GB "
        f"(built in {time.perf_counter() - t0:.0f} s); planted pair: top-1 agreement {realised['agreement']:.3f}, "
        f"top-8 {realised['top8']:.3f}, target top-1 p {realised['target_top1_p']:.2f}",
        flush=True,
    )

    def show(r: dict[str, Any]) -> None:
        print(
            f"  {r['run']:22s} {r['tok_s']:7.2f} tok/s  {r['tok_per_step']:5.2f} tok/step  step {r['step_s']:.3f}s "
            f"= draft {r['draft_s_per_step']:.3f} + verify {r['verify_s_per_step']:.3f} "
            f"(step/verify {r['step_over_verify']:.2f})  x AR {r.get('speedup_vs_ar', float('nan')):.2f}  "
            f"reused {r['reused_nodes_per_step']:.0f}  exact={r['exact']}  [{r.get('wall_s', 0.0):.0f} s]",
            flush=True,
        )
        if r.get("auto_budgets"):
            print(
                f"    auto budgets {r['auto_budgets']}; calibration {r['calibration_s']:.2f} s in the measured runs",
                flush=True,
            )
        if r.get("grow"):
            cap = r.get("level_graph_replays") or r.get("level_graph_captures")
            print(
                f"    growth {r['grow']}, {r['draft_passes_per_step']:.1f} draft passes a step"
                + (
                    f"; captured levels: {r['level_graph_replays']} replays, {r['level_graph_captures']} captures"
                    if cap
                    else ""
                ),
                flush=True,
            )
        if r.get("graph_captures") or r.get("background_host_s_per_step"):
            print(
                f"    background queued in {r['background_host_s_per_step']:.3f} s/step, "
                f"{r.get('background_passes_per_step', 0):.1f} levels/step; {r['graph_captures']} graph "
                f"captures; auto levels {r['auto_overlap_levels']}",
                flush=True,
            )
        m = r.get("profile", {}).get("mean")
        if m:
            pl = m.get("per_level")
            levels = (
                f"; {m['levels']:.1f} levels, per level host {pl['host_level_ms']:.2f} ms (pass launch "
                f"{pl['host_pass_ms']:.2f}, read wait {pl['host_read_ms']:.2f}), GPU pass {pl['gpu_pass_ms']:.2f} + "
                f"bookkeeping {pl['gpu_book_ms']:.2f} ms"
                if pl
                else ""
            )
            print(
                f"    profile: draft {m['propose_ms']:.1f} ms/step, GPU busy {m['gpu_busy_ms']:.1f} (passes "
                f"{m['gpu_pass_ms']:.1f} + bookkeeping {m['gpu_book_ms']:.1f}), idle {m['gpu_idle_ms']:.1f}"
                f"{levels}; sync after {m['host_sync_ms']:.1f} ms",
                flush=True,
            )
        for site, n in r.get("sync_sites", [])[:12]:
            print(f"    sync x{n}: {site}", flush=True)

    choice = modelled_choice(t_cfg, fmt, d_cfg, dev, cap, res.kv_bytes, res.max_tokens, h2d, args.device_gbps)
    if choice:
        out["draft_choice"] = choice
        print(
            "  --draft-dtype auto models: "
            + "; ".join(
                f"{o['fmt']} {o['resident_layers']} resident, pass {o['modelled_pass_ms']:.1f} ms, "
                f"{o['modelled_ms_per_token']:.0f} ms/token"
                for o in choice["options"]
            )
            + f" -> {choice['chosen']}",
            flush=True,
        )
    if not args.smoke and draft_bytes + res.kv_bytes > cap * GB:  # the plan would refuse it; the GPU would not
        out["skipped"] = (
            f"the {args.draft_dtype} draft ({draft_bytes / GB:.1f} GB) and the KV caches ({res.kv_bytes / GB:.1f} GB) "
            f"exceed the {cap:g} GB cap"
        )
        print(f"  skipped: {out['skipped']}", flush=True)
        return out
    # 1. the honest baseline: no draft loaded, every byte of the cap to the target
    target, host, info0 = place_target(
        t_cfg, fmt, t_glob, dev, cap, 0, res0.kv_bytes, res0.max_tokens, args.host_layers, h2d
    )
    out["ar_no_draft_placement"] = info0
    eng = Engine(target, tok, None, context=context)
    t_run = time.perf_counter()
    ar = run_engine(eng, "ar (no draft)", prompts, args.ar_tokens, "ar", None, ref)
    ar["wall_s"] = time.perf_counter() - t_run
    ar.update(resident_layers=info0["resident_layers"], streamed_gb_per_pass=info0["streamed_gb_per_pass"])
    ar["speedup_vs_ar"] = 1.0
    out["runs"].append(ar)
    show(ar)
    save(out)
    ar_rate = ar["tok_s"]
    del eng, target
    for hb in host:
        hb.close()
    _free(dev)
    # 2. the target placed beside the draft
    target, host, info = place_target(
        t_cfg, fmt, t_glob, dev, cap, draft_bytes, res.kv_bytes, res.max_tokens, args.host_layers, h2d
    )
    out["placement"] = info
    print(
        f"  placement: no draft {info0['resident_layers']} resident / {info0['streamed_layers']} streamed; "
        f"beside the draft {info['resident_layers']} / {info['streamed_layers']} "
        f"({info['streamed_gb_per_pass']:.1f} GB per pass)",
        flush=True,
    )
    eng = Engine(target, tok, draft, context=context, tree=big)
    runs: list[tuple[str, str, Any, int]] = (
        [] if args.no_ar_loaded else [("ar (draft loaded)", "ar", None, args.ar_tokens)]
    )
    # the GPU's default n-gram branches (named in a --smoke run, whose CPU default merges none into fixed trees)
    ng = args.ngram_nodes if args.ngram_nodes is not None else NGRAM_NODES_GPU if args.smoke else None
    grow0, beams0 = args.grow_list[0], args.beam_list[0]
    runs += [
        (
            f"specexec {b}"
            + (f" {g}" if g != "auto" else "")
            + (f" w{w}" if w != TreeConfig.max_beams else "")
            + (" calibrated" if c else ""),
            "specexec",
            TreeConfig(budget=b, ngram=ng, grow=g, max_beams=w, calibrate=c),
            args.new_tokens,
        )
        for b in budgets
        for g in args.grow_list
        for w in args.beam_list
        for c in args.cal_list
    ]
    if first or args.modes_other:
        runs += [
            (
                f"{lab} {args.mode_budget}",
                "specexec",
                TreeConfig(
                    budget=args.mode_budget,
                    ngram=ng,
                    **({"max_budget": max(budgets + [args.mode_budget])} if kw.get("auto") else {}),
                    **{k: v for k, v in kw.items() if not k.startswith("_")},
                ),
                args.new_tokens,
            )
            for lab, kw in MODE_RUNS
            if lab in args.mode_list
        ]
    if not args.no_auto:
        auto = TreeConfig(
            auto=True, max_budget=max(budgets), ngram=ng, grow=grow0, max_beams=beams0, calibrate=args.cal_list[0]
        )
        runs.append(("auto", "specexec", auto, args.new_tokens))
    gbp = info["streamed_gb_per_pass"]
    knobs = {f"{lab} {args.mode_budget}": kw for lab, kw in MODE_RUNS}
    for label, method, tree, n in runs:
        t_run = time.perf_counter()
        kw = knobs.get(label, {})
        decode.VERIFY_PRIORITY = kw.get("_prio", True)
        try:
            r = run_engine(eng, label, prompts, n, method, tree, ref, args.sync_debug, args.profile, args.warmup_tokens)
        finally:
            decode.VERIFY_PRIORITY = True
        r["wall_s"] = time.perf_counter() - t_run  # the whole run, warm-up included: what it cost to measure
        if tree is not None:  # the growth the run used ("auto" resolved: it depends on the device and the budget)
            r["grow"] = tree.grow_mode(dev)
        r["speedup_vs_ar"] = r["tok_s"] / ar_rate if ar_rate > 0 else 0.0
        r.update(resident_layers=info["resident_layers"], streamed_gb_per_pass=gbp)
        # PCIe4 PROJECTION: each verify at least the streamed bytes at 25 GB/s, the draft's part as measured
        v4 = max(r["verify_s_per_step"], gbp / PCIE4_GBPS)
        r["projected_pcie4_tok_s"] = r["tok_per_step"] / (r["step_s"] - r["verify_s_per_step"] + v4)
        # the same projection's step / verify (the draft's time as measured on this GPU; a consumer card's is longer)
        r["projected_pcie4_step_over_verify"] = (r["step_s"] - r["verify_s_per_step"] + v4) / v4
        out["runs"].append(r)
        show(r)
        save(out)
    ar4 = max(ar["step_s"], info0["streamed_gb_per_pass"] / PCIE4_GBPS)
    ar["projected_pcie4_tok_s"] = 1.0 / ar4
    ar["projected_pcie4_step_over_verify"] = 1.0  # no draft
    for r in out["runs"]:
        r["projected_pcie4_speedup_vs_ar"] = r["projected_pcie4_tok_s"] * ar4
    del eng, target, draft
    for hb in host:
        hb.close()
    _free(dev)
    return out


def bench_accelerate(n_layers: int, dev, tokens: int, h2d: float) -> dict[str, Any]:
    """HF accelerate device_map CPU offload of an n-layer 70B-shaped bf16 Llama (``generate``, greedy, end to end)
    vs our AR on a target of the same shape with every layer streamed, both measured here."""
    import accelerate
    import torch

    from scripts.bench_offload import accelerate_llama
    from specexec.decoding.engine import Engine
    from specexec.model import synthetic

    s = SHAPES["llama2-70b"]
    main: Any = dev.index or 0 if dev.type == "cuda" else "cpu"  # --smoke: the same calls, all on the CPU
    model = accelerate_llama(n_layers, main, s)
    ids = torch.randint(3, s["vocab_size"], (1, 32), device=dev)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, do_sample=False, min_new_tokens=2)  # warm-up
        _sync(dev)
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        _sync(dev)
        acc_s = time.perf_counter() - t
    del model
    _free(dev)
    # ours: the same shape, every layer streamed (cap 0: nothing resident), plain decoding end to end
    from specexec.model.transformer import ModelConfig

    cfg = ModelConfig(max_position_embeddings=8192, **{**s, "num_layers": n_layers})
    planted = synthetic.plant(cfg.vocab_size, hidden=(cfg.hidden_size,))
    glob = synthetic.planted_globals(planted, planted.z_target, cfg.hidden_size, torch.bfloat16, dev, seed=1)
    target, host, info = place_target(cfg, "bf16", glob, dev, 0.0, 0, 0, 64, n_layers, h2d)
    eng = Engine(target, synthetic.tokenizer_info(cfg.vocab_size), None, context=256)
    p = ids[0].tolist()
    eng.generate(p, 2, method="ar")
    r = eng.generate(p, tokens, method="ar")
    ours_s = r.stats.wall_s - r.stats.prefill_s
    del eng, target
    for hb in host:
        hb.close()
    _free(dev)
    # the same number of forwards on both sides: generate's N tokens take its 32-token prefill pass (which yields
    # the first) + N-1 one-token passes; ours, prefill excluded, N one-token steps (both copy-bound: a 32-token
    # pass streams the same bytes as a 1-token one)
    acc_tok_s, ours_tok_s = tokens / acc_s, tokens / ours_s
    out = {
        "layers": n_layers,
        "tokens": tokens,
        "accelerate_s": acc_s,
        "accelerate_tok_s": acc_tok_s,
        "ours_ar_s": ours_s,
        "ours_ar_tok_s": ours_tok_s,
        "ours_ar_over_accelerate": ours_tok_s / acc_tok_s,
        "streamed_gb_per_pass": info["streamed_gb_per_pass"],
        "accelerate": accelerate.__version__,
    }
    print(
        f"\n== accelerate device_map, {n_layers} 70B-shaped bf16 layers offloaded, {tokens} tokens greedy: "
        f"accelerate {acc_tok_s:.3f} tok/s, our AR {ours_tok_s:.3f} tok/s ({out['ours_ar_over_accelerate']:.1f}x), "
        f"measured end to end",
        flush=True,
    )
    return out


def _shrink() -> None:
    """--smoke: tiny shapes so the whole flow runs on a CPU in seconds (the planted agreement needs a few hundred
    hidden dims to mean anything; the smoke run checks the flow and exactness, not speed or acceptance)."""
    for name, kw in SHAPES.items():
        big = name in ("llama2-70b", "llama3-70b", "qwen2.5-32b", "llama3-8b")
        kw.update(
            vocab_size=512,
            hidden_size=256 if big else 128,
            intermediate_size=256 if big else 128,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
            num_layers=4 if big else 2,
        )
    for name, (t, f, d, _) in SETTINGS.items():  # a cap of ~1 MB: every target layer streams
        SETTINGS[name] = (t, f, d, 0.001)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    PROFILE_LIMIT[0] = args.profile_runs
    global LEADING_RESIDENT
    LEADING_RESIDENT = args.leading_resident
    import torch

    from specexec.formats import int8 as model_mod

    if args.int8_kernel != "auto":
        model_mod.CUDA_INT8_KERNEL = args.int8_kernel
    if args.nf4_kernel != "auto":
        nf4.DRAFT_NF4_KERNEL = args.nf4_kernel

    names = [s.strip() for s in args.settings.split(",") if s.strip()]
    bad = [s for s in names if s not in SETTINGS]
    if bad:
        print(f"error: unknown setting(s) {', '.join(bad)}; known: {', '.join(SETTINGS)}", file=sys.stderr)
        return 2
    if args.smoke:
        _shrink()
        dev = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("bench_gpu needs a CUDA GPU (or --smoke for a CPU logic check)", file=sys.stderr)
        return 1
    else:
        dev = torch.device("cuda")
    needs_bnb = args.draft_dtype != "bf16" or any(SETTINGS[s][1] == "nf4" for s in names)
    if needs_bnb:
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            print(
                "error: NF4 / int8 settings need bitsandbytes (pip install bitsandbytes, or a wheel into a --target "
                "dir on PYTHONPATH); or run only --settings 70b-bf16@24,8b-bf16@8 with --draft-dtype bf16",
                file=sys.stderr,
            )
            return 2
    from offload.plan import measure_h2d_bandwidth

    h2d = measure_h2d_bandwidth(dev) if dev.type == "cuda" else 25.0
    from specexec.loading.draft_choice import device_memory_gbps

    args.device_gbps = device_memory_gbps(dev) if dev.type == "cuda" else 1000.0
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "h2d_pinned_gbps": h2d,
        "note": (
            "measured end to end with the real engine; target/draft are random-layer models of the named shapes with "
            "a planted next-token agreement (specexec.model.synthetic), so tokens/step are the planted pair's; "
            "projected_pcie4_* are projections (verify >= streamed bytes / 25 GB/s)"
        ),
        "args": {k: str(v) for k, v in vars(args).items()},
        "settings": [],
    }
    report["device_gbps"] = args.device_gbps
    print(f"{report['device']}: pinned H2D {h2d:.1f} GB/s, device memory {args.device_gbps:.0f} GB/s", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):

        def save(partial: dict[str, Any], done: int = i) -> None:  # a cut-off run keeps every finished run
            args.out.write_text(json.dumps({**report, "settings": report["settings"][:done] + [partial]}, indent=1))

        report["settings"].append(bench_setting(name, args, dev, h2d, first=i == 0, save=save))
        args.out.write_text(json.dumps(report, indent=1))
    if not args.no_accelerate:
        report["accelerate"] = bench_accelerate(args.accelerate_layers, dev, args.ar_tokens, h2d)
        a = report["accelerate"]
        full = SHAPES["llama2-70b"]["num_layers"]
        acc80 = a["accelerate_tok_s"] * a["layers"] / full  # PROJECTION: its per-layer time scaled to all layers
        a["projected_accelerate_80_layer_tok_s"] = acc80
        for fmt in ("bf16", "nf4"):  # vs our measured 80-layer runs (accelerate streams bf16 either way)
            runs = [
                r["tok_s"]
                for s in report["settings"]
                if s["target"] == "llama2-70b" and s["target_format"] == fmt
                for r in s["runs"]
            ]
            if runs:
                a[f"ours_best_70b_{fmt}_over_projected_accelerate"] = max(runs) / acc80
    _print(report)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    exact = all(r["exact"] for s in report["settings"] for r in s["runs"])
    if not exact:
        print("some runs differ from the target's greedy text: see first_diff in the JSON", file=sys.stderr)
    return 0 if exact else 1


def _print(report: dict[str, Any]) -> None:
    print(
        "\n| setting | run | resident | tok/s | x AR (no draft) | tok/step | step s | draft s | verify s | "
        "step/verify | reused/step | PCIe4 tok/s (projected) | exact |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in report["settings"]:
        for r in s["runs"]:
            print(
                f"| {s['setting']} | {r['run']} | {r['resident_layers']} | {r['tok_s']:.2f} | "
                f"{r['speedup_vs_ar']:.2f} | {r['tok_per_step']:.2f} | {r['step_s']:.3f} | "
                f"{r['draft_s_per_step']:.3f} | {r['verify_s_per_step']:.3f} | {r['step_over_verify']:.2f} | "
                f"{r['reused_nodes_per_step']:.0f} | {r['projected_pcie4_tok_s']:.2f} | {r['exact']} |"
            )
    a = report.get("accelerate")
    if a:
        print(
            f"\naccelerate ({a['layers']} layers, measured): {a['accelerate_tok_s']:.3f} tok/s vs our AR "
            f"{a['ours_ar_tok_s']:.3f} ({a['ours_ar_over_accelerate']:.1f}x)"
        )
        for fmt in ("bf16", "nf4"):
            key = f"ours_best_70b_{fmt}_over_projected_accelerate"
            if key in a:
                print(
                    f"projected accelerate at 80 layers {a['projected_accelerate_80_layer_tok_s']:.3f} tok/s; our "
                    f"best measured 70B {fmt} run is {a[key]:.1f}x that"
                )


if __name__ == "__main__":
    raise SystemExit(main())
