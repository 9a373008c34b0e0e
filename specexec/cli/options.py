"""The CLI options shared by generate, chat, bench and serve, defined once; and options → configs.

Each function returns a ``typer.Option`` to use as a parameter's default, so a command lists exactly the options
it takes and ``--help`` shows the same text everywhere. The ``*_config`` builders turn the parsed values into the
library's validated configs (no logic beyond that). A command looks like this::

    from typing import Optional
    import typer
    from specexec.cli import options as o
    from specexec.cli.common import guarded, setup_logging

    def serve(
        target: str = o.target(),
        draft: Optional[str] = o.draft(),
        device: str = o.device(),
        dtype: str = o.dtype(),
        draft_dtype: Optional[str] = o.draft_dtype(),
        draft_vocab: Optional[str] = o.draft_vocab(),
        context: int = o.context(),
        offload: str = o.offload(),
        gpu_memory: Optional[float] = o.gpu_memory(),
        target_dtype: str = o.target_dtype(),
        cache_dir: Optional[Path] = o.cache_dir(),
        method: Optional[str] = o.method(),
        budget: str = o.budget(),
        max_budget: int = o.max_budget(),
        max_beams: int = o.max_beams(),
        max_branch: int = o.max_branch(),
        max_depth: int = o.max_depth(),
        early_stop: Optional[bool] = o.early_stop(),
        ngram_nodes: str = o.ngram_nodes(),
        quiet: bool = o.quiet(),
        verbose: bool = o.verbose(),
    ) -> None:
        setup_logging(verbose, quiet)

        def run() -> None:
            # validate everything that needs no model first (configs raise ConfigError, shown with the flag's name)
            tree = o.tree_config(budget, max_budget, max_beams, max_branch, max_depth, early_stop, ngram_nodes)
            model = o.model_options(target, draft, device, dtype, draft_dtype, context,
                                    o.offload_config(offload, gpu_memory, target_dtype, cache_dir), method,
                                    cache_dir, draft_vocab)
            o.notices_before_load(model)
            engine = load_engine(model, tree, progress=not quiet, status=o.spinner(quiet))
            o.notices_after_load(model, engine)
            ...

        guarded(run, verbose)

Per-request sampling: ``o.sampling_config(temperature, top_p, top_k, min_p, seed)``; chain: ``o.chain_config(gamma)``;
a method name: ``o.check_method(method, model.draft)``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import typer

from specexec.config import (
    METHODS,
    NEEDS_DRAFT,
    NGRAM_NODES_CPU,
    NGRAM_NODES_GPU,
    ChainConfig,
    SamplingConfig,
    TreeConfig,
)
from specexec.config import check_method as check_method_name
from specexec.errors import ConfigError, InvalidPrompt, SpecexecError, setting

DEMO_TARGET = "qwen2.5-coder-1.5b"
DEMO_DRAFT = "qwen2.5-coder-0.5b"

# library setting (see specexec.errors.setting) -> the flag that sets it; the CLI names flags in every message
FLAGS: dict[str, str] = {
    "target": "--target",
    "draft": "--draft",
    "device": "--device",
    "dtype": "--dtype",
    "draft_dtype": "--draft-dtype",
    "draft_vocab": "--draft-vocab",
    "draft_layers": "--draft-layers",
    "context": "--context",
    "max_new_tokens": "--max-new-tokens",
    "method": "--method",
    "chat": "--chat",
    "prompt": "--prompt",
    "samples": "--samples",
    "num_prompts": "--num-prompts",
    "prompts": "--prompts",
    "methods": "--methods",
    "budgets": "--budgets",
    "gammas": "--gammas",
    "plot": "--plot",
    "TreeConfig.budget": "--budget",
    "TreeConfig.max_budget": "--max-budget",
    "TreeConfig.max_beams": "--max-beams",
    "TreeConfig.max_branch": "--max-branch",
    "TreeConfig.max_depth": "--max-depth",
    "TreeConfig.early_stop": "--early-stop",
    "TreeConfig.ngram": "--ngram-nodes",
    "ChainConfig.gamma": "--gamma",
    "SamplingConfig.temperature": "--temperature",
    "SamplingConfig.top_p": "--top-p",
    "SamplingConfig.top_k": "--top-k",
    "SamplingConfig.min_p": "--min-p",
    "SamplingConfig.seed": "--seed",
    "OffloadConfig.mode": "--offload",
    "OffloadConfig.gpu_memory_gb": "--gpu-memory",
    "OffloadConfig.target_dtype": "--target-dtype",
    "OffloadConfig.cache_dir": "--cache-dir",
    "cache_dir": "--cache-dir",
    "disk_mb": "--disk-mb",
}


# ------------------------------------------------------------------------------------------------ model


def target() -> Any:
    return typer.Option(DEMO_TARGET, "--target", "-t", help="Target model: alias, HF id or local path.")


def draft() -> Any:
    return typer.Option(
        None,
        "--draft",
        "-d",
        help=f"Draft model (alias, HF id or path); 'none' for no draft (plain decoding); 'self' for the target's "
        f"own weights in low bit (int8 on a CPU, nf4 on a GPU). Default: {DEMO_DRAFT} with the default target, "
        "else none.",
    )


def device() -> Any:
    return typer.Option("auto", "--device", help="auto, cpu or cuda.")


def dtype() -> Any:
    return typer.Option(
        "auto",
        "--dtype",
        help="Compute dtype: auto (bf16 on GPU; on a CPU fp32 or bf16, whichever a cached probe of this machine "
        "finds faster), fp32, bf16, fp16.",
    )


def draft_dtype() -> Any:
    return typer.Option(
        None,
        "--draft-dtype",
        help="Draft dtype (default: --dtype; with --draft self: int8 on a CPU, nf4 on a GPU; auto on a GPU beside a "
        "streamed target: 16-bit, int8 or nf4, whichever is expected to decode fastest): auto, fp32, bf16, "
        "fp16, or the low-bit weights int8 (CPU and GPU), nf4 (GPU; bitsandbytes) and the group-wise q4, q3, q2 "
        "(4/3/2-bit codes with an fp16 scale and offset per 64 columns; dequantized each pass, no fused kernel).",
    )


MIN_DRAFT_VOCAB = 1024  # a smaller draft head proposes too little of the vocabulary to be worth it


def draft_vocab() -> Any:
    """``--draft-vocab N|full`` (None: the library's default, see :func:`specexec.api.load`)."""
    return typer.Option(
        None,
        "--draft-vocab",
        help=f"Restrict the draft's lm_head to the N most frequent token ids (FR-Spec; N >= {MIN_DRAFT_VOCAB}), "
        "plus the special ids and every token the draft is fed: a faster draft pass on a CPU; the output is "
        "unchanged (the target decides). 0 or 'full': the whole vocabulary. Default: on a CPU 32768 for a draft "
        "whose vocabulary is over twice that (e.g. Qwen2.5's), else the whole vocabulary.",
    )


def draft_layers() -> Any:
    """``--draft-layers SPEC`` (None: all; see :mod:`specexec.loading.layer_select`)."""
    return typer.Option(
        None,
        "--draft-layers",
        help="With --draft self: a partial self-derived draft that keeps only some of the target's layers and skips "
        "the rest (less memory, a cheaper draft pass, lower acceptance): a number of layers (40), a fraction (0.5 or "
        "50%; both keep the layers with the most influence on a calibration text, measured on the target at load), "
        "or indices (0-11,20,24-27). Default: all.",
    )


def context(default: int = 4096) -> Any:
    return typer.Option(
        default, "--context", help="Longest prompt + answer the KV caches hold (tokens; at most the model's maximum)."
    )


# ------------------------------------------------------------------------------------------------ offload


def offload() -> Any:
    return typer.Option("auto", "--offload", help="Target placement: auto, none (all on GPU), ram, ssd.")


def gpu_memory() -> Any:
    return typer.Option(None, "--gpu-memory", help="Cap on the GPU memory used, in GB (CUDA only).")


def target_dtype() -> Any:
    return typer.Option("auto", "--target-dtype", help="Target weights: auto, bf16, fp16, nf4.")


def cache_dir() -> Any:
    return typer.Option(
        None,
        "--cache-dir",
        help="specexec's cache root: downloaded/converted models (models/) and the packed-layer caches that "
        "--offload ssd and --target-dtype nf4 write (offload/). Default: $SPECEXEC_HOME, else "
        "~/.cache/specexec.",
    )


# ------------------------------------------------------------------------------------------------ tree / chain


def method() -> Any:
    return typer.Option(
        None, "--method", "-m", help=f"One of {', '.join(METHODS)} (default: specexec with a draft, else ar)."
    )


def budget() -> Any:
    return typer.Option(
        "auto", "--budget", help="SpecExec: draft tokens per tree, or 'auto' (best expected tokens/s, measured)."
    )


def max_budget() -> Any:
    return typer.Option(2048, "--max-budget", help="SpecExec: upper limit for --budget auto.")


def max_beams() -> Any:
    return typer.Option(128, "--max-beams", help="SpecExec: nodes expanded per draft pass.")


def max_branch() -> Any:
    return typer.Option(32, "--max-branch", help="SpecExec: children proposed per expanded node.")


def max_depth() -> Any:
    return typer.Option(32, "--max-depth", help="SpecExec: most draft passes per tree.")


def early_stop() -> Any:
    """``--early-stop/--no-early-stop`` (None: the device's default)."""
    return typer.Option(
        None,
        "--early-stop/--no-early-stop",
        help="SpecExec: stop growing a tree once one more draft pass is expected to cost more time than the tokens "
        "it adds are worth (measured costs); --no-early-stop always grows up to --max-depth levels. "
        "Default: on for a CPU draft and for fixed-width growth on a GPU (off for a GPU's dynamic growth).",
    )






def ngram_nodes() -> Any:
    return typer.Option(
        "auto",
        "--ngram-nodes",
        help="SpecExec: merge the prompt-lookup (n-gram) continuations of the text so far into each draft tree, at "
        "most N nodes (they cost no draft pass; where the text repeats, the target accepts them); 0: none. auto "
        f"(default): {NGRAM_NODES_GPU} on a GPU, {NGRAM_NODES_CPU} in a CPU's --budget auto trees, none in a CPU's "
        "fixed-budget ones. Never changes the output.",
    )




def ngram_limit(value: str | int | None) -> int | None:
    """``--ngram-nodes N|auto`` -> TreeConfig.ngram (auto: None, the device's default)."""
    if value is None or isinstance(value, int):
        return value
    if value.strip().lower() == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError("TreeConfig.ngram", value, "must be in 0..1024 or auto") from None




def gamma() -> Any:
    return typer.Option(4, "--gamma", help="Chain: draft tokens per step.")


# ------------------------------------------------------------------------------------------------ sampling


def temperature() -> Any:
    return typer.Option(0.0, "--temperature", help="0 = greedy (exactly the target's greedy output).")


def top_p() -> Any:
    return typer.Option(1.0, "--top-p", help="Nucleus sampling mass (1 = off).")


def top_k() -> Any:
    return typer.Option(0, "--top-k", help="Keep the k most likely tokens (0 = off).")


def min_p() -> Any:
    return typer.Option(0.0, "--min-p", help="Drop tokens below min-p x the top probability (0 = off).")


def seed() -> Any:
    return typer.Option(None, "--seed", help="Seed for sampling (same seed, same output).")


# ------------------------------------------------------------------------------------------------ output


def quiet(help: str = "No spinner, progress bars or stats line.") -> Any:
    return typer.Option(False, "--quiet", "-q", help=help)


def verbose() -> Any:
    return typer.Option(False, "--verbose", "-v", help="Debug logging; the full traceback of an internal error.")


def as_json(help: str = "Print exactly one JSON object on stdout.") -> Any:
    return typer.Option(False, "--json", help=help)


# ------------------------------------------------------------------------------------------------ builders


def resolve_draft(target_: str, draft_: str | None, method_: str | None = None) -> str | None:
    """The draft to load: the demo draft for the demo target when none is given (unless ``--method ar``, which
    needs none); ``none`` means no draft."""
    if draft_ is None:
        return DEMO_DRAFT if target_ == DEMO_TARGET and method_ not in ("ar", "ngram") else None
    return None if draft_.strip().lower() == "none" else draft_


def tree_config(
    budget_: str,
    max_budget_: int,
    max_beams_: int,
    max_branch_: int,
    max_depth_: int,
    early_stop_: bool | None = None,
    ngram_: str | int | None = None,
) -> TreeConfig:
    """``--budget auto|N`` and friends → TreeConfig (auto starts at 64, capped by --max-budget)."""
    ngram = ngram_limit(ngram_)
    if budget_.strip().lower() == "auto":
        return TreeConfig(
            budget=max(1, min(64, max_budget_)),
            auto=True,
            max_budget=max_budget_,
            max_beams=max_beams_,
            max_branch=max_branch_,
            max_depth=max_depth_,
            early_stop=early_stop_,
            ngram=ngram,
        )
    try:
        b = int(budget_)
    except ValueError:
        raise ConfigError("TreeConfig.budget", budget_, "must be a positive integer or 'auto'") from None
    return TreeConfig(
        budget=b,
        max_budget=max_budget_,
        max_beams=max_beams_,
        max_branch=max_branch_,
        max_depth=max_depth_,
        early_stop=early_stop_,
        ngram=ngram,
    )


def sampling_config(
    temperature_: float, top_p_: float, top_k_: int, min_p_: float, seed_: int | None
) -> SamplingConfig:
    """Sampling options → SamplingConfig (rejects nan/inf and out-of-range values)."""
    return SamplingConfig(temperature=temperature_, top_k=top_k_, top_p=top_p_, min_p=min_p_, seed=seed_)


def chain_config(gamma_: int) -> ChainConfig:
    return ChainConfig(gamma=gamma_)


def offload_config(mode: str, gpu_memory_: float | None, target_dtype_: str, cache_dir_: Path | None = None) -> Any:
    """``--offload/--gpu-memory/--target-dtype/--cache-dir`` → offload.OffloadConfig (validated there)."""
    from offload import OffloadConfig
    from specexec.errors import check_finite

    check_finite("OffloadConfig.gpu_memory_gb", gpu_memory_)
    return OffloadConfig(mode=mode, gpu_memory_gb=gpu_memory_, target_dtype=target_dtype_, cache_dir=cache_dir_)


def model_options(
    target_: str,
    draft_: str | None,
    device_: str,
    dtype_: str,
    draft_dtype_: str | None,
    context_: int,
    offload_cfg: Any,
    method_: str | None = None,
    cache_dir_: Path | None = None,
    draft_vocab_: str | None = None,
    draft_layers_: str | None = None,
) -> Any:
    """Model options → :class:`specexec.chat.ModelOptions` (the draft resolved by :func:`resolve_draft`;
    ``cache_dir_``: ``--cache-dir``, where models are looked up and downloaded and layer caches written;
    ``draft_vocab_``: ``--draft-vocab``, see :func:`draft_vocab_size`; ``draft_layers_``: ``--draft-layers``, its
    syntax checked here, its range at load where the target's layer count is known)."""
    from specexec.chat import ModelOptions

    if context_ < 8:
        raise ConfigError("context", context_, "must be >= 8 tokens")
    _check_dtype_names(dtype_, draft_dtype_)
    vocab = draft_vocab_size(draft_vocab_)
    draft_name = resolve_draft(target_, draft_, method_)
    _check_self_draft(draft_name, draft_dtype_)
    _check_draft_layers(draft_name, draft_layers_)
    return ModelOptions(
        target=target_,
        draft=draft_name,
        device=device_,
        dtype=dtype_,
        draft_dtype=draft_dtype_,
        context=context_,
        offload=offload_cfg,
        cache_dir=cache_dir_,
        draft_vocab=vocab,
        draft_layers=draft_layers_,
    )


def _check_draft_layers(draft_: str | None, spec: str | None) -> None:
    """``--draft-layers`` needs ``--draft self`` and a well-formed spec (checked before anything loads; whether its
    indices exist is checked at load, against the target's layer count)."""
    from specexec.loading import layer_select
    from specexec.loading.checkpoint import SELF_DRAFT

    if spec is None:
        return
    if draft_ != SELF_DRAFT:
        raise layer_select.needs_self_draft(spec)
    layer_select.parse(spec, layer_select.MAX_LAYERS)


def draft_vocab_size(value: str | None) -> int | None:
    """``--draft-vocab`` → ``api.load(draft_vocab=...)``: None (not given: the library's default), 0 (``0`` or
    ``full``: the whole vocabulary) or an int >= :data:`MIN_DRAFT_VOCAB`."""
    if value is None:
        return None
    text = value.strip().lower()
    if text in ("full", "0"):
        return 0
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < MIN_DRAFT_VOCAB:
        raise ConfigError(
            "draft_vocab", value, f"must be an integer >= {MIN_DRAFT_VOCAB}, or 0 / 'full' for the whole vocabulary"
        )
    return n


TARGET_DTYPES = ("auto", "fp32", "bf16", "fp16")
DRAFT_DTYPES = (*TARGET_DTYPES, "int8", "nf4", "q4", "q3", "q2")


def _check_dtype_names(dtype_: str, draft_dtype_: str | None) -> None:
    """Unknown dtype names are refused before anything loads (int8 is a draft-only CPU format)."""
    if dtype_ not in TARGET_DTYPES:
        raise ConfigError("dtype", dtype_, f"must be one of {', '.join(TARGET_DTYPES)} (int8 is for --draft-dtype)")
    if draft_dtype_ is not None and draft_dtype_ not in DRAFT_DTYPES:
        raise ConfigError("draft_dtype", draft_dtype_, f"must be one of {', '.join(DRAFT_DTYPES)}")


def _check_self_draft(draft_: str | None, draft_dtype_: str | None) -> None:
    """``--draft self`` is the target in low bit: a dense ``--draft-dtype`` is refused before anything loads."""
    from specexec.loading.checkpoint import SELF_DRAFT, check_self_draft_dtype

    if draft_ == SELF_DRAFT:
        check_self_draft_dtype(draft_dtype_)


def check_method(method_: str | None, draft_: str | None) -> None:
    """An unknown method, or one that needs a draft when there is none, is refused before anything loads."""
    if method_ is None:
        return
    check_method_name(method_)
    if method_ in NEEDS_DRAFT and draft_ is None:
        raise ConfigError(
            "method",
            method_,
            "needs a draft model",
            f"{setting('method', method_)} needs a draft model: pass {setting('draft')}",
        )


def check_max_new_tokens(max_new_tokens_: int, context_: int) -> None:
    """``max_new_tokens`` must be >= 1 and leave room for a prompt in the context (checked again after loading,
    against the model's real context)."""
    if max_new_tokens_ < 1:
        raise ConfigError("max_new_tokens", max_new_tokens_, "must be >= 1")
    if max_new_tokens_ >= context_:
        raise ConfigError(
            "max_new_tokens",
            max_new_tokens_,
            "must be less than the context",
            f"{setting('max_new_tokens', max_new_tokens_)} exceeds the context ({context_} tokens): "
            f"lower it or raise {setting('context')}",
        )


def prompt_text(prompt_: str) -> str:
    """The ``--prompt`` value as text: ``-`` reads stdin; undecodable bytes or an empty prompt are refused."""
    if prompt_ == "-":
        data = sys.stdin.buffer.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidPrompt(f"the prompt on stdin is not valid UTF-8 (byte {e.start})") from None
    else:
        text = prompt_
        try:
            text.encode("utf-8")  # argv bytes that are not UTF-8 arrive as lone surrogates (surrogateescape)
        except UnicodeEncodeError as e:
            raise InvalidPrompt(f"the {setting('prompt')} argument is not valid UTF-8 (character {e.start})") from None
    if not text:
        raise InvalidPrompt("the prompt is empty")
    return text


# ------------------------------------------------------------------------------------------------ display


def spinner(quiet_: bool) -> Callable[[str], ContextManager[Any]]:
    """A rich spinner on stderr for slow steps (nothing when quiet)."""
    if quiet_:
        return lambda _msg: nullcontext()
    from rich.console import Console

    console = Console(stderr=True)
    return lambda msg: console.status(msg, spinner="dots")


def notice(message: str) -> None:
    """One line on stderr that is not an error (a setting was adjusted or has no effect)."""
    typer.secho(f"note: {message}", fg="yellow", err=True)


def notices_before_load(model: Any) -> None:
    """Say (one line each) which given options will have no effect, before the slow load."""
    if model.draft is None and model.draft_vocab:
        notice(f"--draft-vocab {model.draft_vocab} has no effect without a draft model")
    off = model.offload
    if off is None or off.gpu_memory_gb is None:
        return
    from specexec.loading.checkpoint import parse_device

    try:
        dev = parse_device(model.device)
    except SpecexecError:  # an unusable --device is reported by the load itself
        return
    streamed = off.mode in ("ram", "ssd") or off.target_dtype == "nf4"
    if dev.type == "cpu" and not streamed:
        notice(f"--gpu-memory {off.gpu_memory_gb:g} has no effect on the CPU (the model is held in RAM)")


def notices_after_load(model: Any, engine: Any) -> None:
    """Say when the loaded engine differs from what was asked (the context capped to the model's maximum, the auto
    budget's largest tree lowered to fit the GPU memory plan)."""
    if engine.context < model.context:
        notice(f"--context {model.context} is more than the model supports; using {engine.context} tokens")
    if getattr(engine, "max_tree", None) is not None:
        notice(
            f"--max-budget lowered to {engine.max_tree}: bigger trees' KV cache and workspace would leave no GPU "
            "memory for streaming the target"
        )
