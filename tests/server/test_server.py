"""``specexec serve``: a live uvicorn server on a free port, driven by the official ``openai`` client.

The server runs the REAL engine on a tiny pair built here: the conftest tiny pair with the end-of-sequence row of
both LM heads zeroed (greedy never ends early, so long answers exist for the disconnect / queue tests) and a
Qwen-like chat template (the generation prompt is the assistant header), so that a continued conversation
re-renders exactly what the engine already holds. Expected texts come from a second engine on the same files
(``engine.generate``), i.e. what ``specexec generate`` prints; one test compares with the CLI itself.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from specexec.config import SamplingConfig, TreeConfig
from specexec.server import Defaults, ServerConfig, create_app

TREE = TreeConfig.fixed(8, early_stop=False)
CONTEXT = 2048
LONG = 2000  # a long answer (max_tokens) for the cancel / queue tests
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}t3 {{ m['content'] }} t4 "
    "{% elif m['role'] == 'system' %}t7 {{ m['content'] }} t8 "
    "{% else %}t5 {{ m['content'] }} t6 {% endif %}{% endfor %}{% if add_generation_prompt %}t5{% endif %}"
)
HI = [{"role": "user", "content": "t10 t11 t12"}]


# ---------------------------------------------------------------------------------------------- a live server


class LiveServer:
    """Run an ASGI app with uvicorn in a background thread on a free 127.0.0.1 port."""

    def __init__(self, app) -> None:
        self.app = app
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def state(self):
        return self.app.state.server

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120)

    def wait_idle(self, timeout: float = 60) -> None:
        """Until the worker runs nothing and nothing waits (a generous bound, not a timing assertion)."""
        w = self.state.worker
        deadline = time.monotonic() + timeout
        while w.busy or w.waiting:
            assert time.monotonic() < deadline, "the worker never went idle"
            time.sleep(0.02)


def make_server_pair(src: tuple[Path, Path], dst: Path) -> tuple[Path, Path]:
    """Copies of the tiny pair whose LM heads never prefer EOS (id 2), with a Qwen-like chat template."""
    import torch
    from safetensors.torch import load_file, save_file

    out = []
    for path in src:
        d = dst / path.name
        shutil.copytree(path, d)
        for f in d.glob("*.safetensors"):
            sd = load_file(f)
            sd["lm_head.weight"][2] = torch.zeros_like(sd["lm_head.weight"][2])
            save_file(sd, f, metadata={"format": "pt"})
        cfg_file = d / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text())
        cfg["chat_template"] = TEMPLATE
        cfg_file.write_text(json.dumps(cfg))
        tmpl = d / "chat_template.jinja"
        if tmpl.exists():
            tmpl.write_text(TEMPLATE)
        out.append(d)
    return out[0], out[1]


def load_engine(pair: tuple[Path, Path]):
    from specexec import api

    return api.load(str(pair[0]), str(pair[1]), device="cpu", context=CONTEXT, tree=TREE, progress=False)


@pytest.fixture(scope="module")
def pair(tiny_pair, tmp_path_factory):
    return make_server_pair(tiny_pair, tmp_path_factory.mktemp("server_pair"))


@pytest.fixture(scope="module")
def ref(pair):
    """The reference engine: same files, used directly (what ``specexec generate`` runs)."""
    return load_engine(pair)


@pytest.fixture(scope="module")
def live(pair):
    engine = load_engine(pair)
    config = ServerConfig(
        model_name="tiny",
        queue=1,
        max_body_bytes=64 * 1024,
        tree=TREE,
        defaults=Defaults(max_new_tokens=32),
        parallel=1,
    )
    with LiveServer(create_app(config, engine=engine)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(live):
    return live.client()


def expect(ref, prompt, n, chat=False, **samp) -> str:
    return ref.generate(prompt, n, tree=TREE, chat=chat, sampling_cfg=SamplingConfig(**samp)).text


def ext(obj) -> dict:
    return (obj.model_extra or {})["specexec"]


# ---------------------------------------------------------------------------------------------- basics


def test_health_models_and_page(live):
    r = httpx.get(live.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["model"] == "tiny"
    models = live.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    page = httpx.get(live.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/v1/chat/completions" in page.text
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page.text)  # no external resources (vendored files only)
    assert httpx.get(live.url + "/v1/nope").json()["error"]["code"] == "not_found"


def test_health_reports_the_prefix_cache(live, client):
    """Two conversations: the first one's state is saved when the second drops it; /health counts it."""
    for prompt in ("t10 t11 t12 t13 t14", "t50 t51 t52"):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=4)
    live.wait_idle()
    info = httpx.get(live.url + "/health").json()["prefix_cache"]
    assert info["entries"] >= 1 and 0 < info["bytes"] <= info["budget_bytes"]
    assert set(info) == {"entries", "bytes", "budget_bytes", "hits", "restored_tokens"}


