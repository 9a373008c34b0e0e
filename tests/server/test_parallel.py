"""``specexec serve --parallel``: several requests generate together, each answer exactly its solo answer.

A live server on a tiny byte-level pair (the structured-output tests' pair: schemas and tool calls compile) runs
three requests at once, their steps packed into joint target passes. Driven by the official ``openai`` client:
greedy, seeded sampling, a JSON schema, a forced tool call, stop strings and log-probs sent together (more than
run at once, so some join as others leave) answer exactly as each does alone; a client that leaves frees its
place at once and changes nobody else's text; past ``--parallel`` running and ``--queue`` waiting, HTTP 429.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from specexec.server import Defaults, ServerConfig, create_app
from tests.server.test_server import LiveServer
from tests.server.test_structured_server import ADD, ASK, SCHEMA, TREE, WEATHER, byte_pair, load  # noqa: F401

PARALLEL = 3
LONG = 600  # a long answer (this pair never prefers EOS), for the requests that leave or hold their place


@pytest.fixture(scope="module")
def pair(byte_pair, tmp_path_factory) -> tuple[Path, Path]:  # noqa: F811
    """The byte-level pair whose LM heads never prefer EOS: a greedy answer runs to max_tokens (a request that must
    still be running when another arrives)."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("no_eos")
    eos = json.loads((byte_pair[0] / "config.json").read_text())["eos_token_id"]
    out = []
    for src in byte_pair:
        dst = root / src.name
        shutil.copytree(src, dst)
        for f in dst.glob("*.safetensors"):
            sd = load_file(f)
            sd["lm_head.weight"][eos] = 0
            save_file(sd, f, metadata={"format": "pt"})
        out.append(dst)
    return out[0], out[1]


@pytest.fixture(scope="module")
def live(pair, tmp_path_factory):
    engine = load(pair, tmp_path_factory.mktemp("home"))
    config = ServerConfig(
        model_name="tiny", tree=TREE, queue=1, parallel=PARALLEL, defaults=Defaults(max_new_tokens=48)
    )
    with LiveServer(create_app(config, engine=engine)) as srv:
        yield srv


def _bodies() -> list[dict[str, Any]]:
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    named = {"type": "function", "function": {"name": "get_weather"}}
    other = [{"role": "user", "content": "Tell me about Oslo."}]
    return [
        {"messages": ASK, "temperature": 0, "max_tokens": 40},
        {"messages": other, "temperature": 0.9, "seed": 4, "max_tokens": 48},
        {"messages": ASK, "response_format": rf, "temperature": 1.0, "seed": 2},
        {"messages": ASK, "tools": [WEATHER, ADD], "tool_choice": named, "temperature": 0, "max_tokens": 128},
        {"messages": other, "temperature": 0, "max_tokens": 40, "stop": ["a", "in"], "logprobs": True,
         "top_logprobs": 2},
        {"messages": other, "temperature": 1.2, "seed": 9, "max_tokens": 30, "stream": True},
    ]  # fmt: skip


def _ask(srv: LiveServer, body: dict[str, Any]) -> Any:
    """The answer without its ids and timings: the choice (non-streamed) or the joined stream's text."""
    if body.get("stream"):
        parts = []
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=300) as r:
            assert r.status_code == 200
            for ln in r.iter_lines():
                if ln.startswith("data: ") and ln != "data: [DONE]":
                    ch = json.loads(ln[6:])["choices"]
                    parts.append((ch[0]["delta"].get("content") or "", ch[0]["finish_reason"]) if ch else None)
        return parts
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    for c in choice["message"].get("tool_calls") or []:
        c["id"] = "-"
    return choice


def _together(srv: LiveServer, bodies: list[dict[str, Any]]) -> list[Any]:
    out: list[Any] = [None] * len(bodies)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(bodies))

    def run(i: int) -> None:
        try:
            barrier.wait(30)
            out[i] = _ask(srv, bodies[i])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    return out


def _health(srv: LiveServer) -> dict[str, Any]:
    return httpx.get(srv.url + "/health", timeout=30).json()


def _until(check, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.01)
    return False


def test_requests_sent_together_answer_as_alone(live):
    bodies = _bodies()
    alone = [_ask(live, b) for b in bodies]
    packed = _health(live)["packed_passes"]
    # six requests, three at once: four arrive (one waits for a place), then two more
    got = _together(live, bodies[:4]) + _together(live, bodies[4:])
    assert got == alone
    h = _health(live)
    assert h["parallel"] == PARALLEL and h["packed_passes"] > packed
    live.wait_idle()


def test_a_client_leaving_frees_its_place_and_changes_no_other_answer(live):
    story = [{"role": "user", "content": "Write a long story."}]
    bodies = [{"messages": ASK, "temperature": 0, "max_tokens": LONG, "stream": True},
              {"messages": story, "temperature": 0, "max_tokens": 100}]  # fmt: skip
    alone = [_ask(live, b) for b in bodies]
    assert alone[0][-1] == ("", "length")  # the leaving request alone runs to its max_tokens
    leaving = httpx.Client(timeout=300)
    with leaving.stream("POST", live.url + "/v1/chat/completions", json=bodies[0]) as r:
        assert r.status_code == 200
        next(iter(r.iter_lines()))  # it generates
        got: list[Any] = [None, None]
        t = threading.Thread(target=lambda: got.__setitem__(1, _ask(live, bodies[1])))
        t.start()
        # both run (on a slow machine the short one may finish before /health is read: then it ran beside it)
        assert _until(lambda: _health(live)["active"] == 2 or not t.is_alive())
    leaving.close()  # the client leaves mid-answer
    assert _until(lambda: _health(live)["active"] <= 1)
    t.join(300)
    assert got[1] == alone[1]
    live.wait_idle()
    assert _ask(live, bodies[0]) == alone[0]


def test_past_parallel_and_queue_a_request_gets_429(live):
    clients = [httpx.Client(timeout=300) for _ in range(PARALLEL + 1)]
    body = {"messages": ASK, "max_tokens": LONG, "stream": True, "temperature": 0}
    streams = [c.stream("POST", live.url + "/v1/chat/completions", json=body) for c in clients]
    try:
        for s in streams:
            s.__enter__()
        assert _until(lambda: _health(live)["active"] == PARALLEL and _health(live)["waiting"] == 1)
        r = httpx.post(live.url + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2})
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        assert f"{PARALLEL} generations run" in r.json()["error"]["message"]
    finally:
        for c in clients:
            c.close()
    live.wait_idle()
    assert _health(live)["active"] == 0


def test_a_parallel_setting_that_does_not_fit_is_a_loading_error(pair, tmp_path):
    engine = load(pair, tmp_path)
    config = ServerConfig(model_name="tiny", tree=TREE, parallel=10**7)
    with LiveServer(create_app(config, loader=lambda: engine)) as srv:
        assert _until(lambda: _health(srv)["status"] == "error")
        h = httpx.get(srv.url + "/health", timeout=30)
        assert h.status_code == 503 and "parallel=10000000 needs" in h.json()["message"]
