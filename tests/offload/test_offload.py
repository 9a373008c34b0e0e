"""The offload package: streamed forwards equal resident ones bit for bit, NF4 packing, the cache, the plan."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from offload import OffloadConfig, StreamedLayers
from offload import plan as plan_mod
from offload.layout import ALIGN, PAGE, LayerFormat, LayerLayout, layer_layout
from offload.packing import dense_weights, layer_weights, quantize_layer
from offload.plan import PlanModel, Resources, make_plan
from offload.store import RamStore
from specexec.cli.options import FLAGS
from specexec.errors import OutOfMemory, SpecexecError
from specexec.formats import nf4
from specexec.formats.nf4 import NF4Linear
from specexec.loading.checkpoint import load_model
from specexec.loading.offloaded import load_offloaded
from specexec.model.transformer import ModelConfig, ResidentLayers, Transformer
from tests.conftest import make_tiny

CPU = torch.device("cpu")
CHUNK = 16 << 10  # small staging/CRC chunks so a tiny layer spans several (and wraps the staging ring)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _plenty_of_host_memory(monkeypatch):
    """Plans see ample RAM and disk, whatever else runs on this machine; tests of refusals set their own."""
    _fake_ram(monkeypatch, available_gb=1000, total_gb=1000)
    monkeypatch.setattr(plan_mod, "_free_disk", lambda p: int(1e13))


@pytest.fixture(scope="module")
def tiny3(tmp_path_factory) -> Path:
    """A 3-layer Qwen2-style tiny model (qkv bias: every layer tensor kind)."""
    return make_tiny(tmp_path_factory.mktemp("off") / "qwen2", "qwen2", seed=5, layers=3)


def _passes(model: Transformer, seed: int = 0) -> torch.Tensor:
    """Prefill 12 tokens, one decode step, then a 6-node tree under a tree mask; all logits concatenated (on the
    model's device)."""
    dev = model.device
    cache = model.new_cache(40)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.cfg.vocab_size, (19,), generator=g).to(dev)
    out = []
    t = torch.arange(12, device=dev)
    out.append(model.forward(ids[:12], t, t, t[None, :] <= t[:, None], cache))
    t = torch.tensor([12], device=dev)
    out.append(model.forward(ids[12:13], t, t, torch.ones(1, 13, dtype=torch.bool, device=dev), cache))
    parents = [-1, 0, 0, 1, 1, 2]  # a small tree below slot 12
    slots = torch.arange(13, 19)
    mask = torch.zeros(6, 19, dtype=torch.bool)
    mask[:, :13] = True
    depth = []
    for j, p in enumerate(parents):
        mask[j, 13 + j] = True
        if p >= 0:
            mask[j] |= mask[p]
        depth.append(0 if p < 0 else depth[p] + 1)
    pos = 13 + torch.tensor(depth, device=dev)
    out.append(model.forward(ids[13:19], pos, slots.to(dev), mask.to(dev), cache))
    return torch.cat(out)


def _load(path: Path, tmp_path: Path, **kw) -> Transformer:
    return load_offloaded(path, CPU, "fp32", OffloadConfig(cache_dir=tmp_path / "cache", **kw), chunk_bytes=CHUNK)


# -- bit-exact streaming -------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["ram", "ssd"])
@pytest.mark.parametrize("resident", [0, 1, 3])
@pytest.mark.parametrize("lookahead", [1, 2])
def test_streamed_forward_equals_resident(tiny3, tmp_path, mode, resident, lookahead):
    ref = _passes(load_model(tiny3, CPU, torch.float32))
    model = _load(tiny3, tmp_path, mode=mode, resident_layers=resident, lookahead=lookahead)
    assert isinstance(model.layers, StreamedLayers)
    for _ in range(2):  # repeated forwards (the prefetch runs on across forwards)
        assert torch.equal(_passes(model), ref)
    st = model.layers.stats
    assert (st.layers_resident, st.layers_streamed) == (resident, 3 - resident)
    assert st.bytes_last_forward == st.bytes_per_forward == (3 - resident) * st.layer_bytes
    assert st.forwards == 6


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gemma3", "phi3", "mistral_window"])
def test_each_family_streams_bit_exactly(tmp_path, family):
    """Every family's layer tensors (q/k norms, Gemma's extra norms, Phi-3's fused weights) travel through the
    packed layer layout: a streamed forward gives the resident model's logits bit for bit."""
    path = make_tiny(tmp_path / family, family, seed=2, layers=3)
    ref = _passes(load_model(path, CPU, torch.float32))
    model = _load(path, tmp_path, mode="ram", resident_layers=1)
    assert isinstance(model.layers, StreamedLayers) and torch.equal(_passes(model), ref)


