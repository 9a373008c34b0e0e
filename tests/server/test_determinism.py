"""Determinism through the HTTP API: a request gives the same text every time it is served.

The engine's target runs shape-invariant passes by default, so every position's logits are bit-identical whatever
pass computes them (a prefill, a one-token step, a draft tree of any size); the automatic budget may then choose
different trees from one request to the next (it measures step costs) without changing a token. These tests
drive a live server on the default method and budget (what ``specexec serve`` gives a user: ``specexec`` with the
automatic budget) over a small pair built with the conftest helpers whose greedy choices are often near-ties
(see the ``pair`` fixture; EOS never preferred, see ``make_server_pair``), and check:

- repeated temperature-0 chat and completions requests answer identically (text and token counts);
- streamed (SSE) and non-streamed answers are the same text;
- a request served while another is in flight (queued behind it or beside it in joint passes, behind or beside
  one cancelled midway, or two clients at once) answers as when it is served alone;
- a stop string cuts the answer exactly before its first occurrence (``finish_reason`` "stop");
- a seeded sampled request repeats, and equals the same request on a server configured for plain AR decoding
  (``ServerConfig(method="ar")``, which is ``specexec serve --method ar``); greedy answers equal too.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from specexec.server import Defaults, ServerConfig, create_app
from tests.conftest import make_noisy_copy, make_tiny
from tests.server.test_server import LiveServer, ext, make_server_pair

CONTEXT = 1024
N = 40  # max_tokens of the checked requests
HI = [{"role": "user", "content": "t10 t11 t12"}]
OTHER = [{"role": "user", "content": "t50 t51 t52 t53"}]


# ---------------------------------------------------------------------------------------------- servers


def load_engine(pair: tuple[Path, Path], home: Path):
    """The engine as ``specexec serve --dtype bf16`` loads it: default tree (automatic budget), invariant target."""
    from specexec import api

    return api.load(
        str(pair[0]), str(pair[1]), device="cpu", dtype="bf16", context=CONTEXT, progress=False, cache_dir=home
    )


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """A small target with near-ties and its noisy copy as the draft (EOS never preferred, a Qwen-like template).

    Wider than the conftest pairs (512) with flat logits (init std 0.02), run in bf16: its next-token choices are
    often near-ties, where a pass whose kernels round differently would pick another token (measured: without
    the invariant target, greedy speculation differs from plain greedy on about half of such 64-token answers).
    """
    root = tmp_path_factory.mktemp("determinism")
    target = make_tiny(root / "target", "llama", seed=5, std=0.02, hidden=512, vocab=512)
    draft = make_noisy_copy(target, root / "draft", 0.1)
    return make_server_pair((target, draft), root / "served")


@pytest.fixture(scope="module", params=[1, 3], ids=["one-at-a-time", "parallel-3"])
def live(pair, tmp_path_factory, request):
    """The server a user gets: default method (specexec with the draft) and default (automatic) budget; generating
    one request at a time, or three together (their passes packed into joint passes)."""
    engine = load_engine(pair, tmp_path_factory.mktemp("home"))
    config = ServerConfig(model_name="tiny", defaults=Defaults(max_new_tokens=N), parallel=request.param)
    with LiveServer(create_app(config, engine=engine)) as srv:
        yield srv


@pytest.fixture(scope="module")
def live_ar(pair, tmp_path_factory):
    """The same files served with plain autoregressive decoding (``specexec serve --method ar``)."""
    engine = load_engine(pair, tmp_path_factory.mktemp("home_ar"))
    config = ServerConfig(model_name="tiny", method="ar", defaults=Defaults(max_new_tokens=N))
    with LiveServer(create_app(config, engine=engine)) as srv:
        yield srv


def chat(srv: LiveServer, messages: list[dict[str, str]] = HI, **kw: Any) -> Any:
    return srv.client().chat.completions.create(model="tiny", messages=messages, **{"max_tokens": N, **kw})


def chat_text(srv: LiveServer, messages: list[dict[str, str]] = HI, **kw: Any) -> str:
    return chat(srv, messages, **kw).choices[0].message.content


def sse_chat(srv: LiveServer, messages: list[dict[str, str]] = HI, **kw: Any) -> tuple[str, str | None]:
    """A streamed chat answer read as raw server-sent events: (the joined text deltas, the finish reason)."""
    import json

    body = {"messages": messages, "max_tokens": N, "stream": True, **kw}
    parts: list[str] = []
    finish = None
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    for ln in lines[:-1]:
        assert ln.startswith("data: ")
        event = json.loads(ln[6:])
        assert "error" not in event, event
        choice = event["choices"][0]
        parts.append(choice["delta"].get("content") or "")
        finish = choice["finish_reason"] or finish
    return "".join(parts), finish


# ---------------------------------------------------------------------------------------------- greedy


def test_default_server_runs_the_automatic_speculative_method(live):
    """The premise: the server under test runs the default speculative method with the automatic budget. (Whether
    a step drafts is the CPU policy's choice by measured time, so tokens per step are not asserted: a run where plain
    steps measured faster takes one token a step.)"""
    r = chat(live, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == N
    e = ext(r)
    assert e["method"] == "specexec" and e["budget_auto"] is True


def test_chat_greedy_repeats_exactly(live):
    answers = [chat(live, temperature=0) for _ in range(3)]
    texts = [a.choices[0].message.content for a in answers]
    assert texts[0] and texts == [texts[0]] * 3
    assert [a.usage.completion_tokens for a in answers] == [N] * 3
    assert len({a.usage.prompt_tokens for a in answers}) == 1
    assert [a.choices[0].finish_reason for a in answers] == ["length"] * 3


def test_completions_greedy_repeats_exactly(live):
    c = live.client()
    answers = [c.completions.create(model="tiny", prompt="t20 t21 t22", max_tokens=N, temperature=0) for _ in range(3)]
    texts = [a.choices[0].text for a in answers]
    assert texts[0] and texts == [texts[0]] * 3
    assert [a.usage.completion_tokens for a in answers] == [N] * 3
    # streamed, the same text
    chunks = list(c.completions.create(model="tiny", prompt="t20 t21 t22", max_tokens=N, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == texts[0]


def test_streamed_equals_non_streamed(live):
    plain = chat(live, temperature=0)
    text, finish = sse_chat(live, temperature=0)
    assert text == plain.choices[0].message.content and finish == plain.choices[0].finish_reason == "length"
    # and through the openai client's stream, with the usage chunk: the same token count too
    chunks = list(
        live.client().chat.completions.create(
            model="tiny",
            messages=HI,
            max_tokens=N,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_greedy_equals_plain_ar_server(live, live_ar):
    """Greedy speculation through the server is the target's plain greedy decoding, token for token."""
    spec, ar = chat(live, temperature=0), chat(live_ar, temperature=0)
    assert ext(ar)["method"] == "ar"
    assert spec.choices[0].message.content == ar.choices[0].message.content
    assert spec.usage.completion_tokens == ar.usage.completion_tokens
    kw: dict[str, Any] = dict(model="tiny", prompt="t20 t21 t22", max_tokens=N, temperature=0)
    assert (
        live.client().completions.create(**kw).choices[0].text
        == live_ar.client().completions.create(**kw).choices[0].text
    )


