"""Several generations at once (:meth:`Engine.lanes`): their passes packed into joint passes, each answer exactly
its solo answer.

Each lane runs the one decode loop in its own thread; a pass on a lane's region of the pooled cache waits until
every lane waits, then all run as one pass (:mod:`specexec.model.joint`). Checked on tiny pairs: a dense fp32
target (shape-invariant passes) and a 4-bit target and draft whose layers run as one C call; greedy, seeded
sampling, a JSON schema, stop strings and log-probs, with lanes joining and leaving mid-way, prompts prefilled in
chunks beside the running steps, and a target whose passes cannot pack (run one after another, still exact).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from offload.plan import OffloadConfig
from specexec import api
from specexec.config import SamplingConfig
from specexec.decoding.constraint import Constraint
from specexec.errors import ConfigError, OutOfMemory
from specexec.formats import q4
from tests.conftest import make_noisy_copy, make_tiny
from tests.server.test_structured_server import VOCAB, save_byte_tokenizer

PROMPTS = [" ".join(f"t{3 + (7 * i + 5 * j) % 90}" for j in range(4 + 9 * i)) for i in range(5)]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """A byte-level Qwen2-shaped pair (a tokenizer the grammar engine reads) whose draft is the target with noise."""
    root = tmp_path_factory.mktemp("lanes")
    target = make_tiny(root / "target", "qwen2", vocab=VOCAB, seed=21)
    save_byte_tokenizer(target)
    return target, make_noisy_copy(target, root / "draft", 0.1)


def _load(pair: tuple[Path, Path], home: Path, **kw: Any):
    return api.load(str(pair[0]), str(pair[1]), device="cpu", context=512, progress=False, cache_dir=home, **kw)


def _requests() -> list[dict[str, Any]]:
    """One request of each kind: greedy, seeded sampling (two temperatures), stop strings with log-probs, a JSON
    schema (sampled)."""
    return [
        {"prompt": PROMPTS[0], "max_new_tokens": 30},
        {"prompt": PROMPTS[1], "max_new_tokens": 40, "sampling_cfg": SamplingConfig(temperature=0.9, seed=3)},
        {"prompt": PROMPTS[2], "max_new_tokens": 24, "stop": ["t4", "3 t"], "logprobs": 2},
        {"prompt": PROMPTS[3], "max_new_tokens": 36, "sampling_cfg": SamplingConfig(temperature=1.3, seed=8)},
        {"prompt": PROMPTS[4], "max_new_tokens": 20, "constraint": Constraint.json_schema(SCHEMA),
         "sampling_cfg": SamplingConfig(temperature=1.0, seed=1)},
    ]  # fmt: skip


def _answer(result: Any) -> tuple[Any, ...]:
    lps = None if result.logprobs is None else [(x.token, x.logprob, x.top) for x in result.logprobs]
    return result.text, result.tokens, result.finish_reason, lps


def _run_lanes(lanes: list[Any], requests: list[dict[str, Any]], starts: list[threading.Event] | None = None):
    """Each request in its own lane thread (request i in lane i % len(lanes), one after another there); request i
    waits for ``starts[i]`` when given. Returns the answers in request order."""
    out: list[Any] = [None] * len(requests)
    errors: list[BaseException] = []

    def run(lane: int) -> None:
        e = lanes[lane]
        try:
            for i in range(lane, len(requests), len(lanes)):
                if starts is not None:
                    starts[i].wait(60)
                req = dict(requests[i])
                g = e.stream(req.pop("prompt"), req.pop("max_new_tokens"), **req)
                with e.joint.lane():
                    for _ in g:
                        pass
                out[i] = _answer(g.result)
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(lanes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    return out


def _solo(engine: Any, requests: list[dict[str, Any]]) -> list[Any]:
    out = []
    for r in requests:
        req = dict(r)
        out.append(_answer(engine.generate(req.pop("prompt"), req.pop("max_new_tokens"), **req)))
    return out


def test_lanes_answer_as_alone_with_a_dense_invariant_target(pair, tmp_path):
    engine = _load(pair, tmp_path)
    assert engine.target.row_invariant()
    requests = _requests()
    solo = _solo(engine, requests)
    lanes = engine.lanes(3, chunk=8)  # five requests in three lanes: two join when others leave
    got = _run_lanes(lanes, requests)
    assert got == solo
    joint = lanes[0].joint
    assert joint.packed > 0 and joint.lanes == 0
    # the engine itself still generates alone afterwards, the same answers
    assert _solo(engine, requests[:2]) == solo[:2]


@pytest.mark.skipif(q4.available() is not None, reason=str(q4.available()))
def test_lanes_answer_as_alone_with_4_bit_one_call_layers(pair, tmp_path):
    engine = _load(pair, tmp_path, offload=OffloadConfig(target_dtype="q4"), draft_dtype="q4")
    assert engine.target.row_invariant() and engine.draft.row_invariant()  # both pack, drafts too
    requests = _requests()
    solo = _solo(engine, requests)
    lanes = engine.lanes(4, chunk=5)
    assert _run_lanes(lanes, requests) == solo
    assert lanes[0].joint.packed > 0


def test_a_long_prompt_is_prefilled_in_chunks_beside_a_running_answer(pair, tmp_path):
    engine = _load(pair, tmp_path)
    long_prompt = " ".join(f"t{3 + (11 * j) % 90}" for j in range(120))
    requests = [{"prompt": PROMPTS[0], "max_new_tokens": 120}, {"prompt": long_prompt, "max_new_tokens": 8}]
    solo = _solo(engine, requests)
    engine.reset()  # no snapshot of the long prompt in the prefix cache: the lane prefills it
    lanes = engine.lanes(2, chunk=6)
    events: list[str] = []
    starts = [threading.Event(), threading.Event()]
    starts[0].set()

    def on_step(name: str):
        def hook(step: Any) -> None:
            events.append(name)
            if name == "a" and events.count("a") == 3:
                events.append("b joins")
                starts[1].set()

        return hook

    requests[0]["on_step"], requests[1]["on_step"] = on_step("a"), on_step("b")
    got = _run_lanes(lanes, requests, starts)
    assert got == solo
    joined, first_b = events.index("b joins"), events.index("b")
    # the ~480-token prompt takes 80 rounds of 6 rows (the draft's prefill as many more): the running answer keeps
    # stepping meanwhile instead of waiting for the whole prefill
    assert events[joined:first_b].count("a") >= 10


def test_passes_that_cannot_pack_run_one_after_another(pair, tmp_path):
    engine = _load(pair, tmp_path, invariant=False)  # the fastest kernels for each shape: rows are not invariant
    assert not engine.target.row_invariant()
    requests = _requests()[:3]
    solo = _solo(engine, requests)
    lanes = engine.lanes(3)
    got = _run_lanes(lanes, requests)
    # the same tokens (log-probs may differ in their last bits: these passes are not shape-invariant, solo either)
    assert [a[:3] for a in got] == [a[:3] for a in solo]
    assert lanes[0].joint.packed == 0
    assert engine.default_parallel() == 1


def test_lanes_refuse_a_bigger_tree_than_they_were_sized_for(pair, tmp_path):
    from specexec.config import TreeConfig

    engine = _load(pair, tmp_path)
    lane = engine.lanes(2, tree=TreeConfig.fixed(4))[0]
    with pytest.raises(ConfigError):
        lane.stream(PROMPTS[0], 4, tree=TreeConfig.fixed(64))
    with pytest.raises(ConfigError):
        engine.lanes(0)


def test_more_lanes_than_memory_holds_are_refused_naming_what_fits(pair, tmp_path):
    engine = _load(pair, tmp_path)
    with pytest.raises(OutOfMemory) as e:
        engine.lanes(10**7)
    msg = str(e.value)
    assert "parallel=10000000 needs" in msg and "use parallel=" in msg and "a smaller context" in msg
    assert engine.generate(PROMPTS[0], 4).tokens  # the engine itself still generates


def test_the_memory_plan_holds_the_requests_caches(pair, tmp_path):
    """``load(parallel=N)`` (``serve --parallel N``) plans N requests' KV caches: too many is refused before the
    models load, naming the setting."""
    from specexec.loading.memory import NotEnoughMemory

    with pytest.raises(NotEnoughMemory) as e:
        _load(pair, tmp_path, parallel=10**6)
    assert "for each of parallel=1000000 requests" in str(e.value) and "or parallel" in str(e.value)
    with pytest.raises(ConfigError):
        _load(pair, tmp_path, parallel=0)
    assert _load(pair, tmp_path, parallel=3).lanes(3)
