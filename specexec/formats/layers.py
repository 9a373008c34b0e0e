"""A pass's decoder layers in one C call, for a CPU model with block weights (4-bit, Q6_K: ``layers.c``).

A small model's pass on a CPU spends about as long between its products as in them: a dozen torch operations per
layer, each a Python call of some microseconds. :class:`NativeLayers` runs every layer of a pass in one call of the
package's C kernels instead (the same products, ``q4.c``, and attention, ``attn.c``), for the layer shape most
checkpoints share: pre-norm RMSNorm, fused q/k/v (with or without a bias), rotate-half RoPE, SiLU-gated MLP, fp32
activations and cache, no sliding window or soft-capping (:meth:`NativeLayers.of` says None otherwise). Every
row's arithmetic depends on that row alone, so a 4-bit target's shape-invariant passes run it too (a position gets
the same bits in any pass). Its numerics differ from the torch layers' in rounding only.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from specexec.formats import native
from specexec.formats.blocks import BLOCK_LINEARS, table

WEIGHTS = ("attn_norm", "wqkv", "bqkv", "wo", "mlp_norm", "w13", "w2")  # layers.c's order (a missing bias: 0)
LINEARS = ("wqkv", "wo", "w13", "w2")


class NativeLayers:
    """Every layer's weight addresses, laid out once for ``q4_layers`` (the model's weights must stay alive and in
    place, as a resident model's do)."""

    def __init__(self, cfg: Any, layers: list[Any]) -> None:
        self.cfg = cfg
        self.keep = layers  # the weights whose addresses the tables hold
        self.tables = [table(w[n]) for w in layers for n in LINEARS]  # each product's parts (block_matmul)
        ptrs, tables = [], iter(self.tables)
        for w in layers:
            for name in WEIGHTS:
                t = w.get(name)
                ptrs.append(0 if t is None else next(tables).data_ptr() if name in LINEARS else t.data_ptr())
        self.ptrs = torch.tensor(ptrs, dtype=torch.int64)
        self.inter = layers[0]["w2"].shape[1]
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else 1.0 / math.sqrt(cfg.head_dim)

    @classmethod
    def of(cls, cfg: Any, layers: list[Any] | None, device: torch.device, dtype: torch.dtype,
           local_rope: bool = False) -> NativeLayers | None:  # fmt: skip
        """The layer table for a model (its :class:`~specexec.model.transformer.ModelConfig`, its resident layers'
        weights, None when they are streamed; ``local_rope``: its sliding layers have a RoPE base of their own), or
        None where its layers are not the shape ``layers.c`` runs or the C kernels are unavailable here."""
        c = cfg
        if layers is None or device.type != "cpu" or dtype != torch.float32:
            return None
        if c.qk_norm or c.sandwich_norm or c.norm_offset or c.activation != "silu" or c.attn_softcap is not None:
            return None
        if c.sliding_window is not None or local_rope or c.head_dim > 1024 or c.head_dim % 2:
            return None
        for w in layers:
            if not all(isinstance(w.get(n), BLOCK_LINEARS) for n in LINEARS):
                return None
            if set(w) - set(WEIGHTS):
                return None
            dense = [w[n] for n in ("attn_norm", "mlp_norm", "bqkv") if n in w]
            if any(t.dtype != torch.float32 or not t.is_contiguous() for t in dense):
                return None
        if native.available() is not None:
            return None
        return cls(c, layers)

    def run(self, x: Tensor, cos: Tensor, sin: Tensor, cache: Any, slots: Tensor, rows: Any) -> Tensor:
        """x (T, D) fp32 through every layer (a new tensor); ``cos``/``sin`` (T, 1, hd) from ``rope_tables``;
        the pass's keys and values go to ``cache`` at ``slots`` (T,); ``rows``: each row's visible slots
        (:class:`~specexec.model.attention.RowKeys`)."""
        c = self.cfg
        T = x.shape[0]
        out = x.float().contiguous().clone()
        cs, sn = cos.reshape(T, -1).float().contiguous(), sin.reshape(T, -1).float().contiguous()
        k, v = cache.k, cache.v
        assert k.dtype == torch.float32 and k.is_contiguous() and v.is_contiguous()
        slots = slots.to(torch.int64).contiguous()
        failed = native.kernel().q4_layers(
            c.num_layers, T, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, self.inter, out.data_ptr(),
            self.ptrs.data_ptr(), cs.data_ptr(), sn.data_ptr(), k.data_ptr(), v.data_ptr(),
            k.stride(0), k.stride(1), slots.data_ptr(), rows.idx.data_ptr(), rows.start.data_ptr(), self.scale,
            c.rms_norm_eps,
        )  # fmt: skip
        if failed:
            raise MemoryError("the CPU layer kernel could not allocate its scratch memory")
        return out