def test_resident_weights_are_aligned_copies(tiny3):
    """The resident loader copies every weight out of the memory-mapped safetensors file (whose zero-copy views
    sit at 4-8 byte offsets): MKL sums differently for differently aligned operands, so unaligned resident
    weights would give logits ~1e-6 off the offload manager's aligned packed layers (and stay backed by the file)."""
    from safetensors import safe_open

    model = load_model(tiny3, CPU, torch.float32)
    with safe_open(str(tiny3 / "model.safetensors"), framework="pt", device="cpu") as f:
        file_ptrs = {f.get_tensor(k).data_ptr() for k in f.keys()}
    tensors = [t for i in range(3) for t in model.layers.layer(i).values()]
    tensors += [model.globals.embed, model.globals.norm, model.globals.lm_head]
    for t in tensors:
        assert t.data_ptr() % 64 == 0 and t.data_ptr() not in file_ptrs


@pytest.mark.parametrize("family", ["llama_tied", "llama3"])
def test_streamed_families(tmp_path, family):
    path = make_tiny(tmp_path / family, family, layers=2)
    ref = _passes(load_model(path, CPU, torch.float32))
    assert torch.equal(_passes(_load(path, tmp_path, mode="ram", resident_layers=0, ring_size=3)), ref)


def test_staged_ram_equals_resident(tiny3, tmp_path):
    """RAM the driver would not pin is staged chunk by chunk through pinned buffers: same bytes, same logits."""
    ref = _passes(load_model(tiny3, CPU, torch.float32))
    model = _load(tiny3, tmp_path, mode="ram", resident_layers=0)
    inner: StreamedLayers = model.layers
    store = RamStore(inner.layout, inner.store.buffers, cuda=True, chunk_bytes=CHUNK)  # cuda=True: unpinned → staged
    assert store.source(0) is None
    model.layers = StreamedLayers(inner.layout, 3, CPU, {}, store, lookahead=2, staging_buffers=3, readers=2)
    assert torch.equal(_passes(model), ref)
    assert torch.equal(_passes(model), ref)
    model.layers.close()


def test_layers_out_of_order_and_aborted_forward(tiny3, tmp_path):
    model = _load(tiny3, tmp_path, mode="ssd", resident_layers=1, lookahead=2)
    ref = _passes(model)
    prov = model.layers
    prov.begin()
    prov.layer(0)  # resident
    with pytest.raises(RuntimeError, match="in order"):
        prov.layer(2)
    prov.layer(1)
    prov.done(1)  # abandon this forward part-way; the next begin() restarts the ring cleanly
    assert torch.equal(_passes(model), ref)


# -- NF4 ------------------------------------------------------------------------------------------------------
def _nf4_reference(packed: torch.Tensor, absmax: torch.Tensor, shape, blocksize: int) -> torch.Tensor:
    """Pure-torch NF4 dequantization from the public code table (high nibble first), fp32."""
    code = torch.tensor(
        [
            -1.0,
            -0.6961928009986877,
            -0.5250730514526367,
            -0.39491748809814453,
            -0.28444138169288635,
            -0.18477343022823334,
            -0.09105003625154495,
            0.0,
            0.07958029955625534,
            0.16093020141124725,
            0.24611230850220947,
            0.33791524171829224,
            0.44070982933044434,
            0.5626170039176941,
            0.7229568362236023,
            1.0,
        ]
    )
    n = math.prod(shape)
    idx = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[:n].long()
    scale = absmax.repeat_interleave(blocksize)[:n]
    return (code[idx] * scale).reshape(shape)


