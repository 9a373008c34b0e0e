"""Structured output, tool calls and log-probs through ``specexec serve``'s OpenAI API.

Three layers, each on what it needs:

- the wire format and the tool-call machinery alone (:mod:`specexec.server.protocol`, :mod:`specexec.server.tools`):
  request validation and its 400s, the formats' grammars (compiled by llguidance over a byte-level tokenizer built
  here), and the parser's events whatever the text's split into pieces;
- a live server running the REAL engine on a tiny random Qwen2-shaped pair with a byte-level tokenizer built here
  (every byte is a token; ``<tool_call>`` / ``</tool_call>`` are added tokens as in Qwen's vocabulary) and a
  Qwen-like chat template that renders tools: constrained answers of a random model are valid by construction,
  so schemas, forced calls and log-probs are checked end to end, driven by the official ``openai`` client;
- one ``slow`` test on the real demo pair (Qwen2.5-Coder 1.5B / 0.5B).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from specexec.config import TreeConfig
from specexec.server import Defaults, ServerConfig, create_app
from specexec.server import protocol as p
from specexec.server import tools as tl
from tests.conftest import make_noisy_copy, make_tiny
from tests.server.test_server import LiveServer

TREE = TreeConfig.fixed(8, early_stop=False)
CONTEXT = 1024
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKERS = ["<tool_call>", "</tool_call>"]
VOCAB = 320  # the model's rows: 256 bytes + 5 added tokens, and padding rows
# a Qwen-like template (same structure as Qwen2.5's, shorter): tools in the system turn, calls as <tool_call> blocks
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You help.{% endif %}\n"
    "# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    'Answer a call as <tool_call>\n{"name": <name>, "arguments": <args>}\n</tool_call><|im_end|>\n'
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant{% if m.content %}\n{{ m.content }}"
    "{% endif %}{% for c in m.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "enum": [1, 2, 3]}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
ADD: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "boolean"}, "b": {"type": "boolean"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
# a schema a random model finishes within a few tokens (no free strings, no free whitespace)
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


# ---------------------------------------------------------------------------------------------- a byte-level pair


def save_byte_tokenizer(path: Path, template: str = TEMPLATE) -> None:
    """A byte-level BPE tokenizer without merges (every byte its own token, ids 0..255, as GPT-2 maps bytes to
    characters), the Qwen-like special tokens (``<|im_end|>`` the EOS) and ``<tool_call>`` / ``</tool_call>`` as
    non-special added tokens, as in Qwen's vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {c: b for b, c in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKERS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.chat_template = template
    fast.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"), bos_token_id=None, pad_token_id=None)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def byte_pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("bytepair")
    target = make_tiny(root / "target", "qwen2", vocab=VOCAB, seed=3)
    save_byte_tokenizer(target)
    draft = make_noisy_copy(target, root / "draft", 0.1)
    return target, draft


def load(pair: tuple[Path, Path], home: Path, method: str | None = None):
    from specexec import api

    return api.load(
        str(pair[0]), str(pair[1]), device="cpu", context=CONTEXT, tree=TREE, progress=False, cache_dir=home
    )


