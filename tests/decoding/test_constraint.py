"""Constrained decoding is exact: every method's constrained output is constrained plain decoding's.

The tiny models here speak JSON: each family's tiny random target gets a byte-level BPE tokenizer trained on a
little JSON (every byte spellable, merges like ``": "``), and a noisy copy as its draft. Greedy: constrained
SpecExec (fixed trees, the CPU's measured policy), chain and n-gram decoding equal constrained AR token for
token, and every finished output parses and validates against its schema. Sampling: a chi-square test of
constrained SpecExec's samples against the exact constrained distribution (the target's logits masked by the
grammar and renormalised), and seeded constrained SpecExec equals seeded constrained AR sample for sample.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
from scipy import stats

from specexec.config import ChainConfig, SamplingConfig, TreeConfig
from specexec.decoding.constraint import Constraint, ConstraintError
from specexec.decoding.engine import Engine
from specexec.loading.checkpoint import load_model, load_tokenizer
from specexec.steps import sampling
from tests.conftest import FAMILIES, make_noisy_copy, make_tiny

CPU = torch.device("cpu")
VOCAB = 320
CORPUS = [
    json.dumps({"name": "ada", "age": 36, "ok": True, "kind": "cat", "tags": ["a", "bc"]}),
    json.dumps({"name": "bob", "age": 7, "ok": False, "kind": "dog", "tags": []}, indent=2),
    '{"id": 12, "value": 3.5, "items": [1, 2, 3], "note": null}',
    "the quick brown fox jumps over the lazy dog 0123456789 abc abc",
] * 4
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 2}, "maxItems": 2},
    },
    "required": ["name", "age", "ok", "kind", "tags"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},  # keeps a random model's answers short enough to finish
}
PROMPTS = ("Answer in JSON:", '{"x": 1}\n', "abc")


def json_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer of VOCAB ids (0..2 special) trained on CORPUS, saved over ``path``'s."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() == VOCAB
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(path)


def json_pair(root: Path, family: str, seed: int = 0, std: float = 0.25, hidden: int = 64) -> Engine:
    target = make_tiny(root / "target", family, vocab=VOCAB, seed=seed, std=std, hidden=hidden)
    json_tokenizer(target)
    draft = make_noisy_copy(target, root / "draft", 0.1)
    return Engine(
        load_model(target, CPU, torch.float32),
        load_tokenizer(target),
        load_model(draft, CPU, torch.float32),
        context=512,
    )


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> dict[str, Engine]:
    return {f: json_pair(tmp_path_factory.mktemp(f"json-{f}"), f, seed=i) for i, f in enumerate(FAMILIES)}


METHODS = {
    "specexec-16": dict(method="specexec", tree=TreeConfig.fixed(16)),
    "specexec-auto": dict(method="specexec"),  # the CPU's measured policy: trees, chains, n-gram tries
    "chain-4": dict(method="chain", chain=ChainConfig(gamma=4)),
    "ngram": dict(method="ngram"),
}
CONSTRAINTS = {
    "schema": Constraint.json_schema(SCHEMA),
    "json": Constraint.json(),
    "regex": Constraint.regex(r"(yes|no)( [a-c]{1,3}){2,4}\."),
    "lark": Constraint.grammar('start: "[" item ("," item)* "]"\nitem: %json {"type": "integer"} | "null"'),
    "gbnf": Constraint.grammar('root ::= "id-" [0-9]+ ("," [a-f]+)?'),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_constrained_speculation_equals_constrained_ar(engines, family):
    e = engines[family]
    for name, c in CONSTRAINTS.items():
        for prompt in PROMPTS[: 2 if name == "schema" else 1]:
            ref = e.generate(prompt, 48, method="ar", constraint=c)
            for m, kw in METHODS.items():
                r = e.generate(prompt, 48, constraint=c, **kw)
                assert r.tokens == ref.tokens, (family, name, m, prompt, r.text, ref.text)
            if name == "schema" and ref.finish_reason == "stop":
                jsonschema.validate(json.loads(ref.text), SCHEMA)


def test_outputs_follow_their_constraint(engines):
    """Every finished output is in its language: the schema's JSON validates, JSON mode gives an object, the
    regex matches as a whole; the grammar's forced tokens are counted."""
    import re

    finished = Counter()
    for family in FAMILIES:
        e = engines[family]
        for prompt in PROMPTS:
            r = e.generate(prompt, 64, constraint=CONSTRAINTS["schema"], method="specexec")
            if r.finish_reason == "stop":
                jsonschema.validate(json.loads(r.text), SCHEMA)
                finished["schema"] += 1
                assert r.stats.forced_tokens > 0  # the key names follow from the schema
            r = e.generate(prompt, 64, constraint=CONSTRAINTS["json"], method="specexec")
            if r.finish_reason == "stop":
                assert isinstance(json.loads(r.text), dict)
                finished["json"] += 1
            r = e.generate(prompt, 32, constraint=CONSTRAINTS["regex"], method="specexec")
            if r.finish_reason == "stop":
                assert re.fullmatch(r"(yes|no)( [a-c]{1,3}){2,4}\.", r.text), r.text
                finished["regex"] += 1
    # random models wander, but most answers end within the token limit
    assert finished["schema"] >= len(FAMILIES) and finished["regex"] >= len(FAMILIES), finished


