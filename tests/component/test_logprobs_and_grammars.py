"""Log probabilities and constrained decoding in the engine: the real llama.cpp
backend (SmolLM2) and the sim, through the engine core."""

from __future__ import annotations

import asyncio
import json
import math
from contextlib import aclosing

import jsonschema
import pytest

from llmesh.errors import Internal, InvalidArgument
from llmesh.schema_bounds import LIMITS
from tests.component.helpers import answered, generated
from llmesh.types import Delta, Message, Prompt, ResponseFormat, Sampling
from llmesh.engine.admission import Admission
from llmesh.engine.backends.base import DecodeParams
from llmesh.engine.backends.llamacpp import LlamaCppBackend
from llmesh.engine.backends.sim import SimBackend, SimProfile
from llmesh.engine.core import EngineCore

MODEL = "smollm2-135m-instruct"
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}}}


@pytest.fixture(scope="module")
async def llama(real_model_dir):
    b = LlamaCppBackend.from_store(real_model_dir, MODEL, n_ctx=1024, n_threads=2, n_batch=256, n_slots=4)
    yield b
    await b.close()


def ask(text: str) -> Prompt:
    return Prompt(messages=(Message("user", text),))


run = generated  # (text, logprobs, finish) of one request


def core_for(backend) -> EngineCore:
    return EngineCore(backend, Admission(max_running=4, max_waiting=8))


async def test_llamacpp_logprobs_are_sane(llama):
    core = core_for(llama)
    text, lps, finish = await run(core, MODEL, ask("What color is the sky?"),
                                  Sampling(max_tokens=8, temperature=0.0, logprobs=3))
    assert len(lps) == finish.usage.completion_tokens == 8
    assert "".join(t.token for t in lps) == text
    for t in lps:
        assert t.logprob <= 0.0 and len(t.top) == 3
        assert [lp for _, lp in t.top] == sorted((lp for _, lp in t.top), reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert t.top[0][0] == t.token and t.top[0][1] == pytest.approx(t.logprob, abs=1e-5)
        assert sum(math.exp(lp) for _, lp in t.top) <= 1.0 + 1e-4
    # Sampled tokens are not always the best, but their logprob is never above it.
    _, sampled, _ = await run(core, MODEL, ask("Tell me a word."), Sampling(max_tokens=8, temperature=1.5,
                                                                            seed=3, logprobs=1))
    assert all(t.logprob <= t.top[0][1] + 1e-5 for t in sampled)


async def test_llamacpp_json_object_is_always_json(llama):
    """Sampled with several seeds at once: every finished answer parses."""
    core = core_for(llama)
    answers = await asyncio.gather(*(
        run(core, MODEL, ask('Output this JSON exactly: {"color": "blue"}'),
            Sampling(max_tokens=64, temperature=0.3, seed=seed, response_format=ResponseFormat("json_object")))
        for seed in (1, 2, 3)))
    for text, _, finish in answers:
        assert text.startswith("{"), text
        if finish.reason.value == "stop":
            assert isinstance(json.loads(text), dict)


async def test_llamacpp_json_schema_is_always_matched(llama):
    core = core_for(llama)
    answers = await asyncio.gather(*(
        run(core, MODEL, ask("Invent a person."),
            Sampling(max_tokens=64, temperature=1.0, seed=seed,
                     response_format=ResponseFormat("json_schema", json.dumps(PERSON))))
        for seed in (1, 2, 3, 4)))
    for text, _, finish in answers:
        assert finish.reason.value == "stop", text
        jsonschema.validate(json.loads(text), PERSON)


async def test_llamacpp_json_continued_after_a_failover_stays_one_json_value(llama):
    """A stream that moved engines mid-answer: the new engine's grammar resumes after the
    half already sent (from the root it would start a second object: '["bl{} ')."""
    core = core_for(llama)
    prompt = ask('Output this JSON exactly: {"colors": ["blue", "green"]}')
    fmt = Sampling(max_tokens=40, temperature=0.0, seed=0, response_format=ResponseFormat("json_object"))
    half = '{"colors": ["bl'
    text, finish = [], None
    async with aclosing(core.generate(MODEL, prompt, fmt, continuation=half)) as items:
        async for item in items:
            if isinstance(item, Delta):
                text.append(item.text)
            else:
                finish = item
    assert finish.reason.value == "stop", text
    assert isinstance(json.loads(half + "".join(text))["colors"], list)
    # Text the format could never have produced is refused, not fed to llama.cpp (which would abort).
    with pytest.raises(Internal, match="does not match the response format"):
        async with aclosing(core.generate(MODEL, prompt, fmt, continuation="plain words")) as items:
            async for _ in items:
                pass


async def test_llamacpp_refuses_a_schema_it_cannot_express(llama):
    with pytest.raises(InvalidArgument) as info:  # the converter's refusal
        await run(core_for(llama), MODEL, ask("x"), Sampling(max_tokens=5, response_format=ResponseFormat(
            "json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "string",
                                                                              "pattern": "no anchors"}}}))))
    assert info.value.param == "response_format.json_schema.schema"
    with pytest.raises(InvalidArgument) as info:  # the schema bounds', naming the field
        await run(core_for(llama), MODEL, ask("x"), Sampling(max_tokens=5, response_format=ResponseFormat(
            "json_schema", json.dumps({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}))))
    assert info.value.param == "response_format.json_schema.schema.properties.a.$ref"


def schema_params(schema: str, max_new_tokens: int = 24) -> DecodeParams:
    return DecodeParams(max_new_tokens=max_new_tokens, temperature=0.0, top_p=1.0, seed=0,
                        response_format=ResponseFormat("json_schema", schema))


