"""Medusa-style heads: exact under the tree walk, trained by self-distillation, resumable, found by target key."""

from __future__ import annotations

import math

import pytest
import torch
from typer.testing import CliRunner

from offload.plan import OffloadConfig
from specexec import api
from specexec.cli import app
from specexec.config import SamplingConfig, TreeConfig
from specexec.errors import SpecexecError
from specexec.formats.dense import linear
from specexec.loading.checkpoint import load_model, load_tokenizer
from specexec.propose import heads as h
from tests.conftest import make_tiny

CPU = torch.device("cpu")
PROMPTS = ("t10 t11 t12 t13 t14", "t3 t9 t3 t9 t3 t9 t3")
# a text the tiny model can learn to continue: a cycle of tokens, so the next few are predictable
TEXT = " ".join(f"t{3 + (i * 7) % 50}" for i in range(4000))
STEPS = 800  # a fixed amount of training (not a time limit): the same heads on a busy machine as on a quiet one


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny target and its heads, trained briefly on TEXT and saved where ``draft="heads"`` finds them."""
    root = tmp_path_factory.mktemp("heads")
    target = make_tiny(root / "target", "llama", seed=5)
    home = root / "home"
    model = load_model(target, CPU, torch.float32)
    tok = load_tokenizer(target)
    out = h.heads_path(target, home)
    ids = torch.arange(model.cfg.vocab_size)
    before = h.Heads.new(model.cfg.hidden_size, ids)
    heads, state = h.train(model, tok.tokenizer.encode, [TEXT], out, ids, max_minutes=10, chunk=64, batch=64,
                           key=h.target_key(target), max_steps=STEPS)  # fmt: skip
    return target, home, model, tok, before, heads, state


def test_training_saves_heads_that_learn_the_targets_predictions(trained):
    target, home, model, tok, before, heads, state = trained
    assert h.find_heads(target, home) == h.heads_path(target, home)
    assert state.steps > 0 and state.chunks > 0 and len(state.acc) == h.HEADS
    loaded = h.Heads.load(h.heads_path(target, home))
    assert loaded.meta["key"] == h.target_key(target) and loaded.meta["train"]["steps"] == state.steps

    def agreement(hd: h.Heads) -> float:
        ids = torch.tensor(tok.tokenizer.encode(TEXT)[:200])
        hidden: list[torch.Tensor] = []
        pos = torch.arange(len(ids))
        logits = model.forward(ids, pos, pos, pos[None, :] <= pos[:, None], model.new_cache(len(ids)), hidden=hidden)
        pred = logits.argmax(-1)
        s = hd.stage(0, hidden[0][:-1], model.globals.embed[ids[1:]])  # head 1 at i reads the token at i + 1
        guess = hd.ids[linear(s, model.globals.lm_head[hd.ids]).argmax(-1)]
        return (guess == pred[1:]).float().mean().item()  # ... and guesses the target's prediction after it

    assert agreement(loaded) > agreement(before) + 0.1


def test_training_resumes_where_it_stopped(trained, tmp_path):
    target, home, model, tok, *_ = trained
    out = tmp_path / "h.safetensors"
    ids = torch.arange(model.cfg.vocab_size)
    key = h.target_key(target)

    def run(path, steps, k=key):
        return h.train(model, tok.tokenizer.encode, [TEXT], path, ids, 10, chunk=64, batch=32, key=k, max_steps=steps)

    _, first = run(out, 16)
    _, second = run(out, 40)
    assert first.steps == 16 and second.steps == 40
    assert second.chunks > first.chunks and second.seconds > first.seconds
    _, fresh = run(tmp_path / "other.safetensors", 8, "x")
    assert fresh.steps == 8  # another key starts over


def test_the_hidden_state_is_what_the_logits_come_from(trained):
    _, _, model, *_ = trained
    ids = torch.arange(3, 20)
    pos = torch.arange(len(ids))
    hidden: list[torch.Tensor] = []
    logits = model.forward(ids, pos, pos, pos[None, :] <= pos[:, None], model.new_cache(20), hidden=hidden)
    assert torch.allclose(linear(hidden[0], model.globals.lm_head).float(), logits, atol=1e-5)


@pytest.fixture(scope="module")
def engines(trained):
    target, home, *_ = trained
    dense = api.load(str(target), "heads", device="cpu", progress=False, context=256, cache_dir=home)
    int8 = api.load(str(target), "heads", device="cpu", progress=False, context=256, cache_dir=home,
                    offload=OffloadConfig(target_dtype="int8"))  # fmt: skip
    return {"dense": dense, "int8": int8}


@pytest.mark.parametrize("weights", ["dense", "int8"])
def test_heads_greedy_equals_ar(engines, weights):
    e = engines[weights]
    assert e.heads is not None and e.draft is None
    steps = 0
    for p in PROMPTS:
        e.reset()
        ref = e.generate(p, 40, method="ar").tokens
        for kw in (
            dict(),
            dict(method="heads", tree=TreeConfig.fixed(8)),
            dict(method="heads", tree=TreeConfig.fixed(1)),
            dict(method="heads", tree=TreeConfig(budget=4, ngram=16)),
        ):
            e.reset()
            r = e.generate(p, 40, **kw)
            assert r.tokens == ref, (kw, p)
            assert r.stats.method == "heads"
            steps += r.stats.steps


def test_heads_propose_from_the_hidden_state_the_loop_hands_over(engines, monkeypatch):
    """Heads that guess perfectly (an oracle in place of the trained blocks) make every step after the first emit
    K + 1 tokens: the loop hands the proposer the accepted node's hidden state, the best-first paths form the tree,
    and the walk accepts them. Without a hidden state (the first step) the proposal is the root alone."""
    e = engines["dense"]
    e.reset()
    ref = e.generate(PROMPTS[0], 40, method="ar").tokens
    full = e.encode(PROMPTS[0]) + ref
    seen: list[int] = []
    orig = h.HeadsDraft.propose

    def propose(self, seq, ctx):
        self._at = len(seq)
        return orig(self, seq, ctx)

    def guess(self, k, states, tokens, top):
        assert states.shape[-1] == e.target.cfg.hidden_size and len(tokens) == len(states)
        if k == 0:  # head 1 reads the pending token, the last one of the sequence
            assert tokens.tolist() == [full[self._at - 1]]
        seen.append(self._at)
        nxt = full[self._at + k] if self._at + k < len(full) else 0
        return states, torch.full((len(states), 1), nxt), torch.zeros(len(states), 1)

    monkeypatch.setattr(h.HeadsDraft, "propose", propose)
    monkeypatch.setattr(h.HeadsDraft, "guess", guess)
    e.reset()
    r = e.generate(PROMPTS[0], 40, method="heads", tree=TreeConfig.fixed(h.HEADS))
    assert r.tokens == ref and seen
    # the first step verifies the root alone; every later one emits the K guesses and the bonus token
    assert r.stats.steps == 1 + math.ceil((len(ref) - 1) / (h.HEADS + 1)), r.stats


def test_sampled_heads_follow_the_seeded_ar_draws(engines):
    """The tree walk's draws depend only on the seed and the position, so any tree reproduces seeded AR."""
    e = engines["dense"]
    for s in range(6):
        cfg = SamplingConfig(temperature=0.9, seed=s)
        e.reset()
        ref = e.generate(PROMPTS[0], 24, method="ar", sampling_cfg=cfg).tokens
        for tree in (TreeConfig.fixed(8), TreeConfig(budget=2, ngram=8)):  # the latter with lookup merged in
            e.reset()
            assert e.generate(PROMPTS[0], 24, method="heads", tree=tree, sampling_cfg=cfg).tokens == ref


