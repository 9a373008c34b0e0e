"""The engine: a loaded target (+ optional draft) that generates many times, reusing its KV caches.

It builds what a generation needs -- a proposer for the method (:mod:`specexec.propose`), a budget policy
(:mod:`specexec.policy`) -- and runs the one decode loop (:func:`specexec.decoding.loop.decode`). Methods:
``ar`` (no
proposal), ``chain`` (gamma draft tokens; Leviathan et al. 2023 / Chen et al. 2023), ``specexec`` (a best-first
tree of ``budget`` draft tokens, arXiv 2406.02532; with n-gram branches merged in when ``ngram`` is given) and
``ngram`` (draft-free prompt lookup, merged into a trie).

The committed sequence persists between calls: a new request that extends it (the next chat turn) only
prefills the new suffix -- the longest common prefix of the old and new token ids is reused in both caches.
Across conversations, a prefix cache (:mod:`specexec.model.prefix_store`) keeps snapshots of committed states
that a new prompt would otherwise drop, and restores the one sharing the longest prefix with the next prompt.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import psutil
import torch

from specexec import quiet
from specexec.config import NEEDS_DRAFT, NGRAM_LEN_GPU, ChainConfig, SamplingConfig, TreeConfig, check_method
from specexec.decoding.constraint import Constraint, GrammarState, TokenLogprob, grammar_tokenizer
from specexec.decoding.loop import Cancelled, OnStep, TargetState, decode, pass_timer
from specexec.decoding.text import ChatTemplateError, TextStream, check_stops, encode_text, render_chat
from specexec.errors import ConfigError, InvalidPrompt, OutOfMemory, SpecexecError, setting
from specexec.loading import cpu_probe, invariance
from specexec.loading.checkpoint import TokenizerInfo
from specexec.model import sizes
from specexec.model.joint import JointPasses, KVRegion
from specexec.model.kv_cache import KVCache, common_prefix
from specexec.model.prefix_store import PrefixStore
from specexec.model.transformer import Transformer
from specexec.policy import AdaptiveBudget, BudgetPolicy, PolicyState, measure_costs
from specexec.propose import (
    ChainDraft,
    DraftModel,
    Heads,
    HeadsDraft,
    NGramConfig,
    NGramDraft,
    NoDraft,
    Proposer,
    TargetPrefix,
    TreeDraft,
)
from specexec.propose.ngram import LookupRecord
from specexec.steps.record import PLAIN, Arm, Stats, StepInfo

log = logging.getLogger(__name__)

__all__ = ["Cancelled", "Engine", "Generation", "Result", "ScoreResult", "Stats", "StepInfo"]


def weights_tag(model: Transformer) -> str:
    """What a model's weights are, for the keys of cached pass costs (an int8 target computing in bf16 costs what
    neither a dense bf16 one nor an fp32 one does): its output layer's class and kernel."""
    head = model.globals.lm_head
    return f"{type(head).__name__}:{getattr(head, 'kernel', '')}"


PREFIX_CACHE_MAX = 1 << 30  # the default prefix cache budget: at most 1 GiB ...
PREFIX_CACHE_SHARE = 0.10  # ... and at most this share of the RAM available when the engine starts


def default_prefix_cache_bytes() -> int:
    """The prefix cache's default budget: min(1 GiB, 10% of the available RAM), where its snapshots live (host
    RAM for a GPU engine too)."""
    return int(min(PREFIX_CACHE_MAX, PREFIX_CACHE_SHARE * psutil.virtual_memory().available))


CPU_LANE_ROWS = 64  # the rows of one joint pass on a CPU


MAX_PARALLEL = 4  # the most requests a server generates together by default
LANE_MEMORY_SHARE = 0.25  # ... whose caches fit in this share of the free memory they live in


def lane_bytes(model: Transformer, slots: int) -> int:
    """A lane's KV cache for ``model``: ``slots`` slots of every layer's keys and values."""
    c = model.cfg
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * slots * model.dtype.itemsize


def free_bytes(device: torch.device, cap: int | None = None) -> int:
    """The memory a device's caches can take now: the RAM available, or the free GPU memory within ``cap`` bytes
    of the process's (the user's GPU memory cap; None: none)."""
    if device.type != "cuda":
        return int(psutil.virtual_memory().available)
    free = int(torch.cuda.mem_get_info(device)[0])
    return free if cap is None else max(0, min(free, cap - int(torch.cuda.memory_reserved(device))))


def lane_chunk(device: torch.device, room: int) -> int:
    """The most rows of one joint pass: on a GPU, the rows of one step (``room``), what the memory plan left
    activations room for; on a CPU, also a share of a prompt small enough that the running requests' steps go on
    while it is prefilled (a CPU pass costs about its rows)."""
    return room if device.type == "cuda" else max(CPU_LANE_ROWS, room)


def default_ngram(tree: TreeConfig, device: torch.device) -> NGramConfig | None:
    """The prompt-lookup branches merged into a tree for a target on ``device`` when the caller names none: up to
    :meth:`TreeConfig.ngram_nodes` nodes (None: none), each continuation up to NGRAM_LEN_GPU tokens on a GPU."""
    nodes = tree.ngram_nodes(device)
    if not nodes:
        return None
    return NGramConfig(max_nodes=nodes, max_len=NGRAM_LEN_GPU) if device.type != "cpu" else NGramConfig(max_nodes=nodes)


