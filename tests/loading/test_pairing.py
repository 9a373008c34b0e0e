"""Drafts that pair themselves (specexec/loading/pairing.py): which ids a draft may propose, when a pair is refused,
and that a draft limited to the ids its tokenizer shares with the target's changes only speed, never the output.

Tokenizers are word-level ones built here (one symbol per id); models are tiny random ones (tests/conftest.py).
The padded-embedding case is the Qwen2.5 one in miniature: one tokenizer, a target with more embedding rows than
the draft, and rows in both that are no token (Qwen2.5-7B..72B: 152,064 rows, 0.5B..3B: 151,936; 151,665 tokens).
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from specexec import api
from specexec.config import ChainConfig, SamplingConfig, TreeConfig
from specexec.decoding.engine import Engine
from specexec.errors import TokenizerMismatch
from specexec.loading import pairing
from specexec.loading.checkpoint import load_model, load_tokenizer
from specexec.propose.draft_model import LimitedDraft, limit_draft
from tests.conftest import make_noisy_copy, make_tiny

CPU = torch.device("cpu")
PROMPT = [5, 9, 17, 33, 4]


def word_tokenizer(symbols: dict[str, int], lowercase: bool = False):
    """A word-level fast tokenizer over ``symbols`` (``<pad>``, ``<s>``, ``</s>`` must be among them)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=symbols, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    if lowercase:
        tok.normalizer = normalizers.Lowercase()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def symbols(n: int, rename: dict[int, str] | None = None, word: str = "t") -> dict[str, int]:
    """ids 0..2 special, then ``{word}{i}``; ``rename`` gives some ids another symbol."""
    out = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for i in range(3, n):
        out[(rename or {}).get(i, f"{word}{i}")] = i
    return out


def save_tokenizer(path: Path, syms: dict[str, int]) -> None:
    tok = word_tokenizer(syms)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    for f in path.glob("tokenizer*"):
        f.unlink()
    tok.save_pretrained(path)


