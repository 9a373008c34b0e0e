"""All checkpoint and tokenizer I/O: HF-format directories (safetensors only), GGUF files, tokenizers.

Weights are read only from safetensors (or GGUF, converted once to safetensors); pickle checkpoints
(``.bin``/``.pt``/``.pth``) are refused, never unpickled. q/k/v and gate/up projections are fused at load time
into ``wqkv`` and ``w13`` (see :mod:`specexec.model.transformer` for the per-layer names).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specexec.errors import ConfigError, SpecexecError, setting
from specexec.formats import nf4
from specexec.formats.int8 import Int8Linear
from specexec.formats.subset import SubsetHead
from specexec.model.transformer import Globals, ModelConfig, ResidentLayers, Transformer

log = logging.getLogger(__name__)


class _BnbKernelsHint(logging.Filter):
    """Turns bitsandbytes' import-time warning "Failed to load CPU gemm_4bit_forward from kernels-community ...
    `pip install kernels`" (CPUs with AVX512-BF16) into one debug line. Why: NF4 on a CPU here dequantizes each
    weight and runs the dense linear (:class:`specexec.formats.nf4.NF4Linear`); bitsandbytes' fused CPU GEMM that
    `kernels` would fetch (from the Hugging Face hub, at import) is never called, so the hint is noise and
    installing it buys nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "kernels-community" in record.getMessage():
            log.debug(
                "bitsandbytes' optional fused CPU kernel is unavailable (%s); not used: NF4 on a CPU "
                "dequantizes and runs the dense linear",
                record.getMessage()[:160],
            )
            return False
        return True


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_BnbKernelsHint())

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
QUANTIZED = ("int8", "nf4")  # draft weight formats besides "dense"
DRAFT_DTYPES = ("auto", *DTYPES, *QUANTIZED, "q4")  # what a draft accepts
SELF_DRAFT = "self"  # draft="self": the target's own checkpoint loaded in low bit as its draft (SubSpec-style)
DEFAULT_DRAFT_VOCAB = 32768  # reduced draft vocabulary size when one is asked for without a size


def parse_dtype(name: str, device: torch.device) -> torch.dtype:
    """Static resolution (no measuring): 'auto' → bf16 on CUDA (fp16 if bf16 is unsupported), fp32 on CPU;
    else fp32/bf16/fp16; 'int8' → fp32 (the int8 draft computes activations in fp32).

    Memory estimates use this (fp32 is the larger CPU choice); loading uses :func:`resolve_dtype`, which
    measures on a CPU.
    """
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if name == "int8":
        return torch.float32
    if name not in DTYPES:
        raise SpecexecError(
            f"unknown dtype {name!r}; choose one of auto, fp32, bf16, fp16 (a draft also {', '.join(QUANTIZED)})"
        )
    return DTYPES[name]


def resolve_dtype(name: str, device: torch.device, cfg: ModelConfig) -> torch.dtype:
    """The compute dtype to load ``cfg``'s model in. 'auto' on a CPU: fp32 or bf16, whichever this machine runs
    faster for multi-row passes (:mod:`specexec.loading.cpu_probe`, measured once per machine and cached)."""
    if name == "int8":
        raise SpecexecError("int8 is a draft-only format (--draft-dtype int8); the target's dtype sets the output")
    if device.type == "cpu":
        from specexec.loading import cpu_probe

        dtype = cpu_probe.choose_dtype(cfg) if name == "auto" else parse_dtype(name, device)
        cpu_probe.orientation(cfg, dtype)  # which matmul kernel each row count uses (measured once, cached)
        return dtype
    return parse_dtype(name, device)


def resolve_draft(name: str, device: torch.device, cfg: ModelConfig) -> tuple[torch.dtype, bool]:
    """(compute dtype, int8 weights) for a dense or int8 draft dtype name; :func:`draft_format` covers nf4 too."""
    dt, fmt = draft_format(name, name if name in DTYPES else "auto", device, cfg)
    if fmt not in ("dense", "int8"):
        raise SpecexecError(f"{fmt} is not an int8-or-dense draft format (see draft_format)")
    return dt, fmt == "int8"


