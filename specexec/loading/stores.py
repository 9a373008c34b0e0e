"""Models already on this machine: Hugging Face cache snapshots and GGUF files in the usual local stores.

Where each store lives (read from the environment on every call, never at import):

- the Hugging Face hub cache: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``;
  ``models--<org>--<name>/snapshots/<revision>/`` with a config.json of a supported ``model_type`` and safetensors
  weights (named ``<org>/<name>``), or GGUF files (named by path);
- folders the user names: ``--dir PATH`` and ``$SPECEXEC_MODEL_DIRS`` (``os.pathsep``-separated); their GGUF files,
  up to :data:`DIR_DEPTH` folders deep (named by path);
- Ollama: ``$OLLAMA_MODELS``, else ``~/.ollama/models``; a manifest ``manifests/<host>/<namespace>/<model>/<tag>``
  (JSON) names in its ``application/vnd.ollama.image.model`` layer the blob ``blobs/sha256-<hex>``, a GGUF
  (named ``ollama:<model>:<tag>``, with ``<namespace>/`` for other namespaces than ``library``);
- LM Studio: ``~/.lmstudio/models`` and ``~/.cache/lm-studio/models``, ``<publisher>/<repo>/<file>.gguf``
  (named ``lmstudio:<publisher>/<repo>/<file>.gguf``, or ``lmstudio:<publisher>/<repo>`` where the repo holds one
  model file).

Of a split GGUF only the first part is listed; multimodal projector files (``mmproj*.gguf``) are not models and
are skipped. :func:`find` turns a store name back into a local path. Nothing here touches the network.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gemma3", "phi3")
"""config.json ``model_type`` values of the HF-cache checkpoints listed (the families the model code runs)."""

DIR_DEPTH = 3
"""How many folders deep GGUF files are looked for under a user-given folder."""

MODEL_DIRS_ENV = "SPECEXEC_MODEL_DIRS"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_HOST = "registry.ollama.ai"

_SPLIT_PART = re.compile(r".+-(\d{5})-of-\d{5}\.gguf")


@dataclass(frozen=True)
class Found:
    """One model on this machine: ``name`` is usable as ``--target`` (as is ``path``); ``store`` says where it was
    found ("HF cache", "Ollama", "LM Studio", "folder"); ``format`` is "safetensors" or "gguf"; ``size`` in bytes
    (the weights' files)."""

    name: str
    store: str
    format: str
    path: Path
    size: int


def discover(dirs: Sequence[Path] = ()) -> list[Found]:
    """Every model found in the stores, store by store, each sorted by name. ``dirs``: folders to search besides
    ``$SPECEXEC_MODEL_DIRS``. Unreadable files and folders are skipped."""
    found = [*_hf_cache(), *_ollama(), *_lmstudio()]
    for folder in model_dirs(dirs):
        found += [Found(str(p), "folder", "gguf", p, _gguf_size(p)) for p in _ggufs_under(folder, DIR_DEPTH)]
    seen: set[Path] = set()
    unique = []
    for item in found:  # a folder the user names may be a store as well
        if item.path not in seen:
            seen.add(item.path)
            unique.append(item)
    return unique


def find(name: str) -> Path | None:
    """The local path of a store name (``ollama:<model>[:<tag>]``, ``lmstudio:<publisher>/<repo>[/<file>]``, an HF
    repo id ``<org>/<name>`` in the HF cache), or None when it names nothing found here."""
    if name.startswith("ollama:"):
        return _ollama_blob(name.removeprefix("ollama:"))
    if name.startswith("lmstudio:"):
        matches = [f.path for f in _lmstudio() if f.name == name]
        return matches[0] if matches else None
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name):
        return hf_snapshot(name)
    return None


# ---------------------------------------------------------------------------------------------- roots


def hf_cache_root() -> Path:
    """The Hugging Face hub cache folder, as huggingface_hub finds it (from the environment at call time)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def ollama_root() -> Path:
    """Ollama's model store: ``$OLLAMA_MODELS``, else ``~/.ollama/models``."""
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


def lmstudio_roots() -> list[Path]:
    """LM Studio's model folders (the current one and the older location)."""
    return [Path.home() / ".lmstudio" / "models", Path.home() / ".cache" / "lm-studio" / "models"]


def model_dirs(extra: Sequence[Path] = ()) -> list[Path]:
    """The user's model folders: ``extra`` then ``$SPECEXEC_MODEL_DIRS``, each once."""
    env = [Path(p).expanduser() for p in os.environ.get(MODEL_DIRS_ENV, "").split(os.pathsep) if p]
    out: list[Path] = []
    for folder in [*(Path(p).expanduser() for p in extra), *env]:
        if folder not in out:
            out.append(folder)
    return out


# ---------------------------------------------------------------------------------------------- the stores


