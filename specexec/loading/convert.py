"""Convert a GGUF checkpoint into a Hugging Face model directory (config.json + safetensors + tokenizer).

The conversion streams: the GGUF's tensor table (names, ggml types, shapes, offsets) is read first, which fixes
every output tensor's name, shape and byte range, so each safetensors shard's header is written before any
weight is read. Then tensor after tensor, a chunk of rows at a time, the bytes are
read from the GGUF, dequantized to fp32 with ``gguf.quants.dequantize``, un-permuted where llama.cpp permuted
them, cast to the storage dtype (fp16 by default) and appended to the shard. The weights never sit in memory
together: the tensor step holds one chunk (:data:`CHUNK_ELEMENTS` fp32 values) whatever the model's size, and
the peak is set by the tokenizer step, which parses the GGUF's vocabulary (0.79 GB peak RSS converting the demo
1.5B target, 151,936 tokens, in 104 s on 2 cores, where loading it through transformers in fp32 takes ~9 GB). The
config step reads a copy of the metadata without the vocabulary (:func:`_metadata_view`).

The output is exactly what transformers' own GGUF loader gives (``AutoModelForCausalLM.from_pretrained(dir,
gguf_file=...)`` in fp32, each tensor then cast to the storage dtype), which transformers itself then refuses to
``save_pretrained``: the same dequantization function, the same Q/K row un-permutation for llama-architecture
files, the same ``w - 1`` (in fp32) for Gemma 2/3 norms that llama.cpp stores as ``w + 1``, Phi-3's fused
``qkv_proj``/``gate_up_proj`` kept fused, the same fp32 -> dtype cast (torch's), the same names (the ``gguf``
package's table), and the config and tokenizer built by transformers from the GGUF metadata. Only the weights
bypass transformers. Where transformers' loader reads a split GGUF's first part only or ignores a stated key, the
conversion corrects the config (see :func:`_save_config`). Architectures: :data:`ARCHITECTURES`; tensor types:
:data:`QUANT_TYPES`. A GGUF split by llama.cpp's gguf-split converts from any of its parts.

Layout: ``config.json``, ``generation_config.json``, tokenizer files, and ``model.safetensors`` when the weights
fit in one shard of :data:`SHARD_BYTES`, else ``model-0000i-of-0000n.safetensors`` shards (a new one starts
before the tensor that would overflow the current one) with ``model.safetensors.index.json``, as transformers
names them.

A target quantized to NF4 needs no 16-bit copy of its layers: a conversion with ``layers_in_gguf`` writes the config,
tokenizer and globals (embedding, final norm, lm_head) only, plus :data:`LAYERS_IN_GGUF`, the GGUF's parts (paths,
sizes, modification times) and each layer tensor's reading plan. :class:`GgufLayers` then reads a layer's tensors
from the GGUF through the same chunked dequantization, un-permutation and norm shift, rounded through the storage
dtype (fp16), so the NF4 layer cache built from it is byte for byte the one built from a full conversion (demo
target as NF4: 1.68 GB written in all instead of 4.30 GB, the 28 layer files identical; the layers are dequantized
in numpy as the full conversion does). A full conversion writes the same plan as :data:`GGUF_SOURCE`, so a 4-bit CPU
target can take the layer tensors stored as Q4_K from the GGUF's own blocks (:meth:`GgufLayers.blocks`, lossless)
rather than re-quantize their fp16 copy, while the GGUF is there unchanged.

Crash safety: everything is written into a hidden temporary sibling directory; the marker file
:data:`COMPLETE_MARKER` is written last and the directory is renamed into place atomically, so a directory at
``out_dir`` is always complete. A temporary directory left by a killed conversion is deleted by the next one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import logging
import math
import os
import re
import shutil
import struct
import time
from collections.abc import Callable, Iterator
from io import BufferedReader, BufferedWriter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from offload.store import LAYER_SOURCE
from specexec.errors import ModelFormatError, SpecexecError

logger = logging.getLogger(__name__)

COMPLETE_MARKER = ".specexec-complete"
"""Name of the file written last into a converted directory; its presence means the directory is complete."""

LAYERS_IN_GGUF = LAYER_SOURCE
"""In a conversion made with ``layers_in_gguf``: where the layers' weights are (the GGUF's parts, their sizes and
modification times) and how each is read from it (:class:`GgufLayers`); the NF4 layer cache's key hashes it
(:func:`offload.store.cache_key`)."""

GLOBAL_BLOCKS = ("model.embed_tokens.weight", "lm_head.weight")  # the globals a loader may take as blocks
GGUF_SOURCE = "gguf-source.json"
"""In a full conversion: the same reading plan as :data:`LAYERS_IN_GGUF` (the GGUF's parts, sizes and modification
times, each layer tensor's GGUF name and un-permutation) plus the embedding and lm_head (:data:`GLOBAL_BLOCKS`),
while the safetensors hold every weight. A loader may then take a tensor's own blocks from the GGUF (a CPU target
runs Q4_K and Q6_K blocks as stored: :meth:`GgufLayers.blocks`) while the GGUF is there unchanged
(:func:`gguf_blocks`); without it, or without this file (a conversion made before it was written), everything is
read from the safetensors."""

SHARD_BYTES = 2 * 10**9
"""Largest safetensors shard written, in bytes (a single larger tensor gets a shard of its own)."""

CHUNK_ELEMENTS = 1 << 24
"""Values dequantized at once (64 MB of fp32): rows of a tensor are converted in chunks of about this size."""

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
"""GGUF ``general.architecture`` values converted here (Mistral files are ``llama``)."""

QUANT_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
    "TQ1_0", "TQ2_0", "MXFP4",
)  # fmt: skip
"""The ggml tensor types converted (those ``gguf.quants`` dequantizes): a GGUF "Q4_K_M" or "IQ4_XS" file is made
of these. Others (Q8_1, Q8_K, integer and F64 tensors) are refused with one line."""

_NORM_OFFSET_ARCHITECTURES = ("gemma2", "gemma3")
"""llama.cpp stores these architectures' RMSNorm weights as ``w + 1`` (Gemma's norm scales by ``1 + w``)."""

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")

_SPLIT_NAME = re.compile(r"(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")
"""llama.cpp gguf-split's part names: ``<stem>-00001-of-00003.gguf``."""

