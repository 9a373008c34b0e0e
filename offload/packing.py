"""A layer's weights in a packed layer buffer: quantize a dense layer into a layout, view a buffer as weights."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from offload.layout import LINEARS, LayerLayout
from specexec.formats.nf4 import DequantScratch, NF4Linear, nf4_code, quantize_nf4


def quantize_layer(weights: Mapping[str, Tensor], layout: LayerLayout, device: torch.device) -> dict[str, Tensor]:
    """One dense layer (names as in :mod:`specexec.model.transformer`) -> tensors keyed by ``layout`` entry names, on
    CPU.

    Linears are quantized on ``device`` (fast on CUDA); norms and biases are cast to the layout's dtype.
    """
    fmt = layout.fmt
    out: dict[str, Tensor] = {}
    for name, w in weights.items():
        if name in LINEARS:
            packed, absmax = quantize_nf4(w.to(device=device, dtype=fmt.dtype), fmt.blocksize)
            out[f"{name}.nf4"], out[f"{name}.absmax"] = packed.cpu(), absmax.cpu()
        else:
            out[name] = w.to(fmt.dtype)
    return out


def max_linear_numel(layout: LayerLayout) -> int:
    """Values in the layout's largest linear weight (the dequantization scratch size)."""
    return max(math.prod(s) for n, s in layout.weight_shapes if n in LINEARS)


def layer_weights(layout: LayerLayout, buf: Tensor, scratch: DequantScratch | None = None) -> dict[str, Any]:
    """The model's per-layer mapping (see :mod:`specexec.model.transformer`) over a packed layer buffer, without copies.

    Dense layouts give tensor views; NF4 layouts give :class:`NF4Linear` objects for the linears. Build this once
    per buffer: the views follow whatever bytes are later copied into ``buf``.
    """
    views = layout.views(buf)
    if layout.fmt.kind == "dense":
        return views
    code = nf4_code(buf.device)
    out: dict[str, Any] = {}
    for name, shape in layout.weight_shapes:
        if name in LINEARS:
            out[name] = NF4Linear(
                views[f"{name}.nf4"],
                views[f"{name}.absmax"],
                shape,
                layout.fmt.dtype,
                layout.fmt.blocksize,
                code,
                scratch,
            )
        else:
            out[name] = views[name]
    return out


def dense_weights(layer: Mapping[str, Any]) -> dict[str, Tensor]:
    """A layer mapping with every NF4 linear dequantized (the dense model NF4 computes exactly, on CPU)."""
    return {k: (w.dequantize() if isinstance(w, NF4Linear) else w) for k, w in layer.items()}
