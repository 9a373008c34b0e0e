"""Convert a GGUF checkpoint into a Hugging Face model directory (config.json + safetensors + tokenizer).

transformers can read GGUF files (dequantizing every tensor to float), but it refuses to ``save_pretrained`` a
model loaded that way ("quantized with gguf and is not serializable"). So we load the GGUF once in fp32, copy its
state dict (cast to the storage dtype, fp16 by default), free the GGUF model, then build a fresh model from the
same config with ``quantization_config`` removed, fill it with ``load_state_dict(assign=True)`` and save it.
Reloading from the saved directory takes seconds instead of the ~1 minute GGUF dequantization.

Crash safety: everything is written into a hidden temporary sibling directory; the marker file
:data:`COMPLETE_MARKER` is written last and the directory is renamed into place atomically, so a directory at
``out_dir`` is always complete.

Memory: peak RSS is about what transformers needs to dequantize the GGUF in fp32 (~3.9 GB for a 0.5B model,
~9 GB for a 1.5B model); the fp16 copy is made while the fp32 model is alive, then the fp32 model is freed.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from specexec.errors import SpecexecError

logger = logging.getLogger(__name__)

COMPLETE_MARKER = ".specexec-complete"
"""Name of the file written last into a converted directory; its presence means the directory is complete."""

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def is_complete(model_dir: Path) -> bool:
    """True when ``model_dir`` is a finished conversion (the marker file exists)."""
    return (Path(model_dir) / COMPLETE_MARKER).is_file()


def gguf_to_hf_dir(
    gguf_path: Path,
    out_dir: Path,
    dtype: torch.dtype = torch.float16,
    progress: bool = True,
) -> Path:
    """Convert ``gguf_path`` into a Hugging Face directory at ``out_dir`` and return ``out_dir``.

    The weights are dequantized by transformers in fp32 and stored as ``dtype`` (config.json records it as
    ``dtype``/``torch_dtype``). The tokenizer (incl. chat template) and generation config come from the GGUF
    metadata. An existing ``out_dir`` is replaced only after the new directory is complete.
    """
    gguf_path = Path(gguf_path).resolve()
    out_dir = Path(out_dir).expanduser().resolve()
    if not gguf_path.is_file():
        raise SpecexecError(f"GGUF file not found: {gguf_path}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    if tmp_dir.exists():
        shutil.rmtree(tmp_dir)
    tmp_dir.mkdir()
    start = time.perf_counter()
    try:
        with _stage_display(progress) as stage:
            stage(f"reading the tokenizer from {gguf_path.name}")
            _save_tokenizer(gguf_path, tmp_dir)
            stage(f"dequantizing {gguf_path.name} to fp32 (about a minute per GB of GGUF)")
            config, generation_config, state = _load_gguf_state(gguf_path, dtype)
            stage(f"writing {_dtype_name(dtype)} safetensors to {out_dir}")
            _save_model(config, generation_config, state, dtype, tmp_dir)
            del state
            gc.collect()
        _check_layout(tmp_dir)
        _make_readable(tmp_dir)
        _write_marker(tmp_dir, gguf_path, dtype)
        _move_into_place(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    logger.info("converted %s -> %s in %.1f s", gguf_path.name, out_dir, time.perf_counter() - start)
    return out_dir


@contextlib.contextmanager
def _stage_display(progress: bool) -> Iterator[Callable[[str], None]]:
    """Yield ``stage(text)``, which logs a stage and, with ``progress``, shows it on stderr as a rich spinner with
    its elapsed time (the steps have no meaningful length, so no bar and no time estimate; a finished stage stays
    as a line with the time it took).

    transformers' own tqdm bars are always silenced for the duration and restored after (one progress library,
    and their per-tensor estimates were wildly off): the load/save bars through transformers' progress-bar
    switch; the GGUF reader's bar by swapping its module-level ``tqdm`` for a disabled one (that reader calls
    ``tqdm`` directly and ignores the switch).
    """
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    bars = Progress(
        SpinnerColumn(finished_text="[green]done[/]"),
        TextColumn("converting: {task.description}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=not progress,
        transient=False,
    )
    current: list[int] = []  # rich task ids, one per stage

    def stage(text: str) -> None:
        logger.info("convert: %s", text)
        if current:
            bars.update(current[-1], total=1, completed=1)  # type: ignore[arg-type]
        current.append(bars.add_task(text, total=None))

    bars_were_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    original = getattr(gguf_utils, "tqdm", None)
    if original is not None:
        gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        with bars:
            yield stage
            if current:
                bars.update(current[-1], total=1, completed=1)  # type: ignore[arg-type]
    finally:
        if original is not None:
            gguf_utils.tqdm = original
        if bars_were_enabled:
            hf_logging.enable_progress_bar()


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """Build the tokenizer from the GGUF metadata and save it (tokenizer.json, config, chat template)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer.save_pretrained(out_dir)


