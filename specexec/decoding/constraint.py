"""Grammar-constrained decoding: JSON mode, JSON Schema, regular expressions and grammars, exact under speculation.

A :class:`Constraint` names the language the output must belong to. At every position the target's distribution is
masked to the tokens the grammar allows there (greedy: the constrained argmax; sampling: the constrained,
renormalised distribution), so a constrained generation is defined by constrained plain decoding, and every method
reproduces it exactly: the masks depend only on the committed prefix and the path to the node, never on the tree.

:class:`GrammarState` follows one generation. The decode loop asks it for

- the tokens the grammar *forces* at the committed state (:meth:`GrammarState.forced`: a chain of positions where
  exactly one token is allowed). Constrained decoding emits them whatever the model says, so they are proposed
  without a draft pass, in front of the draft's tree, and verified in the same target pass;
- the draft's masks (:meth:`GrammarState.mask_logits`): a proposer masks the draft's logits at every node it
  expands, so its tree holds only tokens the grammar allows;
- the tree's masks (:meth:`GrammarState.tree_masks`): one depth-first walk of the matcher over the proposal, which
  drops any node the grammar forbids (a prompt-lookup branch, say) before the target verifies it, and masks the
  target's logits at every node that remains.

The grammar engine is llguidance (its JSON Schema, regex and Lark front ends; GBNF converts to Lark). It was
chosen over xgrammar by measurement on the demo tokenizer: compiling a 5-field schema took 2.7 ms against 34 ms
(each request may bring a schema of its own), a token's mask 0.08 ms against 0.03 ms (both far below a target
pass), and it needs no other package (xgrammar pulls in triton).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from specexec.errors import SpecexecError

KINDS = ("json", "json_schema", "regex", "grammar")


class ConstraintError(SpecexecError):
    """A constraint that does not compile (an invalid schema, regex or grammar), or a state it cannot leave."""


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of an emitted token under its own (unconstrained, temperature-1)
    distribution at that position, and the ``top`` most probable tokens there with theirs."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Constraint:
    """The language a generation's output must belong to (see the module doc). Build one with :meth:`json`,
    :meth:`json_schema`, :meth:`regex` or :meth:`grammar`; :meth:`check` compiles it without a tokenizer."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown constraint kind {self.kind!r}; one of {', '.join(KINDS)}")

    @classmethod
    def json(cls) -> Constraint:
        """Any JSON object (OpenAI's JSON mode)."""
        return cls("json")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> Constraint:
        """JSON that validates against ``schema`` (a dict or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ConstraintError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ConstraintError(f"a JSON schema is a JSON object, not {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema))  # key order kept: properties are written in it

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        """Text that matches the regular expression ``pattern`` as a whole."""
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, text: str) -> Constraint:
        """Text in the grammar ``text``: llguidance's Lark dialect (``start: ...``; it may embed a JSON schema as
        ``%json {...}``), or GBNF as llama.cpp writes it (``root ::= ...``), which is converted to Lark."""
        return cls("grammar", text)

    def lark(self) -> str:
        """The constraint as one llguidance grammar; raises :class:`ConstraintError` if it does not convert."""
        import llguidance

        fmt, text = {
            "json": ("json_schema", '{"type": "object"}'),
            "json_schema": ("json_schema", self.source),
            "regex": ("regex", self.source),
        }.get(self.kind, ("grammar", self.source))
        try:
            return str(llguidance.grammar_from(fmt, text))  # type: ignore[arg-type]
        except (ValueError, TypeError, RuntimeError, KeyError, IndexError, AttributeError) as e:
            raise ConstraintError(f"the {self.describe()} does not compile: {_first_line(e)}") from None

    def describe(self) -> str:
        return {"json": "JSON mode", "json_schema": "JSON schema", "regex": "regular expression"}.get(
            self.kind, "grammar"
        )

    def check(self) -> None:
        """Compile the constraint (no tokenizer needed); raises :class:`ConstraintError` naming what is wrong."""
        import llguidance

        grammar = self.lark()
        ok, error = _validate(llguidance, grammar)
        if not ok:
            raise ConstraintError(f"the {self.describe()} does not compile: {error}")


def _first_line(e: BaseException) -> str:
    s = str(e).strip() or type(e).__name__
    return s.splitlines()[0][:300]


def _validate(llguidance: Any, grammar: str) -> tuple[bool, str]:
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar)
    except (ValueError, RuntimeError) as e:
        return False, _first_line(e)
    return not error, " ".join(str(error).split())[:300]


def grammar_tokenizer(hf_tokenizer: Any, vocab: int, eos: Sequence[int]) -> Any:
    """llguidance's view of a Hugging Face fast tokenizer over ``vocab`` ids (the model's rows: padding rows are
    never allowed). About a second for a 150k vocabulary: build it once per engine."""
    import llguidance.hf

    try:
        # ids the tokenizer adds past the model's rows are never allowed (GrammarState cuts its masks to the rows)
        n = max(vocab, len(hf_tokenizer))
        return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n, eos_token=list(eos) or None)
    except (ValueError, RuntimeError) as e:
        raise ConstraintError(f"constrained decoding cannot read this model's tokenizer: {_first_line(e)}") from None


class GrammarState:
    """One generation's matcher: the constraint's state after the committed output, and the masks the decode loop
    and the proposers apply (see the module doc). Tokens are ids in the target's vocabulary of ``vocab`` rows;
    ``eos`` are the ids that end a generation, allowed exactly where the grammar accepts."""

    def __init__(self, constraint: Constraint, tokenizer: Any, vocab: int, eos: Iterable[int]) -> None:
        import llguidance

        self.constraint = constraint
        self.vocab = vocab
        self.eos = sorted({int(e) for e in eos if 0 <= int(e) < vocab})
        grammar = constraint.lark()
        self.matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise ConstraintError(
                f"the {constraint.describe()} does not compile: {_first_line(RuntimeError(self.matcher.get_error()))}"
            )
        self.words = (int(tokenizer.vocab_size) + 31) // 32
        self._row = np.zeros((1, self.words), dtype=np.int32)
        self.forced_total = 0  # tokens proposed by :meth:`forced` so far (the share the grammar wrote)

    # -- the committed state ------------------------------------------------------------------------------------
    def commit(self, tokens: Sequence[int]) -> None:
        """Consume committed output tokens (an end-of-sequence token ends the matcher's use)."""
        for t in tokens:
            if t in self.eos:
                return
            if not self.matcher.consume_token(int(t)):
                raise ConstraintError(f"token {t} breaks the {self.constraint.describe()}: {self.matcher.get_error()}")

    def done(self) -> bool:
        """Whether the grammar allows nothing but the end of the sequence."""
        return bool(self.matcher.is_stopped())

    # -- masks ----------------------------------------------------------------------------------------------------
    def _fill(self, out: np.ndarray) -> None:
        """The allowed next tokens at the matcher's state, as a bitmask row (``out``: (words,) int32)."""
        self.matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.size * 4)
        accepting = self.matcher.is_accepting()
        for e in self.eos:
            w, b = divmod(e, 32)
            bit = np.int32(np.uint32(1 << b).view(np.int32))
            out[w] = (out[w] | bit) if accepting else (out[w] & ~bit)

    def _unpack(self, bits: np.ndarray) -> Tensor:
        """(R, words) int32 bitmasks → (R, vocab) bool."""
        flat = np.unpackbits(np.ascontiguousarray(bits).view(np.uint8), axis=1, bitorder="little")[:, : self.vocab]
        if flat.shape[1] < self.vocab:  # the model's padding rows: never allowed
            flat = np.pad(flat, ((0, 0), (0, self.vocab - flat.shape[1])))
        return torch.from_numpy(flat.astype(bool))

    def forced(self, limit: int, path: Sequence[int] = ()) -> list[int]:
        """Up to ``limit`` tokens the grammar forces after ``path`` (tokens beyond the committed state): each is
        the only token allowed at its position (so constrained decoding emits it whatever the model's
        distribution). The state is unchanged; an end-of-sequence token is never part of the chain, and a path
        the grammar refuses forces nothing."""
        k = 0
        for t in path:
            if t in self.eos or not self.matcher.consume_token(int(t)):
                self.matcher.rollback(k)
                return []
            k += 1
        out: list[int] = []
        row = self._row[0]
        while len(out) < limit:
            self._fill(row)
            nz = np.flatnonzero(row)
            if nz.size != 1:
                break
            word = int(np.uint32(row[nz[0]]))
            if word & (word - 1):
                break
            tok = int(nz[0]) * 32 + word.bit_length() - 1
            if tok in self.eos or tok >= self.vocab or not self.matcher.consume_token(tok):
                break
            out.append(tok)
        if k + len(out):
            self.matcher.rollback(k + len(out))
        return out

    def mask_logits(self, logits: Tensor, paths: Sequence[Sequence[int]]) -> Tensor:
        """``logits`` (R, V') with each row r's tokens that the grammar forbids after ``paths[r]`` (tokens beyond
        the committed state) set to -inf. Columns past the target's vocabulary are forbidden."""
        allowed = self.allowed(paths).to(logits.device)
        v = logits.shape[-1]
        if v > self.vocab:
            allowed = torch.nn.functional.pad(allowed, (0, v - self.vocab), value=False)
        allowed = allowed[:, :v]
        out = logits.masked_fill(~allowed, float("-inf"))
        dead = ~torch.isfinite(out).any(-1)  # the draft scores none of the allowed tokens (a vocabulary subset)
        if bool(dead.any()):  # then all of them alike, rather than no distribution at all
            out[dead] = torch.where(allowed[dead], 0.0, float("-inf")).to(out.dtype)
        return out

    def allowed(self, paths: Sequence[Sequence[int]]) -> Tensor:
        """(R, vocab) bool: the tokens allowed after each path (a path ending in a token the grammar forbids,
        or in an end-of-sequence token, allows everything: its row is never used)."""
        bits = np.zeros((len(paths), self.words), dtype=np.int32)
        for r, path in enumerate(paths):
            k = 0
            for t in path:
                if t in self.eos or not self.matcher.consume_token(int(t)):
                    bits[r] = -1
                    break
                k += 1
            else:
                self._fill(bits[r])
            if k:
                self.matcher.rollback(k)
        return self._unpack(bits)

    def tree_masks(self, tokens: Sequence[int], parents: Sequence[int]) -> tuple[list[bool], np.ndarray]:
        """One depth-first walk over a tree rooted at the pending token (``tokens``/``parents`` of its nodes,
        parents first). Returns which nodes the grammar allows (a node whose token it forbids is dropped with its
        subtree) and (N, words) int32 bitmasks (:func:`mask_rows` applies them): the tokens allowed after each
        node (all of them after an end-of-sequence node or a dropped one: their rows are never used)."""
        n = len(tokens)
        kids: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            kids[parents[i]].append(i)
        bits = np.full((n, self.words), -1, dtype=np.int32)
        keep = [False] * n
        keep[0] = True
        self._fill(bits[0])
        # (node, index of the next child to visit); a node on the stack other than the root has been consumed
        stack: list[tuple[int, int]] = [(0, 0)]
        while stack:
            node, c = stack[-1]
            if c == len(kids[node]):
                stack.pop()
                if node != 0:
                    self.matcher.rollback(1)
                continue
            stack[-1] = (node, c + 1)
            child = kids[node][c]
            t = int(tokens[child])
            w, b = divmod(t, 32)
            if t >= self.vocab or not (int(bits[node, w]) >> b) & 1:
                continue
            keep[child] = True
            if t in self.eos:
                continue  # the generation ends here: its subtree is dropped, its row unused
            if not self.matcher.consume_token(t):
                raise ConstraintError(f"the grammar engine refused token {t} it allowed: {self.matcher.get_error()}")
            self._fill(bits[child])
            stack.append((child, 0))
        return keep, bits

    def one_hot(self, tokens: Sequence[int]) -> np.ndarray:
        """(k, words) int32 bitmasks: row i allows ``tokens[i]`` alone (a forced chain's rows)."""
        bits = np.zeros((len(tokens), self.words), dtype=np.uint32)
        for i, t in enumerate(tokens):
            bits[i, t // 32] = np.uint32(1 << (t % 32))
        return bits.view(np.int32)


def mask_rows(logits: Tensor, bits: np.ndarray, chunk: int = 256) -> Tensor:
    """``logits`` (N, V) with each row's tokens outside its bitmask row (``bits`` (N, words) int32, bit t % 32 of
    word t // 32) set to -inf, unpacked on the logits' device a chunk of rows at a time (a big tree's masks as
    booleans would take N x V bytes at once). Columns past the bitmasks' width are forbidden."""
    n, v = logits.shape
    packed = torch.from_numpy(np.ascontiguousarray(bits).view(np.uint8)).to(logits.device)  # (N, 4 x words)
    shifts = torch.arange(8, device=logits.device, dtype=torch.uint8)
    out = logits.clone()
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        allowed = ((packed[s:e, :, None] >> shifts) & 1).flatten(1).bool()  # (rows, 32 x words)
        if allowed.shape[1] < v:
            allowed = torch.nn.functional.pad(allowed, (0, v - allowed.shape[1]), value=False)
        out[s:e].masked_fill_(~allowed[:, :v], float("-inf"))
    return out
