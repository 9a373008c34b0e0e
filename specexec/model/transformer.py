"""The decoder of the Llama lineage (Llama 2/3, Mistral, Qwen2/3, Gemma 2/3, Phi-3): pure compute, no I/O.

Modelled on gpt-fast: a small config dataclass, a static preallocated KV cache written by slot index, explicit
positions and an explicit boolean attention mask, so that tree attention (SpecExec, arXiv 2406.02532) is only a
different mask. The layer loop asks a *layer provider* for each layer's weights; a resident provider holds them
on the compute device, the offload streamer (package ``offload``) copies them in just in time. The model never
knows where its weights came from.

Shapes: T = tokens in this pass, L = cache length attended to (``mask.shape[1]``), D = hidden size,
H / KVH = query / key-value heads, hd = head dim, V = vocabulary.

Per-layer weight names (a mapping ``str -> Tensor | QuantizedLinear``):
``attn_norm`` (D), ``wqkv`` ((H+2*KVH)*hd, D) fused q/k/v, ``bqkv`` optional bias, ``wo`` (D, H*hd),
``mlp_norm`` (D), ``w13`` (2*I, D) fused gate/up, ``w2`` (D, I); with ``ModelConfig.qk_norm`` also ``q_norm`` and
``k_norm`` (hd), with ``sandwich_norm`` also ``post_attn_norm`` and ``post_mlp_norm`` (D).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from specexec.formats.dense import Tiling, embed_rows, linear, tiled_linear
from specexec.formats.layers import NativeLayers
from specexec.formats.subset import SubsetHead
from specexec.model import tree_attn
from specexec.model.attention import blocked, native, native_ready, plan_keys, row_keys, sdpa, sdpa_bias
from specexec.model.joint import KVRegion
from specexec.model.kv_cache import KVCache
from specexec.model.tree_attn import tree_attention, tree_keys

LAYER_KEYS = ("attn_norm", "wqkv", "wo", "mlp_norm", "w13", "w2")


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3")
"""HF ``model_type`` values this decoder runs (a multimodal ``gemma3`` checkpoint runs its ``text_config``)."""

# defaults of the transformers config classes for keys a published config.json may leave out
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "tie_word_embeddings": True, "max_position_embeddings": 8192},
    "gemma3_text": {"vocab_size": 262208, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_theta": 1_000_000.0,
                    "rope_local_base_freq": 10_000.0, "tie_word_embeddings": True, "max_position_embeddings": 131072},
}  # fmt: skip


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder of the Llama lineage (derived from an HF ``config.json``).

    The base is Llama's: RMSNorm before attention and MLP, fused q/k/v with RoPE, a gated MLP. The families differ
    by a few switches: Qwen2's q/k/v bias, Qwen3's and Gemma 3's per-head q/k norms, Gemma's norms after
    attention and MLP (``sandwich_norm``), its ``1 + w`` norm weights, scaled embeddings, GeGLU, attention scale
    and tanh soft-capping, and sliding-window layers (Mistral, Gemma 2/3, Phi-3)."""

    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # I (MLP width)
    num_layers: int
    num_heads: int  # H
    num_kv_heads: int  # KVH (GQA when < H)
    head_dim: int  # hd
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None, or {"rope_type": "llama3" | "linear" | "longrope", ...}; longrope carries its resolved
    # ``attention_factor`` (cos/sin scale)
    rope_scaling: Mapping[str, Any] | None = None
    qkv_bias: bool = False  # Qwen2
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    model_type: str = "llama"
    # sliding-window attention: a position in a sliding layer attends to the latest ``sliding_window`` positions
    # (itself included); ``sliding_layers`` marks those layers (None: every layer attends to all positions)
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] | None = None
    qk_norm: bool = False  # RMSNorm over each head's query and key before RoPE (Qwen3, Gemma 3)
    sandwich_norm: bool = False  # Gemma: a norm on the attention's and the MLP's output before each residual add
    norm_offset: bool = False  # Gemma's RMSNorm: x * (1 + w), in fp32, then cast
    embed_scale: bool = False  # Gemma: embeddings times sqrt(D) (in the model's dtype)
    activation: str = "silu"  # the MLP gate's: silu (SwiGLU) or gelu_tanh (Gemma's GeGLU)
    attn_scale: float | None = None  # the scores' scale; None: 1 / sqrt(head_dim)
    attn_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base (unscaled)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("llama3", "linear", "longrope", "default"):
                raise ValueError(f"unsupported rope scaling type {kind!r} (supported: llama3, linear, longrope)")
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"unsupported MLP activation {self.activation!r} (supported: silu, gelu_pytorch_tanh)")
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
            raise ValueError(f"{len(self.sliding_layers)} layer types for {self.num_layers} layers")

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s attention window (None: all positions)."""
        if self.sliding_layers is None or not self.sliding_layers[layer]:
            return None
        return self.sliding_window

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        """Build from an HF config dict (transformers 4.x rope_theta/rope_scaling or 5.x rope_parameters)."""
        model_type = cfg.get("model_type", "llama")
        if model_type == "gemma3" and isinstance(cfg.get("text_config"), Mapping):  # multimodal: its text decoder
            tie = cfg.get("tie_word_embeddings", cfg["text_config"].get("tie_word_embeddings", True))
            cfg = {**cfg["text_config"], "model_type": "gemma3_text", "tie_word_embeddings": tie}
            model_type = "gemma3_text"
        if model_type not in FAMILIES:
            raise ValueError(f"unsupported model_type {model_type!r} (supported: {', '.join(FAMILIES)})")
        given = {k: v for k, v in cfg.items() if v is not None or k.endswith("softcapping")}  # null caps: none
        cfg = {**_DEFAULTS.get(model_type, {}), **given}
        heads = cfg["num_attention_heads"]
        layers = cfg["num_hidden_layers"]
        gemma = model_type in ("gemma2", "gemma3_text")
        theta, scaling, local_theta = _rope(cfg, model_type)
        max_pos = cfg.get("max_position_embeddings", 4096)
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) in ("longrope", "su"):
            scaling, max_pos = _longrope(cfg, scaling, max_pos)
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if act == "swish":
            act = "silu"
        if act in ("gelu_pytorch_tanh", "gelu_tanh"):
            act = "gelu_tanh"
        rotary = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
        if cfg.get("partial_rotary_factor", rotary) != 1.0:
            raise ValueError("unsupported partial rotary embedding (partial_rotary_factor != 1)")
        window, sliding = _windows(cfg, model_type, layers)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=dict(scaling) if scaling else None,
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=max_pos,
            model_type=model_type,
            sliding_window=window,
            sliding_layers=sliding,
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            sandwich_norm=gemma,
            norm_offset=gemma,
            embed_scale=gemma,
            activation=act,
            attn_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5 if gemma else None,
            attn_softcap=cfg.get("attn_logit_softcapping") if model_type == "gemma2" else None,
            final_softcap=cfg.get("final_logit_softcapping") if gemma else None,
            local_rope_theta=local_theta,
        )


def _rope(cfg: Mapping[str, Any], model_type: str) -> tuple[float, Mapping[str, Any] | None, float | None]:
    """(theta, scaling or None, the sliding layers' own theta or None) from either config layout."""
    rope = dict(cfg.get("rope_parameters") or {})
    local: float | None = None
    if "full_attention" in rope:  # per layer type (transformers 5's Gemma 3)
        loc = dict(rope.get("sliding_attention") or {})
        if loc.get("rope_type", "default") != "default":
            raise ValueError("unsupported scaled RoPE on sliding layers")
        local = float(loc.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0)))
        rope = dict(rope["full_attention"])
    elif model_type == "gemma3_text":
        local = float(cfg.get("rope_local_base_freq", 10_000.0))
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return theta, scaling, local


