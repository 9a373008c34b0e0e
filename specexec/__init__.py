"""specexec: exact speculative decoding (SpecExec draft trees) for offloaded 70B-class models.

``specexec.load(target, draft=None, ...)`` returns an :class:`~specexec.decoding.engine.Engine`; see the README.
Importing the package loads nothing and touches no network.
"""

from __future__ import annotations

from typing import Any

from specexec.errors import SpecexecError

__version__ = "0.1.0"

__all__ = ["SpecexecError", "__version__", "load"]


def load(*args: Any, **kwargs: Any) -> Any:
    """Load a target (+ draft) into an Engine; see :func:`specexec.api.load`."""
    from specexec.api import load as _load

    return _load(*args, **kwargs)
