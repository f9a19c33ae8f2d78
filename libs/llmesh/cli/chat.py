"""``llmesh chat``: stream one answer from the gateway's gRPC API to the terminal."""

from __future__ import annotations

import sys

import grpc

from llmesh.rpc.channels import insecure_channel
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc


async def chat(address: str, model: str, prompt: str, max_tokens: int | None,
               temperature: float | None) -> int:
    sampling = common_pb2.SamplingParams()
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    if temperature is not None:
        sampling.temperature = temperature
    request = gateway_pb2.ChatRequest(model=model, sampling=sampling,
                                      messages=[common_pb2.ChatMessage(role="user", content=prompt)])
    async with insecure_channel(address) as channel:
        try:
            async for chunk in gateway_pb2_grpc.GatewayStub(channel).Chat(request):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.finish_reason:
                    u = chunk.usage
                    print(f"\n[{common_pb2.FinishReason.Name(chunk.finish_reason)}; "
                          f"{u.prompt_tokens} prompt + {u.completion_tokens} completion tokens]",
                          file=sys.stderr)
        except grpc.aio.AioRpcError as exc:
            print(f"\nllmesh chat: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0