def _longrope(cfg: Mapping[str, Any], scaling: Mapping[str, Any], max_pos: int) -> tuple[dict[str, Any], int]:
    """Phi-3's LongRoPE, run within its original context (its short factors): transformers switches every
    position to the long factors once a sequence passes ``original_max_position_embeddings``, which a KV cache
    cannot follow, so the context stops there. The cos/sin scale is the one for the extended context."""
    orig = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings") or max_pos
    orig = int(orig)
    factor = scaling.get("factor") or max_pos / orig
    att = scaling.get("attention_factor")
    if att is None:
        att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    out = {"rope_type": "longrope", "short_factor": list(scaling["short_factor"]), "attention_factor": float(att)}
    return out, min(max_pos, orig)


def _windows(cfg: Mapping[str, Any], model_type: str, layers: int) -> tuple[int | None, tuple[bool, ...] | None]:
    """The sliding window and which layers use it, as transformers reads each family's config."""
    w = cfg.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        w = None
    if not w or model_type == "llama":
        return None, None
    types = cfg.get("layer_types")
    if types is not None:
        sliding = tuple(t == "sliding_attention" for t in types)
    elif model_type in ("qwen2", "qwen3"):
        sliding = tuple(i >= cfg.get("max_window_layers", 28) for i in range(layers))
    elif model_type == "gemma2":
        sliding = tuple(bool((i + 1) % 2) for i in range(layers))
    elif model_type == "gemma3_text":
        pattern = cfg.get("sliding_window_pattern", 6)
        sliding = tuple(bool((i + 1) % pattern) for i in range(layers))
    else:  # mistral, phi3: every layer
        sliding = (True,) * layers
    if not any(sliding):
        return None, None
    return int(w), sliding


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


