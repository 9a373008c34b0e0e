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
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

from specexec.errors import SpecexecError

KINDS = ("json", "json_schema", "regex", "grammar")

# What a constraint may be, all in one place. llguidance bounds the grammar it builds and each mask step
# (PARSER_LIMITS: its own defaults, errors without the parser's state dump); these bound the input ahead of it
# where it has no limit, or where it would crash rather than refuse: its compiler recurses once per rule or $ref in
# a chain (3-9 KB of stack each: ~2,500 chained rules or ~1,000 chained $refs overflow an 8 MB stack and kill the
# process), and nothing bounds its compile time but the input's size (100k Lark alternatives take 30 s).
MAX_SCHEMA_BYTES = 1 << 20  # a JSON schema's text; OpenAI caps a schema's names and values at 120k characters
MAX_GRAMMAR_BYTES = 256 << 10  # a Lark/GBNF grammar (tools' grammars included): llama.cpp's own are a few KB
MAX_REGEX_BYTES = 64 << 10  # a regular expression (a 64 KiB alternation of words compiles in ~0.2 s)
MAX_SCHEMA_DEPTH = 100  # JSON levels (~50 nested objects; OpenAI allows 10): llguidance's JSON reader stops at 128
MAX_REPEAT = 10_000  # a {n} / {n,m} / ~ n count: its derivatives grow with it (a{50000}: 40 ms a token)
# every compile runs on a thread with this stack: address space reserved, memory committed only as it is touched.
# The worst chain the size limits let through needs ~200 MB (1 MiB of chained $refs, 256 KiB of chained rules)
COMPILE_STACK_BYTES = 512 << 20
PARSER_LIMITS: dict[str, Any] = {"verbose_errors": False}  # LLParserLimits for every compile and matcher
# a limit hit on a speculative branch (a draft's, never plain decoding's) drops that branch and the matcher that
# walked it; after this many in one generation speculation under the grammar stops (each costs a compile)
MAX_SPECULATIVE_FAILURES = 8


class ConstraintError(SpecexecError):
    """A constraint that does not compile (an invalid schema, regex or grammar), or a state it cannot leave."""


class GrammarFailed(ConstraintError):
    """The grammar failed at a committed position (a limit of PARSER_LIMITS hit part-way through the answer):
    the generation ends there. ``committed``: of the tokens :meth:`GrammarState.commit` was given, how many stand
    (the ones before the failing position)."""

    committed = 0


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
            _check_size("JSON schema", schema, MAX_SCHEMA_BYTES)
            if too_deep(schema, MAX_SCHEMA_DEPTH) is not None:  # before json.loads, which recurses
                raise ConstraintError(too_deep_message("the JSON schema"))
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ConstraintError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ConstraintError(f"a JSON schema is a JSON object, not {type(schema).__name__}")
        if value_depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:  # before json.dumps, which recurses
            raise ConstraintError(too_deep_message("the JSON schema"))
        text = json.dumps(schema)  # key order kept: properties are written in it
        _check_size("JSON schema", text, MAX_SCHEMA_BYTES)
        return cls("json_schema", text)

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
        """The constraint as one llguidance grammar; raises :class:`ConstraintError` if it does not convert or is
        larger than the limits above allow."""
        import llguidance

        self._check_limits()
        fmt, text = {
            "json": ("json_schema", '{"type": "object"}'),
            "json_schema": ("json_schema", self.source),
            "regex": ("regex", self.source),
        }.get(self.kind, ("grammar", self.source))
        try:
            return str(on_compile_stack(lambda: llguidance.grammar_from(fmt, text)))  # type: ignore[arg-type]
        except (ValueError, TypeError, RuntimeError, KeyError, IndexError, AttributeError, RecursionError) as e:
            raise ConstraintError(f"the {self.describe()} does not compile: {_first_line(e)}") from None

    def _check_limits(self) -> None:
        """The size, depth and repetition limits (module constants); cheap, before anything compiles."""
        what = self.describe()
        if self.kind == "json_schema":
            _check_size(what, self.source, MAX_SCHEMA_BYTES)
            if too_deep(self.source, MAX_SCHEMA_DEPTH) is not None:
                raise ConstraintError(too_deep_message("the JSON schema"))
        elif self.kind in ("regex", "grammar"):
            _check_size(what, self.source, MAX_REGEX_BYTES if self.kind == "regex" else MAX_GRAMMAR_BYTES)
            for m in _REPEAT.finditer(self.source):
                count = max(int(g) for g in m.groups() if g)
                if count > MAX_REPEAT:
                    raise ConstraintError(
                        f"the {what} repeats a piece {count:,} times ({m.group(0).strip()!r}); at most "
                        f"{MAX_REPEAT:,} are allowed"
                    )

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