@pytest.fixture(scope="module")
def live(byte_pair, tmp_path_factory):
    engine = load(byte_pair, tmp_path_factory.mktemp("home"))
    config = ServerConfig(model_name="tiny", tree=TREE, defaults=Defaults(max_new_tokens=48))
    with LiveServer(create_app(config, engine=engine)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return live.client()


@pytest.fixture(scope="module")
def tok(byte_pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(byte_pair[0])


# ---------------------------------------------------------------------------------------------- validation


def chat_body(**kw: Any) -> dict[str, Any]:
    return {"messages": ASK, **kw}


def refused(body: dict[str, Any], kind: str = "chat") -> p.ApiError:
    with pytest.raises(p.ApiError) as e:
        (p.parse_chat if kind == "chat" else p.parse_completion)(body, p.Defaults())
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
    return e.value


def test_response_format_parsing():
    parse = p.parse_chat
    assert parse(chat_body(response_format={"type": "text"}), p.Defaults()).response_format is None
    assert parse(chat_body(response_format={"type": "json_object"}), p.Defaults()).response_format == p.ResponseFormat(
        "json_object"
    )
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}
    assert parse(chat_body(response_format=rf), p.Defaults()).response_format == p.ResponseFormat("json_schema", SCHEMA)
    c = p.parse_completion({"prompt": "x", "response_format": rf}, p.Defaults())
    assert c.response_format is not None and c.response_format.schema == SCHEMA
    for bad in (
        "json",
        {"type": "yaml"},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"schema": SCHEMA}},  # no name
        {"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}},
        {"type": "json_schema", "json_schema": {"name": "s", "schema": "not a schema"}},
        {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": "yes"}},
    ):
        assert refused(chat_body(response_format=bad)).param == "response_format", bad


def test_tools_and_tool_choice_parsing():
    req = p.parse_chat(chat_body(tools=[WEATHER, ADD]), p.Defaults())
    assert [t.name for t in req.tools] == ["get_weather", "add"]
    assert req.tool_choice == p.ToolChoice("auto") and req.parallel_tool_calls
    assert req.tools[0].spec == WEATHER and req.tools[0].parameters == WEATHER["function"]["parameters"]
    named = {"type": "function", "function": {"name": "add"}}
    req = p.parse_chat(chat_body(tools=[WEATHER, ADD], tool_choice=named, parallel_tool_calls=False), p.Defaults())
    assert req.tool_choice == p.ToolChoice("function", "add") and req.tool_choice.forced and not req.parallel_tool_calls
    for choice in ("none", "auto", "required"):
        assert p.parse_chat(chat_body(tools=[ADD], tool_choice=choice), p.Defaults()).tool_choice == p.ToolChoice(
            choice
        )
    no_params = {"type": "function", "function": {"name": "ping"}}
    assert p.parse_chat(chat_body(tools=[no_params]), p.Defaults()).tools[0].parameters["type"] == "object"
    assert p.parse_chat(chat_body(tools=[]), p.Defaults()).tool_choice is None
    fn = ADD["function"]
    for tools, param in (
        ("add", "tools"),
        ([{"type": "function"}], "tools"),
        ([{"type": "function", "function": {"parameters": fn["parameters"]}}], "tools"),  # no name
        ([{"type": "function", "function": {"name": "has space"}}], "tools"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "tools"),
        ([{"type": "function", "function": {"name": "f", "parameters": ["x"]}}], "tools"),
        ([{"type": "code_interpreter"}], "tools"),
        ([ADD, ADD], "tools"),
    ):
        assert refused(chat_body(tools=tools)).param == param, tools
    assert refused(chat_body(tool_choice="auto")).param == "tool_choice"  # without tools
    assert refused(chat_body(tools=[ADD], tool_choice="always")).param == "tool_choice"
    unknown = {"type": "function", "function": {"name": "nope"}}
    err = refused(chat_body(tools=[ADD], tool_choice=unknown))
    assert err.param == "tool_choice" and "nope" in err.message
    assert refused(chat_body(tools=[ADD], parallel_tool_calls="no")).param == "parallel_tool_calls"


def test_tool_messages_parsing():
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": true, "b": false}'}}
    msgs = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "true"},
        {"role": "tool", "tool_call_id": "no-such-id", "content": [{"type": "text", "text": "x"}]},
    ]
    req = p.parse_chat({"messages": msgs, "tools": [ADD]}, p.Defaults())
    assert req.messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": True, "b": False}}}
        ],
    }
    assert req.messages[2] == {"role": "tool", "content": "true", "tool_call_id": "call_1"}
    assert req.messages[3]["tool_call_id"] == "no-such-id" and not req.plain_messages
    assert p.parse_chat({"messages": ASK}, p.Defaults()).plain_messages
    err = refused({"messages": [*ASK, {"role": "tool", "content": "x"}]})
    assert err.param == "messages[1].tool_call_id"
    bad_args = {**call, "function": {"name": "add", "arguments": "{not json"}}
    err = refused({"messages": [*ASK, {"role": "assistant", "tool_calls": [bad_args]}]})
    assert err.param == "messages[1].tool_calls[0].function.arguments"
    err = refused({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"function": {}}]}]})
    assert err.param == "messages[1].tool_calls[0]"


def test_logprobs_parsing():
    d = p.Defaults()
    assert p.parse_chat(chat_body(), d).logprobs is None
    assert p.parse_chat(chat_body(logprobs=True), d).logprobs == 0
    assert p.parse_chat(chat_body(logprobs=True, top_logprobs=20), d).logprobs == 20
    assert p.parse_chat(chat_body(logprobs=False, top_logprobs=0), d).logprobs is None
    assert p.parse_completion({"prompt": "x", "logprobs": 5}, d).logprobs == 5
    assert p.parse_completion({"prompt": "x", "logprobs": 0}, d).logprobs == 0
    assert refused(chat_body(logprobs=True, top_logprobs=21)).param == "top_logprobs"
    assert refused(chat_body(logprobs=True, top_logprobs=-1)).param == "top_logprobs"
    assert refused(chat_body(top_logprobs=3)).param == "top_logprobs"  # without logprobs
    assert refused(chat_body(logprobs=3)).param == "logprobs"
    assert refused({"prompt": "x", "logprobs": 6}, "completion").param == "logprobs"
    assert refused({"prompt": "x", "logprobs": True}, "completion").param == "logprobs"