@pytest.mark.parametrize("shape", [(96, 64), (40, 72), (3, 37)])
def test_nf4_pack_unpack_equals_bitsandbytes(shape):
    import bitsandbytes.functional as bnbf

    torch.manual_seed(0)
    w = torch.randn(shape)
    q, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
    expect = bnbf.dequantize_4bit(q, state)
    packed, absmax = nf4.quantize_nf4(w, 64)
    assert torch.equal(packed, q.view(-1)) and torch.equal(absmax, state.absmax)
    assert torch.equal(_nf4_reference(packed, absmax, shape, 64), expect)
    # through a packed layer buffer and views re-created from it
    cfg = ModelConfig(
        vocab_size=8, hidden_size=64, intermediate_size=80, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16
    )
    layout = layer_layout(cfg, LayerFormat("nf4", torch.float32))
    shapes = dict(layout.weight_shapes)
    weights = {k: torch.randn(s) for k, s in shapes.items()}
    buf = torch.empty(layout.nbytes, dtype=torch.uint8)
    layout.pack(quantize_layer(weights, layout, CPU), buf)
    layer = layer_weights(layout, buf)
    for name in ("wqkv", "wo", "w13", "w2"):
        assert isinstance(layer[name], NF4Linear)
        q, state = bnbf.quantize_4bit(weights[name], blocksize=64, quant_type="nf4", compress_statistics=False)
        # the flat blocks bitsandbytes quantized with (its CPU dequantize_4bit of a 2-D weight whose rows are not
        # whole blocks, like w2's 80 here, gets some shapes wrong: NF4Linear dequantizes through the flat shape)
        ref = _nf4_reference(q.view(-1), state.absmax, shapes[name], 64)
        assert torch.equal(layer[name].dequantize(), ref)
        assert (ref - weights[name]).abs().max() <= 0.2 * weights[name].abs().max()  # NF4's own error, no more
        x = torch.randn(5, shapes[name][1])
        assert torch.equal(layer[name].linear(x), torch.nn.functional.linear(x, layer[name].dequantize()))
    assert torch.equal(layer["attn_norm"], weights["attn_norm"])


def test_nf4_forward_equals_dequantized_resident(tiny3, tmp_path):
    model = _load(tiny3, tmp_path, mode="ram", target_dtype="nf4", resident_layers=1)
    prov: StreamedLayers = model.layers
    assert prov.plan.fmt.kind == "nf4"
    bufs = {**prov._resident_bufs, **{i: b.tensor for i, b in prov.store.buffers.items()}}
    assert sorted(bufs) == [0, 1, 2] and len(prov._resident_bufs) == 1
    dense = ResidentLayers([dense_weights(layer_weights(prov.layout, bufs[i])) for i in range(3)])
    ref = Transformer(cfg=model.cfg, globals=model.globals, layers=dense, device=CPU, dtype=torch.float32)
    assert torch.equal(_passes(model), _passes(ref))


def test_nf4_cache_second_start_does_not_quantize(tiny3, tmp_path, monkeypatch):
    from offload import packing

    calls = []
    real = packing.quantize_nf4
    monkeypatch.setattr(packing, "quantize_nf4", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = _passes(_load(tiny3, tmp_path, mode="ram", target_dtype="nf4", resident_layers=0))
    assert len(calls) == 3 * 4  # 3 layers x 4 linears, once
    calls.clear()
    for mode, k in (("ram", 0), ("ssd", 1), ("none", None)):
        again = _load(tiny3, tmp_path, mode=mode, target_dtype="nf4", resident_layers=k)
        assert calls == [], "the second start re-quantized"
        assert torch.equal(_passes(again), first)


# -- the SSD cache: corrupt and truncated files -----------------------------------------------------------------
def _cache_files(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "cache" / "offload").glob("*/layer_*.bin"))


@pytest.mark.parametrize("layer", [0, 1])
def test_corrupt_ssd_file_is_a_clear_error(tiny3, tmp_path, layer):
    _load(tiny3, tmp_path, mode="ssd", resident_layers=0)
    f = _cache_files(tmp_path)[layer]
    data = bytearray(f.read_bytes())
    data[CHUNK + 5] ^= 0xFF
    f.write_bytes(bytes(data))
    model = _load(tiny3, tmp_path, mode="ssd", resident_layers=0)
    cache = model.new_cache(8)
    t = torch.arange(4)
    for _ in range(2):  # and again at once: a failed copy never leaves a stale ring slot behind
        with pytest.raises(SpecexecError, match=r"corrupt \(checksum mismatch.*delete .* to rebuild"):
            model.forward(t + 3, t, t, t[None, :] <= t[:, None], cache)


