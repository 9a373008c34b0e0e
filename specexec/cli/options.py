"""The options generate, chat, bench and serve share, defined once, and their conversion into the library's configs.

:class:`Shared` is the definition: each field is one option (flag, default, help text, help panel). The
:func:`shared_options` decorator adds those fields to a command's parameters, so Typer parses them like the
command's own, and hands the command one ``Shared`` value; a command declares only its own options::

    @shared_options(defaults={"max_new_tokens": 512})
    def chat(shared: Shared, system: str | None = typer.Option(None, "--system", "-s", help="System prompt.")):
        setup_logging(shared.verbose, shared.quiet)

        def run() -> None:
            model = shared.model_options()  # every check that needs no model comes before the load
            tree = shared.tree_config()
            engine = shared.load(model, tree, show=not shared.quiet)
            ...

        guarded(run, shared.verbose)

``--help`` shows the choices a user makes (models, method, budget, sampling, placement, the target's weights,
output) in the main panel, at most 20 options, and the tuning knobs and settings whose default rarely needs changing
(context, compute dtypes, cache root, tree shape) in the "Advanced" one.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Collection, Mapping
from contextlib import AbstractContextManager as ContextManager
from contextlib import nullcontext
from copy import copy
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_type_hints

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

if TYPE_CHECKING:
    from specexec.api import ModelOptions
    from specexec.decoding.engine import Engine
    from specexec.loading.pairing import DraftChoice

DEMO_TARGET = "qwen2.5-coder-1.5b"
DEMO_DRAFT = "qwen2.5-coder-0.5b"
MIN_DRAFT_VOCAB = 1024  # a smaller draft head proposes too little of the vocabulary to be worth it
ADVANCED = "Advanced"  # the help panel of the tuning knobs (the rest stay in Typer's main "Options" panel)

# library setting (see specexec.errors.setting) -> the flag that sets it; the CLI names flags in every message
FLAGS: dict[str, str] = {
    "target": "--target",
    "draft": "--draft",
    "device": "--device",
    "dtype": "--dtype",
    "draft_dtype": "--draft-dtype",
    "draft_vocab": "--draft-vocab",
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
    "quality": "--quality",
    "quality_chunk": "--quality-chunk",
    "quality_tokens": "--quality-tokens",
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
    "prefix_cache_gb": "--prefix-cache-gb",
    "parallel": "--parallel",
}


def _option(default: Any, *flags: str, help: str, advanced: bool = False) -> Any:
    """A :class:`Shared` field that is also a Typer option (kept in the field's metadata)."""
    info = typer.Option(default, *flags, help=help, rich_help_panel=ADVANCED if advanced else None)
    return field(default=default, metadata={"option": info})


@dataclass(frozen=True)
class Shared:
    """The options generate, chat, bench and serve share, as parsed; the builders turn them into configs."""

    # the main panel: the choices a user makes
    target: str = _option(DEMO_TARGET, "--target", "-t", help="Target model: alias, HF id or local path.")
    draft: str | None = _option(
        "auto",
        "--draft",
        "-d",
        help="Draft model (alias, HF id or path); 'auto': the draft of the target's known pair in configs/, else the "
        "largest model of its family already on this machine with its tokenizer and at most half its size, else "
        "none (one line says which); 'none' for no draft (plain decoding); 'self' for the target's own weights "
        "loaded a second time in low bit (--draft-dtype), reading the target's KV prefix: the draft for a target "
        "that has no compatible small model; 'heads' for Medusa-style heads on the target, no draft model "
        f"(`specexec heads train`; the demo target's ship with specexec). With the default target auto picks "
        f"{DEMO_DRAFT}.",
    )
    method: str | None = _option(
        None,
        "--method",
        "-m",
        help=f"One of {', '.join(METHODS)} (default: specexec with a draft, else ar).",
    )
    budget: str = _option(
        "auto", "--budget", help="SpecExec: draft tokens per tree, or 'auto' (best expected tokens/s, measured)."
    )
    max_new_tokens: int = _option(
        256,
        "--max-new-tokens",
        "-n",
        help="Longest answer in tokens (serve: for requests that give no max_tokens; bench: per prompt).",
    )
    temperature: float = _option(0.0, "--temperature", help="0 = greedy (exactly the target's greedy output).")
    top_p: float = _option(1.0, "--top-p", help="Nucleus sampling mass (1 = off).")
    top_k: int = _option(0, "--top-k", help="Keep the k most likely tokens (0 = off).")
    seed: int | None = _option(None, "--seed", help="Seed for sampling (same seed, same output).")
    device: str = _option("auto", "--device", help="auto, cpu or cuda.")
    offload: str = _option("auto", "--offload", help="Target placement: auto, none (all on GPU), ram, ssd.")
    gpu_memory: float | None = _option(None, "--gpu-memory", help="Cap on the GPU memory used, in GB (CUDA only).")
    target_dtype: str = _option(
        "auto",
        "--target-dtype",
        help="Target weights: auto, bf16, fp16, nf4 (GPU), int8 or q4 (CPU; q4 compiles a 4-bit kernel with the "
        "system C compiler on first use). auto on a CPU: the low-bit weights (q4 or int8) this machine runs "
        "clearly fastest (measured once), else dense.",
    )
    quiet: bool = _option(
        False, "--quiet", "-q", help="No spinner, progress bars, banner or stats line (serve: no access log)."
    )
    verbose: bool = _option(False, "--verbose", "-v", help="Debug logging; the full traceback of an internal error.")

    # the "Advanced" panel: tuning knobs and settings whose default rarely needs changing
    min_p: float = _option(
        0.0, "--min-p", help="Drop tokens below min-p x the top probability (0 = off).", advanced=True
    )
    context: int = _option(
        4096,
        "--context",
        help="Longest prompt + answer the KV caches hold (tokens; at most the model's maximum).",
        advanced=True,
    )
    dtype: str = _option(
        "auto",
        "--dtype",
        help="Compute dtype: auto (bf16 on GPU; on a CPU fp32 or bf16, whichever a cached probe of this machine "
        "finds faster), fp32, bf16, fp16.",
        advanced=True,
    )
    draft_dtype: str | None = _option(
        None,
        "--draft-dtype",
        help="Draft dtype: auto, fp32, bf16, fp16, or the low-bit weights int8 (CPU and GPU), q4 (CPU) and nf4 "
        "(GPU; bitsandbytes). Default: --dtype; with --draft self auto, and only auto, int8 or nf4. auto: q4 or "
        "int8 on a CPU where this machine runs it clearly faster (measured), else --dtype's choice; on a GPU "
        "beside a streamed target 16-bit, int8 or nf4, whichever is expected to decode fastest; for --draft self "
        "int8 on a CPU, nf4 on a GPU.",
        advanced=True,
    )
    cache_dir: Path | None = _option(
        None,
        "--cache-dir",
        help="specexec's cache root: downloaded/converted models (models/) and the packed-layer caches that "
        "--offload ssd and --target-dtype nf4 write (offload/). Default: $SPECEXEC_HOME, else ~/.cache/specexec.",
        advanced=True,
    )
    max_budget: int = _option(2048, "--max-budget", help="SpecExec: upper limit for --budget auto.", advanced=True)
    max_beams: int = _option(128, "--max-beams", help="SpecExec: nodes expanded per draft pass.", advanced=True)
    max_branch: int = _option(32, "--max-branch", help="SpecExec: children proposed per expanded node.", advanced=True)
    max_depth: int = _option(32, "--max-depth", help="SpecExec: most draft passes per tree.", advanced=True)
    early_stop: bool | None = _option(
        None,
        "--early-stop/--no-early-stop",
        help="SpecExec: stop growing a tree once one more draft pass is expected to cost more time than the tokens "
        "it adds are worth (measured costs); --no-early-stop always grows up to --max-depth levels. "
        "Default: on for a CPU draft and for fixed-width growth on a GPU (off for a GPU's dynamic growth).",
        advanced=True,
    )
    ngram_nodes: str = _option(
        "auto",
        "--ngram-nodes",
        help="SpecExec: merge the prompt-lookup (n-gram) continuations of the text so far into each draft tree, at "
        "most N nodes (they cost no draft pass; where the text repeats, the target accepts them); 0: none. auto "
        f"(default): {NGRAM_NODES_GPU} on a GPU, {NGRAM_NODES_CPU} in a CPU's --budget auto trees, none in a CPU's "
        "fixed-budget ones. Never changes the output.",
        advanced=True,
    )
    gamma: int = _option(4, "--gamma", help="Chain: draft tokens per step.", advanced=True)
    draft_vocab: str | None = _option(
        None,
        "--draft-vocab",
        help=f"Restrict the draft's lm_head to the N most frequent token ids (FR-Spec; N >= {MIN_DRAFT_VOCAB}), "
        "plus the special ids and every token the draft is fed: a faster draft pass on a CPU; the output is "
        "unchanged (the target decides). 0 or 'full': the whole vocabulary. Default: on a CPU 32768 for a draft "
        "whose vocabulary is over twice that (e.g. Qwen2.5's), else the whole vocabulary.",
        advanced=True,
    )
    invariant: bool = _option(
        True,
        "--invariant/--no-invariant",
        help="Shape-invariant target passes (default): every position's logits are bit-identical whatever pass "
        "computes them, so greedy output equals plain decoding (method ar) token for token and a request gives the "
        "same text every time. --no-invariant (for benchmarks): each pass takes the fastest kernels for its "
        "shape; plain decoding is then faster on some CPUs, and output may differ where two tokens are within "
        "rounding.",
        advanced=True,
    )

    # -- options -> configs (each raises ConfigError, shown with the flag's name) ---------------------------------

    def tree_config(self) -> TreeConfig:
        return tree_config(
            self.budget,
            self.max_budget,
            self.max_beams,
            self.max_branch,
            self.max_depth,
            self.early_stop,
            self.ngram_nodes,
        )

    def sampling_config(self) -> SamplingConfig:
        """Rejects nan/inf and out-of-range values."""
        return SamplingConfig(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p, seed=self.seed
        )

    def chain_config(self) -> ChainConfig:
        return ChainConfig(gamma=self.gamma)

    def offload_config(self) -> Any:
        """An offload.OffloadConfig (validated there)."""
        from offload import OffloadConfig
        from specexec.errors import check_finite

        check_finite("OffloadConfig.gpu_memory_gb", self.gpu_memory)
        return OffloadConfig(
            mode=self.offload, gpu_memory_gb=self.gpu_memory, target_dtype=self.target_dtype, cache_dir=self.cache_dir
        )

    def model_options(self) -> ModelOptions:
        """The models to load, after every check that needs no model: context, dtype names, ``--draft-vocab``,
        ``--draft self`` with its dtype, the offload options, ``--method`` against the draft and ``--max-new-tokens``
        against the context."""
        from specexec.api import ModelOptions

        if self.context < 8:
            raise ConfigError("context", self.context, "must be >= 8 tokens")
        _check_dtype_names(self.dtype, self.draft_dtype)
        vocab = draft_vocab_size(self.draft_vocab)
        draft, choice = draft_and_choice(self.target, self.draft, self.method, self.cache_dir)
        _check_self_draft(draft, self.draft_dtype)
        model = ModelOptions(
            target=self.target,
            draft=draft,
            device=self.device,
            dtype=self.dtype,
            draft_dtype=self.draft_dtype,
            context=self.context,
            offload=self.offload_config(),
            cache_dir=self.cache_dir,
            draft_vocab=vocab,
            invariant=self.invariant,
            draft_choice=choice.line if choice is not None and not self.quiet else None,
        )
        check_method(self.method, model.draft, choice.reason if choice is not None else None)
        check_max_new_tokens(self.max_new_tokens, self.context)
        return model

    def load(self, model: ModelOptions, tree: TreeConfig, show: bool) -> Engine:
        """Load the engine; a note before for each option without effect, and after for what the load adjusted.
        ``show``: download progress and a spinner while loading."""
        from specexec import api

        notices_before_load(model)
        engine = api.load_engine(model, tree, progress=show, status=spinner(not show))
        notices_after_load(model, engine)
        return engine


_SHARED_TYPES = get_type_hints(Shared)


def option(name: str) -> Any:
    """The Typer option of :class:`Shared` field ``name``, for a command outside the shared set (e.g. --cache-dir)."""
    return copy(next(f for f in fields(Shared) if f.name == name).metadata["option"])


def as_json() -> Any:
    """``--json`` (generate, doctor, bench)."""
    return typer.Option(False, "--json", help="Print exactly one JSON object on stdout.")


def shared_options(
    omit: Collection[str] = (), defaults: Mapping[str, Any] | None = None
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command the :class:`Shared` options.

    The command's first parameter is ``shared: Shared``; its other parameters are its own options (listed first in
    ``--help``). ``omit``: shared options this command does not take (their fields keep the defaults above);
    ``defaults``: this command's own defaults for some of them (e.g. a shorter ``max_new_tokens``). Typer reads the
    returned function's signature: the command's own parameters, then one per shared field.
    """
    defaults = dict(defaults or {})

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        own = inspect.signature(command, eval_str=True)
        params = list(own.parameters.values())
        if not params or params[0].name != "shared":
            raise TypeError(f"{command.__name__}: the first parameter must be `shared: Shared`")
        names = [f.name for f in fields(Shared) if f.name not in omit]
        shared_params = []
        for f in fields(Shared):
            if f.name in omit:
                continue
            info = copy(f.metadata["option"])
            if f.name in defaults:
                info.default = defaults[f.name]
            shared_params.append(
                inspect.Parameter(
                    f.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=_SHARED_TYPES[f.name]
                )
            )

        @functools.wraps(command)
        def run(**kwargs: Any) -> None:
            values = {name: kwargs.pop(name) for name in names}
            command(Shared(**values), **kwargs)

        mine = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params[1:]]
        run.__signature__ = own.replace(parameters=[*mine, *shared_params])  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in [*mine, *shared_params]}
        return run

    return decorate


# ------------------------------------------------------------------------------------------------ builders


def resolve_draft(target_: str, draft_: str | None, method_: str | None = None, home: Path | None = None) -> str | None:
    """The draft to load (None: none); see :func:`draft_and_choice`."""
    return draft_and_choice(target_, draft_, method_, home)[0]


def draft_and_choice(
    target_: str, draft_: str | None, method_: str | None = None, home: Path | None = None
) -> tuple[str | None, DraftChoice | None]:
    """The draft to load, and how ``auto`` chose it (None when not chosen): ``none`` means no draft; ``auto`` (or
    no value) asks :func:`specexec.loading.pairing.choose_draft`, unless ``--method ar`` or ``ngram``, which need
    none."""
    from specexec.loading import pairing

    text = (draft_ or pairing.AUTO).strip()
    if text.lower() == "none":
        return None, None
    if text.lower() != pairing.AUTO:
        return draft_, None
    if method_ in ("ar", "ngram"):
        return None, None
    choice = pairing.choose_draft(target_, home)
    return choice.draft, choice


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
    auto = budget_.strip().lower() == "auto"
    if auto:
        b = max(1, min(64, max_budget_))
    else:
        try:
            b = int(budget_)
        except ValueError:
            raise ConfigError("TreeConfig.budget", budget_, "must be a positive integer or 'auto'") from None
    return TreeConfig(
        budget=b,
        auto=auto,
        max_budget=max_budget_,
        max_beams=max_beams_,
        max_branch=max_branch_,
        max_depth=max_depth_,
        early_stop=early_stop_,
        ngram=ngram,
    )


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
DRAFT_DTYPES = (*TARGET_DTYPES, "int8", "nf4", "q4")


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


def check_method(method_: str | None, draft_: str | None, auto_none: str | None = None) -> None:
    """An unknown method, or one that needs a draft when there is none, is refused before anything loads.
    ``auto_none``: why ``--draft auto`` found none, when it did not."""
    if method_ is None:
        return
    check_method_name(method_)
    if method_ in NEEDS_DRAFT and draft_ is None:
        why = f" and {setting('draft', 'auto')} found none ({auto_none})" if auto_none else ""
        raise ConfigError(
            "method",
            method_,
            "needs a draft model",
            f"{setting('method', method_)} needs a draft model{why}: pass {setting('draft')}",
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


def notices_before_load(model: ModelOptions) -> None:
    """Say (one line each) which draft ``--draft auto`` chose and which given options will have no effect, before
    the slow load."""
    if model.draft_choice:
        typer.echo(model.draft_choice, err=True)
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