# safetensors' names of the storage dtypes
_ST_DTYPE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}

OnTensor = Callable[[str, int, int], None]
"""``on_tensor(hf_name, index, count)``: called once each tensor is in its file (index 0 .. count - 1)."""


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One GGUF tensor and where it goes: ``shape`` in torch order (GGUF lists dimensions fastest first);
    ``path``: the GGUF file (the part of a split GGUF) holding it; ``offset``: where its data starts there;
    ``heads``: llama.cpp permuted its rows within each of ``heads`` head blocks (llama-architecture q/k), which
    the conversion undoes; None when it did not. ``shift``: llama.cpp stored ``w + shift`` (Gemma's norms)."""

    gguf_name: str
    hf_name: str
    qtype: int
    shape: tuple[int, ...]
    path: Path
    offset: int
    heads: int | None = None
    shift: float = 0.0

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1])

    @property
    def cols(self) -> int:
        return self.shape[-1]


@dataclasses.dataclass(frozen=True)
class _Gguf:
    """What the GGUF's headers say: ``architecture``; ``metadata`` of its first part (numbers and strings as
    they are, arrays as their length: the vocabulary is never parsed here); ``tensors`` of all its parts, in
    order (``hf_name`` still empty)."""

    path: Path
    architecture: str
    metadata: dict[str, Any]
    tensors: list[_Tensor]


@dataclasses.dataclass(frozen=True)
class _ModelSpec:
    """The weights the model class expects: ``shapes`` {hf name: shape} of the stored (untied) ones, the
    attention's query and key/value head counts, and its layer count.

    A llama GGUF without ``head_count_kv`` has as many key/value heads as query heads (llama.cpp reads it so);
    transformers' own loader then leaves q/k permuted, a bug not copied here.
    """

    shapes: dict[str, tuple[int, ...]]
    heads: int
    kv_heads: int
    layers: int


def is_complete(model_dir: Path) -> bool:
    """True when ``model_dir`` is a finished conversion (the marker file exists)."""
    return (Path(model_dir) / COMPLETE_MARKER).is_file()


