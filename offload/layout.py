"""The flat byte layout of one decoder layer: every tensor at a fixed, aligned offset in ONE uint8 buffer.

One layer = one buffer = one host→device copy (SpecExec packs each offloaded layer into one storage for the
same reason). The layout depends only on the model config and the storage format, so the memory plan knows the
exact bytes per layer before anything is loaded, every layer of a model shares one layout, and any GPU ring slot
can hold any layer. Views are re-created from a buffer with :meth:`LayerLayout.views` (no copies).

Formats: ``dense`` keeps every tensor in one dtype (bf16/fp16/fp32); ``nf4`` stores the four linear weights as
bitsandbytes NF4 (``<name>.nf4``: packed 4-bit codes, two per byte, (ceil(n/2),) uint8; ``<name>.absmax``: one fp32
scale per ``blocksize`` values) and the norms/biases in the compute dtype.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from specexec.model.transformer import ModelConfig

ALIGN = 256  # bytes: every tensor starts at a multiple of this (≥ what any GEMM / DMA path wants)
PAGE = 4096  # bytes: a whole layer buffer is a multiple of this (page-aligned reads and pinning)
LINEARS = ("wqkv", "wo", "w13", "w2")  # the weights NF4 quantizes; norms and biases stay 16-bit


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16' (stable across torch versions, used in cache keys and manifests)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dt


@dataclass(frozen=True)
class LayerFormat:
    """How a layer's weights are stored (and streamed)."""

    kind: str  # "dense" or "nf4"
    dtype: torch.dtype  # dense: every tensor's dtype; nf4: norms/biases and the dequantized weights (compute dtype)
    blocksize: int = 64  # nf4 only: values sharing one absmax scale

    def __post_init__(self) -> None:
        if self.kind not in ("dense", "nf4"):
            raise ValueError(f"LayerFormat.kind must be 'dense' or 'nf4', got {self.kind!r}")
        if self.kind == "nf4" and self.blocksize not in (32, 64, 128, 256, 512, 1024, 2048, 4096):
            raise ValueError(f"NF4 blocksize must be a power of two in 32..4096, got {self.blocksize}")

    @property
    def name(self) -> str:
        """'bfloat16' or 'nf4-b64-bfloat16' (used in cache keys and in the plan's text)."""
        if self.kind == "dense":
            return dtype_name(self.dtype)
        return f"nf4-b{self.blocksize}-{dtype_name(self.dtype)}"


@dataclass(frozen=True)
class Entry:
    """One tensor inside a layer buffer."""

    name: str  # model weight name ("wo") or NF4 part ("wo.nf4", "wo.absmax")
    offset: int  # bytes from the buffer start, a multiple of ALIGN
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one decoder layer's weights (names as in :mod:`specexec.model.transformer`), (out, in) for linears."""
    D, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd
    shapes: dict[str, tuple[int, ...]] = {
        "attn_norm": (D,),
        "wqkv": (qkv, D),
        "wo": (D, cfg.num_heads * hd),
        "mlp_norm": (D,),
        "w13": (2 * I, D),
        "w2": (D, I),
    }
    if cfg.qkv_bias:
        shapes["bqkv"] = (qkv,)
    if cfg.qk_norm:
        shapes["q_norm"] = shapes["k_norm"] = (hd,)
    if cfg.sandwich_norm:
        shapes["post_attn_norm"] = shapes["post_mlp_norm"] = (D,)
    return shapes


@dataclass(frozen=True)
class LayerLayout:
    """Offsets of every tensor of one layer in a flat uint8 buffer of ``nbytes`` bytes."""

    fmt: LayerFormat
    entries: tuple[Entry, ...]
    weight_shapes: tuple[tuple[str, tuple[int, ...]], ...]  # the model-level weights and their logical shapes
    nbytes: int  # total buffer size, a multiple of PAGE

    def entry(self, name: str) -> Entry:
        for e in self.entries:
            if e.name == name:
                return e
        raise KeyError(name)

    def views(self, buf: Tensor) -> dict[str, Tensor]:
        """Typed views (no copies) of every entry of ``buf`` (uint8, (nbytes,), any device)."""
        if buf.dtype != torch.uint8 or buf.numel() < self.nbytes:
            raise ValueError(f"layer buffer must be uint8 with >= {self.nbytes} bytes, got {buf.dtype} {buf.numel()}")
        return {e.name: buf[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in self.entries}

    def pack(self, tensors: Mapping[str, Tensor], buf: Tensor) -> None:
        """Copy ``tensors`` (keyed by entry name, any device) into ``buf``; zero the padding."""
        names = {e.name for e in self.entries}
        if set(tensors) != names:
            raise ValueError(f"layer tensors {sorted(tensors)} do not match the layout {sorted(names)}")
        buf.zero_()
        views = self.views(buf)
        for name, t in tensors.items():
            v = views[name]
            if tuple(t.shape) != tuple(v.shape) or t.dtype != v.dtype:
                raise ValueError(f"{name}: got {tuple(t.shape)} {t.dtype}, layout wants {tuple(v.shape)} {v.dtype}")
            v.copy_(t)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": {"kind": self.fmt.kind, "dtype": dtype_name(self.fmt.dtype), "blocksize": self.fmt.blocksize},
            "entries": [[e.name, e.offset, list(e.shape), dtype_name(e.dtype)] for e in self.entries],
            "weights": [[n, list(s)] for n, s in self.weight_shapes],
            "nbytes": self.nbytes,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LayerLayout:
        f = d["format"]
        return cls(
            fmt=LayerFormat(f["kind"], dtype_from_name(f["dtype"]), int(f["blocksize"])),
            entries=tuple(Entry(n, int(o), tuple(s), dtype_from_name(t)) for n, o, s, t in d["entries"]),
            weight_shapes=tuple((n, tuple(s)) for n, s in d["weights"]),
            nbytes=int(d["nbytes"]),
        )


def layer_layout(cfg: ModelConfig, fmt: LayerFormat) -> LayerLayout:
    """The layout of every decoder layer of ``cfg`` stored as ``fmt``."""
    shapes = layer_shapes(cfg)
    parts: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    for name, shape in shapes.items():
        if fmt.kind == "nf4" and name in LINEARS:
            n = math.prod(shape)
            parts.append((f"{name}.nf4", ((n + 1) // 2,), torch.uint8))
            parts.append((f"{name}.absmax", (-(-n // fmt.blocksize),), torch.float32))
        else:
            parts.append((name, shape, fmt.dtype))
    entries, offset = [], 0
    for name, shape, dtype in parts:
        e = Entry(name, offset, shape, dtype)
        entries.append(e)
        offset = _round_up(offset + e.nbytes, ALIGN)
    return LayerLayout(fmt, tuple(entries), tuple(shapes.items()), _round_up(max(offset, 1), PAGE))
