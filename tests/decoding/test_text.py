"""The text layer: chat rendering, the incremental detokenizer, stop strings, and the stream that joins them.

Real BPE tokenizers are built here with the ``tokenizers`` library (offline): a byte-level BPE (GPT-2 / Qwen
style) and a sentencepiece-style BPE with byte fallback and Llama's leading-space strip, both trained on a small
vocabulary so that emoji and CJK characters split across tokens.
"""

from __future__ import annotations

import json
import random

import pytest

from specexec.decoding.text import (
    ChatTemplateError,
    Detokenizer,
    MessageError,
    StopMatcher,
    StopStringError,
    TextStream,
    encode_text,
    finish_reason,
    render_chat,
)
from specexec.errors import SpecexecError

CORPUS = [
    'def add_one(x):\n    """Return x + 1."""\n    return x + 1  # 加一\n',
    "Hello world, this is plain English prose about caching and decoding.",
    "你好，世界！这是一个测试。日本語のテキストも少し。",
    "emoji: 😀 🎉 🚀 ✨ naïve café — “quotes” and ümlauts",
    "for i in range(10):\n\tprint(f'{i}: {i * i}')\n",
]
SAMPLE = (
    'def greet(name: str) -> str:\n    """Say hello 👋 to {name}."""\n    return f\'你好, {name}! 🎉\'\n\n'
    "Unseen: 🦀 Ωmega ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 — 한국어 텍스트. The end."
)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _byte_level():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 10, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token=None)
    fast.chat_template = CHATML
    return fast