def test_heads_merge_prompt_lookup_and_stay_exact(engines):
    """``--draft heads`` merges prompt lookup's continuations into its head trees (and verifies the lookup's trie
    alone on its steps without heads): on a prompt that repeats itself, a head tree of 2 verifies more rows than
    its own 3, and the output is plain greedy decoding's."""
    e = engines["dense"]
    prompt = " ".join(["t20 t21 t22 t23 t24 t25 t26 t27"] * 4)
    e.reset()
    ref = e.generate(prompt, 40, method="ar").tokens
    for tree in (TreeConfig(budget=2, ngram=8), TreeConfig(auto=True)):
        e.reset()
        steps: list = []
        r = e.generate(prompt, 40, method="heads", tree=tree, on_step=steps.append)
        assert r.tokens == ref
        if not tree.auto:
            assert max(s.size for s in steps) > 3, [s.size for s in steps]


def test_heads_for_another_target_are_not_found(tmp_path, trained):
    _, home, *_ = trained
    other = make_tiny(tmp_path / "other", "llama", seed=6)
    assert h.find_heads(other, home) is None
    with pytest.raises(SpecexecError, match="specexec heads train --target"):
        api.load(str(other), "heads", device="cpu", progress=False, context=64, cache_dir=home)


def test_cli_heads_train_then_generate(tmp_path):
    target = make_tiny(tmp_path / "t", "llama", seed=7)
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text(TEXT)
    runner = CliRunner()
    r = runner.invoke(app, ["generate", "--target", str(target), "--draft", "heads", "--device", "cpu", "-q", "-p",
                            "t10 t11", "--cache-dir", str(tmp_path / "home")])  # fmt: skip
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.exit_code != 0 and len(lines) == 1 and "specexec heads train" in lines[0], r.output
    r = runner.invoke(app, ["heads", "train", "--target", str(target), "--data", str(data), "--max-minutes", "0.05",
                            "-q", "--cache-dir", str(tmp_path / "home")])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "heads:" in r.stdout and h.heads_path(target, tmp_path / "home").is_file()
    r = runner.invoke(app, ["generate", "--target", str(target), "--draft", "heads", "--device", "cpu", "-q", "-p",
                            "t10 t11", "-n", "8", "--cache-dir", str(tmp_path / "home")])  # fmt: skip
    assert r.exit_code == 0, r.output
    for bad, msg in ((["--max-minutes", "0"], "max-minutes"), (["--data", str(tmp_path / "nope")], "no such")):
        r = runner.invoke(app, ["heads", "train", "--target", str(target), "-q", *bad])
        assert r.exit_code == 2 and msg in r.stderr, r.output


