"""Constrained decoding on the real Qwen2.5-Coder pair (slow; runs in CI).

A JSON-schema answer, JSON mode and a regex through the chat template: every speculative method (the CLI's
default policy, a fixed tree, chain) gives constrained AR's tokens exactly, the finished answers parse
and validate, and the schema's fixed parts are proposed as forced tokens.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from specexec.config import ChainConfig, TreeConfig
from specexec.decoding.constraint import Constraint

pytestmark = pytest.mark.slow

BOOK = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "author": {"type": "string"},
        "year": {"type": "integer"},
        "rating": {"type": "number"},
        "genres": {"type": "array", "items": {"type": "string"}},
        "in_print": {"type": "boolean"},
    },
    "required": ["title", "author", "year", "rating", "genres", "in_print"],
    "additionalProperties": False,
}
PROMPT = "Give me a JSON record for the novel Dune: title, author, year, rating, genres, in_print."
METHODS = {
    "default": {},
    "specexec-16": dict(method="specexec", tree=TreeConfig.fixed(16)),
    "chain-3": dict(method="chain", chain=ChainConfig(gamma=3)),
}


@pytest.fixture(scope="module")
def engine(real_pair):
    return real_pair


def test_schema_answer_is_exact_and_valid(engine):
    c = Constraint.json_schema(BOOK)
    ref = engine.generate(PROMPT, 96, chat=True, method="ar", constraint=c)
    assert ref.finish_reason == "stop", ref.text
    jsonschema.validate(json.loads(ref.text), BOOK)
    assert list(json.loads(ref.text)) == list(BOOK["properties"])  # in the schema's order
    assert ref.stats.forced_tokens > 0  # the key names are the schema's, not the model's
    for name, kw in METHODS.items():
        r = engine.generate(PROMPT, 96, chat=True, constraint=c, **kw)
        assert r.tokens == ref.tokens, (name, r.text, ref.text)
    # unconstrained, the model wraps its JSON in a Markdown fence: the constraint changed the answer
    free = engine.generate(PROMPT, 24, chat=True, method="ar")
    assert free.tokens != ref.tokens[:24]


def test_json_mode_and_regex(engine):
    r = engine.generate("List three primary colors as JSON.", 48, chat=True, constraint=Constraint.json())
    a = engine.generate("List three primary colors as JSON.", 48, chat=True, constraint=Constraint.json(), method="ar")
    assert r.tokens == a.tokens
    if r.finish_reason == "stop":
        assert isinstance(json.loads(r.text), dict)
    pattern = r"(19|20)[0-9]{2}-[01][0-9]-[0-3][0-9]"
    d = engine.generate(
        "When did Apollo 11 land on the Moon? Answer with the date.",
        16,
        chat=True,
        constraint=Constraint.regex(pattern),
    )
    assert d.finish_reason == "stop" and re.fullmatch(pattern, d.text), d.text
    assert (
        d.tokens
        == engine.generate(
            "When did Apollo 11 land on the Moon? Answer with the date.",
            16,
            chat=True,
            constraint=Constraint.regex(pattern),
            method="ar",
        ).tokens
    )
