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

from specexec.formats.dense import Tiling, embed_rows, linear, tiled_linear
from specexec.formats.subset import SubsetHead
from specexec.model.attention import blocked, plan_keys, sdpa, sdpa_bias
from specexec.model.kv_cache import KVCache

LAYER_KEYS = ("attn_norm", "wqkv", "wo", "mlp_norm", "w13", "w2")


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
    # Mistral-style sliding-window attention: each position attends to at most this many latest positions. The
    # model attends to everything, so a context is capped at the window (where the two agree); None: no window.
    sliding_window: int | None = None

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
            sliding_window=_window(cfg),
        )


def _window(cfg: Mapping[str, Any]) -> int | None:
    """The attention window an HF config sets (Mistral's ``sliding_window``; Qwen2's only when
    ``use_sliding_window``), or None."""
    w = cfg.get("sliding_window")
    if not w or cfg.get("use_sliding_window", cfg.get("model_type") != "qwen2") is False:
        return None
    return int(w)


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
    """cos and sign-folded sin (T, 1, hd) for :func:`apply_rope` at ``positions`` (T,).

    cos and sin run over rows padded to 64 columns: a CPU kernel computes whole vectors with one routine and a
    ragged remainder with another (which may round differently), so the padding keeps every position's values on
    the vector routine whatever the pass's size."""
    half = inv_freq.shape[0]
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, hd/2)
    if half % 64:
        freqs = F.pad(freqs, (0, 64 - half % 64))
    cos, sin = freqs.cos()[:, :half], freqs.sin()[:, :half]
    return torch.cat((cos, cos), dim=-1).to(dtype)[:, None, :], torch.cat((-sin, sin), dim=-1).to(dtype)[:, None, :]


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
    # shape-invariant passes (a target's default, :mod:`specexec.loading.invariance`): each position's logits are
    # bit-identical whatever pass computes them. None: each pass takes the fastest kernels for its shape.
    tiling: Tiling | None = None
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
        t = self.tiling
        if t is None:
            x = embed_rows(self.globals.embed, tokens).to(self.dtype)  # (T, D)
            cos, sin = rope_tables(positions, self.inv_freq, self.dtype)
            bias = sdpa_bias(mask, self.dtype)

            def attend(q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
                return sdpa(q, keys, values, bias)

            x = self._layers(x, cos, sin, attend, cache_slots, mask.shape[1], cache, linear, trace, norm)
            if logits_rows is not None:
                x = x[logits_rows]
            return linear(norm(x, self.globals.norm, c.rms_norm_eps), head).float()
        # passes larger than the invariance was checked for run as consecutive passes; rows attend only to slots
        # written by earlier rows or passes (causal prefill, tree ancestry), so the result is the same
        T = tokens.shape[0]
        step = t.max_rows if trace is None else T
        hidden = [
            self._invariant_pass(tokens[a : a + step], positions[a : a + step], cache_slots[a : a + step],
                                 mask[a : a + step], cache, trace, norm)
            for a in range(0, T, step)
        ]  # fmt: skip
        x = hidden[0] if len(hidden) == 1 else torch.cat(hidden)
        if logits_rows is not None:
            x = x[logits_rows]
        out = [
            tiled_linear(norm(x[a : a + t.max_rows], self.globals.norm, c.rms_norm_eps), head, t)
            for a in range(0, x.shape[0], t.max_rows)
        ]
        return (out[0] if len(out) == 1 else torch.cat(out)).float()

    def _invariant_pass(
        self,
        tokens: Tensor,
        positions: Tensor,
        cache_slots: Tensor,
        mask: Tensor,
        cache: KVCache,
        trace: list[Tensor] | None,
        norm: Callable[[Tensor, Tensor, float], Tensor],
    ) -> Tensor:
        """One shape-invariant pass (at most ``tiling.max_rows`` rows); returns the rows' final hidden states.

        The rows are padded to whole row tiles for the whole pass (zero rows at position 0 that see slot 0 and
        write no keys), so every product and every elementwise kernel sees the same tiles in every pass."""
        t = self.tiling
        assert t is not None
        T = tokens.shape[0]
        P = t.pad(T)
        x = embed_rows(self.globals.embed, tokens).to(self.dtype)
        pos = positions
        if P != T:
            x = torch.cat((x, x.new_zeros(P - T, x.shape[1])))
            pos = torch.cat((positions, positions.new_zeros(P - T)))
        cos, sin = rope_tables(pos, self.inv_freq, self.dtype)
        plan = plan_keys(mask, positions, P, t.key_block, t.attn_rows)

        def attend(q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
            return blocked(q, keys, values, plan)

        def lin(a: Tensor, w: Any) -> Tensor:
            return tiled_linear(a, w, t)

        x = self._layers(x, cos, sin, attend, cache_slots, mask.shape[1], cache, lin, trace, norm)
        return x[:T]

    def _layers(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        attend: Callable[[Tensor, Tensor, Tensor], Tensor],
        cache_slots: Tensor,
        L: int,
        cache: KVCache,
        lin: Callable[[Tensor, Any], Tensor],
        trace: list[Tensor] | None = None,
        norm: Callable[[Tensor, Tensor, float], Tensor] = rms_norm,
    ) -> Tensor:
        """The decoder layers over x (P, D) (the pass's rows, and any padding rows after them); returns the final
        hidden states (P, D). Rows past ``cache_slots``'s length write no keys."""
        c = self.cfg
        P = x.shape[0]
        T = cache_slots.shape[0]
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.layers.begin()
        if trace is not None:
            trace.append(x[:T])
        for i in range(c.num_layers):
            w = self.layers.layer(i)
            h = norm(x, w["attn_norm"], c.rms_norm_eps)
            qkv = lin(h, w["wqkv"])
            if "bqkv" in w:
                qkv = qkv + w["bqkv"]
            # RoPE on the queries and keys together (one set of kernels; the same arithmetic per element)
            qk = apply_rope(qkv[:, : q_dim + kv_dim].view(P, c.num_heads + c.num_kv_heads, c.head_dim), cos, sin)
            q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
            v = qkv[:, q_dim + kv_dim :].reshape(P, c.num_kv_heads, c.head_dim)
            keys, values = cache.write(i, cache_slots, k[:T], v[:T], L)
            x = x + lin(attend(q, keys, values), w["wo"])
            h = norm(x, w["mlp_norm"], c.rms_norm_eps)
            gate, up = lin(h, w["w13"]).chunk(2, dim=-1)
            x = x + lin(F.silu(gate) * up, w["w2"])
            if trace is not None:
                trace.append(x[:T])
            self.layers.done(i)
        return x