def check_self_draft_dtype(name: str | None) -> None:
    """A self-derived draft is the target in low bit: only auto (None) and the low-bit formats are accepted."""
    if name not in (None, "auto", *QUANTIZED):
        raise ConfigError(
            "draft_dtype",
            name,
            "a self-derived draft is the target in low bit",
            f"{setting('draft', SELF_DRAFT)} is the target's own weights in low bit: "
            f"{setting('draft_dtype')} must be auto, {', '.join(QUANTIZED[:-1])} or {QUANTIZED[-1]}, not {name}",
        )


def draft_format(
    name: str | None, dtype: str, device: torch.device, cfg: ModelConfig, self_draft: bool = False
) -> tuple[torch.dtype, str]:
    """(compute dtype, weight format: dense | int8 | nf4 | q4) of a draft.

    ``name`` is the draft dtype (``--draft-dtype``; None: the target's ``dtype``, or ``auto`` for a self-derived
    draft; ``auto`` on a CPU: dense, int8 or q4, whichever this machine runs clearly fastest, measured once).
    Low-bit formats keep activations, norms and the KV cache in the compute dtype: fp32 on a CPU (int8: fbgemm's
    int8 GEMM; q4: the package's 4-bit kernel, :mod:`specexec.formats.q4`; nf4: dequantized per pass, correct
    but slow), the target's 16-bit ``dtype`` on
    CUDA (bitsandbytes: ``matmul_4bit`` for nf4, LLM.int8's GEMM for int8). A self-derived draft (``self_draft``)
    is always low-bit: ``auto`` picks int8 on a CPU, nf4 on CUDA; a dense name is refused (it would be the target
    itself, at the target's cost).
    """
    if self_draft:
        check_self_draft_dtype(name)
        if name in (None, "auto"):
            name = "nf4" if device.type == "cuda" else "int8"
    name = name or dtype
    if name == "auto" and device.type == "cpu" and not self_draft:
        from specexec.loading import cpu_probe

        dt, fmt = cpu_probe.choose_draft(cfg)  # low-bit weights where this CPU runs them clearly faster (measured)
        if fmt == "dense":
            cpu_probe.orientation(cfg, dt)
        return dt, fmt
    if name == "q4":
        if device.type != "cpu":
            raise ConfigError("draft_dtype", name, "is a CPU format; on a GPU use nf4 or int8")
        from specexec.formats import q4

        why = q4.available()
        if why is not None:
            raise ConfigError("draft_dtype", name, f"cannot run here: {why}")
        return torch.float32, "q4"
    if name in QUANTIZED:
        if device.type == "cuda":
            return parse_dtype(dtype if dtype in ("bf16", "fp16") else "auto", device), name
        return torch.float32, name
    return resolve_dtype(name, device, cfg), "dense"


def draft_vocab_ids(tokenizer: TokenizerInfo, vocab_size: int, k: int = DEFAULT_DRAFT_VOCAB) -> Tensor:
    """A data-free frequency-ranked draft vocabulary (FR-Spec, arXiv 2502.14856): ids [0, k) -- in a byte-level
    BPE lower ids are earlier merges, i.e. more frequent -- plus every special / added / EOS id. The prompt's
    and generated tokens join at run time (:meth:`specexec.formats.subset.SubsetHead.observe`)."""
    if k < 1:
        raise SpecexecError(f"draft vocabulary size must be >= 1, got {k}")
    tok = tokenizer.tokenizer
    extra = set(tokenizer.eos_ids) | set(getattr(tok, "all_special_ids", []) or [])
    extra |= set(int(i) for i in (getattr(tok, "added_tokens_decoder", None) or {}))
    ids = torch.cat([torch.arange(min(k, vocab_size)), torch.tensor(sorted(extra), dtype=torch.long)])
    return torch.unique(ids[(ids >= 0) & (ids < vocab_size)])


