"""An external OpenAI-compatible provider as an upstream: llama-cpp-python's own
OpenAI-compatible server (a real, separate HTTP server with the real model) stands in
for a hosted API. The gateway pipeline falls back to it when every engine is down,
passes its stream through, maps its errors, and reads its key from a file."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from functools import partial

import pytest

from llmesh.errors import Unavailable
from llmesh.liveconfig.schema import Guards, MeshConfig, ModelPolicy, Provider, TenantPolicy
from llmesh.testing import free_ports, port_open, terminate, wait_until
from llmesh.types import Delta, Finish, Message, Prompt
from llmesh.gateway.context import CompletionRequest, Context
from llmesh.gateway.pipeline import Pipeline
from llmesh.gateway.upstream.engines import EngineClients
from llmesh.gateway.upstream.picking import Endpoint, EndpointPicker
from llmesh.gateway.upstream.provider_secrets import ProviderSecrets
from llmesh.gateway.upstream.providers import ProviderClients
from llmesh.gateway.upstream.router import FALLBACK_HEADER
from tests.component.helpers import Catalog, collect, completion_request

REMOTE = "smol-remote"


@pytest.fixture(scope="module")
def openai_server(real_model_dir, tmp_path_factory):
    gguf = next((real_model_dir / "smollm2-135m-instruct").glob("*.gguf"))
    port = free_ports(1)[0]
    log = (tmp_path_factory.mktemp("provider") / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", REMOTE,
                             "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "1024", "--n_threads", "2"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        assert wait_until(lambda: port_open(port), 60), "llama_cpp.server did not start"
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        terminate(proc, 15, 15.0)
        log.close()


EVERY_MODEL = Catalog(prefix="")
request = partial(completion_request, text="What color is the sky?", timeout_s=60, max_tokens=8, temperature=0.0)


def pipeline_for(base_url: str, key_file=None) -> tuple[Pipeline, EndpointPicker, ProviderClients, list]:
    picker = EndpointPicker()
    # The self-hosted pool: its only engine is down (a closed port).
    picker.replace_all([Endpoint("e0", f"127.0.0.1:{free_ports(1)[0]}", frozenset({"pool-model"}))])
    config = MeshConfig(models={"pool-model": ModelPolicy(fallbacks=["hosted"])},
                        providers={"local": Provider(base_url=base_url, models={"hosted": REMOTE},
                                                     api_key_file=str(key_file) if key_file else None)})
    providers, records = ProviderClients(secrets=ProviderSecrets.of(key_file.parent if key_file else None, [])), []
    return (Pipeline(picker, EngineClients(), EVERY_MODEL, config=lambda: config, providers=providers,
                     observe=records.append), picker, providers, records)


async def run(pipeline: Pipeline, req: CompletionRequest) -> tuple[list[Delta], Finish, Context]:
    ctx = Context.of(req)
    answer = await collect(pipeline, req, ctx)
    return answer.deltas, answer.finish, ctx


async def test_falls_back_to_the_provider_when_every_engine_is_down(openai_server, tmp_path):
    key = tmp_path / "key"
    key.write_text("sk-local-test\n")
    pipeline, _, providers, records = pipeline_for(openai_server, key)
    try:
        deltas, finish, ctx = await run(pipeline, request("pool-model", logprobs=1))
        text = "".join(d.text for d in deltas)
        assert text and len(deltas) > 1  # streamed through, not buffered
        # This server sends no usage in streams: completion tokens are counted from its chunks.
        assert finish.usage.completion_tokens == 8 and finish.reason.value == "length"
        assert ctx.headers[FALLBACK_HEADER] == "hosted"
        assert records[-1].endpoint == "provider:local" and records[-1].fallback == "hosted"
        lps = [t for d in deltas for t in d.logprobs]
        assert lps and all(t.logprob <= 0 for t in lps)
        # The same greedy question asked of the provider directly gives the same text.
        direct, _, _ = await run(pipeline, request("hosted"))
        assert "".join(d.text for d in direct) == text
        # A client that takes the answer at once gets it from one non-streamed call: one Delta, their usage.
        whole, finish, _ = await run(pipeline, replace(request("pool-model", logprobs=1), stream=False))
        assert [d.text for d in whole] == [text] and finish.usage.completion_tokens == 8
        assert finish.usage.prompt_tokens > 0 and len(whole[0].logprobs) == 8
    finally:
        await providers.close()


async def test_an_unreachable_provider_is_unavailable():
    dead, _, providers, _ = pipeline_for(f"http://127.0.0.1:{free_ports(1)[0]}/v1")
    try:
        with pytest.raises(Unavailable) as info:
            await run(dead, request("hosted"))
        assert info.value.reason == "provider_error"
    finally:
        await providers.close()


async def test_tool_calls_pass_through_the_provider_and_the_guards(openai_server):
    """A named tool choice: llama-cpp-python's server constrains the real model to the
    function's parameters and streams the call back; the PII guards' output filters
    leave the call alone, and the tool's answer goes back in the next turn."""
    import json
    from dataclasses import replace

    from llmesh.types import Tool, Tools
    from llmesh.gateway.domain.guards.pii import PiiMasker
    from llmesh.gateway.stages.guards import GuardStage
    from llmesh.gateway.stages.route import RouteStage
    from llmesh.gateway.stages.validate import ValidateStage

    weather = {"type": "object", "required": ["city"], "additionalProperties": False,
               "properties": {"city": {"type": "string", "maxLength": 20}}}
    tools = Tools(functions=(Tool("get_weather", "The weather in a city", json.dumps(weather)),), choice="function",
                  function="get_weather")
    guarded = MeshConfig(providers={"local": Provider(base_url=openai_server, models={"hosted": REMOTE})},
                         tenants={"*": TenantPolicy(guards=Guards(output_pii="mask"))})
    assert guarded.tenant("t").guards.output_pii == "mask"  # the answer's PII is masked too
    providers = ProviderClients()
    pipeline = Pipeline(EndpointPicker(), EngineClients(), EVERY_MODEL, config=lambda: guarded, providers=providers,
                        stages=[ValidateStage(), GuardStage(lambda: guarded, PiiMasker()),
                                RouteStage(EVERY_MODEL, lambda: guarded)])
    try:
        ask = replace(completion_request("hosted", "Weather in Paris? Mail bob@example.com", request_id="t",
                                         timeout_s=60, max_tokens=40, temperature=0.0), tools=tools)
        deltas, finish, _ = await run(pipeline, ask)
        pieces = [c for d in deltas for c in d.tool_calls]
        assert finish.reason.value == "tool_calls" and pieces[0].name == "get_weather" and pieces[0].id
        args = json.loads("".join(p.arguments for p in pieces))
        assert set(args) == {"city"}
        call = replace(pieces[0], arguments=json.dumps(args))
        turn = replace(ask, tools=replace(tools, choice="none"), prompt=Prompt(messages=(
            *ask.prompt.messages, Message("assistant", "", tool_calls=(call,)),
            Message("tool", "Sunny, 21 C", tool_call_id=call.id))))
        deltas, finish, _ = await run(pipeline, turn)
        assert "".join(d.text for d in deltas) and finish.reason.value in ("stop", "length")
    finally:
        await providers.close()
