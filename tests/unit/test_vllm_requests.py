"""The vllm backend's request and output conversions without vLLM (vllm_requests): vLLM's
per-position logprobs ({token id: Logprob}, the chosen token and the ranked best) into the
engine's TokenLogprob, and the refusals. The same conversions run on vLLM's real engine in
tests/component/test_vllm_real_engine.py; here vLLM's shapes are written out as data."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from llmesh.errors import Internal, InvalidArgument
from llmesh.types import ResponseFormat, TokenLogprob
from llmesh.engine.backends.base import DecodeParams, Token
from llmesh.engine.backends.vllm_requests import pieces, sampling_params, token_logprob


@dataclass
class Logprob:  # the fields of vllm.logprobs.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def test_the_chosen_token_outside_the_top_is_reported_with_the_top_best_first():
    position = {7: Logprob(-3.0, 5, " cat"), 1: Logprob(-0.5, 1, " dog"), 2: Logprob(-1.5, 2, " fox")}
    assert token_logprob(7, position, 2) == TokenLogprob(" cat", -3.0, ((" dog", -0.5), (" fox", -1.5)))
    assert token_logprob(1, position, 1) == TokenLogprob(" dog", -0.5, ((" dog", -0.5),))
    assert token_logprob(7, {7: Logprob(-3.0, 5, " cat")}, 0) == TokenLogprob(" cat", -3.0, ())
    with pytest.raises(Internal, match="no log probability"):
        token_logprob(9, position, 2)


def test_one_piece_per_token_with_the_deltas_text_on_the_first():
    completion = SimpleNamespace(text="Hello there", token_ids=[5, 6], logprobs=[
        {5: Logprob(-0.1, 1, "Hello")}, {6: Logprob(-0.2, 1, " there")}])
    assert pieces(completion, None) == ["Hello there", ""]
    assert pieces(completion, 0) == [Token("Hello there", TokenLogprob("Hello", -0.1)),
                                     Token("", TokenLogprob(" there", -0.2))]
    with pytest.raises(Internal, match="without the log probabilities"):
        pieces(SimpleNamespace(text="x", token_ids=[5], logprobs=None), 1)


def test_a_constrained_answer_cannot_be_continued_on_vllm():
    api = SimpleNamespace(SamplingParams=dict, RequestOutputKind=SimpleNamespace(DELTA="delta"),
                          StructuredOutputsParams=dict)
    params = DecodeParams(8, 0.0, 1.0, 0, logprobs=3, response_format=ResponseFormat("json_object"))
    made = sampling_params(api, params)
    assert made["logprobs"] == 3 and made["structured_outputs"] == {"json_object": True}
    with pytest.raises(InvalidArgument, match="cannot continue an answer constrained") as err:
        sampling_params(api, DecodeParams(8, 0.0, 1.0, 0, response_format=ResponseFormat("json_object"),
                                          continued_tokens=3))
    assert err.value.param == "continuation"


def test_only_the_knobs_turned_on_reach_sampling_params():
    api = SimpleNamespace(SamplingParams=dict, RequestOutputKind=SimpleNamespace(DELTA="delta"),
                          StructuredOutputsParams=dict)
    plain = sampling_params(api, DecodeParams(8, 0.7, 0.9, 1))
    assert not {"top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"} & set(plain)
    made = sampling_params(api, DecodeParams(8, 0.7, 0.9, 1, top_k=5, min_p=0.1, repetition_penalty=1.3,
                                             presence_penalty=-1.0, frequency_penalty=0.5))
    assert (made["top_k"], made["min_p"], made["repetition_penalty"], made["presence_penalty"],
            made["frequency_penalty"]) == (5, 0.1, 1.3, -1.0, 0.5)


def test_tools_are_constrained_by_their_structural_tag_with_special_tokens_kept():
    api = SimpleNamespace(SamplingParams=dict, RequestOutputKind=SimpleNamespace(DELTA="delta"),
                          StructuredOutputsParams=dict)
    made = sampling_params(api, DecodeParams(8, 0.0, 1.0, 0), tool_tag='{"type": "structural_tag"}')
    assert made["structured_outputs"] == {"structural_tag": '{"type": "structural_tag"}'}
    assert made["skip_special_tokens"] is False
    assert sampling_params(api, DecodeParams(8, 0.0, 1.0, 0))["skip_special_tokens"] is True