def parse_device(name: str) -> torch.device:
    """'auto' → cuda if available else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise ConfigError("device", name, "must be auto, cpu or cuda")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SpecexecError(
            f"{setting('device', 'cuda')} was asked for but no CUDA GPU is available (use {setting('device', 'cpu')})"
        )
    return torch.device(name)


def model_dir(path: Path, home: Path | None = None, layers_in_gguf: bool = False) -> Path:
    """Validate a model location and return an HF-format directory. A GGUF (a .gguf file, any part of a split one,
    or a folder holding one GGUF or the parts of one split GGUF) is converted once into the cache root ``home``
    (default: :func:`specexec.home.cache_home`), where `specexec models pull FILE.gguf` converts it.

    ``layers_in_gguf`` (a target quantized to NF4 from its layers): a GGUF is converted without its layers, which
    :func:`iter_layers` then reads from the GGUF itself (no 16-bit copy of the model on disk)."""
    if not path.exists():
        raise SpecexecError(f"model path not found: {path}")
    if path.is_file():
        if path.suffix == ".gguf":
            return _converted_gguf(path, home, layers_in_gguf)
        if path.suffix in PICKLE_SUFFIXES:
            raise SpecexecError(_pickle_refusal(path))
        if path.suffix == ".safetensors":
            path = path.parent
        else:
            raise SpecexecError(f"not a model file: {path} (expected a directory, .safetensors or .gguf)")
    if not (path / "config.json").is_file():
        gguf = _folder_gguf(path)
        if gguf is not None:
            return _converted_gguf(gguf, home, layers_in_gguf)
        raise SpecexecError(f"no config.json in {path}: not an HF-format model directory")
    if not list(path.glob("*.safetensors")):
        pickles = [p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES]
        if pickles:
            raise SpecexecError(_pickle_refusal(pickles[0]))
        raise SpecexecError(f"no .safetensors weights in {path}")
    return path


def _folder_gguf(path: Path) -> Path | None:
    """The GGUF a folder holds: its only .gguf file, or the first part when its .gguf files are exactly the parts
    of one split GGUF (``name-0000i-of-0000N.gguf``, all present); None otherwise."""
    from specexec.errors import ModelFormatError
    from specexec.loading import convert

    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if not ggufs:
        return None
    try:
        parts = convert.split_parts(ggufs[0])
    except ModelFormatError:
        return None
    return parts[0] if sorted(parts) == ggufs else None


def _pickle_refusal(path: Path) -> str:
    return (
        f"refusing to load pickle checkpoint {path}: unpickling can run arbitrary code; "
        "convert it to safetensors first (e.g. transformers' save_pretrained(safe_serialization=True))"
    )


def _converted_gguf(path: Path, home: Path | None, layers_in_gguf: bool) -> Path:
    """The converted directory of the GGUF ``path`` (any part of a split one) under the cache root ``home``,
    converted now if missing: :func:`specexec.loading.hub.pull_gguf`, as `specexec models pull` does."""
    from specexec.loading import hub

    return hub.pull_gguf(path.absolute(), home=home, layers_in_gguf=layers_in_gguf)


def read_config(path: Path) -> ModelConfig:
    try:
        raw = json.loads((path / "config.json").read_text())
        return ModelConfig.from_hf(raw)
    except (json.JSONDecodeError, KeyError) as e:
        raise SpecexecError(f"bad config.json in {path}: {e}") from None
    except ValueError as e:
        raise SpecexecError(f"{path}: {e}") from None


# safetensors dtype names -> torch dtypes (the formats a checkpoint's weights come in)
_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _read_header(f: Path) -> tuple[int, dict[str, Any]]:
    """(data start offset, header) of one safetensors file; checks that the data offsets match the file size."""
    size = f.stat().st_size
    try:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if n <= 0 or n > size - 8:
                raise ValueError("header length out of range")
            header = json.loads(fh.read(n))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, OSError, KeyError, TypeError, IndexError) as e:
        raise SpecexecError(f"corrupt safetensors file {f}: {e}") from None
    if 8 + n + end != size:
        raise SpecexecError(f"corrupt or truncated safetensors file {f}: expected {8 + n + end} bytes, found {size}")
    header.pop("__metadata__", None)
    return 8 + n, header


class _Shards:
    """Name → tensor reads over a (possibly sharded) safetensors checkpoint, one tensor at a time.

    Each tensor is read with plain file reads into a fresh buffer of its own, never through a memory map: pages of
    a mapped file that a load touches count in the process's RSS while the map lives, which puts ~2.5 GB on top of
    the loaded weights of the demo pair (the test suite must peak below 8 GB). The page cache still holds the file,
    but that is not this process's memory.
    """

    def __init__(self, path: Path) -> None:
        from specexec.loading import convert

        self.path = path
        # a conversion without its layers reads them, its embedding and lm_head from its GGUF
        self.gguf = convert.GgufLayers(path) if convert.layers_in_gguf(path) else None
        self.where: dict[str, tuple[Path, int, dict[str, Any]]] = {}
        for f in sorted(path.glob("*.safetensors")):
            base, header = _read_header(f)
            for name, info in header.items():
                self.where[name] = (f, base, info)
        # a multimodal checkpoint (Gemma 3 4B+) holds its text decoder under a prefix of its own
        for prefix in ("model.language_model.", "language_model.model."):
            if prefix + "embed_tokens.weight" in self.where:
                for name in [n for n in self.where if n.startswith(prefix)]:
                    self.where["model." + name[len(prefix) :]] = self.where.pop(name)
                if "language_model.lm_head.weight" in self.where:
                    self.where["lm_head.weight"] = self.where.pop("language_model.lm_head.weight")

    def get(self, name: str) -> Tensor:
        """``name`` as a new CPU tensor in its stored dtype, in the allocator's (64-byte aligned) memory."""
        entry = self.where.get(name)
        if entry is None and self.gguf is not None and self.gguf.has(name):
            return self.gguf.get(name)
        if entry is None:
            raise SpecexecError(f"{self.path}: tensor {name!r} missing from the checkpoint")
        f, base, info = entry
        try:
            dtype = _ST_DTYPES[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            lo, hi = (int(o) for o in info["data_offsets"])
            count = 1
            for d in shape:
                count *= d
            if hi - lo != count * dtype.itemsize or lo < 0:
                raise ValueError(f"{name}: {hi - lo} bytes for shape {shape} of {info['dtype']}")
            buf = torch.empty(hi - lo, dtype=torch.uint8)
            with open(f, "rb") as fh:
                fh.seek(base + lo)
                got = fh.readinto(buf.numpy().data)
            if got != hi - lo:
                raise ValueError(f"{name}: read {got} of {hi - lo} bytes")
        except (KeyError, ValueError, TypeError, OSError) as e:
            raise SpecexecError(f"corrupt or truncated safetensors file {f}: {e}") from None
        return buf.view(dtype).reshape(shape)

    def has(self, name: str) -> bool:
        return name in self.where or (self.gguf is not None and self.gguf.has(name))


def _check_sizes(path: Path) -> None:
    """Catch truncated files early: the header's data offsets must match the file size."""
    for f in sorted(path.glob("*.safetensors")):
        _read_header(f)


def _owned(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` (a fresh tensor from :meth:`_Shards.get`) in ``dtype``: ``t`` itself when it already is, else one
    converted copy -- never a second copy of the same bytes.

    Weights must live in the allocator's 64-byte aligned memory, never as views into a memory-mapped file
    (safetensors' own zero-copy reads sit at offsets aligned to only 4-8 bytes): MKL's GEMM takes different code
    paths (and so sums in a different order) for differently aligned operands, so such views compute ~1e-6
    differently from the same weights elsewhere -- e.g. the offload manager's packed layers, which must give
    bit-identical logits. :meth:`_Shards.get` reads into such memory, and so does a dtype conversion.
    """
    return t if t.dtype == dtype else t.to(dtype)


def iter_layers(
    path: Path, cfg: ModelConfig, dtype: torch.dtype, q4: bool = False
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (i, layer weights on CPU in ``dtype``) one layer at a time, q/k/v and gate/up fused (Phi-3 stores
    them fused); every tensor is its own aligned copy (see :func:`_owned`).

    A GGUF conversion made with ``layers_in_gguf`` gives its layers from the GGUF
    (:class:`specexec.loading.convert.GgufLayers`): the same values, in the same storage dtype, as a full
    conversion's safetensors.

    ``q4``: the four linears (:data:`INT8_KEYS`) come as CPU block weights, the rest as above. Where the checkpoint
    is a GGUF conversion that still finds its GGUF (:func:`specexec.loading.convert.gguf_blocks`), a part stored
    there as Q4_K or Q6_K is the file's own blocks (:func:`_q4_linear`: its values are the GGUF's, not rounded
    through the fp16 copy and quantized again); every other part is quantized to 4 bits from its stored values. A
    fused weight's parts are quantized row by row, so a part's rows are the same whether alone or fused."""
    from specexec.loading import convert

    shards = _Shards(path)
    blocks = convert.gguf_blocks(path) if q4 else None
    taken = [0, 0]  # linear tensors taken from the GGUF's blocks, and all of them
    gemma = cfg.sandwich_norm
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        g = lambda n: shards.get(p + n).to(dtype)  # noqa: E731  (only into torch.cat, which copies)
        o = lambda n: _owned(shards.get(p + n), dtype)  # noqa: E731

        def linear(*names: str) -> Any:
            """The linear weight made of the tensors ``names`` (rows one after another)."""
            if q4:
                return _q4_linear(shards, blocks, [p + n for n in names], taken)
            return o(names[0]) if len(names) == 1 else torch.cat([g(n) for n in names])

        fused = shards.has(p + "self_attn.qkv_proj.weight")
        w = {
            "attn_norm": o("input_layernorm.weight"),
            "wqkv": linear("self_attn.qkv_proj.weight") if fused else linear(
                "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"
            ),
            "wo": linear("self_attn.o_proj.weight"),
            # Gemma's post_attention_layernorm normalizes the attention's output; its MLP norm is pre_feedforward
            "mlp_norm": o("pre_feedforward_layernorm.weight" if gemma else "post_attention_layernorm.weight"),
            "w13": linear("mlp.gate_up_proj.weight") if shards.has(p + "mlp.gate_up_proj.weight") else linear(
                "mlp.gate_proj.weight", "mlp.up_proj.weight"
            ),
            "w2": linear("mlp.down_proj.weight"),
        }  # fmt: skip
        if cfg.qkv_bias:
            w["bqkv"] = torch.cat([g("self_attn.q_proj.bias"), g("self_attn.k_proj.bias"), g("self_attn.v_proj.bias")])
        if cfg.qk_norm:
            w["q_norm"], w["k_norm"] = o("self_attn.q_norm.weight"), o("self_attn.k_norm.weight")
        if gemma:
            w["post_attn_norm"] = o("post_attention_layernorm.weight")
            w["post_mlp_norm"] = o("post_feedforward_layernorm.weight")
        yield i, w
    if blocks is not None:
        log.info("block layers: %d of %d linear tensors are the GGUF's own Q4_K / Q6_K blocks", *taken)


def _q4_linear(shards: Any, blocks: Any, names: list[str], taken: list[int]) -> Any:
    """The CPU block weight of the tensors ``names``' rows one after another: a tensor the GGUF (``blocks``, a
    :class:`~specexec.loading.convert.GgufLayers`, or None) stores as Q4_K is its blocks repacked losslessly, one
    stored as Q6_K its blocks as they are (:class:`~specexec.formats.blocks.Q6KLinear`); any other is quantized
    from its stored values to 4 bits (in fp32, as :func:`quantize_weight`). Parts of different types make a
    :class:`~specexec.formats.blocks.Fused` weight. ``taken``: [tensors taken from blocks, tensors] counted up."""
    from specexec.formats import blocks as fb
    from specexec.formats import q4

    parts: list[Any] = []
    for name in names:
        qtype = blocks.qtype(name) if blocks is not None and blocks.has(name) else None
        if qtype in ("Q4_K", "Q6_K"):
            part = _file_blocks(blocks, name, qtype)
            taken[0] += 1
        else:
            w = shards.get(name)
            part = q4.Q4Linear(w.float())
            del w
        parts.append(part)
        taken[1] += 1
    cols = {p.shape[1] for p in parts}
    if len(cols) != 1:
        raise SpecexecError(f"{', '.join(names)}: rows of different widths {sorted(cols)} cannot be one weight")
    return fb.join(parts)


def _file_blocks(blocks: Any, name: str, qtype: str) -> Any:
    """Tensor ``name`` of the GGUF as a CPU block weight of its own blocks (``qtype``: Q4_K or Q6_K)."""
    from specexec.formats import blocks as fb
    from specexec.formats import q4

    k = blocks.tensors[name].cols
    raw = blocks.blocks(name)
    if qtype == "Q4_K":
        return q4.Q4Linear.from_blocks(q4.from_q4_k(raw, k), (int(raw.shape[0]), k))
    return fb.Q6KLinear(raw, (int(raw.shape[0]), k))


def read_globals(path: Path, cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Tensor]:
    """embed, norm and lm_head on CPU (lm_head is embed when tied or absent), each its own aligned copy.

    An untied embedding stored in 16 bits stays in its stored dtype under an fp32 model: a lookup upcasts the rows
    it reads (``Transformer.forward``), which is bit-identical to upcasting the table (every bf16/fp16 value is
    exact in fp32) and saves half the table (0.47 GB on the demo target)."""
    shards = _Shards(path)
    raw = shards.get("model.embed_tokens.weight")
    tied = cfg.tie_word_embeddings or not shards.has("lm_head.weight")
    keep = not tied and dtype == torch.float32 and raw.dtype in (torch.bfloat16, torch.float16)
    embed = raw if keep else _owned(raw, dtype)
    del raw
    if tied:
        lm = embed  # a tied checkpoint's stored lm_head copy is not loaded
    else:
        lm = _owned(shards.get("lm_head.weight"), dtype)
    return {"embed": embed, "norm": _owned(shards.get("model.norm.weight"), dtype), "lm_head": lm}


INT8_KEYS = ("wqkv", "wo", "w13", "w2")  # the per-layer linears a low-bit model quantizes


def quantize_weight(
    w: Tensor, fmt: str, device: torch.device, dtype: torch.dtype, int8_kernel: str | None = None
) -> Any:
    """A linear weight (out, in) as a low-bit weight on ``device`` computing in ``dtype``: int8
    (:class:`~specexec.formats.int8.Int8Linear`, quantized on the CPU from fp32; ``int8_kernel``: its kernel, None
    for the device's default) or NF4 (:class:`specexec.formats.nf4.NF4Linear`, quantized by bitsandbytes on
    ``device`` from ``dtype``)."""
    if fmt == "int8":
        return Int8Linear(w.float(), kernel=int8_kernel).to(device)
    if fmt == "q4":
        from specexec.formats.q4 import Q4Linear

        return Q4Linear(w.float())
    if fmt != "nf4":
        raise ValueError(f"unknown low-bit weight format {fmt!r}")
    from specexec.model.sizes import NF4_BLOCKSIZE

    packed, absmax = nf4.quantize_nf4(w.to(device=device, dtype=dtype), NF4_BLOCKSIZE)
    return nf4.NF4Linear(packed, absmax, tuple(w.shape), dtype, NF4_BLOCKSIZE, nf4.nf4_code(device))


def _low_bit_globals(
    path: Path, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, fmt: str, int8_kernel: str | None = None
) -> Globals:
    """embed, norm, lm_head for a low-bit model, read and quantized one matrix at a time. The lm_head is int8 or
    NF4; the embedding stays dense in ``dtype`` (lookups read rows of it), except a tied int8 one, which is the
    int8 lm_head itself (lookups dequantize rows)."""
    shards = _Shards(path)
    tied = cfg.tie_word_embeddings or not shards.has("lm_head.weight")
    read = dtype if fmt == "nf4" else torch.float32
    if fmt == "q4":
        found = _global_blocks(path, tied)
        if found is not None:
            return Globals(embed=found[0], norm=_owned(shards.get("model.norm.weight"), dtype), lm_head=found[1])
    embed_w = shards.get("model.embed_tokens.weight")
    embed: Any
    if fmt in ("int8", "q4") and tied:
        embed = lm = quantize_weight(embed_w, fmt, device, dtype, int8_kernel)
    elif fmt in ("int8", "q4"):
        lm = quantize_weight(shards.get("lm_head.weight"), fmt, device, dtype, int8_kernel)
        # a 16-bit table stays 16-bit under fp32: a lookup upcasts the rows it reads (as read_globals)
        keep = dtype == torch.float32 and embed_w.dtype in (torch.bfloat16, torch.float16)
        embed = embed_w if keep else _owned(embed_w, dtype).to(device)
    else:
        lm = quantize_weight(embed_w if tied else shards.get("lm_head.weight").to(read), fmt, device, dtype)
        embed = _owned(embed_w, dtype).to(device)
    del embed_w
    return Globals(embed=embed, norm=_owned(shards.get("model.norm.weight"), dtype).to(device), lm_head=lm)


def _global_blocks(path: Path, tied: bool) -> tuple[Any, Any] | None:
    """(embedding, lm_head) of a CPU block model as the GGUF's own Q4_K / Q6_K blocks, where the conversion's GGUF
    is at hand and stores both so (a tied model's lm_head is its embedding); else None (they are quantized from the
    stored values). The embedding then stays in its blocks too: a lookup dequantizes the rows it reads."""
    from specexec.loading import convert

    blocks = convert.gguf_blocks(path)
    names = ["model.embed_tokens.weight"] if tied else ["model.embed_tokens.weight", "lm_head.weight"]
    if blocks is None or not all(blocks.has(n) and blocks.qtype(n) in ("Q4_K", "Q6_K") for n in names):
        return None
    embed = _file_blocks(blocks, names[0], blocks.qtype(names[0]))
    return embed, embed if tied else _file_blocks(blocks, names[1], blocks.qtype(names[1]))


def load_model(
    path: Path,
    device: torch.device,
    dtype: torch.dtype,
    layers: Any = None,
    int8: bool = False,
    head_ids: Tensor | None = None,
    nf4: bool = False,
    fmt: str | None = None,
    int8_kernel: str | None = None,
) -> Transformer:
    """Load an HF-format directory as a :class:`Transformer` with all layers resident on ``device``.

    ``layers`` may be a ready :class:`~specexec.model.transformer.LayerProvider` (e.g. the offload streamer); then
    only the
    globals are loaded here. ``int8`` (drafts): every linear and the lm_head (and a tied embedding) as
    :class:`~specexec.formats.int8.Int8Linear` (quantized layer by layer while loading; on CUDA its bitsandbytes
    kernel). ``nf4`` (drafts): every linear and the lm_head as bitsandbytes NF4
    (:class:`specexec.formats.nf4.NF4Linear`).
    ``fmt``: the weight format by name, dense | int8 | nf4 | q4 (a CPU target's 4-bit weights,
    :class:`~specexec.formats.q4.Q4Linear`; from a GGUF conversion whose GGUF is at hand, the layer tensors stored
    as Q4_K are the file's own blocks: :func:`iter_layers`); it replaces the two flags. An untied embedding stays
    dense. ``int8_kernel``: the int8 weights' kernel (a CPU target's: ``int8pack``, weight-only, computing in
    ``dtype``; None: the device's default, a draft's).
    Activations, norms, biases and the KV cache stay in ``dtype``.
    ``head_ids``: restrict the lm_head to these token ids (:class:`~specexec.formats.subset.SubsetHead`; drafts only:
    it changes the logits).
    """
    if int8 + nf4 + (fmt is not None) > 1:
        raise ValueError("int8, nf4 and fmt are exclusive ways to name the weight format")
    fmt = fmt or ("int8" if int8 else "nf4" if nf4 else "dense")
    if fmt not in ("dense", "q4", *QUANTIZED):
        raise ValueError(f"unknown weight format {fmt!r}")
    path = model_dir(path)
    cfg = read_config(path)
    _check_sizes(path)
    if fmt != "dense":
        glob = _low_bit_globals(path, cfg, device, dtype, fmt, int8_kernel)
    else:
        g = read_globals(path, cfg, dtype)
        embed = g["embed"].to(device)
        lm = embed if g["lm_head"] is g["embed"] else g["lm_head"].to(device)
        glob = Globals(embed=embed, norm=g["norm"].to(device), lm_head=lm)
        del g
    if head_ids is not None:
        if device.type != "cpu":
            raise SpecexecError("a reduced draft vocabulary is a CPU option (on a GPU the full lm_head is cheap)")
        if fmt == "nf4":
            raise SpecexecError("a reduced draft vocabulary needs a dense or int8 draft, not nf4")
        glob.lm_head = SubsetHead(glob.lm_head, head_ids.cpu(), cfg.vocab_size)
    if layers is None:
        loaded = []
        # a q4 model's linears come 4-bit already (from a GGUF's own Q4_K blocks where it has them)
        for _, w in iter_layers(path, cfg, dtype if fmt in ("dense", "nf4") else torch.float32, q4=fmt == "q4"):
            if fmt != "dense":
                loaded.append(
                    {
                        k: t
                        if not isinstance(t, Tensor)
                        else quantize_weight(t, fmt, device, dtype, int8_kernel)
                        if k in INT8_KEYS
                        else t.to(device, dtype)
                        for k, t in w.items()
                    }
                )
            else:
                loaded.append({k: t.to(device) for k, t in w.items()})
            del w
            release_freed_memory()  # per layer: the temporaries' pages must not pile up into the load's peak
        layers = ResidentLayers(loaded)
    model = Transformer(cfg=cfg, globals=glob, layers=layers, device=device, dtype=dtype)
    if fmt == "q4" and isinstance(layers, ResidentLayers):
        from specexec.formats.blocks import BLOCK_LINEARS, leaves
        from specexec.formats.q4 import gather

        found = [w for i in range(cfg.num_layers) for w in layers.layer(i).values() if isinstance(w, BLOCK_LINEARS)]
        gather(p for w in [*found, glob.lm_head, glob.embed] if isinstance(w, BLOCK_LINEARS) for p in leaves(w))
    release_freed_memory()
    return model


def release_freed_memory() -> None:
    """Hand the heap pages freed while loading back to the OS (glibc's ``malloc_trim``; a no-op elsewhere).

    Loading converts and fuses weights through temporaries (fp16 -> fp32 copies, q/k/v and gate/up before their
    ``torch.cat``); glibc keeps the freed pages of the smaller ones in its arenas, so without this a loaded fp32
    demo target (7.2 GB of tensors) holds 8.6 GB of RSS, and peaks there while loading. A few ms per call."""
    import ctypes
    import ctypes.util

    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim): nothing to release
        pass


@dataclass(frozen=True)
class TokenizerInfo:
    """A tokenizer plus the ids generation stops at."""

    tokenizer: Any
    eos_ids: frozenset[int]


def load_tokenizer(path: Path) -> TokenizerInfo:
    """The model's tokenizer (transformers) and its EOS ids (tokenizer + generation_config.json)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise SpecexecError(f"cannot load the tokenizer in {path}: {e}") from None
    eos: set[int] = set()
    if tok.eos_token_id is not None:
        eos.add(int(tok.eos_token_id))
    gen = path / "generation_config.json"
    if gen.is_file():
        val = json.loads(gen.read_text()).get("eos_token_id")
        if isinstance(val, int):
            eos.add(val)
        elif isinstance(val, list):
            eos.update(int(v) for v in val)
    return TokenizerInfo(tokenizer=tok, eos_ids=frozenset(eos))
