#!/usr/bin/env python
"""Benchmark the offload streamer on Llama-2-70B-shaped layers (needs a CUDA GPU).

In one run it measures:
  * pinned host->device bandwidth (one big pinned copy timed with CUDA events);
  * passes through the real ``Transformer.forward`` with every layer streamed by ``StreamedLayers`` from pinned
    RAM, bf16 and NF4, at ``--tokens`` rows a pass over each of ``--prefixes`` cached tokens, timed as the engine
    times its passes for its cost model (``specexec.decoding.loop.pass_timer``: the best of ``--repeats`` or more,
    each synchronized on the compute stream, so the next pass's first layers still prefetch during this one), with
    the fast kernels and (``--invariant``) the bit-exact ones, and each pass's torch operations plus Triton
    launches a layer (an upper bound on its kernel launches);
  * the same passes with no streaming (one layer resident, reused: the compute floor);
  * HF accelerate ``device_map`` CPU offload (transformers LlamaForCausalLM, decoder layers on "cpu") of a
    ``--baseline-layers`` 70B-shaped bf16 model at 1 and 128 tokens, and our streamer on the same layers.

Reported, all from this run: efficiency = (streamed bytes / measured pinned GB/s) / forward time (1.0: the
forward runs at the PCIe copy floor, so a tree of that many tokens costs no more than one token), bound efficiency
= max(copy floor, compute floor) / forward time, and speedup = accelerate time / our time. Random layers are made
on the GPU and copied to pinned host buffers (one random layer per format, tiled: building 70B on the CPU with
normal_ is far too slow).

    python scripts/bench_offload.py --out bench_out/offload.json
    python scripts/bench_offload.py --device-check "$OUT"    # the prepared device call (see device_check)

``--profile-out`` writes the device profile (bandwidth, a layer's bytes, seconds a layer by pass) that
``scripts/bench_gpu.py --project`` reads. ``--smoke`` runs the flow on the CPU at tiny shapes (CI does).
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

from scripts.bench_gpu import accelerate_llama  # noqa: E402
from specexec.loading.synthetic import model_config, shape  # noqa: E402

GB = 1e9
VOCAB = shape("llama2-70b")["vocab_size"]
TOKENS = (1, 16, 128, 512, 1024, 2048)
RAM_MARGIN = 10e9  # bytes of RAM left free (at least; 10% of what is available if more)
SMOKE_GBPS = 1.0  # --smoke: a nominal link, so the flow computes its ratios (they mean nothing)


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
    p.add_argument("--repeats", type=int, default=3, help="timed passes per point (the best counts)")
    p.add_argument("--lookahead", type=int, default=1, help="streamed layers in flight while one computes")
    p.add_argument(
        "--prefixes", default="1024", help="comma list of cached tokens each pass attends to (besides its own)"
    )
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
    p.add_argument(
        "--profile-out", type=Path, default=None, help="also write the device profile (scripts/bench_gpu.py --project)"
    )
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: the flow, not a measurement")
    p.add_argument(
        "--device-check",
        type=Path,
        default=None,
        metavar="DIR",
        help="the prepared device call (see the module docstring): every step's output in DIR",
    )
    args = p.parse_args(argv)
    args.format_list = [f.strip() for f in args.formats.split(",") if f.strip()]
    if not args.format_list or not set(args.format_list) <= {"bf16", "nf4"}:
        p.error(f"--formats must list bf16 and/or nf4, got {args.formats!r}")
    try:
        args.token_list, args.baseline_token_list = _ints(args.tokens), _ints(args.baseline_tokens)
        args.prefix_list = _ints(args.prefixes)
    except ValueError:
        p.error("--tokens, --prefixes and --baseline-tokens take comma-separated positive integers")
    if not args.token_list or not args.prefix_list or min(args.token_list + args.baseline_token_list) < 1:
        p.error("--tokens, --prefixes and --baseline-tokens take comma-separated positive integers")
    if min(args.prefix_list) < 0:
        p.error("--prefixes take comma-separated integers >= 0")
    if args.repeats < 1 or args.lookahead < 1 or args.baseline_layers < 0:
        p.error("--repeats and --lookahead must be at least 1, --baseline-layers at least 0")
    return args


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device_check is not None:
        return device_check(args.device_check, args.smoke)
    import torch

    formats, tokens = args.format_list, args.token_list
    if not args.smoke and not torch.cuda.is_available():
        print("error: bench_offload.py needs a CUDA GPU (none is visible): nothing to measure", file=sys.stderr)
        return 1
    dev = torch.device("cpu" if args.smoke else "cuda")
    from offload.plan import measure_h2d_bandwidth

    t0 = time.perf_counter()
    h2d = SMOKE_GBPS if args.smoke else measure_h2d_bandwidth(dev)
    report: dict[str, Any] = {
        "device": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "h2d_pinned_gbps": h2d,
        "settings": {k: str(v) for k, v in vars(args).items()},
        "runs": [],
        "baseline": None,
    }
    print(f"{report['device']}: pinned H2D {h2d:.1f} GB/s", flush=True)
    if args.baseline_layers and not args.smoke:
        report["baseline"] = {"accelerate": _accelerate(args.baseline_layers, args.baseline_token_list, dev)}
    for fmt in formats:
        report["runs"] += _stream_runs(fmt, args, tokens, h2d, dev, report)
    report["h2d_pinned_gbps_end"] = h2d if args.smoke else measure_h2d_bandwidth(dev)  # the link did not change
    report["seconds"] = time.perf_counter() - t0
    _print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    if args.profile_out is not None:
        args.profile_out.parent.mkdir(parents=True, exist_ok=True)
        args.profile_out.write_text(json.dumps(profile(report), indent=1))
        print(f"wrote the device profile {args.profile_out}")
    print(f"wrote {args.out} ({report['seconds']:.0f} s)")
    return 0


def profile(report: dict[str, Any]) -> dict[str, Any]:
    """The device profile ``scripts/bench_gpu.py --project`` reads: the pinned bandwidth, a layer's streamed bytes
    per format, and per pass (format, tokens, prefix, fast or invariant) the seconds a layer takes streamed and
    resident (compute only), its copy floor and its counted launches."""
    passes, layer_bytes = [], {}
    for r in report["runs"]:
        layer_bytes[r["format"]] = r["streamed_gb"] * GB / r["layers"]
        for mode, fwd, comp in (
            ("fast", "forward_s", "compute_only_s"),
            ("invariant", "forward_invariant_s", "compute_only_invariant_s"),
        ):
            if fwd in r:
                passes.append(
                    dict(
                        format=r["format"],
                        tokens=r["tokens"],
                        prefix=r["prefix"],
                        mode=mode,
                        forward_s_per_layer=r[fwd] / r["layers"],
                        compute_s_per_layer=r[comp] / r["layers"],
                        copy_floor_s_per_layer=r["copy_floor_s"] / r["layers"],
                        launches_per_layer=r.get(f"launches_{mode}"),
                    )
                )
    return {
        "device": report["device"],
        "torch": report["torch"],
        "h2d_pinned_gbps": report["h2d_pinned_gbps"],
        "layer_bytes": layer_bytes,
        "passes": passes,
    }


def device_check(out: Path, smoke: bool) -> int:
    """The prepared device call, in time budgets that fit one 8-minute call (``--smoke``: the same steps on the CPU
    at tiny shapes, a flow check). Steps, each a subprocess whose output lands in ``out``: (1) compile smoke: the
    CUDA tests of the Triton tree-attention kernel and the NF4 invariant linear (the interpreter checks neither
    shared-memory limits nor real head shapes); (2) the pass table of a 70B-shaped streamed NF4 target: trees 1 /
    64 / 256 / 1,024 / 2,048 over prefixes 1k / 4k / 8k, the copy floor, the streamed fast and invariant passes,
    launches a layer, and the device profile; (3) ``pytest -m cuda``; (4) end to end at the shipped default with
    24 GB and 12 GB caps (``scripts/bench_gpu.py``)."""
    import subprocess

    out.mkdir(parents=True, exist_ok=True)
    here, t0 = Path(__file__).resolve().parents[1], time.monotonic()
    py, script_dir = sys.executable, Path(__file__).resolve().parent
    cuda_tests = ["tests/model/test_tree_attn.py", "tests/model/test_nf4_invariant.py"]
    table = ["--formats", "nf4", "--layers", "2" if smoke else "8", "--baseline-layers", "0", "--invariant"]
    table += ["--repeats", "1" if smoke else "2"]
    table += ["--tokens", "1,16" if smoke else "1,64,256,1024,2048"]
    table += ["--prefixes", "16,64" if smoke else "1024,4096,8192", "--out", str(out / "passes.json")]
    table += ["--profile-out", str(out / "profile.json")] + (["--smoke"] if smoke else [])
    e2e = ["--no-accelerate", "--prompts", "1", "--budgets"]
    e2e += ["8", "--prompt-tokens", "40", "--new-tokens", "12", "--ar-tokens", "4", "--smoke"] if smoke else ["1024"]
    steps = [  # a smoke run has no GPU: it collects the kernel tests and skips pytest -m cuda
        ("compile", [py, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *cuda_tests]
         + (["--collect-only"] if smoke else ["-m", "cuda"]), 60),
        ("passes", [py, str(script_dir / "bench_offload.py"), *table], 120),
        ("cuda", [py, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests"], 90),
    ]  # fmt: skip
    for cap, budget in ((24, 100), (12, 80)):
        name = f"70b-nf4@{cap}"
        argv = [py, str(script_dir / "bench_gpu.py"), "--settings", name, *e2e, "--out", str(out / f"{name}.json")]
        steps.append((name, argv, budget))
    if smoke:  # one end-to-end cap is the same flow as the other
        steps = [s for s in steps if s[0] not in ("cuda", "70b-nf4@12")]
    failed = 0
    for name, argv, budget in steps:
        t = time.monotonic()
        with open(out / f"{name}.log", "w") as log:
            try:
                rc = subprocess.run(argv, cwd=here, stdout=log, stderr=subprocess.STDOUT, timeout=budget).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        failed += rc != 0
        print(f"== {name}: exit {rc}, {time.monotonic() - t:.0f} s (of {budget}); {out / (name + '.log')}", flush=True)
    print(f"== device check done in {time.monotonic() - t0:.0f} s, {failed} step(s) failed")
    return 1 if failed else 0


def _config(n_layers: int, smoke: bool = False, context: int = 16384) -> Any:
    return model_config("llama2-70b", smoke, layers=n_layers, context=context)


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


def _time(fn: Any, repeats: int) -> float:
    """The accelerate baseline's seconds per call: one warm-up, then ``repeats`` calls back to back, one
    synchronize at the end."""
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
    from specexec.decoding.loop import pass_ops, pass_timer
    from specexec.formats.nf4 import DequantScratch
    from specexec.model.transformer import Globals, Transformer

    bf16, smoke, cuda = torch.bfloat16, args.smoke, dev.type == "cuda"
    lfmt = LayerFormat("dense" if fmt == "bf16" else "nf4", bf16)
    slots = max(args.prefix_list) + max(tokens)
    layout = layer_layout(_config(1, smoke, slots), lfmt)
    want = args.layers or (4 if smoke else 80)
    n = layers_that_fit(layout.nbytes, psutil.virtual_memory().available, want) if cuda else want
    if n < 2:
        print(f"{fmt}: not enough RAM for 2 layers of {layout.nbytes / GB:.2f} GB: skipped", flush=True)
        return []
    cfg = _config(n, smoke, slots)
    t0 = time.perf_counter()
    template = _random_layer(cfg, layout, dev)

    def make(i: int) -> HostBuffer:
        hb = HostBuffer(layout.nbytes, pin=cuda)
        hb.tensor.copy_(template)
        return hb

    with ThreadPoolExecutor(8) as pool:  # page faults, pinning and copies in parallel
        host = dict(enumerate(pool.map(make, range(n))))
    if cuda and not all(hb.pinned for hb in host.values()):
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
    scratch = DequantScratch(max_linear_numel(layout), bf16, dev) if lfmt.kind == "nf4" and cuda else None
    one = layer_weights(layout, template.to(dev), scratch)

    def model_over(provider: Any, layers: int) -> Any:
        return Transformer(cfg=_config(layers, smoke, slots), globals=glob, layers=provider, device=dev, dtype=bf16)

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
            cache = m.new_cache(slots)
            ours = {T: pass_timer(m, cache)(T, args.repeats) for T in base["accelerate"]["tokens"]}
            acc = base["accelerate"]["forward_s"]
            base["ours"] = {"layers": b, "forward_s": ours, "speedup": {T: acc[T] / ours[T] for T in ours}}
            del m, cache, sub  # not closed: it shares (and would unpin) the host buffers
    streamer = StreamedLayers(layout, n, dev, {}, RamStore(layout, host, cuda=cuda), lookahead=args.lookahead)
    streamed, compute_only = model_over(streamer, n), model_over(_OneLayer(one, n), n)
    cache = streamed.new_cache(slots)
    tiling = None
    if args.invariant:
        from specexec.loading import invariance

        tiling, _, note = invariance.find(cfg, bf16, dev)
        print(f"  invariant tiling: {tiling.describe() if tiling else 'none: ' + note}", flush=True)
    runs = []
    for prefix in args.prefix_list:
        time_streamed = pass_timer(streamed, cache, context=prefix)
        time_compute = pass_timer(compute_only, cache, context=prefix)
        for T in tokens:
            extra: dict[str, float] = {}
            if tiling is not None:
                streamed.tiling = compute_only.tiling = tiling
                extra["forward_invariant_s"] = time_streamed(T, args.repeats)
                extra["compute_only_invariant_s"] = time_compute(T, args.repeats)
                extra["launches_invariant"] = pass_ops(compute_only, cache, T, prefix) / n
                streamed.tiling = compute_only.tiling = None
            s, c = time_streamed(T, args.repeats), time_compute(T, args.repeats)
            nbytes = streamer.stats.bytes_last_forward
            floor = nbytes / (h2d * GB)
            r = dict(
                format=fmt,
                layers=n,
                tokens=T,
                prefix=prefix,
                forward_s=s,
                compute_only_s=c,
                streamed_gb=nbytes / GB,
                copy_floor_s=floor,
                efficiency=efficiency(nbytes, h2d, s),
                bound_efficiency=max(floor, c) / s,
                launches_fast=pass_ops(compute_only, cache, T, prefix) / n,
                **extra,
            )
            runs.append(r)
            inv = ""
            if extra:
                fi, ci = extra["forward_invariant_s"], extra["compute_only_invariant_s"]
                inv = f"; invariant {fi:.3f} s, compute {ci:.3f} s"
            print(
                f"  {fmt} T={T:5d} prefix {prefix:5d}: {s:.3f} s/forward, copy floor {floor:.3f} s, "
                f"compute {c:.3f} s, efficiency {r['efficiency']:.3f}{inv}",
                flush=True,
            )
    del streamed, compute_only, cache, streamer
    for hb in host.values():
        hb.close()
    del host, one, glob, embed, template
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return runs


def _accelerate(n_layers: int, tokens: list[int], dev: Any) -> dict[str, Any]:
    """HF accelerate device_map CPU offload of an ``n_layers`` 70B-shaped bf16 Llama: seconds per pass over T tokens
    (its ``generate`` of one token: one forward of the T tokens)."""
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
    one_pass = dict(max_new_tokens=1, do_sample=False, pad_token_id=0)  # generate's one pass over the T tokens
    for T in tokens:
        ids = torch.randint(3, VOCAB, (1, T), device=dev)
        with torch.inference_mode():
            s = _time(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), **one_pass), 2)
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
        f"{'format':>6} {'layers':>6} {'tokens':>6} {'prefix':>6} {'fwd s':>8} {'GB':>7} {'floor s':>8} "
        f"{'comp s':>8} {'eff':>6} {'bound':>6} {'ops/L':>6}"
        + (f" {'inv fwd s':>9} {'inv comp s':>10} {'inv ops/L':>9}" if inv else "")
    )
    print(hdr)
    for r in report["runs"]:
        tail = ""
        if inv:
            nan = float("nan")
            tail = (
                f" {r.get('forward_invariant_s', nan):>9.3f} {r.get('compute_only_invariant_s', nan):>10.3f}"
                f" {r.get('launches_invariant', nan):>9.0f}"
            )
        print(
            f"{r['format']:>6} {r['layers']:>6} {r['tokens']:>6} {r['prefix']:>6} {r['forward_s']:>8.3f} "
            f"{r['streamed_gb']:>7.1f} {r['copy_floor_s']:>8.3f} {r['compute_only_s']:>8.3f} {r['efficiency']:>6.3f} "
            f"{r['bound_efficiency']:>6.3f} {r['launches_fast']:>6.0f}" + tail
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