def test_unfinished_output_is_cut_at_the_limit(engines):
    e = engines["llama"]
    r = e.generate("x", 6, constraint=CONSTRAINTS["schema"])
    assert r.finish_reason == "length" and len(r.tokens) == 6
    opening = '{"name":"'  # forced by the schema: the answer is this opening, truncated at the limit, or more
    assert opening.startswith(r.text) or r.text.startswith(opening), r.text


def test_logprobs_are_the_targets_and_method_independent(engines):
    """Log-probs come from the verify pass: the same for every method, and equal to the target's own
    log-softmax over a plain forward of the answer."""
    e = engines["qwen2"]
    c = CONSTRAINTS["schema"]
    ref = e.generate(PROMPTS[0], 24, method="ar", constraint=c, logprobs=3)
    spec = e.generate(PROMPTS[0], 24, method="specexec", tree=TreeConfig.fixed(16), constraint=c, logprobs=3)
    assert ref.logprobs is not None and spec.logprobs is not None
    assert [lp.token for lp in ref.logprobs] == ref.tokens
    assert ref.logprobs == spec.logprobs
    ids = e.encode(PROMPTS[0])
    seq = torch.tensor(ids + ref.tokens)
    with torch.no_grad():
        logits = e.target.forward(
            seq,
            torch.arange(len(seq)),
            torch.arange(len(seq)),
            torch.ones(len(seq), len(seq), dtype=torch.bool).tril(),
            e.target.new_cache(len(seq) + 4),
        )
    lsm = torch.log_softmax(logits.float(), -1)[len(ids) - 1 : -1]
    for i, lp in enumerate(ref.logprobs):
        assert lp.logprob == pytest.approx(float(lsm[i, lp.token]), abs=1e-4)
        top = sorted(((t, float(lsm[i, t])) for t in range(lsm.shape[1])), key=lambda x: -x[1])[:3]
        assert [t for t, _ in lp.top] == [t for t, _ in top]
    none = e.generate(PROMPTS[0], 4, logprobs=0)
    assert none.logprobs is not None and all(lp.top == () for lp in none.logprobs)
    assert e.generate(PROMPTS[0], 4).logprobs is None


@pytest.mark.parametrize(
    "make",
    [
        lambda: Constraint.json_schema("{not json"),
        lambda: Constraint.json_schema({"type": "nonsense"}).check(),
        lambda: Constraint.regex("(unclosed").check(),
        lambda: Constraint.grammar("start: undefined_rule").check(),
        lambda: Constraint.grammar("root ::= (").check(),
    ],
)
def test_bad_constraints_raise_one_clear_error(make):
    with pytest.raises(ConstraintError) as err:
        make()
    assert "\n" not in str(err.value) and len(str(err.value)) < 400


