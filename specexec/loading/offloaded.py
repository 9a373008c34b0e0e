"""Build an offloaded target: plan, pack (and quantize) layers one at a time, return a Transformer over a streamer.

Weights pass through memory once: each layer is read from the checkpoint (``loading.iter_layers``; for an NF4
target given as a GGUF, from the GGUF itself: :func:`target_dir`), packed into
its final home — a device buffer (resident), a pinned host buffer (RAM tier) or a cache file (SSD tier, NF4) —
and dropped before the next layer is read. NF4 layers are quantized once and cached on disk; a later start
reads the packed files and never quantizes again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from offload.layout import LayerLayout, layer_layout
from offload.packing import quantize_layer
from offload.plan import OffloadConfig, Plan, PlanModel, Resources, make_plan
from offload.store import CHUNK_BYTES, CacheWriter, HostBuffer, RamStore, SsdStore, writable_dir
from offload.streamer import StreamedLayers
from specexec.config import TreeConfig
from specexec.errors import ConfigError, OutOfMemory, SpecexecError, setting
from specexec.loading.checkpoint import iter_layers, load_model, model_dir, parse_dtype, read_config
from specexec.model import sizes
from specexec.model.transformer import ModelConfig, Transformer

log = logging.getLogger(__name__)


def target_compute_dtype(dtype_str: str, offload: OffloadConfig, device: torch.device) -> torch.dtype:
    """The target's compute dtype: ``dtype_str`` (auto: bf16 on CUDA, fp32 on CPU) unless target_dtype is 16-bit."""
    if offload.target_dtype in ("bf16", "fp16"):
        want = {"bf16": torch.bfloat16, "fp16": torch.float16}[offload.target_dtype]
        if dtype_str != "auto" and parse_dtype(dtype_str, device) != want:
            raise ConfigError(
                "dtype",
                dtype_str,
                "contradicts the target dtype",
                f"{setting('dtype', dtype_str)} contradicts "
                f"{setting('OffloadConfig.target_dtype', offload.target_dtype)}",
            )
        return want
    return parse_dtype(dtype_str, device)


def target_dir(path: Path, offload: OffloadConfig) -> Path:
    """The target's HF-format directory (:func:`~specexec.loading.checkpoint.model_dir`, GGUFs converted under
    ``offload.cache_dir``). A GGUF target whose layers are quantized to NF4 (``target_dtype`` nf4) is converted
    without its layers: they are read from the GGUF once, while the NF4 layer cache is written, so no 16-bit copy
    of the model is ever on disk."""
    return model_dir(path, home=offload.cache_dir, layers_in_gguf=offload.target_dtype == "nf4")


def load_offloaded(
    path: Path,
    device: torch.device,
    dtype_str: str = "auto",
    offload: OffloadConfig = OffloadConfig(),
    draft_bytes: int = 0,
    kv_bytes: int = 0,
    *,
    max_tokens: int = 2048,
    h2d_gbps: float | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    plan: Plan | None = None,
) -> Transformer:
    """Load the target at ``path`` placed by :func:`~offload.plan.make_plan`; ``model.layers`` is the streamer.

    ``draft_bytes``/``kv_bytes``: VRAM the draft and the KV caches (and step buffers) will take (the plan reserves
    it). ``plan``: one already made (by :func:`plan_offload`); else it is made here from this machine.
    ``chunk_bytes``: staging/CRC chunk of newly written caches and of staged RAM (tests use small ones).
    """
    path = target_dir(Path(path), offload)
    cfg = read_config(path)
    if plan is None:
        plan = plan_offload(
            path, device, dtype_str, offload, draft_bytes, kv_bytes, max_tokens=max_tokens, h2d_gbps=h2d_gbps
        )
    log.info("%s", plan.describe())
    layers = build_layers(path, cfg, plan, device, chunk_bytes=chunk_bytes)
    return load_model(path, device, plan.fmt.dtype, layers=layers)


def plan_offload(
    path: Path,
    device: torch.device,
    dtype_str: str = "auto",
    offload: OffloadConfig = OffloadConfig(),
    draft_bytes: int = 0,
    kv_bytes: int = 0,
    *,
    max_tokens: int = 2048,
    h2d_gbps: float | None = None,
) -> Plan:
    """:func:`~offload.plan.make_plan` for the checkpoint at ``path`` on this machine (nothing is allocated)."""
    path = target_dir(Path(path), offload)
    cfg = read_config(path)
    dtype = target_compute_dtype(dtype_str, offload, device)
    root = offload.offload_root
    model = PlanModel.from_checkpoint(
        cfg, dtype, path, root, draft_bytes=draft_bytes, kv_bytes=kv_bytes, max_tokens=max_tokens
    )
    return make_plan(Resources.probe(device, root, h2d_gbps), model, offload)


