"""The web chat page (GET /) in a real headless Chromium, driven by Selenium.

A fake engine stands in for the model here (the page and the streaming / cancel flow are under test; the
engine's output is tested with the real engine in test_server.py): it implements the public engine API the server
uses (``stream`` / ``encode`` / ``tokenizer`` / ``context``) and yields scripted pieces slowly, so the page can be
watched mid-answer. One script contains HTML (``<script>``, ``<b>``, ``<img onerror>``) that must show as text.

Skips (with the reason) only where no Chromium / chromedriver is installed; ``.ci/run`` installs both.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from specexec.decoding.engine import Result, Stats
from specexec.server import ServerConfig, create_app
from tests.server.test_server import LiveServer

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
INJECTION = [
    "Hello ",
    '<b id="injected">bold</b> ',
    "<script>window.__pwned = 1;</script>",
    '<img src=x onerror="window.__pwned = 2">',
    " & done",
]


class FakeGeneration:
    """Yields the engine's scripted pieces with a delay; records how far it got and whether it was closed."""

    def __init__(self, engine: FakeEngine, ids: list[int], max_new: int) -> None:
        self.engine, self.ids, self.max_new = engine, ids, max_new
        self.tokens: list[int] = []
        self.result: Result | None = None
        self.stats = Stats(method="specexec", budget=64)
        self._it = self._run()

    def __iter__(self):
        return self._it

    def close(self) -> None:
        self._it.close()
        if self.result is None:
            self._finish("cancelled")

    def _run(self):
        eng = self.engine
        eng.consumed, eng.closed_early = 0, False
        try:
            for piece in eng.script[: self.max_new]:
                time.sleep(eng.delay)
                self.tokens.append(5)
                self.stats.steps += 1
                eng.consumed += 1
                yield piece
        except GeneratorExit:
            eng.closed_early = True
            raise
        self._finish("length")

    def _finish(self, reason: str) -> None:
        n = len(self.tokens)
        s = self.stats
        s.new_tokens, s.tokens_per_step, s.tokens_per_s, s.finish_reason = n, 2.5, 123.4, reason
        self.result = Result(
            text="".join(self.engine.script[:n]), tokens=list(self.tokens), prompt_tokens=len(self.ids), stats=s
        )


class FakeEngine:
    """The public engine API the server uses, over a real (tiny) tokenizer; output scripted by the test."""

    def __init__(self, model_dir: Path) -> None:
        from specexec.loading.checkpoint import load_tokenizer

        self.tokenizer = load_tokenizer(model_dir)
        self.context = 4096
        self.draft = object()
        self.script: list[str] = ["ok"]
        self.delay = 0.05
        self.requests: list[list[int]] = []
        self.consumed = 0
        self.closed_early = False

    def encode(self, prompt: Any, chat: bool = False) -> list[int]:
        return list(self.tokenizer.tokenizer(prompt)["input_ids"])

    def stream(self, prompt: Any, max_new_tokens: int = 256, **_kw: Any) -> FakeGeneration:
        self.requests.append(list(prompt))
        return FakeGeneration(self, list(prompt), max_new_tokens)


@pytest.fixture(scope="module")
def fake(tiny_pair) -> FakeEngine:
    return FakeEngine(tiny_pair[0])


