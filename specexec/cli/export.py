"""``specexec export vllm|sglang``: the serving engine's command for the same models and endpoint.

For users who outgrow one GPU. The printed command serves the same target and draft (aliases become their Hugging
Face ids, local paths stay paths), the same context, address, port, API key and served model name, so clients need
no change. What has no equivalent there is said on stderr, one ``note:`` line each; stdout holds only the command.

The option names are those of vLLM 0.33.0 (``vllm serve``, ``--speculative-config`` JSON keys) and SGLang 0.5.23
(``python -m sglang.launch_server``), read from their argument parsers; tests/cli/test_export.py holds that list.
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass
from pathlib import Path

import typer

from specexec.cli import options as o
from specexec.cli.common import guarded
from specexec.config import NEEDS_DRAFT
from specexec.errors import ConfigError, SpecexecError, setting

ENGINES = ("vllm", "sglang")
SPEC_TOKENS = (3, 8)  # the engines' usual speculative tokens per step (a chain verified on a resident target)
DEFAULT_PORT = 8000  # specexec serve's


@dataclass(frozen=True)
class Handoff:
    """What carries over from ``specexec serve`` to an engine (models resolved, method settled)."""

    target: str  # HF id or absolute local path
    draft: str | None  # same; None: no speculative config
    method: str  # specexec's method: ar, chain, specexec or ngram
    tokens: int  # speculative tokens per step (vLLM num_speculative_tokens, SGLang --speculative-num-steps)
    context: int  # tokens
    host: str
    port: int
    served_model_name: str
    api_key: str | None = None
    nf4: bool = False  # the target in 4-bit NF4 (bitsandbytes)
    gguf_target: bool = False  # the target is a local .gguf file


def speculative_tokens(budget: str) -> int:
    """A SpecExec tree budget (``--budget N|auto``) as the engines' speculative tokens per step.

    A best-first tree of N draft tokens accepts roughly log2(N) tokens a step; the engines verify one chain on a
    resident target, where each extra token costs compute rather than saving a weight stream, so they run 3-8.
    ``auto`` counts as its starting budget, 64.
    """
    n = 64 if budget.strip().lower() == "auto" else o.tree_config(budget, 2048, 128, 32, 32).budget
    return min(max(round(math.log2(max(n, 1))), SPEC_TOKENS[0]), SPEC_TOKENS[1])


def model_id(spec: str, what: str) -> str:
    """An alias -> its HF id; an existing path or a store name (``ollama:...``, ``lmstudio:...``) -> absolute local
    path; an HF id ``owner/name`` as given."""
    from specexec.loading import hub, stores

    if spec in hub.aliases():
        return hub.get_entry(spec).hf_id
    if spec.startswith(hub.STORE_PREFIXES):
        found = stores.find(spec)
        if found is None:
            raise SpecexecError(f"{setting(what)}: no model {spec!r} on this machine (see `specexec models list`)")
        return str(found.resolve())
    path = Path(spec).expanduser()
    if path.exists():
        return str(path.resolve())
    looks_like_path = spec.startswith((".", "~", "/")) or spec.count("/") > 1 or spec.endswith(".gguf")
    if spec.count("/") == 1 and not looks_like_path:
        return spec
    if looks_like_path:
        raise SpecexecError(f"{setting(what)}: model path not found: {spec}")
    raise SpecexecError(
        f"{setting(what)}: unknown model alias {spec!r} (pass an alias from `specexec models list`, a local path, "
        "a store name or an HF id owner/name)"
    )


def is_gguf(model: str) -> bool:
    """Whether ``model`` (an HF id or a local path) is a GGUF file: named .gguf, or a file that starts with the GGUF
    magic (an Ollama blob)."""
    path = Path(model)
    if model.endswith(".gguf"):
        return True
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def plan(
    target: str,
    draft: str | None,
    method: str | None,
    budget: str,
    gamma: int,
    context: int,
    host: str,
    port: int,
    api_key: str | None,
    served_model_name: str | None,
    target_dtype: str,
    offload: str,
) -> tuple[Handoff, list[str]]:
    """The hand-off for these ``specexec serve`` options, and a note for each thing that does not carry over."""
    from specexec.cli.serve import default_model_name
    from specexec.loading.checkpoint import SELF_DRAFT

    if context < 8:
        raise ConfigError("context", context, "must be >= 8 tokens")
    if not 0 <= port <= 65535:
        raise ConfigError("port", port, "must be in 0..65535", f"--port must be in 0..65535, got {port}")
    if gamma < 1:
        raise ConfigError("ChainConfig.gamma", gamma, "must be >= 1")
    notes: list[str] = []
    draft_spec = o.resolve_draft(target, draft, method)
    o.check_method(method, draft_spec)  # an unknown method, or one that needs a draft without one: ConfigError
    chosen = method or ("specexec" if draft_spec is not None else "ar")
    draft_id = None
    if draft_spec == SELF_DRAFT and chosen in NEEDS_DRAFT:
        notes.append(
            "--draft self (the target's own weights in low bit as its draft) has no equivalent: no speculative "
            "decoding; a small model of the target's family (or an EAGLE head) is the usual draft there"
        )
        chosen = "ar"
    elif draft_spec is not None and chosen in NEEDS_DRAFT:
        draft_id = model_id(draft_spec, "draft")
    elif draft_spec is None and chosen == "ar":
        notes.append("no draft model: plain decoding, no speculative config")
    tokens = gamma
    if chosen == "specexec":
        tokens = speculative_tokens(budget)
        notes.append(
            f"--budget {budget} becomes {tokens} speculative tokens a step (about log2 of the tree budget, within "
            f"{SPEC_TOKENS[0]}..{SPEC_TOKENS[1]}): a SpecExec tree of up to thousands of tokens pays off against one "
            "streamed target pass; the engine verifies a chain on a resident target, where each token costs compute"
        )
    target_id = model_id(target, "target")
    gguf = is_gguf(target_id)
    if offload != "none":
        notes.append(
            "specexec streams offloaded layers ahead of use; the engines' --cpu-offload-gb copies them synchronously "
            "in every forward: give the engine GPU memory for the whole model (tensor parallelism across GPUs)"
        )
    handoff = Handoff(
        target=target_id,
        draft=draft_id,
        method=chosen,
        tokens=tokens,
        context=context,
        host=host,
        port=port,
        served_model_name=served_model_name or default_model_name(target),
        api_key=api_key or None,
        nf4=target_dtype == "nf4",
        gguf_target=gguf,
    )
    return handoff, notes


def vllm_command(h: Handoff) -> tuple[list[str], list[str]]:
    """``vllm serve`` argv and its engine-specific notes."""
    argv = ["vllm", "serve", h.target, "--host", h.host, "--port", str(h.port)]
    argv += ["--max-model-len", str(h.context), "--served-model-name", h.served_model_name]
    if h.api_key:
        argv += ["--api-key", h.api_key]
    spec: dict[str, object] | None = None
    if h.method in NEEDS_DRAFT and h.draft is not None:
        spec = {"model": h.draft, "num_speculative_tokens": h.tokens, "method": "draft_model"}
    elif h.method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": h.tokens}
    if spec is not None:
        argv += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    notes = []
    if h.nf4:
        notes.append(
            "--target-dtype nf4: vLLM 0.33 has no bitsandbytes (NF4) quantization; serve a pre-quantized "
            "checkpoint (AWQ, GPTQ) or add --quantization fp8 (online, 8-bit)"
        )
    if h.gguf_target:
        notes.append("vLLM 0.33 does not load GGUF files: give it the model's safetensors repo instead")
    return argv, notes


def sglang_command(h: Handoff) -> tuple[list[str], list[str]]:
    """``python -m sglang.launch_server`` argv and its engine-specific notes."""
    argv = ["python", "-m", "sglang.launch_server", "--model-path", h.target, "--host", h.host, "--port", str(h.port)]
    argv += ["--context-length", str(h.context), "--served-model-name", h.served_model_name]
    if h.api_key:
        argv += ["--api-key", h.api_key]
    notes = []
    if h.nf4:
        argv += ["--quantization", "bitsandbytes", "--load-format", "bitsandbytes"]
        notes.append("--target-dtype nf4 becomes SGLang's bitsandbytes 4-bit loading (quantized at load, not cached)")
    elif h.gguf_target:
        argv += ["--load-format", "gguf"]
        notes.append("SGLang's GGUF loading covers fewer architectures and quantization types than its safetensors")
    if h.method in NEEDS_DRAFT and h.draft is not None:
        argv += ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", h.draft]
        argv += ["--speculative-num-steps", str(h.tokens), "--speculative-eagle-topk", "1"]
        argv += ["--speculative-num-draft-tokens", str(h.tokens + 1)]
    elif h.method == "ngram":
        argv += ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(h.tokens)]
    return argv, notes


def export(
    engine: str = typer.Argument(..., help="The serving engine: vllm or sglang."),
    target: str = o.option("target"),
    draft: str | None = o.option("draft"),
    method: str | None = o.option("method"),
    budget: str = o.option("budget"),
    gamma: int = o.option("gamma"),
    context: int = o.option("context"),
    target_dtype: str = o.option("target_dtype"),
    offload: str = o.option("offload"),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (as specexec serve's)."),
    port: int = typer.Option(DEFAULT_PORT, "--port", help="Port to listen on (as specexec serve's)."),
    api_key: str | None = typer.Option(
        None,
        "--api-key",
        help="Require 'Authorization: Bearer KEY' (as specexec serve's). Printed in the command, so never read from "
        "$SPECEXEC_API_KEY: pass it to carry it over.",
    ),
    served_model_name: str | None = typer.Option(
        None, "--served-model-name", help="The model id clients see (default, as specexec serve's: --target)."
    ),
) -> None:
    """Print the vLLM or SGLang serve command for the same models, context and endpoint as `specexec serve`.

    Notes on what does not carry over go to stderr; stdout is the command alone.
    """

    def run() -> None:
        name = engine.strip().lower()
        if name not in ENGINES:
            raise SpecexecError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
        handoff, notes = plan(
            target, draft, method, budget, gamma, context, host, port, api_key, served_model_name, target_dtype,
            offload,
        )  # fmt: skip
        argv, more = vllm_command(handoff) if name == "vllm" else sglang_command(handoff)
        for line in notes + more:
            o.notice(line)
        typer.echo(shlex.join(argv))

    guarded(run)