def test_truncated_ssd_file_is_a_clear_error(tiny3, tmp_path):
    _load(tiny3, tmp_path, mode="ssd", resident_layers=0)
    f = _cache_files(tmp_path)[2]
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(SpecexecError, match=r"layer_00002.bin is truncated \(1000 of \d+ bytes\)"):
        _load(tiny3, tmp_path, mode="ssd", resident_layers=0)


# -- plan ---------------------------------------------------------------------------------------------------------
LLAMA70B = ModelConfig(
    vocab_size=32000,
    hidden_size=8192,
    intermediate_size=28672,
    num_layers=80,
    num_heads=64,
    num_kv_heads=8,
    head_dim=128,
)


def test_layout_sizes_match_the_physical_numbers():
    dense = layer_layout(LLAMA70B, LayerFormat("dense", torch.bfloat16))
    nf4 = layer_layout(LLAMA70B, LayerFormat("nf4", torch.bfloat16))
    assert round(dense.nbytes / 1e9, 3) == 1.711 and round(nf4.nbytes / 1e9, 3) == 0.481  # a 70B layer's bytes
    for lay in (dense, nf4):
        assert lay.nbytes % PAGE == 0 and all(e.offset % ALIGN == 0 for e in lay.entries)
        assert LayerLayout.from_json(lay.to_json()) == lay


def _plan(off: OffloadConfig, dtype: torch.dtype = torch.float32, kv_bytes: int = 0):
    """make_plan for Llama-70B on this (faked) machine, the CPU as "GPU" (capped by gpu_memory_gb)."""
    return make_plan(Resources.probe(CPU, off.offload_root), PlanModel(LLAMA70B, dtype, kv_bytes=kv_bytes), off)


def _fake_ram(monkeypatch, available_gb: float, total_gb: float = 64.0) -> None:
    vm = SimpleNamespace(available=int(available_gb * 1e9), total=int(total_gb * 1e9))
    monkeypatch.setattr(plan_mod.psutil, "virtual_memory", lambda: vm)


def test_plan_refuses_ram_tier_that_does_not_fit(monkeypatch, tmp_path):
    _fake_ram(monkeypatch, available_gb=40)
    off = OffloadConfig(mode="ram", target_dtype="bf16", gpu_memory_gb=24, cache_dir=tmp_path)
    with pytest.raises(
        OutOfMemory,
        match=r"OffloadConfig.mode=ram needs 1\d\d\.\d GB of RAM .* use "
        r"OffloadConfig.mode=ssd",
    ) as err:
        _plan(off)
    assert err.value.resource == "RAM" and err.value.need > err.value.have
    assert "--offload ram needs" in err.value.render(FLAGS) and "use --offload ssd" in err.value.render(FLAGS)
    # NF4 (0.48 GB/layer) fits in the same RAM; auto picks ssd for bf16
    p = _plan(OffloadConfig(mode="ram", target_dtype="nf4", gpu_memory_gb=24, cache_dir=tmp_path))
    assert p.mode == "ram" and p.fmt.kind == "nf4" and len(p.resident) + len(p.streamed) == 80
    p = _plan(OffloadConfig(mode="auto", target_dtype="bf16", gpu_memory_gb=24, cache_dir=tmp_path))
    assert p.mode == "ssd"  # RAM too small for 16-bit layers: auto streams from disk
    p = _plan(OffloadConfig(mode="auto", gpu_memory_gb=24, cache_dir=tmp_path))
    assert (p.fmt.kind, p.fmt.dtype) == ("dense", torch.float32)  # CPU: target_dtype auto stays dense
    p = _plan(OffloadConfig(mode="auto", target_dtype="nf4", gpu_memory_gb=24, cache_dir=tmp_path))
    assert p.mode == "ram"
    assert _plan(OffloadConfig()).mode == "none"  # no cap on CPU: everything "fits"
    off = OffloadConfig(mode="ssd", target_dtype="bf16", gpu_memory_gb=24, cache_dir=tmp_path)
    p = _plan(off, dtype=torch.bfloat16)
    assert p.mode == "ssd" and 0 < len(p.resident) < 20 and p.ring_size == 2


