"""The fused low-bit GEMMs (specexec.formats.lowbit_mm) that an int8 or NF4 draft may run on CUDA (opt-in).

On the CPU the very kernels run under Triton's interpreter: their tiling, masks (rows, outputs and an uneven inner
dimension), the int8 per-channel scale, NF4's nibble order, level table and block absmax (blocks aligned with rows
and straddling them) and the output dtype are checked against the dequantized weight's product; a draft using
them changes only what it proposes, so greedy speculative output still equals the target's. On CUDA (``cuda``
marker) the compiled kernels are checked at the row counts a draft uses, against bitsandbytes, and inside a
captured CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from specexec.config import TreeConfig
from specexec.decoding.engine import Engine
from specexec.formats import lowbit_mm, nf4
from specexec.formats.int8 import Int8Linear
from specexec.loading.checkpoint import load_model, load_tokenizer

pytest.importorskip("triton", reason="Triton is not installed (CUDA builds of PyTorch ship it; dev extra on CPU)")

CPU = torch.device("cpu")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # one rounding to the output dtype


def _nf4(n: int, k: int, device=CPU, blocksize: int = 64) -> nf4.NF4Linear:
    torch.manual_seed(n * 7 + k)
    w = torch.randn(n, k, device=device)
    packed, absmax = nf4.quantize_nf4(w, blocksize)
    return nf4.NF4Linear(packed, absmax, (n, k), torch.float32, blocksize, nf4.nf4_code(device))


@pytest.mark.parametrize("rows", [1, 5, 16, 33, 64, 65, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_interpreted_int8_kernel_matches_the_dequantized_product(rows, dtype):
    torch.manual_seed(rows)
    n, k = 200, 300  # neither a multiple of any tile: masked outputs and inner dimension
    x = torch.randn(rows, k).to(dtype)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    s = torch.rand(n) / 50 + 1e-3
    y = lowbit_mm.int8_matmul(x, q, s, interpret=True)
    assert y.shape == (rows, n) and y.dtype == dtype
    assert (lowbit_mm.INT8, CPU, dtype, k, False, True) in lowbit_mm._WARM  # every row tile ran once
    ref = x.float() @ (q.float() * s[:, None]).T
    assert (y.float() - ref).abs().max() <= TOL[dtype] * ref.abs().max()


@pytest.mark.parametrize("n, k", [(96, 256), (40, 160), (200, 96)])
@pytest.mark.parametrize("rows", [1, 16, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreted_nf4_kernel_matches_bitsandbytes_dequantization(n, k, rows, dtype):
    """(96, 256): whole tiles and blocks (the aligned path); (40, 160): 64-value blocks straddle rows (the general
    path); (200, 96): an inner dimension of one and a half tiles."""
    lin = _nf4(n, k)
    x = torch.randn(rows, k).to(dtype)
    y = lowbit_mm.nf4_matmul(x, lin.packed, lin.absmax, lin.state.code, (n, k), 64, interpret=True)
    assert y.shape == (rows, n) and y.dtype == dtype
    ref = x.float() @ lin.dequantize().float().T  # bitsandbytes' own dequantization
    assert (y.float() - ref).abs().max() <= TOL[dtype] * ref.abs().max()


def test_interpreted_kernels_read_strided_rows_and_refuse_a_wrong_width():
    """A row-strided view (a slice of a wider buffer) is read in place; zero rows give an empty result."""
    torch.manual_seed(1)
    q = torch.randint(-127, 128, (96, 256), dtype=torch.int8)
    s = torch.rand(96) / 50
    x = torch.randn(7, 512)[:, :256]
    assert x.stride() == (512, 1)
    ref = x @ (q.float() * s[:, None]).T
    torch.testing.assert_close(lowbit_mm.int8_matmul(x, q, s, interpret=True), ref, rtol=1e-5, atol=1e-5)
    assert lowbit_mm.int8_matmul(x[:0], q, s, interpret=True).shape == (0, 96)
    with pytest.raises(ValueError, match="columns"):
        lowbit_mm.int8_matmul(torch.randn(3, 255), q, s, interpret=True)


@pytest.mark.parametrize("m", [1, 2, 3, 16, 17, 32, 33, 64, 65, 128, 1000])
def test_tiles_cover_the_rows_a_draft_uses(m):
    bo, bt, bk, warps, stages = lowbit_mm.tile(m, 4096)
    cap = lowbit_mm.TILE[1]
    assert bt == min(cap, max(16, 1 << (m - 1).bit_length())) and bt >= min(m, cap)  # one row tile up to the cap
    assert bo >= 16 and bk >= 16 and warps >= 4 and stages >= 2
    if m <= 32:  # a 4096-output linear still spreads over a GPU's ~100+ SMs
        assert 4096 // bo >= 128
    assert lowbit_mm.tile(m, 32000)[0] >= bo  # wide outputs (an lm_head) keep full-height output tiles


def test_int8_linear_and_nf4_linear_triton_kernels_on_cpu():
    """The layers' own ``linear`` with kernel "triton" (interpreted here) computes their dequantized product; an
    int8 subset keeps the kernel; beyond MAX_ROWS rows they fall back to their default path."""
    torch.manual_seed(0)
    w = torch.randn(200, 96)
    q = Int8Linear(w, kernel="triton")
    x = torch.randn(9, 96)
    torch.testing.assert_close(q.linear(x), x @ q.dequantize().T, rtol=1e-4, atol=1e-4)
    sub = q.subset(torch.tensor([3, 150, 7]))
    assert sub.kernel == "triton"
    torch.testing.assert_close(sub.linear(x), x @ q.dequantize()[[3, 150, 7]].T, rtol=1e-4, atol=1e-4)
    lin = _nf4(64, 128)
    lin.kernel = "triton"
    x = torch.randn(9, 128)
    torch.testing.assert_close(lin.linear(x), x @ lin.dequantize().T, rtol=1e-4, atol=1e-4)


COMPILE_CHECK = """
import json, sys
from specexec.formats import lowbit_mm
out = []
for arch in (80, 89, 90):
    for fmt in (lowbit_mm.INT8, lowbit_mm.NF4):
        for m in (1, 16, 32, 64, 128, 256):
            for n, k in ((4096, 4096), (22016, 4096), (4096, 11008), (4864, 896)):
                c = lowbit_mm.compile_for(arch, fmt, m, n, k)
                ptx = c.asm["ptx"]
                out.append([arch, fmt, m, n, k, list(lowbit_mm.tile(m, n)), "wgmma" in ptx, c.metadata.shared])