# ---------------------------------------------------------------------------------------------- formats, grammar


def test_tool_format_detection(tok):
    assert tl.tool_format(TEMPLATE) == tl.HERMES
    assert tl.tool_format(tl.template_text(tok)) == tl.HERMES
    llama = '<|start_header_id|>ipython<|end_header_id|> {"name": function name, "parameters": dict} <|python_tag|>'
    assert tl.tool_format(llama) == tl.LLAMA3
    assert tl.tool_format("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS] {{ calls }}") == tl.MISTRAL
    assert tl.tool_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert tl.tool_format("") is None


def _tools(*specs: dict) -> list[tl.Tool]:
    return [tl.Tool(s["function"]["name"], s["function"]["parameters"], s) for s in specs]


def _matcher(grammar: str, tok):
    import llguidance
    import llguidance.hf

    m = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok), llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not m.is_error(), m.get_error()
    return m


def _accepts(grammar: str, tok, text: str) -> bool:
    m = _matcher(grammar, tok)
    ids = tok.encode(text, add_special_tokens=False)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def test_forced_grammars_accept_their_format(tok):
    tools = _tools(WEATHER, ADD)
    added = tok.get_added_vocab()
    assert tok.encode("<tool_call>", add_special_tokens=False) == [added["<tool_call>"]]  # one token, as in Qwen
    one = '<tool_call>\n{"name": "add", "arguments": {"a": true, "b": false}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
    required = tl.forced_grammar(tl.HERMES, tools, None, True, added.get)
    assert "<[" in required  # the markers are named as tokens
    assert _accepts(required, tok, one) and _accepts(required, tok, two) and _accepts(required, tok, two + "\n")
    assert not _accepts(required, tok, one.replace('"a": true', '"a": 1'))  # arguments follow the schema
    assert not _accepts(required, tok, one.replace('"a": true, ', '"a":true, '))  # in tojson's layout
    assert not _accepts(required, tok, "Sure. " + one)  # no text before a forced call
    single = tl.forced_grammar(tl.HERMES, tools, None, False, added.get)
    assert _accepts(single, tok, one) and not _accepts(single, tok, two)
    named = tl.forced_grammar(tl.HERMES, tools, "get_weather", True, added.get)
    assert not _accepts(named, tok, one) and _accepts(named, tok, two[len(one) + 1 :])
    # the other formats (their markers are text in this vocabulary)
    llama = tl.forced_grammar(tl.LLAMA3, tools, "add", True, added.get)
    assert _accepts(llama, tok, '{"name": "add", "parameters": {"a": false, "b": true}}')
    mistral = tl.forced_grammar(tl.MISTRAL, tools, None, True, added.get)
    calls = '[TOOL_CALLS] [{"name": "add", "arguments": {"a": true, "b": true}}, {"name": "get_weather", '
    assert _accepts(mistral, tok, calls + '"arguments": {"city": "Paris", "days": 1}}]')
    with pytest.raises(ValueError):
        tl.forced_grammar(tl.HERMES, tools, "nope", True, added.get)


# ---------------------------------------------------------------------------------------------- the parser


def _fold_in_pieces(fmt: str, text: str, size: int) -> tuple[tl.Folded, list[tl.Event]]:
    parser = tl.ToolParser(fmt, new_id=lambda: "id")
    events: list[tl.Event] = []
    for i in range(0, len(text), size):
        events += parser.push(text[i : i + size])
    events += parser.finish()
    return tl.fold(events), events


HERMES_CASES = [
    # (generated text, content, [(name, arguments)])
    ("Hello there.", "Hello there.", []),
    ("a < b, <tool x", "a < b, <tool x", []),
    ('<tool_call>\n{"name": "add", "arguments": {"a": true}}\n</tool_call>', None, [("add", '{"a": true}')]),
    (
        'Let me see.\n\n<tool_call>\n{"name": "f", "arguments": {"s": "}{\\"</tool_call>"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
        "Let me see.",
        [("f", '{"s": "}{\\"</tool_call>"}'), ("g", "{}")],
    ),
    ('<tool_call>\n{"arguments": {"x": 1}, "name": "h"}\n</tool_call>', None, [("h", '{"x": 1}')]),  # other order
    ('<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>', None, [("f", '{"x": 2}')]),
    ("x <tool_call>\nnot json\n</tool_call> y", "x <tool_call>\nnot json\n</tool_call> y", []),
    ('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2', None, [("f", '{"a": [1, 2')]),  # cut by max_tokens
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}', None, [("f", '{"a": 1}')]),  # EOS without the end tag
]