def split_parts(gguf_path: Path) -> list[Path]:
    """The files of the GGUF ``gguf_path`` names, in order: ``[gguf_path]``, or for any part of a GGUF split by
    llama.cpp's gguf-split (``<stem>-00002-of-00003.gguf``) all its parts, the first one first.

    A missing part raises :class:`ModelFormatError`.
    """
    gguf_path = Path(gguf_path)
    m = _SPLIT_NAME.fullmatch(gguf_path.name)
    if m is None:
        return [gguf_path]
    count = int(m["count"])
    parts = [gguf_path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ModelFormatError(
            f"{gguf_path.name} is one of {count} parts of a split GGUF, but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} missing from {gguf_path.parent}"
        )
    return parts


def gguf_to_hf_dir(
    gguf_path: Path,
    out_dir: Path,
    dtype: torch.dtype = torch.float16,
    progress: bool = True,
    on_tensor: OnTensor | None = None,
    layers_in_gguf: bool = False,
) -> Path:
    """Convert ``gguf_path`` into a Hugging Face directory at ``out_dir`` and return ``out_dir``.

    ``gguf_path`` may name any part of a split GGUF (``-00001-of-00003.gguf``): all parts are read. The weights
    are dequantized tensor by tensor and stored as ``dtype`` (config.json records it as ``dtype``/``torch_dtype``).
    The tokenizer (incl. chat template), config and generation config come from the GGUF metadata, through
    transformers. An existing ``out_dir`` is replaced only after the new directory is complete. ``progress``: a
    rich progress display on stderr. A GGUF this cannot convert (corrupt or truncated, another architecture, a
    ggml type not in :data:`QUANT_TYPES`, no tokenizer, missing tensors) raises :class:`ModelFormatError`
    before anything is written.

    ``layers_in_gguf``: write no layer weights, only config, tokenizer and the globals (embedding, final norm,
    lm_head: ``model.safetensors``), plus :data:`LAYERS_IN_GGUF`, which tells :class:`GgufLayers` where each layer
    tensor is in the GGUF. For a target quantized to NF4 from its layers: no 16-bit copy of the model on disk.
    """
    if dtype not in _ST_DTYPE:
        raise ValueError(f"dtype must be one of {list(_ST_DTYPE)}, got {dtype}")
    gguf_path = Path(gguf_path).absolute()  # not resolve(): the HF cache links part names to hashed blobs
    out_dir = Path(out_dir).expanduser().resolve()
    if not gguf_path.is_file():
        raise SpecexecError(f"GGUF file not found: {gguf_path}")
    source = _read_gguf(gguf_path)
    first = source.path
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(out_dir)
    tmp_dir = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    if tmp_dir.exists():
        shutil.rmtree(tmp_dir)
    tmp_dir.mkdir()
    start = time.perf_counter()
    try:
        with _display(progress) as show:
            show.stage(f"reading the tokenizer from {first.name}")
            _save_tokenizer(first, tmp_dir)
            show.stage(f"reading the config from {first.name}")
            model = _save_config(source, dtype, tmp_dir)
            plan = _plan(source, model)
            where = LAYERS_IN_GGUF if layers_in_gguf else GGUF_SOURCE
            # the plan also names the embedding and lm_head: a CPU target runs their own blocks, and a conversion
            # without its layers reads them from the GGUF too (it writes only the small tensors)
            from_gguf = [t for t in plan if _is_layer(t) or t.hf_name in GLOBAL_BLOCKS]
            _write_layer_plan(source, from_gguf, dtype, tmp_dir / where)
            if layers_in_gguf:
                planned = {t.hf_name for t in from_gguf}
                plan = [t for t in plan if t.hf_name not in planned]
            show.stage(f"writing {_dtype_name(dtype)} safetensors to {out_dir}")
            _write_weights(plan, dtype, tmp_dir, show.tensors(len(plan)), on_tensor)
        _check_layout(tmp_dir)
        _make_readable(tmp_dir)
        _write_marker(tmp_dir, first, dtype)
        _move_into_place(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    logger.info("converted %s -> %s in %.1f s", first.name, out_dir, time.perf_counter() - start)
    return out_dir


# ---------------------------------------------------------------------------------------------- the GGUF


def _read_gguf(gguf_path: Path) -> _Gguf:
    """The headers of ``gguf_path`` (all parts of a split GGUF): refuses, before any work, files this module cannot
    convert (corrupt, truncated, another architecture, a tensor type not in :data:`QUANT_TYPES`, no tokenizer).

    Only the headers are read, and of the metadata only numbers and strings: arrays (the vocabulary, the merges) are
    skipped unparsed, where ``gguf.GGUFReader`` would build an object per value (tens of seconds and ~0.5 GB for a
    150k-token vocabulary).
    """
    parts = split_parts(gguf_path)
    headers = [_read_header(part) for part in parts]
    metadata = headers[0][0]
    name = parts[0].name
    count = metadata.get("split.count", 1)
    if count != len(parts):
        raise ModelFormatError(
            f"{name} says it is the first of {count} parts of a split GGUF; name the parts "
            f"<name>-00001-of-{count:05d}.gguf ... as llama.cpp's gguf-split does, then pass the first one"
        )
    for i, (part, (meta, _)) in enumerate(zip(parts, headers)):
        if meta.get("split.no", 0) != i:
            raise ModelFormatError(f"{part.name} is part {meta.get('split.no', 0) + 1} of its split GGUF, not {i + 1}")
    architecture = metadata.get("general.architecture", "?")
    if architecture not in ARCHITECTURES:
        raise ModelFormatError(
            f"{name}: GGUF architecture {architecture!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)}; Mistral files are llama)"
        )
    if "tokenizer.ggml.model" not in metadata or "tokenizer.ggml.tokens" not in metadata:
        raise ModelFormatError(
            f"{name} has no tokenizer metadata (tokenizer.ggml.*); use a GGUF written with its tokenizer "
            f"(llama.cpp's convert_hf_to_gguf writes it)"
        )
    tensors = [t for _, part_tensors in headers for t in part_tensors]
    expected = metadata.get("split.tensors.count", len(tensors))
    names = {t.gguf_name for t in tensors}
    if len(names) != len(tensors) or expected != len(tensors):
        raise ModelFormatError(f"{name}: its parts hold {len(tensors)} tensors ({len(names)} names), not {expected}")
    return _Gguf(parts[0], architecture, metadata, tensors)


def _read_header(path: Path) -> tuple[dict[str, Any], list[_Tensor]]:
    """(metadata, tensors) of one GGUF file, each tensor checked to be convertible and inside the file."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            metadata, entries, table_end = _parse_header(f, path.name, size)
    except (struct.error, UnicodeDecodeError, OSError, MemoryError, OverflowError) as err:
        raise ModelFormatError(f"{path.name} is not a readable GGUF file: {err}") from None
    alignment = metadata.get("general.alignment", 32)  # llama.cpp's default alignment
    if not isinstance(alignment, int) or alignment <= 0:
        raise ModelFormatError(f"{path.name} is not a readable GGUF file: alignment {alignment!r}")
    data_start = -(-table_end // alignment) * alignment  # the tensor data begins at the next aligned offset
    tensors = []
    for name, dims, qtype, offset in entries:
        # GGUF lists dimensions fastest-varying first, torch the other way round
        t = _Tensor(name, "", qtype, tuple(reversed(dims)), path, data_start + offset)
        end = t.offset + t.rows * _check_dequantizable(path, t)
        if end > size:
            raise ModelFormatError(f"truncated GGUF file {path}: tensor {name} ends at byte {end} of {size}")
        tensors.append(t)
    return metadata, tensors


# GGUF metadata value types: fixed-size ones -> struct format (uint8, int8, uint16, int16, uint32, int32, float32,
# bool, uint64, int64, float64); 8 is a string, 9 an array
_VALUE_FORMAT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _parse_header(
    f: BufferedReader, name: str, size: int, spans: dict[str, tuple[int, int]] | None = None
) -> tuple[dict[str, Any], list[tuple[str, tuple[int, ...], int, int]], int]:
    """(metadata, [(tensor name, GGUF dims, ggml type, data offset)], end of the tensor table) from an open GGUF
    file of ``size`` bytes (versions 2 and 3, little-endian). Metadata arrays are given as their length. ``spans``,
    if given, receives each metadata entry's byte range in the file.

    Every length read is checked against the file's size, so a corrupt header fails here instead of asking for
    an absurd allocation.
    """

    def unpack(fmt: str) -> tuple:
        data = f.read(struct.calcsize(fmt))
        return struct.unpack(fmt, data)

    def length(what: str, item_bytes: int = 1) -> int:
        (n,) = unpack("<Q")
        if n * item_bytes > size - f.tell():
            raise ModelFormatError(
                f"{name} is corrupt or truncated: a {what} of {n} items runs past the end of the file"
            )
        return n

    def string() -> str:
        return f.read(length("string")).decode()

    def value(value_type: int) -> Any:
        if value_type in _VALUE_FORMAT:
            return unpack(_VALUE_FORMAT[value_type])[0]
        if value_type == 8:
            return string()
        if value_type == 9:
            (item_type,) = unpack("<I")
            fixed = struct.calcsize(_VALUE_FORMAT[item_type]) if item_type in _VALUE_FORMAT else 0
            count = length("metadata array", max(fixed, 1 if item_type != 8 else 8))
            if fixed:
                f.seek(count * fixed, os.SEEK_CUR)
            else:
                for _ in range(count):
                    value(item_type)
            return count
        raise ModelFormatError(f"{name}: GGUF metadata value of unknown type {value_type}")

    magic, version = unpack("<4sI")
    if magic != b"GGUF":
        raise ModelFormatError(f"{name} is not a GGUF file (it does not start with GGUF)")
    if version & 0xFFFF == 0:
        raise ModelFormatError(f"{name} is a big-endian GGUF; only little-endian files are converted")
    if version not in (2, 3):
        raise ModelFormatError(f"{name} is GGUF version {version}; versions 2 and 3 are read")
    tensor_count = length("tensor table", 24)  # each entry takes at least 24 bytes
    kv_count = length("metadata table", 12)
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        start = f.tell()
        key = string()
        (value_type,) = unpack("<I")
        metadata[key] = value(value_type)
        if spans is not None:
            spans[key] = (start, f.tell())
    entries = []
    for _ in range(tensor_count):
        tensor = string()
        (ndim,) = unpack("<I")
        if not 1 <= ndim <= 4:
            raise ModelFormatError(f"{name} is corrupt: tensor {tensor!r} has {ndim} dimensions")
        dims = unpack(f"<{ndim}Q")
        qtype, offset = unpack("<IQ")
        entries.append((tensor, tuple(dims), qtype, offset))
    return metadata, entries, f.tell()


def _check_dequantizable(gguf_path: Path, tensor: _Tensor) -> int:
    """Bytes per row of ``tensor``; ModelFormatError unless its ggml type is one of :data:`QUANT_TYPES`."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        qtype = GGMLQuantizationType(tensor.qtype)
    except ValueError:
        qtype = None
    if qtype is None or qtype.name not in QUANT_TYPES:
        kind = qtype.name if qtype is not None else f"number {tensor.qtype} (unknown to the installed gguf package)"
        raise ModelFormatError(
            f"{gguf_path.name}: tensor {tensor.gguf_name} is stored as ggml type {kind}, which is not converted; "
            f"supported types: {', '.join(QUANT_TYPES)}"
        )
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    if tensor.cols % block:
        raise ModelFormatError(
            f"{gguf_path.name}: tensor {tensor.gguf_name} has rows of {tensor.cols} values, not a multiple of "
            f"its {qtype.name} block of {block}"
        )
    return tensor.cols // block * block_bytes


def _hf_names(architecture: str, model: _ModelSpec) -> dict[str, str]:
    """{GGUF tensor name: HF parameter name} for the model's parameters, from the ``gguf`` package's own name
    table (llama.cpp's), built the way transformers' GGUF loader builds it."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next(key for key, value in MODEL_ARCH_NAMES.items() if value == architecture)
    table = get_tensor_name_map(arch, model.layers)
    names = {}
    for hf_name in model.shapes:
        base, dot, suffix = hf_name.rpartition(".")
        if suffix not in ("weight", "bias"):
            base, dot, suffix = hf_name, "", ""
        gguf_name = table.get_name(base)
        if gguf_name is not None:
            names[gguf_name + dot + suffix] = hf_name
    return names


def _plan(source: _Gguf, model: _ModelSpec) -> list[_Tensor]:
    """The tensors to write, in file order, each with its HF name and what undoes llama.cpp's changes to it (the
    llama q/k row permutation, Gemma's norm offset).

    Like transformers' loader, GGUF tensors the model has no parameter for are skipped (llama 3's
    ``rope_freqs``, a bias the config does not use). Every parameter of the model must come from the file with
    its shape, else ModelFormatError.
    """
    expected = model.shapes
    names = _hf_names(source.architecture, model)
    heads = {"attn_q": model.heads, "attn_k": model.kv_heads}
    plan, skipped = [], []
    for t in source.tensors:
        name = names.get(t.gguf_name)
        if name is None:
            skipped.append(t.gguf_name)
            continue
        if t.shape != expected[name]:
            raise ModelFormatError(
                f"{source.path.name}: tensor {t.gguf_name} has shape {list(t.shape)}, the config gives "
                f"{name} the shape {list(expected[name])}"
            )
        kind = t.gguf_name.split(".")[2] if t.gguf_name.startswith("blk.") else ""
        permuted = source.architecture == "llama" and kind in heads
        offset = source.architecture in _NORM_OFFSET_ARCHITECTURES and "norm.weight" in t.gguf_name
        plan.append(
            dataclasses.replace(t, hf_name=name, heads=heads[kind] if permuted else None, shift=1.0 if offset else 0.0)
        )
    missing = sorted(set(expected) - {t.hf_name for t in plan})
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ModelFormatError(f"{source.path.name} lacks weights its config needs: {shown}")
    if skipped:
        logger.info("convert: %d GGUF tensors have no model parameter and are skipped: %s", len(skipped), skipped)
    return plan


# ---------------------------------------------------------------------------------------------- tokenizer, config


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """Build the tokenizer from the GGUF metadata and save it (tokenizer.json, config, chat template)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer.save_pretrained(out_dir)


def _save_config(source: _Gguf, dtype: torch.dtype, out_dir: Path) -> _ModelSpec:
    """Write config.json and generation_config.json as transformers builds them from the GGUF metadata, and
    return what the weights must be. Their names and shapes come from the model class built on the meta device
    (no memory).

    Corrections where transformers reads only the first file or ignores a key: ``tie_word_embeddings`` from
    the tensors of all parts of a split GGUF, ``head_dim`` from ``<arch>.attention.key_length`` where the file
    states it (transformers' Qwen3 config otherwise keeps its class default of 128), RoPE scaling (linear, llama 3's,
    Phi-3's LongRoPE) and Gemma's query scale as llama.cpp reads them.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    view = _metadata_view(source, out_dir)
    try:
        config = AutoConfig.from_pretrained(view.parent, gguf_file=view.name)
    finally:
        view.unlink()
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.tie_word_embeddings = all(t.gguf_name != "output.weight" for t in source.tensors)
    key_length = source.metadata.get(f"{source.architecture}.attention.key_length")
    if isinstance(key_length, int) and getattr(config, "head_dim", key_length) != key_length:
        config.head_dim = key_length
    _set_rope_scaling(config, source)
    _set_llama3_rope(config, source)
    _set_longrope(config, source)
    _set_query_scale(config, source)
    config.dtype = dtype
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    config.architectures = [type(model).__name__]
    config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    _record_dtype(out_dir / "config.json", dtype)
    shapes = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)  # the embedding itself; save_pretrained does not store it either
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return _ModelSpec(shapes, heads, kv_heads, config.num_hidden_layers)


_VOCABULARY_KEYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
)


def _metadata_view(source: _Gguf, directory: Path) -> Path:
    """A small GGUF in ``directory`` for transformers' config reader: the first part's metadata, byte for byte, minus
    the vocabulary arrays (with ``<arch>.vocab_size`` stated when the file leaves it to the vocabulary's length, as
    transformers then counts it), and every tensor of all parts by name, each as one F32 value.

    transformers' GGUF config reads the whole file with ``gguf.GGUFReader``, which builds an object per vocabulary
    entry (~25 s for a 150k-token vocabulary) to read a few numbers; the config depends only on the metadata kept
    here and on the tensors' names (a tied lm_head is one without ``output.weight``).
    """
    first = source.path
    spans: dict[str, tuple[int, int]] = {}
    with open(first, "rb") as f:
        _parse_header(f, first.name, first.stat().st_size, spans)
        entries = []
        for key, (start, end) in spans.items():
            if key not in _VOCABULARY_KEYS:
                f.seek(start)
                entries.append(f.read(end - start))
    vocab_key = f"{source.architecture}.vocab_size"
    if vocab_key not in spans and "tokenizer.ggml.tokens" in source.metadata:
        encoded = vocab_key.encode()
        entries.append(
            struct.pack("<Q", len(encoded)) + encoded + struct.pack("<II", 4, source.metadata["tokenizer.ggml.tokens"])
        )
    alignment = source.metadata.get("general.alignment", 32)
    table = b""
    for i, t in enumerate(source.tensors):
        encoded = t.gguf_name.encode()
        table += struct.pack("<Q", len(encoded)) + encoded + struct.pack("<IQIQ", 1, 1, 0, i * alignment)
    header = struct.pack("<4sIQQ", b"GGUF", 3, len(source.tensors), len(entries)) + b"".join(entries) + table
    header += b"\0" * (-len(header) % alignment)
    view = directory / f".metadata-{first.name}"
    if view.suffix != ".gguf":
        view = view.with_name(view.name + ".gguf")
    view.write_bytes(header + b"\0" * (len(source.tensors) * alignment))
    return view


def _set_rope_scaling(config: Any, source: _Gguf) -> None:
    """Linear RoPE scaling as the GGUF states it (``<arch>.rope.scaling.type`` / ``.factor``), which transformers'
    GGUF config ignores: Gemma 3 4B and up scale their global layers' positions by 8. On a config with RoPE
    parameters per layer type (Gemma 3) it applies to the full-attention layers only, as in llama.cpp. Other
    scaling types are logged and left out (llama 3's scaling lives in a ``rope_freqs`` tensor, not read here)."""
    kind = source.metadata.get(f"{source.architecture}.rope.scaling.type")
    factor = source.metadata.get(f"{source.architecture}.rope.scaling.factor")
    if kind in (None, "none") or factor in (None, 1.0):
        return
    if kind != "linear":
        logger.warning("%s: RoPE scaling %r is not converted; the model runs unscaled", source.path.name, kind)
        return
    rope = dict(getattr(config, "rope_parameters", None) or {})
    scaled = {"rope_type": "linear", "factor": float(factor)}
    if isinstance(rope.get("full_attention"), dict):
        rope["full_attention"] = {**rope["full_attention"], **scaled}
    else:
        rope.update(scaled)
    config.rope_parameters = rope


_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""The llama 3 RoPE scaling parameters of every published Llama 3.1 / 3.2 / 3.3 config, bar the factor."""


def _set_llama3_rope(config: Any, source: _Gguf) -> None:
    """Llama 3.1+'s RoPE scaling, which llama.cpp stores only as per-frequency factors (the ``rope_freqs`` tensor)
    and transformers' GGUF config drops. The factors are recomputed with llama.cpp's formula from the published
    parameters (:data:`_LLAMA3_ROPE`, the factor being the largest one); when they agree the config gets
    ``rope_type: llama3``, else the file's factors are logged as not understood and the model runs unscaled."""
    tensor = next((t for t in source.tensors if t.gguf_name == "rope_freqs.weight"), None)
    if source.architecture != "llama" or tensor is None or len(tensor.shape) != 1:
        return
    with open(tensor.path, "rb") as f:
        stored = _read_rows(f, tensor, 0, 1).reshape(-1).astype(np.float64)
    base = float(source.metadata.get("llama.rope.freq_base", 10000.0))
    dim = 2 * len(stored)
    params = {"factor": float(stored.max()), **_LLAMA3_ROPE}
    if not np.allclose(stored, _llama3_factors(base, dim, **params), rtol=1e-5, atol=0):
        logger.warning("%s: rope_freqs is not llama 3's scaling; the model runs unscaled", source.path.name)
        return
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope.update({"rope_type": "llama3", **params})
    config.rope_parameters = rope


def _set_longrope(config: Any, source: _Gguf) -> None:
    """Phi-3's LongRoPE (the 128k-context Phi-3 / Phi-3.5 models), which llama.cpp stores as the
    ``rope_factors_long`` / ``rope_factors_short`` tensors and ``phi3.rope.scaling.original_context_length``, and
    transformers' GGUF config drops: they become ``rope_type: longrope`` with the two factor lists."""
    tensors = {t.gguf_name: t for t in source.tensors if t.gguf_name.startswith("rope_factors_")}
    original = source.metadata.get(f"{source.architecture}.rope.scaling.original_context_length")
    if source.architecture != "phi3" or not tensors:
        return
    if set(tensors) != {"rope_factors_long.weight", "rope_factors_short.weight"} or not isinstance(original, int):
        logger.warning(
            "%s: incomplete LongRoPE scaling (%s); the model runs unscaled", source.path.name, sorted(tensors)
        )
        return
    factors = {}
    for kind in ("long", "short"):
        t = tensors[f"rope_factors_{kind}.weight"]
        with open(t.path, "rb") as f:
            factors[f"{kind}_factor"] = _read_rows(f, t, 0, 1).reshape(-1).tolist()
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope.update({"rope_type": "longrope", **factors, "original_max_position_embeddings": original})
    config.original_max_position_embeddings = original
    config.rope_parameters = rope


_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
"""Layer counts of Gemma 2 27B and Gemma 3 27B, whose attention scales by hidden / heads, not the head width."""


def _set_query_scale(config: Any, source: _Gguf) -> None:
    """Gemma's ``query_pre_attn_scalar``, which no GGUF key states: llama.cpp scales queries by the head width,
    except for the 27B models (told apart by their layer count), which use hidden / heads (Gemma 2 27B: 144, Gemma 3
    27B: 168). transformers' GGUF config keeps its class default of 256 for every size."""
    layers = _GEMMA_27B_LAYERS.get(source.architecture)
    if layers is None:
        return
    if config.num_hidden_layers == layers:
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads
    else:
        config.query_pre_attn_scalar = config.head_dim


def _llama3_factors(
    base: float,
    dim: int,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: float,
) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` (convert_hf_to_gguf, LlamaModel): the divisor of each RoPE frequency."""
    freqs = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float32).astype(np.float64) / dim)
    wavelen = 2 * math.pi / freqs
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    mid = 1 / ((1 - smooth) / factor + smooth)
    low, high = original_max_position_embeddings / low_freq_factor, original_max_position_embeddings / high_freq_factor
    return np.where(wavelen < high, 1.0, np.where(wavelen > low, factor, mid))


def _record_dtype(config_path: Path, dtype: torch.dtype) -> None:
    """Record the storage dtype in config.json under both keys (``dtype``: transformers 5, ``torch_dtype``: 4.x)."""
    data = json.loads(config_path.read_text())
    data["dtype"] = data["torch_dtype"] = _dtype_name(dtype)
    data.pop("quantization_config", None)
    data.pop("_model_name_or_path", None)  # the GGUF's general.name, e.g. "... AWQ": misleading here
    config_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------------------------------------- weights


def _shards(plan: list[_Tensor], itemsize: int) -> list[list[_Tensor]]:
    """``plan`` cut into consecutive shards of at most :data:`SHARD_BYTES` (an oversized tensor alone)."""
    shards: list[list[_Tensor]] = [[]]
    size = 0
    for t in plan:
        nbytes = t.rows * t.cols * itemsize
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    return shards


def _write_weights(
    plan: list[_Tensor],
    dtype: torch.dtype,
    out_dir: Path,
    advance: Callable[[str], None],
    on_tensor: OnTensor | None,
) -> None:
    """Write ``plan`` as safetensors shards (+ index when more than one), one tensor at a time."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards = _shards(plan, itemsize)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    done = 0
    with contextlib.ExitStack() as stack:
        sources: dict[Path, BufferedReader] = {}  # one open file per GGUF part
        for name, shard in zip(names, shards):
            with open(out_dir / name, "wb") as dst:
                dst.write(_safetensors_header(shard, dtype, itemsize))
                for t in shard:
                    if t.path not in sources:
                        sources[t.path] = stack.enter_context(open(t.path, "rb"))
                    _write_tensor(sources[t.path], dst, t, dtype)
                    dst.flush()  # a reported tensor is in the file
                    advance(t.hf_name)
                    if on_tensor is not None:
                        on_tensor(t.hf_name, done, len(plan))
                    done += 1
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.rows * t.cols for t in plan) * itemsize},
            "weight_map": {t.hf_name: name for name, shard in zip(names, shards) for t in shard},
        }
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _safetensors_header(shard: list[_Tensor], dtype: torch.dtype, itemsize: int) -> bytes:
    """The length-prefixed JSON header of a safetensors file holding ``shard``'s tensors back to back, in order
    (padded with spaces to a multiple of 8 bytes, as the safetensors library writes it)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in shard:
        nbytes = t.rows * t.cols * itemsize
        header[t.hf_name] = {
            "dtype": _ST_DTYPE[dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _write_tensor(src: BufferedReader, dst: BufferedWriter, t: _Tensor, dtype: torch.dtype) -> None:
    """Dequantize ``t`` from ``src`` a chunk of rows at a time and append it to ``dst`` as ``dtype``."""
    for chunk in _tensor_chunks(src, t, dtype):
        dst.write(chunk.view(torch.uint8).reshape(-1).numpy().data)


def _tensor_chunks(src: BufferedReader, t: _Tensor, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """``t`` read from ``src`` as consecutive chunks of rows in ``dtype`` (flat), dequantized, less ``t.shift``
    (subtracted in float32 as transformers does), un-permuted, then cast (torch's cast, as the transformers path).

    A chunk holds whole head blocks of a permuted q/k weight, so its un-permutation never crosses chunks; a 1-d
    tensor (a norm, a bias) is one chunk.
    """
    if len(t.shape) == 1:
        values = _read_rows(src, t, 0, 1).reshape(-1)
        if t.shift:
            values = values - np.float32(t.shift)
        yield _cast(t, _unpermute(values, t.heads) if t.heads is not None else values, dtype)
        return
    group = t.rows // t.heads if t.heads is not None else 1  # rows per head block
    step = max(group, CHUNK_ELEMENTS // t.cols // group * group)
    for first in range(0, t.rows, step):
        count = min(step, t.rows - first)
        values = _read_rows(src, t, first, count)
        if t.shift:
            values = values - np.float32(t.shift)
        yield _cast(t, _unpermute(values, count // group) if t.heads is not None else values, dtype)


def _read_rows(src: BufferedReader, t: _Tensor, first: int, count: int) -> np.ndarray:
    """Rows ``first .. first + count`` of ``t`` (rows: all dimensions but the last), dequantized to float32
    (``count``, ``cols``), exactly as ``gguf.quants.dequantize`` gives the whole tensor.

    The bytes are read with plain file reads, never through a memory map: pages of a mapped file that the
    conversion touches count in the process's RSS while the map lives (the whole GGUF, by the end).
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(t.qtype)
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    row_bytes = t.cols // block * block_bytes
    raw = np.empty(count * row_bytes, dtype=np.uint8)
    src.seek(t.offset + first * row_bytes)
    if src.readinto(raw.data) != raw.nbytes:
        raise ModelFormatError(f"truncated GGUF file {src.name}: tensor {t.gguf_name} ends past the end of the file")
    if qtype == GGMLQuantizationType.F32:  # gguf.quants takes F32 and F16 typed (as GGUFReader hands them over)
        return dequantize(raw.view(np.float32).reshape(count, t.cols), qtype)
    if qtype == GGMLQuantizationType.F16:
        return dequantize(raw.view(np.float16).reshape(count, t.cols), qtype)
    return dequantize(raw.reshape(count, row_bytes), qtype)


def _cast(t: _Tensor, values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """float32 ``values`` of ``t`` cast to ``dtype`` (torch's cast, as the transformers path does), flat."""
    chunk = torch.from_numpy(np.ascontiguousarray(values)).to(dtype).reshape(-1)
    if not bool(torch.isfinite(chunk).all()):
        raise SpecexecError(
            f"weight {t.hf_name} overflows {_dtype_name(dtype)}; convert with dtype=torch.bfloat16 or float32 instead"
        )
    return chunk


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation on ``w`` (rows, ...), which holds ``n_head`` whole heads.

    llama.cpp's converter reorders each head's rows from HF's rotate-half layout to interleaved pairs
    (``reshape(n_head, 2, d, ...).swapaxes(1, 2)``); this is its inverse, written as transformers' GGUF loader
    writes it (``reshape(n_head, d, 2, ...).swapaxes(2, 1)``), so values land on the same rows.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


# ---------------------------------------------------------------------------------------------- layers in the GGUF


def _is_layer(t: _Tensor) -> bool:
    return t.hf_name.startswith("model.layers.")


def _part_stats(parts: list[Path]) -> list[dict[str, Any]]:
    return [{"path": str(p), "size": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns} for p in parts]


def _write_layer_plan(source: _Gguf, layers: list[_Tensor], dtype: torch.dtype, out: Path) -> None:
    """Write the file ``out`` (:data:`LAYERS_IN_GGUF` or :data:`GGUF_SOURCE`): the GGUF's parts (path, size, mtime)
    and, per layer tensor, its GGUF name and what undoes llama.cpp's changes to it; ``dtype``: the storage dtype its
    values round through."""
    info = {
        "parts": _part_stats(split_parts(source.path)),
        "dtype": _dtype_name(dtype),
        "tensors": {t.hf_name: {"gguf": t.gguf_name, "heads": t.heads, "shift": t.shift} for t in layers},
    }
    out.write_text(json.dumps(info, indent=2) + "\n")


def layers_in_gguf(model_dir: Path) -> bool:
    """True when ``model_dir`` is a conversion whose layers stay in the GGUF (see :class:`GgufLayers`)."""
    return (Path(model_dir) / LAYERS_IN_GGUF).is_file()


def gguf_blocks(model_dir: Path) -> GgufLayers | None:
    """A reader of the layer tensors' own blocks in the GGUF ``model_dir`` was converted from
    (:meth:`GgufLayers.blocks`), or None: not a GGUF conversion, one made before :data:`GGUF_SOURCE` was written, or
    a full conversion whose GGUF is gone or changed since (its safetensors then hold the weights to use; a demo
    model's assembled GGUF is deleted once converted). A conversion without its layers has only its GGUF: a
    changed one raises :class:`ModelFormatError`."""
    model_dir = Path(model_dir)
    if layers_in_gguf(model_dir):
        return GgufLayers(model_dir)
    if not (model_dir / GGUF_SOURCE).is_file():
        return None
    try:
        return GgufLayers(model_dir, GGUF_SOURCE)
    except (ModelFormatError, OSError, KeyError, ValueError) as err:
        logger.info("%s: the layers are read from its safetensors, not from its GGUF's blocks (%s)", model_dir, err)
        return None


class GgufLayers:
    """Layer tensors by HF name, read from the GGUF of a ``layers_in_gguf`` conversion at ``model_dir``: each is
    dequantized a chunk of rows at a time into one new CPU tensor in the conversion's storage dtype (fp16), so its
    values are exactly those a full conversion stores. Same ``get``/``has`` as the safetensors reader.

    ``plan``: the reading plan's file in ``model_dir``, :data:`LAYERS_IN_GGUF` or a full conversion's
    :data:`GGUF_SOURCE`. A GGUF part that changed since the conversion (size or modification time) raises
    :class:`ModelFormatError`.
    """

    def __init__(self, model_dir: Path, plan: str = LAYERS_IN_GGUF) -> None:
        model_dir = Path(model_dir)
        info = json.loads((model_dir / plan).read_text())
        parts = [Path(p["path"]) for p in info["parts"]]
        for want in info["parts"]:
            path = Path(want["path"])
            if not path.is_file():
                raise ModelFormatError(f"{model_dir} reads its layers from {path}, which is gone")
            st = path.stat()
            if (st.st_size, st.st_mtime_ns) != (want["size"], want["mtime_ns"]):
                raise ModelFormatError(
                    f"{path} changed since it was converted into {model_dir}; delete {model_dir} to convert it again"
                )
        found = {t.gguf_name: t for part in parts for t in _read_header(part)[1]}
        self.dtype: torch.dtype = getattr(torch, info["dtype"])
        self.tensors = {
            hf: dataclasses.replace(found[e["gguf"]], hf_name=hf, heads=e["heads"], shift=e["shift"])
            for hf, e in info["tensors"].items()
        }

    def has(self, name: str) -> bool:
        return name in self.tensors

    def _tensor(self, name: str) -> _Tensor:
        t = self.tensors.get(name)
        if t is None:
            raise ModelFormatError(f"tensor {name!r} is not among the GGUF's layer tensors")
        return t

    def qtype(self, name: str) -> str:
        """The ggml type tensor ``name`` is stored as in the GGUF (``"Q4_K"``, ``"Q6_K"``, ``"F16"`` ...)."""
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self._tensor(name).qtype).name

    def blocks(self, name: str) -> torch.Tensor:
        """The GGUF's own bytes of the 2-d tensor ``name``: a new uint8 tensor (rows, bytes a row) of its ggml
        blocks, its rows in the HF order -- where llama.cpp permuted q/k rows, whole rows are moved back as
        :func:`_tensor_chunks` moves their values, so row ``r`` holds the blocks of the converted tensor's row ``r``.
        Read with a plain file read (see :func:`_read_rows`), never dequantized."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        t = self._tensor(name)
        if len(t.shape) != 2 or t.shift:
            raise ValueError(f"{name}: only a 2-d tensor stored as it is has blocks to take")
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(t.qtype)]
        row_bytes = t.cols // block * block_bytes
        raw = np.empty((t.rows, row_bytes), dtype=np.uint8)
        with open(t.path, "rb") as src:
            src.seek(t.offset)
            if src.readinto(raw.data) != raw.nbytes:
                raise ModelFormatError(f"truncated GGUF file {t.path}: tensor {t.gguf_name} ends past the end of it")
        rows = _unpermute(raw, t.heads) if t.heads is not None else raw
        return torch.from_numpy(np.ascontiguousarray(rows))

    def get(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as a new CPU tensor in the storage dtype."""
        t = self._tensor(name)
        out = torch.empty(t.rows * t.cols, dtype=self.dtype)
        at = 0
        with open(t.path, "rb") as src:
            for chunk in _tensor_chunks(src, t, self.dtype):
                out[at : at + chunk.numel()] = chunk
                at += chunk.numel()
        return out.reshape(t.shape)


# ---------------------------------------------------------------------------------------------- display


class _Display:
    """The conversion's steps on stderr: a spinner line per stage with its elapsed time, then a bar over the
    tensors written (count and time left). Every stage is logged as well."""

    def __init__(self, bars) -> None:
        self.bars = bars
        self.task: int | None = None  # the rich task of the current stage
        self.total = 1  # its length: 1 for a stage, the tensor count for the bar

    def stage(self, text: str) -> None:
        logger.info("convert: %s", text)
        self.finish()
        self.task, self.total = self.bars.add_task(text, total=None, bar=False), 1

    def tensors(self, count: int) -> Callable[[str], None]:
        """Turn the current stage into a bar over ``count`` tensors; return ``advance(hf_name)``."""
        task, self.total = self.task, count
        self.bars.update(task, total=count, completed=0, bar=True)
        return lambda name: self.bars.update(task, advance=1)

    def finish(self) -> None:
        if self.task is not None:
            self.bars.update(self.task, total=self.total, completed=self.total)


@contextlib.contextmanager
def _display(progress: bool) -> Iterator[_Display]:
    """A :class:`_Display`; with ``progress`` false nothing is shown (the stages are still logged)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    class BarOnly(ProgressColumn):
        """``column``, shown only for the task with the field ``bar`` set (the tensors), blank for the stages."""

        def __init__(self, column: ProgressColumn) -> None:
            super().__init__()
            self.column = column

        def render(self, task):
            return self.column.render(task) if task.fields.get("bar") else Text("")

    bars = Progress(
        SpinnerColumn(finished_text="[green]done[/]"),
        TextColumn("converting: {task.description}"),
        BarOnly(BarColumn()),
        BarOnly(MofNCompleteColumn()),
        TimeElapsedColumn(),
        BarOnly(TimeRemainingColumn()),
        console=Console(stderr=True),
        disable=not progress,
        transient=False,
    )
    with bars:
        show = _Display(bars)
        yield show
        show.finish()


# ---------------------------------------------------------------------------------------------- directory


def _check_layout(model_dir: Path) -> None:
    """Fail loudly (a bug, not a user error) if the saved directory misses config, weights or tokenizer."""
    missing = []
    if not (model_dir / "config.json").is_file():
        missing.append("config.json")
    if not any(model_dir.glob("*.safetensors")):
        missing.append("*.safetensors")
    if not any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
        missing.append("tokenizer files")
    if missing:
        raise RuntimeError(f"conversion wrote an incomplete directory {model_dir}: missing {', '.join(missing)}")


def _make_readable(model_dir: Path) -> None:
    """Give every file the usual umask permissions."""
    umask = os.umask(0)
    os.umask(umask)
    for path in model_dir.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)
    model_dir.chmod(0o777 & ~umask)


def _write_marker(model_dir: Path, gguf_path: Path, dtype: torch.dtype) -> None:
    """Write the completion marker (last file of the conversion) with a little provenance."""
    import transformers

    info = {"source_gguf": gguf_path.name, "dtype": _dtype_name(dtype), "transformers": transformers.__version__}
    (model_dir / COMPLETE_MARKER).write_text(json.dumps(info, indent=2) + "\n")


def _remove_abandoned(out_dir: Path) -> None:
    """Delete temporary and old siblings of ``out_dir`` left by conversions whose process died (killed, power
    lost): ``.<name>.tmp-<pid>`` / ``.<name>.old-<pid>`` whose pid runs no more. A conversion running
    concurrently keeps its own."""
    for path in out_dir.parent.glob(f".{glob.escape(out_dir.name)}.*-*"):
        kind, _, pid = path.name.removeprefix(f".{out_dir.name}.").partition("-")
        if kind not in ("tmp", "old") or not pid.isdigit() or _alive(int(pid)):
            continue
        logger.info("removing %s, left by an interrupted conversion", path)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    """True if a process ``pid`` exists (or may: one of another user's)."""
    if pid == os.getpid():
        return False  # a previous conversion of this process, interrupted
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _move_into_place(tmp_dir: Path, out_dir: Path) -> None:
    """Atomically rename ``tmp_dir`` to ``out_dir``, replacing (then deleting) any previous ``out_dir``."""
    old_dir = None
    if out_dir.exists() or out_dir.is_symlink():
        old_dir = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
        os.replace(out_dir, old_dir)
    os.replace(tmp_dir, out_dir)
    if old_dir is not None:
        if old_dir.is_dir() and not old_dir.is_symlink():
            shutil.rmtree(old_dir, ignore_errors=True)
        else:
            old_dir.unlink()


def _dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``."""
    return str(dtype).removeprefix("torch.")
