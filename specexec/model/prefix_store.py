"""A prefix cache across conversations: snapshots of committed KV state, keyed by the tokens they hold.

The engine's live caches hold one committed sequence; a prompt that does not extend it (another conversation)
would drop it. Before the live state is dropped the engine saves it here (:meth:`PrefixStore.save`): the used
slots only -- ``[0, n)`` of every layer of the target's cache, and of the draft's when the draft keeps its own --
copied to host RAM (a GPU engine's too). A new generation restores the snapshot sharing the longest token prefix
with its prompt (:meth:`PrefixStore.best`, :meth:`Snapshot.restore`) when that beats what the live cache shares,
and prefills only the rest. Restoring copies the saved bits back, so with shape-invariant target passes the
restored keys and values are bit-identical to recomputing them: the output is exactly a fresh engine's.

Snapshots are evicted least recently used first so their bytes never exceed the budget; a snapshot whose tokens
are a prefix of another's is dropped (the longer one serves every prompt the shorter one would).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from specexec.model.kv_cache import KVCache, common_prefix

HOST = torch.device("cpu")


def _copy_out(cache: KVCache, n: int) -> tuple[Tensor, Tensor]:
    """Slots [0, n) of every layer of ``cache``, copied to host RAM (contiguous)."""
    k = cache.k[:, :, :n].to(HOST, copy=True).contiguous()
    v = cache.v[:, :, :n].to(HOST, copy=True).contiguous()
    return k, v


def slots_bytes(cache: KVCache, n: int) -> int:
    """Bytes of ``n`` slots of every layer of ``cache`` (keys and values)."""
    k = cache.k
    return 2 * k.shape[0] * k.shape[1] * n * k.shape[3] * k.element_size()


@dataclass
class Snapshot:
    """Committed KV state: the target's entries of ``tokens`` (all of them) and the draft's of ``tokens[:draft_len]``
    (0: none saved)."""

    tokens: tuple[int, ...]
    k: Tensor  # (layers, KVH, len(tokens), hd) on the host
    v: Tensor
    draft_k: Tensor | None = None
    draft_v: Tensor | None = None
    draft_len: int = 0

    @property
    def nbytes(self) -> int:
        n = self.k.numel() * self.k.element_size() * 2
        if self.draft_k is not None:
            n += self.draft_k.numel() * self.draft_k.element_size() * 2
        return n

    def restore(self, cache: KVCache, n: int) -> None:
        """Copy the first ``n`` saved target slots into ``cache`` (in place: graphs captured over it stay valid)."""
        cache.k[:, :, :n].copy_(self.k[:, :, :n])
        cache.v[:, :, :n].copy_(self.v[:, :, :n])

    def restore_draft(self, cache: KVCache, n: int) -> None:
        """Copy the first ``n`` saved draft slots (at most ``draft_len``) into the draft's ``cache``."""
        assert self.draft_k is not None and self.draft_v is not None and n <= self.draft_len
        cache.k[:, :, :n].copy_(self.draft_k[:, :, :n])
        cache.v[:, :, :n].copy_(self.draft_v[:, :, :n])


class PrefixStore:
    """Snapshots of committed KV state within ``budget`` bytes (0: disabled), least recently used evicted first."""

    def __init__(self, budget: int) -> None:
        if budget < 0:
            raise ValueError(f"the prefix cache budget must be >= 0 bytes, got {budget}")
        self.budget = int(budget)
        self._entries: OrderedDict[tuple[int, ...], Snapshot] = OrderedDict()  # oldest use first
        self.nbytes = 0
        self.hits = 0  # generations that restored a snapshot
        self.restored_tokens = 0  # prompt tokens whose keys/values came from a snapshot (all generations)

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def keys(self) -> list[tuple[int, ...]]:
        """The snapshots' token sequences, least recently used first."""
        return list(self._entries)

    def info(self) -> dict[str, Any]:
        """What /health reports: entries, bytes held, the budget, hits and restored tokens so far."""
        return {
            "entries": len(self._entries),
            "bytes": self.nbytes,
            "budget_bytes": self.budget,
            "hits": self.hits,
            "restored_tokens": self.restored_tokens,
        }

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def save(self, tokens: list[int], cache: KVCache, draft: KVCache | None = None, draft_len: int = 0) -> bool:
        """Snapshot ``cache``'s entries of ``tokens`` (slots [0, len(tokens))) and ``draft``'s of
        ``tokens[:draft_len]``. Returns whether it is held (newly, or already by a snapshot that covers it)."""
        n = len(tokens)
        if not self.enabled or n == 0:
            return False
        key = tuple(tokens)
        for other in list(self._entries):  # already held: the same tokens, or a longer sequence they begin
            if len(other) >= n and other[:n] == key:
                self._entries.move_to_end(other)
                return True
        draft_len = min(draft_len, n) if draft is not None else 0
        size = slots_bytes(cache, n) + (slots_bytes(draft, draft_len) if draft is not None and draft_len else 0)
        if size > self.budget:
            return False
        for other in list(self._entries):  # shorter snapshots this one extends serve nothing it does not
            if len(other) < n and key[: len(other)] == other:
                self._drop(other)
        while self.nbytes + size > self.budget:
            self._drop(next(iter(self._entries)))
        k, v = _copy_out(cache, n)
        snap = Snapshot(key, k, v)
        if draft is not None and draft_len:
            snap.draft_k, snap.draft_v = _copy_out(draft, draft_len)
            snap.draft_len = draft_len
        self._entries[key] = snap
        self.nbytes += snap.nbytes
        return True

    def best(self, tokens: list[int]) -> tuple[Snapshot | None, int]:
        """The snapshot sharing the longest leading run with ``tokens``, and its length (0: none shares any)."""
        found, most = None, 0
        for key, snap in self._entries.items():
            m = common_prefix(key, tokens)
            if m > most:
                found, most = snap, m
        return found, most

    def touch_best(self, tokens: list[int]) -> None:
        """Make :meth:`best`'s snapshot for ``tokens`` the most recently used (before a save that may evict)."""
        snap, _ = self.best(tokens)
        if snap is not None:
            self._entries.move_to_end(snap.tokens)

    def used(self, snap: Snapshot, tokens: int) -> None:
        """Count a restore of ``tokens`` tokens from ``snap`` (now the most recently used)."""
        self._entries.move_to_end(snap.tokens)
        self.hits += 1
        self.restored_tokens += tokens

    def _drop(self, key: tuple[int, ...]) -> None:
        snap = self._entries.pop(key)
        self.nbytes -= snap.nbytes