def plan_with_draft(
    path: Path,
    device: torch.device,
    dtype_str: str,
    offload: OffloadConfig,
    reserve: Callable[[str], Any],
    formats: Sequence[str],
    *,
    resources: Resources | None = None,
    pick: Callable[[list[tuple[str, Plan]]], str] | None = None,
) -> tuple[Plan, str]:
    """The plan for the first draft weight format of ``formats`` (e.g. dense, int8, nf4) whose draft leaves room
    for the streamed target, and that format. ``reserve(fmt)`` gives the :class:`~specexec.model.sizes.PlanReservations`
    with the draft in ``fmt``. Only a lack of GPU memory moves on to the next format; when none fits, the error
    of the last one is raised, saying which precisions were tried. ``resources``: the machine (default: probed).
    ``pick``: plan every format and let ``pick([(format, plan) of those that fit])`` name the one to load
    (``--draft-dtype auto`` on a GPU: :func:`specexec.loading.draft_choice.picker`); None: the first that fits.

    ``--draft-dtype auto`` on a GPU plans the 16-bit, int8 and NF4 drafts: a 16-bit 7B draft takes 13.5 GB, more
    than a 16 GB card has beside a streamed 70B's ring, while its int8 (6.9 GB) or NF4 (4.0 GB) copy fits; among
    those that fit, the picker weighs the streamed bytes each leaves against its draft passes and acceptance.
    """
    path = target_dir(Path(path), offload)
    cfg = read_config(path)
    dtype = target_compute_dtype(dtype_str, offload, device)
    root = offload.offload_root
    res = resources or Resources.probe(device, root, None)
    names = [{"dense": "16-bit"}.get(f, f) for f in formats]
    fits: list[tuple[str, Plan]] = []
    for i, fmt in enumerate(formats):
        r = reserve(fmt)
        model = PlanModel.from_checkpoint(
            cfg, dtype, path, root, draft_bytes=r.draft_bytes, kv_bytes=r.kv_bytes, max_tokens=r.max_tokens
        )
        try:
            plan = make_plan(res, model, offload)
        except OutOfMemory as e:
            if e.resource != "GPU memory" or (i == len(formats) - 1 and not fits):
                if i and e.resource == "GPU memory":
                    raise OutOfMemory(
                        f"{e} (the draft was tried in {', '.join(names)})", e.resource, e.need, e.have
                    ) from None
                raise
            continue
        fits.append((fmt, plan))
        if pick is None:
            break
    if not fits:
        raise ValueError("no draft formats to try")
    fmt, plan = fits[0]
    if pick is not None and len(fits) > 1:
        fmt = pick(fits)
        plan = dict(fits)[fmt]
    elif fmt != formats[0]:
        log.warning(
            "the draft in %s does not fit beside the streamed target under this GPU's budget: loading it in %s "
            "(%.1f GB; --draft-dtype chooses)",
            names[0],
            {"dense": "16-bit"}.get(fmt, fmt),
            reserve(fmt).draft_bytes / 1e9,
        )
    return plan, fmt


def plan_streamed(
    path: Path,
    device: torch.device,
    dtype_str: str,
    offload: OffloadConfig,
    reserve: Callable[[TreeConfig, str], Any],
    formats: Sequence[str],
    tree: TreeConfig,
    pick: Callable[[list[tuple[str, Plan]]], str] | None = None,
) -> tuple[Plan, str, TreeConfig]:
    """The streamed target's plan beside the draft and the largest tree that leaves room for both.

    ``reserve(tree, fmt)`` gives the :class:`~specexec.model.sizes.PlanReservations` of a draft in ``fmt`` and
    ``tree``'s KV cache and workspace. A fixed budget is planned as given; ``--budget auto`` tries its
    ``max_budget`` and then smaller caps (:func:`~specexec.model.sizes.fitting_caps`: a 70B + 7B at 12 GB fits only
    with trees of a few hundred nodes). Each cap is planned with :func:`plan_with_draft` over ``formats`` (``pick``:
    see there). Returns (plan, draft format, the tree the caches are sized for); an error that no cap fits names the
    budget setting to shrink.
    """
    caps = sizes.fitting_caps(tree)
    for k, cap in enumerate(caps):
        try:
            plan, fmt = plan_with_draft(path, device, dtype_str, offload, partial(reserve, cap), formats, pick=pick)
        except OutOfMemory as e:
            if e.resource != "GPU memory":
                raise
            if len(caps) == 1:  # a fixed budget: the tree's reservation is one of the things to shrink
                smaller = setting("TreeConfig.budget")
                raise OutOfMemory(f"{e}, or a smaller {smaller}", e.resource, e.need, e.have) from None
            if k == len(caps) - 1:
                smallest = setting("TreeConfig.max_budget", cap.max_budget)
                raise OutOfMemory(f"{e} (even with {smallest})", e.resource, e.need, e.have) from None
            continue
        if cap.max_budget < tree.max_budget:
            log.info("max_budget lowered to %d to fit the streamed target's plan", cap.max_budget)
        return plan, fmt, cap
    raise ValueError("fitting_caps gave no tree to plan")