# ---------------------------------------------------------------------------------------------- other requests


def _first_text(stream) -> str:
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            return chunk.choices[0].delta.content
    raise AssertionError("the stream ended without text")


def _text(stream) -> str:
    return "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)


def _beside_or_behind(w) -> bool:
    """Two requests in the server: one generating and one waiting (one at a time), or both generating."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if w.waiting == 1 if w.parallel == 1 else w.active_count == 2:
            return True
        time.sleep(0.01)
    return False


def test_answer_unchanged_behind_another_request(live):
    alone = chat_text(live, temperature=0)
    other_alone = chat_text(live, OTHER, temperature=0)
    w = live.state.worker
    c = live.client()
    # a different, longer request is generating; the checked one is queued behind it (a streamed request is
    # answered once it is queued, so the worker's queue can be read before either finishes)
    running = c.chat.completions.create(model="tiny", messages=OTHER, max_tokens=12 * N, temperature=0, stream=True)
    first = _first_text(running)
    checked = c.chat.completions.create(model="tiny", messages=HI, max_tokens=N, temperature=0, stream=True)
    assert _beside_or_behind(w)  # the premise: it waits behind the other, or runs beside it
    other = first + _text(running)
    assert _text(checked) == alone
    assert other.startswith(other_alone)  # the other one is its own answer too, only longer
    live.wait_idle()
    # after the other request the engine's cache holds that one; served again, the same text
    assert chat_text(live, temperature=0) == alone


def test_answer_unchanged_after_a_request_cancelled_midway(live):
    alone = chat_text(live, temperature=0)
    w = live.state.worker
    c = live.client()
    running = c.chat.completions.create(model="tiny", messages=OTHER, max_tokens=20 * N, temperature=0, stream=True)
    assert _first_text(running)
    checked = c.chat.completions.create(model="tiny", messages=HI, max_tokens=N, temperature=0, stream=True)
    assert _beside_or_behind(w)
    running.close()  # the client leaves mid-answer; the queued request runs next, after a cancelled generation
    assert _text(checked) == alone
    live.wait_idle()


def test_two_concurrent_clients_answer_as_alone(live):
    prompts = {"a": HI, "b": OTHER}
    alone = {k: chat_text(live, m, temperature=0) for k, m in prompts.items()}
    got: dict[str, str] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def ask(key: str, stream: bool) -> None:
        try:
            barrier.wait(30)
            if stream:
                got[key] = sse_chat(live, prompts[key], temperature=0)[0]
            else:
                got[key] = chat_text(live, prompts[key], temperature=0)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    for _ in range(2):
        threads = [threading.Thread(target=ask, args=("a", True)), threading.Thread(target=ask, args=("b", False))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert got == alone
        got.clear()


# ---------------------------------------------------------------------------------------------- stop strings


def _stop_word(full: str) -> str:
    """A word of ``full`` whose first occurrence (as text) is not at its start."""
    for word in full.split(" ")[2:]:
        if full.index(word) > 0:
            return word
    raise AssertionError(f"no usable stop word in {full!r}")


def test_stop_string_cuts_at_its_first_occurrence(live):
    full = chat(live, temperature=0)
    text = full.choices[0].message.content
    stop = _stop_word(text)
    cut = text[: text.index(stop)]
    r = chat(live, temperature=0, stop=stop)
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < full.usage.completion_tokens
    streamed, finish = sse_chat(live, temperature=0, stop=[stop])
    assert streamed == cut and finish == "stop"
    # a stop string of two words (it spans a token boundary), and one that never occurs beside it
    words = text.split(" ")
    two = " ".join(words[len(words) // 2 : len(words) // 2 + 2])
    r2 = chat(live, temperature=0, stop=["no such text", two])
    assert r2.choices[0].message.content == text[: text.index(two)] and r2.choices[0].finish_reason == "stop"
    # completions too
    c = live.client()
    whole = c.completions.create(model="tiny", prompt="t20 t21 t22", max_tokens=N, temperature=0).choices[0].text
    stop_c = _stop_word(whole)
    cr = c.completions.create(model="tiny", prompt="t20 t21 t22", max_tokens=N, temperature=0, stop=stop_c)
    assert cr.choices[0].text == whole[: whole.index(stop_c)] and cr.choices[0].finish_reason == "stop"


# ---------------------------------------------------------------------------------------------- seeded sampling


def test_seeded_sampling_repeats_and_equals_ar(live, live_ar):
    kw: dict[str, Any] = dict(temperature=0.9, top_p=0.95, seed=1234)
    a = chat(live, **kw)
    b = chat(live, **kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens == b.usage.completion_tokens
    assert ext(a)["method"] == "specexec"
    streamed, _ = sse_chat(live, **kw)
    assert streamed == a.choices[0].message.content
    # seeded AR on the plain-decoding server gives the same text
    ar = chat(live_ar, **kw)
    assert ext(ar)["method"] == "ar"
    assert ar.choices[0].message.content == a.choices[0].message.content
    # each seed's answer is the AR server's, and the seed matters (sampling does sample)
    by_seed = {1234: a.choices[0].message.content}
    for seed in (1, 2):
        by_seed[seed] = chat_text(live, **{**kw, "seed": seed})
        assert by_seed[seed] == chat_text(live_ar, **{**kw, "seed": seed})
    assert len(set(by_seed.values())) > 1
    # completions: seeded, repeated, and the AR server's
    ck: dict[str, Any] = dict(model="tiny", prompt="t20 t21 t22", max_tokens=N, temperature=0.9, seed=77)
    c1 = live.client().completions.create(**ck).choices[0].text
    assert c1 == live.client().completions.create(**ck).choices[0].text
    assert c1 == live_ar.client().completions.create(**ck).choices[0].text


# ---------------------------------------------------------------------------------------------- log-probs


def test_logprobs_repeat_and_equal_plain_decoding(live, live_ar):
    """The target's log-probs of the emitted tokens come from its verify passes, which are shape-invariant: the
    same values to the bit whatever the tree, streamed or not, and on the plain-decoding server."""
    import json

    body = {"messages": HI, "max_tokens": N, "temperature": 0, "logprobs": True, "top_logprobs": 5}

    def post(srv: LiveServer) -> dict[str, Any]:
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    spec = post(live)
    content = spec["logprobs"]["content"]
    assert len(content) == N and all(len(e["top_logprobs"]) == 5 for e in content)
    assert post(live)["logprobs"] == spec["logprobs"]
    assert post(live_ar)["logprobs"] == spec["logprobs"]
    with httpx.stream("POST", live.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln and ln != "data: [DONE]"]
    streamed = [
        x
        for e in events
        if e["choices"] and e["choices"][0]["logprobs"]
        for x in e["choices"][0]["logprobs"]["content"]
    ]
    assert streamed == content
    # completions: the same values in that endpoint's shape
    cbody = {"prompt": "t20 t21 t22", "max_tokens": N, "temperature": 0, "logprobs": 5}
    a = httpx.post(live.url + "/v1/completions", json=cbody, timeout=120).json()["choices"][0]["logprobs"]
    b = httpx.post(live_ar.url + "/v1/completions", json=cbody, timeout=120).json()["choices"][0]["logprobs"]
    assert a == b and len(a["tokens"]) == N
