"""A draft's output layer restricted to a subset of the vocabulary."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from specexec.formats.dense import linear


class SubsetHead:
    """A draft lm_head restricted to a subset of the vocabulary (FR-Spec, arXiv 2502.14856).

    Scores only the ``ids`` rows of ``weight`` (a dense (V, D) tensor, or an :class:`Int8Linear`: anything with
    ``subset(ids)``) and returns full-vocabulary logits (T, V) with ``-inf`` outside the subset, so the draft's
    callers see an ordinary model that never proposes the excluded tokens. :meth:`observe` grows the subset with
    every token the model is fed (the prompt, the committed text): a token that occurred is likely to recur. The
    draft only proposes, so the subset changes speed and acceptance, never the output.
    """

    def __init__(self, weight: Any, ids: Tensor, vocab: int) -> None:
        self.weight, self.vocab = weight, vocab
        ids = torch.unique(ids.long().clamp(0, vocab - 1))
        self.member = torch.zeros(vocab, dtype=torch.bool)
        self.member[ids] = True
        self.ids = ids
        self.sub = self._rows(ids)
        self.extra_ids = ids[:0]
        self.extra: Any = None

    def _rows(self, ids: Tensor) -> Any:
        if isinstance(self.weight, Tensor):
            return self.weight[ids.to(self.weight.device)].contiguous()
        return self.weight.subset(ids)

    def observe(self, tokens: Tensor) -> None:
        """Add the tokens not in the subset yet (their rows are scored from now on)."""
        toks = tokens.detach().to("cpu", torch.long)
        toks = toks[(toks >= 0) & (toks < self.vocab)]
        new = toks[~self.member[toks]]
        if new.numel() == 0:
            return
        new = torch.unique(new)
        self.member[new] = True
        self.extra_ids = torch.cat([self.extra_ids, new])
        self.extra = self._rows(self.extra_ids)  # rebuilt: small (tokens seen outside the subset)

    @property
    def size(self) -> int:
        return int(self.ids.numel() + self.extra_ids.numel())

    def linear(self, x: Tensor, invariant: bool = False) -> Tensor:  # a draft's head: never invariant
        out = torch.full((x.shape[0], self.vocab), float("-inf"), dtype=x.dtype, device=x.device)
        out[:, self.ids.to(x.device)] = linear(x, self.sub)
        if self.extra is not None:
            out[:, self.extra_ids.to(x.device)] = linear(x, self.extra)
        return out
