"""GGUF Q6_K blocks run as stored (:mod:`specexec.formats.blocks`): the values they unpack are ``gguf``'s bit for bit,
the kernel computes its integer definition bit for bit on every path, a row's result is the same in any pass, and a
fused weight of parts of different types computes each part's columns."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from specexec.formats import blocks, native, q4

pytestmark = pytest.mark.skipif(native.available() is not None, reason=str(native.available()))


def _q6_k(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Random Q6_K rows (n, k / 256 * 210): every bit pattern of the 6-bit values and the int8 sub-scales, fp16
    scales of real magnitude (gguf has no Q6_K quantizer)."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(n * k // 256, blocks.Q6_K_BYTES), dtype=np.uint8)
    b[:, -2:] = rng.uniform(0.0005, 0.01, size=(len(b), 1)).astype(np.float16).view(np.uint8)
    return torch.from_numpy(b.reshape(n, -1))


def test_the_values_are_ggufs_dequantization_bit_for_bit():
    raw = _q6_k(33, 768)
    want = torch.from_numpy(np.array(dequantize(raw.numpy(), Q.Q6_K), np.float32)).reshape(33, 768)
    w = blocks.Q6KLinear(raw, (33, 768))
    assert torch.equal(w.dequantize(), want)
    ids = torch.tensor([32, 0, 5])
    assert torch.equal(w.rows(ids), want[ids])
    assert torch.equal(w.subset(ids).dequantize(), want[ids])
    assert w.nbytes() == 33 * 3 * 210


def _reference(w: blocks.Q6KLinear, x: torch.Tensor) -> torch.Tensor:
    """The kernel's definition in torch: x's rows quantized to int8 per block of 256 (scale absmax / 127), each
    block's exact integer sum(sc * (q - 32) * a), then per output acc += (d * xd) * isum over the blocks in order,
    in fp32."""
    n, nb = w.shape[0], w.shape[1] // 256
    b = w.packed.reshape(n, nb, 210)
    d = b[..., 208:].contiguous().view(torch.float16).float()[..., 0]  # (n, nb)
    sc = b[..., 192:208].contiguous().view(torch.int8).long()  # (n, nb, 16)
    # the 6-bit values: gguf's dequantization divided by d * sc gives q - 32 exactly (a power-of-two-free integer)
    qv = torch.round(w.dequantize().reshape(n, nb, 16, 16) / (d[..., None, None] * sc[..., None].float())).long()
    qv = torch.where(sc[..., None] == 0, 0, qv)
    xr = x.float().reshape(-1, nb, 256)
    dx = xr.abs().amax(-1) / 127
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    qa = torch.round(xr * inv[..., None]).long().reshape(-1, nb, 16, 16)
    isum = torch.einsum("osji,rsji->rosj", qv, qa)  # exact int64 dots per sub-block
    isum = (isum * sc[None]).sum(-1)  # (rows, n, nb)
    acc = torch.zeros(x.shape[0], n)
    for s in range(nb):
        acc = acc + (d[None, :, s] * dx[:, s, None]) * isum[..., s].float()
    return acc


def test_the_kernel_computes_its_integer_definition_bit_for_bit():
    """Whatever path a row count takes (one row, groups of up to 4, the vector or the scalar code), every output is
    the same function of exact integers."""
    raw = _q6_k(37, 512, seed=1)
    raw.view(-1, 210)[3, 192:208] = 0  # zero sub-scales
    w = blocks.Q6KLinear(raw, (37, 512))
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(2)) * 3
    x[4] = 0  # a zero row: scale 0
    want = _reference(w, x)
    for a, b in ((0, 11), (0, 1), (3, 5), (2, 9), (7, 11)):
        assert torch.equal(w.linear(x[a:b]), want[a:b]), (a, b)
    scalar = torch.empty(11, 37)
    assert native.kernel().q6k_matmul_scalar(raw.data_ptr(), 37, 512, x.data_ptr(), 11, scalar.data_ptr()) == 0
    assert torch.equal(scalar, want)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if old > 1 else 2)
        assert torch.equal(w.linear(x), want)
    finally:
        torch.set_num_threads(old)


def test_a_fused_weight_of_mixed_types_computes_each_parts_columns():
    k = 512
    dense = torch.randn(24, k, generator=torch.Generator().manual_seed(3)) * 0.05
    a, b, c = q4.Q4Linear(dense[:16]), q4.Q4Linear(dense[16:]), blocks.Q6KLinear(_q6_k(8, k, seed=4), (8, k))
    fused = blocks.join([a, b, c])
    assert isinstance(fused, blocks.Fused) and [p.shape[0] for p in blocks.leaves(fused)] == [24, 8]
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(5))
    assert torch.equal(fused.linear(x), torch.cat((a.linear(x), b.linear(x), c.linear(x)), 1))
    assert torch.equal(fused.dequantize(), torch.cat((a.dequantize(), b.dequantize(), c.dequantize())))
    assert fused.nbytes() == a.nbytes() + b.nbytes() + c.nbytes()
    assert blocks.join([c]) is c
    with pytest.raises(ValueError):
        blocks.Fused([a, q4.Q4Linear(torch.zeros(4, 256))])