async def straight(backend, schema: str) -> str:
    """A request straight to the backend, past the engine core's checks (as a caller of
    the backend's own API would)."""
    tokens = backend.tokenize(ask("Answer in JSON."))
    async with aclosing(backend.stream(tokens, schema_params(schema))) as pieces:
        return "".join([p async for p in pieces])


@pytest.mark.parametrize("schema, param", [
    ('{"type":"string","maxLength":100000}', "maxLength"),  # 36 bytes: SIGSEGV in llama.cpp's parser before
    ('{"type":"array","items":{"type":"integer"},"minItems":10000000}', "minItems"),  # a 180 MB grammar before
])
async def test_llamacpp_refuses_what_would_crash_it_and_serves_on(llama, schema, param):
    with pytest.raises(InvalidArgument) as info:  # through the engine core
        await run(core_for(llama), MODEL, ask("x"), Sampling(max_tokens=5, response_format=ResponseFormat(
            "json_schema", schema)))
    assert info.value.param == f"response_format.json_schema.schema.{param}"
    with pytest.raises(InvalidArgument) as info:  # and straight to the backend
        await straight(llama, schema)
    assert info.value.param == f"response_format.json_schema.schema.{param}"
    text = await straight(llama, json.dumps(PERSON))
    assert text.startswith("{"), text


async def test_llamacpp_serves_schemas_at_the_bounds(llama):
    """Each repetition bound at its limit converts, parses and constrains decoding."""
    at_limits = {"type": "object", "required": ["tags", "code", "note"], "properties": {
        "tags": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": LIMITS.max_items},
        "code": {"type": "string", "pattern": f"^[a-z]{{1,{LIMITS.max_pattern_repeat}}}$"},
        "note": {"type": "string", "maxLength": LIMITS.max_length},
        "kind": {"enum": [f"k{i}" for i in range(LIMITS.max_enum - 8)]}}}
    text = await straight(llama, json.dumps(at_limits))
    assert text.startswith('{ "tags"') or text.startswith('{"tags"'), text


async def test_no_schema_of_the_hostile_set_crashes_or_stalls_llamacpp(llama):
    """Issue 26 on llama.cpp, as tests/component/test_vllm_real.py does on vLLM: every hostile schema
    of bench.hostile_schemas (up to 64 KB: each keyword's limit just under, at and just over it, the
    widest and deepest shapes, odd values), as a response_format and as a required tool's parameters,
    through the engine core: over a bound it is INVALID_ARGUMENT naming the keyword; within them it
    converts, llama.cpp parses it and it constrains two tokens (or llama.cpp's parser refuses it,
    INVALID_ARGUMENT), each within 30 s; the engine serves a plain request after."""
    from bench.hostile_schemas import cases
    from llmesh.schema_bounds import check_schema
    from llmesh.types import Tool, Tools

    core, counts = core_for(llama), {"constrained": 0, "over_a_bound": 0, "refused_by_parser": 0}
    for _, name, body in cases(LIMITS.max_bytes, MODEL):
        function = body["tools"][0]["function"] if "tools" in body else None
        text = json.dumps(function["parameters"] if function else body["response_format"]["json_schema"]["schema"])
        try:
            check_schema(text, "schema")
            within = True
        except InvalidArgument:
            within = False
        tools = Tools((Tool(function["name"], "", text),), "required") if function else None
        sampling = Sampling(max_tokens=2, temperature=0.0,
                            response_format=None if function else ResponseFormat("json_schema", text))
        try:
            await asyncio.wait_for(answered(core, MODEL, ask("Answer in JSON."), sampling, tools=tools), timeout=30)
            assert within, name  # nothing over a bound reaches llama.cpp
            counts["constrained"] += 1
        except InvalidArgument as exc:
            counts["over_a_bound" if not within else "refused_by_parser"] += 1
            assert within or exc.param, (name, str(exc))
    print(f"\nhostile schemas on llama.cpp: {counts}")
    assert counts["constrained"] > 0 and counts["over_a_bound"] > 0
    assert (await run(core, MODEL, ask("Say hi."), Sampling(max_tokens=3, temperature=0.0)))[0]


async def test_llamacpp_refuses_a_grammar_its_parser_refuses(llama):
    """Left recursion passes the bounds; llama.cpp's parser refuses it, on the worker: INVALID_ARGUMENT."""
    left = {"type": "object", "properties": {"v": {"$ref": "#/$defs/l"}},
            "$defs": {"l": {"anyOf": [{"$ref": "#/$defs/l"}, {"type": "null"}]}}}
    with pytest.raises(InvalidArgument, match="left recursion") as info:
        await straight(llama, json.dumps(left))
    assert info.value.param == "response_format.json_schema.schema"
    assert (await straight(llama, json.dumps(PERSON))).startswith("{")


async def test_sim_reports_its_uniform_logprobs_and_refuses_response_format():
    sim = SimBackend("sim-lp", 512, SimProfile(decode_ms_base=1.0, output_tokens=5))
    try:
        core = core_for(sim)
        text, lps, finish = await run(core, "sim-lp", Prompt(text="a b c"), Sampling(max_tokens=5, logprobs=2))
        assert len(lps) == 5 and "".join(t.token for t in lps) == text
        assert all(t.logprob == pytest.approx(-math.log(16)) and len(t.top) == 2 for t in lps)
        with pytest.raises(InvalidArgument) as info:
            await run(core, "sim-lp", Prompt(text="a"), Sampling(response_format=ResponseFormat("json_object")))
        assert info.value.param == "response_format"
    finally:
        await sim.close()