def _load_gguf_state(gguf_path: Path, dtype: torch.dtype) -> tuple:
    """Load the GGUF in fp32 and return (config without quantization_config, generation config, state dict).

    The state dict holds ``dtype`` copies; the fp32 model is freed before returning.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    config = model.config
    generation_config = model.generation_config
    fp32_state = model.state_dict()
    del model
    gc.collect()
    # Cast tensor by tensor, dropping each fp32 tensor as soon as its copy exists: the peak stays at the fp32 size.
    state = {}
    for name in list(fp32_state):
        tensor = fp32_state.pop(name)
        state[name] = tensor.detach().to(dtype=dtype, copy=True)
        del tensor
    _check_finite(state, dtype)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = dtype
    return config, generation_config, state


def _check_finite(state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Refuse weights that overflow ``dtype`` (e.g. fp16 max 65504): the saved model would produce NaNs."""
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise SpecexecError(
                f"weight {name} overflows {_dtype_name(dtype)}; convert with dtype=torch.bfloat16 or float32 instead"
            )


def _save_model(config, generation_config, state: dict[str, torch.Tensor], dtype: torch.dtype, out_dir: Path) -> None:
    """Build a plain (non-GGUF) model on the meta device, fill it with ``state`` and save it as safetensors."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(state, strict=True, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    model.generation_config = generation_config
    model.save_pretrained(out_dir)
    _record_dtype(out_dir / "config.json", dtype)


def _record_dtype(config_path: Path, dtype: torch.dtype) -> None:
    """Record the storage dtype in config.json under both keys (``dtype``: transformers 5, ``torch_dtype``: 4.x)."""
    data = json.loads(config_path.read_text())
    data["dtype"] = data["torch_dtype"] = _dtype_name(dtype)
    data.pop("quantization_config", None)
    data.pop("_model_name_or_path", None)  # the GGUF's general.name, e.g. "... AWQ": misleading here
    config_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _check_layout(model_dir: Path) -> None:
    """Fail loudly (a bug, not a user error) if the saved directory misses config, weights or tokenizer."""
    missing = []
    if not (model_dir / "config.json").is_file():
        missing.append("config.json")
    if not any(model_dir.glob("*.safetensors")):
        missing.append("*.safetensors")
    if not any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
        missing.append("tokenizer files")
    if missing:
        raise RuntimeError(f"conversion wrote an incomplete directory {model_dir}: missing {', '.join(missing)}")


def _make_readable(model_dir: Path) -> None:
    """Give every file the usual umask permissions (safetensors writes its files 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in model_dir.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)
    model_dir.chmod(0o777 & ~umask)


def _write_marker(model_dir: Path, gguf_path: Path, dtype: torch.dtype) -> None:
    """Write the completion marker (last file of the conversion) with a little provenance."""
    import transformers

    info = {"source_gguf": gguf_path.name, "dtype": _dtype_name(dtype), "transformers": transformers.__version__}
    (model_dir / COMPLETE_MARKER).write_text(json.dumps(info, indent=2) + "\n")


def _move_into_place(tmp_dir: Path, out_dir: Path) -> None:
    """Atomically rename ``tmp_dir`` to ``out_dir``, replacing (then deleting) any previous ``out_dir``."""
    old_dir = None
    if out_dir.exists() or out_dir.is_symlink():
        old_dir = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
        os.replace(out_dir, old_dir)
    os.replace(tmp_dir, out_dir)
    if old_dir is not None:
        if old_dir.is_dir() and not old_dir.is_symlink():
            shutil.rmtree(old_dir, ignore_errors=True)
        else:
            old_dir.unlink()


def _dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``."""
    return str(dtype).removeprefix("torch.")
