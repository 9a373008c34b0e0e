"""Which shape-invariant way to run a target's passes on this machine, found by checking, once.

A target pass is shape-invariant when every row's logits are bit-identical whatever pass computes them: a
one-token step, a tree of any size and shape (at any row), a prefill. Then greedy speculative decoding emits
exactly the tokens of plain greedy decoding in the same dtype, and a request gives the same text every time.

Matrix libraries choose kernels by shape (a one-row product is often a matrix-vector kernel; a few rows a different
micro-kernel; the rows past the last whole micro-tile an edge kernel), and kernels that block the reduction
differently round differently. Which row counts share a kernel differs between CPUs, libraries, builds and GPUs, so
nothing here is assumed: for the model's own layer and head shapes, in its dtype, on its device, :func:`choose`
tries row tiles (:class:`~specexec.formats.dense.Tiling`) from the smallest up and keeps the first tile under which
probe rows get the bits they get alone at every pass size and place it checks (1 row to ``max_rows``; up to
:data:`PROBES` different rows a pass): ``F.linear``'s when it has one, else ``w @ x.T``'s (on a CPU; that
orientation has passed random probe weights and then failed real ones, so it is never chosen for speed alone); then
the smallest row tile for the attention's products (fp32 whatever the model's dtype) under which a probe query
agrees across one-token, prefill and tree layouts. When nothing passes (no tiling makes this machine's kernels
agree), the target runs its fastest kernels and a warning says that greedy speculation may then differ from plain
decoding at near-ties.

Results are cached in ``<cache home>/invariance.json`` keyed by the device, torch version, thread count, dtype
and shapes, and kept for the process; models too small to matter (tests' tiny models) are checked once a process
(milliseconds) and not written to the cache.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specexec.formats.dense import Tiling, tiled_linear
from specexec.home import write_json
from specexec.model import tree_attn
from specexec.model.attention import blocked, plan_keys
from specexec.model.sizes import (  # noqa: F401  (GUARANTEE, unavailable_message: this module's public names too)
    CPU_MAX_ROWS,
    CUDA_MAX_ROWS,
    GUARANTEE,
    PROBES,
    check_bytes,
    head_shapes,
    unavailable_message,
)
from specexec.model.transformer import ModelConfig, Transformer
from specexec.model.tree_attn import tree_attention, tree_keys

log = logging.getLogger(__name__)

CACHE_FILE = "invariance.json"
CPU_TILES = (1, 2, 4, 8, 16, 32)
CUDA_TILES = (16, 64, 128)
KEY_BLOCK = 64  # positions per attention block (see specexec.model.attention.blocked)
MULTIPLES = (1, 2, 3, 5, 8, 16, 33, 64)  # pass sizes checked, in tiles (and 1 row, and max_rows)
MIN_CACHED_PARAMS = 1 << 20  # smaller models are checked every time, not cached


@dataclass(frozen=True)
class Choice:
    """The tiling a target runs with on this machine (None: no tiling gives invariance here)."""

    key: str
    tiling: dict[str, Any] | None
    ms: dict[str, float] = field(default_factory=dict)  # candidate -> ms of a one-token + a tree pass
    seconds: float = 0.0
    note: str = ""

    def get(self) -> Tiling | None:
        return Tiling(**self.tiling) if self.tiling is not None else None


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from specexec.loading.cpu_probe import cpu_name

    return cpu_name()


def _sizes(tiling: Tiling) -> list[int]:
    sizes = {1, tiling.max_rows} | {tiling.rows * m for m in MULTIPLES}
    return sorted(s for s in sizes if s <= tiling.max_rows)


def linear_invariant(
    shapes: list[tuple[int, int]],
    dtype: torch.dtype,
    device: torch.device,
    tiling: Tiling,
    weight: Callable[[Tensor], Any] = lambda w: w,
) -> bool:
    """Does every checked pass size give each probe row, wherever it sits in the pass, the bits it gets alone?
    ``weight``: wraps each random weight (a quantized format's object, or a test's kernel).

    Kernels that sum a dot product in another order give another fp32 sum, but a 16-bit output differs only
    where that sum lands near a rounding boundary: one element in hundreds. So a pass holds up to :data:`PROBES`
    different probe rows, spread over it (first, last and between), each checked against its own one-row result:
    one probe row of a narrow layer can agree by chance (a 320-wide product in bf16 differed in one element of
    one row of 40, on a CPU without bf16 instructions)."""
    gen = torch.Generator().manual_seed(0)
    for out_f, in_f in shapes:
        w = weight((torch.rand(out_f, in_f, generator=gen) - 0.5).mul_(2 / in_f**0.5).to(device, dtype))
        x = torch.randn(tiling.max_rows, in_f, generator=gen).to(device, dtype)
        probes = torch.randn(PROBES, in_f, generator=gen).to(device, dtype)
        refs = [tiled_linear(p[None], w, tiling)[0] for p in probes]
        for n in _sizes(tiling):
            rows = x[:n].clone()
            k = min(n, PROBES)
            at = [0] if k == 1 else sorted({round(j * (n - 1) / (k - 1)) for j in range(k)})
            rows[at] = probes[: len(at)]
            y = tiled_linear(rows, w, tiling)
            if any(not torch.equal(y[i], refs[j]) for j, i in enumerate(at)):
                return False
        del w, x
    return True


def memory_note(cfg: ModelConfig, dtype: torch.dtype, free_bytes: int) -> str | None:
    """Why the check cannot run with ``free_bytes`` of device memory free (None: it fits, see :func:`check_bytes`)."""
    need = check_bytes(cfg, dtype)
    if need <= free_bytes:
        return None
    return (
        f"not enough free GPU memory for the load-time invariance check: it needs {need / 1e9:.2f} GB, "
        f"{free_bytes / 1e9:.2f} GB is free"
    )


def _free_bytes(device: torch.device) -> int:
    """Device memory a new allocation can take: the driver's free bytes and torch's cached, unused blocks."""
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(torch.cuda.mem_get_info(device)[0]) + int(cached)


def _layouts(p: int, gen: torch.Generator) -> list[tuple[int, int, list[int]]]:
    """Ways a pass can hold a row at position ``p``: (committed prefix n0, rows T, the row's visible slots, one per
    position 0..p in increasing order; its own slot last). A one-token step, prefills, and tree rows whose
    ancestors sit at scattered slots."""
    out = [(p, 1, list(range(p + 1)))]
    for n0 in sorted({max(0, p - 2), max(0, p - 9), max(0, p - 40)}):
        out.append((n0, p - n0 + 3, list(range(p + 1))))  # prefill or chain: contiguous

        depth = p - n0  # tree: the row sits deeper in the pass than its depth, ancestors spread out
        T = depth + 1 + int(torch.randint(1, 30, (1,), generator=gen))
        if depth:
            anc = sorted(torch.randperm(T - 2, generator=gen)[: depth - 1].add(1).tolist())
            out.append((n0, T, [*range(n0), n0, *[n0 + a for a in anc], n0 + T - 1]))
        else:
            out.append((n0, T, [*range(n0), n0]))
    return out


def attention_invariant(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, tiling: Tiling) -> bool:
    """Does a probe query get the same attention output at the same position in every layout of pass (one-token
    step, prefill, tree rows with scattered ancestors; other rows random)? With the model's score scale and
    soft-capping, and for a sliding-window model with a window short enough to cut blocks."""
    windows: list[int | None] = [None]
    if cfg.sliding_window is not None:
        windows.append(min(cfg.sliding_window, 2 * tiling.key_block - 3))
    return all(_attention_agrees(cfg, dtype, device, tiling, w) for w in windows)


def _attention_agrees(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device, tiling: Tiling, window: int | None
) -> bool:
    gen = torch.Generator().manual_seed(1)
    H, KVH, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    B = tiling.key_block
    for p in (5, B + 3, 3 * B + 7):
        kpos = torch.randn(KVH, p + 1, hd, generator=gen).to(dtype)
        vpos = torch.randn(KVH, p + 1, hd, generator=gen).to(dtype)
        probe = torch.randn(H, hd, generator=gen).to(dtype)
        ref: Tensor | None = None
        for n0, T, seen in _layouts(p, gen):
            T = min(T, tiling.max_rows)
            L = n0 + T
            at = seen[-1] - n0  # the probe's row in the pass
            if at >= T:
                continue
            keys = torch.randn(KVH, L, hd, generator=gen).to(dtype)
            values = torch.randn(KVH, L, hd, generator=gen).to(dtype)
            keys[:, seen], values[:, seen] = kpos, vpos
            pos = torch.arange(n0, n0 + T)
            mask = torch.arange(L)[None, :] <= pos[:, None]  # other rows: a causal prefill around it
            mask[at] = False
            mask[at, seen] = True
            pos[at] = p
            # other rows must see one slot per position as well: keep them causal up to their own slot
            q = torch.randn(T, H, hd, generator=gen).to(dtype)
            q[at] = probe
            P = tiling.pad(T)
            qp = torch.cat((q, q.new_zeros(P - T, H, hd))).to(device)
            if tree_attn.ready(device):  # the kernel the model's invariant passes run there (see Transformer)
                rows = tree_keys(mask.to(device), pos.to(device), P, window)
                try:
                    out = tree_attention(qp, keys.to(device), values.to(device), rows, cfg.attn_scale,
                                         cfg.attn_softcap)  # fmt: skip
                except Exception as e:  # a kernel that does not compile or run here: the check fails, said so
                    log.warning("the Triton tree attention failed on %s: %s: %s", device, type(e).__name__, e)
                    return False
            else:
                plan = plan_keys(mask.to(device), pos.to(device), P, B, tiling.attn_rows, window)
                out = blocked(qp, keys.to(device), values.to(device), plan, cfg.attn_scale, cfg.attn_softcap)
            out = out[at].cpu()
            if ref is None:
                ref = out
            elif not torch.equal(out, ref):
                return False
    return True


def _rows(tile: int, device: torch.device, cfg: ModelConfig | None = None) -> int:
    """Rows a pass is padded to a multiple of: the tile, and on a CPU enough rows that elementwise kernels split
    every tensor between threads at whole vectors (a thread's ragged remainder would run a scalar routine that may
    round differently from the vector one). Rows whose widths are all multiples of 64 * threads need nothing
    more; otherwise a multiple of the thread count does it."""
    if device.type != "cpu":
        return tile
    threads = torch.get_num_threads()
    widths = [] if cfg is None else [w for s in head_shapes(cfg)[:4] for w in s]
    if cfg is not None:
        widths.append((cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim)  # RoPE's rows
    if widths and all(w % 64 == 0 for w in widths):
        g = math.gcd(*(w // 64 for w in widths))
        return math.lcm(tile, threads // math.gcd(threads, g))
    return math.lcm(tile, threads)


def _attn_rows(tile: int, device: torch.device) -> int:
    """The attention products' row tile: on a CPU also a multiple of the thread count (their elementwise steps)."""
    return math.lcm(tile, torch.get_num_threads()) if device.type == "cpu" else tile


