"""Errors a user can cause, in library terms, as a small hierarchy.

Anything a user can get wrong (a bad path, an unknown alias, a corrupt file, too little memory, a bad setting)
raises a :class:`SpecexecError` whose message says what is wrong and how to fix it. Programming errors raise
ordinary exceptions (and the CLI shows them as bugs, never as user errors).

Settings inside a message are named with :func:`setting` rather than spelled out, so that each front end names
them its own way: ``str(err)`` uses the library's names (``context``, ``OffloadConfig.gpu_memory_gb``), and the
CLI renders the same error with its flags (``--context``, ``--gpu-memory``) through :meth:`SpecexecError.render`::

    raise SpecexecError(f"the answer exceeds the context: raise {setting('context')}")
    str(err)                                   # 'the answer exceeds the context: raise context'
    err.render({"context": "--context"})       # 'the answer exceeds the context: raise --context'

Hierarchy::

    SpecexecError                 base (catch this one)
    ├── ConfigError(ValueError)   a setting has a bad value: ``key``, ``value``, ``requirement``
    ├── InvalidPrompt(ValueError) prompt or input text unusable (empty, not UTF-8, too long)
    ├── ModelNotFound             no such path, alias or cached download
    ├── ModelFormatError          a model directory or file that cannot be read (corrupt, pickle-only, ...)
    ├── TokenizerMismatch         target and draft tokenizers differ
    └── OutOfMemory               ``resource`` (RAM, GPU memory, disk) too small: ``need`` / ``have`` bytes
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

_MARK = "\x00"  # settings inside a message template: \x00key\x00 or \x00key\x01value\x00
_SEP = "\x01"
_SETTING = re.compile(f"{_MARK}([^{_MARK}{_SEP}]+)(?:{_SEP}([^{_MARK}]*))?{_MARK}")


def setting(key: str, value: Any = None) -> str:
    """Name a setting (optionally with the value given) inside an error message.

    ``key`` is the library's name: an argument of :func:`specexec.api.load` / ``Engine.stream`` (``context``,
    ``max_new_tokens``, ``method``, ``draft``, ``dtype``, ``device``) or ``Config.field`` of a config dataclass
    (``TreeConfig.budget``, ``OffloadConfig.mode``). Rendered as ``key`` / ``key=value`` by ``str(err)``, as a
    flag / ``flag value`` by the CLI.
    """
    return f"{_MARK}{key}{_MARK}" if value is None else f"{_MARK}{key}{_SEP}{value}{_MARK}"


def render(template: str, names: Mapping[str, str] | None = None) -> str:
    """Replace the :func:`setting` marks in ``template``: by ``names[key]`` (a flag) when given, else ``key``."""

    def one(m: re.Match[str]) -> str:
        key, value = m.group(1), m.group(2)
        if names is not None and key in names:
            return names[key] if value is None else f"{names[key]} {value}"
        return key if value is None else f"{key}={value}"

    return _SETTING.sub(one, template)


class SpecexecError(Exception):
    """A user-caused error. ``str(err)`` is a complete, one-line explanation in library terms."""

    exit_code: int = 2

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        self.template = message
        super().__init__(render(message))
        if exit_code is not None:
            self.exit_code = exit_code

    def render(self, names: Mapping[str, str]) -> str:
        """The message with each setting named by ``names`` (e.g. the CLI's flags); unknown keys stay as they are."""
        return render(self.template, names)


class ConfigError(SpecexecError, ValueError):
    """A setting has a value it cannot have. Also a ValueError, so ``except ValueError`` keeps working.

    ``key`` names the setting as :func:`setting` does (``TreeConfig.budget``, ``context``); ``requirement`` says
    what it must be (``"must be >= 1"``); the message is ``<setting> <requirement>, got <value>`` unless a whole
    ``message`` (a template that may use :func:`setting`) is given.
    """

    def __init__(self, key: str, value: Any, requirement: str, message: str | None = None) -> None:
        self.key, self.value, self.requirement = key, value, requirement
        super().__init__(message or f"{setting(key)} {requirement}, got {_show(value)}")


class InvalidPrompt(SpecexecError, ValueError):
    """The prompt (or a chat message) cannot be used: empty, not valid UTF-8, longer than the context."""


class ModelNotFound(SpecexecError):
    """No model at that path, no such alias, or a download that is not cached."""


class ModelFormatError(SpecexecError):
    """A model directory or file that cannot be read: corrupt, truncated, pickle-only, unsupported."""


class TokenizerMismatch(SpecexecError):
    """Target and draft tokenize differently, so the draft's tokens mean nothing to the target."""


class OutOfMemory(SpecexecError):
    """``resource`` (``"RAM"``, ``"GPU memory"``, ``"disk"``) is too small: ``need`` and ``have`` are bytes
    (None where unknown). The message says what to change."""

    def __init__(self, message: str, resource: str, need: int | None = None, have: int | None = None) -> None:
        self.resource, self.need, self.have = resource, need, have
        super().__init__(message)


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def check_finite(key: str, value: float | None) -> None:
    """Raise :class:`ConfigError` unless ``value`` is None or a finite number (not nan, not inf)."""
    if value is not None and not math.isfinite(value):
        raise ConfigError(key, value, "must be a finite number")
