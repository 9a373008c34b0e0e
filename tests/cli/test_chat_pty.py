"""``specexec chat`` in a real pseudo-terminal (pexpect): streamed turns, /stats, Ctrl-C at the prompt and in the
middle of an answer, Ctrl-D exits with status 0."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.test_chat import make_chat_pair

pexpect = pytest.importorskip("pexpect")

SPECEXEC = Path(sys.executable).parent / "specexec"
LOAD_TIMEOUT = 120  # seconds: importing torch + loading on a busy machine
TOKENS = r"(?:t\d+ ){12}"  # a dozen answer tokens in a row (the echoed user input has fewer)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    return make_chat_pair(tmp_path_factory.mktemp("pty"))


def _spawn(pair: tuple[Path, Path], *args: str):
    if not SPECEXEC.exists():
        pytest.skip(f"console script not installed at {SPECEXEC}")
    env = dict(os.environ, OMP_NUM_THREADS="1", TERM="xterm", COLUMNS="200", LINES="50")
    cmd = [
        str(SPECEXEC),
        "chat",
        "--target",
        str(pair[0]),
        "--draft",
        str(pair[1]),
        "--device",
        "cpu",
        "--budget",
        "16",
        *args,
    ]
    child = pexpect.spawn(
        cmd[0], cmd[1:], env=env, encoding="utf-8", codec_errors="replace", timeout=60, dimensions=(50, 200)
    )
    child.logfile_read = sys.stderr  # the whole session lands in the captured output of a failing test
    child.expect(">>> ", timeout=LOAD_TIMEOUT)
    return child


def _exit_with_ctrl_d(child) -> None:
    child.sendeof()
    child.expect(pexpect.EOF, timeout=30)
    child.close()
    assert child.exitstatus == 0, child.before


def test_turns_stats_and_ctrl_d(pair):
    child = _spawn(pair, "--max-new-tokens", "40")
    try:
        child.sendline("t10 t11 t12")
        child.expect(TOKENS)
        child.expect(">>> ")
        child.sendline("t20")
        child.expect(TOKENS)
        child.expect(">>> ")
        child.sendline("/stats")
        child.expect("tokens/s")
        child.expect("accepted")
        child.expect(">>> ")
        child.sendline('"""t30')
        child.expect(r"\.\.\. ")
        child.sendline('t31"""')
        child.expect(TOKENS)
        child.expect(">>> ")
        os.write(child.child_fd, b"t40 \xff\xfe t41\r")  # invalid UTF-8: one error line, the session goes on
        child.expect("not valid UTF-8")
        child.expect(">>> ")
        child.send("t40 t41")  # typed but not entered: Ctrl-C clears the line and keeps the session
        child.sendintr()
        child.expect("line cleared")
        child.expect(">>> ")
        child.sendline('"""t50')  # Ctrl-C inside a multi-line message drops the whole message
        child.expect(r"\.\.\. ")
        child.sendintr()
        child.expect("line cleared")
        child.expect(">>> ")
        child.sendline("/stats")  # the last answer is still the t30/t31 one: the cleared lines never reached it
        child.expect("tokens/s")
        child.expect(">>> ")
        _exit_with_ctrl_d(child)
    finally:
        child.close(force=True)


def test_ctrl_c_stops_an_answer_and_the_session_goes_on(pair):
    child = _spawn(pair, "--max-new-tokens", "1200", "--context", "4096")
    try:
        child.sendline("t10 t11 t12")
        child.expect(TOKENS)  # the answer is streaming (1200 tokens take far longer than the Ctrl-C needs)
        child.sendintr()
        child.expect("interrupted: the partial answer stays in the history")
        child.expect(">>> ")
        child.sendline("/stats")
        child.expect("no completed answer yet")
        child.expect(">>> ")
        child.sendline("t20 t21")  # another full turn after the interrupt
        child.expect(TOKENS)
        child.expect(">>> ", timeout=120)
        child.sendline("/stats")
        child.expect(r"1200 in \d+ target passes")
        child.expect(">>> ")
        _exit_with_ctrl_d(child)
    finally:
        child.close(force=True)