def test_chat_greedy_equals_generate_chat(client, ref):
    r = client.chat.completions.create(model="tiny", messages=HI, max_tokens=24, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "tiny"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expect(ref, "t10 t11 t12", 24, chat=True)
    assert r.choices[0].finish_reason == "length"
    ids = ref.encode("t10 t11 t12", chat=True)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 24, len(ids) + 24)
    e = ext(r)
    assert e["method"] == "specexec" and e["budget"] == 8 and e["new_tokens"] == 24
    assert e["tokens_per_step"] > 0 and e["tokens_per_s"] > 0


def test_chat_streamed_equals_non_streamed(client, ref):
    want = expect(ref, "t10 t11 t12", 20, chat=True)
    chunks = list(client.chat.completions.create(model="tiny", messages=HI, max_tokens=20, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert len([c for c in chunks if c.choices[0].delta.content]) > 1  # streamed in pieces
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert ext(chunks[-1])["new_tokens"] == 20


def test_completions_equal_generate(client, ref):
    r = client.completions.create(model="tiny", prompt="t20 t21 t22", max_tokens=16, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    want = expect(ref, "t20 t21 t22", 16)
    assert r.choices[0].text == want
    assert r.usage.prompt_tokens == len(ref.encode("t20 t21 t22"))
    chunks = list(client.completions.create(model="tiny", prompt="t20 t21 t22", max_tokens=16, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"
    ids = client.completions.create(model="tiny", prompt=ref.encode("t20 t21 t22"), max_tokens=16)
    assert ids.choices[0].text == want  # a prompt given as token ids


def test_include_usage(client, ref):
    ids = ref.encode("t10 t11 t12", chat=True)
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=HI, max_tokens=10, stream=True, stream_options={"include_usage": True}
        )
    )
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 10 and last.usage.prompt_tokens == len(ids)
    assert last.usage.total_tokens == len(ids) + 10
    assert chunks[-2].choices[0].finish_reason == "length" and ext(chunks[-2])["new_tokens"] == 10
    assert all(c.usage is None for c in chunks[:-1])
    plain = list(client.chat.completions.create(model="tiny", messages=HI, max_tokens=4, stream=True))
    assert plain[-1].choices and plain[-1].usage is None  # no usage chunk unless asked


def test_raw_sse_format(live):
    with httpx.stream(
        "POST", live.url + "/v1/chat/completions", timeout=60, json={"messages": HI, "max_tokens": 6, "stream": True}
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}


# ---------------------------------------------------------------------------------------------- stop, seed, EOS


def test_stop_strings(client, ref):
    full = expect(ref, "t10 t11 t12", 24, chat=True)
    words = full.split(" ")
    stop = words[3]  # a word that occurs in the answer: the text before its first occurrence comes back
    cut = full[: full.index(stop)]
    r = client.chat.completions.create(model="tiny", messages=HI, max_tokens=24, stop=[stop, "zzz"])
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 24
    chunks = list(client.chat.completions.create(model="tiny", messages=HI, max_tokens=24, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    # a stop string that spans two pieces ("tA tB" crosses a token boundary) is still found and held back
    two = " ".join(words[4:6])
    r2 = client.chat.completions.create(model="tiny", messages=HI, max_tokens=24, stop=two, stream=False)
    assert r2.choices[0].message.content == full[: full.index(two)] and r2.choices[0].finish_reason == "stop"
    # completions too; and a stop string that never occurs changes nothing
    c = client.completions.create(model="tiny", prompt="t20 t21", max_tokens=12, stop=["no such text"])
    assert c.choices[0].text == expect(ref, "t20 t21", 12) and c.choices[0].finish_reason == "length"


def test_seed_reproduces_a_sampled_answer(client, ref):
    kw = dict(model="tiny", messages=HI, max_tokens=24, temperature=1.0, top_p=0.95)
    a = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    assert a == b
    assert a == expect(ref, "t10 t11 t12", 24, chat=True, temperature=1.0, top_p=0.95, seed=1234)
    others = {client.chat.completions.create(seed=s, **kw).choices[0].message.content for s in range(5)}
    assert len(others) > 1  # sampling does sample
    k = client.chat.completions.create(seed=7, extra_body={"top_k": 3, "min_p": 0.05}, **kw)
    assert k.choices[0].message.content == expect(
        ref, "t10 t11 t12", 24, chat=True, temperature=1.0, top_p=0.95, top_k=3, min_p=0.05, seed=7
    )


def test_eos_gives_finish_reason_stop(tiny_pair):
    """On the unmodified tiny pair the greedy answer to this prompt ends with EOS well before max_tokens."""
    from specexec import api

    engine = api.load(str(tiny_pair[0]), str(tiny_pair[1]), device="cpu", context=256, tree=TREE, progress=False)
    want = engine.generate("t10 t11", 64, tree=TREE)
    assert want.tokens[-1] in engine.tokenizer.eos_ids and len(want.tokens) < 64  # the premise
    with LiveServer(create_app(ServerConfig(model_name="t", tree=TREE), engine=engine)) as srv:
        r = srv.client().completions.create(model="t", prompt="t10 t11", max_tokens=64)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == want.text
    assert r.usage.completion_tokens == len(want.tokens)


# ---------------------------------------------------------------------------------------------- errors


def _bad(client, status: int, **kw) -> dict:
    kind = kw.pop("kind", "chat")
    with pytest.raises(openai.APIStatusError) as e:
        if kind == "chat":
            client.chat.completions.create(**{"model": "tiny", "messages": HI, **kw})
        else:
            client.completions.create(**{"model": "tiny", **kw})
    assert e.value.status_code == status, e.value
    body = e.value.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_400s(client):
    assert _bad(client, 400, temperature=-0.5)["param"] == "temperature"
    assert _bad(client, 400, top_p=1.5)["param"] == "top_p"
    assert _bad(client, 400, max_tokens=0)["param"] == "max_tokens"
    assert _bad(client, 400, max_completion_tokens=-3)["param"] == "max_completion_tokens"
    err = _bad(client, 400, max_tokens=CONTEXT)
    assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
    assert _bad(client, 400, n=2)["param"] == "n"
    assert _bad(client, 400, messages=[])["param"] == "messages"
    assert _bad(client, 400, messages=[{"role": "wizard", "content": "x"}])["param"] == "messages[0].role"
    assert _bad(client, 400, extra_body={"top_k": -1})["param"] == "top_k"
    long_prompt = " ".join(["t9"] * (CONTEXT + 5))
    assert _bad(client, 400, kind="completion", prompt=long_prompt)["code"] == "context_length_exceeded"
    assert _bad(client, 400, kind="completion", prompt=["t9", "t10"])["param"] == "prompt"  # two prompts
    assert _bad(client, 400, kind="completion", prompt="t9", echo=True)["param"] == "echo"
    assert _bad(client, 400, kind="completion", prompt=[5, 100000])["param"] == "prompt"  # ids outside the vocab


def test_malformed_and_missing(live):
    url = live.url + "/v1/chat/completions"
    for body in (
        b"{bad json",
        b"[1, 2]",
        b"\xff\xfe",
        json.dumps({"model": "tiny"}).encode(),
        json.dumps({"messages": "hello"}).encode(),
        json.dumps({"messages": HI, "stream": "yes"}).encode(),
        json.dumps({"messages": HI, "temperature": "hot"}).encode(),
        json.dumps({"messages": HI, "temperature": float("nan")}).encode(),
        json.dumps({"messages": HI, "seed": "abc"}).encode(),
        json.dumps({"messages": HI, "seed": 2**70}).encode(),
        json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(),
    ):
        r = httpx.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(live.url + "/v1/completions", json={"max_tokens": 4}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(url, json={"messages": HI, "max_tokens": 3, "unknown_field": {"a": 1}, "user": "u"}, timeout=30)
    assert r.status_code == 200  # unknown fields are ignored
    assert httpx.get(url).status_code == 405


def test_body_size_limit(live):
    url = live.url + "/v1/chat/completions"
    big = json.dumps({"messages": [{"role": "user", "content": "t9 " * 40000}]}).encode()
    assert len(big) > 64 * 1024
    r = httpx.post(url, content=big, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    def chunked():  # no Content-Length: counted while it arrives
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192]

    r = httpx.post(url, content=chunked(), headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 413
    assert httpx.get(live.url + "/health").status_code == 200


def test_api_key(pair, ref):
    config = ServerConfig(model_name="tiny", api_key="sekrit", tree=TREE)
    with LiveServer(create_app(config, engine=ref)) as srv:
        for key in ("wrong", "none"):
            with pytest.raises(openai.AuthenticationError) as e:
                srv.client(key).chat.completions.create(model="tiny", messages=HI, max_tokens=2)
            assert e.value.status_code == 401 and e.value.response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/v1/models").status_code == 401  # no header at all
        assert httpx.get(srv.url + "/health").status_code == 200  # no key needed
        assert httpx.get(srv.url + "/").status_code == 200
        r = srv.client("sekrit").chat.completions.create(model="tiny", messages=HI, max_tokens=4)
        assert r.choices[0].message.content == expect(ref, "t10 t11 t12", 4, chat=True)


def test_loading_answers_503_then_serves(pair):
    gate = threading.Event()

    def loader():
        gate.wait(60)
        return load_engine(pair)

    with LiveServer(create_app(ServerConfig(model_name="tiny", tree=TREE), loader=loader)) as srv:
        assert httpx.get(srv.url + "/health").status_code == 503
        c = srv.client()
        with pytest.raises(openai.APIStatusError) as e:
            c.chat.completions.create(model="tiny", messages=HI, max_tokens=2)
        assert e.value.status_code == 503
        gate.set()
        deadline = time.monotonic() + 60
        while httpx.get(srv.url + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert c.chat.completions.create(model="tiny", messages=HI, max_tokens=2).choices[0].message.content


# ---------------------------------------------------------------------------------------------- concurrency


def _first_text(stream) -> str:
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            return chunk.choices[0].delta.content
    raise AssertionError("the stream ended without text")


def test_health_answers_during_a_generation_and_disconnect_cancels(live, client, ref):
    w = live.state.worker
    cancelled = w.cancelled
    stream = client.chat.completions.create(model="tiny", messages=HI, max_tokens=LONG, stream=True)
    assert _first_text(stream)
    assert w.busy
    h = httpx.get(live.url + "/health", timeout=5)  # the event loop is free while the engine works
    assert h.status_code == 200 and h.json()["busy"] is True
    assert client.models.list().data[0].id == "tiny"
    stream.close()  # the client goes away mid-answer
    live.wait_idle()
    assert w.cancelled == cancelled + 1
    assert w.last.generated < LONG // 2  # stopped at the next step, not run to the end
    # the next request starts at once and is right
    r = client.chat.completions.create(model="tiny", messages=HI, max_tokens=12)
    assert r.choices[0].message.content == expect(ref, "t10 t11 t12", 12, chat=True)


def test_non_streamed_request_cancelled_when_the_client_leaves(live, client, ref):
    w = live.state.worker
    cancelled = w.cancelled
    with pytest.raises(httpx.ReadTimeout):  # the client gives up waiting and closes the connection
        httpx.post(
            live.url + "/v1/chat/completions",
            json={"messages": HI, "max_tokens": LONG},
            timeout=httpx.Timeout(30, read=0.5),
        )
    live.wait_idle()
    assert w.cancelled == cancelled + 1 and w.last.generated < LONG // 2
    r = client.chat.completions.create(model="tiny", messages=HI, max_tokens=6)
    assert r.choices[0].message.content == expect(ref, "t10 t11 t12", 6, chat=True)


def test_queue_full_gives_429_and_a_waiting_client_can_leave(live, client):
    w = live.state.worker
    assert live.app.state.config.queue == 1
    running = client.chat.completions.create(model="tiny", messages=HI, max_tokens=LONG, stream=True)
    assert _first_text(running)
    waiting = client.completions.create(model="tiny", prompt="t30", max_tokens=LONG, stream=True)  # queued
    assert w.busy and w.waiting == 1
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model="tiny", messages=HI, max_tokens=2)
    assert e.value.status_code == 429 and int(e.value.response.headers["retry-after"]) >= 1
    assert e.value.response.json()["error"]["code"] == "queue_full"
    waiting.close()  # leaves the queue before it ever ran
    deadline = time.monotonic() + 30
    while w.waiting:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    running.close()
    live.wait_idle()
    assert w.last.generated < LONG // 2


def test_two_concurrent_clients_both_complete_correctly(live, ref):
    prompts = {"a": [{"role": "user", "content": "t40 t41"}], "b": [{"role": "user", "content": "t50 t51 t52"}]}
    want = {k: expect(ref, m[0]["content"], 40, chat=True) for k, m in prompts.items()}
    got: dict[str, str] = {}
    errors: list[BaseException] = []

    def ask(key: str, stream: bool) -> None:
        try:
            c = live.client()
            if stream:
                chunks = c.chat.completions.create(model="tiny", messages=prompts[key], max_tokens=40, stream=True)
                got[key] = "".join(ch.choices[0].delta.content or "" for ch in chunks)
            else:
                r = c.chat.completions.create(model="tiny", messages=prompts[key], max_tokens=40)
                got[key] = r.choices[0].message.content
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=ask, args=("a", True)), threading.Thread(target=ask, args=("b", False))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert got == want


# ---------------------------------------------------------------------------------------------- prefix reuse


def test_second_turn_prefills_only_the_new_tokens(client, ref):
    from specexec.decoding.text import render_chat

    tok = ref.tokenizer.tokenizer
    first = client.chat.completions.create(model="tiny", messages=HI, max_tokens=8)
    answer = first.choices[0].message.content
    turn2 = HI + [{"role": "assistant", "content": answer}, {"role": "user", "content": "t20 t21"}]
    second = client.chat.completions.create(model="tiny", messages=turn2, max_tokens=8)
    ids1, ids2 = render_chat(tok, HI), render_chat(tok, turn2)
    held = len(ids1) + first.usage.completion_tokens  # what the engine holds after turn 1
    assert ids2[:held] == ids1 + tok(answer, add_special_tokens=False)["input_ids"]  # the premise
    new = len(ids2) - held
    assert new == len(render_chat(tok, [{"role": "user", "content": "t20 t21"}])) + 1  # "t6" + the new message
    # the engine's cache holds turn 1 but its last answer token (generated, never fed back); the prefill feeds that
    # token and the new ones but the last (which the first decode step processes): nothing of turn 1 is recomputed.
    # A snapshot of an earlier conversation (the prefix cache) may hold a few of the new tokens too
    restored = ext(second)["restored_tokens"]
    assert ext(second)["prefill_tokens"] == new - restored and restored < new
    assert second.usage.prompt_tokens_details.cached_tokens == held - 1 + restored
    # turn 1 itself was mostly new to the live cache (an earlier request's snapshot may have held it)
    assert ext(first)["prefill_tokens"] + ext(first)["restored_tokens"] >= len(ids1) - 1 - 2
    assert second.choices[0].message.content == ref.generate(ids2, 8, tree=TREE).text


# ---------------------------------------------------------------------------------------------- the CLI


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-c", "from specexec.cli import main; main()", *args]


def test_cli_serve_equals_cli_generate(pair):
    common = [
        "--target",
        str(pair[0]),
        "--draft",
        str(pair[1]),
        "--device",
        "cpu",
        "--budget",
        "8",
        "--no-early-stop",
        "--context",
        str(CONTEXT),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        _cli("serve", *common, "--port", "0", "--served-model-name", "tiny-cli"),
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stderr.readline()
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        assert m, line
        url = f"http://127.0.0.1:{m.group(1)}"
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
        deadline = time.monotonic() + 120
        while httpx.get(url + "/health").status_code != 200:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        chat = c.chat.completions.create(model="tiny-cli", messages=HI, max_tokens=16, temperature=0)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    assert proc.returncode == 0
    gen = subprocess.run(
        _cli("generate", *common, "--chat", "-p", "t10 t11 t12", "-n", "16", "--json", "-q"),
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert gen.returncode == 0, gen.stderr
    assert chat.choices[0].message.content == json.loads(gen.stdout)["text"]


def test_cli_errors_are_one_line(pair):
    from typer.testing import CliRunner

    from specexec.cli import app

    busy = socket.create_server(("127.0.0.1", 0))
    port = busy.getsockname()[1]
    cases = [
        (["--port", str(port)], "cannot listen on 127.0.0.1"),
        (["--queue", "-1"], "--queue must be >= 0"),
        (["--port", "70000"], "--port must be in"),
        (["--host", "no.such.host.invalid"], "cannot listen on no.such.host.invalid"),
        (["--method", "bogus"], "method"),
    ]
    try:
        for extra, pattern in cases:
            r = CliRunner().invoke(app, ["serve", "--target", str(pair[0]), "--device", "cpu", *extra])
            # the one notice line of --draft auto (the default) may come first; the error is one line after it
            lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("draft: ")]
            assert r.exit_code != 0 and len(lines) == 1 and lines[0].startswith("error: "), (extra, r.stderr)
            assert pattern in lines[0], (extra, lines)
    finally:
        busy.close()


def test_cli_model_load_failure_exits_with_one_error(tmp_path):
    r = subprocess.run(
        _cli("serve", "--target", str(tmp_path / "missing"), "--device", "cpu", "--port", "0", "-q"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode != 0 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr


# ---------------------------------------------------------------------------------------------- the real pair


@pytest.mark.slow
def test_real_pair_chat_equals_engine(real_pair):
    """The demo pair (the session's shared copy): a greedy chat answer through the server equals the engine's."""
    engine = real_pair
    tree = TreeConfig.fixed(32, early_stop=False)  # fixed: no measured (timing-dependent) choices
    msgs = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    engine.reset()
    with LiveServer(create_app(ServerConfig(model_name="demo", tree=tree, parallel=1), engine=engine)) as srv:
        r = srv.client().chat.completions.create(model="demo", messages=msgs, max_tokens=16, temperature=0)
    engine.reset()
    want = engine.generate(msgs[0]["content"], 16, tree=tree, chat=True)
    assert r.choices[0].message.content == want.text
    assert r.usage.completion_tokens == len(want.tokens) == 16
    assert ext(r)["method"] == "specexec" and ext(r)["budget"] == 32
