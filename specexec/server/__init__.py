"""``specexec serve``: an OpenAI-compatible HTTP server (and a web chat page) over one :class:`Engine`.

- :mod:`specexec.server.protocol`: OpenAI request validation and response / chunk shapes (pure).
- :mod:`specexec.server.worker`: the single thread that runs the engine, the bounded queue, cancellation.
- :mod:`specexec.server.app`: the FastAPI app (routes, auth, body limit, server-sent events, the page).
- ``static/index.html``: the web chat page served at ``GET /`` (no build step, no external resources).

``create_app(ServerConfig(...), engine=engine)`` gives an ASGI app to run with uvicorn; ``specexec serve`` does that.
"""

from __future__ import annotations

from specexec.server.app import ServerConfig, create_app
from specexec.server.protocol import Defaults

__all__ = ["Defaults", "ServerConfig", "create_app"]
