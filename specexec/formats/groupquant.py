"""Group-wise 2/3/4-bit weights (``q2``, ``q3``, ``q4``): a draft weight format for self-derived drafts.

Format (per linear weight W (out, in)): the input columns of each output row are split into groups of
:data:`~specexec.model.sizes.GROUP_SIZE` (64; a last partial group is padded). Each group stores an fp16 ``offset`` m
(its minimum, rounded down to fp16) and an fp16 ``scale`` s ((max - m) / (2^bits - 1), rounded up to fp16), and every
value as the unsigned code q = round((w - m) / s) in [0, 2^bits - 1]: round-to-nearest, asymmetric min/max (the
zero point of the GPTQ/HQQ papers is -m / s here, kept as the offset m so the error bound holds with the stored fp16
values). The dequantized weight is m + q * s, within s / 2 of W everywhere (the rounding directions of m and s
guarantee that no code is clamped).

Packing: along each row, every 8 consecutive codes are one ``8 * bits``-bit little-endian integer (code i at bit
``bits * i``) stored as ``bits`` bytes -- 2-bit: 4 codes a byte; 3-bit: 8 codes in 3 bytes; 4-bit: 2 a byte. So a
weight takes ``out * groups * (64 * bits / 8 + 4)`` bytes: 0.3125 (q2), 0.4375 (q3), 0.5625 (q4) bytes a parameter,
exactly :func:`specexec.model.sizes.group_linear_bytes`.

Compute (:class:`GroupQuantLinear`): dequantize the whole weight into the compute dtype, then one matmul (the dense
:func:`specexec.formats.dense.linear`), on any device with the same torch ops -- correct, not fast: there is no fused
low-bit kernel here. A draft only proposes, so the quantization error changes acceptance, never the output.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

GROUP_SIZE = 64  # input columns per group
GROUP_BITS = {"q4": 4, "q3": 3, "q2": 2}  # bits a code; an fp16 scale and an fp16 offset per group
CODES_PER_WORD = 8  # codes packed into one `bits`-byte word


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """codes (rows, n) uint8 in [0, 2^bits), n a multiple of 8 -> (rows, n * bits / 8) uint8 (see module doc)."""
    rows, n = codes.shape
    if n % CODES_PER_WORD:
        raise ValueError(f"{n} codes a row is not a multiple of {CODES_PER_WORD}")
    c = codes.reshape(rows, n // CODES_PER_WORD, CODES_PER_WORD).to(torch.int32)
    shifts = torch.arange(CODES_PER_WORD, dtype=torch.int32, device=codes.device) * bits
    word = (c << shifts).sum(-1, dtype=torch.int32)  # (rows, n/8) holds 8 * bits <= 32 bits
    byte_shifts = torch.arange(bits, dtype=torch.int32, device=codes.device) * 8
    out = (word[..., None] >> byte_shifts) & 0xFF  # (rows, n/8, bits)
    return out.to(torch.uint8).reshape(rows, n // CODES_PER_WORD * bits)


def unpack_codes(packed: Tensor, bits: int) -> Tensor:
    """The inverse of :func:`pack_codes`: (rows, n * bits / 8) uint8 -> (rows, n) uint8."""
    rows, nb = packed.shape
    if nb % bits:
        raise ValueError(f"{nb} packed bytes a row is not a multiple of {bits}")
    b = packed.reshape(rows, nb // bits, bits).to(torch.int32)
    byte_shifts = torch.arange(bits, dtype=torch.int32, device=packed.device) * 8
    word = (b << byte_shifts).sum(-1, dtype=torch.int32)  # (rows, n/8)
    shifts = torch.arange(CODES_PER_WORD, dtype=torch.int32, device=packed.device) * bits
    codes = (word[..., None] >> shifts) & ((1 << bits) - 1)  # (rows, n/8, 8)
    return codes.to(torch.uint8).reshape(rows, nb // bits * CODES_PER_WORD)


def _fp16_down(x: Tensor) -> Tensor:
    """fp32 ``x`` -> fp16 values <= x (nearest rounding moves by at most half an ulp: step below it first)."""
    return (x - x.abs() * 2.0**-10 - 2.0**-24).to(torch.float16)


def _fp16_up(x: Tensor) -> Tensor:
    """fp32 ``x`` >= 0 -> fp16 values >= x."""
    return (x * (1 + 2.0**-10) + 2.0**-24).to(torch.float16)


ROW_CHUNK = 2048  # rows quantized at once (bounds the fp32 temporaries of a large lm_head)
CLIP_RATIOS = (0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.6)  # range fractions tried by refine


def _groups(w: Tensor) -> Tensor:
    """w (rows, in) -> fp32 (rows, groups, GROUP_SIZE); a last partial group is padded with the row's last value
    (it never widens a group's range)."""
    rows, inp = w.shape
    groups = -(-inp // GROUP_SIZE)
    wf = w.detach().to(torch.float32)
    pad = groups * GROUP_SIZE - inp
    if pad:
        wf = torch.cat([wf, wf[:, -1:].expand(rows, pad)], dim=1)
    return wf.reshape(rows, groups, GROUP_SIZE)


def _codes(g: Tensor, offset: Tensor, scale: Tensor, top: int) -> Tensor:
    return torch.round((g - offset.float()[..., None]) / scale.float()[..., None]).clamp_(0, top)


def _sq_error(g: Tensor, offset: Tensor, scale: Tensor, top: int) -> Tensor:
    q = _codes(g, offset, scale, top)
    return (torch.addcmul(offset.float()[..., None], q, scale.float()[..., None]) - g).square_().sum(-1)


def _refine(g: Tensor, offset: Tensor, scale: Tensor, top: int) -> tuple[Tensor, Tensor]:
    """A cheap data-free refinement of round-to-nearest: per group, try the range shrunk about its centre to each
    of :data:`CLIP_RATIOS`, move the offset to the least-squares value for the codes it gives (one HQQ-style
    alternating step with p = 2), and keep whichever (offset, scale) -- the min/max one included -- has the
    smallest squared error |W - dequant|^2 with the stored fp16 values."""
    lo, hi = g.amin(-1), g.amax(-1)
    best_err = _sq_error(g, offset, scale, top)
    for ratio in CLIP_RATIOS:
        half = (hi - lo) * ratio / 2
        s = ((2 * half) / top).clamp_(min=2.0**-24).to(torch.float16)
        m = ((lo + hi) / 2 - half).to(torch.float16)
        q = _codes(g, m, s, top)
        m = (g - q * s.float()[..., None]).mean(-1).to(torch.float16)  # least-squares offset for these codes
        err = _sq_error(g, m, s, top)
        better = err < best_err
        offset, scale = torch.where(better, m, offset), torch.where(better, s, scale)
        best_err = torch.where(better, err, best_err)
    return offset, scale


def _quantize_rows(w: Tensor, bits: int, refine: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(packed, scale, offset) of the rows ``w`` (see :meth:`GroupQuantLinear.quantize`)."""
    g = _groups(w)
    top = (1 << bits) - 1
    offset = _fp16_down(g.amin(-1))  # (rows, groups)
    scale = _fp16_up((g.amax(-1) - offset.float()) / top)
    if refine:
        offset, scale = _refine(g, offset, scale, top)
    codes = _codes(g, offset, scale, top).to(torch.uint8).reshape(g.shape[0], -1)
    return pack_codes(codes, bits).contiguous(), scale.contiguous(), offset.contiguous()


class GroupQuantLinear:
    """A linear weight (out, in) in the ``q2``/``q3``/``q4`` format (see the module doc). ``linear(x)``:
    (T, in) -> (T, out) in x's dtype."""

    def __init__(self, packed: Tensor, scale: Tensor, offset: Tensor, shape: tuple[int, int], bits: int) -> None:
        self.packed = packed  # (out, groups * GROUP_SIZE * bits / 8) uint8
        self.scale = scale  # (out, groups) fp16
        self.offset = offset  # (out, groups) fp16
        self.shape = (int(shape[0]), int(shape[1]))
        self.bits = bits

    @classmethod
    def quantize(cls, w: Tensor, fmt: str, refine: bool = False) -> GroupQuantLinear:
        """Quantize ``w`` (out, in), any float dtype, on its device (computed in fp32, :data:`ROW_CHUNK` rows at
        a time). ``refine``: per group, the clipped range and least-squares offset of :func:`_refine` (lower
        squared error; the s / 2 bound no longer holds for clipped values)."""
        if fmt not in GROUP_BITS:
            raise ValueError(f"unknown group-wise format {fmt!r}; one of {', '.join(GROUP_BITS)}")
        bits = GROUP_BITS[fmt]
        out, inp = w.shape
        parts = [_quantize_rows(w[r : r + ROW_CHUNK], bits, refine) for r in range(0, out, ROW_CHUNK)]
        packed, scale, offset = (torch.cat([p[i] for p in parts]) for i in range(3))
        return cls(packed, scale, offset, (out, inp), bits)

    @property
    def fmt(self) -> str:
        return f"q{self.bits}"

    def codes(self) -> Tensor:
        """The unpacked codes (out, groups * GROUP_SIZE) uint8 (padding included)."""
        return unpack_codes(self.packed, self.bits)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The dense weight (out, in) in ``dtype`` (computed in fp32: offset + code * scale, then cast)."""
        out, inp = self.shape
        q = self.codes().reshape(out, -1, GROUP_SIZE).to(torch.float32)
        w = torch.addcmul(self.offset.float()[..., None], q, self.scale.float()[..., None])
        return w.reshape(out, -1)[:, :inp].to(dtype)

    def linear(self, x: Tensor) -> Tensor:
        """x (T, in) @ W.T -> (T, out): dequantize, then the dense linear (its CPU kernel choice included)."""
        from specexec.formats.dense import linear

        return linear(x, self.dequantize(x.dtype))

    def subset(self, ids: Tensor) -> GroupQuantLinear:
        """The output rows ``ids`` as their own weight (same codes, scales and offsets): a reduced draft head."""
        ids = ids.to(self.packed.device)
        return GroupQuantLinear(
            self.packed[ids].contiguous(),
            self.scale[ids].contiguous(),
            self.offset[ids].contiguous(),
            (int(ids.shape[0]), self.shape[1]),
            self.bits,
        )

    def to(self, device: torch.device) -> GroupQuantLinear:
        return GroupQuantLinear(
            self.packed.to(device), self.scale.to(device), self.offset.to(device), self.shape, self.bits
        )

    def nbytes(self) -> int:
        """Bytes held: packed codes + fp16 scales + fp16 offsets."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.offset))


def dequantize_resident(model: Any) -> int:
    """Replace, in place, every NF4 / group-wise weight of a CPU model by the dense fp32-or-``model.dtype`` tensor
    it dequantizes to; returns how many were replaced.

    On a CPU both formats compute as "dequantize, then the dense linear" on every pass, so the model's outputs are
    unchanged bit for bit (a test checks) while each pass skips the dequantization: for measurements that count
    tokens (acceptance), not for memory (the dense copy is what the format exists to avoid). int8 weights are left
    alone: their CPU kernel quantizes activations too, so they have no dense equivalent.
    """
    from specexec.formats.nf4 import NF4Linear

    if model.device.type != "cpu":
        raise ValueError("dequantize_resident is for CPU models (on CUDA NF4 runs fused kernels)")
    done = 0

    def dense(w: Any) -> Any:
        nonlocal done
        if isinstance(w, GroupQuantLinear):
            done += 1
            return w.dequantize(model.dtype)
        if isinstance(w, NF4Linear):
            done += 1
            return w.dequantize().to(model.dtype)
        return w

    model.globals.lm_head = dense(model.globals.lm_head)  # a low-bit model's embedding is already dense
    for layer in model.layers.layers:
        for k in list(layer):
            layer[k] = dense(layer[k])
    return done