DEEP = '{"type": "object", "properties": {"a": ' * 1000 + '{"type": "string"}' + "}}" * 1000


def _nested(n: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _chain(n: int) -> dict:
    """A schema whose $defs refer to each other in a chain of ``n``: llguidance's compiler recurses once per link
    (on an 8 MB stack ~1,000 links end the process with a stack overflow)."""
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    return {"$defs": {**defs, f"d{n}": {"type": "string"}}, "$ref": "#/$defs/d0"}


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Constraint.json_schema(DEEP), "nests more than 100 levels deep"),  # text: before json.loads
        (lambda: Constraint.json_schema(_nested(1000)), "nests more than 100"),  # a dict: before json.dumps
        (
            lambda: Constraint.json_schema({"properties": {f"p{i}": {"type": "integer"} for i in range(40_000)}}),
            r"is [0-9,]+ bytes; at most 1,048,576",
        ),
        (lambda: Constraint.regex("a{1000000}").check(), "repeats a piece 1,000,000 times"),
        (lambda: Constraint.regex("(a|aa)*" + "b" * 70_000).check(), "is 70,007 bytes; at most 65,536"),
        (lambda: Constraint.grammar('start: x\nx: "a" ~ 50000').check(), "repeats a piece 50,000 times"),
        (lambda: Constraint.grammar("start: " + "|".join(f'"w{i}"' for i in range(40_000))).check(), "bytes"),
        (lambda: Constraint.json_schema(_chain(15_000)).check(), "bytes"),
    ],
)
def test_constraints_past_the_limits_are_refused_quickly(make, message):
    """Too deep, too large, too slow to compile: one clear error, before llguidance spends time (or stack) on it."""
    with pytest.raises(ConstraintError, match=message) as err:
        make()
    assert "\n" not in str(err.value)


def test_long_chains_compile_on_the_compile_stack():
    """A chain of $refs / rules that would overflow a thread's usual stack compiles (on the compile thread's)."""
    Constraint.json_schema(_chain(3000)).check()
    rules = "\n".join(f'r{i}: r{i + 1} "x"' for i in range(5000))
    Constraint.grammar(f'start: r0\n{rules}\nr5000: "a"').check()


def test_too_deep_names_the_path():
    from specexec.decoding.constraint import json_path, too_deep

    body = json.dumps({"model": "m", "tools": [{"x": 1}, {"function": {"parameters": "@"}}]})
    body = body.replace('"@"', '{"a": [' * 60 + "1" + "]}" * 60)
    path = too_deep(body, 100)
    assert json_path(path[:4]) == "tools[1].function.parameters" and path[4:6] == ["a", 0]
    assert too_deep(body, 200) is None and too_deep('"{[{["', 1) is None  # brackets inside strings do not count


