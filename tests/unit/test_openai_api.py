import orjson
import pytest

from llmesh.errors import InvalidArgument
from llmesh.types import FinishReason, Message, Usage
from llmesh.validation import check_request
from llmesh.gateway.fronts.openai_api import CHAT, TEXT, ChatBody, ChunkWriter, CompletionBody, parse


def chat(**fields) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    body.update(fields)
    return orjson.dumps(body)


def test_chat_body_maps_to_domain():
    body = parse(ChatBody, chat(max_tokens=5, temperature=0.5, top_p=0.5, stop="x", seed=3,
                                messages=[{"role": "developer", "content": "be brief"},
                                          {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                       {"type": "text", "text": "b"}]}]))
    assert body.prompt().messages == (Message("system", "be brief"), Message("user", "ab"))
    s = body.sampling_params()
    assert (s.max_tokens, s.temperature, s.top_p, s.stop, s.seed) == (5, 0.5, 0.5, ("x",), 3)


def test_max_completion_tokens_wins_over_max_tokens():
    assert parse(ChatBody, chat(max_tokens=5, max_completion_tokens=9)).sampling_params().max_tokens == 9


def test_completions_default_to_16_tokens_like_openai():
    body = parse(CompletionBody, orjson.dumps({"model": "m", "prompt": "once"}))
    assert body.sampling_params().max_tokens == 16
    assert body.prompt_value().text == "once"


@pytest.mark.parametrize("raw, param", [
    (b"", None),
    (b"{not json", None),
    (orjson.dumps({"messages": []}), "model"),
    (chat(temperature="hot"), "temperature"),
    (chat(messages="hi"), "messages"),
])
def test_bad_bodies_are_invalid_arguments_naming_the_field(raw, param):
    with pytest.raises(InvalidArgument) as info:
        parse(ChatBody, raw)
    assert info.value.param == param
    assert info.value.message


@pytest.mark.parametrize("fields, param", [
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
])
def test_value_rules_name_the_field(fields, param):
    body = parse(ChatBody, chat(**fields))
    with pytest.raises(InvalidArgument) as info:
        check_request(body.model, body.prompt(), body.sampling_params(), user=body.user)
    assert info.value.param == param


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_is_rejected(n):
    with pytest.raises(InvalidArgument) as info:
        parse(ChatBody, chat(n=n)).choices
    assert info.value.param == "n"


def test_n_counts_choices():
    assert parse(ChatBody, chat(n=3)).choices == 3
    assert parse(ChatBody, chat()).choices == 1


def test_chunks_follow_openai_stream_shape():
    w = ChunkWriter(CHAT, "rid", "m", include_usage=True)
    assert w.role()["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    d = w.delta("hey")
    assert d["object"] == "chat.completion.chunk" and d["usage"] is None
    assert d["choices"][0]["delta"] == {"content": "hey"}
    assert w.finish(FinishReason.LENGTH)["choices"][0]["finish_reason"] == "length"
    u = w.usage(Usage(3, 4))
    assert u["choices"] == [] and u["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    text = ChunkWriter(TEXT, "rid", "m", include_usage=False)
    assert text.role() is None and text.usage(Usage(1, 1)) is None
    assert text.delta("x")["choices"][0]["text"] == "x" and "usage" not in text.delta("x")


def test_pre_encoded_delta_events_are_the_dicts_encoded():
    for shape in (CHAT, TEXT):
        for usage in (True, False):
            w = ChunkWriter(shape, "rid", 'm"odel', include_usage=usage)
            for text in ("hey", "", 'é\n"\\', "\x00"):
                for index in (0, 2):
                    assert w.delta_sse(text, index) == b"data: " + orjson.dumps(w.delta(text, index)) + b"\n\n"