@dataclass
class Result:
    """A finished generation: decoded text, new token ids, prompt length, stats."""

    text: str
    tokens: list[int]
    prompt_tokens: int
    stats: Stats
    logprobs: list[TokenLogprob] | None = None  # per token of ``tokens``, when asked for (``logprobs=``)

    @property
    def finish_reason(self) -> str:
        return self.stats.finish_reason

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "text": self.text,
            "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
            "stats": self.stats.to_json(),
        }
        if self.logprobs is not None:
            d["logprobs"] = [{"token": lp.token, "logprob": lp.logprob, "top": lp.top} for lp in self.logprobs]
        return d


@dataclass(frozen=True)
class ScoreResult:
    """Teacher-forced scores of a token sequence under the target (:meth:`Engine.score`).

    Entry j is about ``tokens[j]`` = ``ids[start + j]`` given ``ids[: start + j]``: ``logprobs`` (n,) fp32, its
    log-probability in nats (the log-softmax of the target's fp32 logits: temperature 1, no top-k/top-p);
    ``top1`` (n,) the target's greedy choice there (its argmax); ``logits`` (n, V) fp32, when asked for.
    """

    tokens: list[int]
    logprobs: torch.Tensor
    top1: list[int]
    start: int
    logits: torch.Tensor | None = None

    @property
    def nll(self) -> float:
        """The negative log-likelihood of the scored tokens: -sum(logprobs), nats (summed in float64)."""
        return -float(self.logprobs.double().sum())

    @property
    def mean_nll(self) -> float:
        """Nats per scored token."""
        return self.nll / len(self.tokens)

    @property
    def perplexity(self) -> float:
        """exp(mean_nll)."""
        return math.exp(self.mean_nll)

    def to_json(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "tokens": self.tokens,
            "logprobs": self.logprobs.tolist(),
            "top1": self.top1,
            "nll": self.nll,
            "perplexity": self.perplexity,
        }


class Generation:
    """Iterate to receive text pieces as tokens are accepted; ``result`` is set once iteration ends.

    Stopping early is safe between pieces: the engine's caches are consistent there. :meth:`close` cancels
    explicitly; ``result`` then holds what was generated, with finish_reason ``"cancelled"`` (an ``on_step`` hook
    that returns False or raises :class:`Cancelled` ends it the same way). An exception raised inside a step
    (Ctrl-C, or one from the hook) propagates and leaves ``result`` None.
    """

    def __init__(
        self,
        engine: Engine,
        ids: list[int],
        max_new: int,
        proposer: Proposer,
        policy: BudgetPolicy,
        samp: SamplingConfig,
        stats: Stats,
        verify_chunk: int,
        stop: Sequence[str] = (),
        on_step: OnStep | None = None,
        constraint: GrammarState | None = None,
        logprobs: int | None = None,
    ) -> None:
        self.engine, self.ids, self.max_new = engine, ids, max_new
        self.text = TextStream(engine.tokenizer.tokenizer, engine.tokenizer.eos_ids, stop)
        self.proposer, self.policy, self.samp = proposer, policy, samp
        self.stats = stats
        self.verify_chunk = verify_chunk
        self.on_step = on_step
        self.constraint, self.top_logprobs = constraint, logprobs
        self.tokens: list[int] = []
        # per token of ``tokens``, when asked for: the target's log-probs (None: not asked for)
        self.logprobs: list[TokenLogprob] | None = [] if logprobs is not None else None
        self._pending: list[TokenLogprob] = []  # the step in flight's, until its tokens are kept
        self.result: Result | None = None
        self._it: Generator[str, None, None] | None = None

    def __iter__(self) -> Iterator[str]:
        if self._it is None:
            self._it = self._run()
        return self._it

    def close(self) -> None:
        """Cancel: stop after the step in flight (safe at any point between pieces)."""
        if self._it is not None:
            self._it.close()
        if self.result is None:
            self._finish("cancelled")

    def _run(self) -> Generator[str, None, None]:
        e = self.engine
        assert e.state is not None
        steps = decode(
            e.state,
            self.proposer,
            self.policy,
            self.samp,
            self.max_new,
            e.tokenizer.eos_ids,
            self.stats,
            self.verify_chunk,
            on_step=self._step,
            constraint=self.constraint,
            top_logprobs=self.top_logprobs,
        )
        try:
            for new in steps:
                text, stopped = self.text.push(new)
                kept = new[: self.text.n_tokens - len(self.tokens)] if stopped else new
                self.tokens.extend(kept)
                if self.logprobs is not None:
                    self.logprobs.extend(self._pending[: len(kept)])
                if text:
                    yield text
                if stopped:
                    break
            tail = self.text.flush()
            if tail:
                yield tail
            self._finish("stop" if self.text.stopped else None)
        except GeneratorExit:  # closed by the caller between pieces: a clean cancel
            self._finish("cancelled")
            raise
        finally:  # an exception (e.g. Ctrl-C inside a pass) leaves ``result`` None; the caches stay consistent
            steps.close()

    def _step(self, step: StepInfo) -> bool | None:
        self._pending = cast(list[TokenLogprob], list(step.logprobs))  # the decode loop records TokenLogprobs
        return self.on_step(step) if self.on_step is not None else None

    def _finish(self, reason: str | None) -> None:
        if reason is not None:
            self.stats.finish_reason = reason
        self.stats.new_tokens = len(self.tokens)
        self.result = Result(
            text=self.text.text,
            tokens=list(self.tokens),
            prompt_tokens=len(self.ids),
            stats=self.stats,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
        )