def test_plan_refuses_disk_vram_and_none(monkeypatch, tmp_path):
    _fake_ram(monkeypatch, available_gb=40)
    monkeypatch.setattr(plan_mod, "_free_disk", lambda p: int(50e9))
    with pytest.raises(OutOfMemory, match=r"SSD tier needs 136\.\d GB of disk .*OffloadConfig.cache_dir") as err:
        _plan(OffloadConfig(mode="ssd", target_dtype="bf16", cache_dir=tmp_path))
    assert err.value.resource == "disk" and "--cache-dir" in err.value.render(FLAGS)
    with pytest.raises(OutOfMemory, match="VRAM too small to stream"):
        _plan(OffloadConfig(mode="ram", target_dtype="nf4", gpu_memory_gb=4), kv_bytes=int(2e9))
    with pytest.raises(OutOfMemory, match="use OffloadConfig.mode auto, ram or ssd") as err:
        _plan(OffloadConfig(mode="none", target_dtype="bf16", gpu_memory_gb=24))
    assert "use --offload auto, ram or ssd, or --target-dtype nf4" in err.value.render(FLAGS)


def test_resident_layers_are_spread_among_the_streamed_ones():
    """A streamed pass is bound by its copies: resident layers go between streamed ones (their compute then runs
    while the next streamed layer copies), the first layer is streamed, and every layer is placed exactly once."""
    from offload.plan import spread

    assert spread(0, 80) == () and spread(80, 80) == tuple(range(80)) and spread(90, 4) == (0, 1, 2, 3)
    assert spread(79, 80) == tuple(range(1, 80))
    assert spread(19, 80) == tuple(range(4, 80, 4))
    for n in (1, 2, 7, 32, 80, 126):
        for k in range(n + 1):
            r = spread(k, n)
            assert len(r) == k == len(set(r)) and list(r) == sorted(r) and all(0 <= i < n for i in r)
            if k < n:
                assert 0 not in r  # the pass starts with what the ring prefetched
                gaps = [b - a for a, b in zip((-1,) + r, r + (n,))]  # streamed runs around the resident layers
                assert max(gaps) - min(gaps) <= 1 + (n - 1) // (k + 1), (k, n, gaps)


def test_plan_describe(monkeypatch, tmp_path):
    _fake_ram(monkeypatch, available_gb=100, total_gb=128)
    off = OffloadConfig(mode="ram", target_dtype="nf4", gpu_memory_gb=24, cache_dir=tmp_path, lookahead=2)
    p = _plan(off, dtype=torch.bfloat16)
    text = p.describe()
    assert "mode=ram" in text and "nf4-b64-bfloat16" in text and "lookahead 2" in text
    k = len(p.resident)
    assert 8 < k < 79 and f"{k} of 80 layers resident (spread: {p.resident[0]}, {p.resident[1]}, " in text
    assert p.floor_seconds(25.0) == pytest.approx(len(p.streamed) * p.layer_bytes / 25e9)
    assert "25.0 GB/s pinned H2D (assumed" in text


@pytest.mark.parametrize(
    "kw",
    [
        dict(mode="disk"),
        dict(target_dtype="int4"),
        dict(lookahead=0),
        dict(ring_size=2, lookahead=2),
        dict(resident_layers=-1),
        dict(gpu_memory_gb=0),
    ],
)
def test_offload_config_validation(kw):
    with pytest.raises(ValueError):
        OffloadConfig(**kw)


def test_offload_config_defaults():
    c = OffloadConfig(cache_dir="/tmp/x", lookahead=3)
    assert c.cache_dir == Path("/tmp/x") and c.offload_root == Path("/tmp/x/offload") and c.ring == 4


# -- the benchmark script ---------------------------------------------------------------------------------------
def test_bench_script_help_and_cpu_refusal():
    script = REPO / "scripts" / "bench_offload.py"
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and "--layers" in out.stdout
    if not torch.cuda.is_available():
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=REPO)
        assert out.returncode == 1 and "needs a CUDA GPU" in out.stderr


def test_bench_helpers():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import bench_offload as b
    finally:
        sys.path.pop(0)
    assert b.efficiency(streamed_bytes=55e9, h2d_gbps=55.0, seconds=1.25) == pytest.approx(0.8)
    assert b.layers_that_fit(layer_bytes=int(1.711e9), ram_available=int(100e9), want=80) == 52
    assert b.layers_that_fit(layer_bytes=int(0.481e9), ram_available=int(100e9), want=80) == 80


# -- CUDA: stream/event ordering ----------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU = torch.device("cuda")