def _one_line(error: str) -> str:
    return " ".join(str(error).replace("<non-verbose/>", "").split())[:300]


def _validate(llguidance: Any, grammar: str) -> tuple[bool, str]:
    try:
        limits = llguidance.LLParserLimits(**PARSER_LIMITS)
        error = on_compile_stack(lambda: llguidance.LLMatcher.validate_grammar(grammar, limits=limits))
    except (ValueError, RuntimeError) as e:
        return False, _first_line(e)
    return not error, _one_line(error)


# {n}, {n,}, {n,m} (not \{), and Lark's ~ n / ~ n..m
_REPEAT = re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}|~\s*(\d+)(?:\s*\.\.\s*(\d+))?")


def _check_size(what: str, text: str, limit: int) -> None:
    n = len(text.encode("utf-8", errors="surrogatepass"))
    if n > limit:
        raise ConstraintError(f"the {what} is {n:,} bytes; at most {limit:,} are allowed")


def too_deep_message(what: str) -> str:
    """The one message for JSON nested deeper than MAX_SCHEMA_DEPTH (``what``: "the JSON schema", a field)."""
    n = MAX_SCHEMA_DEPTH
    return f"{what} nests more than {n} levels deep (objects and arrays); at most {n} are allowed"


_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{},:]')


def too_deep(text: str, limit: int) -> list[str | int] | None:
    """Where the JSON ``text`` first nests deeper than ``limit`` objects and arrays: the keys and indices down to
    that value, or None if it never does. A scan of its brackets with a stack of its own (never a recursion, which
    is what makes ``json.loads`` fail on deep input); the text need not be valid JSON."""
    path: list[str | int] = []  # the key or index inside each open container
    kinds: list[str] = []
    last = ""  # the last string read: an object's key when a colon follows
    for m in _JSON_TOKEN.finditer(text):
        t = m.group(0)
        if t in "{[":
            if len(kinds) == limit:
                return path
            kinds.append(t)
            path.append(0 if t == "[" else "")
        elif t in "}]":
            if kinds:
                kinds.pop()
                path.pop()
        elif t == ",":
            if kinds and kinds[-1] == "[":
                index = path[-1]
                path[-1] = index + 1 if isinstance(index, int) else 0
        elif t == ":":
            if kinds and kinds[-1] == "{":
                try:
                    path[-1] = json.loads(last)
                except ValueError:
                    path[-1] = last
        else:
            last = t
    return None


def value_depth(value: Any, limit: int) -> int:
    """How many objects and arrays deep ``value`` (parsed JSON) nests, counted up to ``limit + 1`` (an explicit
    stack: no recursion)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            d += 1
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((c, d) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def json_path(path: Sequence[str | int]) -> str:
    """``["tools", 0, "function"]`` -> ``tools[0].function``."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


_T = TypeVar("_T")
_STACK_LOCK = threading.Lock()


