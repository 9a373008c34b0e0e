"""The decode loop: prefix-cached prefill, then steps of draft → ONE target pass → acceptance → cache compaction.

Three methods share one loop. Every step verifies a tree rooted at the pending token (the last emitted token,
in neither KV cache yet): ``ar`` verifies the root alone (plain autoregressive decoding), ``chain`` a chain of
gamma draft tokens (Leviathan et al. 2023 / Chen et al. 2023), ``specexec`` a best-first tree of ``budget``
draft tokens (arXiv 2406.02532). After each step both caches are compacted in place to prefix + accepted path.

The committed sequence persists between calls: a new request that extends it (the next chat turn) only
prefills the new suffix — the longest common prefix of the old and new token ids is reused in both caches.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterator, Sequence

import torch

from specexec import sampling
from specexec.accept import accept
from specexec.budget import AutoBudget, StepCosts, calibrate
from specexec.config import ChainConfig, SamplingConfig, TreeConfig, check_method
from specexec.draft import Drafter
from specexec.errors import ConfigError, InvalidPrompt, SpecexecError, setting
from specexec.loading import TokenizerInfo
from specexec.model import Transformer
from specexec.tree import Tree
from specexec.verify import commit_target, score_tree

log = logging.getLogger(__name__)


@dataclass
class Stats:
    """What one generation did. Seconds are wall-clock; tokens_per_s counts decoding only (prefill excluded)."""

    method: str
    steps: int = 0  # target verification passes (prefill excluded)
    new_tokens: int = 0
    tokens_per_step: float = 0.0
    tokens_per_s: float = 0.0
    draft_s: float = 0.0
    target_s: float = 0.0
    wall_s: float = 0.0
    prefill_s: float = 0.0
    prefill_tokens: int = 0  # prompt tokens actually processed (the rest came from the prefix cache)
    calibration_s: float = 0.0  # auto budget: one-time cost measurement (excluded from wall_s)
    budget: int | None = None  # specexec: the budget (auto: the one chosen most often)
    budgets: dict[int, int] = field(default_factory=dict)  # specexec: budget -> steps that used it
    budget_auto: bool = False
    gamma: int | None = None
    mean_tree_size: float = 0.0
    draft_passes: int = 0
    early_stops: int = 0  # specexec: trees whose growth the early-stop rule ended before max_depth
    accepted_hist: dict[int, int] = field(default_factory=dict)  # tokens emitted per step -> count
    tree_shapes: list[list[int]] = field(default_factory=list)  # tokens per draft pass, per step

    def to_json(self, shapes: bool = False) -> dict[str, Any]:
        d = asdict(self)
        d["accepted_hist"] = {str(k): v for k, v in sorted(self.accepted_hist.items())}
        d["budgets"] = {str(k): v for k, v in sorted(self.budgets.items())}
        if not shapes:
            d.pop("tree_shapes")
        return d


@dataclass
class Result:
    """A finished generation: decoded text, new token ids, prompt length, stats."""

    text: str
    tokens: list[int]
    prompt_tokens: int
    stats: Stats

    def to_json(self) -> dict[str, Any]:
        return {"text": self.text, "tokens": self.tokens, "prompt_tokens": self.prompt_tokens,
                "stats": self.stats.to_json()}


class Generation:
    """Iterate to receive text pieces as tokens are accepted; ``result`` is set once iteration ends."""

    def __init__(self, engine: "Engine", ids: list[int], max_new: int, method: str, samp: SamplingConfig,
                 tree: TreeConfig, chain: ChainConfig) -> None:
        self.engine, self.ids, self.max_new, self.method = engine, ids, max_new, method
        self.samp, self.tree, self.chain = samp, tree, chain
        self.tokens: list[int] = []
        self.result: Result | None = None
        self.stats = Stats(method=method)

    def __iter__(self) -> Iterator[str]:
        tok = self.engine.tokenizer.tokenizer
        shown = ""
        for new in self.engine._decode(self):
            self.tokens.extend(new)
            text = self._text(tok)
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
                continue
            if len(text) > len(shown) and text.startswith(shown):
                yield text[len(shown):]
            shown = text
        final = self._text(tok)
        if len(final) > len(shown) and final.startswith(shown):
            yield final[len(shown):]
        self.result = Result(text=final, tokens=list(self.tokens), prompt_tokens=len(self.ids), stats=self.stats)

    def _text(self, tok: Any) -> str:
        body = [t for t in self.tokens if t not in self.engine.tokenizer.eos_ids]
        return tok.decode(body, skip_special_tokens=True)


class Engine:
    """A loaded target (+ optional draft) that generates many times, reusing its KV caches.

    ``context`` is the longest committed sequence (prompt + answer) the caches hold.
    """

    def __init__(self, target: Transformer, tokenizer: TokenizerInfo, draft: Transformer | None = None,
                 context: int = 4096, tree: TreeConfig | None = None) -> None:
        if context > target.cfg.max_position_embeddings:
            log.warning("context %d exceeds the model's max_position_embeddings %d", context,
                        target.cfg.max_position_embeddings)
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        self.context = context
        self.seq: list[int] = []  # committed tokens; the last one is pending (in no cache yet)
        self.t_len = 0  # seq[:t_len] is in the target cache
        self._t_cache = None
        self._drafter: Drafter | None = None
        self._tree_room = 0
        self._auto: AutoBudget | None = None
        self._costs = StepCosts()  # fixed budgets: measured step costs for the draft's early stop
        self._ensure_room(tree or TreeConfig(), ChainConfig())

    # -- capacity -----------------------------------------------------------------------------------------------
    def _ensure_room(self, tree: TreeConfig, chain: ChainConfig) -> None:
        """(Re)allocate caches so a step of this tree size fits after ``context`` committed tokens."""
        room = max(tree.largest, chain.gamma) + 2
        if self._t_cache is not None and room <= self._tree_room:
            return
        self._tree_room = room
        self._t_cache = None  # free the old cache before allocating the new one
        self._t_cache = self.target.new_cache(self.context + room)
        self.t_len = 0
        self._auto = None
        if self.draft is not None:
            extra = room + tree.largest + tree.max_beams
            self._drafter = Drafter(self.draft, self.context + extra)

    def reset(self) -> None:
        """Forget the committed sequence (the caches' contents become unused)."""
        self.seq, self.t_len = [], 0
        if self._drafter:
            self._drafter.reset()

    # -- public API ---------------------------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """Prompt text (raw, or one user message through the chat template) or ids → token ids."""
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        tok = self.tokenizer.tokenizer
        if chat:
            if not getattr(tok, "chat_template", None):
                raise SpecexecError(f"{setting('chat')} needs a chat template, and this tokenizer has none")
            return list(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False))
        return list(tok(prompt, add_special_tokens=True)["input_ids"])

    def stream(self, prompt: str | Sequence[int], max_new_tokens: int = 256, method: str | None = None,
               sampling_cfg: SamplingConfig | None = None, tree: TreeConfig | None = None,
               chain: ChainConfig | None = None, chat: bool = False) -> Generation:
        """Start a generation; iterate the returned object for text pieces, then read ``.result``."""
        method = method or ("specexec" if self.draft is not None else "ar")
        check_method(method)
        if method != "ar" and self.draft is None:
            raise SpecexecError(f"{setting('method', method)} needs a draft model: pass {setting('draft')}")
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
        tree, chain = tree or TreeConfig(), chain or ChainConfig()
        self._ensure_room(tree, chain)
        return Generation(self, ids, max_new_tokens, method, sampling_cfg or SamplingConfig(), tree, chain)

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 256, **kw: Any) -> Result:
        """Run a generation to the end (see :meth:`stream`)."""
        g = self.stream(prompt, max_new_tokens, **kw)
        for _ in g:
            pass
        assert g.result is not None
        return g.result

    # -- the loop -----------------------------------------------------------------------------------------------
    def _sync(self) -> None:
        if self.target.device.type == "cuda":
            torch.cuda.synchronize(self.target.device)

    def _adopt(self, ids: list[int]) -> None:
        """Make ``ids`` the committed sequence, keeping the cached common prefix (excluding the pending token)."""
        def lcp(a: list[int], b: list[int]) -> int:
            n = 0
            for x, y in zip(a, b):
                if x != y:
                    break
                n += 1
            return n

        self.t_len = lcp(self.seq[: self.t_len], ids[:-1])
        if self._drafter is not None:
            self._drafter.length = lcp(self.seq[: self._drafter.length], ids[:-1])
        self.seq = list(ids)

    def _prefill(self) -> int:
        """Process the committed tokens the target cache lacks (all but the pending one)."""
        n = len(self.seq) - 1
        todo = n - self.t_len
        if todo > 0:
            dev = self.target.device
            pos = torch.arange(self.t_len, n, device=dev)
            mask = torch.arange(n, device=dev)[None, :] <= pos[:, None]
            self.target.forward(torch.tensor(self.seq[self.t_len:n], device=dev), pos, pos, mask, self._t_cache,
                                logits_rows=slice(-1, None))
            self.t_len = n
        if self._drafter is not None:
            self._drafter.prefill(self.seq)
        return max(todo, 0)

    def _decode(self, g: Generation) -> Iterator[list[int]]:
        st = g.stats
        samp = g.samp
        gen = None
        if not samp.greedy:
            gen = torch.Generator(device=self.target.device)
            gen.manual_seed(samp.seed if samp.seed is not None else int(torch.randint(0, 2**62, (1,))))
        auto = g.method == "specexec" and g.tree.auto
        if auto and self._auto is None:  # once per engine (and cache size), before the caches hold anything
            tc = time.perf_counter()
            self._auto = self._calibrate(g.tree)
            st.calibration_s = time.perf_counter() - tc
        t0 = time.perf_counter()
        self._adopt(g.ids)
        st.prefill_tokens = self._prefill()
        self._sync()
        st.prefill_s = time.perf_counter() - t0
        if g.method == "specexec":
            st.budget = g.tree.budget
            st.budget_auto = auto
        chosen: Counter[int] = Counter()
        if g.method == "chain":
            st.gamma = g.chain.gamma
        hist: Counter[int] = Counter()
        tree_total = 0
        produced = 0
        eos = self.tokenizer.eos_ids
        while produced < g.max_new:
            n = len(self.seq) - 1
            assert self.t_len == n
            td = time.perf_counter()
            q = None
            if g.method == "ar":
                tree = Tree(self.seq[-1], 1, self.target.device)
            elif g.method == "specexec":
                assert self._drafter is not None
                tcfg = replace(g.tree, budget=self._auto.choose()) if auto else g.tree
                chosen[tcfg.budget] += 1
                cost = self._auto.grow_cost(tcfg.budget) if auto else self._costs.grow_cost(tcfg.budget)
                tree, gs = self._drafter.grow(self.seq, tcfg, lambda lg: sampling.logprobs(lg, samp), cost)
                st.draft_passes += gs.passes
                st.early_stops += gs.stopped_early
                st.tree_shapes.append(gs.beams)
            else:
                assert self._drafter is not None
                tree, q, gs = self._drafter.chain(self.seq, g.chain.gamma, lambda lg: self._pick(lg, samp, gen))
                st.draft_passes += gs.passes
            self._sync()
            tt = time.perf_counter()
            logits = score_tree(self.target, self._t_cache, tree, n, g.tree.verify_chunk)  # (N, V)
            path, emitted = accept(tree, logits, q, samp, gen, n)  # q is None unless chain sampling
            commit_target(self._t_cache, path, n)
            if self._drafter is not None and g.method != "ar":
                self._drafter.commit(tree, path, n)
            self._sync()
            te = time.perf_counter()
            st.draft_s += tt - td
            st.target_s += te - tt
            st.steps += 1
            if auto:
                self._auto.update(tcfg.budget, tree.n_logp[1:].tolist(), len(emitted), tt - td, te - tt,
                                  gs.passes)
            elif g.method == "specexec":
                predicted = min(1.0 + float(tree.n_logp[1:].exp().sum()), tcfg.max_depth + 1.0)
                self._costs.update(tcfg.budget, tt - td, gs.passes, te - tt, predicted, len(emitted))
            tree_total += tree.size - 1
            hist[len(emitted)] += 1
            # commit: cut at EOS / the token limit; the caches may hold more than is committed, never less
            out: list[int] = []
            for t in emitted[: g.max_new - produced]:
                out.append(t)
                if t in eos:
                    break
            self.seq.extend(out)
            self.t_len = min(n + len(path), len(self.seq) - 1)
            if self._drafter is not None:
                self._drafter.length = min(self._drafter.length, len(self.seq) - 1)
            produced += len(out)
            yield out
            if out and out[-1] in eos:
                break
        st.new_tokens = produced
        st.wall_s = time.perf_counter() - t0
        st.tokens_per_step = produced / max(st.steps, 1)
        decode_s = st.wall_s - st.prefill_s
        st.tokens_per_s = produced / decode_s if decode_s > 0 else 0.0
        st.mean_tree_size = tree_total / max(st.steps, 1)
        st.accepted_hist = dict(hist)
        if chosen:
            st.budget = chosen.most_common(1)[0][0]
            st.budgets = dict(chosen)

    def _calibrate(self, tree: TreeConfig) -> AutoBudget:
        """Time a few target passes (tree sizes) and draft passes (beam counts) for the auto budget.

        Uses the caches as scratch, so it runs before the prompt is processed (the prefix cache is dropped).
        """
        assert self._drafter is not None
        dev = self.target.device

        def timed(model: Transformer, cache: Any, size: int, reps: int) -> float:
            pos = torch.arange(size, device=dev)
            toks = torch.randint(0, model.cfg.vocab_size, (size,), device=dev)
            mask = pos[None, :] <= pos[:, None]
            best, spent, i = float("inf"), 0.0, 0
            while i < reps or (spent < 0.2 and i < 5):  # fast passes: repeat, keep the best (least noisy)
                self._sync()
                t = time.perf_counter()
                model.forward(toks, pos, pos, mask, cache)
                self._sync()
                dt = time.perf_counter() - t
                best, spent, i = min(best, dt), spent + dt, i + 1
            return best

        timed(self.target, self._t_cache, 1, 1)  # warm-up
        timed(self.draft, self._drafter.cache, 1, 1)
        t_s, d_s = calibrate(lambda n: timed(self.target, self._t_cache, n, 1),
                             lambda n: timed(self.draft, self._drafter.cache, n, 2), tree.max_budget, tree.max_beams)
        self.seq, self.t_len = [], 0
        self._drafter.length = 0
        return AutoBudget(target_s=t_s, draft_pass_s=d_s, max_beams=tree.max_beams, max_depth=tree.max_depth,
                          max_budget=tree.max_budget, budget=tree.budget)

    @staticmethod
    def _pick(logits: torch.Tensor, samp: SamplingConfig, gen: torch.Generator | None):
        """Chain drafting: the draft's token and the distribution q it came from."""
        if samp.greedy:
            return logits.argmax(-1), None
        q = sampling.probs(logits, samp)
        return sampling.choose(q, False, gen), q

