"""Bytes, from a model's config alone: weights, KV caches and the buffers one decoding step allocates.

The one place where memory arithmetic lives. The load checks (:mod:`specexec.loading.memory`,
:func:`specexec.api.load`),
``specexec doctor`` and the offload planner (:mod:`offload.plan`) all call these functions; none re-derives a size.

- **weights**: parameter counts of the Llama-family layout used by :mod:`specexec.model.transformer` (fused q/k/v [+
  bias], gated MLP, two norms a layer, four for Gemma 2/3, q/k head norms for Qwen3 and Gemma 3; embedding, final
  norm and lm_head once when tied), and what a checkpoint stores
  (:func:`stored_weights` reads the safetensors headers: element counts and stored dtypes, no weight is read).
- **KV caches**: ``2 x layers x kv_heads x slots x head_dim`` elements each, sized exactly as the engine sizes
  them (:func:`target_cache_slots`, :func:`draft_cache_slots`).
- **tree-sized buffers** (:class:`StepBuffers`): everything whose size grows with the tree budget N -- the KV room
  for the tree in both caches, the ancestry mask (N x N bool), the verification mask, the target's logits
  (N x V fp32, and one same-sized working copy: the probabilities when sampling, the concatenation when
  verification is chunked), the activations of the largest target pass, and the draft's per-pass buffers
  (logits and log-probabilities of ``max_beams`` rows, the candidate arrays, the tree arrays).

GB = 1e9 bytes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from specexec.config import FORCED_IN_CHAIN, NGRAM_NODES_GPU, ChainConfig, TreeConfig
from specexec.errors import SpecexecError
from specexec.model.transformer import ModelConfig

GB = 1e9
NF4_BLOCKSIZE = 64  # values per NF4 absmax block (bitsandbytes' quantize_4bit, no nested quantization)
NF4_BYTES_PER_PARAM = 0.5 + 4 / NF4_BLOCKSIZE  # 4-bit codes + one fp32 absmax per block
WEIGHT_FORMATS = ("dense", "int8", "nf4", "q4")  # how a model's linears are held: model_weight_bytes

# safetensors dtype names -> bytes per element
SAFETENSORS_DTYPE_BYTES = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
# names of storage dtypes (config.json ``torch_dtype``, models.toml ``dtype``) -> bytes per element
DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2}


# ---------------------------------------------------------------------------------------------- weights


def norm_params(cfg: ModelConfig) -> int:
    """Norm weights of one decoder layer: two hidden-size norms (Llama, Mistral, Qwen2, Phi-3), four with Gemma's
    norms on the attention's and MLP's outputs (``sandwich_norm``), plus one head_dim norm each for queries and keys
    (``qk_norm``: Qwen3, Gemma 3)."""
    n = (4 if cfg.sandwich_norm else 2) * cfg.hidden_size
    return n + (2 * cfg.head_dim if cfg.qk_norm else 0)


def layer_params(cfg: ModelConfig) -> int:
    """Parameters of one decoder layer: attention (q, k, v, o [+ qkv bias]), gated MLP, norms (:func:`norm_params`).
    Phi-3's fused qkv and gate/up tensors hold the same counts as separate ones."""
    d, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    attn = d * (q + 2 * kv) + q * d + ((q + 2 * kv) if cfg.qkv_bias else 0)
    mlp = 3 * d * cfg.intermediate_size
    return attn + mlp + norm_params(cfg)


def global_params(cfg: ModelConfig) -> int:
    """Embedding, final norm and lm_head (not counted twice when tied)."""
    mats = 1 if cfg.tie_word_embeddings else 2
    return mats * cfg.vocab_size * cfg.hidden_size + cfg.hidden_size


def param_count(cfg: ModelConfig) -> int:
    """All parameters of the model."""
    return cfg.num_layers * layer_params(cfg) + global_params(cfg)


def globals_bytes(cfg: ModelConfig, itemsize: int) -> int:
    """Embedding + final norm + lm_head (unless tied) at ``itemsize`` bytes an element."""
    return global_params(cfg) * itemsize


