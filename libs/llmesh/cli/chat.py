"""``llmesh chat``: stream one answer from the gateway's gRPC API to the terminal, with llmesh.client."""

from __future__ import annotations

import sys

from llmesh.client import AsyncClient, GatewayError
from llmesh.rpc.channels import CHANNEL_OPTIONS
from llmesh.v1 import common_pb2


async def chat(address: str, model: str, prompt: str, max_tokens: int | None,
               temperature: float | None, credential: str | None = None) -> int:
    # No deadline: the answer streams until the model stops or the user interrupts.
    async with AsyncClient(address, credential=credential, timeout_s=None, options=CHANNEL_OPTIONS) as client:
        try:
            async for chunk in client.stream(model=model, messages=[{"role": "user", "content": prompt}],
                                             max_tokens=max_tokens, temperature=temperature):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.finish_reason:
                    u = chunk.usage
                    print(f"\n[{common_pb2.FinishReason.Name(chunk.finish_reason)}; "
                          f"{u.prompt_tokens} prompt + {u.completion_tokens} completion tokens]",
                          file=sys.stderr)
        except GatewayError as exc:
            print(f"\nllmesh chat: {exc.code.name}: {exc.message}", file=sys.stderr)
            return 1
    return 0