class _SlowStreams(StreamedLayers):
    """Makes races visible: every copy starts after a GPU sleep on the copy stream, every layer's compute after
    one on the compute stream. Missing waits then read stale slots or overwrite slots still being read."""

    def _issue(self, p: int) -> None:
        with torch.cuda.stream(self._copy):
            torch.cuda._sleep(200_000)
        super()._issue(p)

    def layer(self, i):
        w = super().layer(i)
        torch.cuda._sleep(200_000)
        return w


def _slow(model: Transformer) -> Transformer:
    p: StreamedLayers = model.layers
    model.layers = _SlowStreams(
        p.layout,
        p.num_layers,
        p.device,
        p._resident_bufs,
        p.store,
        lookahead=p.lookahead,
        ring_size=len(p._ring) or None,
    )
    return model


def _gpu_passes(model: Transformer, T: int, seed: int) -> torch.Tensor:
    cache = model.new_cache(T + 8)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.cfg.vocab_size, (T,), generator=g).cuda()
    t = torch.arange(T, device="cuda")
    a = model.forward(ids, t, t, t[None, :] <= t[:, None], cache)
    t1 = torch.tensor([T], device="cuda")
    b = model.forward(ids[:1], t1, t1, torch.ones(1, T + 1, dtype=torch.bool, device="cuda"), cache)
    return torch.cat([a, b])


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("wide") / "m", "qwen2", layers=6, hidden=512, vocab=256, std=0.05)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["ram", "ssd"])
@pytest.mark.parametrize("lookahead", [1, 2, 3])
def test_cuda_streamed_equals_resident_bf16(wide, tmp_path, mode, lookahead):
    ref_model = load_model(wide, GPU, torch.bfloat16)
    refs = {T: _gpu_passes(ref_model, T, T) for T in (1, 64)}
    off = OffloadConfig(mode=mode, target_dtype="bf16", cache_dir=tmp_path, lookahead=lookahead, resident_layers=1)
    model = _slow(load_offloaded(wide, GPU, "bf16", off, chunk_bytes=1 << 20))
    assert model.layers.stats.layers_streamed == 5 and len(model.layers._ring) == lookahead + 1
    for rep in range(10):
        for T, ref in refs.items():
            assert torch.equal(_gpu_passes(model, T, T), ref), f"mismatch at repeat {rep}, T={T}"
    model.layers.close()


@cuda
@pytest.mark.cuda
def test_cuda_unpinned_ram_is_staged(wide, tmp_path, monkeypatch):
    from offload import store

    monkeypatch.setattr(store, "_host_register", lambda t: False)
    ref = _gpu_passes(load_model(wide, GPU, torch.bfloat16), 64, 1)
    off = OffloadConfig(mode="ram", target_dtype="bf16", cache_dir=tmp_path, resident_layers=0)
    model = _slow(load_offloaded(wide, GPU, "bf16", off, chunk_bytes=1 << 20))
    assert model.layers.store.source(0) is None
    for _ in range(5):
        assert torch.equal(_gpu_passes(model, 64, 1), ref)
    model.layers.close()


@cuda
@pytest.mark.cuda
def test_cuda_refused_pinning_leaves_cuda_usable():
    """A refused cudaHostRegister (here: memory already registered) is reported as False, and the CUDA error it
    leaves behind must not surface in the next kernel launch."""
    from offload.store import HostBuffer, _host_register

    hb = HostBuffer(1 << 20, pin=True)
    assert hb.pinned
    assert _host_register(hb.tensor) is False
    assert torch.ones(4, device="cuda").mul(2).sum().item() == 8.0
    hb.close()


@cuda
@pytest.mark.cuda
def test_cuda_nf4(wide, tmp_path):
    off = dict(target_dtype="nf4", cache_dir=tmp_path)
    resident = load_offloaded(wide, GPU, "bf16", OffloadConfig(mode="none", **off))
    off_ram = OffloadConfig(mode="ram", resident_layers=0, lookahead=2, **off)
    streamed = _slow(load_offloaded(wide, GPU, "bf16", off_ram))
    assert resident.layers.stats.layers_streamed == 0 and streamed.layers.stats.layers_streamed == 6
    for T in (1, 64, 1600):  # bnb.matmul_4bit up to 1536 rows, dequantize into the scratch + GEMM above
        ref = _gpu_passes(resident, T, T)
        for _ in range(3):
            assert torch.equal(_gpu_passes(streamed, T, T), ref)
    # and close to a dense bf16 model with the dequantized weights
    prov = resident.layers
    dense = ResidentLayers([dense_weights(prov._resident[i]) for i in range(6)])
    ref = Transformer(cfg=resident.cfg, globals=resident.globals, layers=dense, device=GPU, dtype=torch.bfloat16)
    for T in (1, 64, 1600):
        a, b = _gpu_passes(streamed, T, T), _gpu_passes(ref, T, T)
        assert (a - b).abs().max() <= 0.05 * b.abs().max()
    streamed.layers.close()


