"""``specexec serve``: an OpenAI-compatible HTTP server and a web chat page (see :mod:`specexec.server`).

Parsing only: options become configs; :mod:`specexec.server` does the work. The port is bound first (a busy port
is a one-line error), then the server starts and answers ``/health`` with 503 while the models load in a thread.
"""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path

import typer

from specexec.cli import options as o
from specexec.cli.common import guarded, setup_logging
from specexec.errors import ConfigError, SpecexecError

log = logging.getLogger(__name__)


def serve(
    target: str = o.target(),
    draft: str | None = o.draft(),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, "--port", help="Port to listen on (0: any free port, printed at start)."),
    api_key: str | None = typer.Option(
        None,
        "--api-key",
        envvar="SPECEXEC_API_KEY",
        help="Require 'Authorization: Bearer KEY' on /v1/* (also from $SPECEXEC_API_KEY).",
    ),
    queue: int = typer.Option(8, "--queue", help="Requests that may wait while one generates; more get HTTP 429."),
    served_model_name: str | None = typer.Option(
        None, "--served-model-name", help="The model id in /v1/models and responses (default: --target)."
    ),
    max_body_kb: int = typer.Option(4096, "--max-body-kb", help="Largest request body accepted (KiB); more: 413."),
    max_new_tokens: int = typer.Option(
        512,
        "--max-new-tokens",
        "-n",
        help="Answer length when a request gives no max_tokens (capped by the room left in the context).",
    ),
    method: str | None = o.method(),
    temperature: float = typer.Option(
        0.0, "--temperature", help="Default when a request gives none; 0 = greedy (exactly the target's output)."
    ),
    top_p: float = typer.Option(1.0, "--top-p", help="Default nucleus mass when a request gives none (1 = off)."),
    top_k: int = typer.Option(0, "--top-k", help="Default top-k when a request gives none (0 = off)."),
    min_p: float = typer.Option(0.0, "--min-p", help="Default min-p when a request gives none (0 = off)."),
    seed: int | None = typer.Option(None, "--seed", help="Default sampling seed when a request gives none."),
    budget: str = o.budget(),
    max_budget: int = o.max_budget(),
    max_beams: int = o.max_beams(),
    max_branch: int = o.max_branch(),
    max_depth: int = o.max_depth(),
    early_stop: bool | None = o.early_stop(),
    ngram_nodes: str = o.ngram_nodes(),
    gamma: int = o.gamma(),
    context: int = o.context(),
    device: str = o.device(),
    dtype: str = o.dtype(),
    draft_dtype: str | None = o.draft_dtype(),
    draft_vocab: str | None = o.draft_vocab(),
    draft_layers: str | None = o.draft_layers(),
    offload: str = o.offload(),
    gpu_memory: float | None = o.gpu_memory(),
    target_dtype: str = o.target_dtype(),
    cache_dir: Path | None = o.cache_dir(),
    quiet: bool = o.quiet("Only warnings and errors in the log (no loading progress, no access log)."),
    verbose: bool = o.verbose(),
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions) and a web chat
    page at /."""
    setup_logging(verbose, quiet)
    level = logging.DEBUG if verbose else (logging.WARNING if quiet else logging.INFO)
    for name in ("specexec.server", "specexec.cli.serve", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).setLevel(level)

    def run() -> None:
        import uvicorn

        from specexec.chat import load_engine
        from specexec.server import Defaults, ServerConfig, create_app

        tree = o.tree_config(
            budget, max_budget, max_beams, max_branch, max_depth, early_stop, ngram_nodes
        )
        chain = o.chain_config(gamma)
        samp = o.sampling_config(temperature, top_p, top_k, min_p, seed)
        model = o.model_options(
            target,
            draft,
            device,
            dtype,
            draft_dtype,
            context,
            o.offload_config(offload, gpu_memory, target_dtype, cache_dir),
            cache_dir_=cache_dir,
            draft_vocab_=draft_vocab,
            draft_layers_=draft_layers,
        )
        o.check_method(method, model.draft)
        o.check_max_new_tokens(max_new_tokens, context)
        if not 0 <= port <= 65535:
            raise ConfigError("port", port, "must be in 0..65535", f"--port must be in 0..65535, got {port}")
        if queue < 0:
            raise ConfigError("queue", queue, "must be >= 0", f"--queue must be >= 0, got {queue}")
        if max_body_kb < 1:
            raise ConfigError(
                "max_body_kb", max_body_kb, "must be >= 1", f"--max-body-kb must be >= 1, got {max_body_kb}"
            )
        name = served_model_name or default_model_name(target)
        config = ServerConfig(
            model_name=name,
            api_key=api_key or None,
            queue=queue,
            max_body_bytes=max(max_body_kb * 1024, 1024),
            defaults=Defaults(max_new_tokens=max_new_tokens, sampling=samp),
            method=method,
            tree=tree,
            chain=chain,
        )
        o.notices_before_load(model)
        sock = listen(host, port)
        failures: list[BaseException] = []

        def loader():
            log.info("loading target %s%s", model.target, f", draft {model.draft}" if model.draft else " (no draft)")
            eng = load_engine(model, tree, progress=not quiet)
            o.notices_after_load(model, eng)
            return eng

        def load_failed(e: BaseException) -> None:
            failures.append(e)
            server.should_exit = True

        app = create_app(config, loader=loader, on_load_error=load_failed)
        server = uvicorn.Server(
            uvicorn.Config(app, log_config=None, access_log=not quiet, timeout_graceful_shutdown=3, log_level=None)
        )
        bound_host, bound_port = sock.getsockname()[:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        typer.echo(
            f"specexec serve: listening on http://{shown}:{bound_port} (OpenAI API at /v1, web chat at /)"
            + (", API key required" if api_key else ""),
            err=True,
        )
        t0 = time.perf_counter()
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown: a normal way to stop
            pass
        if failures:
            e = failures[0]
            if isinstance(e, (SpecexecError, ValueError, MemoryError, KeyboardInterrupt)):
                raise e
            raise SpecexecError(f"loading the model failed: {type(e).__name__}: {e}") from e
        log.info("server stopped after %.0f s", time.perf_counter() - t0)

    guarded(run, verbose)


def default_model_name(target: str) -> str:
    """The id clients see: the alias or HF id as given; a local path's last component."""
    path = Path(target).expanduser()
    return path.name if path.exists() else target


def listen(host: str, port: int) -> socket.socket:
    """Bind the listening socket now, so a busy port or a bad address is one clear error before loading."""
    try:
        return socket.create_server((host, port), family=_family(host), backlog=128)
    except OSError as e:
        raise SpecexecError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _family(host: str) -> socket.AddressFamily:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise SpecexecError(f"cannot listen on {host}: unknown host ({e.strerror})") from None
    return infos[0][0]
