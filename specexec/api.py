"""The small public API: ``engine = specexec.load(target, draft)``, then ``engine.generate(...)`` / ``stream(...)``.

Example::

    import specexec
    engine = specexec.load("qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b")
    result = engine.generate("def quicksort(arr):", max_new_tokens=64)
    print(result.text, result.stats.tokens_per_s)
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from specexec import hub
from specexec.config import TreeConfig
from specexec.engine import Engine
from specexec.errors import SpecexecError
from specexec.loading import (
    check_tokenizers_match,
    load_model,
    draft_vocab_ids,
    load_tokenizer,
    model_dir,
    parse_device,
    read_config,
    resolve_draft,
    resolve_dtype,
)

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
    draft_vocab: int | None = None,
) -> Engine:
    """Load a target (alias, HF id or path) and optional draft into an :class:`~specexec.engine.Engine`.

    ``offload`` is an :class:`offload.OffloadConfig` (None: the target is resident on ``device``; its
    ``target_dtype`` may be nf4). ``dtype`` is the compute dtype (auto: bf16 on CUDA; on a CPU fp32 or bf16 by a
    cached measurement of this machine, :mod:`specexec.cpu_probe`), ``draft_dtype`` the draft's (default: same as
    ``dtype``; also ``int8``: int8 weights on CPU). ``draft_vocab``: restrict the draft's lm_head to that many
    frequency-ranked token ids plus special ids and the tokens it is fed (CPU; FR-Spec). ``context`` is the
    longest prompt + answer the KV caches hold.
    """
    if context < 8:
        raise SpecexecError(f"context must be >= 8 tokens, got {context}")
    dev = parse_device(device)
    t_path = model_dir(hub.resolve(target, progress=progress))
    t_tok = load_tokenizer(t_path)
    d_path = None
    if draft is not None:
        d_path = model_dir(hub.resolve(draft, progress=progress))
        d_tok = load_tokenizer(d_path)
        check_tokenizers_match(t_tok.tokenizer, d_tok.tokenizer, target, draft)
    # the draft first: it stays resident, and the target's memory plan then sees what is left
    d_model = None
    if d_path is not None:
        d_cfg = read_config(d_path)
        d_dt, d_int8 = resolve_draft(draft_dtype or dtype, dev, d_cfg)
        head = draft_vocab_ids(d_tok, d_cfg.vocab_size, draft_vocab) if draft_vocab is not None else None
        d_model = _load(d_path, dev, d_dt, int8=d_int8, head_ids=head)
    t_cfg = read_config(t_path)
    context = min(context, t_cfg.max_position_embeddings)
    room = (tree or TreeConfig()).largest + 2
    kv = _kv_bytes(t_cfg, context + room, dev)
    if d_model is not None:
        kv += _kv_bytes(d_model.cfg, context + 2 * room + (tree or TreeConfig()).max_beams, dev)
    if _offloaded(offload, dev):
        from offload import load_offloaded

        t_model = load_offloaded(t_path, dev, dtype, offload, draft_bytes=0, kv_bytes=kv, max_tokens=room)
    else:
        check_host_memory(t_path, kv if dev.type == "cpu" else 0)
        t_model = _load(t_path, dev, resolve_dtype(dtype, dev, t_cfg))
    return Engine(t_model, t_tok, d_model, context=context, tree=tree)


def _offloaded(offload: Any, dev: torch.device) -> bool:
    """Whether the target goes through the offload manager (streamed or NF4) rather than a plain resident load."""
    if offload is None or offload.mode == "none" and offload.target_dtype != "nf4":
        return False
    if dev.type == "cpu" and offload.mode == "auto" and offload.target_dtype != "nf4":
        return False  # nothing to stream to on a CPU: the target is simply resident in RAM
    return True


def _kv_bytes(cfg: Any, slots: int, dev: torch.device) -> int:
    elem = 4 if dev.type == "cpu" else 2
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * slots * elem


def check_host_memory(path: Any, extra: int) -> None:
    """Refuse up front when the weights (fp32 on CPU: 2x the fp16 files) plus ``extra`` bytes exceed free RAM."""
    import psutil

    files = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    need = files * 2 + extra
    avail = psutil.virtual_memory().available
    if need > avail:
        raise SpecexecError(
            f"not enough RAM: loading {path.name} needs about {need / 1e9:.1f} GB, {avail / 1e9:.1f} GB available "
            "(lower --context, or use a GPU with --offload)"
        )


def _load(path: Any, dev: torch.device, dt: torch.dtype, **kw: Any):
    try:
        return load_model(path, dev, dt, **kw)
    except torch.cuda.OutOfMemoryError:
        raise SpecexecError(
            f"not enough GPU memory to load {path} resident; use --offload auto or a smaller --dtype"
        ) from None
