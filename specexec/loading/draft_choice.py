"""``--draft-dtype auto`` on a GPU beside a streamed target: the draft's weight format expected to decode fastest.

A 16-bit 7B draft takes 13.5 GB; in int8 it takes 6.9 GB and in NF4 4.0 GB, and under a 24 GB cap the memory it
frees holds 13 or 19 more NF4 layers of a 70B target, so every target pass streams that much less over PCIe. What
a lighter draft costs is some acceptance and, on every draft pass, its kernels' extra work (bitsandbytes' NF4
matmul beyond one row dequantizes each weight to 16 bits and reads it back). :func:`choose` weighs both with a
model whose constants are data (``configs/draft_formats.toml``, calibrated on an H200, see there):

    seconds per token(f) = (streamed bytes a pass with the draft in f / pinned H2D bandwidth
                            + resident target layers * their compute left outside the copies
                            + draft passes a step * pass time in f) / keep(f)

with the bandwidths measured on this machine (:func:`measure_bandwidths`). (The plan spreads the resident layers
among the streamed ones, so their compute hides under the copies: the calibrated term is 0.) Where the
16-bit draft leaves nothing to stream, it is kept (a lighter format can then only lose). ``keep`` is a prior,
not a measurement on real 7B weights; each option reports the keep at which it would tie the 16-bit draft
(``break_even_keep``), so a user can judge the choice, and ``--draft-dtype`` overrides it.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import torch

from specexec.model import sizes
from specexec.model.transformer import ModelConfig

CONFIG_PATH = resources.files("specexec.configs") / "draft_formats.toml"  # the package data of configs/
GB = 1e9
ASSUMED_DEVICE_GBPS = 1000.0  # device memory when not measurable: a consumer card's (RTX 4090: ~1 TB/s)
LAYER_70B = 855_654_400  # a Llama-2/3-70B decoder layer's parameters (the calibration's)


@dataclass(frozen=True)
class FormatCost:
    keep: float  # tokens per step kept against the 16-bit draft (a prior)
    layer_ms: float  # extra per draft layer and pass
    rewrite: float  # 16-bit linear bytes written and read back per pass, as a multiple of their size


@dataclass(frozen=True)
class CostModel:
    levels_per_step: float
    layer_ms: float
    formats: dict[str, FormatCost]
    resident_layer_ms: dict[str, float]  # target layer format (dense, nf4) -> a 70B-sized layer's verify compute

    def resident_ms(self, t_cfg: ModelConfig, t_fmt: str) -> float:
        """A resident layer of ``t_cfg`` (stored as ``t_fmt``: dense or nf4) in a verify pass, ms, scaled from the
        70B-sized layer's figure by its parameters."""
        return self.resident_layer_ms.get(t_fmt, 0.0) * sizes.layer_params(t_cfg) / LAYER_70B


@cache
def cost_model(path: Traversable | Path = CONFIG_PATH) -> CostModel:
    """The constants of ``configs/draft_formats.toml`` (malformed data is a bug: ValueError)."""
    with path.open("rb") as f:
        raw: dict[str, Any] = tomllib.load(f)
    try:
        formats = {
            name: FormatCost(float(v["keep"]), float(v["layer_ms"]), float(v["rewrite"]))
            for name, v in raw["formats"].items()
        }
        resident = {str(k): float(v) for k, v in raw.get("resident_layer_ms", {}).items()}
        model = CostModel(float(raw["levels_per_step"]), float(raw["layer_ms"]), formats, resident)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: malformed draft format costs ({e})") from e
    if "dense" not in formats or any(not 0 < c.keep <= 1 for c in formats.values()):
        raise ValueError(f"{path}: needs a dense format and every keep in (0, 1]")
    return model


def pass_bytes(cfg: ModelConfig, fmt: str, itemsize: int = 2) -> int:
    """HBM bytes one draft pass moves for its weights in ``fmt``: every weight but the embedding (only its rows
    are gathered) read once, plus the rewrite of the 16-bit linears (see the module docstring)."""
    embed = cfg.vocab_size * cfg.hidden_size * itemsize
    weights = sizes.model_weight_bytes(cfg, fmt, itemsize)
    if fmt != "int8" or not cfg.tie_word_embeddings:
        weights -= embed
    c = cost_model().formats.get(fmt)
    rewrite = c.rewrite if c is not None else 0.0
    dense_linears = sizes.model_weight_bytes(cfg, "dense", itemsize) - embed
    return int(weights + rewrite * dense_linears)


def pass_seconds(cfg: ModelConfig, fmt: str, hbm_gbps: float) -> float:
    """The modelled time of one draft pass in ``fmt`` (see ``configs/draft_formats.toml``)."""
    m = cost_model()
    per_layer = (m.layer_ms + m.formats[fmt].layer_ms) / 1e3
    return cfg.num_layers * per_layer + pass_bytes(cfg, fmt) / (hbm_gbps * GB)


@dataclass(frozen=True)
class Option:
    fmt: str
    streamed_bytes: int  # per target pass, with the draft in this format
    stream_s: float  # streamed bytes / pinned H2D + the resident target layers' compute
    draft_s: float  # draft passes a step x modelled pass time
    keep: float
    s_per_token: float
    # the keep at which this format ties the 16-bit draft (1.0: the 16-bit draft itself, or slower even at keep 1;
    # None: the 16-bit draft does not fit)
    break_even_keep: float | None

    def describe(self) -> str:
        name = {"dense": "16-bit"}.get(self.fmt, self.fmt)
        return (
            f"{name}: {self.streamed_bytes / GB:.1f} GB streamed a pass ({self.stream_s:.3f} s) + draft "
            f"{self.draft_s:.3f} s a step, keep {self.keep:.2f} -> {self.s_per_token * 1e3:.0f} ms a token"
            + (
                ""
                if self.fmt == "dense" or self.break_even_keep is None
                else f" (ties the 16-bit draft at keep {self.break_even_keep:.2f})"
                if self.break_even_keep < 1.0
                else " (slower than the 16-bit draft even at keep 1)"
            )
        )