@pytest.mark.parametrize("case", range(len(HERMES_CASES)))
def test_hermes_parser_any_split(case):
    text, content, calls = HERMES_CASES[case]
    for size in (1, 2, 3, 7, len(text)):
        folded, events = _fold_in_pieces(tl.HERMES, text, size)
        assert folded.content == content, (size, events)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in folded.tool_calls] == calls, size
        assert all(c["id"] == "id" and c["type"] == "function" for c in folded.tool_calls)
        if calls and content is None:  # no markup leaks as content
            assert not any(isinstance(e, tl.Content) for e in events)


def test_hermes_parser_streams_arguments_as_they_come():
    parser = tl.ToolParser(tl.HERMES, new_id=lambda: "call_x")
    assert parser.push("<tool_call>\n") == []
    assert parser.push('{"name": "add", "arguments": ') == []
    started = parser.push('{"a": tr')
    assert started == [tl.CallStart(0, "call_x", "add"), tl.CallArgs(0, '{"a": tr')]
    assert parser.push("ue}") == [tl.CallArgs(0, "ue}")]
    assert parser.push("}\n</tool_") == [] and parser.push("call>") == [] and parser.finish() == []


@pytest.mark.parametrize(
    "fmt, text, content, calls",
    [
        (tl.LLAMA3, ' {"name": "add", "parameters": {"a": 1}}', None, [("add", '{"a": 1}')]),
        (tl.LLAMA3, '<|python_tag|>{"name": "f", "arguments": {}}', None, [("f", "{}")]),
        (tl.LLAMA3, '{"answer": 42}', '{"answer": 42}', []),
        (tl.LLAMA3, "It is sunny.", "It is sunny.", []),
        (tl.LLAMA3, "<b>bold</b>", "<b>bold</b>", []),
        (tl.LLAMA3, "  ", "  ", []),
        (
            tl.MISTRAL,
            '[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]',
            None,
            [("f", '{"x": 1}'), ("g", "{}")],
        ),  # fmt: skip
        (tl.MISTRAL, ' [{"name": "f", "arguments": {}}]', None, [("f", "{}")]),  # the control token not in the text
        (tl.MISTRAL, "[1, 2, 3] is a list", "[1, 2, 3] is a list", []),
    ],
)
def test_whole_answer_formats(fmt, text, content, calls):
    for size in (1, 4, len(text)):
        folded, _ = _fold_in_pieces(fmt, text, size)
        assert folded.content == content
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in folded.tool_calls] == calls


def test_whole_answer_formats_stream_plain_text_at_once():
    """Only an answer that may be a call (it starts with ``{`` / ``[`` or a marker) waits for its end."""
    parser = tl.ToolParser(tl.LLAMA3)
    assert (
        parser.push("  ") == []
        and parser.push("It") == [tl.Content("  It")]
        and parser.push(" is") == [tl.Content(" is")]
    )
    waiting = tl.ToolParser(tl.LLAMA3)
    assert waiting.push("<|py") == [] and waiting.push('thon_tag|>{"name": "f"') == []
    assert waiting.push(', "parameters": {}}') == [] and len(waiting.finish()) == 2


def test_call_ids():
    assert tl.new_call_id(tl.HERMES).startswith("call_") and len(tl.new_call_id(tl.HERMES)) == 29
    m = tl.new_call_id(tl.MISTRAL)
    assert len(m) == 9 and m.isalnum()


# ---------------------------------------------------------------------------------------------- log-prob shapes


def test_token_texts_and_offsets(tok):
    from specexec.server.worker import TokenTexts

    texts = TokenTexts(tok)
    ids = tok.encode("héllo, wörld <tool_call>", add_special_tokens=False)
    parts = [texts(i) for i in ids]
    assert b"".join(raw for _, raw in parts).decode() == tok.decode(ids)
    assert any("\\x" in t for t, _ in parts)  # a character split over two byte tokens shows as escapes
    entries = [p.TokenLogprob(t, raw, -1.0) for t, raw in parts]
    lp = p.CompletionLogprobs()
    whole = lp(entries)
    text = tok.decode(ids)
    starts = whole["text_offset"]
    assert starts[0] == 0 and starts == sorted(starts) and len(starts) == len(ids)
    assert text[starts[-1] :] == "<tool_call>"
    chat = p.chat_logprobs([p.TokenLogprob("a", b"a", float("-inf"), (("a", b"a", -0.5),))])
    assert chat["content"][0]["logprob"] == p.LOGPROB_FLOOR  # JSON has no -inf
    assert chat["content"][0]["top_logprobs"] == [{"token": "a", "logprob": -0.5, "bytes": [97]}]


