"""A draft model and its KV cache, shared by the draft proposers (chain and tree) of one engine.

Cache slots: the committed sequence occupies slots [0, n); the root (pending token) sits at slot n; the nodes a
proposer expands get slots n+1, n+2, ... (pruned nodes leave unused slots behind, harmless: no mask row points at
them). ``tokens`` are the committed tokens whose keys/values are in the cache (a prefix of the sequence).

A self-derived draft (the target's own layers in low bit, all or some) may take its committed prefix's keys/values
from the target (:class:`TargetPrefix`, :meth:`DraftModel.share_prefix`): the target computed them anyway, at
full precision and from the full-depth residual stream, so the draft reads the context exactly as the target does
and never runs the prompt or an accepted token itself. After each step the entries of the newly committed tokens
are copied from the target's cache (their own layers; a partial draft's layer i is the target's layer
``layers[i]``); the draft still writes its tree nodes into its own cache, so its tree slots never collide with
the target's. What the draft proposes changes; the output never does.

A draft whose tokenizer differs from the target's in a few ids (or that has embedding rows which are no token) is a
:class:`LimitedDraft`: its logits at those ids are -inf, so no proposer ever proposes them, greedy or sampled (its
sampling distribution q renormalises over the rest). See :mod:`specexec.loading.pairing`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from specexec.model.graphs import StaticPasses
from specexec.model.kv_cache import KVCache, common_prefix
from specexec.model.transformer import Transformer
from specexec.propose.captured import LevelSpace
from specexec.steps.rules import CATCH_UP_ROWS


@dataclass
class LimitedDraft(Transformer):
    """A draft model that never proposes the ``excluded`` ids: every pass's logits are -inf there (after the
    model's own soft-capping, so a capped model's masked logits stay -inf). Every proposer reads the draft's logits
    from :meth:`forward` (eager, padded static or captured passes), so none can propose them."""

    excluded: Tensor | None = None  # (k,) long, on the model's device

    @torch.inference_mode()
    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        logits = super().forward(*args, **kwargs)
        if self.excluded is None:
            return logits
        return logits.index_fill_(-1, self.excluded, float("-inf"))


def limit_draft(model: Transformer, excluded: Tensor) -> Transformer:
    """``model`` as a :class:`LimitedDraft` that never proposes ``excluded`` (token ids); ``model`` itself when
    there is nothing to exclude. The weights are shared, not copied."""
    if excluded.numel() == 0:
        return model
    same = {f.name: getattr(model, f.name) for f in fields(model) if f.init and f.name != "excluded"}
    return LimitedDraft(**same, excluded=excluded.to(model.device, torch.long))


class TargetPrefix:
    """The target's KV cache as the source of a self-derived draft's committed prefix.

    ``layers``: the target layer of each draft layer (a partial self draft keeps some); ``held(seq)``: how many of
    ``seq[:-1]``'s leading tokens the target's cache holds (its committed prefix in common with ``seq``)."""

    def __init__(self, cache: KVCache, layers: Sequence[int], held: Callable[[list[int]], int]) -> None:
        self.cache = cache
        n = cache.k.shape[0]
        self.layers: slice | Tensor = (
            slice(None) if list(layers) == list(range(n)) else torch.tensor(list(layers), device=cache.k.device)
        )
        self.held = held
        self.copied = 0  # committed tokens whose entries came from the target (all generations)

    def copy_into(self, cache: KVCache, lo: int, hi: int) -> None:
        """Slots [lo, hi) of every draft layer from the target's (cast to the draft's dtype)."""
        cache.k[:, :, lo:hi] = self.cache.k[self.layers, :, lo:hi]
        cache.v[:, :, lo:hi] = self.cache.v[self.layers, :, lo:hi]
        self.copied += hi - lo


class DraftModel:
    """Owns the draft model's KV cache.

    ``static``: run passes of up to ``static_rows`` tokens with padded static shapes (CUDA graphs on a GPU; see
    :mod:`specexec.model.graphs`); None = only on CUDA. The cache's last slot is reserved as the padding scratch slot.
    """

    def __init__(
        self,
        model: Transformer,
        capacity: int,
        static: bool | None = None,
        static_rows: int = 128,
        cache: KVCache | None = None,
    ) -> None:
        self.model = model
        self.cache: KVCache = model.new_cache(capacity + 1) if cache is None else cache  # given: a lane's region
        self.usable = capacity  # slots [0, capacity) hold real entries; slot ``capacity`` is scratch
        self._tokens: list[int] = []
        # a draft's numerics only change what it proposes: on a GPU its RMSNorm runs as one fused kernel (a 7B pass
        # had ~520 of its ~1330 kernels in the norms' separate steps, docs/BENCHMARKS.md)
        self.fused_norm = model.device.type == "cuda"
        use = model.device.type == "cuda" if static is None else static
        self.static = StaticPasses(model, self.cache, static_rows, fused_norm=self.fused_norm) if use else None
        self.prefix: TargetPrefix | None = None  # see :meth:`share_prefix`
        # captured growth levels (specexec.propose.captured), kept here so they and their graphs outlive a
        # generation (each has its own proposer)
        self.level_space: LevelSpace | None = None
        self.caught_up_s = 0.0  # seconds the last :meth:`catch_up` spent on a separate catch-up pass

    def share_prefix(self, source: TargetPrefix | None) -> None:
        """Take the committed prefix's keys/values from the target's cache (None: compute them, the default).

        The caller must run the target over each committed token before the draft needs it: the decode loop
        prefills the target first and commits it before the proposer."""
        if source is not None:
            t = source.cache
            if (t.k.shape[1], t.k.shape[3]) != (self.cache.k.shape[1], self.cache.k.shape[3]):
                raise ValueError("the target's KV heads / head size differ from the draft's: no shared prefix")
            if t.k.device != self.cache.k.device:
                raise ValueError("the target's KV cache is on another device than the draft's")
        self.prefix = source
        self.reset()

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def length(self) -> int:
        """Committed tokens in the cache."""
        return len(self._tokens)

    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    def forward(self, tokens: Tensor, pos: Tensor, slots: Tensor, mask: Tensor, last_only: bool = False) -> Tensor:
        """One draft pass (static/graphed when it fits a bucket, else eager). Returns logits (T, V) fp32."""
        tokens = self.in_vocab(tokens)
        if self.static is not None and tokens.shape[0] <= self.static.max_rows:
            out = self.static.forward(tokens, pos, slots, mask)
            return out[-1:] if last_only else out
        return self.model.forward(
            tokens,
            pos,
            slots,
            mask,
            self.cache,
            logits_rows=slice(-1, None) if last_only else None,
            fused_norm=self.fused_norm,
        )

    def in_vocab(self, tokens: Tensor) -> Tensor:
        """Target tokens the draft's vocabulary lacks (e.g. a 72B target's padding rows) become token 0.

        The draft only proposes; what it is fed changes its guesses, never the output.
        """
        V = self.model.cfg.vocab_size
        return torch.where(tokens < V, tokens, torch.zeros_like(tokens))

    # -- the committed prefix -------------------------------------------------------------------------------------
    def lag(self, seq: list[int]) -> int:
        """Committed tokens of ``seq`` (its pending last token excluded) the next proposal must run through the
        draft before its root: 0 when the draft takes its prefix from the target (copied, not computed)."""
        if self.prefix is not None:
            return 0
        m = len(self._tokens)
        if m > len(seq) - 1 or seq[:m] != self._tokens:
            m = common_prefix(self._tokens, seq[:-1])
        return len(seq) - 1 - m

    def reset(self) -> None:
        self._tokens = []

    def adopt_restored(self, tokens: list[int]) -> None:
        """The cache's slots [0, len(tokens)) now hold ``tokens``' entries (copied in from a prefix-cache
        snapshot)."""
        self._tokens = list(tokens)

    def keep_prefix(self, seq: list[int]) -> None:
        """Keep the cached entries that are a prefix of ``seq[:-1]`` (the pending last token is never cached)."""
        keep = common_prefix(self._tokens, seq[:-1])
        if keep < len(self._tokens):
            del self._tokens[keep:]

    def _adopt(self, seq: list[int]) -> None:
        """Shared prefix: take the entries of the committed tokens the target holds beyond this cache's prefix."""
        if self.prefix is None:
            return
        m = self.length
        k = min(self.prefix.held(seq), len(seq) - 1)
        if k > m:
            self.prefix.copy_into(self.cache, m, k)
            self._tokens = list(seq[:k])

    def prefill(self, seq: list[int]) -> None:
        """Process every committed token except the pending last one (those the target holds are copied from it
        when the prefix is shared)."""
        self.keep_prefix(seq)
        self._adopt(seq)
        m, n = self.length, len(seq) - 1
        if m >= n:
            return
        dev = self.device
        pos = torch.arange(m, n, device=dev)
        mask = torch.arange(n, device=dev)[None, :] <= pos[:, None]
        self.model.forward(
            self.in_vocab(torch.tensor(seq[m:n], device=dev)),
            pos,
            pos,
            mask,
            self.cache,
            logits_rows=slice(-1, None),
            fused_norm=self.fused_norm,
        )
        self._tokens = list(seq[:n])

    def catch_up(self, seq: list[int]) -> Tensor:
        """One pass over the committed tokens the cache lacks plus the root (at slot n); the root's logits (1, V).

        Afterwards seq[:n] is committed in the cache and the root's keys/values sit at slot n (uncommitted).
        """
        self.keep_prefix(seq)
        self._adopt(seq)
        self.caught_up_s = 0.0
        if self.device.type == "cpu" and len(seq) - 1 - self.length >= CATCH_UP_ROWS:
            # tokens committed while no draft pass ran (plain or head steps): their pass is the cost of having
            # skipped the draft, not of this proposal; timed apart so the CPU's measured-rate policy can tell the
            # two (on a GPU the rows ride in the root's pass nearly free)
            t0 = time.perf_counter()
            self.prefill(seq)
            self.caught_up_s = time.perf_counter() - t0
        m, n = self.length, len(seq) - 1
        dev = self.device
        toks = torch.tensor(seq[m:], dtype=torch.long, device=dev)
        pos = torch.arange(m, n + 1, device=dev)
        mask = torch.arange(n + 1, device=dev)[None, :] <= pos[:, None]
        logits = self.forward(toks, pos, pos, mask, last_only=True)
        self._tokens = list(seq[:n])
        return logits

    def commit(self, slots: list[int], seq: list[int]) -> None:
        """After acceptance: ``slots`` are the draft slots of the accepted path's nodes, root first (-1 where a node
        was never run through the draft). The root is at slot n = len(prefix) already; the run of accepted nodes
        that were run moves to slots n+1, n+2, ...; ``seq`` is the committed sequence now.

        Shared prefix (:meth:`share_prefix`): the committed tokens' entries come from the target instead (the
        path's draft entries are not moved).
        """
        n = self.length
        if self.prefix is not None:
            new_len = min(self.prefix.held(seq), len(seq) - 1)
            if new_len > n:
                self.prefix.copy_into(self.cache, n, new_len)
            self._tokens = list(seq[:new_len])
            return
        kept: list[int] = []
        for s in slots:
            if s < 0:
                break
            kept.append(s)
        if not kept:
            return
        self.cache.compact(torch.tensor(kept[1:], dtype=torch.long), n + 1)
        self._tokens = list(seq[: min(n + len(kept), len(seq) - 1)])
