"""Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2): pure compute, no I/O.

Modelled on gpt-fast: a small config dataclass, a static preallocated KV cache written by slot index, explicit
positions and an explicit boolean attention mask, so that tree attention (SpecExec, arXiv 2406.02532) is only a
different mask. The layer loop asks a *layer provider* for each layer's weights; a resident provider holds them
on the compute device, the offload streamer (package ``offload``) copies them in just in time. The model never
knows where its weights came from.

Shapes: T = tokens in this pass, L = cache length attended to (``mask.shape[1]``), D = hidden size,
H / KVH = query / key-value heads, hd = head dim, V = vocabulary.

Per-layer weight names (a mapping ``str -> Tensor | QuantizedLinear``):
``attn_norm`` (D), ``wqkv`` ((H+2*KVH)*hd, D) fused q/k/v, ``bqkv`` optional bias, ``wo`` (D, H*hd),
``mlp_norm`` (D), ``w13`` (2*I, D) fused gate/up, ``w2`` (D, I).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from specexec.formats.dense import embed_rows, linear
from specexec.formats.subset import SubsetHead
from specexec.model.kv_cache import KVCache

LAYER_KEYS = ("attn_norm", "wqkv", "wo", "mlp_norm", "w13", "w2")

# cuDNN's SDPA builds an execution plan per new (T, L) shape: 60-124 ms each on an H100 (L grows every step), and
# it runs 3x slower than needed for small T even when planned. The other backends handle our masks well.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (derived from an HF ``config.json``)."""

    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # I (MLP width)
    num_layers: int
    num_heads: int  # H
    num_kv_heads: int  # KVH (GQA when < H)
    head_dim: int  # hd
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None  # None, or {"rope_type": "llama3" | "linear", ...}
    qkv_bias: bool = False  # Qwen2
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    model_type: str = "llama"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("llama3", "linear", "default"):
                raise ValueError(f"unsupported rope scaling type {kind!r} (supported: llama3, linear)")

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        """Build from an HF config dict (transformers 4.x rope_theta/rope_scaling or 5.x rope_parameters)."""
        model_type = cfg.get("model_type", "llama")
        if model_type not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"unsupported model_type {model_type!r} (supported: llama, mistral, qwen2)")
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
            scaling = None
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=dict(scaling) if scaling else None,
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            model_type=model_type,
        )


class LayerProvider(Protocol):
    """Hands the model each decoder layer's weights, on the compute device, in order.

    ``begin()`` is called once per forward before layer 0 (a streamer starts prefetching), ``layer(i)`` returns
    layer i's weights ready to use on the current stream, ``done(i)`` is called after layer i's compute has
    been enqueued (a streamer may then reuse that buffer once the compute stream passes this point).
    """

    num_layers: int

    def begin(self) -> None: ...

    def layer(self, i: int) -> Mapping[str, Any]: ...

    def done(self, i: int) -> None: ...