def _candidates(device: torch.device, cfg: ModelConfig | None = None) -> list[Tiling]:
    rows = CPU_MAX_ROWS if device.type == "cpu" else CUDA_MAX_ROWS
    if device.type == "cpu":  # F.linear only: w @ x.T has passed the random-weight check and failed real weights
        return [Tiling(_rows(r, device, cfg), False, False, KEY_BLOCK, rows, r) for r in CPU_TILES]
    return [Tiling(r, False, False, KEY_BLOCK, rows, r) for r in CUDA_TILES]


BLOCK_CHECK_ROWS = 4096  # output rows the check gives a block-format linear (the head's 0.93 GB of fp32 is not needed)


def weight_wrapper(fmt: str) -> Callable[[Tensor], Any]:
    """How a random dense weight becomes a weight of format ``fmt`` for the check: ``dense`` as it is, ``int8`` as
    a CPU target's int8 weight (the ``int8pack`` kernel, :class:`~specexec.formats.int8.Int8Linear`), ``q4`` as
    its 4-bit one (:class:`~specexec.formats.q4.Q4Linear`)."""
    if fmt == "dense":
        return lambda w: w
    if fmt == "int8":
        from specexec.formats.int8 import Int8Linear

        return lambda w: Int8Linear(w.float(), kernel="int8pack")
    if fmt == "q4":
        from specexec.formats.q4 import Q4Linear

        return lambda w: Q4Linear(w.float())
    raise ValueError(f"no invariance check for {fmt!r} weights")


