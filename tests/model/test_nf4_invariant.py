"""NF4 weights in shape-invariant passes: dequantized once per linear call, then one fixed product configuration.

The CPU tests run the code path :func:`specexec.formats.dense.tiled_linear` takes for a quantized weight with a
dense form (``invariant_weight``), with a counting stand-in and, where bitsandbytes imports, with a real
:class:`~specexec.formats.nf4.NF4Linear`."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from specexec.formats.dense import Tiling, invariant_weight, tiled_linear

ROWS = (1, 7, 128, 300)
TILINGS = (Tiling(rows=4), Tiling(rows=16, loop=True), Tiling(rows=128, loop=True))


class CountingDequant:
    """A stand-in for a streamed 4-bit weight: ``invariant_weight`` dequantizes (here: codes * scale, elementwise,
    as NF4's lookup times its block scale) and counts its calls; ``linear`` must not be used by invariant passes."""

    def __init__(self, out_f: int, in_f: int) -> None:
        gen = torch.Generator().manual_seed(3)
        self.codes = torch.randint(-8, 8, (out_f, in_f), generator=gen).float()
        self.scale = torch.rand(out_f, 1, generator=gen) / in_f
        self.calls = 0

    def invariant_weight(self) -> Tensor:
        self.calls += 1
        return self.codes * self.scale

    def linear(self, x: Tensor, invariant: bool = False) -> Tensor:
        raise AssertionError("an invariant pass multiplied the quantized weight tile by tile")


def _rows_agree(w: object, tiling: Tiling, in_f: int) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(max(ROWS), in_f, generator=gen)
    alone = torch.cat([tiled_linear(x[i : i + 1], w, tiling) for i in range(max(ROWS))])
    for n in ROWS:
        y = tiled_linear(x[:n], w, tiling)
        assert torch.equal(y, alone[:n]), (n, tiling)


@pytest.mark.parametrize("tiling", TILINGS, ids=lambda t: f"tile{t.rows}{'-loop' if t.loop else ''}")
def test_dequantized_once_and_rows_invariant(tiling: Tiling) -> None:
    w = CountingDequant(96, 64)
    for n in ROWS:
        before = w.calls
        tiled_linear(torch.randn(n, 64), w, tiling)
        assert w.calls == before + 1, f"{n} rows dequantized {w.calls - before} times"
    _rows_agree(w, tiling, 64)


def test_dense_and_kernel_weights_pass_through() -> None:
    dense = torch.randn(4, 4)
    assert invariant_weight(dense) is dense

    class Kernel:  # int8/q4-like: its own invariant kernel, no dense form
        def linear(self, x: Tensor, invariant: bool = False) -> Tensor:
            return x

    k = Kernel()
    assert invariant_weight(k) is k


def _nf4() -> object:
    try:
        from specexec.formats import nf4

        nf4.nf4_code("cpu")
    except Exception as e:  # bitsandbytes without its CPU kernels
        pytest.skip(f"bitsandbytes NF4 unavailable on the CPU: {e}")
    return nf4


def _nf4_linear(nf4: object, device: str, out_f: int = 96, in_f: int = 128) -> object:
    w = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(7)).to(device)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    packed, absmax = nf4.quantize_nf4(w.to(dtype), 64)  # type: ignore[attr-defined]
    scratch = nf4.DequantScratch(out_f * in_f, dtype, torch.device(device)) if device == "cuda" else None  # type: ignore[attr-defined]
    return nf4.NF4Linear(packed, absmax, (out_f, in_f), dtype, 64, nf4.nf4_code(device), scratch)  # type: ignore[attr-defined]


def _count_dequant(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    import bitsandbytes.functional as bf

    calls = [0]
    real = bf.dequantize_4bit

    def counting(*a: object, **k: object) -> Tensor:
        calls[0] += 1
        return real(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(bf, "dequantize_4bit", counting)
    return calls


@pytest.mark.parametrize("tiling", TILINGS[1:], ids=lambda t: f"tile{t.rows}-loop")
def test_bnb_nf4_cpu(tiling: Tiling, monkeypatch: pytest.MonkeyPatch) -> None:
    nf4 = _nf4()
    lin = _nf4_linear(nf4, "cpu")
    calls = _count_dequant(monkeypatch)
    for n in ROWS:
        before = calls[0]
        tiled_linear(torch.randn(n, 128), lin, tiling)
        assert calls[0] == before + 1
    _rows_agree(lin, tiling, 128)


@pytest.mark.cuda
@pytest.mark.parametrize("tiling", (Tiling(rows=16), Tiling(rows=128, loop=True)), ids=("tile16", "tile128-loop"))
def test_bnb_nf4_cuda(tiling: Tiling, monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    nf4 = _nf4()
    lin = _nf4_linear(nf4, "cuda", 1024, 1024)
    calls = _count_dequant(monkeypatch)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(300, 1024, generator=gen).to("cuda", torch.bfloat16)
    alone = torch.cat([tiled_linear(x[i : i + 1], lin, tiling) for i in range(300)])
    for n in ROWS:
        before = calls[0]
        y = tiled_linear(x[:n], lin, tiling)
        assert calls[0] == before + 1
        assert torch.equal(y, alone[:n]), n