def test_a_grammar_failing_part_way_raises_a_clear_error(monkeypatch):
    """A mask step that runs out of llguidance's lexer fuel part-way through an answer (the fuel lowered through
    PARSER_LIMITS, so a small grammar hits it): the forced prefix is produced, then one clear ConstraintError."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from specexec.decoding import constraint as cm

    tok = Tokenizer(models.BPE(vocab={c: b for b, c in bytes_to_unicode().items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    monkeypatch.setitem(cm.PARSER_LIMITS, "step_lexer_fuel", 100)
    state = cm.GrammarState(
        Constraint.regex("abcdefgh[ab]*a[ab]{10}"), cm.grammar_tokenizer(hf, 257, [256]), 257, [256]
    )
    committed: list[int] = []
    with pytest.raises(ConstraintError, match="failed part-way through the answer: lexer error") as err:
        for _ in range(20):
            forced = state.forced(1) or [ord("a")]
            state.commit(forced)
            committed += forced
    assert bytes(committed).startswith(b"abcdefgh") and "\n" not in str(err.value)


def test_engine_refuses_a_bad_constraint_before_generating(engines):
    e = engines["llama"]
    with pytest.raises(ConstraintError, match="JSON schema"):
        e.stream("x", 4, constraint=Constraint.json_schema({"type": "object", "properties": {"a": {"type": "nope"}}}))
    assert e.generate("x", 3).tokens  # the engine still works


# -- sampling ------------------------------------------------------------------------------------------------------
SAMPLE_GRAMMAR = Constraint.regex(r"[ab]{1,2}[cd]?")  # short answers: the exact distribution is enumerable
N_SAMPLES = 3000


def constrained_distribution(e: Engine, prompt: list[int], c: Constraint, samp: SamplingConfig, depth: int = 4):
    """The exact distribution of constrained sampling's answers (token tuples ending in EOS), by enumeration:
    at each prefix the target's logits masked by the grammar, through the sampling filters."""
    eos = min(e.tokenizer.eos_ids)
    out: dict[tuple[int, ...], float] = {}

    def logits(ids: list[int]) -> torch.Tensor:
        n = len(ids)
        with torch.no_grad():
            return e.target.forward(
                torch.tensor(ids),
                torch.arange(n),
                torch.arange(n),
                torch.ones(n, n, dtype=torch.bool).tril(),
                e.target.new_cache(n + 4),
                logits_rows=slice(-1, None),
            )[-1:]

    def visit(path: list[int], p: float) -> None:
        g = e.grammar(c)
        allowed = g.allowed([path])
        row = logits(prompt + path).masked_fill(~allowed, float("-inf"))
        probs = sampling.probs(row, samp)[0].double()
        for t in torch.nonzero(probs).flatten().tolist():
            q = p * float(probs[t])
            if t in e.tokenizer.eos_ids:
                out[tuple(path) + (eos,)] = out.get(tuple(path) + (eos,), 0.0) + q
            else:
                assert len(path) < depth, "the grammar allows longer answers than enumerated"
                visit(path + [t], q)

    visit([], 1.0)
    return out


@pytest.fixture(scope="module")
def sampler(tmp_path_factory) -> Engine:
    # a flatter target (smaller init) so several answers are likely
    return json_pair(tmp_path_factory.mktemp("json-sampling"), "llama", seed=5, std=0.08)


@pytest.mark.parametrize("samp", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_p=0.9)])
def test_constrained_sampling_follows_the_constrained_distribution(sampler, samp):
    e = sampler
    prompt = e.encode("abc")
    P = constrained_distribution(e, prompt, SAMPLE_GRAMMAR, samp)
    assert len(P) >= 4, P  # not a trivial distribution
    eos = min(e.tokenizer.eos_ids)
    counts: Counter[tuple[int, ...]] = Counter()
    for s in range(N_SAMPLES):
        cfg = replace(samp, seed=s)
        r = e.generate(
            prompt, 6, method="specexec", tree=TreeConfig.fixed(8), sampling_cfg=cfg, constraint=SAMPLE_GRAMMAR
        )
        toks = [eos if t in e.tokenizer.eos_ids else t for t in r.tokens]
        counts[tuple(toks)] += 1
        if s < 100:  # seeded: the same sample as constrained AR
            a = e.generate(prompt, 6, method="ar", sampling_cfg=cfg, constraint=SAMPLE_GRAMMAR)
            assert a.tokens == r.tokens
            c = e.generate(prompt, 6, method="chain", sampling_cfg=cfg, constraint=SAMPLE_GRAMMAR)
            assert c.tokens == r.tokens  # a constrained chain is verified by the walk with coupled draws
    assert all(k in P for k in counts), set(counts) - set(P)
    cells = sorted(P, key=P.get)
    exp = np.array([N_SAMPLES * P[c] for c in cells])
    obs = np.array([counts.get(c, 0) for c in cells], dtype=float)
    small = exp < 5
    if small.sum() > 0:  # pool the rare cells
        exp = np.concatenate([[exp[small].sum()], exp[~small]])
        obs = np.concatenate([[obs[small].sum()], obs[~small]])
    stat = float(((obs - exp) ** 2 / exp).sum())
    pval = float(stats.chi2.sf(stat, len(exp) - 1))
    assert pval > 1e-3, (pval, counts.most_common(8))
    # a negative control: the unconstrained target's answers fall outside the constrained support
    free = Counter(tuple(e.generate(prompt, 3, sampling_cfg=replace(samp, seed=s)).tokens) for s in range(50))
    assert any(k not in P for k in free)