# ---------------------------------------------------------------------------------------------- end to end


def _sse(live: LiveServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", live.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert not any("error" in e for e in events), events
    return events


def test_json_schema_answer(client, live):
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model="tiny", messages=ASK, response_format=rf, temperature=0)
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert r.choices[0].finish_reason == "stop"
    again = client.chat.completions.create(model="tiny", messages=ASK, response_format=rf, temperature=0)
    assert again.choices[0].message.content == text  # temperature 0 repeats
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, response_format=rf, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "stop"
    # sampled answers are valid too, and completions take response_format as well
    for seed in range(3):
        s = client.chat.completions.create(model="tiny", messages=ASK, response_format=rf, temperature=1, seed=seed)
        jsonschema.validate(json.loads(s.choices[0].message.content), SCHEMA)
    c = client.completions.create(model="tiny", prompt="Data:", max_tokens=40, extra_body={"response_format": rf})
    jsonschema.validate(json.loads(c.choices[0].text), SCHEMA)
    obj = client.completions.create(
        model="tiny", prompt="Data:", max_tokens=16, extra_body={"response_format": {"type": "json_object"}}
    )
    assert obj.choices[0].text.lstrip().startswith("{")  # JSON mode: an object (16 tokens may cut it)
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].text), dict)


def test_schema_cut_by_max_tokens_gives_length(client):
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    full = client.chat.completions.create(model="tiny", messages=ASK, response_format=rf, temperature=0)
    r = client.chat.completions.create(model="tiny", messages=ASK, response_format=rf, temperature=0, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    assert full.choices[0].message.content.startswith(r.choices[0].message.content)


def test_bad_structured_requests_are_400_and_the_server_keeps_serving(client, live):
    def bad(**kw: Any) -> dict:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=kw.pop("messages", ASK), max_tokens=4, **kw)
        err = e.value.response.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] is None, err
        return err

    schema = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}
    assert (
        bad(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})["param"]
        == "response_format"
    )
    ref = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
    assert (
        bad(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": ref}})["param"]
        == "response_format"
    )
    assert bad(response_format={"type": "xml"})["param"] == "response_format"
    broken = {"type": "function", "function": {"name": "f", "parameters": schema}}
    assert bad(tools=[broken])["param"] == "tools"
    assert bad(tools=[ADD], tool_choice={"type": "function", "function": {"name": "nope"}})["param"] == "tool_choice"
    assert bad(tool_choice="required")["param"] == "tool_choice"
    assert bad(tools=[{"type": "function", "function": {"description": "no name"}}])["param"] == "tools"
    assert bad(logprobs=True, top_logprobs=25)["param"] == "top_logprobs"
    assert bad(top_logprobs=2)["param"] == "top_logprobs"
    msgs = [*ASK, {"role": "tool", "content": "42"}]
    assert bad(messages=msgs, tools=[ADD])["param"] == "messages[1].tool_call_id"
    call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": "a=1"}}
    msgs = [*ASK, {"role": "assistant", "tool_calls": [call]}]
    assert bad(messages=msgs, tools=[ADD])["param"] == "messages[1].tool_calls[0].function.arguments"
    assert httpx.get(live.url + "/health").json()["status"] == "ok"
    ok = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4)
    assert ok.choices[0].finish_reason in ("length", "stop")


def _deep(n: int) -> str:
    return '{"type": "object", "properties": {"a": ' * n + '{"type": "string"}' + "}}" * n


