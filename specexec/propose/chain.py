"""Chain speculative decoding's proposer (Leviathan et al. 2023; Chen et al. 2023): gamma draft tokens, one at a
time. Greedy: the draft's argmax, verified by the exact tree walk. Sampling: x_i ~ q_i, verified by speculative
sampling with those q (the ``"chain"`` acceptance rule); or, with ``StepContext.walk`` (the CPU policy's chain
arms), coupled draws -- x_i drawn from q_i with the Gumbel noise the tree walk uses at that position
(:func:`specexec.steps.sampling.coupled_choice`) -- verified by the exact tree walk, so the same seed gives AR's
text."""

from __future__ import annotations

import torch
from torch import Tensor

from specexec.config import FORCED_IN_CHAIN, SamplingConfig
from specexec.propose.draft_model import DraftModel
from specexec.propose.ngram import NGramDraft
from specexec.steps import sampling
from specexec.steps.proposal import Proposal, StepContext
from specexec.steps.rules import ChainStop
from specexec.steps.tree import Tree


class ChainDraft:
    """``ctx.arm.size`` (gamma) draft tokens per step; with a :class:`~specexec.steps.rules.ChainStop` as
    ``ctx.cost``, up to gamma.

    With ``lookup`` (an :class:`~specexec.propose.ngram.NGramDraft`; greedy chains verified by the tree walk only,
    as :class:`~specexec.propose.best_first.TreeDraft` asks for them) the prompt-lookup continuations are merged into
    the chain's tree: where the text copies from its context (an edit, a translation, a summary of given text), a
    continuation runs on past the chain's last draft token at no draft cost, and alternatives branch off it. A
    chain whose tokens so far follow a continuation stops earlier (ChainStop's ``covered``): the draft pass would
    mostly repeat what the continuation proposes. The tree walk verifies any tree exactly.
    """

    name = "chain"

    def __init__(self, draft: DraftModel, gamma: int, lookup: NGramDraft | None = None) -> None:
        self.draft, self.gamma, self.lookup = draft, gamma, lookup

    def begin(self, seq: list[int]) -> None:
        self.draft.prefill(seq)

    def propose(self, seq: list[int], ctx: StepContext) -> Proposal:
        d = self.draft
        dev = d.device
        gamma = ctx.arm.size
        n = len(seq) - 1
        # verified by the tree walk: greedy, or (ctx.walk) coupled draws when sampling; else the chain rule with q
        walk = ctx.samp.greedy or (ctx.walk and ctx.seed is not None)
        # n-gram continuations only where the tree walk verifies (no q to keep aligned)
        lookup = self.lookup if self.lookup is not None and walk else None
        conts = lookup.continuations(seq) if lookup is not None else []
        follow = _Follow(conts, lookup.acc) if lookup is not None else None
        extra = lookup.max_nodes() if lookup is not None else 0
        # under a constraint, up to FORCED_IN_CHAIN forced tokens join the chain
        tree = Tree(seq[-1], gamma + 1 + extra + (FORCED_IN_CHAIN if ctx.constraint is not None else 0), dev)
        beams = [len(seq) - d.length]
        logits = d.catch_up(seq)
        con = ctx.constraint
        drafted: list[int] = []  # the chain's tokens so far (the grammar's path)
        if con is not None:
            logits = con.mask_logits(logits, [drafted])
        tree.draft_slot[0] = n
        qs: list[Tensor | None] = []
        passes = 1
        cum = torch.zeros(1, device=dev)
        stop = ctx.cost if isinstance(ctx.cost, ChainStop) else None
        logps: list[float] = []
        node = 0  # the chain's last node; its depth: the chain's length so far (forced tokens included)
        chosen = 0  # the draft's own tokens (forced ones excluded)
        for i in range(gamma):
            depth = int(tree.depth[node])
            if walk and not ctx.samp.greedy:  # coupled: the walk's draw at this position whenever p is close to q
                assert ctx.seed is not None
                lq = sampling.coupled_logprobs(sampling.logprobs(logits, ctx.samp), ctx.seed, [n + 1 + depth])
                tok, q, probs = lq.argmax(-1), None, lq.exp()
            else:
                tok, q = draft_choice(logits, ctx.samp, ctx.gen)
                probs = q if q is not None else torch.softmax(logits.float(), dim=-1)
            qs.append(q)
            # the path's draft log-probability, as every tree holds (the budget policy's estimates use it)
            cum = cum + probs.gather(-1, tok.view(1, 1)).view(1).clamp_min(1e-30).log()
            tree.add(torch.tensor([node], device=dev), tok, cum)
            node, chosen = tree.size - 1, chosen + 1
            run = [int(tok)]
            if con is not None:  # the tokens the grammar forces next join the chain at no draft cost
                drafted.append(int(tok))
                forced = con.forced(tree.capacity - tree.size - extra, drafted)
                for f in forced:
                    tree.add(torch.tensor([node], device=dev), torch.tensor([f], device=dev), cum)
                    node = tree.size - 1
                drafted.extend(forced)
                run.extend(forced)
            if i == gamma - 1:
                break
            covered = 0.0
            for t in run:
                covered = follow.step(t) if follow is not None else 0.0
            if stop is not None:
                logps.append(float(cum))
                if not stop.more(logps, passes, covered):
                    break
            # one draft pass over the chosen token and the forced ones after it
            last = n + int(tree.depth[node])
            pos = torch.arange(last - len(run) + 1, last + 1, device=dev)
            tree.draft_slot[node - len(run) + 1 : node + 1] = pos
            mask = torch.arange(last + 1, device=dev)[None, :] <= pos[:, None]
            logits = d.forward(torch.tensor(run, device=dev), pos, pos, mask)[-1:]
            if con is not None:
                logits = con.mask_logits(logits, [drafted])
            passes += 1
            beams.append(len(run))
        q_all = torch.cat(qs) if qs and qs[0] is not None else None  # type: ignore[arg-type]
        merged_at, chain_size = 0, tree.size
        if lookup is not None and lookup.merge_into(tree, seq, conts):  # looked up once per step
            merged_at = chain_size  # the chain's nodes come first
        prop = Proposal(
            tree,
            rule="chain" if q_all is not None else "tree",
            q=q_all,
            passes=passes,
            beams=beams,
            arm=ctx.arm,
            source=self.name,
            stopped_early=chosen < gamma,
            merged_at=merged_at,
            catch_up_s=d.caught_up_s,
        )
        prop.trim(ctx.trim)
        return prop

    def commit(self, proposal: Proposal, path: list[int], seq: list[int]) -> None:
        slots = proposal.tree.draft_slot[torch.tensor(path, device=proposal.tree.device)].tolist()
        self.draft.commit(slots, seq)


class _Follow:
    """Which n-gram continuations the chain's tokens still follow, and the chance that the next one is proposed
    by them anyway: the n-gram acceptance estimate when some followed continuation goes on, else 0."""

    def __init__(self, conts: list[tuple[int, list[int]]], acc: float) -> None:
        self.live = [c for _, c in conts]
        self.acc = acc
        self.i = 0

    def step(self, tok: int) -> float:
        i = self.i
        self.live = [c for c in self.live if len(c) > i and c[i] == tok]
        self.i = i + 1
        return self.acc if any(len(c) > i + 1 for c in self.live) else 0.0


def draft_choice(logits: Tensor, samp: SamplingConfig, gen: torch.Generator | None) -> tuple[Tensor, Tensor | None]:
    """The draft's token and the distribution q it came from (None when greedy): argmax, or x ~ q."""
    if samp.greedy:
        return logits.argmax(-1), None
    q = sampling.probs(logits, samp)
    return sampling.choose(q, False, gen), q