def layer_bytes(cfg: ModelConfig, kind: str) -> int:
    """Bytes of one decoder layer stored as ``bf16``/``fp16`` (2 bytes a parameter), ``fp32`` or ``nf4`` (linear
    weights 4-bit with an fp32 absmax per 64 values; norms and biases stay 16-bit). The offload store's packed
    buffers add alignment padding to this (:func:`offload.layout.layer_layout` gives their exact size)."""
    n = layer_params(cfg)
    if kind in ("bf16", "fp16"):
        return 2 * n
    if kind == "fp32":
        return 4 * n
    if kind != "nf4":
        raise ValueError(f"unknown weight format {kind!r}")
    hd = cfg.head_dim
    small = norm_params(cfg) + (((cfg.num_heads + 2 * cfg.num_kv_heads) * hd) if cfg.qkv_bias else 0)
    return int((n - small) * NF4_BYTES_PER_PARAM) + 2 * small


def _linear_bytes(out: int, inp: int, fmt: str) -> int:
    """One (out, in) linear weight: int8 codes + one fp32 scale per output channel, 4-bit q4 super-blocks
    (:func:`specexec.formats.q4.row_bytes` a row), or NF4 codes (two a byte) + one fp32 absmax per block."""
    n = out * inp
    if fmt == "int8":
        return n + 4 * out
    if fmt == "q4":
        from specexec.formats.q4 import row_bytes

        return out * row_bytes(inp)
    return (n + 1) // 2 + 4 * -(-n // NF4_BLOCKSIZE)


def model_weight_bytes(cfg: ModelConfig, fmt: str, itemsize: int) -> int:
    """Resident bytes of a whole model as :func:`specexec.loading.checkpoint.load_model` holds it, computing at
    ``itemsize``.

    ``dense``: every parameter at ``itemsize``. ``int8``: the layers' four linears and the lm_head as int8 + one
    fp32 scale per output row (a tied embedding is that lm_head); ``q4`` likewise in 4-bit blocks. ``nf4``: the
    linears and the lm_head in NF4. An
    untied embedding (and an NF4 model's tied one) stays dense. Norms and biases stay at ``itemsize``.
    Exact for what the loader allocates (a test checks), except a ``q4`` model on a GGUF's own blocks: its Q6_K
    tensors hold 6.56 bits a value and an untied embedding stays in the file's blocks: the file's mix decides (the demo
    target holds 0.7 GB less). An untied 16-bit embedding under an fp32 int8 / q4 model stays 16-bit: half counted.
    """
    if fmt == "dense":
        return param_count(cfg) * itemsize
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}")
    d, hd, v = cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    linears = ((q + 2 * kv, d), (d, q), (2 * cfg.intermediate_size, d), (d, cfg.intermediate_size))
    small = norm_params(cfg) + ((q + 2 * kv) if cfg.qkv_bias else 0)
    layer = sum(_linear_bytes(o, i, fmt) for o, i in linears) + small * itemsize
    head = _linear_bytes(v, d, fmt)
    embed = 0 if fmt in ("int8", "q4") and cfg.tie_word_embeddings else v * d * itemsize
    return cfg.num_layers * layer + head + embed + d * itemsize


@dataclass(frozen=True)
class StoredWeights:
    """What a safetensors checkpoint holds, from its headers: elements and bytes per stored dtype."""

    numel: dict[str, int] = field(default_factory=dict)  # safetensors dtype name -> elements
    largest: int = 0  # elements of the largest single tensor (the transient copy when casting on load)

    @property
    def params(self) -> int:
        return sum(self.numel.values())

    @property
    def nbytes(self) -> int:
        return sum(n * SAFETENSORS_DTYPE_BYTES.get(k, 4) for k, n in self.numel.items())

    @property
    def dtype(self) -> str:
        """The dtype most elements are stored in (``F32``, ``BF16``, ``F16``...)."""
        return max(self.numel, key=lambda k: self.numel[k]) if self.numel else "?"

    def resident_bytes(self, itemsize: int, cfg: ModelConfig | None = None, fmt: str = "dense") -> int:
        """Bytes the weights take once loaded at ``itemsize`` bytes an element (whatever they are stored in),
        plus one transient tensor copy while casting. With ``cfg`` the count is the model's own parameters (a
        checkpoint of tied embeddings may also store the lm_head copy, which the loader does not keep).
        ``fmt`` int8 / nf4 (needs ``cfg``): :func:`model_weight_bytes` plus the largest tensor
        read in fp32 before it is quantized."""
        if fmt != "dense":
            if cfg is None:
                raise ValueError("a low-bit weight count needs the model's config")
            return model_weight_bytes(cfg, fmt, itemsize) + self.largest * 4
        params = min(self.params, param_count(cfg)) if cfg is not None else self.params
        return params * itemsize + self.largest * itemsize