def _sentencepiece_style():
    """Llama-2-like: '▁' for spaces, byte-fallback tokens <0xXX>, decoder strips the first leading space."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=60, show_progress=False
    )
    tok.train_from_iterator(CORPUS * 10, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # byte fallback for every character outside the small alphabet
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def byte_tok():
    return _byte_level()


@pytest.fixture(scope="module")
def sp_tok():
    return _sentencepiece_style()


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _ref(tok, ids):
    return tok.decode(ids, skip_special_tokens=True)


# -- chat rendering ---------------------------------------------------------------------------------------------
def test_render_chat_matches_the_template(byte_tok):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 😀"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "多谢"},
    ]
    want = byte_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert render_chat(byte_tok, msgs) == list(want)
    text = byte_tok.decode(render_chat(byte_tok, msgs))
    assert text.endswith("<|im_start|>user\n多谢<|im_end|>\n<|im_start|>assistant\n")
    no_gen = render_chat(byte_tok, msgs, add_generation_prompt=False)
    assert byte_tok.decode(no_gen).endswith("多谢<|im_end|>\n")
    # extra keys (e.g. OpenAI's "name") are ignored, not passed to the template
    assert render_chat(byte_tok, [{"role": "user", "content": "Hi 😀", "name": "x"}]) == render_chat(
        byte_tok, [{"role": "user", "content": "Hi 😀"}]
    )


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "empty"),
        ("hello", "list"),
        ([{"role": "tool", "content": "x"}], "role must be one of system, user, assistant"),
        ([{"content": "x"}], "role must be"),
        ([{"role": "user", "content": ["a", "b"]}], "content must be a string"),
        ([{"role": "user"}], "content must be a string"),
        (["hi"], "must be an object"),
    ],
)
def test_render_chat_rejects_malformed_messages(byte_tok, messages, match):
    with pytest.raises(MessageError, match=match) as e:
        render_chat(byte_tok, messages)
    assert isinstance(e.value, SpecexecError)


def test_render_chat_without_template_or_refused(byte_tok, sp_tok):
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat(sp_tok, [{"role": "user", "content": "hi"}])
    strict = _byte_level()
    strict.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        render_chat(strict, [{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}])
    assert byte_tok.decode(render_chat(strict, [{"role": "user", "content": "hi"}])) == "hi"


def test_encode_text(byte_tok, sp_tok):
    assert encode_text(byte_tok, SAMPLE) == byte_tok(SAMPLE)["input_ids"]
    assert encode_text(sp_tok, "hello") == sp_tok("hello")["input_ids"]
    with pytest.raises(SpecexecError):
        encode_text(byte_tok, ["not", "text"])


# -- detokenizer ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["byte", "sp"])
def test_detokenizer_token_by_token_equals_decode(which, byte_tok, sp_tok):
    tok = byte_tok if which == "byte" else sp_tok
    ids = _ids(tok, SAMPLE)
    # the test is only meaningful if characters really split across tokens
    assert sum("\ufffd" in tok.decode([i]) for i in ids) >= 4
    d = Detokenizer(tok)
    pieces = [d.push([i]) for i in ids]
    pieces.append(d.flush())
    assert "".join(pieces) == d.text == _ref(tok, ids) == SAMPLE
    assert not any("\ufffd" in p for p in pieces)  # incomplete characters were held back, never emitted


def test_sentencepiece_leading_space(sp_tok):
    ids = _ids(sp_tok, " indented text and more words")
    assert sp_tok.convert_ids_to_tokens(ids)[0].startswith("▁")
    d = Detokenizer(sp_tok)
    pieces = [d.push([i]) for i in ids] + [d.flush()]
    assert "".join(pieces) == _ref(sp_tok, ids)
    assert any(p.startswith(" ") for p in pieces[1:])  # later words keep their space


def test_detokenizer_context_keeps_the_first_leading_space(sp_tok, byte_tok):
    prompt, answer = _ids(sp_tok, "Hello"), _ids(sp_tok, " world and more 😀")
    assert _ref(sp_tok, answer) == "world and more 😀"  # alone, the decoder strips the first space
    d = Detokenizer(sp_tok, context=prompt[-4:])
    got = "".join(d.push([i]) for i in answer) + d.flush()
    assert got == d.text == " world and more 😀" == _ref(sp_tok, prompt + answer)[len(_ref(sp_tok, prompt)) :]
    # a byte-level tokenizer needs no context; with one, the answer's text is unchanged
    a = _ids(byte_tok, " 加一 😀 x")
    d = Detokenizer(byte_tok, context=_ids(byte_tok, "abc 😀"))
    assert "".join(d.push([i]) for i in a) + d.flush() == _ref(byte_tok, a)


@pytest.mark.parametrize("which", ["byte", "sp"])
def test_detokenizer_random_splits(which, byte_tok, sp_tok):
    tok = byte_tok if which == "byte" else sp_tok
    rng = random.Random(0)
    words = SAMPLE.split(" ") + ["😀😀😀", "加一加一", "🎉🚀✨", "\n\n", "  "]
    for _ in range(40):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 30)))
        ids = _ids(tok, text)
        d = Detokenizer(tok)
        out, i = [], 0
        while i < len(ids):
            k = rng.randint(1, 6)
            out.append(d.push(ids[i : i + k]))
            i += k
        out.append(d.flush())
        assert "".join(out) == d.text == _ref(tok, ids), text


def test_detokenizer_skips_special_and_extra_ids(byte_tok):
    a, b = _ids(byte_tok, "abc 😀"), _ids(byte_tok, " 加一")
    special = byte_tok.convert_tokens_to_ids("<|im_start|>")  # special, but not in all_special_ids
    eos = byte_tok.eos_token_id
    extra = a[0]
    ids = a + [special, eos] + b
    d = Detokenizer(byte_tok)
    got = "".join(d.push([i]) for i in ids) + d.flush()
    assert got == _ref(byte_tok, ids) == "abc 😀 加一"
    d = Detokenizer(byte_tok, skip_ids={extra})
    got = "".join(d.push([i]) for i in ids) + d.flush()
    assert got == _ref(byte_tok, [i for i in ids if i != extra])


def test_detokenizer_flush_releases_an_incomplete_character(byte_tok):
    ids = _ids(byte_tok, SAMPLE)
    k = next(k for k in range(1, len(ids)) if _ref(byte_tok, ids[:k]).endswith("\ufffd"))
    cut = ids[:k]  # ends inside a character
    d = Detokenizer(byte_tok)
    held = "".join(d.push([i]) for i in cut)
    assert "\ufffd" not in held and _ref(byte_tok, cut).startswith(held)
    assert held + d.flush() == _ref(byte_tok, cut)


def test_detokenizer_genuine_replacement_characters_are_not_held_forever(byte_tok):
    # a model that keeps emitting a lone continuation byte: text ends in U+FFFD at every step
    bad = byte_tok.convert_tokens_to_ids("Ģ")  # byte 0x80 on its own
    assert byte_tok.decode([bad]) == "\ufffd"
    d = Detokenizer(byte_tok)
    out = "".join(d.push([bad]) for _ in range(40))
    assert out.count("\ufffd") >= 30  # released after a bounded hold, not only at flush
    assert out + d.flush() == _ref(byte_tok, [bad] * 40)


class _Counting:
    """Wraps a tokenizer; counts decode calls and the ids they decode."""

    def __init__(self, tok):
        self.tok, self.calls, self.decoded, self.longest = tok, 0, 0, 0

    def decode(self, ids, **kw):
        self.calls += 1
        self.decoded += len(ids)
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


@pytest.mark.parametrize("step", [1, 3])
def test_detokenizer_work_is_proportional_to_new_tokens(byte_tok, step):
    ids = _ids(byte_tok, SAMPLE * 8)
    n = len(ids)
    assert n > 300
    wrapped = _Counting(byte_tok)
    d = Detokenizer(wrapped)
    for i in range(0, n, step):
        d.push(ids[i : i + step])
    d.flush()
    assert d.text == _ref(byte_tok, ids)
    pushes = -(-n // step)
    # a push decodes its new ids plus the previous chunk, twice (a few ids more while a character is
    # incomplete); re-decoding the whole answer would be ~n^2 / (2 * step) ids and grow with the answer
    assert wrapped.calls <= 4 * pushes
    assert wrapped.decoded <= 8 * n
    assert wrapped.longest <= 2 * step + 8


# -- stop strings -----------------------------------------------------------------------------------------------
def _stop_ref(text: str, stops) -> tuple[str, bool]:
    """Non-streaming reference: cut before the occurrence that ends first (ties: the longest)."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < best):
            best = (i + len(s), i)
    return (text, False) if best is None else (text[: best[1]], True)