def test_schemas_past_the_limits_are_400_naming_the_field(live):
    """Too deep for json.loads (1,000 nested objects), deeper than the limit, larger than the limit: a 400 whose
    message names the field (OpenAI's error envelope), never a 500; the server keeps serving."""

    def bad(body: str) -> dict:
        r = httpx.post(live.url + "/v1/chat/completions", content=body, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error", err
        return err

    head = '{"model": "tiny", "max_tokens": 4, "messages": ' + json.dumps(ASK)
    for n in (1000, 200):  # past json.loads' recursion; past MAX_SCHEMA_DEPTH only
        rf = '{"type": "json_schema", "json_schema": {"name": "s", "schema": ' + _deep(n) + "}}"
        err = bad(head + ', "response_format": ' + rf + "}")
        assert err["param"] == "response_format", err
        assert err["message"].startswith("response_format.json_schema.schema nests more than 100 levels"), err
        tool = '{"type": "function", "function": {"name": "f", "parameters": ' + _deep(n) + "}}"
        err = bad(head + ', "tools": [' + json.dumps(ADD) + ", " + tool + "]}")
        assert err["param"] == "tools", err
        assert err["message"].startswith("tools[1].function.parameters nests more than 100 levels"), err
    huge = {"type": "object", "properties": {f"p{i:05}": {"type": "integer"} for i in range(40_000)}}
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": huge}}
    err = bad(json.dumps({"model": "tiny", "messages": ASK, "response_format": rf}))
    assert err["message"].startswith("response_format.json_schema.schema cannot be used: the JSON schema is"), err
    assert "at most 1,048,576 are allowed" in err["message"] and err["param"] == "response_format"
    assert httpx.get(live.url + "/health").json()["status"] == "ok"


def test_a_grammar_failing_part_way_ends_the_stream_with_an_error_event(live, monkeypatch):
    """A mask step out of llguidance's lexer fuel part-way through a streamed answer (the fuel lowered through
    PARSER_LIMITS so a small pattern hits it): the text so far, then one error event in OpenAI's envelope naming
    the field, then [DONE]; not a dropped connection. Not streamed: a 400."""
    from specexec.decoding import constraint as cm

    monkeypatch.setitem(cm.PARSER_LIMITS, "step_lexer_fuel", 100)
    schema = {"type": "string", "pattern": "^[xy]{24}[ab]*a[ab]{10}$"}  # free text, then the costly part
    body = chat_body(
        model="tiny",
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    )
    with httpx.stream("POST", live.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]", lines
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    err = events[-1]["error"]
    assert err["param"] == "response_format" and err["type"] == "invalid_request_error", err
    assert "failed part-way through the answer" in err["message"], err
    text = "".join(c["delta"].get("content") or "" for e in events[:-1] for c in e["choices"])
    assert len(text) > 1 and set(text[1:]) <= set("xy"), text  # the steps before the failing one
    r = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 400 and "failed part-way" in r.json()["error"]["message"], r.text


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _params(name: str) -> dict:
    return {"get_weather": WEATHER, "add": ADD}[name]["function"]["parameters"]


def test_forced_tool_call(client, live):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER, ADD], tool_choice=named, temperature=0, max_tokens=128
    )
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    ((name, args),) = _calls(msg)
    assert name == "get_weather" and msg.tool_calls[0].id.startswith("call_") and msg.tool_calls[0].type == "function"
    jsonschema.validate(args, _params(name))
    # streamed: the same call, the name first, then argument fragments; no markup as content
    events = _sse(live, "/v1/chat/completions", {
        "messages": ASK, "tools": [WEATHER, ADD], "tool_choice": named, "temperature": 0, "max_tokens": 128,
    })  # fmt: skip
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert not any(d.get("content") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls") or []]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert calls[0]["index"] == 0 and calls[0]["type"] == "function"
    assert all(c["index"] == 0 and "id" not in c for c in calls[1:]) and len(calls) > 2
    assert "".join(c["function"]["arguments"] for c in calls) == msg.tool_calls[0].function.arguments
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # the openai client's stream helper assembles the same call
    with client.chat.completions.stream(
        model="tiny", messages=ASK, tools=[WEATHER, ADD], tool_choice=named, temperature=0, max_tokens=128
    ) as stream:
        final = stream.get_final_completion()
    assert _calls(final.choices[0].message) == [(name, args)]
    # required: one or more calls of any tool, each valid for its function
    req = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER, ADD], tool_choice="required", temperature=0, max_tokens=200
    )
    got = _calls(req.choices[0].message)
    assert got and req.choices[0].finish_reason in ("tool_calls", "length")
    for n, a in got[: None if req.choices[0].finish_reason == "tool_calls" else -1]:
        jsonschema.validate(a, _params(n))