def model_format(model: Transformer) -> str:
    """The weight format a model's invariant passes run (``int8``/``q4``: a CPU target's int8/4-bit weights; else
    ``dense``, which NF4 also is here: its invariant path dequantizes, then runs the dense product)."""
    from specexec.formats.blocks import BLOCK_LINEARS
    from specexec.formats.int8 import Int8Linear

    head = model.globals.lm_head
    if isinstance(head, BLOCK_LINEARS):
        return "q4"
    return "int8" if isinstance(head, Int8Linear) and head.kernel == "int8pack" else "dense"


def find(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device, fmt: str = "dense"
) -> tuple[Tiling | None, dict[str, float], str]:
    """Check the candidate tilings on ``cfg``'s shapes; (the invariant one or None, {}, a note).
    ``fmt``: the linears' weight format (:func:`weight_wrapper`)."""
    shapes = head_shapes(cfg)
    if fmt == "q4":  # each output of the block kernels is its own weight row's fixed sequence: more rows add no path
        shapes = [(min(out, BLOCK_CHECK_ROWS), inp) for out, inp in shapes]
    wrap = weight_wrapper(fmt)
    # the smallest invariant tile, F.linear's when it has one: w @ x.T has passed random weights and failed real ones
    found = next((t for t in _candidates(device, cfg) if linear_invariant(shapes, dtype, device, t, wrap)), None)
    if found is None:  # no padded single call agrees with itself: one fixed-shape call per tile always does
        tile = 16 if device.type == "cpu" else 128
        fixed = Tiling(_rows(tile, device, cfg), False, True, KEY_BLOCK, _candidates(device)[0].max_rows, tile)
        found = fixed if linear_invariant(shapes, dtype, device, fixed, wrap) else None
    if found is None:
        return None, {}, "no row tiling makes this machine's matrix kernels agree across pass sizes"
    # the attention computes in fp32 whatever the model's dtype: its own tile, the smallest that agrees
    tiles = CPU_TILES if device.type == "cpu" else CUDA_TILES
    with_attn = [replace(found, attn_rows=_attn_rows(a, device)) for a in tiles]
    attn = next((t.attn_rows for t in with_attn if attention_invariant(cfg, dtype, device, t)), None)
    if attn is None:
        return None, {}, "this machine's attention products give different results for different pass shapes"
    return replace(found, attn_rows=attn), {}, ""