def build_layers(
    path: Path, cfg: ModelConfig, plan: Plan, device: torch.device, chunk_bytes: int = CHUNK_BYTES
) -> StreamedLayers:
    """Pack every layer into its home as ``plan`` says and return the streamer over them."""
    layout = layer_layout(cfg, plan.fmt)
    builder = _Builder(layout, plan, device)
    store: SsdStore | None = None
    if plan.cache_dir is not None:
        store = SsdStore.open(plan.cache_dir, layout, cfg.num_layers)
        if store is None:
            what = "NF4 layer cache" if plan.fmt.kind == "nf4" else "SSD-tier layer cache"
            log.warning(
                "writing the %s of %s: %d layers, %.1f GB, into %s (once; later starts reuse it; "
                "`specexec cache rm` removes it)",
                what,
                path.name,
                cfg.num_layers,
                cfg.num_layers * layout.nbytes / 1e9,
                plan.cache_dir,
            )
            writable_dir(plan.cache_dir, what)
            try:
                store = builder.write_cache(path, cfg, plan.cache_dir, chunk_bytes)
            except OSError as e:
                raise SpecexecError(
                    f"cannot write the {what} in {plan.cache_dir}: {e.strerror or e}; point the cache at a "
                    "writable disk with space (--cache-dir, or the SPECEXEC_HOME environment variable)"
                ) from None
        else:
            log.info("reading packed layers from %s", plan.cache_dir)
            builder.read_cache(store)
    else:
        builder.from_checkpoint(path, cfg)
    host = RamStore(layout, builder.host, device.type == "cuda", chunk_bytes) if plan.mode == "ram" else store
    return StreamedLayers(
        layout,
        cfg.num_layers,
        device,
        builder.resident,
        host if plan.streamed else None,
        lookahead=plan.lookahead,
        ring_size=plan.ring_size,
        plan=plan,
    )


class _Builder:
    """Puts packed layers where the plan wants them: device buffers (resident) or host buffers (RAM tier)."""

    def __init__(self, layout: LayerLayout, plan: Plan, device: torch.device) -> None:
        self.layout, self.plan, self.device = layout, plan, device
        self.resident: dict[int, Tensor] = {}
        self.host: dict[int, HostBuffer] = {}
        self._ram = set(plan.streamed) if plan.mode == "ram" else set()
        self._pin = device.type == "cuda"
        self._tmp: Tensor | None = None

    def buffer(self, i: int) -> Tensor:
        """The CPU buffer layer i is packed into: its own host buffer (RAM tier) or a reused temporary."""
        if i in self._ram:
            hb = HostBuffer(self.layout.nbytes, pin=self._pin)
            if self._pin and not hb.pinned:
                self._pin = False
                log.warning(
                    "could not pin host memory (the driver refused; WSL caps pinned memory): the RAM-tier "
                    "layers from layer %d on are staged through small pinned buffers, which is slower",
                    i,
                )
            self.host[i] = hb
            return hb.tensor
        if self._tmp is None:
            self._tmp = torch.empty(self.layout.nbytes, dtype=torch.uint8)
        return self._tmp

    def place(self, i: int, buf: Tensor) -> None:
        """Layer i is packed in ``buf``: copy it to the device if it is resident."""
        if i in self.plan.resident:
            dev = torch.empty(self.layout.nbytes, dtype=torch.uint8, device=self.device)
            dev.copy_(buf)
            self.resident[i] = dev

    def wanted(self, i: int) -> bool:
        return i in self._ram or i in self.plan.resident

    def from_checkpoint(self, path: Path, cfg: ModelConfig) -> None:
        for i, w in iter_layers(path, cfg, self.layout.fmt.dtype):
            if self.wanted(i):
                buf = self.buffer(i)
                self.layout.pack(w, buf)
                self.place(i, buf)

    def write_cache(self, path: Path, cfg: ModelConfig, root: Path, chunk_bytes: int) -> SsdStore:
        nf4 = self.layout.fmt.kind == "nf4"
        what = "quantizing to NF4 and caching" if nf4 else "packing"
        log.info("%s %d layers into %s (once)", what, cfg.num_layers, root)
        source = {"model": str(path.resolve()), "format": self.layout.fmt.name}
        writer = CacheWriter(root, self.layout, cfg.num_layers, source, chunk_bytes)
        qdev = self.device if self.device.type == "cuda" else torch.device("cpu")
        for i, w in iter_layers(path, cfg, self.layout.fmt.dtype):
            tensors = quantize_layer(w, self.layout, qdev) if nf4 else w
            buf = self.buffer(i)
            self.layout.pack(tensors, buf)
            writer.write(i, buf)
            self.place(i, buf)
        return writer.finish()

    def read_cache(self, store: SsdStore) -> None:
        with ThreadPoolExecutor(4, thread_name_prefix="offload-load") as pool:
            for i in range(self.plan.num_layers):
                if self.wanted(i):
                    buf = self.buffer(i)
                    store.read_layer(i, buf, pool)
                    self.place(i, buf)
