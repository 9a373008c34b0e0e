"""The one decode loop: prefill → (propose → verify → accept → commit → emit)*, with stats.

Every method runs through :func:`decode`: the budget policy sizes the step, a proposer (:mod:`specexec.propose`)
supplies its tree, the target verifies it in ONE pass (:func:`specexec.decoding.verify.score_tree`), the acceptance
rule the proposal names keeps the longest exact prefix plus one token of the target's own, both sides commit (the
target's KV cache here, the proposer's state in ``proposer.commit``), and the step's one record
(:class:`StepInfo`) goes to the stats, the policy and the ``on_step`` hook before the emitted tokens are yielded.
Chat, ``generate``, ``bench``, the server and the scripts all go through this loop (via the engine).

:class:`TargetState` is the committed sequence and the target's KV cache: ``seq`` (its last token is pending, in
no cache yet) and ``t_len`` (``seq[:t_len]`` is in the target cache). A new request that extends the committed
sequence (the next chat turn) keeps the cached common prefix and prefills only the rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from typing import Any

import numpy as np
import torch
from torch import Tensor

from specexec.config import SamplingConfig
from specexec.decoding.accept import accept
from specexec.decoding.constraint import GrammarFailed, GrammarState, TokenLogprob, mask_rows
from specexec.decoding.verify import commit_target, score_tree
from specexec.model.kv_cache import KVCache, common_prefix
from specexec.model.transformer import Transformer
from specexec.policy import BudgetPolicy
from specexec.steps import sampling
from specexec.steps.proposal import Proposal, Proposer, StepContext
from specexec.steps.record import Stats, StepInfo
from specexec.steps.tree import Tree


class Cancelled(Exception):
    """Raised by an ``on_step`` hook (like returning False) to end the generation after the current step, with
    finish_reason "cancelled" -- the same state as closing the generation between pieces."""


OnStep = Callable[[StepInfo], bool | None]  # an on_step hook: False (or Cancelled) cancels


class TargetState:
    """The committed sequence and the target model's KV cache."""

    def __init__(self, model: Transformer, capacity: int, cache: KVCache | None = None) -> None:
        self.model = model
        self.cache: KVCache = model.new_cache(capacity) if cache is None else cache  # given: a lane's region
        self.seq: list[int] = []  # committed tokens; the last one is pending (in no cache yet)
        self.t_len = 0  # seq[:t_len] is in the target cache

    @property
    def n(self) -> int:
        """The pending token's position (= committed tokens in the cache)."""
        return len(self.seq) - 1

    def reset(self) -> None:
        self.seq, self.t_len = [], 0

    def adopt(self, ids: list[int]) -> None:
        """Make ``ids`` the committed sequence, keeping the cached common prefix (excluding the pending token)."""
        self.t_len = common_prefix(self.seq[: self.t_len], ids[:-1])
        self.seq = list(ids)

    def held(self, seq: list[int]) -> int:
        """How many leading tokens of ``seq[:-1]`` the target cache holds (a shared-prefix draft copies them)."""
        k = min(self.t_len, len(seq) - 1)
        return k if self.seq[:k] == seq[:k] else common_prefix(self.seq[:k], seq[:k])

    def prefill(self) -> int:
        """Process the committed tokens the target cache lacks (all but the pending one). Returns how many."""
        n = self.n
        todo = n - self.t_len
        if todo > 0:
            dev = self.model.device
            pos = torch.arange(self.t_len, n, device=dev)
            mask = torch.arange(n, device=dev)[None, :] <= pos[:, None]
            self.model.forward(
                torch.tensor(self.seq[self.t_len : n], device=dev),
                pos,
                pos,
                mask,
                self.cache,
                logits_rows=slice(-1, None),
            )
            self.t_len = n
        return max(todo, 0)

    def commit(self, path: list[int], out: list[int]) -> None:
        """Keep the accepted path's KV (nodes path[1:] move behind the prefix) and append the committed tokens
        ``out`` (the emitted tokens, possibly cut at EOS / the limit). The cache may hold more than is committed."""
        n = self.n
        commit_target(self.cache, path, n)
        self.seq.extend(out)
        self.t_len = min(n + len(path), len(self.seq) - 1)


