"""Which of the target's decoder layers a partial self-derived draft keeps (``draft_layers``, ``--draft-layers``).

A self-derived draft (``draft="self"``) is the target's own checkpoint in a low-bit format. A whole 70B one does
not fit beside a streamed 70B under 24 GB even at 2 bits (docs/BENCHMARKS.md), so a *partial* one keeps only
some of the layers and skips the rest: the residual stream flows past a skipped layer unchanged (self-speculative
layer skipping, as in Draft & Verify, arXiv 2309.08168). Its KV cache holds the kept layers only. Any draft is
verified exactly, so the choice moves speed, never the output.

The spec: ``all`` (every layer), a number of layers (``40``), a fraction of them (``0.5``, ``50%``), or explicit
indices (``0-11,20,24-27``; a single index needs a trailing comma: ``5,``). A number or a fraction keeps the layers
that change the residual stream the most on a short calibration text (``configs/calibration.txt``), measured on
the target itself at load time: a layer's *block influence* is 1 - the mean cosine similarity between the hidden
states entering and leaving it (ShortGPT, arXiv 2403.03853); the layers with the least influence are the ones skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

import torch
import torch.nn.functional as F

from specexec.errors import ConfigError, setting
from specexec.loading.checkpoint import SELF_DRAFT
from specexec.model.transformer import Transformer

CALIBRATION = resources.files("specexec.configs") / "calibration.txt"  # the package data of configs/
MIN_KEPT = 2  # a fraction keeps at least this many layers
MIN_CALIBRATION = 32  # fewer calibration ids than this: a tokenizer that cannot read the text
MAX_LAYERS = 1 << 16  # for a syntax check before the target's layer count is known


@dataclass(frozen=True)
class LayerSpec:
    """A parsed ``draft_layers``: explicit ``indices``, or a ``count`` chosen by block influence (neither: all)."""

    indices: tuple[int, ...] | None = None
    count: int | None = None

    @property
    def everything(self) -> bool:
        return self.indices is None and self.count is None

    def kept(self, num_layers: int) -> int:
        """How many layers the draft holds (for sizing before any model runs)."""
        if self.indices is not None:
            return len(self.indices)
        return num_layers if self.count is None else self.count


def parse(spec: str | None, num_layers: int) -> LayerSpec:
    """``draft_layers`` → :class:`LayerSpec` for a target of ``num_layers`` layers; a bad spec raises
    :class:`~specexec.errors.ConfigError`."""
    if spec is None:
        return LayerSpec()
    text = spec.strip().lower().replace(" ", "")
    if text in ("", "all"):
        return LayerSpec()

    def bad(why: str) -> ConfigError:
        return ConfigError(
            "draft_layers",
            spec,
            why,
            f"{setting('draft_layers')} {spec}: {why}; expected all, a number of layers (40), a fraction (0.5 or 50%) "
            "or indices (0-11,20,24-27)",
        )

    if "," not in text and "-" not in text:  # a count or a fraction
        pct = text.endswith("%")
        try:
            f = float(text[:-1] if pct else text) / (100.0 if pct else 1.0)
        except ValueError:
            raise bad("not a number") from None
        if "." in text or pct:
            if not 0.0 < f <= 1.0:
                raise bad("a fraction must be in (0, 1]")
            n = min(num_layers, max(MIN_KEPT, round(f * num_layers)))
        else:
            n = int(f)
            if not 1 <= n <= num_layers:  # (before the target is known, num_layers is MAX_LAYERS: say >= 1)
                raise bad(
                    f"a number of layers must be in 1..{num_layers}" if num_layers < MAX_LAYERS else "must be >= 1"
                )
        return LayerSpec() if n == num_layers else LayerSpec(count=n)
    idx: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, sep, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise bad(f"{part!r} is not an index or a range a-b") from None
        if a > b or a < 0 or b >= num_layers:
            raise bad(f"{part!r} is outside the target's layers 0-{num_layers - 1}")
        idx.update(range(a, b + 1))
    if len(idx) == num_layers:
        return LayerSpec()
    return LayerSpec(indices=tuple(sorted(idx)))


def needs_self_draft(spec: str) -> ConfigError:
    """The error for layers asked of a draft that is not self-derived."""
    why = f"only a self-derived draft ({setting('draft', SELF_DRAFT)}) skips layers"
    return ConfigError("draft_layers", spec, why, f"{setting('draft_layers')} {spec}: {why}")


def calibration_tokens(encode, vocab_size: int, limit: int = 512) -> list[int]:
    """The calibration text (``configs/calibration.txt``) as token ids, at most ``limit``. A tokenizer that reads
    almost none of it (fewer than ``MIN_CALIBRATION`` ids) gets a fixed pseudo-random id sequence instead: the
    influence is then measured on tokens the model has, not on nothing."""
    ids = [int(t) for t in encode(CALIBRATION.read_text())][:limit]
    if len(ids) >= MIN_CALIBRATION:
        return ids
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (limit // 2,), generator=gen).tolist()


@torch.inference_mode()
def block_influence(model: Transformer, tokens: list[int]) -> list[float]:
    """Per decoder layer: 1 - mean cosine similarity of the hidden states entering and leaving it, over
    ``tokens`` (one causal pass of ``model``; the first position, an attention sink with outsized activations, is
    left out)."""
    T = len(tokens)
    if T < 2:
        raise ValueError("block influence needs at least 2 tokens")
    dev = model.device
    pos = torch.arange(T, device=dev)
    mask = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
    trace: list[torch.Tensor] = []
    model.forward(torch.tensor(tokens, device=dev), pos, pos, mask, model.new_cache(T), slice(T - 1, T), trace)
    return [
        float(1.0 - F.cosine_similarity(a[1:].float(), b[1:].float(), dim=-1).mean())
        for a, b in zip(trace, trace[1:], strict=False)
    ]


def by_influence(influence: list[float], count: int) -> list[int]:
    """The ``count`` layers of the highest block influence, ascending (ties: the earlier layer)."""
    order = sorted(range(len(influence)), key=lambda i: (-influence[i], i))
    return sorted(order[:count])


def resolve(spec: LayerSpec, model: Transformer | None, encode) -> list[int] | None:
    """The kept layer indices (None: all). A count is chosen by :func:`block_influence` of ``model`` (the target)
    on the calibration text."""
    if spec.indices is not None:
        return list(spec.indices)
    if spec.count is None:
        return None
    if model is None:
        raise ValueError("choosing layers by influence needs the target model")
    return choose(model, spec.count, encode)


def choose(model: Transformer, count: int, encode) -> list[int]:
    """The ``count`` layers of ``model`` (the target) with the most block influence on the calibration text."""
    return by_influence(block_influence(model, calibration_tokens(encode, model.cfg.vocab_size)), count)
