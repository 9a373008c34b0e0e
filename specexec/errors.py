"""The one exception type for errors a user can cause.

Anything a user can get wrong (a bad path, an unknown alias, a corrupt file, too little memory, a bad option
value) raises :class:`SpecexecError` with a message that says what is wrong and how to fix it. The CLI catches
it, prints the message on one line and exits non-zero. Programming errors raise ordinary exceptions.
"""

from __future__ import annotations


class SpecexecError(Exception):
    """A user-caused error. ``str(err)`` is a complete, one-line explanation."""

    exit_code: int = 2

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code