def offset_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Gemma's RMSNorm: the normalized row times ``1 + weight``, both in fp32, then cast (as HF Gemma does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def rope_inv_freq(cfg: ModelConfig, theta: float | None = None) -> Tensor:
    """Inverse RoPE frequencies (hd/2,), fp32, including llama3 / linear / longrope scaling; ``theta``: an unscaled
    base of its own (Gemma 3's sliding layers)."""
    hd = cfg.head_dim
    if theta is not None:
        return 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    sc = cfg.rope_scaling
    if not sc:
        return inv
    kind = sc.get("rope_type", sc.get("type"))
    if kind == "linear":
        return inv / float(sc["factor"])
    if kind == "longrope":
        short = torch.tensor(sc["short_factor"], dtype=torch.float32)
        return 1.0 / (short * cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
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


def rope_scale(cfg: ModelConfig) -> float:
    """The factor on cos and sin (LongRoPE's attention factor; 1 otherwise)."""
    sc = cfg.rope_scaling
    return float(sc.get("attention_factor", 1.0)) if sc else 1.0


def apply_rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """Rotate-half RoPE. x (T, heads, hd); cos (T, 1, hd); ``sin_signed`` (T, 1, hd) is sin with its first half
    negated (:func:`rope_tables`), so the rotation is a swap of halves: ``x2 * -sin == -x2 * sin`` exactly."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * sin_signed


def rope_tables(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype, scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """cos and sign-folded sin (T, 1, hd) for :func:`apply_rope` at ``positions`` (T,), times ``scale``.

    cos and sin run over rows padded to 64 columns: a CPU kernel computes whole vectors with one routine and a
    ragged remainder with another (which may round differently), so the padding keeps every position's values on
    the vector routine whatever the pass's size."""
    half = inv_freq.shape[0]
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, hd/2)
    if half % 64:
        freqs = F.pad(freqs, (0, 64 - half % 64))
    cos, sin = freqs.cos()[:, :half], freqs.sin()[:, :half]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return torch.cat((cos, cos), dim=-1).to(dtype)[:, None, :], torch.cat((-sin, sin), dim=-1).to(dtype)[:, None, :]


def fused_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm through ``F.rms_norm`` (one fused kernel on CUDA where torch has it). Not bit-identical to
    :func:`rms_norm` (the weight multiplies before the cast): for a draft, whose numerics only change what it
    proposes, never for a target."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def softcap(x: Tensor, cap: float | None) -> Tensor:
    """``cap * tanh(x / cap)`` (Gemma 2's soft-capping; identity for None)."""
    if cap is None:
        return x
    return torch.tanh(x / cap) * cap


def window_mask(mask: Tensor, positions: Tensor, window: int) -> Tensor:
    """``mask`` (T, L) restricted to each row's latest ``window`` positions. A row sees one slot per position
    0..p in increasing slot order (causal prefill, a tree's ancestry), so its k-th visible slot holds position k."""
    rank = mask.cumsum(1) - 1
    return mask & (rank > positions[:, None] - window)


