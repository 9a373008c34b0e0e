"""The small public API: ``engine = specexec.load(target, draft)``, then ``engine.generate(...)`` / ``stream(...)``.

Example::

    import specexec
    engine = specexec.load("qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b")
    result = engine.generate("def quicksort(arr):", max_new_tokens=64)
    print(result.text, result.stats.tokens_per_s)
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from specexec.config import TreeConfig
from specexec.decoding.engine import Engine
from specexec.errors import ConfigError, OutOfMemory, setting
from specexec.loading import draft_choice, hub, layer_select, memory
from specexec.loading.checkpoint import (
    DEFAULT_DRAFT_VOCAB,
    SELF_DRAFT,
    check_tokenizers_match,
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
    draft_layers: str | None = None,
    share_prefix: bool = True,
) -> Engine:
    """Load a target (alias, HF id or path) and optional draft into an :class:`~specexec.decoding.engine.Engine`.

    ``offload`` is an :class:`offload.OffloadConfig` (None: the target is resident on ``device``; its
    ``target_dtype`` may be nf4). ``dtype`` is the compute dtype (auto: bf16 on CUDA; on a CPU fp32 or bf16 by a
    cached measurement of this machine, :mod:`specexec.loading.cpu_probe`), ``draft_dtype`` the draft's (default: same
    as
    ``dtype``; also the low-bit weight formats ``int8`` -- fbgemm on a CPU, bitsandbytes' int8 GEMM on CUDA -- and
    ``nf4`` -- bitsandbytes on CUDA; on a CPU it dequantizes every pass, for tests -- and the group-wise ``q4``,
    ``q3``, ``q2`` (:mod:`specexec.formats.groupquant`: 4/3/2-bit codes, an fp16 scale and offset per 64 input columns,
    dequantized every pass); see :func:`specexec.loading.checkpoint.draft_format`). ``draft_dtype`` auto (or None) on
    a GPU
    with a streamed target: the 16-bit, int8 or NF4 draft, whichever is expected to decode fastest -- fewer streamed
    bytes against dearer draft passes and a little acceptance (:mod:`specexec.loading.draft_choice`).

    ``draft="self"``: a self-derived draft (SubSpec-style): the target's own checkpoint loaded a second time, in
    low bit (``draft_dtype`` auto: int8 on a CPU, nf4 on CUDA; a 16-bit/fp32 name is refused), resident beside the
    target. No second model or tokenizer (the tokenizers trivially match). It shares no weights with the target;
    it shares the KV prefix: the committed tokens' keys/values are copied from the target's cache after each step
    instead of computed by the draft (``share_prefix``; False: it computes its own, for comparisons). It still
    keeps its own KV cache (sized and checked like any draft's) for its tree nodes, and its weight bytes are
    counted in its low-bit format. ``draft_layers`` (self-derived drafts only): a *partial* self
    draft that keeps some of the target's layers and skips the rest (``all``, a number ``40``, a fraction ``0.5``
    -- chosen by their influence on a calibration text, measured on the target at load -- or indices
    ``0-11,20``; :mod:`specexec.loading.layer_select`); its weights and KV cache shrink with the layers it keeps.
    ``draft_vocab``: restrict the draft's lm_head to that many
    frequency-ranked token ids plus special ids and the tokens it is fed (FR-Spec); None: on a CPU 32768 for a draft
    whose vocabulary is over twice that (its lm_head is then a large share of each draft pass), else the full
    vocabulary; 0: the full vocabulary. ``draft_dtype`` auto on a CPU: int8 weights where this machine runs them
    clearly faster than dense ones (measured once, :func:`specexec.loading.cpu_probe.choose_draft`). ``context`` is the
    longest prompt + answer the KV caches hold.
    ``cache_dir``: specexec's cache root (models, offload layer caches); default
    :func:`specexec.loading.hub.cache_home`.

    Before anything is allocated, the weights (at their loaded dtype, counted from the safetensors headers), both
    KV caches and every tree-sized buffer are checked against free memory (:mod:`specexec.loading.memory`); a load that
    does not fit raises :class:`~specexec.loading.memory.NotEnoughMemory` (naming the largest tree budget that fits when
    the tree is what is too big).
    """
    if context < 8:
        raise ConfigError("context", context, "must be >= 8 tokens")
    tree = tree or TreeConfig()
    home = Path(cache_dir).expanduser() if cache_dir is not None else None
    if offload is not None and home is not None and offload.cache_dir is None:
        offload = replace(offload, cache_dir=home)
    dev = parse_device(device)
    t_path = model_dir(hub.resolve(target, progress=progress, home=home))
    t_tok = load_tokenizer(t_path)
    self_draft = draft == SELF_DRAFT
    d_path = None
    d_tok = t_tok
    if self_draft:
        d_path = t_path  # the same checkpoint, loaded below in a low-bit format
    elif draft is not None:
        d_path = model_dir(hub.resolve(draft, progress=progress, home=home))
        d_tok = load_tokenizer(d_path)
        check_tokenizers_match(t_tok.tokenizer, d_tok.tokenizer, target, draft)
    t_cfg = read_config(t_path)
    d_cfg = read_config(d_path) if d_path is not None else None
    layers = layer_select.parse(draft_layers, t_cfg.num_layers)
    if draft_layers is not None and not self_draft:
        raise layer_select.needs_self_draft(draft_layers)
    if d_cfg is not None and not layers.everything:  # sized (weights, KV cache) with the layers it keeps
        d_cfg = replace(d_cfg, num_layers=layers.kept(d_cfg.num_layers))
    context = min(context, t_cfg.max_position_embeddings)
    d_dt, d_fmt = draft_format(draft_dtype, dtype, dev, d_cfg, self_draft) if d_cfg is not None else (None, "dense")
    d_isz = d_dt.itemsize if d_dt is not None else 4  # activations and the draft's KV cache
    d_stored = sizes.stored_weights(d_path) if d_path is not None else None
    d_weights = d_stored.resident_bytes(d_isz, d_cfg, d_fmt) if d_stored is not None else None
    plan = None
    tree_cap: int | None = None  # the largest --budget auto tree the memory plan left room for, when lowered
    if _offloaded(offload, dev):
        from specexec.loading.offloaded import plan_with_draft, target_compute_dtype

        t_isz = target_compute_dtype(dtype, offload, dev).itemsize

        # --draft-dtype auto on a GPU: the 16-bit, int8 and NF4 drafts are planned, and among those that leave room
        # for the streamed target's ring the picker takes the one modelled fastest (specexec/draft_choice.py)
        formats = [d_fmt]
        pick = None
        if dev.type == "cuda" and d_cfg is not None and draft_dtype in (None, "auto") and d_fmt == "dense":
            formats += draft_choice.lighter_formats(torch.cuda.get_device_capability(dev))
            pick = draft_choice.picker(d_cfg, t_cfg, dev)  # the format expected to decode fastest among those that fit
        # --budget auto: the plan reserves KV and workspace for --max-budget trees; where that leaves no room for the
        # streamed target beside any draft format, smaller caps are tried (a 70B + 7B at 12 GB fits only with
        # trees of a few hundred nodes), and the engine then never grows a tree beyond the cap that fitted
        caps = sizes.fitting_caps(tree)
        for k, cap in enumerate(caps):

            def reserve(fmt: str, cap: TreeConfig = cap) -> sizes.PlanReservations:
                weights = d_stored.resident_bytes(d_isz, d_cfg, fmt) if d_stored is not None else None
                return sizes.plan_reservations(t_cfg, d_cfg, context, t_isz, d_isz, cap, draft_weights=weights)

            try:
                plan, d_fmt = plan_with_draft(t_path, dev, dtype, offload, reserve, formats, pick=pick)
            except OutOfMemory as e:
                if e.resource != "GPU memory":
                    raise
                if len(caps) == 1:  # a fixed budget: the tree's reservation is one of the things to shrink
                    smaller = setting("TreeConfig.budget")
                    raise OutOfMemory(f"{e}, or a smaller {smaller}", e.resource, e.need, e.have) from None
                if k == len(caps) - 1:
                    smallest = setting("TreeConfig.max_budget", cap.max_budget)
                    raise OutOfMemory(f"{e} (even with {smallest})", e.resource, e.need, e.have) from None
                continue
            if cap.max_budget < tree.max_budget:  # Engine.max_tree says so (the CLI prints a notice)
                log.info("max_budget lowered to %d to fit the streamed target's plan", cap.max_budget)
                tree_cap = cap.max_budget
            tree = cap
            break
        assert plan is not None  # the loop either planned or raised
        if d_stored is not None:
            d_weights = d_stored.resident_bytes(d_isz, d_cfg, d_fmt)
        # what the target itself keeps where the engine's buffers live: its globals, plus (on a CPU) its layers
        t_weights = sizes.globals_bytes(t_cfg, t_isz)
        if dev.type == "cpu":
            t_weights += len(plan.resident) * plan.layer_bytes + plan.ram_need
        memory.check_engine(
            t_cfg, d_cfg, dev, context, t_isz, d_isz, tree, target_weights=t_weights, draft_weights=d_weights
        )
    else:
        t_isz = resolve_dtype(dtype, dev, t_cfg).itemsize
        t_weights = sizes.stored_weights(t_path).resident_bytes(t_isz, t_cfg)
        memory.check_engine(
            t_cfg, d_cfg, dev, context, t_isz, d_isz, tree, target_weights=t_weights, draft_weights=d_weights
        )
    # the draft first: it stays resident, and the target's memory plan accounted for it (a partial self draft
    # whose layers are chosen by their influence needs the target first)
    t_model = None
    keep = list(layers.indices) if layers.indices is not None else None
    if layers.count is not None:
        t_model = _load_target(t_path, dev, dtype, t_cfg, plan, offload)
        keep = layer_select.choose(t_model, layers.count, t_tok.tokenizer.encode)
        log.info("partial self draft: %d of %d layers, %s", len(keep), t_cfg.num_layers, keep)
    d_model = None
    if d_path is not None and d_cfg is not None and d_dt is not None:
        vocab = draft_vocab
        if vocab is None and dev.type == "cpu" and d_fmt != "nf4" and d_cfg.vocab_size > 2 * DEFAULT_DRAFT_VOCAB:
            vocab = DEFAULT_DRAFT_VOCAB
        head = draft_vocab_ids(d_tok, d_cfg.vocab_size, vocab) if vocab else None
        what = "self-derived draft (the target's weights)" if self_draft else f"draft {d_path.name}"
        log.info("loading the %s: %s weights, %.2f GB, computing in %s", what, d_fmt, (d_weights or 0) / 1e9, d_dt)
        d_model = _load(d_path, dev, d_dt, fmt=d_fmt, head_ids=head, keep_layers=keep)
        if self_draft:  # its layer i is the target's layer keep[i]: it can read the target's prefix
            d_model.source_layers = tuple(keep) if keep is not None else tuple(range(t_cfg.num_layers))
    if t_model is None:
        t_model = _load_target(t_path, dev, dtype, t_cfg, plan, offload)
    engine = Engine(
        t_model,
        t_tok,
        d_model,
        context=context,
        tree=tree,
        calibration_dir=hub.cache_home(cache_dir) / "calibration",
        share_prefix=share_prefix,
        max_tree=tree_cap,
    )
    if d_model is not None and d_dt is not None:  # what the chat banner names (--draft-dtype auto may choose)
        engine.draft_weights = d_fmt if d_fmt != "dense" else str(d_dt).removeprefix("torch.")
    return engine


def _load_target(path: Path, dev: torch.device, dtype: str, cfg: Any, plan: Any, offload: Any):
    """The target: through the offload manager when it has a plan, else resident."""
    if plan is not None:
        from specexec.loading.offloaded import load_offloaded

        return load_offloaded(path, dev, dtype, offload, plan=plan)
    return _load(path, dev, resolve_dtype(dtype, dev, cfg))


def _offloaded(offload: Any, dev: torch.device) -> bool:
    """Whether the target goes through the offload manager (streamed or NF4) rather than a plain resident load."""
    if offload is None or offload.mode == "none" and offload.target_dtype != "nf4":
        return False
    if dev.type == "cpu" and offload.mode == "auto" and offload.target_dtype != "nf4":
        return False  # nothing to stream to on a CPU: the target is simply resident in RAM
    return True


def _load(path: Any, dev: torch.device, dt: torch.dtype, **kw: Any):
    try:
        return load_model(path, dev, dt, **kw)
    except torch.cuda.OutOfMemoryError:
        raise OutOfMemory(
            f"not enough GPU memory to load {path} resident; use {setting('OffloadConfig.mode', 'auto')} or a "
            f"smaller {setting('dtype')}",
            "GPU memory",
        ) from None