def shared_layers(target: Transformer, draft: Transformer | None) -> tuple[int, ...] | None:
    """The target layer of each of ``draft``'s layers when it is derived from ``target`` and can read the target's
    keys/values as its own (same KV heads, head size and device); else None."""
    if draft is None or draft.source_layers is None:
        return None
    t, d = target.cfg, draft.cfg
    src = draft.source_layers
    if len(src) != d.num_layers or (src and max(src) >= t.num_layers):
        return None
    if (t.num_kv_heads, t.head_dim) != (d.num_kv_heads, d.head_dim) or target.device != draft.device:
        return None
    return src


class Engine:
    """A loaded target (+ optional draft) that generates many times, reusing its KV caches.

    ``context`` is the longest committed sequence (prompt + answer) the caches hold. ``static_draft``: run draft
    passes of up to ``static_rows`` tokens padded to static shapes (CUDA graphs on a GPU); None = on CUDA only.
    ``costs_dir``: where the auto budget's measured pass costs are cached per machine and model pair (None: not
    cached); cached costs are reused at the next start and measured again when the steps' costs drift from them.
    ``share_prefix``: a self-derived draft (``draft.source_layers`` set) takes its committed prefix's keys/values
    from the target's cache instead of computing its own (:class:`~specexec.propose.draft_model.TargetPrefix`);
    False: it computes them (for comparisons). Other drafts always compute their own.
    ``invariant``: run the target's passes shape-invariant (:mod:`specexec.loading.invariance`), so every method's
    greedy output is the target's plain greedy decoding token for token; False: the fastest kernel for each
    pass's shape (for benchmarks; output may then differ at near-ties).
    ``prefix_cache_bytes``: the budget of the prefix cache across conversations
    (:mod:`specexec.model.prefix_store`; snapshots in host RAM); None: :func:`default_prefix_cache_bytes`; 0: off.
    """

    def __init__(
        self,
        target: Transformer,
        tokenizer: TokenizerInfo,
        draft: Transformer | None = None,
        context: int = 4096,
        tree: TreeConfig | None = None,
        static_draft: bool | None = None,
        static_rows: int = 128,
        costs_dir: Path | None = None,
        share_prefix: bool = True,
        max_tree: int | None = None,
        invariant: bool = True,
        prefix_cache_bytes: int | None = None,
    ) -> None:
        if prefix_cache_bytes is not None and prefix_cache_bytes < 0:
            raise ConfigError("prefix_cache_bytes", prefix_cache_bytes, "must be >= 0 (0: no prefix cache)")
        if context > target.cfg.max_position_embeddings:
            log.warning(
                "context %d exceeds the model's max_position_embeddings %d", context, target.cfg.max_position_embeddings
            )
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        self.costs_dir = costs_dir
        self.invariance = invariance.apply(target, invariant, home=self._home())
        self.draft_weights: str | None = None  # the draft's weight format, as specexec.load chose it (int8, ...)
        self.target_weights: str | None = None  # the target's low-bit format when it has one (int8 on a CPU)
        self.heads: Heads | None = None  # Medusa-style heads on the target (method "heads"; specexec.load sets them)
        # the largest tree the memory plan left room for (specexec.load lowers --max-budget to fit a streamed
        # target): auto trees are capped at it, a bigger fixed budget is refused; None: no cap
        self.max_tree = max_tree
        self.context = context
        self.state: TargetState | None = None
        self.draft_model: DraftModel | None = None
        budget = default_prefix_cache_bytes() if prefix_cache_bytes is None else prefix_cache_bytes
        self.prefix_cache = PrefixStore(budget)  # snapshots of committed states other prompts dropped
        self._tree_room = 0
        self._draft_room = 0
        self.lane: int | None = None  # this engine's lane among several concurrent ones (:meth:`lanes`); None: alone
        self.joint: JointPasses | None = None  # the lanes' pass rendezvous
        self.gpu_cap: int | None = None  # the GPU memory the user capped the process at (bytes; lanes stay inside)
        # what the budget policies measured and learnt (costs, rates), kept across generations
        self.policies = PolicyState(costs_dir)
        self._lookup = LookupRecord()  # what prompt lookup measured on earlier texts: a new text's prior
        self._static = (static_draft, static_rows)
        self._grammar_tokenizer: Any = None
        self.costs_dir = costs_dir
        self.share_prefix = share_prefix and shared_layers(target, draft) is not None
        tree = tree or TreeConfig()
        # with the n-gram branches a generation merges by default, so its first step does not reallocate the caches
        self._ensure_room(tree, ChainConfig(), default_ngram(tree, target.device) if draft is not None else None)

    # -- read-only views (tests, tools) ---------------------------------------------------------------------------
    @property
    def seq(self) -> list[int]:
        """The committed sequence (prompt + answer so far); its last token is not in any cache yet."""
        return list(self.state.seq) if self.state else []

    @property
    def target_cache(self):
        return self.state.cache if self.state else None

    def prefix_cache_info(self) -> dict[str, Any]:
        """The prefix cache across conversations: ``entries``, ``bytes`` held, ``budget_bytes`` (0: off), ``hits``
        (generations that restored a snapshot) and ``restored_tokens`` (prompt tokens they did not recompute)."""
        return self.prefix_cache.info()

    # -- the prefix cache across conversations --------------------------------------------------------------------
    def _save_live(self) -> None:
        """Snapshot the live committed state into the prefix cache (before something drops it): the target's
        entries, and the draft's when it keeps its own (a draft sharing the target's prefix copies it again)."""
        st = self.state
        if st is None or not self.prefix_cache.enabled or st.t_len == 0:
            return
        tokens = st.seq[: st.t_len]
        dm = self.draft_model
        own = dm is not None and dm.prefix is None
        d_len = common_prefix(dm.tokens, tokens) if dm is not None and own else 0
        self.prefix_cache.save(tokens, st.cache, dm.cache if dm is not None and own else None, d_len)

    def save_live(self) -> None:
        """Keep the committed sequence in the prefix cache too (another lane may get this conversation next)."""
        self._save_live()

    def _forget_live(self) -> None:
        """Forget the live committed sequence (the prefix cache's snapshots stay)."""
        if self.state:
            self.state.reset()
        if self.draft_model:
            self.draft_model.reset()

    def _restore(self, ids: list[int]) -> int:
        """Before adopting ``ids``: when a snapshot shares more of ``ids[:-1]`` than the live caches do, copy its
        entries into them. Returns the tokens restored beyond what the live target cache already shared."""
        st = self.state
        store = self.prefix_cache
        if st is None or not len(store):
            return 0
        need = ids[:-1]
        snap, n = store.best(need)
        live = common_prefix(st.seq[: st.t_len], need)
        if snap is None or n <= live:
            return 0
        snap.restore(st.cache, n)
        st.seq, st.t_len = list(need[:n]), n
        dm = self.draft_model
        if dm is not None and dm.prefix is None:
            m = min(n, snap.draft_len)
            if m > common_prefix(dm.tokens, need):
                snap.restore_draft(dm.cache, m)
                dm.adopt_restored(need[:m])
        store.used(snap, n - live)
        return n - live

    # -- capacity -----------------------------------------------------------------------------------------------
    @staticmethod
    def _rooms(tree: TreeConfig, chain: ChainConfig, ngram: NGramConfig | None) -> tuple[int, int]:
        """The slots a step needs past the committed tokens: in the target's cache, and in the draft's (which also
        holds every expanded node: max_beams a level beyond the tree)."""
        room = sizes.step_room(tree, chain, ngram.max_nodes if ngram is not None else 0)
        return room, room + tree.largest + tree.max_beams

    def _ensure_room(self, tree: TreeConfig, chain: ChainConfig, ngram: NGramConfig | None) -> None:
        """(Re)allocate caches so a step of this tree size fits after ``context`` committed tokens."""
        room, draft_room = self._rooms(tree, chain, ngram)
        if self.state is not None and room <= self._tree_room and draft_room <= self._draft_room:
            return
        if self.lane is not None:  # a lane's region of the pooled caches is sized once, for the server's settings
            raise ConfigError(
                "tree", room, f"needs {room} cache slots a step; the lanes were sized for {self._tree_room}"
            )
        self._save_live()  # the new caches start empty
        if self.state is None or room > self._tree_room:
            self._tree_room = room
            self.state = None  # free the old cache before allocating the new one
            self.state = TargetState(self.target, self.context + room)
            self.policies.forget_cost_model()
        if self.draft is not None:
            self._draft_room = max(draft_room, self._draft_room)
            self.draft_model = None
            self.draft_model = DraftModel(
                self.draft,
                self.context + self._draft_room,
                static=self._static[0],
                static_rows=self._static[1],
            )
            self._link_prefix()

    def lanes(
        self, n: int, tree: TreeConfig | None = None, chain: ChainConfig | None = None, chunk: int | None = None
    ) -> list[Engine]:
        """``n`` engines that generate concurrently, each in its own thread, their passes packed into joint passes
        (:mod:`specexec.model.joint`): each has its own committed sequence in a region of one pooled cache per
        model, sized for ``tree`` / ``chain``; they share the models, the prefix cache and what the policies
        measured. ``chunk``: the most rows of one joint pass (a prompt is prefilled over several rounds beside
        the others' steps; default :func:`lane_chunk`). This engine's own
        caches are freed (they come back at its next use)."""
        if n < 1:
            raise ConfigError("parallel", n, "must be >= 1")
        tree = self._capped(tree or TreeConfig())
        chain = chain or ChainConfig()
        ngram = default_ngram(tree, self.target.device) if self.draft is not None else None
        room, draft_room = self._rooms(tree, chain, ngram)
        t_cap, d_cap = self.context + room, self.context + draft_room + 1
        self._save_live()
        self.state, self.draft_model = None, None  # freed first: the pools may take their place
        each = lane_bytes(self.target, t_cap) + (lane_bytes(self.draft, d_cap) if self.draft is not None else 0)
        free = free_bytes(self.target.device, self.gpu_cap)
        if n * each > free:
            fit = int(free // each)
            where = "GPU memory" if self.target.device.type == "cuda" else "RAM"
            raise OutOfMemory(
                f"{setting('parallel', n)} needs {n * each / 1e9:.1f} GB of {where} for its KV caches "
                f"({each / 1e6:,.0f} MB a request at {setting('context', self.context)}) and {free / 1e9:.1f} GB is "
                f"free: use {setting('parallel', max(fit, 1))} or a smaller {setting('context')}",
                where,
                n * each,
                int(free),
            )
        joint = JointPasses(lane_chunk(self.target.device, room) if chunk is None else chunk)
        c = self.target.cfg
        t_pool = KVCache(c.num_layers, c.num_kv_heads, n * t_cap, c.head_dim, self.target.dtype, self.target.device)
        d_pool = None
        if self.draft is not None:
            d = self.draft.cfg
            d_pool = KVCache(d.num_layers, d.num_kv_heads, n * d_cap, d.head_dim, self.draft.dtype, self.draft.device)
        out = []
        for i in range(n):
            e = copy.copy(self)
            e.lane, e.joint = i, joint
            e._tree_room, e._draft_room = room, draft_room
            e.state = TargetState(self.target, t_cap, KVRegion(t_pool, i * t_cap, t_cap, joint))
            if self.draft is not None:
                assert d_pool is not None
                # eager passes: a lane's draft passes pack with the other lanes' (no per-lane captured graphs)
                e.draft_model = DraftModel(self.draft, d_cap - 1, static=False,
                                           cache=KVRegion(d_pool, i * d_cap, d_cap, joint))  # fmt: skip
                e._link_prefix()
            out.append(e)
        return out

    def default_parallel(self, tree: TreeConfig | None = None, chain: ChainConfig | None = None) -> int:
        """How many requests a server runs together by default: the lanes whose caches fit in a share of the memory
        they live in (:data:`LANE_MEMORY_SHARE` of the available RAM, or of the free GPU memory), at most
        :data:`MAX_PARALLEL`; 1 where passes cannot pack (a target that is not row-invariant)."""
        if not self.target.row_invariant():
            return 1
        tree = self._capped(tree or TreeConfig())
        ngram = default_ngram(tree, self.target.device) if self.draft is not None else None
        room, draft_room = self._rooms(tree, chain or ChainConfig(), ngram)
        need = lane_bytes(self.target, self.context + room)
        if self.draft is not None:
            need += lane_bytes(self.draft, self.context + draft_room + 1)
        free = free_bytes(self.target.device, self.gpu_cap)
        return max(1, min(MAX_PARALLEL, int(LANE_MEMORY_SHARE * free // max(need, 1))))

    def _link_prefix(self) -> None:
        """Point the draft at the target's cache for its committed prefix (``share_prefix``), or unlink it."""
        if self.draft_model is None or self.state is None:
            return
        layers = shared_layers(self.target, self.draft)
        on = self.share_prefix and layers is not None
        state = self.state
        self.draft_model.share_prefix(TargetPrefix(state.cache, layers, state.held) if on and layers else None)

    def set_share_prefix(self, on: bool) -> None:
        """Turn the self-derived draft's shared KV prefix on or off (it stays off for a draft that cannot share);
        the draft's cached prefix is dropped either way."""
        self.share_prefix = on and shared_layers(self.target, self.draft) is not None
        self._link_prefix()

    def _home(self) -> Path | None:
        """The cache root the measured costs live under (None: the default one)."""
        return self.costs_dir.parent if self.costs_dir is not None else None

    def set_invariant(self, on: bool) -> None:
        """Switch the target between shape-invariant passes and the fastest kernels for each pass's shape (see
        ``invariant`` above). Pass costs measured and budget rates learnt are kept per mode (they differ between
        the two), so switching back finds them again."""
        if on == (self.target.tiling is not None):
            return
        self.policies.switch_mode(on)
        self.invariance = invariance.apply(self.target, on, home=self._home())
        self.prefix_cache.clear()  # computed by the other mode's kernels: not what this mode would compute

    def reset(self) -> None:
        """Forget the committed sequence and the prefix cache's snapshots: the next generation starts cold."""
        self._forget_live()
        self.prefix_cache.clear()

    # -- public API ---------------------------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """Prompt text (raw, or one user message through the chat template) or ids → token ids."""
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        tok = self.tokenizer.tokenizer
        if chat:  # the text layer's rendering: the same ids as a chat session's / the server's for one message
            if not getattr(tok, "chat_template", None):
                raise ChatTemplateError(f"{setting('chat')} needs a chat template, and this tokenizer has none")
            return render_chat(tok, [{"role": "user", "content": prompt}])
        return encode_text(tok, prompt)

    def stream(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 256,
        method: str | None = None,
        sampling_cfg: SamplingConfig | None = None,
        tree: TreeConfig | None = None,
        chain: ChainConfig | None = None,
        chat: bool = False,
        ngram: NGramConfig | None = None,
        policy: BudgetPolicy | None = None,
        stop: Sequence[str] = (),
        on_step: OnStep | None = None,
        constraint: Constraint | None = None,
        logprobs: int | None = None,
    ) -> Generation:
        """Start a generation; iterate the returned object for text pieces, then read ``.result``.

        ``ngram``: prompt-lookup settings -- for ``method="ngram"`` the proposals themselves, for ``specexec``
        extra branches merged into the draft's tree (None: the tree config's ``ngram`` nodes, by default
        :data:`~specexec.config.NGRAM_NODES_GPU` on a GPU; see :meth:`TreeConfig.ngram_nodes`). ``policy``: a
        budget policy to use instead of the tree config's (fixed or auto), e.g. one with known costs. ``stop``:
        stop strings; the text ends right before the first one (not included) and finish_reason is "stop".
        ``on_step``: called with a :class:`~specexec.steps.record.StepInfo` after every step; returning False (or
        raising
        :class:`~specexec.decoding.loop.Cancelled`) ends the generation after that step, as :meth:`Generation.close`
        does
        (finish_reason "cancelled"). ``constraint``: the output follows this grammar (JSON mode, a JSON schema, a
        regex, a Lark/GBNF grammar; :mod:`specexec.decoding.constraint`), exactly as constrained plain decoding
        would, whatever the method. ``logprobs``: record each token's target log-prob in the generation's
        ``logprobs`` (and the result's), with the ``logprobs`` most probable tokens at each position (0: none).
        """
        method = method or ("specexec" if self.draft is not None else "heads" if self.heads is not None else "ar")
        check_method(method)
        stops = check_stops(stop)
        if method in NEEDS_DRAFT and self.draft is None:
            raise SpecexecError(f"{setting('method', method)} needs a draft model: pass {setting('draft')}")
        if method == "heads" and self.heads is None:
            raise SpecexecError(f"{setting('method', method)} needs trained heads: pass {setting('draft', 'heads')}")
        ids = self.encode(prompt, chat)
        if not ids:
            raise InvalidPrompt("the prompt is empty")
        if max_new_tokens < 1:
            raise ConfigError("max_new_tokens", max_new_tokens, "must be >= 1")
        if len(ids) >= self.context:
            raise InvalidPrompt(f"the prompt has {len(ids)} tokens but the context holds {self.context}")
        if len(ids) + max_new_tokens > self.context:
            raise SpecexecError(
                f"prompt ({len(ids)} tokens) + {setting('max_new_tokens', max_new_tokens)} exceeds the context "
                f"({self.context}); lower {setting('max_new_tokens')} or raise {setting('context')}"
            )
        if max(ids) >= self.target.cfg.vocab_size or min(ids) < 0:
            raise SpecexecError("prompt token ids out of the model's vocabulary")
        tree, chain = self._capped(tree or TreeConfig()), chain or ChainConfig()
        if method == "ngram":
            ngram = ngram or NGramConfig()
        elif method in ("specexec", "heads") and ngram is None:
            ngram = default_ngram(tree, self.target.device)
        st = self.state
        if st is not None and common_prefix(st.seq[: st.t_len], ids[:-1]) < st.t_len:
            # another conversation: adopting ``ids`` drops the live state's tail. The snapshot ``ids`` will resume
            # becomes the most recently used first, so saving the live state does not evict it
            self.prefix_cache.touch_best(ids[:-1])
            self._save_live()
        self._ensure_room(tree, chain, ngram)
        samp = sampling_cfg or SamplingConfig()
        if logprobs is not None and not 0 <= logprobs <= 20:
            raise ConfigError("logprobs", logprobs, "must be between 0 and 20")
        grammar = self.grammar(constraint) if constraint is not None else None
        stats = Stats(method=method)
        proposer, chosen = self._plan(method, tree, chain, ngram, stats, constrained=constraint is not None)
        policy = policy or chosen
        assert self.state is not None
        stats.restored_tokens = self._restore(ids)
        self.state.adopt(ids)
        return Generation(
            self,
            ids,
            max_new_tokens,
            proposer,
            policy,
            samp,
            stats,
            tree.verify_chunk,
            stops,
            on_step=on_step,
            constraint=grammar,
            logprobs=logprobs,
        )

    def grammar(self, constraint: Constraint) -> GrammarState:
        """A fresh matcher for ``constraint`` over this engine's tokenizer (raises ConstraintError if it does not
        compile). The tokenizer's grammar view is built once per engine (about a second)."""
        if self._grammar_tokenizer is None:
            eos = sorted(self.tokenizer.eos_ids)
            self._grammar_tokenizer = grammar_tokenizer(self.tokenizer.tokenizer, self.target.cfg.vocab_size, eos)
        return GrammarState(constraint, self._grammar_tokenizer, self.target.cfg.vocab_size, self.tokenizer.eos_ids)

    def _capped(self, tree: TreeConfig) -> TreeConfig:
        """``tree`` within :attr:`max_tree`: an auto tree's ``max_budget`` lowered to it; a bigger fixed budget
        refused (its caches would not fit beside the streamed target)."""
        cap = self.max_tree
        if cap is None or tree.largest <= cap:
            return tree
        if tree.auto:
            return replace(tree, max_budget=cap, budget=min(tree.budget, cap))
        raise ConfigError(
            "TreeConfig.budget",
            tree.budget,
            f"exceeds the {cap} the memory plan left room for",
            f"{setting('TreeConfig.budget', tree.budget)} exceeds the largest tree the GPU memory plan left room for "
            f"({cap}); use {setting('TreeConfig.budget', cap)} or less",
        )

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 256, **kw: Any) -> Result:
        """Run a generation to the end (see :meth:`stream`)."""
        g = self.stream(prompt, max_new_tokens, **kw)
        for _ in g:
            pass
        assert g.result is not None
        return g.result

    def score(
        self,
        text: str | Sequence[int],
        start: int = 1,
        chat: bool = False,
        chunk: int = 512,
        logits: bool = False,
    ) -> ScoreResult:
        """Teacher-forced scores: the target's log-probability of each token of ``text`` (or ids) given the tokens
        before it, e.g. a text's perplexity under this target's weight format against another's.

        ``start``: the first scored index (1: every token but the first, which has nothing before it;
        ``len(prompt_ids)`` on prompt + answer ids: the answer's tokens only). The target reads the ids in passes
        of ``chunk`` tokens (a prefill's causal passes; only the scored rows' logits are kept, about 4 x ``chunk``
        x vocabulary bytes at a time) in the engine's pass dtype; with shape-invariant passes (the default) each
        position's logits are bit-identical to the ones plain decoding computes there, whatever ``chunk``.
        ``logits``: keep the scored rows' logits too. At most :attr:`context` ids. The passes use the target's
        KV cache: the committed sequence is forgotten (saved to the prefix cache first, when it has one).
        """
        ids = self.encode(text, chat)
        if len(ids) > self.context:
            raise InvalidPrompt(f"the text has {len(ids)} tokens but the context holds {self.context}")
        if not 1 <= start < len(ids):
            raise ConfigError("start", start, f"must be in 1..{len(ids) - 1} (the text has {len(ids)} tokens)")
        if chunk < 1:
            raise ConfigError("chunk", chunk, "must be >= 1")
        if max(ids) >= self.target.cfg.vocab_size or min(ids) < 0:
            raise SpecexecError("token ids out of the model's vocabulary")
        self._save_live()
        self._forget_live()
        if self.state is None:  # freed for lanes (:meth:`lanes`): this engine's own caches come back
            self._ensure_room(TreeConfig(), ChainConfig(), None)
        assert self.state is not None
        dev = self.target.device
        x = torch.tensor(ids, device=dev)
        lps, tops, kept = [], [], []
        with torch.inference_mode():
            for a in range(0, len(ids) - 1, chunk):  # row i of a pass predicts ids[i + 1]
                b = min(a + chunk, len(ids) - 1)
                pos = torch.arange(a, b, device=dev)
                mask = torch.arange(b, device=dev)[None, :] <= pos[:, None]
                first = max(start - 1, a) - a  # rows before it are only read into the cache
                rows = slice(first, None) if first < b - a else slice(-1, None)
                out = self.target.forward(x[a:b], pos, pos, mask, self.state.cache, logits_rows=rows)
                if first >= b - a:
                    continue
                lp = torch.log_softmax(out.float(), dim=-1)
                lps.append(lp.gather(-1, x[a + first + 1 : b + 1, None])[:, 0])
                tops.append(out.argmax(-1))
                if logits:
                    kept.append(out.float())
        return ScoreResult(
            tokens=ids[start:],
            logprobs=torch.cat(lps).cpu(),
            top1=torch.cat(tops).tolist(),
            start=start,
            logits=torch.cat(kept) if logits else None,
        )

    # -- what a generation runs with ------------------------------------------------------------------------------
    def _plan(
        self,
        method: str,
        tree: TreeConfig,
        chain: ChainConfig,
        ngram: NGramConfig | None,
        stats: Stats,
        constrained: bool = False,
    ) -> tuple[Proposer, BudgetPolicy]:
        """The proposer and budget policy for a generation. A constrained generation's measured-rate policy learns
        its own arm rates: forced tokens and masked drafts change what each arm yields."""
        dev = self.target.device
        learnt = f"{method}+grammar" if constrained else method
        pol = self.policies
        if method == "ar":
            return NoDraft(dev), pol.fixed(PLAIN)
        if method == "heads":
            assert self.heads is not None
            g = self.target.globals
            lookup = NGramDraft(dev, ngram, self._lookup) if ngram is not None else None
            heads = HeadsDraft(self.heads, g.lm_head, g.embed, dev, lookup)
            if tree.auto:  # measured choice between plain AR or prompt lookup's trie (0) and head trees of a few sizes
                stats.budget_auto = True
                return heads, self._adaptive_policy(learnt, pol.head_arms(tree.max_budget), tree, stats)
            return heads, pol.fixed(Arm.nodes(tree.budget))
        if method == "ngram":
            assert ngram is not None
            if tree.auto:  # measured choice between plain AR (0) and tries of a few sizes
                stats.budget_auto = True
                arms = pol.ngram_arms(ngram.max_nodes)
                return NGramDraft(dev, ngram, self._lookup), self._adaptive_policy(learnt, arms, tree, stats)
            return NGramDraft(dev, ngram, self._lookup), pol.fixed(Arm.nodes(ngram.max_nodes))
        assert self.draft_model is not None
        if method == "chain":
            stats.gamma = chain.gamma
            return ChainDraft(self.draft_model, chain.gamma), pol.fixed(Arm.nodes(chain.gamma))
        stats.budget, stats.budget_auto = Arm.nodes(tree.budget), tree.auto
        if not tree.auto:
            merged = NGramDraft(dev, ngram, self._lookup) if ngram is not None else None
            return TreeDraft(self.draft_model, tree, merged), pol.fixed_tree(Arm.nodes(tree.budget), tree.max_depth)
        if self._measured_policy():
            # a compute-bound verifier: choose per step, by measured tokens/s, among no draft (n-gram trie or
            # AR), chains and small trees; n-gram continuations are merged into every tree
            arms = pol.cpu_arms(tree.max_budget)
            # one n-gram index, merged into trees and chains alike (a chain's tree runs on along a continuation)
            lookup = NGramDraft(dev, ngram, self._lookup) if ngram is not None else None  # (--ngram-nodes 0: none)
            chains = ChainDraft(self.draft_model, pol.longest_chain(), lookup)
            # the draft reads the prompt only when the policy first asks for it (the policy weighs that cost)
            proposer = TreeDraft(self.draft_model, tree, lookup, chains, lazy=True)
            return proposer, self._adaptive_policy(learnt, arms, tree, stats, draft=True)
        merged = NGramDraft(dev, ngram, self._lookup) if ngram is not None else None
        proposer = TreeDraft(self.draft_model, tree, merged)
        # once per engine (and cache size), before the caches hold anything; again when the steps' costs drift
        policy, spent = pol.cost_model(tree, self._costs_key(tree), lambda: self._measure_costs(tree))
        if spent is not None:
            stats.costs_s = spent
        return proposer, policy

    def _adaptive_policy(
        self, method: str, arms: tuple[Arm, ...], tree: TreeConfig, stats: Stats, draft: bool = False
    ) -> AdaptiveBudget:
        """The engine's measured-rate policy for these arms (see :meth:`PolicyState.adaptive`); with ``draft``, its
        curve of the draft's pass costs is measured too."""
        policy, spent = self.policies.adaptive(
            method,
            arms,
            max_depth=tree.max_depth,
            heads_depth=self.heads.k if self.heads is not None else 0,
            verify_prior=lambda: self._pass_prior(draft=False),
            draft_prior=(lambda: self._pass_prior(draft=True)) if draft else None,
        )
        if spent is not None:
            stats.costs_s = spent
        return policy

    def _pass_prior(self, draft: bool) -> dict[int, float]:
        """The target's pass seconds at a few small sizes (what trimming a proposal weighs), or the draft's (what its
        catch-ups cost), measured once per machine and model (cached by the policies). Uses the caches as scratch:
        the live committed state is saved to the prefix cache, then dropped."""
        assert self.state is not None
        dm = self.draft_model
        model = dm.model if draft and dm is not None else self.target
        key = (model.device, model.cfg, model.dtype, weights_tag(model), model.tiling)

        def measure(sizes: Sequence[int]) -> dict[int, float]:
            assert self.state is not None
            self._save_live()  # the passes below use the caches as scratch
            if draft and dm is not None:  # the draft's own passes, as its steps run them
                timer, capacity = pass_timer(dm.model, dm.cache, dm.forward), dm.usable
            else:
                timer, capacity = pass_timer(self.target, self.state.cache), self.state.cache.capacity
            with quiet.watch() as seen:
                timer(1, 1)  # warm-up
                points = {n: timer(n, 2) for n in sizes if n <= capacity}
            self._forget_live()
            if model.device.type == "cpu" and 1 in points:  # a quiet one-row pass checks the format probe's figures
                cpu_probe.check_pass(model, "draft" if draft else "target", points[1], seen.load)
            return points

        return self.policies.pass_prior("draft" if draft else "verify", key, measure)

    def _measured_policy(self) -> bool:
        """--budget auto on a CPU: the measured per-step choice (AdaptiveBudget); elsewhere the cost model."""
        return self.target.device.type == "cpu"

    def _costs_key(self, tree: TreeConfig) -> tuple[object, ...]:
        """What the cost model's pass costs depend on: the machine's device, both models, the tree limits and the
        cache size."""
        assert self.draft is not None
        return (
            self.target.device,
            self.target.cfg,
            self.draft.cfg,
            self.target.dtype,
            weights_tag(self.target),
            self.target.tiling,
            self.draft.dtype,
            weights_tag(self.draft),
            tree.max_budget,
            tree.max_beams,
            self.context + self._tree_room,
            "draft passes as run",  # costs measured before the draft was timed through its graphed passes differ
        )

    def _measure_costs(self, tree: TreeConfig) -> tuple[dict[int, float], dict[int, float]]:
        """Time a few target passes (tree sizes) and draft passes (beam counts) for the cost model.

        Uses the caches as scratch: the live committed state is saved to the prefix cache first, then dropped.
        """
        assert self.draft_model is not None and self.state is not None
        self._save_live()  # the passes below use the caches as scratch
        t_time = pass_timer(self.target, self.state.cache)
        # the draft's own passes (graphed on a GPU): timing its model eagerly overstates what its graphed steps take
        # several times over, and the drift check would then measure again every generation
        d_time = pass_timer(self.draft_model.model, self.draft_model.cache, self.draft_model.forward)
        t_time(1, 1)  # warm-up
        d_time(1, 1)
        t_s, d_s = measure_costs(lambda n: t_time(n, 1), lambda n: d_time(n, 2), tree.max_budget, tree.max_beams)
        self._forget_live()
        return t_s, d_s
