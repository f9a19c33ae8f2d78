"""The embeddings body and response on the wire (services/gateway/fronts/embeddings.py), the
request's rules (llmesh.validation.check_embed) and the guards on its inputs."""

from __future__ import annotations

import base64

import numpy as np
import orjson
import pytest

from llmesh.errors import InvalidArgument
from llmesh.liveconfig.schema import MeshConfig
from llmesh.types import FinishReason, Usage
from llmesh.validation import check_embed
from llmesh.gateway.context import Context, Vectors
from llmesh.gateway.fronts.embeddings import EmbeddingsBody, embeddings_json, embeddings_request, read_embeddings
from llmesh.gateway.stages.guards import GuardStage


def call(raw: bytes):
    return read_embeddings(EmbeddingsBody, raw)


def test_a_string_or_a_list_of_strings_and_nothing_else():
    one = call(b'{"model": "m", "input": "hello"}')
    assert one.inputs == ("hello",) and one.encoding_format == "float" and one.dimensions is None
    many = call(b'{"model": "m", "input": ["a", "b"], "encoding_format": "base64", "user": "u"}')
    assert many.inputs == ("a", "b") and many.encoding_format == "base64" and many.user == "u"
    for body, param in ((b'{"model": "m", "input": [1, 2]}', "input"),
                        (b'{"model": "m", "input": [[1], [2]]}', "input"),
                        (b'{"model": "m", "input": "x", "encoding_format": "int8"}', "encoding_format"),
                        (b'{"model": "m", "input": "x", "stream": true}', "stream"),
                        (b'{"input": "x"}', "model")):
        with pytest.raises(InvalidArgument) as caught:
            call(body)
        assert caught.value.param == param, body
    req = embeddings_request(call(b'{"model": "m", "input": ["a"], "dimensions": 8}'), "rid", 5.0,
                             credential="k")
    assert req.embeds and req.operation == "embeddings" and req.inputs == ("a",) and req.dimensions == 8
    assert req.credential == "k" and not req.stream


def test_the_rules_bound_count_and_size_and_name_the_input():
    check_embed("m", ("a",) * 2048)
    for inputs, param in (((), "input"), (("a",) * 2049, "input"), (("ok", ""), "input[1]"),
                          (("ok", "x" * 32769), "input[1]")):
        with pytest.raises(InvalidArgument) as caught:
            check_embed("m", inputs)
        assert caught.value.param == param
    with pytest.raises(InvalidArgument) as dims:
        check_embed("m", ("a",), dimensions=0)
    assert dims.value.param == "dimensions"


def test_float_and_base64_answers_carry_the_float32_values():
    vectors = [np.array([0.1, -2.5, 3e-8], dtype="<f4"), np.array([1.0, 0.0, -1.0], dtype="<f4")]
    answer = Vectors(FinishReason.STOP, Usage(prompt_tokens=7), tuple(v.tobytes() for v in vectors))
    floats = orjson.loads(embeddings_json(answer, "m", "float"))
    assert floats["object"] == "list" and floats["model"] == "m"
    assert floats["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    assert [d["index"] for d in floats["data"]] == [0, 1] and floats["data"][0]["object"] == "embedding"
    assert [np.float32(x) for x in floats["data"][0]["embedding"]] == list(vectors[0])
    b64 = orjson.loads(embeddings_json(answer, "m", "base64"))
    for d, v in zip(b64["data"], vectors):
        assert np.array_equal(np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4"), v)


async def test_inputs_are_pii_masked_and_get_no_output_filter():
    stage = GuardStage(MeshConfig)
    req = embeddings_request(call(b'{"model": "m", "input": ["mail me at jo@example.com", "plain"]}'),
                             "rid", 5.0)
    ctx = Context.of(req)
    await stage.admit(ctx)
    assert "jo@example.com" not in ctx.req.inputs[0] and ctx.req.inputs[1] == "plain"
    assert ctx.record.pii and not ctx.filters