CHECK_VERSION = 6  # bumped when what the check covers changes: older cached choices are checked again


def _key(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, fmt: str = "dense") -> str:
    return (
        f"v{CHECK_VERSION}|{_device_name(device)}|torch {torch.__version__}|threads {torch.get_num_threads()}|{dtype}|"
        + ("" if fmt == "dense" else f"{fmt} weights|")
        + f"{head_shapes(cfg)}|heads {cfg.num_heads}/{cfg.num_kv_heads}x{cfg.head_dim}"
        + (f"|window {cfg.sliding_window}" if cfg.sliding_window is not None else "")
        + (f"|scale {cfg.attn_scale} cap {cfg.attn_softcap}" if cfg.attn_scale or cfg.attn_softcap else "")
        + ("|triton tree attention" if tree_attn.ready(device) else "")
    )


def cache_path(home: Path | None = None) -> Path:
    from specexec.home import cache_home

    return cache_home(home) / CACHE_FILE


def _read(home: Path | None = None) -> dict[str, Any]:
    try:
        data = json.loads(cache_path(home).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(choice: Choice, home: Path | None = None) -> None:
    path = cache_path(home)
    data = _read(home)
    data[choice.key] = asdict(choice)
    try:
        write_json(path, data)
    except OSError as e:  # a read-only cache costs a re-check next start, nothing else
        log.warning("could not save the invariance check to %s: %s", path, e)


_CHOSEN: dict[str, Choice] = {}  # this process's choices: a model keeps its tiling however often it is applied


def choose(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    use_cache: bool = True,
    home: Path | None = None,
    fmt: str = "dense",
) -> Choice:
    """The cached (under cache root ``home``, default :func:`specexec.home.cache_home`) or freshly checked choice
    for ``cfg`` in ``dtype`` on ``device``. Small models (tests' tiny ones) are not timed: the first invariant
    tiling, the same every run."""
    key = _key(cfg, dtype, device, fmt)
    if use_cache and key in _CHOSEN:
        return _CHOSEN[key]
    big = sum(o * i for o, i in head_shapes(cfg)) >= MIN_CACHED_PARAMS
    if use_cache and big:
        data = _read(home).get(key)
        if data:
            try:
                _CHOSEN[key] = Choice(**data)
                return _CHOSEN[key]
            except TypeError:
                pass
    if big:
        log.info(
            "checking which kernels keep the target's passes shape-invariant (once; cached in %s)", cache_path(home)
        )
    t0 = time.perf_counter()
    short = memory_note(cfg, dtype, _free_bytes(device)) if device.type == "cuda" else None
    if short is not None:  # the memory plan reserves check_bytes; a smaller free amount means it was not planned
        return Choice(key, None, {}, 0.0, short)  # not cached: try again next load
    try:
        tiling, ms, note = find(cfg, dtype, device, fmt=fmt)
    except torch.cuda.OutOfMemoryError:  # the check's full-size random weights did not fit beside the model
        torch.cuda.empty_cache()
        need = check_bytes(cfg, dtype) / 1e9
        note = f"not enough free GPU memory to run the load-time invariance check (about {need:.2f} GB)"
        return Choice(key, None, {}, round(time.perf_counter() - t0, 2), note)  # not cached: try again next load
    choice = Choice(key, asdict(tiling) if tiling else None, ms, round(time.perf_counter() - t0, 2), note)
    if big:
        _write(choice, home)
    _CHOSEN[key] = choice
    return choice


def apply(
    model: Transformer, on: bool = True, check: Callable[..., Choice] = choose, home: Path | None = None
) -> Choice | None:
    """Give ``model`` shape-invariant passes (``on``), or the fastest per-shape kernels; returns the choice made
    (None when off). ``home``: the cache root. Warns in one line (:func:`unavailable_message`) when this machine
    has no invariant way or the check could not run."""
    if not on:
        model.tiling = None
        return None
    fmt = model_format(model)
    choice = check(model.cfg, model.dtype, model.device, home=home, **({"fmt": fmt} if fmt != "dense" else {}))
    model.tiling = choice.get()
    if model.tiling is None:
        log.warning("%s", unavailable_message(choice.note))
    return choice