# -- limits hit on speculative branches -------------------------------------------------------------------------------
# with the lexer fuel at 200, the branch into c… runs out of fuel a few bytes in; the branch into d… never does
BRANCHY = r"ab(c[ab]*a[ab]{10}|d[0-9]{3})"
BRANCHY_FUEL = 200


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tok = Tokenizer(models.BPE(vocab={c: b for b, c in bytes_to_unicode().items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def byte_engine(root: Path) -> Engine:
    target = make_tiny(root / "target", "llama", vocab=257, seed=3)
    byte_tokenizer().save_pretrained(target)
    draft = make_noisy_copy(target, root / "draft", 0.1)
    return Engine(
        load_model(target, CPU, torch.float32),
        load_tokenizer(target),
        load_model(draft, CPU, torch.float32),
        context=512,
    )


def test_a_limit_hit_on_a_draft_branch_drops_the_branch_not_the_answer(monkeypatch):
    """A tree with a branch into the expensive alternative (out of fuel part-way) and one into the cheap one:
    the expensive branch is dead from the node where the limit is hit (its subtree with it), the cheap one
    stands, and the committed matcher is untouched: its masks along the cheap path are a fresh matcher's, and
    the answer finishes."""
    from specexec.decoding import constraint as cm

    monkeypatch.setitem(cm.PARSER_LIMITS, "step_lexer_fuel", BRANCHY_FUEL)
    gt = cm.grammar_tokenizer(byte_tokenizer(), 257, [256])
    state = cm.GrammarState(Constraint.regex(BRANCHY), gt, 257, [256])
    fresh = cm.GrammarState(Constraint.regex(BRANCHY), gt, 257, [256])
    assert state.forced(8) == list(b"ab")
    state.commit(list(b"ab"))
    fresh.commit(list(b"ab"))
    bad, good = b"c" + b"a" * 16, b"d123"
    tokens = [ord("b")] + list(bad) + list(good)
    parents = [-1] + list(range(len(bad))) + [0] + list(range(len(bad) + 1, len(bad) + len(good)))
    keep, bits = state.tree_masks(tokens, parents)
    chain = keep[1 : len(bad) + 1]
    assert not all(chain) and chain[0], chain  # the branch dies part-way…
    dead = chain.index(False)
    assert not any(chain[dead:])  # …with its subtree
    assert all(keep[len(bad) + 1 :])  # the cheap branch stands
    assert state.speculative_failures >= 1 and not state.matcher.is_error()
    for t in good:  # the committed matcher is a fresh one's: same masks, no error
        _, a = state.tree_masks([t], [-1])
        _, b = fresh.tree_masks([t], [-1])
        assert (a == b).all()
        state.commit([t])
        fresh.commit([t])
    assert state.done() and state.allowed([[]])[0, 256]


def test_a_limit_on_the_committed_path_fails_as_plain_decoding_does(monkeypatch, tmp_path):
    """The committed path's limit: AR and the speculative methods stop with the same one clean error at the
    same token (what they streamed before it equal)."""
    from specexec.decoding import constraint as cm

    monkeypatch.setitem(cm.PARSER_LIMITS, "step_lexer_fuel", 100)
    e = byte_engine(tmp_path)
    c = Constraint.regex("[ab]*a[ab]{10}")  # the mask after a few free tokens runs out of fuel

    def run(**kw):
        out = ""
        with pytest.raises(ConstraintError, match="failed part-way through the answer") as err:
            for piece in e.stream("x", 40, constraint=c, **kw):
                out += piece
        return out, str(err.value)

    ref = run(method="ar")
    assert ref[0], ref
    for kw in METHODS.values():
        assert run(**kw) == ref, kw