def test_tool_history_renders_through_the_template(client, live, tok):
    call = {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    msgs = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_7", "content": "sunny, 21 C"},
    ]
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=[WEATHER], max_tokens=8, temperature=0)
    template_msgs = [
        ASK[0],
        {"role": "assistant", "content": "", "tool_calls": [{**call, "function": {"name": "get_weather",
                                                                               "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "sunny, 21 C"},
    ]  # fmt: skip
    text = tok.apply_chat_template(template_msgs, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text and "sunny, 21 C" in text
    assert r.usage.prompt_tokens == len(tok(text, add_special_tokens=False)["input_ids"])
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # tool_choice none: the tools are rendered (as vLLM does) but nothing is parsed out of the answer
    n = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=8, temperature=0
    )
    assert n.choices[0].message.tool_calls is None and n.choices[0].finish_reason in ("stop", "length")


def _check_chat_logprobs(content: list, k: int) -> None:
    for e in content:
        assert len(e["top_logprobs"]) == k and bytes(e["bytes"]).decode("utf-8", "backslashreplace") == e["token"]
        tops = [t["logprob"] for t in e["top_logprobs"]]
        assert tops == sorted(tops, reverse=True) and all(v <= 0 for v in tops) and e["logprob"] <= 0
        if k:
            assert e["logprob"] >= tops[-1] - 1e-4  # greedy: the chosen token is the most likely one


def test_logprobs(live, tok):
    body = {"messages": ASK, "max_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    r = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=120).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"] == 12
    _check_chat_logprobs(content, 3)
    text = r["choices"][0]["message"]["content"]
    assert b"".join(bytes(e["bytes"]) for e in content).decode(errors="replace") == text  # tokens join to the text
    events = _sse(live, "/v1/chat/completions", body)
    streamed = [
        x
        for e in events
        if e["choices"] and e["choices"][0]["logprobs"]
        for x in e["choices"][0]["logprobs"]["content"]
    ]
    assert streamed == content
    # logprobs without top_logprobs: the chosen token's only
    plain = httpx.post(live.url + "/v1/chat/completions", json={**body, "top_logprobs": None}, timeout=120).json()
    _check_chat_logprobs(plain["choices"][0]["logprobs"]["content"], 0)
    assert (
        httpx.post(
            live.url + "/v1/chat/completions", json={**body, "logprobs": False, "top_logprobs": None}, timeout=120
        ).json()["choices"][0]["logprobs"]
        is None
    )
    # completions: tokens, token_logprobs, top_logprobs (dicts), text_offset
    cbody = {"prompt": "Once upon", "max_tokens": 10, "temperature": 0, "logprobs": 2}
    c = httpx.post(live.url + "/v1/completions", json=cbody, timeout=120).json()
    lp = c["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 10
    assert all(len(d) <= 2 for d in lp["top_logprobs"]) and lp["text_offset"][0] == 0
    assert all(v >= min(d.values()) - 1e-4 for v, d in zip(lp["token_logprobs"], lp["top_logprobs"]))
    cevents = _sse(live, "/v1/completions", cbody)
    joined: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in cevents:
        part = e["choices"][0]["logprobs"] if e["choices"] else None
        for key in joined:
            joined[key] += part[key] if part else []
    assert joined == lp
    # under a constraint the values are still the model's own distribution's (the chosen token may rank low)
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    s = httpx.post(
        live.url + "/v1/chat/completions", json={**body, "max_tokens": 40, "response_format": rf}, timeout=120
    )
    sc = s.json()["choices"][0]
    assert b"".join(bytes(e["bytes"]) for e in sc["logprobs"]["content"]).decode() == sc["message"]["content"]


def test_greedy_structured_answers_equal_plain_decoding(live, byte_pair, tmp_path_factory):
    """Speculation under a constraint gives the constrained plain decoding's answer (the AR server's)."""
    engine = load(byte_pair, tmp_path_factory.mktemp("home_ar"))
    config = ServerConfig(model_name="tiny", method="ar", defaults=Defaults(max_new_tokens=48))
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    named = {"type": "function", "function": {"name": "get_weather"}}
    bodies = [
        {"messages": ASK, "response_format": rf, "temperature": 0},
        {"messages": ASK, "tools": [WEATHER, ADD], "tool_choice": named, "temperature": 0, "max_tokens": 128},
        {"messages": ASK, "tools": [WEATHER, ADD], "tool_choice": "required", "temperature": 0, "max_tokens": 128},
    ]
    with LiveServer(create_app(config, engine=engine)) as ar:
        for body in bodies:
            a = httpx.post(ar.url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
            b = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
            for x in (a, b):
                for c in x["message"].get("tool_calls") or []:
                    c["id"] = "-"
            assert a == b


# ---------------------------------------------------------------------------------------------- other templates


@pytest.fixture(scope="module")
def word_pair(tiny_pair, tmp_path_factory):
    """The conftest tiny pair (word-level tokens t3..t95) with a template given per test."""
    return tiny_pair


def _serve_word_pair(pair: tuple[Path, Path], template: str, root: Path) -> LiveServer:
    import shutil

    from specexec import api

    target = root / "target"
    shutil.copytree(pair[0], target)
    cfg = json.loads((target / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (target / "tokenizer_config.json").write_text(json.dumps(cfg))
    for f in target.glob("chat_template.jinja"):
        f.write_text(template)
    engine = api.load(str(target), None, device="cpu", context=256, progress=False, cache_dir=root / "home")
    return LiveServer(create_app(ServerConfig(model_name="w"), engine=engine))


def test_templates_without_tools_or_a_known_format(word_pair, tmp_path_factory):
    plain = "{% for m in messages %}t3 {{ m['content'] }} t4 {% endfor %}{% if add_generation_prompt %}t5{% endif %}"
    with _serve_word_pair(word_pair, plain, tmp_path_factory.mktemp("plain")) as srv:
        c = srv.client()
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="w", messages=[{"role": "user", "content": "t9"}], tools=[ADD])
        assert e.value.response.json()["error"]["param"] == "tools"
        ok = c.chat.completions.create(model="w", messages=[{"role": "user", "content": "t9"}], max_tokens=3)
        assert ok.choices[0].message.content is not None
    unknown = "{% if tools %}t7 {% endif %}" + plain  # renders tools, in no format this server knows
    with _serve_word_pair(word_pair, unknown, tmp_path_factory.mktemp("unknown")) as srv:
        c = srv.client()
        r = c.chat.completions.create(
            model="w", messages=[{"role": "user", "content": "t9"}], tools=[ADD], max_tokens=3
        )
        assert r.choices[0].message.tool_calls is None  # auto: free text, nothing to parse
        for choice in ("required", {"type": "function", "function": {"name": "add"}}):
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(
                    model="w", messages=[{"role": "user", "content": "t9"}], tools=[ADD], tool_choice=choice
                )
            assert e.value.response.json()["error"]["param"] == "tool_choice"


# ---------------------------------------------------------------------------------------------- the demo pair


@pytest.mark.slow
def test_real_pair_structured_output_tools_and_logprobs(real_pair):
    """The demo pair through the official client: forced tool calls (whole and streamed) whose arguments validate,
    a tool answer in the history rendered by Qwen's template, schema-valid JSON (whole and streamed), log-probs;
    temperature 0 repeats. Ordered so that requests extend each other's prompts (the engine's prefix cache): the
    tools' system prompt (~190 tokens) is prefilled once."""
    engine = real_pair
    engine.reset()
    tok = engine.tokenizer.tokenizer
    tree = TreeConfig.fixed(8, early_stop=False)
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    params = weather["function"]["parameters"]
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    person = [{"role": "user", "content": "Invent a person: JSON with name and age."}]
    with LiveServer(create_app(ServerConfig(model_name="demo", tree=tree, parallel=1), engine=engine)) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=1200)
        named = {"type": "function", "function": {"name": "get_weather"}}
        t = c.chat.completions.create(
            model="demo", messages=ask, tools=[weather], tool_choice=named, temperature=0, max_tokens=40
        )
        assert t.choices[0].finish_reason == "tool_calls" and t.choices[0].message.content is None
        (call,) = t.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), params)
        with c.chat.completions.stream(
            model="demo", messages=ask, tools=[weather], tool_choice="required", temperature=0, max_tokens=40
        ) as stream:
            final = stream.get_final_completion()
        (streamed,) = final.choices[0].message.tool_calls
        assert (streamed.function.name, streamed.function.arguments) == ("get_weather", call.function.arguments)

        tool_answer = '{"temperature": 21, "sky": "sunny"}'
        history = [
            *ask,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
            {"role": "tool", "tool_call_id": call.id, "content": tool_answer},
        ]
        a = c.chat.completions.create(model="demo", messages=history, tools=[weather], temperature=0, max_tokens=16)
        again = c.chat.completions.create(model="demo", messages=history, tools=[weather], temperature=0, max_tokens=16)
        assert a.choices[0].message.content and a.choices[0].message.content == again.choices[0].message.content
        rendered = tok.apply_chat_template(
            [
                ask[0],
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather",
                                                      "arguments": json.loads(call.function.arguments)}}]},
                {"role": "tool", "content": tool_answer},
            ],
            tools=[weather], add_generation_prompt=True, tokenize=False,
        )  # fmt: skip
        assert "<tool_response>\n" + tool_answer in rendered and call.function.arguments in rendered
        assert a.usage.prompt_tokens == len(tok(rendered, add_special_tokens=False)["input_ids"])

        rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
        r = c.chat.completions.create(model="demo", messages=person, response_format=rf, temperature=0, max_tokens=40)
        assert r.choices[0].finish_reason == "stop", r
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        chunks = list(c.chat.completions.create(
            model="demo", messages=person, response_format=rf, temperature=0, max_tokens=40, stream=True
        ))  # fmt: skip
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == r.choices[0].message.content

        lp = c.chat.completions.create(
            model="demo", messages=person, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3
        )
        content = lp.choices[0].logprobs.content
        assert len(content) == lp.usage.completion_tokens == 8
        assert "".join(x.token for x in content) == lp.choices[0].message.content  # the tokens join to the text
        for x in content:
            tops = [y.logprob for y in x.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True)
            assert x.logprob >= tops[-1] - 1e-3 and x.logprob >= tops[0] - 1e-3  # greedy: the most likely token
    engine.reset()