def on_compile_stack(fn: Callable[[], _T]) -> _T:
    """``fn()`` on a thread with a stack of COMPILE_STACK_BYTES (llguidance's compiler recurses per rule in a
    chain; on a thread's usual 8 MB a chain of a few thousand rules would end the process, not raise), returning
    its result or raising its exception here."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = e

    with _STACK_LOCK:  # stack_size is process-wide: set it for this one thread only
        old = threading.stack_size()
        try:
            threading.stack_size(COMPILE_STACK_BYTES)
        except (ValueError, RuntimeError):  # a platform that cannot: compile here
            return fn()
        try:
            t = threading.Thread(target=run, name="specexec-grammar-compile", daemon=True)
            t.start()
        finally:
            threading.stack_size(old)
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


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
        self.constraint = constraint
        self.vocab = vocab
        self.eos = sorted({int(e) for e in eos if 0 <= int(e) < vocab})
        self._tokenizer = tokenizer
        self._grammar = constraint.lark()
        self._limits = dict(PARSER_LIMITS)  # the limits at the start: a matcher compiled later gets the same
        self.matcher = self._compile()  # the committed matcher: committed positions only (see the class doc)
        if self.matcher.is_error():
            error = _one_line(self.matcher.get_error())
            raise ConstraintError(f"the {constraint.describe()} does not compile: {error}")
        self._spec: Any = None  # the speculative matcher (compiled on first use), at the committed state
        self._committed: list[int] = []  # the committed tokens (a new speculative matcher replays them)
        self.speculative_failures = 0  # speculative matchers given up on a limit (see :meth:`_speculative`)
        self.words = (int(tokenizer.vocab_size) + 31) // 32
        self._row = np.zeros((1, self.words), dtype=np.int32)
        self.forced_total = 0  # tokens proposed by :meth:`forced` so far (the share the grammar wrote)

    def _compile(self) -> Any:
        import llguidance

        limits = llguidance.LLParserLimits(**self._limits)
        tokenizer, grammar = self._tokenizer, self._grammar
        return on_compile_stack(lambda: llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits))

    # -- the committed state ------------------------------------------------------------------------------------
    def commit(self, tokens: Sequence[int]) -> None:
        """Consume committed output tokens (an end-of-sequence token ends the matcher's use). The committed
        matcher computes the mask at each position first, as constrained plain decoding does there, so its lexer
        does the same work in the same order whatever the method (its cache, hence the fuel a later step needs,
        depends on that history): it fails exactly where plain decoding fails."""
        new: list[int] = []
        for t in tokens:
            try:
                self._fill(self._row[0])
            except GrammarFailed as e:
                self._committed += new
                e.committed = len(new)
                raise
            if t in self.eos:
                break
            if not self.matcher.consume_token(int(t)):
                self._failed()
                raise ConstraintError(f"token {t} breaks the {self.constraint.describe()}")
            new.append(int(t))
        self._committed += new
        spec = self._spec
        if spec is not None and new and (spec.try_consume_tokens(new) != len(new) or spec.is_error()):
            self._drop_speculative()

    def _failed(self) -> None:
        """Raise :class:`ConstraintError` if the committed matcher has failed (a limit of PARSER_LIMITS hit
        part-way through the answer, or a parser error): it never leaves that state, so the generation ends."""
        if self.matcher.is_error():
            raise GrammarFailed(
                f"the {self.constraint.describe()} failed part-way through the answer: "
                f"{_one_line(self.matcher.get_error())}"
            )

    # -- the speculative matcher ----------------------------------------------------------------------------------
    def _speculative(self) -> Any | None:
        """The matcher for positions past the committed state (a draft's paths, a tree's nodes), at the committed
        state; None once MAX_SPECULATIVE_FAILURES have been given up (every speculative node is then dead: plain
        decoding's pace, its output unchanged).

        It is a matcher of its own, compiled apart: a limit hit on a branch puts a matcher in an error state it
        never leaves (``rollback`` refuses), and a lexer's error state is shared by all its ``deep_copy``s, so
        no fork of the committed matcher could fail without taking it down too. A failed one is dropped and the
        next use compiles another, replaying the committed tokens."""
        if self._spec is None and self.speculative_failures < MAX_SPECULATIVE_FAILURES:
            spec = self._compile()
            n = len(self._committed)
            if spec.is_error() or spec.try_consume_tokens(self._committed) != n or spec.is_error():
                self.speculative_failures += 1
            else:
                self._spec = spec
        return self._spec

    def _drop_speculative(self) -> None:
        """Give up the speculative matcher (a limit hit on a branch, say): the branch is dead, and the committed
        matcher never saw it."""
        self._spec = None
        self.speculative_failures += 1

    def _enter(self, path: Sequence[int]) -> Any | None:
        """The speculative matcher after ``path``, or None (the matcher left at the committed state) where the
        path holds an end-of-sequence token, a token the grammar refuses, or hits a limit (then it is dropped)."""
        spec = self._speculative()
        if spec is None or any(t in self.eos for t in path):
            return None
        k = spec.try_consume_tokens([int(t) for t in path])  # a refused token is no error: validated first
        if spec.is_error():
            self._drop_speculative()
            return None
        if k < len(path):
            spec.rollback(k)
            return None
        return spec

    def _spec_fill(self, spec: Any, out: np.ndarray) -> bool:
        """The speculative matcher's mask into ``out``; False (and the matcher dropped) on a limit hit."""
        spec.unsafe_compute_mask_ptr(out.ctypes.data, out.size * 4)
        if spec.is_error():
            self._drop_speculative()
            return False
        self._eos_bits(out, bool(spec.is_accepting()))
        return True

    def done(self) -> bool:
        """Whether the grammar allows nothing but the end of the sequence."""
        return bool(self.matcher.is_stopped())

    # -- masks ----------------------------------------------------------------------------------------------------
    def _fill(self, out: np.ndarray) -> None:
        """The allowed next tokens at the committed state, as a bitmask row (``out``: (words,) int32)."""
        self.matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.size * 4)
        self._failed()  # a mask step out of fuel: its mask is no language's
        self._eos_bits(out, bool(self.matcher.is_accepting()))

    def _eos_bits(self, out: np.ndarray, accepting: bool) -> None:
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
        the grammar refuses forces nothing. With no path the positions are the committed ones (the loop commits
        the chain), on the committed matcher, which raises on a limit; after a path they are speculative, and a
        limit hit there ends the chain where it is."""
        if path:
            spec = self._enter(path)
            if spec is None:
                return []
        else:
            spec = None
        m = self.matcher if spec is None else spec
        out: list[int] = []
        row = self._row[0]
        while len(out) < limit:
            if spec is None:
                self._fill(row)
            elif not self._spec_fill(spec, row):
                return out  # the speculative matcher is gone: nothing to roll back
            nz = np.flatnonzero(row)
            if nz.size != 1:
                break
            word = int(np.uint32(row[nz[0]]))
            if word & (word - 1):
                break
            tok = int(nz[0]) * 32 + word.bit_length() - 1
            if tok in self.eos or tok >= self.vocab or m.try_consume_tokens([tok]) != 1:
                break
            out.append(tok)
        if m.is_error():
            if spec is None:
                self._failed()
            self._drop_speculative()
            return out
        if len(path) + len(out):
            m.rollback(len(path) + len(out))
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
        """(R, vocab) bool: the tokens allowed after each path (a path ending in a token the grammar forbids, in
        an end-of-sequence token, or one where a limit is hit, allows everything: its row is never used, the
        tree's walk, :meth:`tree_masks`, decides what the target sees)."""
        bits = np.full((len(paths), self.words), -1, dtype=np.int32)
        for r, path in enumerate(paths):
            if not path:
                self._fill(bits[r])  # the committed state: plain decoding computes this mask too
                continue
            spec = self._enter(path)
            if spec is None:
                continue
            if not self._spec_fill(spec, bits[r]):
                bits[r] = -1
                continue
            spec.rollback(len(path))
        return self._unpack(bits)

    def tree_masks(self, tokens: Sequence[int], parents: Sequence[int]) -> tuple[list[bool], np.ndarray]:
        """One depth-first walk over a tree rooted at the pending token (``tokens``/``parents`` of its nodes,
        parents first). Returns which nodes the grammar allows (a node whose token it forbids is dropped with its
        subtree) and (N, words) int32 bitmasks (:func:`mask_rows` applies them): the tokens allowed after each
        node (all of them after an end-of-sequence node or a dropped one: their rows are never used).

        The root's mask is the committed state's (the committed matcher; a limit hit there ends the generation,
        as in plain decoding). The other nodes are speculative: a node where a limit is hit (consuming its token
        or computing its mask) is dead, dropped with its subtree, so acceptance never walks into it; the walk
        goes on over its siblings with a fresh speculative matcher."""
        n = len(tokens)
        kids: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            kids[parents[i]].append(i)
        bits = np.full((n, self.words), -1, dtype=np.int32)
        keep = [False] * n
        keep[0] = True
        self._fill(bits[0])
        spec = self._speculative() if n > 1 else None
        # (node, index of the next child to visit); a node on the stack other than the root has been consumed
        stack: list[tuple[int, int]] = [(0, 0)]
        path: list[int] = []  # the tokens of the stack's nodes below the root
        while stack:
            node, c = stack[-1]
            if c == len(kids[node]):
                stack.pop()
                if node != 0:
                    path.pop()
                    if spec is not None:
                        spec.rollback(1)
                continue
            stack[-1] = (node, c + 1)
            child = kids[node][c]
            t = int(tokens[child])
            w, b = divmod(t, 32)
            if t >= self.vocab or not (int(bits[node, w]) >> b) & 1:
                continue
            if t in self.eos:
                keep[child] = True
                continue  # the generation ends here: its subtree is dropped, its row unused
            if spec is None:
                continue  # speculation given up: the node is dead
            took = spec.try_consume_tokens([t])
            if took == 1 and not spec.is_error() and self._spec_fill(spec, bits[child]):
                keep[child] = True
                path.append(t)
                stack.append((child, 0))
                continue
            bits[child] = -1  # a dead node: dropped with its subtree
            if not spec.is_error():
                continue  # refused though allowed (the engine's quirk): the matcher is still at the parent
            if self._spec is spec:  # a limit hit on this branch: its siblings get a fresh matcher at the parent
                self._drop_speculative()
            spec = self._enter(path)
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