json.dump(out, sys.stdout)
"""


def test_kernels_compile_for_real_gpus_without_one():
    """Every tile a draft's levels use compiles to a cubin for an A100 (8.0), an RTX 40xx (8.9) and an H100/H200
    (9.0), both formats, 7B- and Qwen-0.5B-shaped linears (Triton ships its own ptxas). On a Hopper GPU the
    full-height output tiles run on warp-group MMAs (the point of the swapped layout), and each tile's shared
    memory fits the smallest of these GPUs' per-block limit (163 KB on an A100; 99 KB on an RTX 40xx)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a real (compiling) Triton
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run(
        [sys.executable, "-c", COMPILE_CHECK], env=env, cwd=root, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(res.stdout)
    assert len(rows) == 3 * 2 * 6 * 4
    for arch, _fmt, _m, _n, _k, (bo, *_), wgmma, shared in rows:
        if arch == 90 and bo >= 64:
            assert wgmma, (arch, _fmt, _m, _n, _k)
        assert shared <= {80: 163, 89: 99, 90: 227}[arch] * 1024, (arch, _fmt, _m, _n, _k, shared)


def _use_kernel(model, kernel: str) -> int:
    """Switch every low-bit linear (int8 or NF4) of ``model`` to ``kernel``; how many there were."""
    seen = 0
    weights = [w for layer in model.layers.layers for w in layer.values()] + [model.globals.lm_head]
    for w in weights:
        if isinstance(w, (Int8Linear, nf4.NF4Linear)):
            w.kernel, seen = kernel, seen + 1
    return seen


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_low_bit_draft_on_the_fused_kernels_keeps_greedy_output_exact(tiny_pair, fmt):
    """A low-bit draft whose linears run the fused kernels (interpreted here) computes its dequantized weights'
    logits, and speculative greedy output still equals the target's own."""
    target_path, draft_path = tiny_pair
    target = load_model(target_path, CPU, torch.float32)
    draft = load_model(draft_path, CPU, torch.float32, fmt=fmt)
    ids, pos = torch.arange(3, 15), torch.arange(12)
    mask = pos[None, :] <= pos[:, None]
    _use_kernel(draft, "dequant" if fmt == "int8" else "bnb")
    ref = draft.forward(ids, pos, pos, mask, draft.new_cache(12))
    assert _use_kernel(draft, "triton") > 0
    got = draft.forward(ids, pos, pos, mask, draft.new_cache(12))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    engine = Engine(target, load_tokenizer(target_path), draft, context=128, tree=TreeConfig(budget=8))
    prompt = [5, 9, 17, 33, 4]
    want = engine.generate(prompt, 12, method="ar").tokens
    assert engine.generate(prompt, 12, method="specexec").tokens == want


def test_draft_nf4_kernel_setting_reaches_only_cuda_drafts(monkeypatch):
    """loading.quantize_weight (the drafts' quantizer) stamps DRAFT_NF4_KERNEL on CUDA weights only; a CPU
    weight keeps bitsandbytes' dequantize-and-multiply path."""
    from specexec.loading.checkpoint import quantize_weight

    monkeypatch.setattr(nf4, "DRAFT_NF4_KERNEL", "triton")
    assert quantize_weight(torch.randn(64, 64), "nf4", CPU, torch.float32).kernel == "bnb"


# ---------------------------------------------------------------------------------------------- GPU


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 16, 32, 48, 64, 128, 256, 300])
def test_cuda_kernels_match_dequantized_and_bitsandbytes(rows, monkeypatch):
    """The compiled kernels at every row tile, both formats; the "triton" layers run them up to MAX_ROWS rows and
    bitsandbytes' beyond."""
    from specexec.formats import int8 as model

    torch.manual_seed(rows)
    dev = torch.device("cuda")
    w = torch.randn(4096 + 96, 1024)  # outputs beyond the 8192 / half-height tiles' boundary, a ragged last tile
    monkeypatch.setattr(model, "CUDA_INT8_KERNEL", "triton")
    q = Int8Linear(w).to(dev)
    assert q.kernel == "triton"
    x = torch.randn(rows, 1024, device=dev, dtype=torch.bfloat16)
    ref = x.float() @ q.dequantize().T
    fused = lowbit_mm.int8_matmul(x, q.qweight, q.scale)
    assert fused.dtype == torch.bfloat16 and (fused.float() - ref).abs().max() <= 1e-2 * ref.abs().max()
    got = q.linear(x)
    if rows <= lowbit_mm.MAX_ROWS:
        assert torch.equal(got, fused)
    assert (got.float() - ref).abs().max() <= 0.05 * ref.abs().max()  # bitsandbytes' W8A8 is the coarser one
    monkeypatch.setattr(nf4, "DRAFT_NF4_KERNEL", "triton")
    from specexec.loading.checkpoint import quantize_weight

    lin = quantize_weight(w.to(dev), "nf4", dev, torch.bfloat16)
    assert lin.kernel == "triton"
    ref = x.float() @ lin.dequantize().float().T
    fused = lin.linear(x)
    assert (fused.float() - ref).abs().max() <= 1e-2 * ref.abs().max()
    lin.kernel = "bnb"
    assert (lin.linear(x).float() - ref).abs().max() <= 1e-2 * ref.abs().max()


@cuda
@pytest.mark.cuda
def test_cuda_kernels_replay_in_a_graph():
    dev = torch.device("cuda")
    torch.manual_seed(0)
    q = Int8Linear(torch.randn(512, 256)).to(dev)
    q.kernel = "triton"
    lin = _nf4(512, 256, dev)
    lin.kernel = "triton"
    x = torch.randn(32, 256, device=dev, dtype=torch.float16)
    want = (q.linear(x), lin.linear(x))  # compiled outside the capture (as StaticPasses warms up before capturing)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = (q.linear(x), lin.linear(x))
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out[0], q.linear(x))
    torch.testing.assert_close(out[1], lin.linear(x))
    assert not torch.equal(out[0], want[0]) and not torch.equal(out[1], want[1])
