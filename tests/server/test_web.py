"""The web chat page (GET /) in a real headless Chromium, driven by Selenium.

A fake engine stands in for the model here (the page and the streaming / cancel flow are under test; the
engine's output is tested with the real engine in test_server.py): it implements the public engine API the server
uses (``stream`` / ``encode`` / ``tokenizer`` / ``context``) and yields scripted pieces slowly, so the page can be
watched mid-answer. One script contains HTML (``<script>``, ``<b>``, ``<img onerror>``) that must show as text;
others are Markdown (rendered through the page's vendored marked + DOMPurify) or Markdown carrying injections.

Tool-call chunks and JSON answers come from a scripted endpoint instead (:func:`scripted_site`): the real page and
its vendored scripts, served by the real app, with ``/v1/chat/completions`` answered by a list of chunks, so the
page's handling of OpenAI's streamed ``tool_calls`` deltas is tested whatever the engine emits.

Skips (with the reason) only where no Chromium / chromedriver is installed; ``.ci/run`` installs both.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from specexec.decoding.engine import Result, Stats
from specexec.server import ServerConfig, create_app
from specexec.steps.record import Arm
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
        self.stats = Stats(method="specexec", budget=Arm("tree", 64))
        for key, value in engine.stats_fields.items():  # what the test wants the stats to say
            setattr(self.stats, key, value)
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
        self.stats_fields: dict[str, Any] = {}

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
    assert browser.execute_script("return typeof marked + typeof DOMPurify") == "objectfunction"  # vendored, loaded


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

    fake.script, fake.delay, fake.stats_fields = INJECTION, 0.3, {}
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
    assert content.get_attribute("textContent").strip() == "".join(INJECTION)  # shown literally, as text
    assert "123.4 tok/s" in stats.text and "2.50 tokens per step" in stats.text and "5 tokens" in stats.text
    assert "tree of 64" in stats.text
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


# ---------------------------------------------------------------------------------------------- Markdown

MARKDOWN = [
    "## Plan\n\n",
    "Call `f()` twice:\n\n",
    "```python\n",
    "def f():\n",
    "    return 1 < 2\n",
    "```\n\n",  # the fence closes here: the page showed a code block before it came
    "- one\n- two *and a half*\n\n",
    "| a | b |\n|---|---|\n| 1 | 2 |\n\n",
    "See [the docs](https://example.com/docs).",
]
CLOSING_FENCE = MARKDOWN.index("```\n\n")


def test_markdown_renders_with_code_blocks_that_copy(browser, site, fake):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    fake.script, fake.delay, fake.stats_fields = MARKDOWN, 0.3, {}
    _open(browser, site)
    _send(browser, "t50")
    answer = wait_for(lambda: _answers(browser), what="an answer bubble")[-1]
    content = answer.find_element(By.CSS_SELECTOR, ".content")
    # mid-answer, the fence is still open: the code so far already shows as a code block
    wait_for(lambda: content.find_elements(By.CSS_SELECTOR, "pre code"), what="a code block mid-answer")
    assert fake.consumed <= CLOSING_FENCE and "streaming" in answer.get_attribute("class")
    stats = answer.find_element(By.CSS_SELECTOR, ".stats")
    wait_for(lambda: "tok/s" in stats.text, what="the end of the answer")

    assert content.find_element(By.CSS_SELECTOR, "h2").text == "Plan"
    assert [li.text for li in content.find_elements(By.CSS_SELECTOR, "ul > li")] == ["one", "two and a half"]
    assert content.find_element(By.CSS_SELECTOR, "li em").text == "and a half"
    inline = content.find_element(By.CSS_SELECTOR, "p > code")
    assert inline.text == "f()"
    assert [c.text for c in content.find_elements(By.CSS_SELECTOR, "table td")] == ["1", "2"]
    link = content.find_element(By.CSS_SELECTOR, "a")
    assert link.text == "the docs" and link.get_attribute("href") == "https://example.com/docs"
    assert link.get_attribute("target") == "_blank" and "noopener" in link.get_attribute("rel")
    blocks = content.find_elements(By.CSS_SELECTOR, "pre > code")
    assert len(blocks) == 1
    code = "def f():\n    return 1 < 2"
    assert blocks[0].get_attribute("textContent").rstrip("\n") == code
    frame = content.find_element(By.CSS_SELECTOR, ".code")
    assert "python" in frame.text

    # the copy button puts the code on the clipboard: pasting it into the message box gives the code back
    frame.find_element(By.CSS_SELECTOR, "button").click()
    wait_for(lambda: frame.find_element(By.CSS_SELECTOR, "button").text == "Copied", what="the copy to be confirmed")
    box = browser.find_element(By.ID, "input")
    box.clear()
    box.click()
    box.send_keys(Keys.CONTROL, "v")
    wait_for(lambda: box.get_attribute("value"), what="the pasted code")
    assert box.get_attribute("value").rstrip("\n") == code
    box.clear()


# Injections inside Markdown: raw HTML blocks and inline tags, a javascript: link, an image whose URL tries to
# break out of its attribute, HTML inside link text, an autolink to javascript:, an SVG with onload.
MARKDOWN_INJECTION = [
    "Links: [click](javascript:window.__pwned=3) and [ok](https://example.com)\n\n",
    '<img src=x onerror="window.__pwned=4">\n\n',
    "<script>window.__pwned=5</script>\n\n",
    '![pic](x" onerror="window.__pwned=6) and [<img src=x onerror=window.__pwned=7>](https://example.com)\n\n',
    '<a href="javascript:window.__pwned=8" id="injected">a</a> <svg onload="window.__pwned=9"></svg>\n\n',
    "<javascript:window.__pwned=10> and <iframe srcdoc='<script>parent.__pwned=11</script>'></iframe>\n\n",
    "```html\n<script>window.__pwned=12</script>\n```\n",
]


def test_markdown_carrying_html_and_scripts_stays_inert(browser, site, fake):
    from selenium.webdriver.common.by import By

    fake.script, fake.delay, fake.stats_fields = MARKDOWN_INJECTION, 0.05, {}
    _open(browser, site)
    _send(browser, "t60")
    answer = wait_for(lambda: _answers(browser), what="an answer bubble")[-1]
    stats = answer.find_element(By.CSS_SELECTOR, ".stats")
    wait_for(lambda: "tok/s" in stats.text, what="the end of the answer")
    time.sleep(0.5)  # time for any image error or load handler to have fired
    assert browser.execute_script("return window.__pwned") is None
    content = answer.find_element(By.CSS_SELECTOR, ".content")
    assert content.find_elements(By.CSS_SELECTOR, "script, iframe, svg, img[onerror], #injected") == []
    hrefs = [a.get_attribute("href") or "" for a in content.find_elements(By.CSS_SELECTOR, "a")]
    assert "https://example.com/" in hrefs and not any(h.lower().startswith("javascript:") for h in hrefs)
    handlers = browser.execute_script(
        "return [...arguments[0].querySelectorAll('*')].flatMap((e) => [...e.attributes].map((a) => a.name))"
        ".filter((n) => n.startsWith('on'))",
        content,
    )
    assert handlers == []
    # the raw HTML shows as the text the model wrote; a fenced block shows its code
    text = content.text
    assert '<img src=x onerror="window.__pwned=4">' in text and "<script>window.__pwned=5</script>" in text
    assert content.find_element(By.CSS_SELECTOR, "pre code").text == "<script>window.__pwned=12</script>"


# ---------------------------------------------------------------------------------------------- stats in words


def test_stats_line_names_the_proposal_in_words(browser, site, fake):
    from selenium.webdriver.common.by import By

    cases = [
        ({"budget": Arm("chain", 6)}, "draft chain of 6"),
        ({"budget": Arm("tree", 64)}, "tree of 64"),
        ({"budget": Arm("chain", 3), "budget_auto": True}, "auto: mostly draft chain of 3"),
        ({"method": "ar", "budget": Arm("plain")}, "plain decoding"),
        ({"method": "ngram", "budget": Arm("tree", 16)}, "prompt lookup"),
        ({"method": "chain", "budget": Arm("tree", 4), "gamma": 4}, "draft chain of 4"),
    ]
    fake.script, fake.delay = ["fine"], 0.01
    _open(browser, site)
    try:
        for i, (fields, words) in enumerate(cases):
            fake.stats_fields = fields
            _send(browser, f"t{70 + i}")
            wait_for(lambda: len(_answers(browser)) == i + 1, what="the answer bubble")  # noqa: B023
            stats = _answers(browser)[-1].find_element(By.CSS_SELECTOR, ".stats")
            wait_for(lambda: "tok/s" in stats.text, what="the stats line")  # noqa: B023
            assert "123.4 tok/s" in stats.text and "2.50 tokens per step" in stats.text
            assert words in stats.text, (fields, stats.text)
            assert "budget" not in stats.text
    finally:
        fake.stats_fields = {}


# ---------------------------------------------------------------------------------------------- tool calls, JSON

STATS = {
    "method": "specexec",
    "budget": -6,
    "budget_auto": False,
    "gamma": None,
    "steps": 4,
    "new_tokens": 10,
    "tokens_per_step": 2.5,
    "tokens_per_s": 50.0,
    "prefill_tokens": 3,
    "wall_s": 0.2,
}


def _chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "fake-model",
            "choices": choices, **extra}  # fmt: skip


def tool_call_chunks() -> list[dict[str, Any]]:
    """Two tool calls the way OpenAI streams them: the id and name first, the arguments in string fragments."""

    def call(index: int, **fields: Any) -> dict[str, Any]:
        return _chunk({"tool_calls": [{"index": index, **fields}]})

    return [
        _chunk({"role": "assistant", "content": None}),
        call(0, id="call_a", type="function", function={"name": "get_weather", "arguments": ""}),
        call(0, function={"arguments": '{"city": "Pa'}),
        call(0, function={"arguments": 'ris", "days": [1,'}),
        call(0, function={"arguments": ' 2], "units": {"t": "C"}}'}),
        call(1, id="call_b", type="function", function={"name": "search", "arguments": "not json {"}),
        _chunk({}, "tool_calls", specexec=STATS),
        _chunk(usage={"prompt_tokens": 4, "completion_tokens": 10, "total_tokens": 14}),
    ]


def text_chunks(*pieces: str) -> list[dict[str, Any]]:
    return [
        _chunk({"role": "assistant", "content": ""}),
        *(_chunk({"content": p}) for p in pieces),
        _chunk({}, "stop", specexec=STATS),
    ]


@pytest.fixture(scope="module")
def scripted_site():
    """The real page (and its vendored scripts) from the real app, but ``/health`` and ``/v1/chat/completions``
    answered by the test: the chat endpoint records each request body and streams ``scripted.chunks``."""
    outer = FastAPI()
    outer.state.chunks, outer.state.requests, outer.state.delay = [], [], 0.2

    @outer.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": "fake-model"}

    @outer.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        outer.state.requests.append(await request.json())

        async def events():
            for c in outer.state.chunks:
                await asyncio.sleep(outer.state.delay)
                yield f"data: {json.dumps(c)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    # the page's own app (its lifespan never runs under a mount: no engine is loaded, the loader is never called)
    outer.mount("/", create_app(ServerConfig(model_name="fake-model"), loader=lambda: None))
    with LiveServer(outer) as srv:
        yield srv


def test_streamed_tool_calls_render_as_cards(browser, scripted_site):
    from selenium.webdriver.common.by import By

    scripted = scripted_site.app.state
    scripted.chunks, scripted.delay = tool_call_chunks(), 0.3
    _open(browser, scripted_site)
    _send(browser, "what is the weather in Paris?")
    answer = wait_for(lambda: _answers(browser), what="an answer bubble")[-1]
    # mid-answer: the card is there with the arguments so far, as raw text while they do not parse yet
    card = wait_for(lambda: answer.find_elements(By.CSS_SELECTOR, ".tool-call"), what="a tool-call card")[0]
    assert card.find_element(By.CSS_SELECTOR, ".tool-name").text == "get_weather"
    stats = answer.find_element(By.CSS_SELECTOR, ".stats")
    wait_for(lambda: "tok/s" in stats.text, what="the end of the answer")
    assert "draft chain of 6" in stats.text and "50.0 tok/s" in stats.text

    cards = answer.find_elements(By.CSS_SELECTOR, ".tool-call")
    assert [c.find_element(By.CSS_SELECTOR, ".tool-name").text for c in cards] == ["get_weather", "search"]
    args = cards[0].find_element(By.CSS_SELECTOR, "pre").text
    assert json.loads(args) == {"city": "Paris", "days": [1, 2], "units": {"t": "C"}}
    assert args.splitlines()[1] == '  "city": "Paris",'  # pretty-printed, one member a line
    assert cards[0].find_elements(By.CSS_SELECTOR, ".j-key")  # and highlighted
    assert cards[1].find_element(By.CSS_SELECTOR, "pre").text == "not json {"  # not JSON: the raw text

    # the calls stay in the conversation: the next request carries them on the assistant's turn
    scripted.chunks, scripted.delay = text_chunks("ok"), 0.01
    _send(browser, "thanks")
    wait_for(lambda: len(scripted.requests) == 2, what="the second request")
    turn = scripted.requests[-1]["messages"][1]
    assert turn["role"] == "assistant"
    assert [c["function"]["name"] for c in turn["tool_calls"]] == ["get_weather", "search"]
    assert json.loads(turn["tool_calls"][0]["function"]["arguments"])["city"] == "Paris"
    assert turn["tool_calls"][0]["id"] == "call_a"


def test_a_json_answer_shows_as_a_highlighted_block(browser, scripted_site):
    from selenium.webdriver.common.by import By

    scripted = scripted_site.app.state
    scripted.chunks, scripted.delay = (
        text_chunks('{"name": "Ada", ', '"id": 12345678901234567890, ', '"ok": true}'),
        0.1,
    )
    _open(browser, scripted_site)
    _send(browser, "who?")
    answer = wait_for(lambda: _answers(browser), what="an answer bubble")[-1]
    stats = answer.find_element(By.CSS_SELECTOR, ".stats")
    wait_for(lambda: "tok/s" in stats.text, what="the end of the answer")
    code = answer.find_element(By.CSS_SELECTOR, ".content pre code")
    assert code.text.splitlines() == ["{", '  "name": "Ada",', '  "id": 12345678901234567890,', '  "ok": true', "}"]
    assert [k.text for k in code.find_elements(By.CSS_SELECTOR, ".j-key")] == ['"name"', '"id"', '"ok"']
    assert answer.find_element(By.CSS_SELECTOR, ".content .code button").text == "Copy"


def test_the_json_schema_setting_sends_response_format(browser, scripted_site):
    from selenium.webdriver.common.by import By

    scripted = scripted_site.app.state
    scripted.chunks, scripted.delay = text_chunks('{"answer": "4"}'), 0.01
    _open(browser, scripted_site)
    browser.find_element(By.CSS_SELECTOR, "#settings > summary").click()
    browser.find_element(By.CSS_SELECTOR, "#schema-box > summary").click()
    schema = browser.find_element(By.ID, "schema")
    error = browser.find_element(By.ID, "schema-error")
    sent = len(scripted.requests)

    schema.send_keys('{"type": "object",')  # not valid JSON: an inline error, and nothing is sent
    assert error.is_displayed() and "not valid JSON" in error.text
    _send(browser, "2+2?")
    time.sleep(0.3)
    assert len(scripted.requests) == sent and _answers(browser) == []
    assert browser.find_element(By.ID, "input").get_attribute("value") == "2+2?"  # the message waits in the box

    schema.clear()
    valid = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    schema.send_keys(json.dumps(valid))
    assert not error.is_displayed()
    browser.find_element(By.ID, "send").click()
    wait_for(lambda: len(scripted.requests) == sent + 1, what="the request")
    assert scripted.requests[-1]["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "page", "schema": valid},
    }
    answer = wait_for(lambda: _answers(browser), what="an answer bubble")[-1]
    wait_for(lambda: "tok/s" in answer.find_element(By.CSS_SELECTOR, ".stats").text, what="the end of the answer")
    assert answer.find_element(By.CSS_SELECTOR, ".content pre code").text.splitlines()[1] == '  "answer": "4"'
    schema.clear()  # the box is kept in the page only; clear it for later tests


def test_the_vendored_scripts_are_served_from_a_fixed_list(site):
    import httpx

    page = httpx.get(site.url + "/")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "http" not in csp  # same-origin scripts only, no CDN
    for name in ("marked.umd.js", "purify.min.js"):
        r = httpx.get(f"{site.url}/static/vendor/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/javascript")
        assert r.headers["x-content-type-options"] == "nosniff"
    assert httpx.get(site.url + "/static/vendor/marked.LICENSE").headers["content-type"].startswith("text/plain")
    for name in ("index.html", "..%2Fapp.py", "purify.min.js.map", "nope.js"):
        assert httpx.get(f"{site.url}/static/vendor/{name}").status_code == 404