def stored_weights(path: Path) -> StoredWeights:
    """Read the headers of every ``*.safetensors`` file in ``path`` (a few KB each; no weight is read)."""
    numel: dict[str, int] = {}
    largest = 0
    for f in sorted(Path(path).glob("*.safetensors")):
        try:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                if n <= 0 or n > f.stat().st_size - 8:
                    raise ValueError("header length out of range")
                header = json.loads(fh.read(n))
        except (ValueError, OSError) as e:
            raise SpecexecError(f"corrupt safetensors file {f}: {e}") from None
        for name, info in header.items():
            if name == "__metadata__":
                continue
            count = math.prod(info["shape"])
            numel[info["dtype"]] = numel.get(info["dtype"], 0) + count
            largest = max(largest, count)
    return StoredWeights(numel=numel, largest=largest)


# ---------------------------------------------------------------------------------------------- KV caches


def kv_bytes_per_token(cfg: ModelConfig, itemsize: int) -> int:
    """KV-cache bytes one token costs across all layers (keys and values)."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def kv_bytes(cfg: ModelConfig, slots: int, itemsize: int) -> int:
    """Bytes of a :class:`~specexec.model.kv_cache.KVCache` with ``slots`` slots."""
    return kv_bytes_per_token(cfg, itemsize) * slots


def step_room(tree: TreeConfig, chain: ChainConfig | None = None, ngram_nodes: int = 0) -> int:
    """Cache slots one step needs after the committed context: the largest tree (with ``ngram_nodes`` of prompt
    lookup merged in; 0 without an n-gram config) or chain (with the tokens a grammar may force into it), + root +
    bonus (``Engine._ensure_room``)."""
    return max(tree.largest + ngram_nodes, (chain or ChainConfig()).gamma + FORCED_IN_CHAIN + ngram_nodes) + 2


def fitting_caps(tree: TreeConfig, floor: int = 64) -> list[TreeConfig]:
    """The trees a GPU memory plan tries in turn (:func:`specexec.api.load`): ``tree`` itself, and for ``--budget
    auto`` its ``max_budget`` halved down to ``floor`` (what is reserved for trees then shrinks with it)."""
    if not tree.auto:
        return [tree]
    out, b = [tree], tree.max_budget // 2
    while b >= floor:
        out.append(replace(tree, max_budget=b, budget=min(tree.budget, b)))
        b //= 2
    return out


def target_cache_slots(context: int, tree: TreeConfig, chain: ChainConfig | None = None, ngram_nodes: int = 0) -> int:
    """Slots of the target's KV cache (what ``Engine._ensure_room`` allocates)."""
    return context + step_room(tree, chain, ngram_nodes)


def draft_cache_slots(context: int, tree: TreeConfig, chain: ChainConfig | None = None, ngram_nodes: int = 0) -> int:
    """Slots of the draft's KV cache: the target's room + every expanded node of a tree + one scratch slot."""
    return context + step_room(tree, chain, ngram_nodes) + tree.largest + tree.max_beams + 1


# ---------------------------------------------------------------------------------------------- activations


