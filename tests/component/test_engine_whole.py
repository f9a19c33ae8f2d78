"""A non-streamed request needs no per-token stream: with ``GenerateRequest.whole`` a
real sim engine (served in-process over gRPC) answers in one message carrying the
text, token count, logprobs, finish and usage; without it, the same answer streams.
The gateway's engine client reads either as the same Deltas and Finish."""

from __future__ import annotations

from dataclasses import replace

from llmesh.rpc.channels import mesh_channel
from llmesh.types import Delta, Finish
from llmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from llmesh.gateway.upstream.engines import EngineClients
from opentelemetry.trace import INVALID_SPAN
from tests.component.helpers import completion_request

MODEL = "sim-whole"


async def test_whole_answers_in_one_message_with_the_streamed_text(engines):
    address = (await engines("w", MODEL, sim_output_tokens=64)).address
    req = engine_pb2.GenerateRequest(model=MODEL, prompt="once upon a time",
                                     sampling=common_pb2.SamplingParams(max_tokens=12, temperature=0.7, seed=1,
                                                                        logprobs=1))
    async with mesh_channel(address, "engine") as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        streamed = [r async for r in stub.Generate(req, timeout=10)]
        req.whole = True
        whole = [r async for r in stub.Generate(req, timeout=10)]
    assert len(streamed) > 2 and len(whole) == 1
    # cut at max_tokens: the last text goes out with the finish, no message without text
    assert streamed[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert all(r.text and r.token_count for r in streamed) and sum(r.token_count for r in streamed) == 12
    one = whole[0]
    assert one.text == "".join(r.text for r in streamed) and one.token_count == 12
    assert [t.token for t in one.logprobs] == [t.token for r in streamed for t in r.logprobs]
    assert one.finish_reason == streamed[-1].finish_reason and one.usage == streamed[-1].usage

    clients = EngineClients()
    ours = completion_request(MODEL, "hello", max_tokens=8, temperature=0.7, seed=2)
    try:
        as_stream = [i async for i in clients.generate(address, ours, 10, INVALID_SPAN)]
        at_once = [i async for i in clients.generate(address, replace(ours, stream=False), 10, INVALID_SPAN)]
    finally:
        await clients.close()
    assert [type(i) for i in at_once] == [Delta, Finish]
    assert at_once[0].text == "".join(i.text for i in as_stream if isinstance(i, Delta))
    assert at_once[0].tokens == 8 and at_once[1] == as_stream[-1]