def _hf_cache() -> Iterator[Found]:
    """Safetensors snapshots of supported models, and GGUF files, in the HF hub cache."""
    root = hf_cache_root()
    for repo in sorted(_subdirs(root)):
        if not repo.name.startswith("models--"):
            continue
        repo_id = repo.name.removeprefix("models--").replace("--", "/", 1)
        snapshot = hf_snapshot(repo_id)
        if snapshot is not None:
            size = sum(_size(p) for p in snapshot.glob("*.safetensors"))
            yield Found(repo_id, "HF cache", "safetensors", snapshot, size)
        for snap in sorted(_subdirs(repo / "snapshots")):
            for path in _ggufs_under(snap, 2):
                yield Found(str(path), "HF cache", "gguf", path, _gguf_size(path))


def hf_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot of ``repo_id`` holding a config.json of a supported model type and safetensors weights
    (the revision ``refs/main`` points at, else the newest such snapshot), or None."""
    repo = hf_cache_root() / f"models--{repo_id.replace('/', '--')}"
    snapshots = repo / "snapshots"
    candidates = sorted(_subdirs(snapshots), key=_mtime, reverse=True)
    try:
        main = (repo / "refs" / "main").read_text().strip()
        candidates.sort(key=lambda p: p.name != main)  # stable: refs/main first, then newest first
    except OSError:
        pass
    for snap in candidates:
        if _model_type(snap / "config.json") in MODEL_TYPES and any(snap.glob("*.safetensors")):
            return snap
    return None


def _ollama() -> Iterator[Found]:
    """GGUF blobs named by Ollama's manifests."""
    manifests = ollama_root() / "manifests"
    for manifest in sorted(p for p in _files_under(manifests, 4)):
        parts = manifest.relative_to(manifests).parts
        if len(parts) != 4:  # host / namespace / model / tag
            continue
        host, namespace, model, tag = parts
        blob = _manifest_blob(manifest)
        if blob is None:
            continue
        if host == OLLAMA_HOST:
            short = model if namespace == "library" else f"{namespace}/{model}"
        else:
            short = f"{host}/{namespace}/{model}"
        yield Found(f"ollama:{short}:{tag}", "Ollama", "gguf", blob, _size(blob))


def _ollama_blob(name: str) -> Path | None:
    """The GGUF blob of Ollama model ``name`` (``model[:tag]``, ``namespace/model[:tag]`` or
    ``host/namespace/model[:tag]``; the tag defaults to ``latest``)."""
    model, _, tag = name.partition(":")
    parts = model.split("/")
    if len(parts) == 1:
        parts = [OLLAMA_HOST, "library", *parts]
    elif len(parts) == 2:
        parts = [OLLAMA_HOST, *parts]
    if len(parts) != 3 or any(p in ("", ".", "..") for p in parts) or tag in (".", ".."):
        return None
    return _manifest_blob(ollama_root() / "manifests" / Path(*parts) / (tag or "latest"))


def _manifest_blob(manifest: Path) -> Path | None:
    """The existing model blob an Ollama manifest names, or None."""
    try:
        layers = json.loads(manifest.read_text())["layers"]
        digest = next(layer["digest"] for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_LAYER)
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        return None
    if not isinstance(digest, str) or not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
        return None
    blob = ollama_root() / "blobs" / digest.replace(":", "-")
    return blob if blob.is_file() else None


def _lmstudio() -> Iterator[Found]:
    """GGUF files of LM Studio's ``<publisher>/<repo>/`` folders."""
    for root in lmstudio_roots():
        for publisher in sorted(_subdirs(root)):
            for repo in sorted(_subdirs(publisher)):
                files = list(_ggufs_under(repo, 1))
                for path in files:
                    name = f"lmstudio:{publisher.name}/{repo.name}"
                    if len(files) > 1:
                        name += f"/{path.name}"
                    yield Found(name, "LM Studio", "gguf", path, _gguf_size(path))


# ---------------------------------------------------------------------------------------------- files


def _ggufs_under(folder: Path, depth: int) -> Iterator[Path]:
    """Model GGUF files under ``folder`` (up to ``depth`` folders deep), sorted: first parts of split files only,
    no multimodal projectors."""
    for path in sorted(_files_under(folder, depth)):
        if path.suffix != ".gguf" or path.name.startswith("mmproj"):
            continue
        m = _SPLIT_PART.fullmatch(path.name)
        if m is not None and int(m.group(1)) != 1:
            continue
        yield path.absolute()  # the HF cache links names to hashed blobs: keep the names


def _files_under(folder: Path, depth: int) -> Iterator[Path]:
    """Files under ``folder``, at most ``depth`` folders deep (hidden folders skipped)."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        try:
            if entry.is_file():
                yield Path(entry.path)
            elif entry.is_dir() and depth > 1 and not entry.name.startswith("."):
                yield from _files_under(Path(entry.path), depth - 1)
        except OSError:
            continue


def _subdirs(folder: Path) -> list[Path]:
    try:
        return [Path(e.path) for e in os.scandir(folder) if e.is_dir()]
    except OSError:
        return []


def _model_type(config: Path) -> str | None:
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    return data.get("model_type") if isinstance(data, dict) else None


def _gguf_size(path: Path) -> int:
    """Bytes of a GGUF, all parts of a split one."""
    from specexec.errors import ModelFormatError
    from specexec.loading.convert import split_parts

    try:
        return sum(_size(p) for p in split_parts(path))
    except ModelFormatError:
        return _size(path)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