def sync(device: torch.device) -> None:
    """Wait for the work queued on the current stream (what a step's timings attribute). Only that stream: a
    device-wide synchronize would also wait for the streamer's prefetch of the next pass's first layers (keeping the
    next step's draft from starting while they copy)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def make_generator(samp: SamplingConfig, device: torch.device) -> torch.Generator | None:
    """The generation's random stream (None when greedy); the seed keys the tree walk's noise."""
    if samp.greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(samp.seed if samp.seed is not None else int(torch.randint(0, 2**62, (1,))))
    return gen


def decode(
    state: TargetState,
    proposer: Proposer,
    policy: BudgetPolicy,
    samp: SamplingConfig,
    max_new: int,
    eos: set[int] | frozenset[int],
    stats: Stats,
    verify_chunk: int = 4096,
    draft_logprobs: Callable | None = None,
    on_step: OnStep | None = None,
    constraint: GrammarState | None = None,
    top_logprobs: int | None = None,
) -> Generator[list[int], None, None]:
    """Decode up to ``max_new`` tokens after ``state.seq`` (already adopted); yields each step's committed tokens.

    The generator may be closed after any yield (a cancel): the caches and ``state.seq`` are consistent there.
    ``stats`` is filled as the loop runs and finalised when it ends (also on close). ``on_step(StepInfo)`` is
    called once per step; returning False or raising :class:`Cancelled` ends the loop after that step's tokens
    are yielded, with finish_reason "cancelled" (unless the step already ended the generation).

    ``constraint``: the grammar the output follows (its state after the output so far). Each step the tokens it
    forces go first, as a chain above the proposal's root; the proposer grows its tree below them, masking its
    draft by the grammar; nodes the grammar forbids are dropped; the target's logits are masked at every node
    before acceptance. ``top_logprobs``: record each committed token's target log-prob (and the ``top_logprobs``
    most probable tokens') in its step's ``logprobs``; None records none.
    """
    dev = state.model.device
    gen = make_generator(samp, dev)
    seed = int(gen.initial_seed()) if gen is not None else None  # keys the walk's noise (and coupled drafts)
    t0 = time.perf_counter()
    stats.prefill_tokens = state.prefill()  # first: a self-derived draft may take the prefix from the target
    proposer.begin(state.seq)
    sync(dev)
    stats.prefill_s = time.perf_counter() - t0
    logprobs = draft_logprobs or (lambda lg: sampling.logprobs(lg, samp))
    lag = getattr(proposer, "lag", None)  # a draft model's proposer: tokens its draft has yet to read
    stats.finish_reason = "length"
    try:
        while stats.new_tokens < max_new:
            n = state.n
            td = time.perf_counter()
            arm = policy.choose(left=max_new - stats.new_tokens, lag=lag(state.seq) if lag is not None else 0)
            ctx = StepContext(
                samp=samp,
                gen=gen,
                arm=arm,
                cost=policy.grow_cost(arm),
                trim=policy.trim_rule(),
                logprobs=logprobs,
                seed=seed,
                walk=constraint is not None,  # a chain's rule cannot take the forced tokens' chain above it
                constraint=constraint,
            )
            forced: list[int] = []
            if constraint is not None:  # the grammar's forced tokens lead; the proposal grows below them
                forced = constraint.forced(max_new - stats.new_tokens - 1)
                constraint.commit(forced)
            pseq = state.seq + forced if forced else state.seq
            prop = proposer.propose(pseq, ctx)
            allowed = None
            if constraint is not None:
                tree = prop.tree
                keep, allowed = constraint.tree_masks(tree.n_tokens.tolist(), tree.n_parents.tolist())
                if not all(keep):
                    prop.prune(keep)
                    allowed = allowed[np.asarray(keep)]
            verified = _graft(prop, state.seq[-1], forced) if forced else prop
            if forced:
                assert constraint is not None and allowed is not None
                allowed = np.concatenate([constraint.one_hot(forced), allowed])
            sync(dev)
            tt = time.perf_counter()
            hidden: list[Tensor] | None = [] if getattr(proposer, "wants_hidden", False) else None
            logits = score_tree(state.model, state.cache, verified.tree, n, verify_chunk, hidden)  # (N, V)
            raw = logits  # the target's own logits (a mask makes a masked copy): the log-probs' source
            if allowed is not None:
                logits = mask_rows(logits, allowed)
            path, emitted = accept(verified, logits, samp, gen, n)
            out: list[int] = []  # commit: cut at EOS / the token limit
            for t in emitted[: max_new - stats.new_tokens]:
                out.append(t)
                if t in eos:
                    break
            state.commit(path, out)
            k = len(forced)
            ppath = [0] + [i - k for i in path[k + 1 :]] if forced else path  # the proposer's own nodes
            if hidden is not None:  # heads: the last accepted node's hidden state (its logits chose seq[-1])
                prop.hidden = (hidden[0] if len(hidden) == 1 else torch.cat(hidden))[path[-1]]
            proposer.commit(prop, ppath, state.seq)
            failure: GrammarFailed | None = None
            if constraint is not None:
                try:
                    constraint.commit(out[k:])
                except GrammarFailed as e:  # at a committed position (as plain decoding): the tokens before it stand
                    failure = e
                    out = out[: k + e.committed]
            sync(dev)
            te = time.perf_counter()
            step = StepInfo(
                arm=arm,
                tree_logp=tuple(prop.tree.n_logp[1:].tolist()),
                emitted=len(emitted) - k,
                draft_s=tt - td,
                target_s=te - tt,
                passes=prop.passes,
                catch_up_s=prop.catch_up_s,
                size=verified.tree.size,
                index=stats.steps,
                tokens=tuple(out),
                beams=tuple(prop.beams),
                stopped_early=prop.stopped_early,
                trimmed=prop.trimmed,
                # accepted nodes from the n-gram branches (ppath[0] is the root)
                ngram_tokens=sum(i >= prop.merged_at for i in ppath[1 : len(out) - k + 1]) if prop.merged_at else 0,
                forced=k,
                logprobs=_picked(raw, path, out, top_logprobs) if top_logprobs is not None else (),
            )
            stats.add(step)
            policy.update(step)
            cancel = False
            if on_step is not None:
                try:
                    cancel = on_step(step) is False
                except Cancelled:
                    cancel = True
            yield out
            if failure is not None:
                raise failure
            if out and out[-1] in eos:
                stats.finish_reason = "stop"
                break
            if cancel and stats.new_tokens < max_new:
                stats.finish_reason = "cancelled"
                break
    finally:
        stats.wall_s = time.perf_counter() - t0
        decode_s = stats.wall_s - stats.prefill_s
        stats.tokens_per_s = stats.new_tokens / decode_s if decode_s > 0 else 0.0


def _graft(prop: Proposal, root: int, forced: list[int]) -> Proposal:
    """The tree the target verifies: the root, then the forced tokens as a chain, then the proposal's tree below
    the last of them (the proposal's root; its node j becomes node len(forced) + j)."""
    t, k = prop.tree, len(forced)
    out = Tree(root, k + t.size, t.device)
    dev = t.device
    chain = torch.arange(k + 1, device=dev)
    out.tokens[1 : k + 1] = torch.tensor(forced, device=dev)
    out.parents[1 : k + 1] = chain[:-1]
    out.depth[: k + 1] = chain
    out.tokens[k + 1 : k + t.size] = t.tokens[1 : t.size]
    out.parents[k + 1 : k + t.size] = t.parents[1 : t.size] + k
    out.depth[k + 1 : k + t.size] = t.depth[1 : t.size] + k
    out.logp[k : k + t.size] = t.logp[: t.size]
    out.size = k + t.size
    return Proposal(out, arm=prop.arm, source=prop.source)


def _picked(raw: Tensor, path: list[int], out: list[int], top: int) -> tuple[TokenLogprob, ...]:
    """The committed tokens' log-probs under the target's own distribution (``raw``: its logits before any grammar
    mask): token i was chosen at node path[i]. The ``top`` most probable tokens at each position are ordered by
    log-prob, then id, so tied tokens come out the same whatever the pass."""
    rows = raw[torch.tensor(path[: len(out)], device=raw.device)].float()  # (T, V)
    lp = torch.log_softmax(rows, dim=-1)
    chosen = lp[torch.arange(len(out), device=raw.device), torch.tensor(out, device=raw.device)].tolist()
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(out)
    if top > 0:
        k = min(top, lp.shape[-1])
        kth = torch.topk(lp, k, dim=-1).values[:, -1:]  # every token at or above it is a candidate (ties too)
        tops = []
        for row, cut in zip(lp, kth):
            ids = torch.nonzero(row >= cut).flatten()
            cand = sorted(zip(ids.tolist(), row[ids].tolist()), key=lambda x: (-x[1], x[0]))
            tops.append(tuple(cand[:k]))
    return tuple(TokenLogprob(t, p, tp) for t, p, tp in zip(out, chosen, tops))


def pass_timer(
    model: Transformer,
    cache: KVCache,
    forward: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor] | None = None,
    context: int = 0,
) -> Callable[[int, int], float]:
    """``time(size, reps)``: the best of a few timed forwards of ``size`` random tokens (uses the cache as scratch).
    ``forward(tokens, positions, slots, mask)``: the pass to time instead of ``model.forward`` over ``cache`` (a
    draft's: its graphed passes on a GPU, which is what its steps run). ``context``: the rows come after that many
    cache slots and attend to them (the cache needs ``context + size`` slots)."""
    dev = model.device
    run = forward or (lambda toks, pos, slots, mask: model.forward(toks, pos, slots, mask, cache))

    def timed(size: int, reps: int) -> float:
        toks, pos, mask = _pass_inputs(model, size, context)
        best, spent, i = float("inf"), 0.0, 0
        while i < reps or (spent < 0.2 and i < 5):  # fast passes: repeat, keep the best (least noisy)
            sync(dev)
            t = time.perf_counter()
            run(toks, pos, pos, mask)
            sync(dev)
            dt = time.perf_counter() - t
            best, spent, i = min(best, dt), spent + dt, i + 1
        return best

    return timed


def _pass_inputs(model: Transformer, size: int, context: int) -> tuple[Tensor, Tensor, Tensor]:
    """Random tokens, positions and causal mask of a pass of ``size`` rows after ``context`` cached slots."""
    dev = model.device
    pos = context + torch.arange(size, device=dev)
    toks = torch.randint(0, model.cfg.vocab_size, (size,), device=dev)
    return toks, pos, torch.arange(context + size, device=dev)[None, :] <= pos[:, None]


def pass_ops(model: Transformer, cache: KVCache, size: int, context: int = 0) -> int:
    """Torch operations plus Triton kernel launches of one forward of ``size`` random rows after ``context`` cache
    slots (the pass :func:`pass_timer` times): an upper bound on the pass's kernel launches (views count too)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from specexec.model import tree_attn

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    toks, pos, mask = _pass_inputs(model, size, context)
    before = tree_attn.launches
    with Count():
        model.forward(toks, pos, pos, mask, cache)
    return Count.ops + tree_attn.launches - before
