"""``specexec serve``: an OpenAI-compatible HTTP server and a web chat page (see :mod:`specexec.server`).

Parsing only: options become configs; :mod:`specexec.server` does the work. The port is bound first (a busy port
is a one-line error), then the server starts and answers ``/health`` with 503 while the models load in a thread.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import typer

from specexec.cli import options as o
from specexec.cli.common import guarded, setup_logging
from specexec.errors import ConfigError, SpecexecError, check_finite

log = logging.getLogger(__name__)


@o.shared_options(defaults={"max_new_tokens": 512})
def serve(
    shared: o.Shared,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, "--port", help="Port to listen on (0: any free port, printed at start)."),
    api_key: str | None = typer.Option(
        None,
        "--api-key",
        envvar="SPECEXEC_API_KEY",
        help="Require 'Authorization: Bearer KEY' on /v1/* (also from $SPECEXEC_API_KEY).",
    ),
    parallel: int | None = typer.Option(
        None,
        "--parallel",
        help="Requests generated together, their steps packed into one target pass (default: as many as fit in "
        "a quarter of the free memory, at most 4).",
    ),
    queue: int = typer.Option(
        8, "--queue", help="Requests that may wait while --parallel run; more get HTTP 429.", rich_help_panel=o.ADVANCED
    ),
    served_model_name: str | None = typer.Option(
        None,
        "--served-model-name",
        help="The model id in /v1/models and responses (default: --target).",
        rich_help_panel=o.ADVANCED,
    ),
    max_body_kb: int = typer.Option(
        4096, "--max-body-kb", help="Largest request body accepted (KiB); more: 413.", rich_help_panel=o.ADVANCED
    ),
    prefix_cache_gb: float | None = typer.Option(
        None,
        "--prefix-cache-gb",
        help="RAM for snapshots of other conversations' prompt keys/values, restored when a request resumes one "
        "(GB; default: min(1 GiB, 10% of the available RAM); 0: off).",
        rich_help_panel=o.ADVANCED,
    ),
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions) and a web chat
    page at /.

    The sampling options and --max-new-tokens are the defaults for requests that give none.
    """
    s = shared
    setup_logging(s.verbose, s.quiet)
    level = logging.DEBUG if s.verbose else (logging.WARNING if s.quiet else logging.INFO)
    for name in ("specexec.server", "specexec.cli.serve", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).setLevel(level)

    def run() -> None:
        import uvicorn

        from specexec import api
        from specexec.server import Defaults, ServerConfig, create_app

        prefix_bytes = prefix_cache_bytes(prefix_cache_gb)  # before model_options: no draft lookup for a bad value
        tree = s.tree_config()
        chain = s.chain_config()
        samp = s.sampling_config()
        model = s.model_options()
        if not 0 <= port <= 65535:
            raise ConfigError("port", port, "must be in 0..65535", f"--port must be in 0..65535, got {port}")
        if queue < 0:
            raise ConfigError("queue", queue, "must be >= 0", f"--queue must be >= 0, got {queue}")
        if parallel is not None and parallel < 1:
            raise ConfigError("parallel", parallel, "must be >= 1", f"--parallel must be >= 1, got {parallel}")
        if max_body_kb < 1:
            raise ConfigError(
                "max_body_kb", max_body_kb, "must be >= 1", f"--max-body-kb must be >= 1, got {max_body_kb}"
            )
        model = replace(model, prefix_cache_bytes=prefix_bytes, parallel=parallel or 1)
        name = served_model_name or default_model_name(s.target)
        config = ServerConfig(
            model_name=name,
            api_key=api_key or None,
            queue=queue,
            max_body_bytes=max(max_body_kb * 1024, 1024),
            defaults=Defaults(max_new_tokens=s.max_new_tokens, sampling=samp),
            method=s.method,
            tree=tree,
            chain=chain,
            parallel=parallel,
        )
        o.notices_before_load(model)
        sock = listen(host, port)
        failures: list[BaseException] = []

        def loader() -> Any:
            log.info("loading target %s%s", model.target, f", draft {model.draft}" if model.draft else " (no draft)")
            eng = api.load_engine(model, tree, progress=not s.quiet)
            o.notices_after_load(model, eng)
            return eng

        def load_failed(e: BaseException) -> None:
            failures.append(e)
            server.should_exit = True

        app = create_app(config, loader=loader, on_load_error=load_failed)
        server = uvicorn.Server(
            uvicorn.Config(app, log_config=None, access_log=not s.quiet, timeout_graceful_shutdown=3, log_level=None)
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

    guarded(run, s.verbose)


def prefix_cache_bytes(gb: float | None) -> int | None:
    """``--prefix-cache-gb`` -> the engine's ``prefix_cache_bytes`` (None: its default)."""
    if gb is None:
        return None
    check_finite("prefix_cache_gb", gb)
    if gb < 0:
        raise ConfigError("prefix_cache_gb", gb, "must be >= 0 (0: no prefix cache)")
    return int(gb * 1e9)


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
