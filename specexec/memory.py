"""Memory estimates from a model's ``config.json`` alone (no weight is read) and the check that refuses a plan
which cannot fit — before anything is allocated.

Why: a huge ``--context`` makes the static KV caches (``2 x layers x kv_heads x capacity x head_dim`` elements per
model) bigger than the RAM, and ``torch.zeros`` of that size either fails with an allocator traceback or, worse,
gets the process OOM-killed halfway through. :func:`check_load` computes what a resident load will allocate
(weights + both KV caches + the logits of one tree pass) and raises :class:`SpecexecError` with the numbers and
the fix when it exceeds what the device has free.

Sizes are exact element counts of the Llama-family layout used by :mod:`specexec.model` (GB = 1e9 bytes).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from specexec.config import ChainConfig, TreeConfig
from specexec.errors import OutOfMemory, setting
from specexec.loading import model_dir, parse_dtype, read_config
from specexec.model import ModelConfig

log = logging.getLogger(__name__)

GB = 1e9
MARGIN_BYTES = 512 << 20  # kept free on the device for the allocator, activations, the OS
NF4_BYTES_PER_PARAM = 0.5 + 4 / 64  # 4-bit codes + one fp32 absmax per 64-element block (bitsandbytes)


def layer_params(cfg: ModelConfig) -> int:
    """Parameters of one decoder layer: attention (q, k, v, o [+ qkv bias]), gated MLP, two norms."""
    d, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    attn = d * (q + 2 * kv) + q * d + ((q + 2 * kv) if cfg.qkv_bias else 0)
    mlp = 3 * d * cfg.intermediate_size
    return attn + mlp + 2 * d


def global_params(cfg: ModelConfig) -> int:
    """Embedding, final norm and lm_head (not counted twice when tied)."""
    mats = 1 if cfg.tie_word_embeddings else 2
    return mats * cfg.vocab_size * cfg.hidden_size + cfg.hidden_size


def param_count(cfg: ModelConfig) -> int:
    """All parameters of the model."""
    return cfg.num_layers * layer_params(cfg) + global_params(cfg)


def layer_bytes(cfg: ModelConfig, kind: str) -> int:
    """Bytes of one decoder layer stored as ``bf16``/``fp16`` (2 bytes a parameter), ``fp32`` or ``nf4`` (linear
    weights 4-bit with an fp32 absmax per 64 values; norms and biases stay 16-bit)."""
    n = layer_params(cfg)
    if kind in ("bf16", "fp16"):
        return 2 * n
    if kind == "fp32":
        return 4 * n
    if kind != "nf4":
        raise ValueError(f"unknown weight format {kind!r}")
    d, hd = cfg.hidden_size, cfg.head_dim
    small = 2 * d + (((cfg.num_heads + 2 * cfg.num_kv_heads) * hd) if cfg.qkv_bias else 0)
    return int((n - small) * NF4_BYTES_PER_PARAM) + 2 * small


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int) -> int:
    """KV-cache bytes one token costs across all layers (keys and values)."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


@dataclass(frozen=True)
class EngineMemory:
    """What a resident engine allocates, in bytes."""

    weights: int  # target + draft weights (0 when the target is offloaded and the draft absent)
    kv: int  # both static KV caches
    workspace: int  # fp32 logits (and their probabilities) of the largest target and draft passes

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.workspace


def engine_memory(target: ModelConfig, draft: ModelConfig | None, context: int, dtype_bytes: int,
                  draft_dtype_bytes: int, tree: TreeConfig, chain: ChainConfig,
                  target_weights: bool = True) -> EngineMemory:
    """Bytes an :class:`~specexec.engine.Engine` allocates with these configs (its cache sizing, replicated).

    ``context`` is clamped to the target's ``max_position_embeddings`` like :func:`specexec.api.load` does.
    ``target_weights=False``: the target's layers are offloaded (the offload plan accounts for them).
    """
    context = min(context, target.max_position_embeddings)
    room = max(tree.largest, chain.gamma) + 2
    weights = param_count(target) * dtype_bytes if target_weights else 0
    kv = kv_bytes_per_token(target, dtype_bytes) * (context + room)
    workspace = 2 * room * target.vocab_size * 4
    if draft is not None:
        weights += param_count(draft) * draft_dtype_bytes
        kv += kv_bytes_per_token(draft, draft_dtype_bytes) * (context + room + tree.largest + tree.max_beams)
        workspace += 2 * tree.max_beams * draft.vocab_size * 4
    return EngineMemory(weights=weights, kv=kv, workspace=workspace)


def available_bytes(device: torch.device) -> int:
    """Free bytes where tensors on ``device`` live: free VRAM for CUDA, available RAM otherwise."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


def check_memory(need: EngineMemory, device: torch.device, context: int) -> None:
    """Raise :class:`SpecexecError` (with the numbers and the fix) if ``need`` exceeds the device's free memory."""
    have = available_bytes(device) - MARGIN_BYTES
    log.debug("memory check on %s: need %.2f GB (weights %.2f, kv %.2f, workspace %.2f), have %.2f GB",
              device, need.total / GB, need.weights / GB, need.kv / GB, need.workspace / GB, have / GB)
    if need.total <= have:
        return
    where = "GPU memory (VRAM)" if device.type == "cuda" else "RAM"
    if need.kv >= need.weights:
        fix = f"lower {setting('context')}"
    else:
        fix = f"use a smaller model or a 16-bit {setting('dtype')}" + (
            f", or {setting('OffloadConfig.mode')}" if device.type == "cuda" else "")
    raise OutOfMemory(
        f"not enough {where}: the KV caches for {setting('context', context)} need {need.kv / GB:.2f} GB, the "
        f"weights {need.weights / GB:.2f} GB and the workspace {need.workspace / GB:.2f} GB "
        f"({need.total / GB:.2f} GB in all), but only {max(have, 0) / GB:.2f} GB is free: {fix}",
        where, need.total, max(have, 0))


def check_load(target: Path, draft: Path | None, device: torch.device, dtype: str, draft_dtype: str | None,
               context: int, tree: TreeConfig | None = None, chain: ChainConfig | None = None,
               target_weights: bool = True) -> EngineMemory:
    """Check, from the config.json files only, that loading these models with these settings fits.

    ``target``/``draft`` are model locations (validated with :func:`specexec.loading.model_dir`); ``dtype`` and
    ``draft_dtype`` are the CLI names (``auto``, ``bf16``...; ``nf4`` counts as offloaded). Returns the estimate.
    """
    t_cfg = read_config(model_dir(target))
    d_cfg = read_config(model_dir(draft)) if draft is not None else None
    offloaded = dtype == "nf4" or not target_weights
    t_bytes = parse_dtype("auto" if dtype == "nf4" else dtype, device).itemsize
    d_name = draft_dtype or ("auto" if dtype == "nf4" else dtype)
    d_bytes = parse_dtype(d_name, device).itemsize
    need = engine_memory(t_cfg, d_cfg, context, t_bytes, d_bytes, tree or TreeConfig(), chain or ChainConfig(),
                         target_weights=not offloaded)
    check_memory(need, device, min(context, t_cfg.max_position_embeddings))
    return need
