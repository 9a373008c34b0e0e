#!/usr/bin/env python
"""Benchmark the offload streamer on Llama-2-70B-shaped layers (needs a CUDA GPU).

In one run it measures:
  * pinned host->device bandwidth (one big pinned copy timed with CUDA events);
  * forwards through the real ``Transformer.forward`` with every layer streamed by ``StreamedLayers`` from pinned
    RAM, bf16 and NF4, at 1..2048 tokens per pass (KV cache of ``--kv-slots`` slots, ``--context`` of them
    attended to), timed back to back (steady state: the next forward's first layers prefetch during this one);
  * the same forwards with no streaming (one layer resident, reused: the compute floor);
  * HF accelerate ``device_map`` CPU offload (transformers LlamaForCausalLM, decoder layers on "cpu") of a
    ``--baseline-layers`` 70B-shaped bf16 model at 1 and 128 tokens, and our streamer on the same layers.

Reported, all from this run: efficiency = (streamed bytes / measured pinned GB/s) / forward time (1.0: the
forward runs at the PCIe copy floor, so a tree of that many tokens costs no more than one token), bound efficiency
= max(copy floor, compute floor) / forward time, and speedup = accelerate time / our time. Random layers are made
on the GPU and copied to pinned host buffers (one random layer per format, tiled: building 70B on the CPU with
normal_ is far too slow).

    python scripts/bench_offload.py --out bench_out/offload.json
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from scripts.shapes import accelerate_llama, model_config, shape  # noqa: E402

GB = 1e9
VOCAB = shape("llama2-70b")["vocab_size"]
TOKENS = (1, 16, 128, 512, 1024, 2048)
RAM_MARGIN = 10e9  # bytes of RAM left free (at least; 10% of what is available if more)


def efficiency(streamed_bytes: float, h2d_gbps: float, seconds: float) -> float:
    """(streamed bytes / pinned bandwidth) / measured time: 1.0 = running at the PCIe copy floor."""
    return streamed_bytes / (h2d_gbps * GB) / seconds


def layers_that_fit(layer_bytes: int, ram_available: int, want: int) -> int:
    """How many packed layers (of ``want``) fit in ``ram_available`` bytes, keeping a safety margin."""
    margin = max(RAM_MARGIN, 0.1 * ram_available)
    return max(0, min(want, int((ram_available - margin) // layer_bytes)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="70B-shaped layers to stream (default: as many of 80 as fit in RAM, per format)",
    )
    p.add_argument("--formats", default="bf16,nf4", help="comma list of bf16, nf4 (default: both)")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma list of tokens per pass")
    p.add_argument("--repeats", type=int, default=3, help="timed back-to-back forwards per point (after 1 warm-up)")
    p.add_argument("--lookahead", type=int, default=1, help="streamed layers in flight while one computes")
    p.add_argument("--kv-slots", type=int, default=4096, help="KV cache capacity (slots)")
    p.add_argument("--context", type=int, default=1024, help="cached tokens each pass attends to (besides its own)")
    p.add_argument(
        "--baseline-layers",
        type=int,
        default=10,
        help="70B-shaped bf16 layers for the accelerate CPU-offload baseline (0: skip it)",
    )
    p.add_argument("--baseline-tokens", default="1,128", help="tokens per pass for the baseline comparison")
    p.add_argument(
        "--invariant",
        action="store_true",
        help="also time each forward on the shape-invariant tiling the engine's load-time check picks here (the "
        "target's default): what bit-exact passes cost against the fast kernels",
    )
    p.add_argument("--out", type=Path, default=Path("bench_out/offload.json"), help="where to write the JSON")
    args = p.parse_args(argv)
    args.format_list = [f.strip() for f in args.formats.split(",") if f.strip()]
    if not args.format_list or not set(args.format_list) <= {"bf16", "nf4"}:
        p.error(f"--formats must list bf16 and/or nf4, got {args.formats!r}")
    try:
        args.token_list, args.baseline_token_list = _ints(args.tokens), _ints(args.baseline_tokens)
    except ValueError:
        p.error("--tokens and --baseline-tokens take comma-separated positive integers")
    if not args.token_list or min(args.token_list + args.baseline_token_list) < 1:
        p.error("--tokens and --baseline-tokens take comma-separated positive integers")
    if args.repeats < 1 or args.lookahead < 1 or args.baseline_layers < 0:
        p.error("--repeats and --lookahead must be at least 1, --baseline-layers at least 0")
    return args


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    formats, tokens = args.format_list, args.token_list
    if not torch.cuda.is_available():
        print("error: bench_offload.py needs a CUDA GPU (none is visible): nothing to measure", file=sys.stderr)
        return 1
    if max(tokens) + args.context > args.kv_slots:
        args.context = args.kv_slots - max(tokens)
    dev = torch.device("cuda")
    from offload.plan import measure_h2d_bandwidth

    t0 = time.perf_counter()
    h2d = measure_h2d_bandwidth(dev)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "h2d_pinned_gbps": h2d,
        "settings": {k: str(v) for k, v in vars(args).items()},
        "runs": [],
        "baseline": None,
    }
    print(f"{report['device']}: pinned H2D {h2d:.1f} GB/s", flush=True)
    if args.baseline_layers:
        report["baseline"] = {"accelerate": _accelerate(args.baseline_layers, args.baseline_token_list, dev)}
    for fmt in formats:
        report["runs"] += _stream_runs(fmt, args, tokens, h2d, dev, report)
    report["h2d_pinned_gbps_end"] = measure_h2d_bandwidth(dev)  # a sanity check: the link did not change
    report["seconds"] = time.perf_counter() - t0
    _print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out} ({report['seconds']:.0f} s)")
    return 0


def _config(n_layers: int) -> Any:
    return model_config("llama2-70b", layers=n_layers, context=4096)


def _random_layer(cfg: Any, layout: Any, dev: Any) -> Any:
    """One random packed layer (uint8 CPU, layout.nbytes), made on the GPU."""
    import torch

    from offload.layout import layer_shapes
    from offload.packing import quantize_layer

    g = torch.Generator(device=dev).manual_seed(0)
    dense = {
        n: (
            torch.ones(s, dtype=torch.bfloat16, device=dev)
            if n.endswith("norm")
            else torch.randn(s, generator=g, dtype=torch.bfloat16, device=dev) * 0.02
        )
        for n, s in layer_shapes(cfg).items()
    }
    tensors = quantize_layer(dense, layout, dev) if layout.fmt.kind == "nf4" else dense
    buf = torch.empty(layout.nbytes, dtype=torch.uint8, device=dev)
    layout.pack(tensors, buf)
    return buf.cpu()


class _OneLayer:
    """A provider that hands out one resident layer for every index: the forward without any streaming."""

    def __init__(self, weights: Any, num_layers: int) -> None:
        self.w, self.num_layers = weights, num_layers

    def begin(self) -> None:
        pass

    def layer(self, i: int) -> Any:
        return self.w

    def done(self, i: int) -> None:
        pass


def _inputs(T: int, ctx: int, dev: Any) -> tuple[Any, ...]:
    import torch

    ids = torch.randint(3, VOCAB, (T,), device=dev)
    pos = ctx + torch.arange(T, device=dev)
    mask = torch.arange(ctx + T, device=dev)[None, :] <= pos[:, None]  # (T, ctx+T): the prefix + causal
    return ids, pos, pos, mask


def _time(fn: Any, repeats: int) -> float:
    """Seconds per call: one warm-up, then ``repeats`` calls back to back, one synchronize at the end."""
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


def _stream_runs(
    fmt: str, args: argparse.Namespace, tokens: list[int], h2d: float, dev: Any, report: dict[str, Any]
) -> list[dict[str, Any]]:
    import psutil
    import torch

    from offload.layout import LayerFormat, layer_layout
    from offload.packing import layer_weights, max_linear_numel
    from offload.store import HostBuffer, RamStore
    from offload.streamer import StreamedLayers
    from specexec.formats.nf4 import DequantScratch
    from specexec.model.transformer import Globals, Transformer

    bf16 = torch.bfloat16
    lfmt = LayerFormat("dense" if fmt == "bf16" else "nf4", bf16)
    layout = layer_layout(_config(1), lfmt)
    want = args.layers or 80
    n = layers_that_fit(layout.nbytes, psutil.virtual_memory().available, want)
    if n < 2:
        print(f"{fmt}: not enough RAM for 2 layers of {layout.nbytes / GB:.2f} GB: skipped", flush=True)
        return []
    cfg = _config(n)
    t0 = time.perf_counter()
    template = _random_layer(cfg, layout, dev)

    def make(i: int) -> HostBuffer:
        hb = HostBuffer(layout.nbytes, pin=True)
        hb.tensor.copy_(template)
        return hb

    with ThreadPoolExecutor(8) as pool:  # page faults, pinning and copies in parallel
        host = dict(enumerate(pool.map(make, range(n))))
    if not all(hb.pinned for hb in host.values()):
        raise SystemExit("could not pin the host buffers: the benchmark needs pinned RAM")
    setup = time.perf_counter() - t0
    print(
        f"{fmt}: {n} of {want} layers of {layout.nbytes / GB:.3f} GB in pinned RAM "
        f"({n * layout.nbytes / GB:.1f} GB, set up in {setup:.1f} s)",
        flush=True,
    )
    g = torch.Generator(device=dev).manual_seed(1)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g, dtype=bf16, device=dev) * 0.02
    glob = Globals(embed=embed, norm=torch.ones(cfg.hidden_size, dtype=bf16, device=dev), lm_head=embed)
    scratch = DequantScratch(max_linear_numel(layout), bf16, dev) if lfmt.kind == "nf4" else None
    one = layer_weights(layout, template.to(dev), scratch)

    def model_over(provider: Any, layers: int) -> Any:
        c = _config(layers)
        return Transformer(cfg=c, globals=glob, layers=provider, device=dev, dtype=bf16)

    base = report.get("baseline")
    if fmt == "bf16" and base and base.get("accelerate"):
        b = base["accelerate"]["layers"]
        sub = (
            StreamedLayers(
                layout,
                b,
                dev,
                {},
                RamStore(layout, {i: host[i] for i in range(min(b, n))}, cuda=True),
                lookahead=args.lookahead,
            )
            if b <= n
            else None
        )
        if sub is not None:
            m = model_over(sub, b)
            cache = m.new_cache(args.kv_slots)
            ours = {}
            for T in base["accelerate"]["tokens"]:
                x = _inputs(T, 0, dev)
                with torch.inference_mode():
                    ours[T] = _time(lambda: m.forward(*x, cache), args.repeats)
            acc = base["accelerate"]["forward_s"]
            base["ours"] = {"layers": b, "forward_s": ours, "speedup": {T: acc[T] / ours[T] for T in ours}}
            del m, cache, sub  # not closed: it shares (and would unpin) the host buffers
    streamer = StreamedLayers(layout, n, dev, {}, RamStore(layout, host, cuda=True), lookahead=args.lookahead)
    streamed, compute_only = model_over(streamer, n), model_over(_OneLayer(one, n), n)
    cache = streamed.new_cache(args.kv_slots)
    tiling = None
    if args.invariant:
        from specexec.loading import invariance

        tiling, _, note = invariance.find(cfg, bf16, dev)
        print(f"  invariant tiling: {tiling.describe() if tiling else 'none: ' + note}", flush=True)
    runs = []
    for T in tokens:
        x = _inputs(T, args.context, dev)
        extra: dict[str, float] = {}
        with torch.inference_mode():
            if tiling is not None:
                streamed.tiling = compute_only.tiling = tiling
                extra["forward_invariant_s"] = _time(lambda: streamed.forward(*x, cache), args.repeats)
                extra["compute_only_invariant_s"] = _time(lambda: compute_only.forward(*x, cache), args.repeats)
                streamed.tiling = compute_only.tiling = None
            s = _time(lambda: streamed.forward(*x, cache), args.repeats)
            c = _time(lambda: compute_only.forward(*x, cache), args.repeats)
        nbytes = streamer.stats.bytes_last_forward
        floor = nbytes / (h2d * GB)
        r = dict(
            format=fmt,
            layers=n,
            tokens=T,
            forward_s=s,
            compute_only_s=c,
            streamed_gb=nbytes / GB,
            copy_floor_s=floor,
            efficiency=efficiency(nbytes, h2d, s),
            bound_efficiency=max(floor, c) / s,
            **extra,
        )
        runs.append(r)
        inv = ""
        if extra:
            inv = f"; invariant {extra['forward_invariant_s']:.3f} s, compute {extra['compute_only_invariant_s']:.3f} s"
        print(
            f"  {fmt} T={T:5d}: {s:.3f} s/forward, copy floor {floor:.3f} s, compute {c:.3f} s, "
            f"efficiency {r['efficiency']:.3f}{inv}",
            flush=True,
        )
    del streamed, compute_only, cache, streamer
    for hb in host.values():
        hb.close()
    del host, one, glob, embed, template
    gc.collect()
    torch.cuda.empty_cache()
    return runs


def _accelerate(n_layers: int, tokens: list[int], dev: Any) -> dict[str, Any]:
    """HF accelerate device_map CPU offload of an ``n_layers`` 70B-shaped bf16 Llama: seconds per forward."""
    import accelerate
    import torch
    import transformers

    t0 = time.perf_counter()
    model = accelerate_llama(n_layers, dev.index or 0, shape("llama2-70b"))
    print(
        f"accelerate baseline: {n_layers} 70B-shaped bf16 layers on the CPU (set up in "
        f"{time.perf_counter() - t0:.1f} s)",
        flush=True,
    )
    out: dict[str, Any] = {
        "layers": n_layers,
        "tokens": tokens,
        "forward_s": {},
        "accelerate": accelerate.__version__,
        "transformers": transformers.__version__,
    }
    for T in tokens:
        ids = torch.randint(3, VOCAB, (1, T), device=dev)
        with torch.inference_mode():
            s = _time(lambda: model(input_ids=ids, use_cache=False), 2)
        out["forward_s"][T] = s
        print(f"  accelerate T={T:5d}: {s:.3f} s/forward", flush=True)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _print(report: dict[str, Any]) -> None:
    print(
        f"\n{report['device']}, torch {report['torch']}: pinned H2D {report['h2d_pinned_gbps']:.1f} GB/s "
        f"(at the end: {report['h2d_pinned_gbps_end']:.1f})"
    )
    inv = any("forward_invariant_s" in r for r in report["runs"])
    hdr = (
        f"{'format':>6} {'layers':>6} {'tokens':>6} {'fwd s':>8} {'GB':>7} {'floor s':>8} {'comp s':>8} "
        f"{'eff':>6} {'bound':>6}" + (f" {'inv fwd s':>9} {'inv comp s':>10}" if inv else "")
    )
    print(hdr)
    for r in report["runs"]:
        tail = ""
        if inv:
            nan = float("nan")
            tail = f" {r.get('forward_invariant_s', nan):>9.3f} {r.get('compute_only_invariant_s', nan):>10.3f}"
        print(
            f"{r['format']:>6} {r['layers']:>6} {r['tokens']:>6} {r['forward_s']:>8.3f} {r['streamed_gb']:>7.1f} "
            f"{r['copy_floor_s']:>8.3f} {r['compute_only_s']:>8.3f} {r['efficiency']:>6.3f} "
            f"{r['bound_efficiency']:>6.3f}" + tail
        )
    base = report.get("baseline")
    if base and base.get("ours"):
        acc, ours = base["accelerate"], base["ours"]
        for T, sp in ours["speedup"].items():
            print(
                f"baseline, {acc['layers']} bf16 layers, T={T}: accelerate {acc['forward_s'][T]:.3f} s, "
                f"ours {ours['forward_s'][T]:.3f} s: speedup {sp:.1f}x"
            )


if __name__ == "__main__":
    sys.exit(main())