def _run(stops, chunks):
    m = StopMatcher(stops)
    out, stopped = [], False
    for c in chunks:
        t, stopped = m.push(c)
        out.append(t)
        if stopped:
            break
    if not stopped:
        out.append(m.flush())
    return "".join(out), stopped


def test_stop_spanning_pushes_is_held_then_cut():
    m = StopMatcher(["\n\nUser:"])
    assert m.push("Hello\n") == ("Hello", False)  # "\n" could begin the stop: held
    assert m.push("\nUs") == ("", False)
    assert m.push("er: more") == ("", True)
    assert m.matched == "\n\nUser:"
    assert m.push("anything") == ("", True)
    assert m.flush() == ""


def test_stop_overlapping_prefixes():
    assert _run(["ab"], ["a", "a", "b"]) == ("a", True)
    m = StopMatcher(["ab"])
    assert m.push("a") == ("", False)
    assert m.push("a") == ("a", False)
    assert m.push("b") == ("", True)
    assert _run(["aab", "ab"], ["a", "a", "a", "b"]) == ("a", True)


def test_stop_several_and_at_the_start():
    assert _run(["END", "###"], ["ab", "c##", "#x END"]) == ("abc", True)
    assert _run(["abc", "b"], ["a", "b", "c"]) == ("a", True)  # "b" ends first
    assert _run(["STOP"], ["STOP now"]) == ("", True)
    assert _run(["x"], ["x"]) == ("", True)


