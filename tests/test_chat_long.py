"""A long chat that outgrows a small context many times over: 200 turns through ChatSession and 200 piped lines
through ``specexec chat``. Every turn answers, memory stays flat, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specexec.chat import ChatSession, GenOptions
from specexec.errors import SpecexecError
from tests.test_chat import make_chat_pair

TURNS = 200
CONTEXT = 80  # tokens; one turn takes ~16 (message + 8-token answer + template), so the window holds ~4 turns
MAX_NEW = 8
SPECEXEC = Path(sys.executable).parent / "specexec"


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    return make_chat_pair(tmp_path_factory.mktemp("long"))


def _message(i: int) -> str:
    return " ".join(f"t{10 + (i * 7 + j) % 80}" for j in range(1 + i % 4))


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def test_200_turns_in_a_small_context(pair):
    import gc

    from specexec.api import load

    engine = load(str(pair[0]), str(pair[1]), device="cpu", context=CONTEXT, progress=False)
    s = ChatSession(engine, system="t7 t8", options=GenOptions(max_new_tokens=MAX_NEW))
    caches = (engine.target_cache, engine.draft_model.cache)
    dropped = emptied = refused = 0
    rss0 = None
    for i in range(TURNS):
        if i == 20:  # warmed up: allocator pools and lazily built state are in place
            gc.collect()
            rss0 = _rss()
        text = _message(i)
        if i % 50 == 49:  # now and then a message that nearly fills the window: every earlier turn leaves it...
            text = " ".join(["t40"] * (CONTEXT - 16))
        if i % 67 == 66:  # ...or one that cannot fit at all: refused, the session goes on
            with pytest.raises(SpecexecError, match="message too long"):
                s.send(" ".join(["t41"] * (CONTEXT + 5)))
            refused += 1
        reply = s.send(text)
        pieces = list(reply)
        assert reply.result is not None and "".join(pieces) == reply.text != "", i
        assert reply.prompt_tokens + len(reply.result.tokens) <= engine.context, i
        assert 1 <= reply.result.stats.new_tokens <= MAX_NEW, i
        dropped += any("oldest turn" in n for n in reply.notices)
        emptied += sum(t.in_context for t in s.turns) == 1
    gc.collect()
    grown = _rss() - rss0
    assert len(s.turns) == TURNS and not any(t.interrupted for t in s.turns)
    in_context = sum(t.in_context for t in s.turns)
    assert 1 <= in_context <= 6  # the window stayed small; the transcript kept everything
    assert len(s.to_json()["messages"]) == 1 + 2 * TURNS
    assert dropped > TURNS // 2 and emptied >= 4 and refused >= 2
    assert (engine.target_cache, engine.draft_model.cache) == caches  # the very same cache tensors: nothing reallocated
    assert all(a is b for a, b in zip((engine.target_cache, engine.draft_model.cache), caches))
    assert grown < 64 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB over {TURNS - 20} turns"


def test_200_piped_lines_through_the_cli(pair):
    if not SPECEXEC.exists():
        pytest.skip(f"console script not installed at {SPECEXEC}")
    lines = [_message(i) for i in range(TURNS)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        str(SPECEXEC),
        "chat",
        "--target",
        str(pair[0]),
        "--draft",
        str(pair[1]),
        "--device",
        "cpu",
        "--context",
        str(CONTEXT),
        "--max-new-tokens",
        str(MAX_NEW),
        "--budget",
        "16",
    ]
    proc = subprocess.run(cmd, input="\n".join(lines) + "\n", capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "error:" not in proc.stderr, proc.stderr[-3000:]
    summaries = [line for line in proc.stderr.splitlines() if line.endswith("tokens/step]")]
    assert len(summaries) == TURNS  # every line got an answer (and its speed summary)
    assert "oldest turn(s) left the model's window" in proc.stderr
    answers = [line for line in proc.stdout.split(">>> ") if line.strip()]
    assert len(answers) == TURNS and all(len(a.split()) >= 1 for a in answers)
