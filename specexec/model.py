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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from specexec import lowbit_mm
from specexec.kv_cache import KVCache

LAYER_KEYS = ("attn_norm", "wqkv", "wo", "mlp_norm", "w13", "w2")

# cuDNN's SDPA builds an execution plan per new (T, L) shape: 60-124 ms each on an H100 (L grows every step), and
# it measured 3x slower than needed for small T even when planned. The other backends handle our masks well.
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


# Which CPU passes go through ``w @ x.T`` instead of ``F.linear`` (see :func:`linear`), per dtype, by row count.
# The BLAS picks its kernel by shape, and which orientation wins depends on the CPU, the build and the row count:
# on one 2-core EPYC box ``F.linear`` cost 2-3x one row at 2-7 rows while ``w @ x.T`` stayed near one row, and an
# earlier measurement on the same class found the opposite at 2-5 rows. So :mod:`specexec.cpu_probe` measures both
# on the model's own layer shapes (:func:`set_cpu_orientation`); until it has, fp32 uses the rule measured first
# (scripts/bench_cpu_matmul.py: 8..48 rows) and other dtypes ``F.linear``.
ORIENT_MAX_ROWS = 64  # larger passes (prefill, big trees) always use F.linear
_DEFAULT_FP32_ROWS = (8, 48)
_CPU_ORIENT: dict[torch.dtype, tuple[bool, ...]] = {
    torch.float32: tuple(_DEFAULT_FP32_ROWS[0] <= r <= _DEFAULT_FP32_ROWS[1] for r in range(ORIENT_MAX_ROWS + 1))
}


def set_cpu_orientation(dtype: torch.dtype, transposed_rows: Sequence[int] | None) -> None:
    """CPU passes in ``dtype`` with a row count in ``transposed_rows`` use ``w @ x.T`` (process-wide); None
    restores the default rule."""
    if transposed_rows is None:
        if dtype == torch.float32:
            lo, hi = _DEFAULT_FP32_ROWS
            _CPU_ORIENT[dtype] = tuple(lo <= r <= hi for r in range(ORIENT_MAX_ROWS + 1))
        else:
            _CPU_ORIENT.pop(dtype, None)
        return
    rows = set(transposed_rows)
    _CPU_ORIENT[dtype] = tuple(r in rows for r in range(ORIENT_MAX_ROWS + 1))


def cpu_orientation(dtype: torch.dtype) -> list[int]:
    """The row counts whose CPU passes in ``dtype`` use ``w @ x.T``."""
    table = _CPU_ORIENT.get(dtype, ())
    return [r for r, on in enumerate(table) if on]


def set_cpu_transposed(dtype: torch.dtype, on: bool) -> None:
    """Whether CPU passes of 8..48 rows in ``dtype`` use the ``w @ x.T`` orientation (process-wide)."""
    set_cpu_orientation(dtype, range(8, 49) if on else [])


def cpu_transposed(x: Tensor) -> bool:
    """Does :func:`linear` run ``x`` (T, in) through ``w @ x.T``?"""
    if x.device.type != "cpu" or x.dim() != 2:
        return False
    table = _CPU_ORIENT.get(x.dtype)
    r = x.shape[0]
    return table is not None and r <= ORIENT_MAX_ROWS and table[r]


def linear(x: Tensor, w: Any) -> Tensor:
    """x (T, in) @ w.T -> (T, out). ``w`` is a dense tensor or any object with ``.linear(x)`` (e.g. NF4, int8).

    On a CPU, passes of a few rows (tree verification, draft levels) may go through ``w @ x.T``: the BLAS often
    picks a far better kernel for that orientation. Which row counts do is measured per machine and dtype by
    :mod:`specexec.cpu_probe` (:func:`set_cpu_orientation`; the numbers it saw are in ``doctor``).
    """
    if isinstance(w, Tensor):
        if cpu_transposed(x):
            return torch.mm(w, x.T).T
        return F.linear(x, w)
    return w.linear(x)


def embed_rows(w: Any, tokens: Tensor) -> Tensor:
    """Embedding lookup: rows ``tokens`` of a dense (V, D) tensor or of a quantized weight (``.rows(tokens)``)."""
    if isinstance(w, Tensor):
        return w[tokens]
    return w.rows(tokens)


# int8 weights on CUDA: "bnb" (bitsandbytes' W8A8) or "triton" (specexec.lowbit_mm, a fused weight-only GEMM, up to
# lowbit_mm.MAX_ROWS rows a call, bitsandbytes' beyond). Its first version lost to bitsandbytes' end to end on an H200
# (docs/BENCHMARKS.md, fifth H200 session); the current one is not GPU-measured yet, so bitsandbytes' stays the default
CUDA_INT8_KERNEL = "bnb"


