"""The checks that refuse, before anything is allocated, a load that would not fit in memory.

Why: a huge ``--context`` or tree ``--budget`` makes the static KV caches, the ancestry mask and the logits
bigger than the RAM, and ``torch.zeros`` of that size either fails with an allocator traceback or, worse, gets the
process OOM-killed (or swapping) halfway through. :func:`check_engine` adds up what a load will allocate (weights
at their loaded dtype, both KV caches, every tree-sized buffer: :mod:`specexec.model.sizes`) and raises
:class:`NotEnoughMemory` with the numbers and the fix -- for an oversized tree, the largest budget that fits.
"""

from __future__ import annotations

import logging
from pathlib import Path

import psutil
import torch

from specexec.config import ChainConfig, TreeConfig
from specexec.errors import OutOfMemory, setting
from specexec.loading.checkpoint import model_dir, parse_dtype, read_config
from specexec.model import sizes
from specexec.model.transformer import ModelConfig

log = logging.getLogger(__name__)

GB = 1e9
MARGIN_BYTES = 512 << 20  # kept free on the device for the allocator, small activations, the OS
MAX_BUDGET = 65536  # TreeConfig's own upper limit


class NotEnoughMemory(OutOfMemory):
    """An engine would not fit in RAM/VRAM (an :class:`~specexec.errors.OutOfMemory` with ``resource`` "RAM" or
    "GPU memory"). ``largest_budget``: the largest tree budget that fits (None when the tree is not what is too
    big); ``need``/``have`` in bytes."""

    def __init__(self, message: str, resource: str, need: int, have: int, largest_budget: int | None = None) -> None:
        super().__init__(message, resource, need, have)
        self.largest_budget = largest_budget


def available_bytes(device: torch.device) -> int:
    """Free bytes where tensors on ``device`` live: free VRAM for CUDA, available RAM otherwise."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


def _with_budget(tree: TreeConfig, budget: int) -> TreeConfig:
    from dataclasses import replace

    return replace(tree, max_budget=budget) if tree.auto else replace(tree, budget=budget)


def largest_budget(
    target: ModelConfig,
    draft: ModelConfig | None,
    context: int,
    t_isz: int,
    d_isz: int,
    tree: TreeConfig,
    chain: ChainConfig | None,
    fixed: int,
    have: int,
) -> int:
    """The largest tree budget (<= ``tree.largest``) whose buffers fit in ``have - fixed`` bytes; 0 if none."""

    def fits(b: int) -> bool:
        return (
            fixed + sizes.step_buffers(target, draft, context, _with_budget(tree, b), chain, t_isz, d_isz).total <= have
        )

    lo, hi = 0, tree.largest
    if not fits(1):
        return 0
    lo = 1
    while lo < hi:  # fits(lo) holds; find the largest b in [lo, hi] with fits(b)
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def check_engine(
    target: ModelConfig,
    draft: ModelConfig | None,
    device: torch.device,
    context: int,
    target_itemsize: int,
    draft_itemsize: int,
    tree: TreeConfig,
    chain: ChainConfig | None = None,
    target_weights: int | None = None,
    draft_weights: int | None = None,
    have: int | None = None,
    lanes: int = 1,
) -> sizes.EngineMemory:
    """Raise :class:`NotEnoughMemory` unless everything an engine with these settings allocates on ``device``
    fits in ``have`` bytes (default: what the device has free, less a margin); ``lanes``: requests generating
    together, each with its own KV caches. Returns the estimate."""
    context = min(context, target.max_position_embeddings)
    need = sizes.engine_memory(
        target,
        draft,
        context,
        target_itemsize,
        draft_itemsize,
        tree,
        chain,
        target_weights=target_weights,
        draft_weights=draft_weights,
        ngram_nodes=tree.ngram_nodes(device) if draft is not None else 0,
        lanes=lanes,
    )
    if have is None:
        have = available_bytes(device) - MARGIN_BYTES
    log.debug(
        "memory check on %s: need %.2f GB (weights %.2f, kv %.2f, other tree buffers %.2f), have %.2f GB",
        device,
        need.total / GB,
        need.weights / GB,
        need.kv / GB,
        need.workspace / GB,
        have / GB,
    )
    if need.total <= have:
        return need
    where = "GPU memory (VRAM)" if device.type == "cuda" else "RAM"
    resource = "GPU memory" if device.type == "cuda" else "RAM"
    fixed = need.fixed
    best = largest_budget(target, draft, context, target_itemsize, draft_itemsize, tree, chain, fixed, have)
    free = f"only {max(have, 0) / GB:.1f} GB of {where} is free"
    if best >= 1:
        what, big = need.step.largest()
        key = "TreeConfig.max_budget" if tree.auto else "TreeConfig.budget"
        raise NotEnoughMemory(
            f"the tree's buffers for {setting(key, tree.largest)} need {need.step.total / GB:.1f} GB of {where} "
            f"(largest: {what} {big / GB:.1f} GB) on top of {fixed / GB:.1f} GB for the weights and KV caches, but "
            f"{free}; the largest that fits is {setting(key, best)}",
            resource,
            need.total,
            max(have, 0),
            largest_budget=best,
        )
    each = f" for each of {setting('parallel', lanes)} requests" if lanes > 1 else ""
    if need.kv >= need.weights:
        fix = f"lower {setting('context')}" + (f" or {setting('parallel')}" if lanes > 1 else "")
    else:
        fix = f"use a smaller model or a 16-bit {setting('dtype')}" + (
            f", or {setting('OffloadConfig.mode')}" if device.type == "cuda" else ""
        )
    raise NotEnoughMemory(
        f"not enough {where}: the weights need {need.weights / GB:.2f} GB, the KV caches for "
        f"{setting('context', context)}{each} {need.kv / GB:.2f} GB and the other tree buffers "
        f"{need.workspace / GB:.2f} GB "
        f"({need.total / GB:.2f} GB in all), but {free}: {fix}",
        resource,
        need.total,
        max(have, 0),
    )


def check_load(
    target: Path,
    draft: Path | None,
    device: torch.device,
    dtype: str,
    draft_dtype: str | None,
    context: int,
    tree: TreeConfig | None = None,
    chain: ChainConfig | None = None,
    target_weights: bool = True,
) -> sizes.EngineMemory:
    """Check, from config.json and the safetensors headers only, that loading these models with these settings
    fits (see :func:`check_engine`).

    ``target``/``draft`` are model locations (validated with :func:`specexec.loading.checkpoint.model_dir`);
    ``dtype`` and ``draft_dtype`` are the CLI names (``auto``, ``bf16``...; ``nf4`` counts as offloaded). Returns the
    estimate.
    """
    t_dir = model_dir(target)
    d_dir = model_dir(draft) if draft is not None else None
    t_cfg = read_config(t_dir)
    d_cfg = read_config(d_dir) if d_dir is not None else None
    offloaded = dtype == "nf4" or not target_weights
    t_isz = parse_dtype("auto" if dtype == "nf4" else dtype, device).itemsize
    d_name = draft_dtype or ("auto" if dtype == "nf4" else dtype)
    d_isz = parse_dtype(d_name, device).itemsize
    t_w = 0 if offloaded else sizes.stored_weights(t_dir).resident_bytes(t_isz, t_cfg)
    d_w = sizes.stored_weights(d_dir).resident_bytes(d_isz, d_cfg) if d_dir is not None else None
    return check_engine(
        t_cfg,
        d_cfg,
        device,
        context,
        t_isz,
        d_isz,
        tree or TreeConfig(),
        chain or ChainConfig(),
        target_weights=t_w,
        draft_weights=d_w,
    )