def test_paths_are_the_most_probable_head_paths(trained):
    """The level-by-level growth returns exactly the ``budget`` most probable paths through the heads' guesses
    (every path enumerated and scored by brute force), parents before children."""
    target, _, model, _, _, heads, _ = trained
    g = model.globals
    draft = h.HeadsDraft(heads, g.lm_head, g.embed, CPU)
    hidden = torch.randn(model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    root = 11
    for budget in (1, 2, 5, 8, 20):
        top = min(h.TOP, budget)
        every: list[tuple[float, tuple[int, ...]]] = []

        def walk(k, state, token, score, path):
            if k == heads.k:
                return
            s, tok, lp = draft.guess(k, state[None], torch.tensor([token]), top)
            for t, p in zip(tok[0].tolist(), lp[0].tolist()):
                every.append((score + p, (*path, t)))
                walk(k + 1, s[0], t, score + p, (*path, t))

        walk(0, hidden.float(), root, 0.0, ())
        want = sorted(every, key=lambda x: (-x[0], len(x[1])))[:budget]
        parents, toks, depths, scores = draft.paths(hidden, root, budget)
        assert len(toks) == budget and all(p < i + 1 for i, p in enumerate(parents))  # parents come first
        got = []
        for i in range(budget):  # each node's path from the root
            path, j = [], i + 1
            while j:
                path.append(toks[j - 1])
                j = parents[j - 1]
            got.append((scores[i], tuple(reversed(path))))
            assert depths[i] == len(path)
        assert [p for _, p in got] == [p for _, p in want], budget
        assert [s for s, _ in got] == pytest.approx([s for s, _ in want], abs=1e-5)


@pytest.mark.cuda
def test_heads_on_cuda_greedy_equals_ar(trained):
    """The heads on a GPU target (its hidden states, embedding and output layer there): greedy equals AR."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    target, home, *_ = trained
    e = api.load(str(target), "heads", device="cuda", progress=False, context=256, cache_dir=home)
    for p in PROMPTS:
        e.reset()
        ref = e.generate(p, 32, method="ar").tokens
        for kw in (dict(), dict(method="heads", tree=TreeConfig.fixed(8))):
            e.reset()
            assert e.generate(p, 32, **kw).tokens == ref, kw
