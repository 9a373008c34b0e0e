"""specexec: exact speculative decoding (SpecExec draft trees) for offloaded 70B-class models."""

from specexec.errors import SpecexecError

__version__ = "0.1.0"

__all__ = ["SpecexecError", "__version__"]