class ResidentLayers:
    """All layers live on the compute device (the draft, or a target that fits)."""

    def __init__(self, layers: list[dict[str, Any]]) -> None:
        self.layers = layers
        self.num_layers = len(layers)

    def begin(self) -> None:
        pass

    def layer(self, i: int) -> Mapping[str, Any]:
        return self.layers[i]

    def done(self, i: int) -> None:
        pass


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm computed in fp32, as HF Llama/Qwen2 do."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    """Inverse RoPE frequencies (hd/2,), fp32, including llama3 / linear scaling."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    sc = cfg.rope_scaling
    if not sc:
        return inv
    kind = sc.get("rope_type", sc.get("type"))
    if kind == "linear":
        return inv / float(sc["factor"])
    if kind == "llama3":
        factor = float(sc["factor"])
        low, high = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
        old_ctx = float(sc["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


def apply_rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """Rotate-half RoPE. x (T, heads, hd); cos (T, 1, hd); ``sin_signed`` (T, 1, hd) is sin with its first half
    negated (:func:`rope_tables`), so the rotation is a swap of halves: ``x2 * -sin == -x2 * sin`` exactly."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * sin_signed


def rope_tables(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sign-folded sin (T, 1, hd) for :func:`apply_rope` at ``positions`` (T,)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, hd/2)
    cos = torch.cat((freqs, freqs), dim=-1).cos()
    sin = freqs.sin()
    return cos.to(dtype)[:, None, :], torch.cat((-sin, sin), dim=-1).to(dtype)[:, None, :]


def fused_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm through ``F.rms_norm`` (one fused kernel on CUDA where torch has it). Not bit-identical to
    :func:`rms_norm` (the weight multiplies before the cast): for a draft, whose numerics only change what it
    proposes, never for a target."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


@dataclass
class Globals:
    """The weights outside the layer loop."""

    embed: Tensor  # (V, D)
    norm: Tensor  # (D,)
    lm_head: Any  # (V, D) tensor (tied: the same tensor as embed) or a quantized linear


@dataclass
class Transformer:
    """A Llama-family decoder whose layers come from a :class:`LayerProvider`."""

    cfg: ModelConfig
    globals: Globals
    layers: LayerProvider
    device: torch.device
    dtype: torch.dtype
    # a self-derived draft: the target layer each of its layers is (None: not derived from the target); lets it
    # take its committed prefix's keys/values from the target (``DraftModel.share_prefix``)
    source_layers: tuple[int, ...] | None = None
    inv_freq: Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.inv_freq = rope_inv_freq(self.cfg).to(self.device)

    def new_cache(self, capacity: int) -> KVCache:
        """A static KV cache for ``capacity`` slots."""
        c = self.cfg
        return KVCache(c.num_layers, c.num_kv_heads, capacity, c.head_dim, self.dtype, self.device)

    @torch.inference_mode()
    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        cache_slots: Tensor,
        mask: Tensor,
        cache: KVCache,
        logits_rows: Tensor | slice | None = None,
        trace: list[Tensor] | None = None,
        fused_norm: bool = False,
    ) -> Tensor:
        """One pass. tokens/positions/cache_slots (T,) long; mask (T, L) bool, True = may attend to slot.

        Writes this pass's keys/values into ``cache`` at ``cache_slots`` (every slot a row attends to must be
        written before or in this pass). Returns fp32 logits (T', V) for ``logits_rows`` (default all rows).
        ``trace``: append the residual stream (T, D) entering the first layer and leaving each layer.
        ``fused_norm``: RMSNorm through one fused kernel (:func:`fused_rms_norm`; a draft's passes on a GPU, never
        a target's).
        """
        c = self.cfg
        head = self.globals.lm_head
        if isinstance(head, SubsetHead):
            head.observe(tokens)
        norm = fused_rms_norm if fused_norm else rms_norm
        x = embed_rows(self.globals.embed, tokens).to(self.dtype)  # (T, D)
        cos, sin = rope_tables(positions, self.inv_freq, self.dtype)
        # the additive bias SDPA would make from the boolean mask in every layer, made once (the same values)
        attn_mask = torch.zeros(mask.shape, dtype=self.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        attn_mask = attn_mask[None, None]  # (1, 1, T, L)
        with sdpa_kernel(_SDPA_BACKENDS):
            x = self._layers(x, cos, sin, attn_mask, cache_slots, mask.shape[1], cache, trace, norm)
        if logits_rows is not None:
            x = x[logits_rows]
        x = norm(x, self.globals.norm, c.rms_norm_eps)
        return linear(x, self.globals.lm_head).float()

    def _layers(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        attn_mask: Tensor,
        cache_slots: Tensor,
        L: int,
        cache: KVCache,
        trace: list[Tensor] | None = None,
        norm: Callable[[Tensor, Tensor, float], Tensor] = rms_norm,
    ) -> Tensor:
        """The decoder layers over x (T, D); returns the final hidden states (T, D)."""
        c = self.cfg
        T = x.shape[0]
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        gqa = c.num_heads != c.num_kv_heads
        groups = c.num_heads // c.num_kv_heads
        self.layers.begin()
        if trace is not None:
            trace.append(x)
        for i in range(c.num_layers):
            w = self.layers.layer(i)
            h = norm(x, w["attn_norm"], c.rms_norm_eps)
            qkv = linear(h, w["wqkv"])
            if "bqkv" in w:
                qkv = qkv + w["bqkv"]
            # RoPE on the queries and keys together (one set of kernels; the same arithmetic per element)
            qk = apply_rope(qkv[:, : q_dim + kv_dim].view(T, c.num_heads + c.num_kv_heads, c.head_dim), cos, sin)
            q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
            v = qkv[:, q_dim + kv_dim :]
            keys, values = cache.write(i, cache_slots, k, v.reshape(T, c.num_kv_heads, c.head_dim), L)
            if gqa:  # expand KV heads: SDPA's GQA mode falls back to the slow math kernel when a mask is given
                keys = keys.repeat_interleave(groups, dim=0)
                values = values.repeat_interleave(groups, dim=0)
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], keys[None], values[None], attn_mask=attn_mask
            )  # (1, H, T, hd)
            x = x + linear(o[0].transpose(0, 1).reshape(T, q_dim), w["wo"])
            h = norm(x, w["mlp_norm"], c.rms_norm_eps)
            gate, up = linear(h, w["w13"]).chunk(2, dim=-1)
            x = x + linear(F.silu(gate) * up, w["w2"])
            if trace is not None:
                trace.append(x)
            self.layers.done(i)
        return x