def test_auto_draft_precision_falls_back_to_what_fits(monkeypatch, tiny3, tmp_path):
    """--draft-dtype auto on a GPU: a 16-bit draft that leaves no room for the streamed target goes int8, then NF4;
    where the 16-bit one fits it stays; when none fits the error says what was tried."""
    from specexec.loading.checkpoint import read_config
    from specexec.loading.offloaded import plan_with_draft
    from specexec.model.sizes import PlanReservations

    _fake_ram(monkeypatch, available_gb=100, total_gb=128)
    off = OffloadConfig(mode="ram", target_dtype="bf16", cache_dir=tmp_path)
    cfg = read_config(tiny3)
    base = make_plan(  # what the target alone needs streamed (a ring of 2) on an unlimited GPU, reservations included
        Resources(device="cuda", vram_free=10**13, ram_total=int(128e9), ram_available=int(100e9)),
        PlanModel(cfg, torch.bfloat16, max_tokens=16),
        off,
    )
    assert base.num_layers == cfg.num_layers
    draft = {"dense": 6_000_000, "int8": 3_000_000, "nf4": 1_500_000}
    reserve = lambda fmt: PlanReservations(draft[fmt], 0, 16)

    def gpu(free: int) -> Resources:
        return Resources(device="cuda", vram_free=free, ram_total=int(128e9), ram_available=int(100e9))

    headroom = plan_mod.VRAM_HEADROOM
    ring = 2 * base.layer_bytes
    fixed = base.vram_need - base.num_layers * base.layer_bytes  # globals + workspace with no draft
    for fits, want in ((draft["dense"], "dense"), (draft["int8"], "int8"), (draft["nf4"], "nf4")):
        free = headroom + fixed + ring + fits
        plan, fmt = plan_with_draft(tiny3, CPU, "bf16", off, reserve, ["dense", "int8", "nf4"], resources=gpu(free))
        assert fmt == want and plan.streamed, (fits, fmt)
    # an explicit format is not second-guessed
    with pytest.raises(OutOfMemory, match="VRAM too small to stream") as err:
        plan_with_draft(tiny3, CPU, "bf16", off, reserve, ["dense"], resources=gpu(headroom + fixed + ring + 10))
    assert "tried" not in str(err.value)
    with pytest.raises(OutOfMemory, match=r"the draft was tried in 16-bit, int8, nf4") as err:
        plan_with_draft(tiny3, CPU, "bf16", off, reserve, ["dense", "int8", "nf4"], resources=gpu(headroom + 10))
    assert err.value.resource == "GPU memory"


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("target_dtype", ["bf16", "nf4"])
def test_cuda_streamed_passes_are_shape_invariant(wide, tmp_path, target_dtype):
    """A streamed target on its invariant tiling: each position's logits are the same bits in one prefill, in
    one-token steps, and in passes of other sizes (bf16 and NF4 weights)."""
    from specexec.loading import invariance

    off = OffloadConfig(mode="ram", target_dtype=target_dtype, cache_dir=tmp_path, resident_layers=1)
    model = _slow(load_offloaded(wide, GPU, "bf16", off, chunk_bytes=1 << 20))
    choice = invariance.apply(model)
    assert model.tiling is not None, choice
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, model.cfg.vocab_size, (80,), generator=g).cuda()
    t = torch.arange(80, device="cuda")
    whole = model.forward(ids, t, t, t[None, :] <= t[:, None], model.new_cache(96))
    cache = model.new_cache(96)
    parts, a = [], 0
    for n in (37, 1, 1, 9, 32):  # a prefill, two steps, a chain, a bigger pass
        s = t[a : a + n]
        parts.append(model.forward(ids[a : a + n], s, s, t[None, : a + n] <= s[:, None], cache))
        a += n
    assert torch.equal(torch.cat(parts), whole)
    model.layers.close()