def test_stop_held_tail_released_at_flush():
    m = StopMatcher(["</answer>"])
    assert m.push("done </ans") == ("done ", False)
    assert m.flush() == "</ans"
    assert _run([], ["a", "b"]) == ("ab", False)


def test_stop_random_splits_match_the_reference():
    rng = random.Random(1)
    alphabet = "ab\nc"
    for _ in range(400):
        stops = sorted(
            {"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))}
        )
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 25)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        chunks = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        assert _run(stops, chunks) == _stop_ref(text, stops), (stops, chunks)


@pytest.mark.parametrize("bad", [[""], ["ok", ""], [3]])
def test_stop_rejects_bad_strings(bad):
    with pytest.raises(StopStringError):
        StopMatcher(bad)


# -- the stream -------------------------------------------------------------------------------------------------
def test_text_stream_eos(byte_tok):
    eos = byte_tok.eos_token_id
    ids = _ids(byte_tok, "answer 😀 done")
    s = TextStream(byte_tok, {eos})
    out = [s.push([i]) for i in ids]
    assert not any(stop for _, stop in out)
    text, stopped = s.push([eos] + _ids(byte_tok, " ignored"))
    assert stopped and s.hit_eos and s.finish_reason == "stop"
    assert "".join(t for t, _ in out) + text == s.text == "answer 😀 done"
    assert s.n_tokens == len(ids) + 1
    assert s.push(ids) == ("", True) and s.flush() == ""


def test_text_stream_stop_string_across_tokens(byte_tok):
    ids = _ids(byte_tok, "x = 1  # 加一\nEND_OF_CODE and more")
    s = TextStream(byte_tok, {byte_tok.eos_token_id}, stops=["\nEND_OF"])
    pieces = []
    for i in range(0, len(ids), 2):
        t, stopped = s.push(ids[i : i + 2])
        pieces.append(t)
        if stopped:
            break
    assert stopped and not s.hit_eos and s.stop_string == "\nEND_OF" and s.finish_reason == "stop"
    assert "".join(pieces) == s.text == "x = 1  # 加一"
    assert _ref(byte_tok, ids[: s.n_tokens]).startswith("x = 1  # 加一\nEND_OF")
    assert not _ref(byte_tok, ids[: s.n_tokens - 1]).endswith("\nEND_OF")


def test_text_stream_length(byte_tok):
    ids = _ids(byte_tok, "no stop here 🎉")
    s = TextStream(byte_tok, {byte_tok.eos_token_id}, stops=["🎉!"])
    text = "".join(s.push([i])[0] for i in ids)
    assert text == "no stop here "  # the emoji could begin the stop string: held
    text += s.flush()
    assert text == s.text == _ref(byte_tok, ids)
    assert s.finish_reason == "length" and finish_reason(False) == "length" and finish_reason(True) == "stop"


# -- the real Qwen tokenizer ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_qwen_tokenizer_token_by_token():
    from specexec.loading import hub
    from specexec.loading.checkpoint import load_tokenizer
    from tests.conftest import REAL_TARGET, _pull_demo

    _pull_demo()  # on a fresh cache this test may run before the shared pair is loaded
    info = load_tokenizer(hub.local_path(REAL_TARGET))
    tok = info.tokenizer
    text = SAMPLE + '\n```rust\nfn main() { println!("🦀 {}", "中文"); }\n```\nÅngström ½ ≤ ≥ 🇺🇳 👩‍💻'
    ids = _ids(tok, text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    d = Detokenizer(tok)
    pieces = [d.push([i]) for i in ids] + [d.flush()]
    assert "".join(pieces) == _ref(tok, ids) == text
    assert not any("\ufffd" in p for p in pieces)
    msgs = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "写一个函数 😀"}]
    ids = render_chat(tok, msgs)
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    s = TextStream(tok, info.eos_ids, stops=["```"])
    body = _ids(tok, "Here:\n```python\nx = 1\n```")
    got = "".join(s.push([i])[0] for i in body)
    assert got == "Here:\n" and s.finish_reason == "stop"
