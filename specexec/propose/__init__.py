"""The proposer seam: where a decode step's candidate tokens come from.

Decoding is one loop (:mod:`specexec.decoding.loop`): propose → verify (ONE target pass over the proposal's tree) →
accept → commit → emit. Only the proposer varies; :class:`Proposer` is all the loop calls (``begin``, ``propose``,
``commit``). A proposer returns a :class:`Proposal`: a tree rooted at the pending token (flat tensors,
:class:`specexec.steps.tree.Tree`), the acceptance rule it needs (``"tree"``: the exact tree walk, right for any
tree; ``"chain"``: speculative sampling along a chain with the draft distributions q it was sampled from), and what
it spent (draft passes, tokens per pass). The :class:`StepContext` carries the budget policy's choices: the size,
the early stop's costs, and the rule that trims nodes not worth verifying, which the proposer applies to its own
tree (:meth:`Proposal.trim`). After acceptance the loop calls the proposer's ``commit`` with the accepted path and
the committed sequence; the proposer updates its own state (its draft KV cache, its n-gram index). Nothing outside
a proposer writes its fields.

Implementations:

- :class:`NoDraft` -- the root alone: plain autoregressive decoding.
- :class:`ChainDraft` -- gamma draft tokens one at a time (Leviathan et al. 2023; Chen et al. 2023).
- :class:`TreeDraft` -- SpecExec's best-first tree of ``budget`` draft tokens (arXiv 2406.02532), optionally
  with n-gram branches merged in.
- :class:`NGramDraft` -- draft-free prompt lookup: continuations of earlier occurrences of the last few tokens
  (in the prompt and the text generated so far), merged into one trie. No model, so a step costs only the
  target's pass.
- :class:`HeadsDraft` -- Medusa-style heads on the target's last hidden state: a tree of the most probable head
  paths, for the cost of a few small products (:mod:`specexec.propose.heads`).

How the coming proposers plug in:

- *Draft-free* (n-gram lookup, Token Recycling): keep an index of the committed tokens, build a tree in
  ``propose`` without any model, update the index in ``commit``. :class:`NGramDraft` is the example.
- *Needing the target's hidden states* (Medusa heads, EAGLE): a proposer with ``wants_hidden`` True gets, on
  the proposal its ``commit`` receives, the final hidden state of the last accepted node (``Proposal.hidden``,
  from the verify pass the loop ran); it builds the next tree from it. :class:`HeadsDraft` is the example.

Every proposal is verified exactly, so a proposer can only change speed, never the output.
"""

from specexec.propose.best_first import TreeDraft
from specexec.propose.chain import ChainDraft
from specexec.propose.draft_model import DraftModel, TargetPrefix
from specexec.propose.heads import Heads, HeadsDraft
from specexec.propose.ngram import NGramConfig, NGramDraft
from specexec.propose.nodraft import NoDraft
from specexec.steps.proposal import Proposal, Proposer, StepContext

__all__ = [
    "ChainDraft",
    "DraftModel",
    "Heads",
    "HeadsDraft",
    "NGramConfig",
    "NGramDraft",
    "NoDraft",
    "Proposal",
    "Proposer",
    "StepContext",
    "TargetPrefix",
    "TreeDraft",
]
