"""The fused weight-only int8 GEMM (specexec.int8mm) that an int8 draft runs on CUDA.

On the CPU the very kernel runs under Triton's interpreter: its tiling, masks (rows, outputs and an uneven inner
dimension), the per-channel scale and the output dtype are checked against the dequantized weight's product; a
draft using it changes only what it proposes, so greedy speculative output still equals the target's. On CUDA
(``cuda`` marker) the compiled kernel is checked at the row counts a draft uses, against bitsandbytes' W8A8 and
inside a captured CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from specexec import int8mm
from specexec.config import TreeConfig
from specexec.engine import Engine
from specexec.loading import load_model, load_tokenizer
from specexec.model import Int8Linear

pytest.importorskip("triton", reason="Triton is not installed (CUDA builds of PyTorch ship it; dev extra on CPU)")

CPU = torch.device("cpu")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _ref(x, q, s):
    return x.float() @ (q.float() * s[:, None]).T


@pytest.mark.parametrize("rows", [1, 5, 16, 33, 64, 65, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_interpreted_kernel_matches_the_dequantized_product(rows, dtype):
    torch.manual_seed(rows)
    n, k = 200, 300  # neither a multiple of any tile: masked outputs and inner dimension
    x = torch.randn(rows, k).to(dtype)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    s = torch.rand(n) / 50 + 1e-3
    y = int8mm.matmul(x, q, s, interpret=True)
    assert y.shape == (rows, n) and y.dtype == dtype
    assert (CPU, dtype, k, False, False, True) in int8mm._WARM  # every row tile ran once at the first call
    ref = _ref(x, q, s)
    # fp32 accumulation, then one rounding to the output dtype (bf16: 8 bits of mantissa)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype] * ref.abs().max()
    assert (y.float() - ref).abs().max() <= tol


def test_interpreted_kernel_even_inner_dimension_and_strided_rows():
    """K a multiple of the inner tile takes the unmasked loop; a row-strided view (a slice of a wider buffer, as a
    chunk of fused q/k/v would be) is read in place."""
    torch.manual_seed(1)
    q = torch.randint(-127, 128, (96, 256), dtype=torch.int8)
    s = torch.rand(96) / 50
    wide = torch.randn(7, 512)
    x = wide[:, :256]
    assert x.stride() == (512, 1)
    torch.testing.assert_close(int8mm.matmul(x, q, s, interpret=True), _ref(x, q, s), rtol=1e-5, atol=1e-5)
    assert int8mm.matmul(x[:0], q, s, interpret=True).shape == (0, 96)
    with pytest.raises(ValueError, match="columns"):
        int8mm.matmul(torch.randn(3, 255), q, s, interpret=True)


@pytest.mark.parametrize("m", [1, 2, 3, 16, 17, 64, 65, 128, 1000])
def test_tiles_cover_the_rows_a_draft_uses(m):
    bm, bn, bk, warps, stages = int8mm.tile(m, 4096)
    if m <= 64:  # one row tile: every weight tile is read once a pass
        assert bm >= m and bm == max(16, 1 << (m - 1).bit_length())
    assert bk in (64, 128, 256) and warps >= 4 and stages >= 2
    if m <= 64:  # a 4096-output linear still spreads over a GPU's ~100+ SMs
        assert 4096 // bn >= 64
    assert int8mm.tile(m, 32000)[1] >= bn  # wide outputs (an lm_head) take wider column tiles


def test_int8_linear_triton_kernel_on_cpu_matches_dequantized():
    torch.manual_seed(0)
    w = torch.randn(200, 96)
    q = Int8Linear(w, kernel="triton")
    x = torch.randn(9, 96)
    torch.testing.assert_close(q.linear(x), x @ q.dequantize().T, rtol=1e-4, atol=1e-4)
    sub = q.subset(torch.tensor([3, 150, 7]))
    assert sub.kernel == "triton"
    torch.testing.assert_close(sub.linear(x), x @ q.dequantize()[[3, 150, 7]].T, rtol=1e-4, atol=1e-4)


def _use_kernel(model, kernel: str) -> int:
    """Switch every Int8Linear of ``model`` to ``kernel``; how many there were."""
    seen = 0
    for layer in model.layers.layers:
        for w in layer.values():
            if isinstance(w, Int8Linear):
                w.kernel, seen = kernel, seen + 1
    if isinstance(model.globals.lm_head, Int8Linear):
        model.globals.lm_head.kernel, seen = kernel, seen + 1
    return seen


def test_int8_draft_on_the_fused_kernel_keeps_greedy_output_exact(tiny_pair):
    """An int8 draft whose linears run the fused kernel (interpreted here) computes its dequantized weights'
    logits, and speculative greedy output still equals the target's own."""
    target_path, draft_path = tiny_pair
    target = load_model(target_path, CPU, torch.float32)
    draft = load_model(draft_path, CPU, torch.float32, int8=True)
    ids, pos = torch.arange(3, 15), torch.arange(12)
    mask = pos[None, :] <= pos[:, None]
    _use_kernel(draft, "dequant")
    ref = draft.forward(ids, pos, pos, mask, draft.new_cache(12))
    assert _use_kernel(draft, "triton") > 0
    got = draft.forward(ids, pos, pos, mask, draft.new_cache(12))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    engine = Engine(target, load_tokenizer(target_path), draft, context=128, tree=TreeConfig(budget=8))
    prompt = [5, 9, 17, 33, 4]
    want = engine.generate(prompt, 12, method="ar").tokens
    assert engine.generate(prompt, 12, method="specexec").tokens == want


# ---------------------------------------------------------------------------------------------- GPU


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 16, 32, 48, 64, 128, 300])
def test_cuda_kernel_matches_dequantized_and_w8a8(rows, monkeypatch):
    """The compiled kernel at every row tile; the "triton" Int8Linear runs it up to TRITON_MAX_ROWS rows and
    bitsandbytes' W8A8 (the coarser one: activations quantized too) beyond."""
    from specexec import model

    torch.manual_seed(rows)
    dev = torch.device("cuda")
    w = torch.randn(4096 + 96, 1000)  # uneven inner dimension, outputs beyond 8192 / 32 column tiles
    monkeypatch.setattr(model, "CUDA_INT8_KERNEL", "triton")
    q = Int8Linear(w).to(dev)
    assert q.kernel == "triton"
    x = torch.randn(rows, 1000, device=dev, dtype=torch.bfloat16)
    ref = x.float() @ q.dequantize().T
    fused = int8mm.matmul(x, q.qweight, q.scale)
    assert fused.dtype == torch.bfloat16
    assert (fused.float() - ref).abs().max() <= 1e-2 * ref.abs().max()
    got = q.linear(x)
    if rows <= model.TRITON_MAX_ROWS:
        assert torch.equal(got, fused)
    assert (got.float() - ref).abs().max() <= 0.05 * ref.abs().max()
    monkeypatch.setattr(model, "CUDA_INT8_KERNEL", "bnb")
    assert Int8Linear(w).to(dev).kernel == "bnb"


@cuda
@pytest.mark.cuda
def test_cuda_kernel_replays_in_a_graph():
    dev = torch.device("cuda")
    torch.manual_seed(0)
    q = Int8Linear(torch.randn(512, 256), kernel="triton").to(dev)
    q.kernel = "triton"
    x = torch.randn(32, 256, device=dev, dtype=torch.bfloat16)
    want = q.linear(x)  # compiled outside the capture (as StaticPasses warms up before capturing)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = q.linear(x)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, q.linear(x))
    assert not torch.equal(out, want)
