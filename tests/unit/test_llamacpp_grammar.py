"""The llama.cpp engine's grammars (llmesh.engine.backends.llamacpp_grammar): converted off
the event loop, within a deadline, a size and a nesting, remembered; refusals are
INVALID_ARGUMENT naming the schema. The parse by llama.cpp itself: the component tests."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from llmesh.errors import InvalidArgument
from llmesh.schema_bounds import LIMITS
from llmesh.types import ResponseFormat
from llmesh.engine.backends import llamacpp_grammar
from llmesh.engine.backends.llamacpp_grammar import MAX_NESTING, PARAM, GrammarCompiler, gbnf_nesting, schema_grammar

from .work import calls_made

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}, "required": ["name"]}


def fmt(schema: dict | str) -> ResponseFormat:
    return ResponseFormat("json_schema", schema if isinstance(schema, str) else json.dumps(schema))


def test_nesting_counts_groups_not_literals_or_classes():
    assert gbnf_nesting('root ::= ("(" ([(] x)?)?') == 2
    assert gbnf_nesting('a ::= "\\"(((" [)\\]] b') == 0
    assert gbnf_nesting(schema_grammar(json.dumps({"type": "string", "maxLength": 300}))) == 300


def test_grammars_keep_json_strings_free_of_control_characters():
    assert r'char ::= [^"\\\x7F\x00-\x1F] |' in schema_grammar(json.dumps(PERSON))


def test_the_schema_bounds_come_first_even_without_the_gateway():
    with pytest.raises(InvalidArgument) as info:
        schema_grammar('{"type":"string","maxLength":100000}')
    assert info.value.param == PARAM + ".maxLength"


def test_a_grammar_over_its_size_or_nesting_is_refused(monkeypatch):
    text = json.dumps({"type": "string", "maxLength": 500})
    size = len(schema_grammar(text))
    assert schema_grammar(text, max_bytes=size)
    with pytest.raises(InvalidArgument, match=f"grammar of {size} bytes; at most {size - 1}"):
        schema_grammar(text, max_bytes=size - 1)
    monkeypatch.setattr(llamacpp_grammar, "MAX_NESTING", 499)
    with pytest.raises(InvalidArgument, match="nested 500 groups deep; at most 499") as info:
        schema_grammar(text)
    assert info.value.param == PARAM and MAX_NESTING == 1_000


def test_what_the_converter_cannot_express_is_invalid_argument():
    with pytest.raises(InvalidArgument, match="cannot be enforced") as info:
        schema_grammar(json.dumps({"type": "string", "pattern": "no anchors"}))
    assert info.value.param == PARAM


async def test_grammars_are_made_off_the_loop_and_remembered(monkeypatch):
    made: list[str] = []
    real = llamacpp_grammar.schema_grammar

    def counting(schema: str, max_bytes: int) -> str:
        made.append(schema)
        return real(schema, max_bytes)
    monkeypatch.setattr(llamacpp_grammar, "schema_grammar", counting)
    compiler = GrammarCompiler(cache_entries=2)
    try:
        first = await compiler.grammar(fmt(PERSON))
        assert await compiler.grammar(fmt(PERSON)) is first and len(made) == 1
        for bad in range(2):  # a refusal is remembered too
            with pytest.raises(InvalidArgument):
                await compiler.grammar(fmt('{"type":"string","pattern":"x"}'))
        assert len(made) == 2
        await compiler.grammar(fmt({"type": "integer"}))
        await compiler.grammar(fmt(PERSON))  # evicted by the two since: made again
        assert len(made) == 4
        assert "root" in await compiler.grammar(ResponseFormat("json_object"))
    finally:
        compiler.close()


async def test_a_conversion_over_its_deadline_is_invalid_argument_and_the_loop_stays_free(monkeypatch):
    def slow(schema: str, max_bytes: int) -> str:
        time.sleep(0.5)
        return "root ::= x"
    monkeypatch.setattr(llamacpp_grammar, "schema_grammar", slow)
    compiler = GrammarCompiler(timeout_s=0.1)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1
    ticker = asyncio.create_task(tick())
    try:
        with pytest.raises(InvalidArgument, match="within 0.1 s") as info:
            await compiler.grammar(fmt(PERSON))
        assert info.value.param == PARAM and ticks >= 5
    finally:
        ticker.cancel()
        compiler.close()


def test_every_bounded_schema_converts_in_linear_work():
    """The worst schemas the bounds accept (bench.hostile_schemas) convert in a few dozen calls per
    byte at most (about 14 on the worst today, ~25 ms here: far inside the engine's deadline, which
    bench.hostile times); over the bounds nothing reaches the converter."""
    from bench.hostile_schemas import cases

    schema_grammar('{"type": "string"}')  # the converter's imports are not the schema's work
    worst = 0.0
    for _, _, body in cases(LIMITS.max_bytes + 1, "m"):
        if "tools" in body:
            continue
        text = json.dumps(body["response_format"]["json_schema"]["schema"])
        worst = max(worst, (calls_made(schema_grammar, text) - 200) / len(text))
    assert worst < 40, worst
