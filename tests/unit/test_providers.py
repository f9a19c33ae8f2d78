"""The provider adapter's pure parts: our request in OpenAI's wire format, their
errors as ours, their key from the environment or a file."""

import json
from dataclasses import replace

import pytest

from llmesh.errors import InvalidArgument, Overloaded, Unavailable
from llmesh.liveconfig.schema import Provider
from llmesh.types import Message, Prompt, ResponseFormat, Sampling
from llmesh.gateway.context import CompletionRequest
from llmesh.gateway.upstream.provider_secrets import ProviderSecrets
from llmesh.gateway.upstream.providers import _Events, error_for_status, request_body


def req(prompt: Prompt, **sampling) -> CompletionRequest:
    return CompletionRequest("r", "t", "ours", prompt, Sampling(**sampling), 5.0)


def test_chat_body_uses_their_model_name_and_streams_with_usage():
    path, body = request_body(req(Prompt(messages=(Message("user", "hi"),)), max_tokens=3, temperature=0.0,
                                  stop=("x",), logprobs=2,
                                  response_format=ResponseFormat("json_schema", json.dumps({"type": "object"}))),
                              "gpt-x")
    assert path == "/chat/completions"
    assert body["model"] == "gpt-x" and body["stream"] and body["stream_options"] == {"include_usage": True}
    assert (body["max_tokens"], body["temperature"], body["stop"]) == (3, 0.0, ["x"])
    assert (body["logprobs"], body["top_logprobs"]) == (True, 2)
    assert body["response_format"]["json_schema"]["schema"] == {"type": "object"}
    path, body = request_body(req(Prompt(text="once"), logprobs=1), "m")
    assert path == "/completions" and body["prompt"] == "once" and body["logprobs"] == 1


def test_the_knobs_turned_on_go_to_the_provider_and_off_ones_do_not():
    _, body = request_body(req(Prompt(text="once"), presence_penalty=0.5, frequency_penalty=0.0, top_k=-1,
                               repetition_penalty=1.2), "m")
    assert body["presence_penalty"] == 0.5 and body["repetition_penalty"] == 1.2
    assert "frequency_penalty" not in body and "top_k" not in body and "min_p" not in body


def test_a_client_that_takes_the_answer_at_once_asks_for_it_unstreamed():
    _, body = request_body(replace(req(Prompt(messages=(Message("user", "hi"),)), max_tokens=3), stream=False), "m")
    assert "stream" not in body and "stream_options" not in body and body["max_tokens"] == 3


@pytest.mark.parametrize("status, cls, reason", [
    (429, Overloaded, "provider_rate_limited"), (401, Unavailable, "provider_auth"),
    (400, InvalidArgument, "provider_rejected"), (503, Unavailable, "provider_error"),
])
def test_their_errors_map_to_ours(status, cls, reason):
    exc = error_for_status(status, b'{"error": {"message": "nope"}}')
    assert isinstance(exc, cls) and exc.reason == reason and "nope" in exc.message


def test_key_from_env_or_file(tmp_path, monkeypatch):
    secrets = ProviderSecrets.of(tmp_path, ["LLMESH_TEST_PROVIDER_KEY", "LLMESH_TEST_PROVIDER_UNSET"])
    api_key = secrets.api_key
    url = "https://provider.example/v1"
    monkeypatch.setenv("LLMESH_TEST_PROVIDER_KEY", "sk-env")
    assert api_key(Provider(base_url=url, models={}, api_key_env="LLMESH_TEST_PROVIDER_KEY")) == "sk-env"
    f = tmp_path / "k"
    f.write_text("sk-file\n")
    assert api_key(Provider(base_url=url, models={}, api_key_file=str(f))) == "sk-file"
    assert api_key(Provider(base_url=url, models={}, api_key_file="k")) == "sk-file"  # relative: in the key dir
    with pytest.raises(Unavailable):
        api_key(Provider(base_url=url, models={}, api_key_env="LLMESH_TEST_PROVIDER_UNSET"))
    assert api_key(Provider(base_url=url, models={})) is None


def test_tools_and_a_tool_conversation_in_their_format():
    from dataclasses import replace

    from llmesh.types import Tool, ToolCall, Tools
    from llmesh.gateway.upstream.providers import _tool_calls
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    conversation = Prompt(messages=(
        Message("user", "Weather in Paris?"),
        Message("assistant", "", tool_calls=(ToolCall(0, "call_1", "weather", '{"city":"Paris"}'),)),
        Message("tool", "sunny", tool_call_id="call_1")))
    tools = Tools(functions=(Tool("weather", "Weather in a city", json.dumps(schema), True),), choice="function",
                  function="weather", parallel=False)
    _, body = request_body(replace(req(conversation), tools=tools), "gpt-x")
    assert body["tools"] == [{"type": "function", "function": {"name": "weather", "description": "Weather in a city",
                                                               "parameters": schema, "strict": True}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert body["parallel_tool_calls"] is False
    assert body["messages"][1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Paris"}'}}]}
    assert body["messages"][2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    _, plain = request_body(replace(req(conversation), tools=Tools(choice="none")), "gpt-x")
    assert "tools" not in plain and "tool_choice" not in plain
    # their streamed pieces as ours
    assert _tool_calls({"tool_calls": [{"index": 0, "id": "c", "type": "function",
                                        "function": {"name": "weather", "arguments": ""}}]}) == (
        ToolCall(0, "c", "weather", ""),)
    assert _tool_calls({"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}) == (
        ToolCall(0, "", "", '{"ci'),)


def test_events_split_across_reads_and_after_done_ignored():
    events = _Events()
    assert events.feed(b'data: {"a": 1}\n\ndata: {"b"') == [b'{"a": 1}']
    assert events.feed(b': 2}\r\n\r\n: a comment\n\n') == [b'{"b": 2}']
    assert events.feed(b'data: [DONE]\n\ndata: {"late": 1}\n\n') == [] and events.done
