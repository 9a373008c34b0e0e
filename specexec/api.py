"""The public API: ``engine = specexec.load(target, draft)``, then ``engine.generate(...)`` / ``stream(...)``.

Example::

    import specexec
    engine = specexec.load("qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b")
    result = engine.generate("def quicksort(arr):", max_new_tokens=64)
    print(result.text, result.stats.tokens_per_s)

:func:`load` is one pass of four steps, each a function below: find the checkpoints (:func:`_find`), plan memory
once (:func:`_plan_memory`: where the target lives and whether everything fits, before anything is allocated), load
the draft (:func:`_load_draft`), load the target (:func:`_load_target`). :func:`load_engine` is the command line's
way in: the same load from :class:`ModelOptions`, with downloads shown before a spinner starts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from specexec.config import TreeConfig
from specexec.decoding.engine import Engine
from specexec.errors import ConfigError, OutOfMemory, SpecexecError, setting
from specexec.loading import draft_choice, hub, memory, pairing
from specexec.loading.checkpoint import (
    DEFAULT_DRAFT_VOCAB,
    SELF_DRAFT,
    TokenizerInfo,
    draft_format,
    draft_vocab_ids,
    load_model,
    load_tokenizer,
    model_dir,
    parse_device,
    read_config,
    resolve_dtype,
)
from specexec.model import sizes
from specexec.model.transformer import ModelConfig, Transformer
from specexec.propose.draft_model import limit_draft

log = logging.getLogger(__name__)


def load(
    target: str,
    draft: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    draft_dtype: str | None = None,
    context: int = 4096,
    offload: Any = None,
    tree: TreeConfig | None = None,
    progress: bool = True,
    cache_dir: str | Path | None = None,
    draft_vocab: int | None = None,
    share_prefix: bool = True,
    invariant: bool = True,
    prefix_cache_bytes: int | None = None,
    parallel: int = 1,
) -> Engine:
    """Load a target and an optional draft into an :class:`~specexec.decoding.engine.Engine`.

    Before anything is allocated, the weights (counted from the safetensors headers at their loaded dtype), both
    KV caches and every tree-sized buffer are checked against free memory; a load that does not fit raises
    :class:`~specexec.loading.memory.NotEnoughMemory`, naming the largest tree budget that fits when the tree is
    what is too big.

    Args:
        target: an alias, HF id, local directory or GGUF file.
        draft: the same for the draft model; None: no draft (plain decoding). ``"self"``: the target's own
            checkpoint loaded a second time in low bit (SubSpec-style), resident beside the target; it reads the
            committed tokens' keys and values from the target's cache (``share_prefix``). ``"heads"``: no draft
            model; Medusa-style heads trained on this target (``specexec heads train``; the demo target's ship in
            the package) propose from its last hidden state (:mod:`specexec.propose.heads`). ``"auto"``: the draft of
            the target's known pair, else a smaller model of its family on this machine, else none
            (:func:`specexec.loading.pairing.choose_draft`; the choice is logged). A draft's tokenizer must agree
            with the target's on the ids it can propose; the few ids where it does not are never proposed
            (:func:`specexec.loading.pairing.check_pair`).
        device: ``auto`` (CUDA when available, else the CPU), ``cpu`` or ``cuda[:N]``.
        dtype: the compute dtype: ``auto`` (bf16 on CUDA; on a CPU fp32 or bf16, whichever a cached measurement of
            this machine finds faster, :mod:`specexec.loading.cpu_probe`), ``fp32``, ``bf16`` or ``fp16``.
        draft_dtype: the draft's dtype or low-bit weight format (None: ``dtype``): ``int8`` or ``nf4``
            (:func:`~specexec.loading.checkpoint.draft_format`). ``auto`` chooses:
            on a CPU int8 where it runs clearly faster than dense; on a GPU beside a streamed target the 16-bit,
            int8 or NF4 draft expected to decode fastest (:mod:`specexec.loading.draft_choice`); for a self draft
            int8 on a CPU and nf4 on CUDA.
        context: the longest prompt + answer the KV caches hold, in tokens (at most the model's maximum).
        offload: an :class:`offload.OffloadConfig` for a streamed or NF4 target; None: the target is resident.
        tree: the draft tree settings the caches are sized for. With ``auto`` budgets beside a streamed target,
            ``max_budget`` may be lowered to fit the memory plan (``Engine.max_tree`` then says so).
        progress: show download and conversion progress.
        cache_dir: specexec's cache root (models, layer caches, step costs); None: ``$SPECEXEC_HOME``, else
            ``~/.cache/specexec``.
        draft_vocab: restrict the draft's lm_head to this many frequency-ranked token ids, plus the special ids and
            the tokens it is fed (FR-Spec); 0: the full vocabulary; None: 32768 on a CPU for a draft whose
            vocabulary is over twice that, else the full vocabulary.
        share_prefix: a self draft copies the committed tokens' keys and values from the target's cache; False:
            it computes its own (for comparisons).
        invariant: run the target's passes shape-invariant (:mod:`specexec.loading.invariance`): each position's
            logits are bit-identical whatever pass computes them, so every method's greedy output is the target's
            plain greedy decoding token for token and a request gives the same text every time. False: the
            fastest kernel for each pass's shape (for benchmarks; output may then differ at near-ties).
        prefix_cache_bytes: the budget of the prefix cache across conversations: snapshots (in host RAM) of
            committed keys and values another prompt would drop, restored for a later prompt that shares their
            prefix (:mod:`specexec.model.prefix_store`); None: min(1 GiB, 10% of the available RAM); 0: off.
        parallel: the requests that will generate together (:meth:`Engine.lanes`, ``serve --parallel``): the
            memory plan holds that many KV caches (a streamed target keeps fewer layers resident to make room).
    """
    if context < 8:
        raise ConfigError("context", context, "must be >= 8 tokens")
    if parallel < 1:
        raise ConfigError("parallel", parallel, "must be >= 1")
    if prefix_cache_bytes is not None and prefix_cache_bytes < 0:
        raise ConfigError("prefix_cache_bytes", prefix_cache_bytes, "must be >= 0 (0: no prefix cache)")
    tree = tree or TreeConfig()
    home = Path(cache_dir).expanduser() if cache_dir is not None else None
    if offload is not None and home is not None and offload.cache_dir is None:
        offload = replace(offload, cache_dir=home)
    dev = parse_device(device)
    if draft == pairing.AUTO:
        choice = pairing.choose_draft(target, home)
        log.info("%s", choice.line)
        draft = choice.draft
    from_blocks = _layers_in_gguf(offload, draft, dev, dtype)
    use_heads = draft == HEADS_DRAFT
    if use_heads:
        draft = None
    found = _find(target, draft, progress, home, layers_in_gguf=from_blocks)
    limit = found.target_cfg.max_position_embeddings
    if context > limit:
        log.warning("context capped at the model's %d positions (was %d)", limit, context)
        context = limit
    d_dt, d_fmt = _draft_format(found, draft_dtype, dtype, dev)
    t_fmt, t_dt = _target_format(found.target_cfg, dtype, dev, offload, found.target)
    mem = _plan_memory(found, dev, dtype, draft_dtype, d_dt, d_fmt, offload, context, tree, t_fmt, t_dt, parallel)
    # the draft first: it stays resident, and the target's memory plan accounted for it
    d_model = _load_draft(found, dev, d_dt, mem, draft_vocab)
    if invariant and mem.offload is None and t_dt is not None:
        # the invariance check allocates full-size weights of the target's shapes: before the target, not beside it
        from specexec.loading import invariance

        invariance.choose(found.target_cfg, t_dt, dev, home=hub.cache_home(home), fmt=t_fmt)
    t_model = _load_target(found, dev, dtype, mem, offload, t_fmt, t_dt)
    engine = Engine(
        t_model,
        found.tokenizer,
        d_model,
        context=context,
        tree=mem.tree,
        costs_dir=hub.cache_home(cache_dir) / "costs",
        share_prefix=share_prefix,
        max_tree=mem.tree_cap,
        invariant=invariant,
        prefix_cache_bytes=prefix_cache_bytes,
    )
    if d_model is not None and d_dt is not None:  # what the chat banner names (--draft-dtype auto may choose)
        engine.draft_weights = mem.draft_fmt if mem.draft_fmt != "dense" else str(d_dt).removeprefix("torch.")
    if t_fmt != "dense":
        engine.target_weights = t_fmt
    if use_heads:
        engine.heads = _load_heads(found.target, target, home)
    if offload is not None and offload.gpu_memory_gb is not None and dev.type == "cuda":
        engine.gpu_cap = int(offload.gpu_memory_gb * 1e9)
    return engine


HEADS_DRAFT = "heads"  # draft="heads": Medusa-style heads on the target instead of a draft model


def _load_heads(model_dir: Path, name: str, home: Path | None) -> Any:
    """The target's trained heads (the cache's, else the package's), or one error naming the train command."""
    from specexec.propose.heads import Heads, find_heads

    path = find_heads(model_dir, home)
    if path is None:
        raise SpecexecError(f"no trained heads for {name}: run `specexec heads train --target {name}` (once)")
    heads = Heads.load(path)
    if heads.a.shape[1] != read_config(model_dir).hidden_size:
        raise SpecexecError(f"the heads in {path} do not fit {name}: train them again (`specexec heads train`)")
    log.info("heads for %s: %s", name, path)
    return heads


# ---------------------------------------------------------------------------------------------- 1. find


@dataclass(frozen=True)
class _Found:
    """The checkpoints to load: located (downloaded or converted if need be) and read, nothing loaded yet."""

    target: Path
    target_cfg: ModelConfig
    tokenizer: TokenizerInfo
    draft: Path | None  # a self draft: the target's own directory
    draft_cfg: ModelConfig | None
    draft_tokenizer: TokenizerInfo
    self_draft: bool
    paired: pairing.Pairing | None = None  # the ids the draft never proposes (None: a self draft or none)


def _layers_in_gguf(offload: Any, draft: str | None, dev: torch.device, dtype: str) -> bool:
    """Whether a GGUF target converts without its layers, embedding and lm_head (no 16-bit copy on disk): an NF4
    target is quantized from the GGUF's blocks, and a CPU target whose weights are left to ``auto`` (with the
    compute dtype) or asked as ``q4`` runs the file's own blocks, read from the file at load (without a C compiler,
    ``auto`` reads them into the format the CPU probe picks). A self draft or heads (which read the target's 16-bit
    weights) keep the copy."""
    if draft in (SELF_DRAFT, HEADS_DRAFT):
        return False
    want = offload.target_dtype if offload is not None else "auto"
    if want == "nf4":
        return True
    if dev.type != "cpu" or not (want == "auto" and dtype == "auto" or want == "q4" and dtype in ("auto", "fp32")):
        return False
    return offload is None or offload.mode not in ("ram", "ssd")


def _find(target: str, draft: str | None, progress: bool, home: Path | None, layers_in_gguf: bool = False) -> _Found:
    """Resolve both models to HF-format directories and read their configs and tokenizers (which must pair:
    :func:`specexec.loading.pairing.check_pair`). ``layers_in_gguf``: a GGUF target converts without its layers."""
    t_path = model_dir(
        hub.resolve(target, progress=progress, home=home, layers_in_gguf=layers_in_gguf),
        home=home,
        layers_in_gguf=layers_in_gguf,
    )
    t_tok = load_tokenizer(t_path)
    t_cfg = read_config(t_path)
    self_draft = draft == SELF_DRAFT
    d_path, d_tok, d_cfg, paired = None, t_tok, None, None
    if self_draft:
        d_path, d_cfg = t_path, t_cfg  # the same checkpoint, loaded in a low-bit format
    elif draft is not None:
        d_path = model_dir(hub.resolve(draft, progress=progress, home=home))
        d_tok = load_tokenizer(d_path)
        d_cfg = read_config(d_path)
        paired = pairing.check_pair(t_tok.tokenizer, d_tok.tokenizer, t_cfg.vocab_size, d_cfg.vocab_size, target, draft)
    return _Found(t_path, t_cfg, t_tok, d_path, d_cfg, d_tok, self_draft, paired)


def _draft_format(
    found: _Found, draft_dtype: str | None, dtype: str, dev: torch.device
) -> tuple[torch.dtype | None, str]:
    """(compute dtype, weight format) of the draft, see :func:`~specexec.loading.checkpoint.draft_format`; (None,
    "dense") without one."""
    if found.draft_cfg is None:
        return None, "dense"
    return draft_format(draft_dtype, dtype, dev, found.draft_cfg, found.self_draft)


def _target_format(
    cfg: ModelConfig, dtype: str, dev: torch.device, offload: Any, path: Path | None = None
) -> tuple[str, torch.dtype | None]:
    """(weight format, compute dtype) of a resident target: ``int8`` weights computing in bf16 (a CPU's
    ``int8pack`` kernel) or ``q4`` weights computing in fp32 (our block kernels) when asked
    (``OffloadConfig.target_dtype``), or, with both the target dtype and the compute dtype ``auto`` on a CPU: ``q4``
    for a GGUF conversion (at ``path``) whose GGUF is at hand (the file's own blocks), else a low-bit format where
    this machine runs it clearly faster (:func:`specexec.loading.cpu_probe.choose_target`); else ``dense`` in the
    resolved dtype (None: a streamed or NF4 target, whose offload plan decides)."""
    want = offload.target_dtype if offload is not None else "auto"
    if want in ("int8", "q4"):
        from specexec.loading import cpu_probe

        field = "OffloadConfig.target_dtype"
        if dev.type != "cpu":
            raise ConfigError(field, want, f"is a CPU format; on a GPU use {setting(field, 'nf4')}")
        if offload.mode in ("ram", "ssd"):
            raise ConfigError(field, want, "keeps the target resident in RAM: not with a streamed target")
        dt = cpu_probe.TARGET_FORMATS[want]
        name = "bf16" if dt == torch.bfloat16 else "fp32"
        if dtype not in ("auto", name):
            raise ConfigError("dtype", dtype, f"{want} target weights compute in {name}: use auto or {name}")
        if want == "q4":
            from specexec.formats import q4

            why = q4.available()
            if why is not None:
                raise ConfigError(field, want, f"cannot run here: {why}")
        cpu_probe.orientation(cfg, dt)
        return want, dt
    if _offloaded(offload, dev):
        return "dense", None
    if want == "auto" and dev.type == "cpu" and dtype == "auto":
        from specexec.formats import native
        from specexec.loading import convert, cpu_probe

        if path is not None and convert.gguf_blocks(path) is not None and native.available() is None:
            cpu_probe.orientation(cfg, torch.float32)
            return "q4", torch.float32  # a GGUF's own blocks: the file's quality, its bytes
        fmt, dt = cpu_probe.choose_target(cfg)
        cpu_probe.orientation(cfg, dt)
        return fmt, dt
    return "dense", resolve_dtype(dtype, dev, cfg)


# ---------------------------------------------------------------------------------------------- 2. plan memory


@dataclass(frozen=True)
class _MemoryPlan:
    """Where everything goes, decided before anything is allocated."""

    offload: Any  # the streamed (or NF4) target's offload.Plan; None: the target is resident on the device
    tree: TreeConfig  # what the caches are sized for: the tree asked for, or an auto tree with a lower max_budget
    tree_cap: int | None  # that lower max_budget (Engine.max_tree: the CLI prints a notice); None: not lowered
    draft_fmt: str  # the draft's weight format (--draft-dtype auto on a GPU may choose a lighter one)
    draft_weights: int | None  # its resident bytes in that format


def _plan_memory(
    found: _Found,
    dev: torch.device,
    dtype: str,
    draft_dtype: str | None,
    d_dt: torch.dtype | None,
    d_fmt: str,
    offload: Any,
    context: int,
    tree: TreeConfig,
    t_fmt: str = "dense",
    t_dt: torch.dtype | None = None,
    lanes: int = 1,
) -> _MemoryPlan:
    """Plan the target's placement (a streamed target: with the draft format and tree that leave room for its ring)
    and check that weights, KV caches (``lanes`` of each) and tree buffers fit
    (:func:`specexec.loading.memory.check_engine`)."""
    t_cfg, d_cfg = found.target_cfg, found.draft_cfg
    d_isz = d_dt.itemsize if d_dt is not None else 4  # activations and the draft's KV cache
    d_stored = sizes.stored_weights(found.draft) if found.draft is not None else None

    def draft_bytes(fmt: str) -> int | None:
        return d_stored.resident_bytes(d_isz, d_cfg, fmt) if d_stored is not None else None

    plan, tree_cap = None, None
    if _offloaded(offload, dev):
        from specexec.loading.offloaded import plan_streamed, target_compute_dtype

        t_isz = target_compute_dtype(dtype, offload, dev).itemsize
        # --draft-dtype auto on a GPU: the 16-bit, int8 and NF4 drafts are planned; among those that leave room for
        # the streamed target's ring, the picker takes the one modelled fastest
        formats, pick = [d_fmt], None
        if dev.type == "cuda" and d_cfg is not None and draft_dtype in (None, "auto") and d_fmt == "dense":
            formats += draft_choice.lighter_formats(torch.cuda.get_device_capability(dev))
            pick = draft_choice.picker(d_cfg, t_cfg, dev)

        def reserve(tree: TreeConfig, fmt: str) -> sizes.PlanReservations:
            return sizes.plan_reservations(
                t_cfg, d_cfg, context, t_isz, d_isz, tree, draft_weights=draft_bytes(fmt), lanes=lanes
            )

        plan, d_fmt, planned = plan_streamed(found.target, dev, dtype, offload, reserve, formats, tree, pick)
        if planned.max_budget < tree.max_budget:
            tree_cap = planned.max_budget
        tree = planned
        # what the target itself keeps where the engine's buffers live: its globals, plus (on a CPU) its layers
        t_weights = sizes.globals_bytes(t_cfg, t_isz)
        if dev.type == "cpu":
            t_weights += len(plan.resident) * plan.layer_bytes + plan.ram_need
    else:
        t_isz = (t_dt or resolve_dtype(dtype, dev, t_cfg)).itemsize
        stored = sizes.stored_weights(found.target)
        from specexec.loading import convert

        if convert.layers_in_gguf(found.target):  # its safetensors hold the small tensors only
            embed = t_cfg.vocab_size * t_cfg.hidden_size  # the largest tensor
            stored = sizes.StoredWeights(numel={"F16": sizes.param_count(t_cfg)}, largest=embed)
        t_weights = stored.resident_bytes(t_isz, t_cfg, t_fmt)
    d_weights = draft_bytes(d_fmt)
    memory.check_engine(
        t_cfg, d_cfg, dev, context, t_isz, d_isz, tree, target_weights=t_weights, draft_weights=d_weights, lanes=lanes
    )
    return _MemoryPlan(plan, tree, tree_cap, d_fmt, d_weights)


def _offloaded(offload: Any, dev: torch.device) -> bool:
    """Whether the target goes through the offload manager (streamed or NF4) rather than a plain resident load."""
    if offload is None or offload.mode == "none" and offload.target_dtype != "nf4":
        return False
    if dev.type == "cpu" and offload.mode == "auto" and offload.target_dtype != "nf4":
        return False  # nothing to stream to on a CPU: the target is simply resident in RAM
    return True


# ---------------------------------------------------------------------------------------------- 3, 4. load


def _load_draft(
    found: _Found,
    dev: torch.device,
    d_dt: torch.dtype | None,
    mem: _MemoryPlan,
    draft_vocab: int | None,
) -> Transformer | None:
    """The draft in its planned format, with a frequency-ranked head where asked (or by default on a CPU)."""
    if found.draft is None or found.draft_cfg is None or d_dt is None:
        return None
    d_cfg, fmt = found.draft_cfg, mem.draft_fmt
    vocab = draft_vocab
    if vocab is None and dev.type == "cpu" and fmt != "nf4" and d_cfg.vocab_size > 2 * DEFAULT_DRAFT_VOCAB:
        vocab = DEFAULT_DRAFT_VOCAB
    head = draft_vocab_ids(found.draft_tokenizer, d_cfg.vocab_size, vocab) if vocab else None
    excluded = found.paired.excluded if found.paired is not None else None
    if head is not None and excluded is not None and excluded.numel():  # never score rows it may not propose
        head = head[~torch.isin(head, excluded)]
    what = "self-derived draft (the target's weights)" if found.self_draft else f"draft {found.draft.name}"
    log.info("loading the %s: %s weights, %.2f GB, computing in %s", what, fmt, (mem.draft_weights or 0) / 1e9, d_dt)
    model = _load(found.draft, dev, d_dt, fmt=fmt, head_ids=head)
    if found.self_draft:  # its layer i is the target's layer i: it can read the target's prefix
        model.source_layers = tuple(range(found.target_cfg.num_layers))
    if excluded is not None:  # ids whose tokens differ from the target's, or rows that are no token: never proposed
        model = limit_draft(model, excluded)
    return model


def _load_target(
    found: _Found,
    dev: torch.device,
    dtype: str,
    mem: _MemoryPlan,
    offload: Any,
    t_fmt: str = "dense",
    t_dt: torch.dtype | None = None,
) -> Transformer:
    """The target: through the offload manager when it has a plan, else resident (int8 or 4-bit weights: each
    linear quantized while loading)."""
    if mem.offload is not None:
        from specexec.loading.offloaded import load_offloaded

        return load_offloaded(found.target, dev, dtype, offload, plan=mem.offload)
    dt = t_dt or resolve_dtype(dtype, dev, found.target_cfg)
    if t_fmt == "int8":
        log.info("loading the target in int8 weights (computing in bf16)")
        return _load(found.target, dev, dt, fmt="int8", int8_kernel="int8pack")
    if t_fmt == "q4":
        log.info("loading the target in 4-bit weights (computing in fp32)")
        return _load(found.target, dev, dt, fmt="q4")
    return _load(found.target, dev, dt)


def _load(path: Path, dev: torch.device, dt: torch.dtype, **kw: Any) -> Transformer:
    try:
        return load_model(path, dev, dt, **kw)
    except torch.cuda.OutOfMemoryError:
        raise OutOfMemory(
            f"not enough GPU memory to load {path} resident; use {setting('OffloadConfig.mode', 'auto')} or a "
            f"smaller {setting('dtype')}",
            "GPU memory",
        ) from None


# ---------------------------------------------------------------------------------------------- the CLI's way in


@dataclass(frozen=True)
class ModelOptions:
    """Which models to load and how: :func:`load`'s model arguments, as the command line collects them."""

    target: str
    draft: str | None = None  # an alias, id or path, "self", "auto" (see :func:`load`), or None: no draft
    device: str = "auto"
    dtype: str = "auto"
    draft_dtype: str | None = None
    context: int = 4096
    offload: Any = None  # an offload.OffloadConfig, or None: the target is resident
    cache_dir: Path | None = None  # specexec's cache root; None: $SPECEXEC_HOME, else ~/.cache/specexec
    draft_vocab: int | None = None  # the draft's head: N frequent ids, 0: all; None: load's default
    invariant: bool = True  # shape-invariant target passes (False: fastest kernels, for benchmarks)
    prefix_cache_bytes: int | None = None  # the prefix cache's budget across conversations (None: load's default)
    draft_choice: str | None = None  # how draft="auto" chose the draft: the line the command line shows
    parallel: int = 1  # requests the caches are planned for (a server's --parallel)


def load_engine(
    opts: ModelOptions,
    tree: TreeConfig,
    progress: bool = True,
    status: Callable[[str], ContextManager[Any]] | None = None,
) -> Engine:
    """Resolve the models (downloads show their own progress bars), then :func:`load` them inside
    ``status(message)``: the command line passes a spinner there, and two live displays cannot nest."""
    d_path: Path | str | None = None
    draft = opts.draft
    if draft == pairing.AUTO:  # the command line resolves auto before (and says which); other callers here
        draft = pairing.choose_draft(opts.target, opts.cache_dir).draft
    from_blocks = _layers_in_gguf(opts.offload, draft, parse_device(opts.device), opts.dtype)
    t_path = hub.resolve(opts.target, progress=progress, home=opts.cache_dir, layers_in_gguf=from_blocks)
    if draft in (SELF_DRAFT, HEADS_DRAFT):
        d_path = draft  # the target's own weights in low bit, or heads on it: nothing to resolve
    elif draft:
        d_path = hub.resolve(draft, progress=progress, home=opts.cache_dir)
    with (status or (lambda _msg: nullcontext()))("loading models"):
        return load(
            str(t_path),
            str(d_path) if d_path else None,
            device=opts.device,
            dtype=opts.dtype,
            draft_dtype=opts.draft_dtype,
            context=opts.context,
            offload=opts.offload,
            tree=tree,
            progress=progress,
            cache_dir=opts.cache_dir,
            draft_vocab=opts.draft_vocab,
            invariant=opts.invariant,
            prefix_cache_bytes=opts.prefix_cache_bytes,
            parallel=opts.parallel,
        )