NATIVE_ROWS = 256  # rows a native layer pass takes at once (its scratch grows with them)


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
    local_inv_freq: Tensor | None = field(init=False)
    # every pass runs all layers in one C call where the model's layers allow it (a CPU model with 4-bit weights,
    # :class:`~specexec.formats.layers.NativeLayers`); None: not looked at yet, False: they don't
    native_layers: Any = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        self.inv_freq = rope_inv_freq(self.cfg).to(self.device)
        theta = self.cfg.local_rope_theta
        self.local_inv_freq = None if theta is None else rope_inv_freq(self.cfg, theta).to(self.device)

    def _ropes(self, positions: Tensor) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
        """(cos, sin) for the global layers and for the sliding layers (the same tables unless the sliding
        layers have a RoPE base of their own)."""
        glob = rope_tables(positions, self.inv_freq, self.dtype, rope_scale(self.cfg))
        if self.local_inv_freq is None:
            return glob, glob
        return glob, rope_tables(positions, self.local_inv_freq, self.dtype)

    def _logits(self, x: Tensor) -> Tensor:
        return softcap(x.float(), self.cfg.final_softcap)

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
        hidden: list[Tensor] | None = None,
    ) -> Tensor:
        """One pass. tokens/positions/cache_slots (T,) long; mask (T, L) bool, True = may attend to slot.

        Writes this pass's keys/values into ``cache`` at ``cache_slots`` (every slot a row attends to must be
        written before or in this pass). Returns fp32 logits (T', V) for ``logits_rows`` (default all rows).
        ``trace``: append the residual stream (T, D) entering the first layer and leaving each layer.
        ``fused_norm``: RMSNorm through one fused kernel (:func:`fused_rms_norm`; a draft's passes on a GPU, never
        a target's). ``hidden``: append the final normed hidden states (T', D) the logits are computed from (what
        Medusa-style heads read).
        """
        if isinstance(cache, KVRegion):  # a lane of several generations: its passes go through the rendezvous
            assert trace is None, "a lane's passes keep no trace"
            return cache.joint.forward(self, cache, tokens, positions, cache_slots, mask, logits_rows, fused_norm,
                                       hidden)  # fmt: skip
        c = self.cfg
        head = self.globals.lm_head
        if isinstance(head, SubsetHead):
            head.observe(tokens)
        norm = offset_rms_norm if c.norm_offset else fused_rms_norm if fused_norm else rms_norm
        t = self.tiling
        if trace is None and self._native_layers() is not None:
            x = self._native_pass(tokens, positions, cache_slots, mask, cache)
            if logits_rows is not None:
                x = x[logits_rows]
            return self._head(x, norm, hidden)
        if t is None:
            x = self._embed(tokens)  # (T, D)
            glob, local = self._ropes(positions)
            attend: Callable[[int, Tensor, Tensor, Tensor], Tensor]
            if native_ready(x.device, self.dtype):  # a CPU: the C kernel reads grouped heads in place
                rows = row_keys(mask, positions, tokens.shape[0])
                wrows = None
                if c.sliding_window is not None:
                    wrows = row_keys(mask, positions, tokens.shape[0], window=c.sliding_window)

                def attend(i: int, q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
                    r = wrows if wrows is not None and c.window(i) else rows
                    return native(q, keys, values, r, c.attn_scale, c.attn_softcap)

            else:
                bias = sdpa_bias(mask, self.dtype)
                wbias = None
                if c.sliding_window is not None:
                    wbias = sdpa_bias(window_mask(mask, positions, c.sliding_window), self.dtype)

                def attend(i: int, q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
                    b = wbias if wbias is not None and c.window(i) else bias
                    return sdpa(q, keys, values, b, c.attn_scale, c.attn_softcap)

            x = self._layers(x, glob, local, attend, cache_slots, mask.shape[1], cache, linear, trace, norm)
            if logits_rows is not None:
                x = x[logits_rows]
            return self._head(x, norm, hidden)
        # passes larger than the invariance was checked for run as consecutive passes; rows attend only to slots
        # written by earlier rows or passes (causal prefill, tree ancestry), so the result is the same
        T = tokens.shape[0]
        step = t.max_rows if trace is None else T
        parts = [
            self._invariant_pass(tokens[a : a + step], positions[a : a + step], cache_slots[a : a + step],
                                 mask[a : a + step], cache, trace, norm)
            for a in range(0, T, step)
        ]  # fmt: skip
        x = parts[0] if len(parts) == 1 else torch.cat(parts)
        if logits_rows is not None:
            x = x[logits_rows]
        return self._head(x, norm, hidden)

    def row_invariant(self) -> bool:
        """Is every row's result the same bits in any pass, beside any other rows? True for the one-call CPU
        layers and for shape-invariant passes whose attention reads each row's own slots (the CPU's C kernel, the
        GPU's tree kernel); then several generations' rows can share a pass (:mod:`specexec.model.joint`)."""
        if isinstance(self.globals.lm_head, SubsetHead):  # its vocabulary follows the tokens a pass reads
            return False
        if self._native_layers() is not None:
            return True
        return self.tiling is not None and (native_ready(self.device, self.dtype) or tree_attn.ready(self.device))

    def _head(self, x: Tensor, norm: Callable[[Tensor, Tensor, float], Tensor], hidden: list[Tensor] | None) -> Tensor:
        """The final norm and the output layer over the rows' final hidden states x (T', D) -> fp32 logits; a
        tiled model's in passes of at most ``max_rows`` rows through its tiling."""
        t = self.tiling
        out = []
        step = max(x.shape[0], 1) if t is None else t.max_rows
        for a in range(0, max(x.shape[0], 1), step):
            h = norm(x[a : a + step], self.globals.norm, self.cfg.rms_norm_eps)
            if hidden is not None:
                hidden.append(h)
            out.append(linear(h, self.globals.lm_head) if t is None else tiled_linear(h, self.globals.lm_head, t))
        return self._logits(out[0] if len(out) == 1 else torch.cat(out))

    def _native_layers(self) -> NativeLayers | None:
        """The model's layers as one C call (:class:`~specexec.formats.layers.NativeLayers`), where they allow it."""
        if self.native_layers is None:
            resident = isinstance(self.layers, ResidentLayers)
            layers = [self.layers.layer(i) for i in range(self.cfg.num_layers)] if resident else None
            found = NativeLayers.of(self.cfg, layers, self.device, self.dtype, self.local_inv_freq is not None)
            self.native_layers = found or False
        return self.native_layers or None

    def _native_pass(
        self, tokens: Tensor, positions: Tensor, cache_slots: Tensor, mask: Tensor, cache: KVCache
    ) -> Tensor:
        """Every layer by :class:`~specexec.formats.layers.NativeLayers`, in passes of at most ``NATIVE_ROWS`` rows
        (each row's result is the same in any pass, so this serves shape-invariant models too); returns the rows'
        final hidden states (T, D)."""
        nl = self._native_layers()
        assert nl is not None
        parts = []
        for a in range(0, tokens.shape[0], NATIVE_ROWS):
            sl = slice(a, a + NATIVE_ROWS)
            glob, _ = self._ropes(positions[sl])
            rows = row_keys(mask[sl], positions[sl], positions[sl].shape[0])
            parts.append(nl.run(self._embed(tokens[sl]), *glob, cache, cache_slots[sl], rows))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _embed(self, tokens: Tensor) -> Tensor:
        x = embed_rows(self.globals.embed, tokens).to(self.dtype)
        if self.cfg.embed_scale:  # Gemma: times sqrt(D) rounded to the model's dtype, as HF Gemma does
            x = x * torch.tensor(self.cfg.hidden_size**0.5, dtype=self.dtype)
        return x

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
        c = self.cfg
        t = self.tiling
        assert t is not None
        T = tokens.shape[0]
        P = t.pad(T)
        x = self._embed(tokens)
        pos = positions
        if P != T:
            x = torch.cat((x, x.new_zeros(P - T, x.shape[1])))
            pos = torch.cat((positions, positions.new_zeros(P - T)))
        glob, local = self._ropes(pos)
        attend: Callable[[int, Tensor, Tensor, Tensor], Tensor]
        if native_ready(x.device, self.dtype):
            rows = row_keys(mask, positions, P)
            wrows = None if c.sliding_window is None else row_keys(mask, positions, P, window=c.sliding_window)

            def attend(i: int, q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
                r = wrows if wrows is not None and c.window(i) else rows
                return native(q, keys, values, r, c.attn_scale, c.attn_softcap)

        elif tree_attn.ready(x.device):  # a CUDA device with Triton: one kernel launch a layer
            trows = tree_keys(mask, positions, P)
            twrows = None if c.sliding_window is None else tree_keys(mask, positions, P, window=c.sliding_window)

            def attend(i: int, q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
                r = twrows if twrows is not None and c.window(i) else trows
                return tree_attention(q, keys, values, r, c.attn_scale, c.attn_softcap)

        else:
            plan = plan_keys(mask, positions, P, t.key_block, t.attn_rows)
            wplan = None
            if c.sliding_window is not None:
                wplan = plan_keys(mask, positions, P, t.key_block, t.attn_rows, window=c.sliding_window)

            def attend(i: int, q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
                p = wplan if wplan is not None and c.window(i) else plan
                return blocked(q, keys, values, p, c.attn_scale, c.attn_softcap)

        def lin(a: Tensor, w: Any) -> Tensor:
            return tiled_linear(a, w, t)

        x = self._layers(x, glob, local, attend, cache_slots, mask.shape[1], cache, lin, trace, norm)
        return x[:T]

    def _layers(
        self,
        x: Tensor,
        glob: tuple[Tensor, Tensor],
        local: tuple[Tensor, Tensor],
        attend: Callable[[int, Tensor, Tensor, Tensor], Tensor],
        cache_slots: Tensor,
        L: int,
        cache: KVCache,
        lin: Callable[[Tensor, Any], Tensor],
        trace: list[Tensor] | None = None,
        norm: Callable[[Tensor, Tensor, float], Tensor] = rms_norm,
    ) -> Tensor:
        """The decoder layers over x (P, D) (the pass's rows, and any padding rows after them); returns the final
        hidden states (P, D). ``glob`` / ``local``: RoPE tables of the global and the sliding layers. Rows past
        ``cache_slots``'s length write no keys."""
        c = self.cfg
        P = x.shape[0]
        T = cache_slots.shape[0]
        H, KVH, hd = c.num_heads, c.num_kv_heads, c.head_dim
        q_dim, kv_dim = H * hd, KVH * hd
        eps = c.rms_norm_eps
        act = F.silu if c.activation == "silu" else partial(F.gelu, approximate="tanh")
        self.layers.begin()
        if trace is not None:
            trace.append(x[:T])
        for i in range(c.num_layers):
            w = self.layers.layer(i)
            h = norm(x, w["attn_norm"], eps)
            qkv = lin(h, w["wqkv"])
            if "bqkv" in w:
                qkv = qkv + w["bqkv"]
            qk = qkv[:, : q_dim + kv_dim].view(P, H + KVH, hd)
            if c.qk_norm:  # per head, before RoPE
                qk = torch.cat((norm(qk[:, :H], w["q_norm"], eps), norm(qk[:, H:], w["k_norm"], eps)), dim=1)
            # RoPE on the queries and keys together (one set of kernels; the same arithmetic per element)
            cos, sin = local if c.window(i) else glob
            qk = apply_rope(qk, cos, sin)
            q, k = qk[:, :H], qk[:, H:]
            v = qkv[:, q_dim + kv_dim :].reshape(P, KVH, hd)
            keys, values = cache.write(i, cache_slots, k[:T], v[:T], L)
            a = lin(attend(i, q, keys, values), w["wo"])
            x = x + (norm(a, w["post_attn_norm"], eps) if c.sandwich_norm else a)
            h = norm(x, w["mlp_norm"], eps)
            gate, up = lin(h, w["w13"]).chunk(2, dim=-1)
            m = lin(act(gate) * up, w["w2"])
            x = x + (norm(m, w["post_mlp_norm"], eps) if c.sandwich_norm else m)
            if trace is not None:
                trace.append(x[:T])
            self.layers.done(i)
        return x