def _int8_kernel(device: torch.device | None = None) -> str:
    """The best int8 linear for weights on ``device`` (default CPU) in this build (see :class:`Int8Linear`)."""
    if device is not None and device.type == "cuda":
        return CUDA_INT8_KERNEL
    ops = getattr(torch.ops, "quantized", None)
    engines = torch.backends.quantized.supported_engines
    if ops is not None and hasattr(ops, "linear_dynamic") and ("fbgemm" in engines or "x86" in engines):
        return "dynamic"
    if hasattr(torch, "_weight_int8pack_mm"):
        return "int8pack"
    return "dequant"


INT8_KERNELS = ("dynamic", "int8pack", "dequant", "bnb", "triton")


class Int8Linear:
    """A linear weight (out, in) as int8 with one fp32 scale per output channel (symmetric, round to nearest).

    ``linear(x)`` runs one of five kernels (``kernel``; default: :data:`CUDA_INT8_KERNEL` (``bnb``) for weights
    on CUDA, else the first available CPU one):

    - ``dynamic``: fbgemm's ``quantized::linear_dynamic`` (activations quantized per pass to 8 bits as well, int8
      GEMM with fp32 accumulation; the fast AVX2/AVX512 path);
    - ``int8pack``: ``torch._weight_int8pack_mm`` (weight-only, what gpt-fast uses on CPU);
    - ``dequant``: dequantize to ``x``'s dtype, then the dense :func:`linear`;
    - ``bnb``: bitsandbytes' LLM.int8() matmul without outlier decomposition (threshold 0): activations quantized
      row-wise to int8, an int8 GEMM (cuBLASLt on CUDA), rescaled by both absmax vectors. The weight's int8 codes
      and scales are exactly bitsandbytes' ``CB``/``SCB`` (``SCB = 127 * scale``). On CUDA the activations pass
      through fp16 (bitsandbytes' CUDA quantizer takes fp16 only);
    - ``triton``: :mod:`specexec.lowbit_mm`, one fused weight-only kernel (codes widened in registers, fp32
      accumulation, the scale in the epilogue; no casts, no activation quantization) up to
      ``lowbit_mm.MAX_ROWS`` rows, ``bnb`` beyond (see :data:`CUDA_INT8_KERNEL`).

    Measured on a 2-core AVX2 EPYC (noisy, see the cpudraft report): ``int8pack`` with fp32 activations was 3-30x
    slower than fp32 dense beyond one row, ``dynamic`` 2-5x faster at 16-128 rows. Meant for the draft: its results
    differ from the dense weights' by the quantization error, which only changes what the draft proposes.
    ``rows(ids)`` dequantizes embedding rows (a tied lm_head doubles as the embedding).
    """

    def __init__(self, w: Tensor, kernel: str | None = None) -> None:
        w = w.detach().float()
        self.shape = tuple(w.shape)
        self.scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # (out,) fp32
        self.qweight = torch.round(w / self.scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        self.kernel = kernel or _int8_kernel(w.device)
        if self.kernel not in INT8_KERNELS:
            raise ValueError(f"unknown int8 kernel {self.kernel!r}")
        self._packed: Any = None
        self._scb = self.scale * 127.0  # bitsandbytes' SCB, made once: not a kernel in every (graphed) pass

    def _prepacked(self) -> Any:
        if self._packed is None:
            import warnings

            with warnings.catch_warnings():  # torch warns that quantized tensor creation is deprecated
                warnings.simplefilter("ignore")
                q = torch._make_per_channel_quantized_tensor(
                    self.qweight, self.scale.double(), torch.zeros(self.shape[0], dtype=torch.long), 0
                )
                self._packed = torch.ops.quantized.linear_prepack(q, None)
        return self._packed

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The dense weight (out, in) these int8 values stand for."""
        return (self.qweight.to(torch.float32) * self.scale[:, None]).to(dtype)

    def rows(self, ids: Tensor) -> Tensor:
        """Dequantized rows ``ids`` (n, in) in fp32 (embedding lookups)."""
        return self.qweight[ids].to(torch.float32) * self.scale[ids][:, None]

    def subset(self, ids: Tensor) -> Int8Linear:
        """The output channels ``ids`` as their own int8 weight (same values and scales, same kernel)."""
        out = Int8Linear.__new__(Int8Linear)
        out.shape = (int(ids.shape[0]), self.shape[1])
        out.scale, out.qweight = self.scale[ids].contiguous(), self.qweight[ids].contiguous()
        out.kernel, out._packed, out._scb = self.kernel, None, out.scale * 127.0
        return out

    def to(self, device: torch.device) -> Int8Linear:
        """The same int8 weight on ``device`` (the kernel re-chosen for it: :data:`CUDA_INT8_KERNEL` on CUDA)."""
        out = Int8Linear.__new__(Int8Linear)
        out.shape, out.qweight, out.scale = self.shape, self.qweight.to(device), self.scale.to(device)
        out.kernel = self.kernel if device.type == self.qweight.device.type else _int8_kernel(device)
        out._packed, out._scb = None, out.scale * 127.0
        return out

    def linear(self, x: Tensor) -> Tensor:
        """x (T, in) -> (T, out) in x's dtype."""
        if self.kernel == "triton" and x.shape[0] <= lowbit_mm.MAX_ROWS:
            # off CUDA (tests) the same kernel runs under Triton's CPU interpreter
            return lowbit_mm.int8_matmul(x, self.qweight, self.scale, interpret=x.device.type != "cuda")
        if self.kernel in ("bnb", "triton"):
            import bitsandbytes  # noqa: F401  (registers torch.ops.bitsandbytes; imported once, then cached)

            a = x.to(torch.float16) if x.device.type == "cuda" else x
            qa, row_stats, _ = torch.ops.bitsandbytes.int8_vectorwise_quant(a.contiguous())
            return torch.ops.bitsandbytes.int8_scaled_mm(qa, self.qweight, row_stats, self._scb, dtype=x.dtype)
        if self.kernel == "dynamic":
            y = torch.ops.quantized.linear_dynamic(x.float(), self._prepacked(), True)
            return y.to(x.dtype)
        if self.kernel == "int8pack":
            return torch._weight_int8pack_mm(x.contiguous(), self.qweight, self.scale.to(x.dtype))
        return linear(x, self.dequantize(x.dtype))

    def nbytes(self) -> int:
        return self.qweight.numel() + self.scale.numel() * 4


class SubsetHead:
    """A draft lm_head restricted to a subset of the vocabulary (FR-Spec, arXiv 2502.14856).

    Scores only the ``ids`` rows of ``weight`` (a dense (V, D) tensor, or an :class:`Int8Linear` or
    :class:`~specexec.groupquant.GroupQuantLinear`: anything with ``subset(ids)``) and returns
    full-vocabulary logits (T, V) with ``-inf`` outside the subset, so the draft's callers see an ordinary model
    that never proposes the excluded tokens. :meth:`observe` grows the subset with every token the model is fed
    (the prompt, the committed text): a token that occurred is likely to recur. The draft only proposes, so the
    subset changes speed and acceptance, never the output.
    """

    def __init__(self, weight: Any, ids: Tensor, vocab: int) -> None:
        self.weight, self.vocab = weight, vocab
        ids = torch.unique(ids.long().clamp(0, vocab - 1))
        self.member = torch.zeros(vocab, dtype=torch.bool)
        self.member[ids] = True
        self.ids = ids
        self.sub = self._rows(ids)
        self.extra_ids = ids[:0]
        self.extra: Any = None

    def _rows(self, ids: Tensor) -> Any:
        if isinstance(self.weight, Tensor):
            return self.weight[ids.to(self.weight.device)].contiguous()
        return self.weight.subset(ids)

    def observe(self, tokens: Tensor) -> None:
        """Add the tokens not in the subset yet (their rows are scored from now on)."""
        toks = tokens.detach().to("cpu", torch.long)
        toks = toks[(toks >= 0) & (toks < self.vocab)]
        new = toks[~self.member[toks]]
        if new.numel() == 0:
            return
        new = torch.unique(new)
        self.member[new] = True
        self.extra_ids = torch.cat([self.extra_ids, new])
        self.extra = self._rows(self.extra_ids)  # rebuilt: small (tokens seen outside the subset)

    @property
    def size(self) -> int:
        return int(self.ids.numel() + self.extra_ids.numel())

    def linear(self, x: Tensor) -> Tensor:
        out = torch.full((x.shape[0], self.vocab), float("-inf"), dtype=x.dtype, device=x.device)
        out[:, self.ids.to(x.device)] = linear(x, self.sub)
        if self.extra is not None:
            out[:, self.extra_ids.to(x.device)] = linear(x, self.extra)
        return out


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