@pytest.fixture(scope="module")
def site(fake):
    with LiveServer(create_app(ServerConfig(model_name="fake-model"), engine=fake)) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not CHROMIUM or not CHROMEDRIVER:
        pytest.skip(
            "no Chromium + chromedriver on this machine (Debian: apt-get install chromium chromium-driver; "
            ".ci/run installs them)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1100,800",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
    ):
        opts.add_argument(flag)
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def wait_for(fn, timeout: float = 30.0, what: str = "condition"):
    """Poll ``fn`` until it returns something truthy (a generous bound; not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _open(browser, site) -> None:
    from selenium.webdriver.common.by import By

    browser.get(site.url + "/")
    wait_for(lambda: browser.find_element(By.ID, "status").text == "ready", what="the page to see the server ready")
    assert browser.find_element(By.ID, "model").text == "fake-model"


def _send(browser, text: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    box = browser.find_element(By.ID, "input")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def _answers(browser):
    from selenium.webdriver.common.by import By

    return browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")


def test_streamed_answer_appears_with_stats_and_model_text_is_escaped(browser, site, fake):
    from selenium.webdriver.common.by import By

    fake.script, fake.delay = INJECTION, 0.3
    _open(browser, site)
    _send(browser, "t10 t11")
    user = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".msg.user .content"), what="the user message")
    assert user[-1].text == "t10 t11"
    answer = wait_for(lambda: _answers(browser), what="an answer bubble")[-1]
    content = answer.find_element(By.CSS_SELECTOR, ".content")
    # mid-answer: some text is shown while the answer is still streaming
    wait_for(lambda: content.text and "streaming" in answer.get_attribute("class"), what="a partial, streaming answer")
    assert content.get_attribute("textContent") != "".join(INJECTION)
    stats = answer.find_element(By.CSS_SELECTOR, ".stats")
    wait_for(lambda: "tok/s" in stats.text, what="the stats line")
    assert content.get_attribute("textContent") == "".join(INJECTION)  # shown literally, as text
    assert "123.4 tok/s" in stats.text and "2.50 tok/step" in stats.text and "5 tokens" in stats.text
    assert browser.find_elements(By.ID, "injected") == []
    assert browser.find_elements(By.CSS_SELECTOR, "#messages img, #messages b, #messages script") == []
    assert browser.execute_script("return window.__pwned") is None
    assert "streaming" not in answer.get_attribute("class")


def test_stop_aborts_the_answer_and_cancels_the_generation(browser, site, fake):
    from selenium.webdriver.common.by import By

    fake.script, fake.delay = ["word "] * 400, 0.05
    _open(browser, site)
    _send(browser, "t12")
    answer = wait_for(lambda: _answers(browser), what="an answer bubble")[-1]
    content = answer.find_element(By.CSS_SELECTOR, ".content")
    wait_for(lambda: content.text.count("word") >= 3, what="a few streamed words")
    stop = browser.find_element(By.ID, "stop")
    assert stop.is_enabled() and not browser.find_element(By.ID, "send").is_enabled()
    stop.click()
    stats = answer.find_element(By.CSS_SELECTOR, ".stats")
    wait_for(lambda: stats.text == "stopped", what="the answer to be marked stopped")
    wait_for(lambda: fake.closed_early, what="the server to close the generation")
    site.wait_idle()
    assert fake.consumed < 400
    assert site.state.worker.last is not None and site.state.worker.last.cancelled.is_set()
    assert browser.find_element(By.ID, "send").is_enabled() and not stop.is_enabled()
    shown = content.text
    assert shown.startswith("word") and len(shown) < len("word ") * 400  # the partial answer stays on screen


def test_new_chat_clears_the_conversation(browser, site, fake):
    from selenium.webdriver.common.by import By

    from specexec.decoding.text import render_chat

    fake.script, fake.delay = ["first answer"], 0.01
    _open(browser, site)
    _send(browser, "t20")
    wait_for(lambda: _answers(browser) and "tok/s" in _answers(browser)[-1].text, what="the first answer")
    _send(browser, "t21")
    wait_for(lambda: len(_answers(browser)) == 2 and "tok/s" in _answers(browser)[-1].text, what="the second answer")
    tok = fake.tokenizer.tokenizer
    second = [
        {"role": "user", "content": "t20"},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": "t21"},
    ]
    assert fake.requests[-1] == render_chat(tok, second)  # the page sends the whole conversation
    browser.find_element(By.ID, "new-chat").click()
    assert browser.find_elements(By.CSS_SELECTOR, ".msg") == []
    assert browser.find_element(By.ID, "empty").is_displayed()
    fake.script = ["fresh"]
    _send(browser, "t30")
    wait_for(lambda: _answers(browser) and "tok/s" in _answers(browser)[-1].text, what="the answer in the new chat")
    assert len(browser.find_elements(By.CSS_SELECTOR, ".msg")) == 2
    assert fake.requests[-1] == render_chat(tok, [{"role": "user", "content": "t30"}])  # nothing from before


def test_new_chat_during_an_answer_stops_it(browser, site, fake):
    from selenium.webdriver.common.by import By

    fake.script, fake.delay = ["word "] * 400, 0.05
    _open(browser, site)
    _send(browser, "t40")
    answer = wait_for(lambda: _answers(browser), what="an answer bubble")[-1]
    wait_for(lambda: "word" in answer.text, what="streamed text")
    browser.find_element(By.ID, "new-chat").click()
    wait_for(lambda: fake.closed_early, what="the server to close the generation")
    assert browser.find_elements(By.CSS_SELECTOR, ".msg") == []
    assert browser.find_element(By.ID, "send").is_enabled()