def shrink_rows(src: Path, dst: Path, rows: int, noise: float = 0.05) -> Path:
    """A draft for ``src``: its weights plus noise, with the embedding and lm_head cut to ``rows`` rows."""
    from safetensors.torch import load_file, save_file

    make_noisy_copy(src, dst, noise)
    for f in dst.glob("*.safetensors"):
        sd = load_file(f)
        for k in ("model.embed_tokens.weight", "lm_head.weight"):
            if k in sd:
                sd[k] = sd[k][:rows].contiguous()
        save_file(sd, f, metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["vocab_size"] = rows
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


# ---------------------------------------------------------------------------------------------- the check


def test_one_tokenizer_padded_rows_pair_and_padding_is_never_proposed():
    """One tokenizer (120 tokens), target 160 rows, draft 128: nothing differs; the draft's 8 rows past the
    tokenizer are excluded, and ids past the target's rows never arise."""
    tok = word_tokenizer(symbols(120))
    p = pairing.check_pair(tok, tok, 160, 128)
    assert p.differ == 0 and p.excluded.tolist() == list(range(120, 128))
    assert p.allowed is not None and p.allowed.shape == (128,) and int(p.allowed.sum()) == 120
    # the larger draft: its rows beyond the target's vocabulary are excluded too
    p = pairing.check_pair(tok, word_tokenizer(symbols(120)), 128, 160)
    assert p.differ == 0 and p.excluded.tolist() == list(range(120, 160))
    # every row a token on both sides: nothing to exclude
    assert pairing.check_pair(tok, tok, 120, 120).allowed is None


def test_a_renamed_special_token_is_excluded_and_reported(caplog):
    """Two releases of one family differ in one special token (LM Studio's Gemma 2 report: id 139): the pair is
    usable, that id is never proposed, and one warning names it with both sides' strings."""
    target = word_tokenizer(symbols(400, {139: "<start_of_image>"}))
    draft = word_tokenizer(symbols(400, {139: "<unused99>"}))
    with caplog.at_level(logging.WARNING, logger="specexec.loading.pairing"):
        p = pairing.check_pair(target, draft, 400, 400, "t-big", "t-small")
    assert p.differ == 1 and p.excluded.tolist() == [139]
    assert p.examples == ("id 139: '<start_of_image>' vs '<unused99>'",)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "1 token id(s) differ" in warnings[0] and "<unused99>" in warnings[0]


def test_another_family_is_refused_in_one_line():
    target = word_tokenizer(symbols(400))
    draft = word_tokenizer(symbols(400, word="u"))
    with pytest.raises(TokenizerMismatch) as e:
        pairing.check_pair(target, draft, 400, 400, "big", "small")
    msg = str(e.value)
    assert "\n" not in msg and "different tokenizers" in msg and "397 of 400 token ids differ" in msg
    assert "id 3: 't3' vs 'u3'" in msg and msg.count("vs") == pairing.SHOWN


@pytest.mark.parametrize("renamed, ok", [(4, True), (5, False)])
def test_the_refusal_threshold(renamed, ok):
    """More than 1% of the target's tokens differing refuses the pair (500 tokens: 5 may differ, 6 may not)."""
    n = 500
    rename = {10 + i: f"x{i}" for i in range(renamed)}
    # a token only the target has (beyond the draft's rows) counts as differing as well
    target = word_tokenizer({**symbols(n), "x99": n})
    draft = word_tokenizer(symbols(n, rename))
    if ok:
        p = pairing.check_pair(target, draft, n + 1, n)
        assert p.differ == renamed + 1 and p.excluded.tolist() == sorted(rename)
    else:
        with pytest.raises(TokenizerMismatch, match=f"{renamed + 1} of {n + 1} token ids differ"):
            pairing.check_pair(target, draft, n + 1, n)


def test_a_subset_vocabulary_is_refused_past_the_threshold():
    """A draft whose tokenizer lacks 16 of the target's 96 tokens (all it has agree): too much it cannot propose."""
    with pytest.raises(TokenizerMismatch, match="16 of 96 token ids differ"):
        pairing.check_pair(word_tokenizer(symbols(96)), word_tokenizer(symbols(80)), 96, 80)


def test_text_that_encodes_differently_is_refused():
    """The same id -> token table but another normalizer: text -> ids differs, so the pair is refused."""
    syms = symbols(300, {i: f"W{i}" for i in range(3, 300)})
    with pytest.raises(TokenizerMismatch, match="encodes to"):
        pairing.check_pair(word_tokenizer(syms), word_tokenizer(syms, lowercase=True), 300, 300)


def test_auto_choice_says_why(tmp_path, monkeypatch):
    """choose_draft's one line: a known pair (downloaded on first use when absent), and why there is no draft for
    an HF id not downloaded, a missing path and a GGUF file not converted yet. Nothing is downloaded."""
    monkeypatch.setenv("SPECEXEC_HOME", str(tmp_path))
    c = pairing.choose_draft("qwen2.5-coder-1.5b")
    assert c.draft == "qwen2.5-coder-0.5b"
    assert c.line == (
        "draft: qwen2.5-coder-0.5b (the known pair 'demo' in configs/models.toml; downloaded on first use)"
    )
    assert "not on this machine yet" in pairing.choose_draft("nobody-xyz/not-a-model").line
    assert pairing.choose_draft("nobody-xyz/not-a-model").draft is None
    assert "which was not found" in pairing.choose_draft(str(tmp_path / "missing")).line
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert "not readable before it loads" in pairing.choose_draft(str(tmp_path / "model.gguf")).line


def test_load_with_draft_auto(tmp_path, monkeypatch):
    """api.load(draft="auto") and load_engine with ModelOptions(draft="auto") take the smaller model of the
    target's family that is on this machine (hub.list_models says what is)."""
    from specexec.loading import hub

    target = make_tiny(tmp_path / "target", "llama", seed=8)
    small = make_tiny(tmp_path / "small", "llama", seed=8, layers=1, hidden=32)
    listed = [{"alias": "small", "source": "test", "path": str(small), "present": True}]
    monkeypatch.setattr(hub, "list_models", lambda home=None: listed)
    engine = api.load(str(target), "auto", device="cpu", dtype="fp32", context=64)
    assert engine.draft is not None and (engine.draft.cfg.hidden_size, engine.draft.cfg.num_layers) == (32, 1)
    opts = api.ModelOptions(target=str(target), draft="auto", device="cpu", dtype="fp32", context=64)
    assert api.load_engine(opts, TreeConfig.fixed(4), progress=False).draft is not None
    monkeypatch.setattr(hub, "list_models", lambda home=None: [])
    assert api.load(str(target), "auto", device="cpu", dtype="fp32", context=64).draft is None


def test_auto_finds_a_smaller_checkpoint_in_the_hf_cache(tmp_path, monkeypatch):
    """A smaller model of the family in the Hugging Face cache (found by specexec.loading.stores) is a candidate too;
    the line names it by its repo id."""
    from specexec.loading import hub

    monkeypatch.setattr(hub, "list_models", lambda home=None: [])
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    target = make_tiny(tmp_path / "target", "llama", seed=8)
    assert pairing.choose_draft(str(target)).draft is None
    snap = tmp_path / "hf" / "models--someone--tiny-small" / "snapshots" / "abc123"
    make_tiny(snap, "llama", seed=8, layers=1, hidden=32)
    c = pairing.choose_draft(str(target))
    assert c.draft is not None and Path(c.draft).expanduser() in (snap, Path("someone/tiny-small")), c
    assert c.line.startswith("draft: someone/tiny-small (a llama model on this machine with the target's tokenizer")


# ---------------------------------------------------------------------------------------------- the limited draft


@pytest.fixture(scope="module")
def padded_pair(tmp_path_factory) -> tuple[Path, Path]:
    """Target: 160 embedding rows; draft: its noisy copy cut to 128 rows; one tokenizer of 120 tokens."""
    root = tmp_path_factory.mktemp("padded")
    target = make_tiny(root / "target", "llama", vocab=160, seed=7)
    save_tokenizer(target, symbols(120))
    draft = shrink_rows(target, root / "draft", 128)
    return target, draft


def test_padded_pair_loads_as_a_limited_draft(padded_pair):
    engine = api.load(*map(str, padded_pair), device="cpu", dtype="fp32", context=256, tree=TreeConfig.fixed(8))
    assert engine.target.cfg.vocab_size == 160 and engine.draft.cfg.vocab_size == 128
    assert isinstance(engine.draft, LimitedDraft) and engine.draft.excluded.tolist() == list(range(120, 128))
    cache = engine.draft.new_cache(16)
    toks = torch.tensor([5, 9, 17])
    pos = torch.arange(3)
    logits = engine.draft.forward(toks, pos, pos, pos[None, :] <= pos[:, None], cache)
    assert logits.shape == (3, 128)
    assert torch.isneginf(logits[:, 120:]).all() and torch.isfinite(logits[:, :120]).all()


def test_padded_pair_greedy_equals_the_targets_own_decoding(padded_pair):
    """Greedy SpecExec and chain give the target's AR tokens; the draft's proposals are accepted often enough
    that the tree does real work (so the limited draft is exercised)."""
    engine = api.load(*map(str, padded_pair), device="cpu", dtype="fp32", context=256, tree=TreeConfig.fixed(8))
    want = engine.generate(PROMPT, 40, method="ar").tokens
    assert len(want) >= 10
    tree = engine.generate(PROMPT, 40, method="specexec", tree=TreeConfig.fixed(8, early_stop=False))
    chain = engine.generate(PROMPT, 40, method="chain", chain=ChainConfig(gamma=4))
    assert tree.tokens == want and chain.tokens == want
    assert tree.stats.tokens_per_step > 1.2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_padded_pair_on_cuda_with_captured_draft_passes(padded_pair):
    """On a GPU the draft's passes run as CUDA graphs (padded static shapes, captured growth levels): the mask is
    part of every captured pass, no tree holds an excluded id, and greedy SpecExec and chain give the AR tokens."""
    engine = api.load(*map(str, padded_pair), device="cuda", dtype="fp32", context=256, tree=TreeConfig.fixed(16))
    assert isinstance(engine.draft, LimitedDraft)
    want = engine.generate(PROMPT, 40, method="ar").tokens
    for budget in (8, 64):
        got = engine.generate(PROMPT, 40, method="specexec", tree=TreeConfig.fixed(budget, early_stop=False))
        assert got.tokens == want, budget
    assert engine.generate(PROMPT, 40, method="chain", chain=ChainConfig(gamma=4)).tokens == want
    dm = engine.draft_model
    assert dm is not None and dm.static is not None  # the graphed path ran
    rows = torch.tensor([5, 9, 17, 33], device="cuda")
    pos = torch.arange(4, device="cuda") + 200
    mask = torch.arange(204, device="cuda")[None, :] <= pos[:, None]
    logits = dm.forward(rows, pos, pos, mask)
    assert torch.isneginf(logits[:, 120:]).all() and torch.isfinite(logits[:, :120]).all()


def test_draft_vocab_head_combines_with_the_mask(padded_pair):
    """A reduced draft head (--draft-vocab) scores no excluded row, and the greedy output stays the target's."""
    engine = api.load(
        *map(str, padded_pair), device="cpu", dtype="fp32", context=256, tree=TreeConfig.fixed(8), draft_vocab=64
    )
    head = engine.draft.globals.lm_head
    assert not torch.isin(head.ids, torch.arange(120, 128)).any()
    want = engine.generate(PROMPT, 24, method="ar").tokens
    assert engine.generate(PROMPT, 24, method="specexec", tree=TreeConfig.fixed(8, early_stop=False)).tokens == want


def test_a_renamed_token_is_never_proposed_end_to_end(tmp_path):
    """Target and draft tokenizers differ at one id: the draft loads limited there and the output is the
    target's greedy decoding."""
    target = make_tiny(tmp_path / "target", "llama", vocab=400, seed=5)
    save_tokenizer(target, symbols(400, {139: "<start_of_image>"}))
    draft = make_noisy_copy(target, tmp_path / "draft", 0.05)
    save_tokenizer(draft, symbols(400, {139: "<unused99>"}))
    engine = api.load(str(target), str(draft), device="cpu", dtype="fp32", context=256, draft_vocab=0)
    assert isinstance(engine.draft, LimitedDraft) and engine.draft.excluded.tolist() == [139]
    want = engine.generate(PROMPT, 24, method="ar").tokens
    assert engine.generate(PROMPT, 24, method="specexec", tree=TreeConfig.fixed(16, early_stop=False)).tokens == want


def test_another_family_draft_refused_by_load(tmp_path):
    target = make_tiny(tmp_path / "target", "llama", vocab=96, seed=5)
    draft = make_tiny(tmp_path / "draft", "llama", vocab=96, seed=6, layers=1)
    save_tokenizer(draft, symbols(96, word="u"))
    with pytest.raises(TokenizerMismatch, match="different tokenizers"):
        api.load(str(target), str(draft), device="cpu", dtype="fp32", context=64)


# ---------------------------------------------------------------------------------------------- sampling stays exact

V = 16
EXCLUDED = [4, 9, 13]
NEW = 3
EOS = 2
SAMPLES = 1200


@pytest.fixture(scope="module")
def sampling_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("limited-sampling")
    target = make_tiny(root / "target", "llama", vocab=V, seed=3, std=0.3, layers=2, hidden=32)
    draft = make_noisy_copy(target, root / "draft", 0.1)
    return target, draft


def test_chain_sampling_with_a_limited_draft_is_the_targets_distribution(sampling_pair):
    """Chain speculative sampling with a draft that never proposes 3 of 16 ids: the next 3 tokens follow the
    target's exact joint distribution (chi-square, p > 1e-3), the excluded ids included (they come from the
    rejection's residual max(p - q, 0), where q = 0)."""
    from tests.decoding.test_sampling import Table, chi_square, joint, truncate_at_eos

    t_model = load_model(sampling_pair[0], CPU, torch.float32)
    d_model = limit_draft(load_model(sampling_pair[1], CPU, torch.float32), torch.tensor(EXCLUDED))
    engine = Engine(t_model, load_tokenizer(sampling_pair[0]), d_model, context=256)
    samp = SamplingConfig(temperature=1.0)
    P = truncate_at_eos(joint(Table(t_model, [5, 6, 7]), samp))
    out = [
        tuple(
            engine.generate(
                [5, 6, 7], NEW, method="chain", chain=ChainConfig(gamma=3), sampling_cfg=replace(samp, seed=s)
            ).tokens
        )
        for s in range(SAMPLES)
    ]
    _, _, pval, impossible = chi_square(out, P)
    assert impossible == 0 and pval > 1e-3, pval
    assert sum(t in EXCLUDED for s in out for t in s) > 0.05 * SAMPLES * NEW  # the excluded ids still come out


def test_limited_draft_renormalises_its_sampling_distribution(sampling_pair):
    """The draft's q is its softmax over the allowed ids alone: zero on the excluded ones, summing to one."""
    from specexec.steps import sampling

    d_model = limit_draft(load_model(sampling_pair[1], CPU, torch.float32), torch.tensor(EXCLUDED))
    plain = load_model(sampling_pair[1], CPU, torch.float32)
    pos = torch.arange(3)
    mask = pos[None, :] <= pos[:, None]
    args = (torch.tensor([5, 6, 7]), pos, pos, mask)
    q = sampling.probs(d_model.forward(*args, d_model.new_cache(8)), SamplingConfig(temperature=1.0))
    full = torch.softmax(plain.forward(*args, plain.new_cache(8)), -1)
    keep = torch.ones(V, dtype=torch.bool)
    keep[EXCLUDED] = False
    assert (q[:, EXCLUDED] == 0).all()
    torch.testing.assert_close(q[:, keep], full[:, keep] / full[:, keep].sum(-1, keepdim=True))


# ---------------------------------------------------------------------------------------------- the real tokenizer


@pytest.mark.slow
def test_qwen_style_padded_pair_with_the_real_tokenizer_runs_exactly(tmp_path):
    """The real Qwen2.5 tokenizer (the demo pair's) on tiny models with the real row counts: a 152,064-row target
    and a 151,936-row draft pair, and greedy SpecExec gives the target's AR tokens."""
    from specexec.loading import hub
    from tests.conftest import REAL_DRAFT, _pull_demo

    _pull_demo()  # a fresh cache may not hold the demo pair yet when this test runs
    source = hub.local_path(REAL_DRAFT)
    paths = []
    for name, rows in (("target", 152_064), ("draft", 151_936)):
        p = make_tiny(tmp_path / name, "qwen2", vocab=rows, seed=4, hidden=32, layers=1)
        for f in source.glob("tokenizer*"):
            shutil.copy(f, p / f.name)
        paths.append(p)
    engine = api.load(*map(str, paths), device="cpu", dtype="fp32", context=128, draft_vocab=0)
    prompt = engine.tokenizer.tokenizer("def quicksort(arr):")["input_ids"]
    want = engine.generate(prompt, 16, method="ar").tokens
    assert engine.generate(prompt, 16, method="specexec", tree=TreeConfig.fixed(8)).tokens == want