def options(
    d_cfg: ModelConfig,
    streamed: dict[str, int],
    h2d_gbps: float,
    hbm_gbps: float,
    resident: dict[str, int] | None = None,
    resident_ms: float = 0.0,
) -> list[Option]:
    """Every format of ``streamed`` (format -> streamed bytes a target pass with the draft in it; only formats
    whose plan fits), modelled; ``resident`` (format -> resident target layers) at ``resident_ms`` each
    (:meth:`CostModel.resident_ms`). The break-even needs "dense" among them."""
    m = cost_model()
    raw = []
    for fmt, nbytes in streamed.items():
        c = m.formats.get(fmt)
        if c is None:
            continue
        stream_s = nbytes / (h2d_gbps * GB) + (resident or {}).get(fmt, 0) * resident_ms / 1e3
        draft_s = m.levels_per_step * pass_seconds(d_cfg, fmt, hbm_gbps)
        raw.append((fmt, nbytes, stream_s, draft_s, c.keep))
    base = next(((s + d) for f, _, s, d, _ in raw if f == "dense"), None)
    return [
        Option(f, n, s, d, k, (s + d) / k, None if base is None else 1.0 if f == "dense" else min(1.0, (s + d) / base))
        for f, n, s, d, k in raw
    ]


def plan_options(d_cfg: ModelConfig, t_cfg: ModelConfig, plans: dict[str, Any], h2d_gbps: float, hbm_gbps: float):  # noqa: ANN201
    """:func:`options` for memory plans (:class:`offload.plan.Plan`, format -> the plan with the draft in it): their
    streamed bytes and resident layers, the target's layers costed by their format."""
    t_fmt = "nf4" if next(iter(plans.values())).fmt.kind == "nf4" else "dense"
    return options(
        d_cfg,
        {f: p.bytes_per_forward for f, p in plans.items()},
        h2d_gbps,
        hbm_gbps,
        {f: len(p.resident) for f, p in plans.items()},
        cost_model().resident_ms(t_cfg, t_fmt),
    )


def choose(opts: list[Option]) -> Option:
    """The option with the least expected seconds per token; the 16-bit draft when nothing streams with it."""
    dense = next((o for o in opts if o.fmt == "dense"), None)
    if dense is not None and dense.streamed_bytes == 0:
        return dense
    return min(opts, key=lambda o: o.s_per_token)


def lighter_formats(capability: tuple[int, int]) -> list[str]:
    """The low-bit formats ``--draft-dtype auto`` may take on a GPU of this compute capability: bitsandbytes'
    int8 matmul needs integer tensor cores (Turing, 7.5, and later); NF4 runs everywhere it does."""
    return (["int8"] if capability >= (7, 5) else []) + ["nf4"]


def device_memory_gbps(device: torch.device, nbytes: int = 1 << 28) -> float:
    """Device memory bandwidth in GB/s: the best of a few timed device copies of ``nbytes`` (a copy moves its
    bytes twice, read and written)."""
    from offload.plan import best_copy_seconds

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return 2 * nbytes / best_copy_seconds(torch.empty_like(src), src, repeats=5, warmup=2) / GB


def measure_bandwidths(device: torch.device, nbytes: int = 1 << 28) -> tuple[float, float]:
    """(pinned host->device, device memory) bandwidth in GB/s, measured now (well under a second)."""
    from offload.plan import measure_h2d_bandwidth

    return measure_h2d_bandwidth(device, nbytes, repeats=4), device_memory_gbps(device, nbytes)


def picker(  # noqa: ANN201
    d_cfg: ModelConfig, t_cfg: ModelConfig, device: torch.device, bandwidths: tuple[float, float] | None = None
):
    """A ``pick`` for :func:`specexec.loading.offloaded.plan_with_draft`: measures this GPU's bandwidths (once, when
    there is a
    choice to make), logs every option and returns the chosen format."""
    import logging

    log = logging.getLogger("specexec")

    def pick(fits: list[tuple[str, Any]]) -> str:
        if bandwidths is not None:
            h2d, hbm = bandwidths
        else:
            try:
                h2d, hbm = measure_bandwidths(device)
            except RuntimeError as e:  # pinning refused (e.g. WSL's cap), or no room for the test buffers
                h2d, hbm = fits[0][1].h2d_gbps, ASSUMED_DEVICE_GBPS
                log.info("bandwidths not measured (%s): assuming %.0f GB/s H2D, %.0f GB/s device", e, h2d, hbm)
        opts = plan_options(d_cfg, t_cfg, dict(fits), h2d, hbm)
        best = choose(opts)
        log.info(
            "--draft-dtype auto (pinned H2D %.1f GB/s, device memory %.0f GB/s measured): %s; loading the draft in %s",
            h2d,
            hbm,
            "; ".join(o.describe() for o in opts),
            {"dense": "16-bit"}.get(best.fmt, best.fmt),
        )
        return best.fmt

    return pick
