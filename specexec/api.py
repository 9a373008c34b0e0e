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
    load_tokenizer,
    model_dir,
    parse_device,
    parse_dtype,
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
) -> Engine:
    """Load a target (alias, HF id or path) and optional draft into an :class:`~specexec.engine.Engine`.

    ``offload`` is an :class:`offload.OffloadConfig` (None: the target is resident on ``device``).
    ``dtype`` applies to the target (``nf4`` only through ``offload``), ``draft_dtype`` to the draft (default:
    same as ``dtype``). ``context`` is the longest prompt + answer the KV caches hold.
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
    if offload is not None and getattr(offload, "active", True):
        import offload as offload_pkg

        t_model = offload_pkg.load_offloaded(t_path, dev, dtype, offload, context=context, draft_path=d_path,
                                             progress=progress)
    else:
        if dtype == "nf4":
            raise SpecexecError("--target-dtype nf4 needs the offload manager (--offload auto|ram|ssd)")
        t_model = _load(t_path, dev, parse_dtype(dtype, dev))
    d_model = None
    if d_path is not None:
        d_model = _load(d_path, dev, parse_dtype(draft_dtype or (dtype if dtype != "nf4" else "auto"), dev))
        if d_model.cfg.vocab_size != t_model.cfg.vocab_size:
            log.info("draft vocab %d != target vocab %d (padding rows)", d_model.cfg.vocab_size,
                     t_model.cfg.vocab_size)
    return Engine(t_model, t_tok, d_model, context=min(context, t_model.cfg.max_position_embeddings), tree=tree)


def _load(path: Any, dev: torch.device, dt: torch.dtype):
    try:
        return load_model(path, dev, dt)
    except torch.cuda.OutOfMemoryError:
        raise SpecexecError(
            f"not enough GPU memory to load {path} resident; use --offload auto or a smaller --dtype"
        ) from None