def pass_activation_bytes(cfg: ModelConfig, tokens: int, itemsize: int, context: int = 0) -> int:
    """Activations of one forward over ``tokens`` rows attending to ``context`` + ``tokens`` slots: the fused
    q/k/v and MLP outputs, a few hidden-size temporaries and, with GQA, the keys/values expanded to every head
    (the logits are counted separately)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd
    per_row = 3 * cfg.intermediate_size + qkv + 4 * d  # w13 output (2I) + silu*up (I) + qkv + temporaries
    act = tokens * per_row * itemsize
    if cfg.num_heads != cfg.num_kv_heads:
        act += 2 * cfg.num_heads * (context + tokens) * hd * itemsize
    return act


def logits_bytes(cfg: ModelConfig, rows: int, itemsize: int = 4) -> int:
    """Logits of ``rows`` rows: the lm_head output at ``itemsize`` plus its fp32 copy when that is not fp32."""
    return rows * cfg.vocab_size * (4 + (itemsize if itemsize != 4 else 0))


def invariant_attention_bytes(
    cfg: ModelConfig, context: int = 0, rows: int = 2048, attn_rows: int = 16, key_block: int = 64
) -> int:
    """Peak temporaries (bytes) of one layer's shape-invariant attention on a GPU,
    :func:`specexec.model.attention.blocked`, for a pass of ``rows`` rows (a chain that deep at worst: the rows'
    own blocks, R = rows / key_block + 1 of them) over a prefix of ``context`` positions (S = context / key_block
    shared blocks), its products' row tile ``attn_rows``. It runs the rows in chunks of c rows whose largest
    working tensor holds about :data:`~specexec.model.attention.CHUNK_ELEMENTS` fp32 values (never fewer than one
    row tile), and a chunk holds, in fp32: the gathered keys and values (2 KVH c R B hd); the own blocks'
    expanded queries, scores, exps and values product, their query group padded to whole tiles (Gp);
    the shared blocks' expanded queries, scores, exps and values product (M = c G rows padded); the blocks'
    concatenated parts and their running sum (2 KVH c G (S + R) hd); and the products' padding to
    :data:`~specexec.model.attention.MIN_OUTPUTS` outputs (inputs and output). A kernel that writes only its
    output (rows x heads x head_dim) would replace this function."""
    from specexec.model.attention import CHUNK_ELEMENTS, MIN_OUTPUTS

    H, KVH, hd, B = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, key_block
    G = H // KVH
    Gp = -(-G // attn_rows) * attn_rows
    S = context // B
    R = -(-rows // B) + 1
    per_row = max(H * (S + R) * max(B, hd), 2 * KVH * R * B * hd)  # as blocked sizes its chunks
    c = max(attn_rows, CHUNK_ELEMENTS // per_row // attn_rows * attn_rows)
    M = -(-c * G // attn_rows) * attn_rows
    gathered = 2 * KVH * c * R * B * hd
    own = KVH * c * R * Gp * (2 * hd + 2 * B)
    shared = KVH * S * M * (2 * hd + 2 * B)
    parts = 2 * KVH * c * G * (S + R) * hd
    return 4 * (gathered + own + shared + parts + 3 * MIN_OUTPUTS)


@dataclass(frozen=True)
class StepBuffers:
    """Bytes of every buffer whose size grows with the tree (one decoding step at the largest tree)."""

    target_kv_room: int  # target KV slots for the tree (beyond the context)
    draft_kv_room: int  # draft KV slots for the tree, the expanded nodes and the scratch slot
    ancestry: int  # N x N bool ancestry mask
    verify_mask: int  # rows x (context + N) bool mask of one verification chunk
    logits: int  # N x V fp32 target logits + one same-sized working copy
    target_activations: int  # one target pass over a verification chunk
    draft_work: int  # one draft pass over max_beams rows: logits, log-probs, masks, candidates, tree arrays

    @property
    def total(self) -> int:
        return (
            self.target_kv_room
            + self.draft_kv_room
            + self.ancestry
            + self.verify_mask
            + self.logits
            + self.target_activations
            + self.draft_work
        )

    def largest(self) -> tuple[str, int]:
        """(name, bytes) of the biggest item, for messages."""
        items = {
            k: getattr(self, k)
            for k in (
                "target_kv_room",
                "draft_kv_room",
                "ancestry",
                "verify_mask",
                "logits",
                "target_activations",
                "draft_work",
            )
        }
        name = max(items, key=lambda k: items[k])
        return name.replace("_", " "), items[name]


def step_buffers(
    target: ModelConfig,
    draft: ModelConfig | None,
    context: int,
    tree: TreeConfig,
    chain: ChainConfig | None = None,
    target_itemsize: int = 4,
    draft_itemsize: int = 4,
    ngram_nodes: int = 0,
) -> StepBuffers:
    """The tree-sized buffers of one step (see :class:`StepBuffers`) for ``tree.largest`` draft tokens (plus
    ``ngram_nodes`` merged prompt-lookup nodes)."""
    room = step_room(tree, chain, ngram_nodes)
    n = room - 1  # tree nodes with the root
    rows = min(n, tree.verify_chunk)
    t_act = pass_activation_bytes(target, rows, target_itemsize, context)
    if target_itemsize != 4:
        t_act += rows * target.vocab_size * target_itemsize  # the lm_head output before its fp32 cast
    d_kv = d_work = 0
    if draft is not None:
        slots = draft_cache_slots(context, tree, chain, ngram_nodes)
        d_kv = kv_bytes(draft, slots - context, draft_itemsize)
        k = min(tree.max_beams, n)
        branch = min(tree.max_branch, draft.vocab_size)
        d_work = (
            logits_bytes(draft, k, draft_itemsize)
            + k * draft.vocab_size * 4  # logits + log-probs
            + k * slots  # the tree mask over the draft cache (bool)
            + pass_activation_bytes(draft, k, draft_itemsize, slots)
            + 2 * k * branch * (4 + 8 + 8)  # top-k values/tokens/parents and their filtered copies
            + (2 * tree.largest + 1) * (8 + 8 + 8 + 4 + 8)
        )  # tree arrays: token, parent, depth, logp, slot
    return StepBuffers(
        target_kv_room=kv_bytes(target, room, target_itemsize),
        draft_kv_room=d_kv,
        ancestry=n * n,
        verify_mask=rows * (context + n),
        logits=2 * n * target.vocab_size * 4,
        target_activations=t_act,
        draft_work=d_work,
    )


# ---------------------------------------------------------------------------------------------- everything


@dataclass(frozen=True)
class EngineMemory:
    """What an :class:`~specexec.decoding.engine.Engine` allocates, in bytes."""

    weights: int  # target + draft weights (0 for the target when it is offloaded)
    kv_context: int  # both KV caches' slots for the committed context (the tree room is in ``step``)
    step: StepBuffers  # every tree-sized buffer

    @property
    def kv(self) -> int:
        """Both KV caches as allocated (context + tree room)."""
        return self.kv_context + self.step.target_kv_room + self.step.draft_kv_room

    @property
    def workspace(self) -> int:
        """Tree-sized buffers other than KV room (masks, logits, activations, draft work)."""
        return self.total - self.weights - self.kv

    @property
    def fixed(self) -> int:
        """Bytes that do not depend on the tree budget (weights, KV over the context)."""
        return self.weights + self.kv_context

    @property
    def total(self) -> int:
        return self.weights + self.kv_context + self.step.total


def engine_memory(
    target: ModelConfig,
    draft: ModelConfig | None,
    context: int,
    target_itemsize: int,
    draft_itemsize: int,
    tree: TreeConfig,
    chain: ChainConfig | None = None,
    target_weights: int | None = None,
    draft_weights: int | None = None,
    ngram_nodes: int = 0,
    lanes: int = 1,
) -> EngineMemory:
    """Bytes an engine allocates with these configs. ``context`` is clamped to the target's
    ``max_position_embeddings`` (as :func:`specexec.api.load` does). ``lanes``: requests generating together,
    each with KV caches of its own (:meth:`Engine.lanes`).

    ``target_weights``/``draft_weights``: resident weight bytes when known better than the config's parameter
    count at the itemsize (e.g. from :func:`stored_weights`); pass ``target_weights=0`` for an offloaded target.
    ``ngram_nodes``: prompt-lookup nodes merged into each tree (:meth:`TreeConfig.ngram_nodes`).
    """
    context = min(context, target.max_position_embeddings)
    weights = param_count(target) * target_itemsize if target_weights is None else target_weights
    kv = kv_bytes(target, context, target_itemsize)
    if draft is not None:
        weights += param_count(draft) * draft_itemsize if draft_weights is None else draft_weights
        kv += kv_bytes(draft, context, draft_itemsize)
    step = step_buffers(target, draft, context, tree, chain, target_itemsize, draft_itemsize, ngram_nodes)
    return EngineMemory(weights=weights, kv_context=kv * lanes, step=step)


@dataclass(frozen=True)
class PlanReservations:
    """What an offloaded target's memory plan (:func:`offload.plan.make_plan`) leaves room for on the GPU before
    placing target layers, as :func:`specexec.api.load` charges it."""

    draft_bytes: int  # the resident draft's weights (its format's bytes: dense, int8 or nf4)
    kv_bytes: int  # both KV caches + the step's buffers other than the target's logits and activations
    max_tokens: int  # rows of the largest target pass (the plan sizes its workspace for it)


def plan_reservations(
    target: ModelConfig,
    draft: ModelConfig | None,
    context: int,
    target_itemsize: int,
    draft_itemsize: int,
    tree: TreeConfig,
    draft_weights: int | None = None,
    lanes: int = 1,
) -> PlanReservations:
    """:class:`PlanReservations` for these configs (the plan counts the target's own logits and activations in
    its workspace). ``draft_weights``: the draft's resident bytes (e.g. :func:`model_weight_bytes` of a low-bit
    draft); None: its parameters at ``draft_itemsize``."""
    # the n-gram branches a GPU merges into every draft tree by default (none without a draft: AR)
    merged = (tree.ngram if tree.ngram is not None else NGRAM_NODES_GPU) if draft is not None else 0
    est = engine_memory(
        target, draft, context, target_itemsize, draft_itemsize, tree,
        target_weights=0, draft_weights=draft_weights, ngram_nodes=merged, lanes=lanes,
    )  # fmt: skip
    others = est.total - est.weights - est.step.logits - est.step.target_activations
    return PlanReservations(est.weights, others, min(step_room(tree, None, merged) - 1, tree.verify_chunk))


# -- the load-time invariance check (specexec.loading.invariance): its sizes and its one line ---------------------
CPU_MAX_ROWS = 256  # the largest pass checked on a CPU (bigger ones run as passes of this many rows)
CUDA_MAX_ROWS = 4096
PROBES = 16  # different probe rows a checked pass holds (see invariance.linear_invariant)
GUARANTEE = "greedy output equals plain decoding up to near-ties; sampling still follows the target's distribution"


def head_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of every linear a pass runs: one decoder layer's fused wqkv, wo, w13, w2 and the output head."""
    d, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    layer = [(q + 2 * kv, d), (d, q), (2 * cfg.intermediate_size, d), (d, cfg.intermediate_size)]
    return [*layer, (cfg.vocab_size, cfg.hidden_size)]


def check_bytes(cfg: ModelConfig, dtype: torch.dtype, device_type: str = "cuda") -> int:
    """Device bytes the invariance check (``invariance.find``) holds at its peak on ``cfg``'s shapes, from what
    ``invariance.linear_invariant`` allocates for its largest linear (the output head at real shapes): the random
    weight (out x in; made on the host in fp32, converted there, then copied), the pass rows ``x``, a pass's copy of
    them and its zero-padded copy (max_rows x in each), the probes and their one-row results, and a pass's output
    twice (max_rows x out: a fixed-tile pass concatenates its tiles' outputs). The attention check's tensors are
    a few hundred positions long (negligible)."""
    isz = torch.empty((), dtype=dtype).element_size()
    rows = CUDA_MAX_ROWS if device_type == "cuda" else CPU_MAX_ROWS
    return max((o * i + 3 * rows * i + PROBES * (i + o) + 2 * rows * o) * isz for o, i in head_shapes(cfg))


def unavailable_message(note: str) -> str:
    """The one line a target without shape-invariant passes logs: why, and the guarantee the user has instead."""
    return f"shape-invariant passes are off ({note}); what still holds: {GUARANTEE}"
