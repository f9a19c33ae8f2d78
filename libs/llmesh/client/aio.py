"""The asyncio client: ``AsyncClient(address)``, the same calls as ``Client``, awaited."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from typing import Any

import grpc
from google.protobuf.message import Message

from llmesh.client.core import (CallMetadata, Deadline, Response, Result, RetryPolicy, Timeout, as_dict,
                                ClientBase)
from llmesh.client.errors import from_rpc_error


class AsyncStream:
    """The answer's messages (ChatResponse or CompleteResponse, each with its choice's
    ``index``) as they arrive: ``async for``. ``aclose()``,
    leaving its ``async with`` block or cancelling the task that reads it cancels the RPC."""

    def __init__(self, rpc: Callable[..., Any], request: Message, metadata: tuple[tuple[str, str], ...],
                 deadline: Deadline, policy: RetryPolicy):
        self._rpc, self._request, self._metadata = rpc, request, metadata
        self._deadline, self._policy = deadline, policy
        self._call: Any = None  # the current attempt's call
        self.attempts = 0
        self._messages = self._run()

    async def _run(self) -> AsyncGenerator[Response, None]:
        yielded = False
        while True:
            self.attempts += 1
            self._call = self._rpc(self._request, timeout=self._deadline.remaining(), metadata=self._metadata)
            try:
                async for message in self._call:
                    yielded = True
                    yield message
                return
            except grpc.aio.AioRpcError as exc:
                delay = None if yielded else self._policy.delay(exc.code(), self.attempts, self._deadline)
                if delay is None:
                    raise from_rpc_error(exc) from None
            finally:
                self._call.cancel()  # a no-op once the call has ended
            await asyncio.sleep(delay)

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Response:
        return await self._messages.__anext__()

    async def aclose(self) -> None:
        await self._messages.aclose()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def initial_metadata(self) -> dict[str, str]:
        return as_dict(await self._call.initial_metadata()) if self._call else {}

    async def trailing_metadata(self) -> dict[str, str]:
        return as_dict(await self._call.trailing_metadata()) if self._call else {}


class AsyncClient(ClientBase):
    """The asyncio twin of ``llmesh.client.Client`` (same arguments); create it inside a running loop."""

    _grpc = grpc.aio

    def _start(self, method: str, request: Message | None, timeout_s: Timeout, metadata: CallMetadata,
               fields: dict[str, Any]) -> AsyncStream:
        return AsyncStream(*self._call_parts(method, request, timeout_s, metadata, fields))

    @staticmethod
    async def _collect(stream: AsyncStream) -> Result:
        async with stream:
            result = Result(responses=[m async for m in stream])
            result.initial_metadata = await stream.initial_metadata()
            result.trailing_metadata = await stream.trailing_metadata()
        return result

    def stream(self, request: Message | None = None, /, *, timeout_s: Timeout = ..., metadata: CallMetadata = None,
               **fields: Any) -> AsyncStream:
        """Start a chat (see ``Client.stream``); iterate the result with ``async for``."""
        return self._start("Chat", request, timeout_s, metadata, fields)

    async def chat(self, request: Message | None = None, /, *, timeout_s: Timeout = ..., metadata: CallMetadata = None,
                   **fields: Any) -> Result:
        return await self._collect(self.stream(request, timeout_s=timeout_s, metadata=metadata, **fields))

    def stream_complete(self, request: Message | None = None, /, *, timeout_s: Timeout = ...,
                        metadata: CallMetadata = None, **fields: Any) -> AsyncStream:
        """Start a text completion (see ``Client.stream_complete``); iterate it with ``async for``."""
        return self._start("Complete", request, timeout_s, metadata, fields)

    async def complete(self, request: Message | None = None, /, *, timeout_s: Timeout = ...,
                       metadata: CallMetadata = None, **fields: Any) -> Result:
        return await self._collect(self.stream_complete(request, timeout_s=timeout_s, metadata=metadata, **fields))

    async def list_models(self, *, timeout_s: Timeout = ...,
                          metadata: CallMetadata = None) -> list[str]:
        return list((await self._unary("ListModels", None, timeout_s, metadata, {})).models)

    async def embed(self, request: Message | None = None, /, *, timeout_s: Timeout = ...,
                    metadata: CallMetadata = None, **fields: Any) -> Any:
        """Vectors for texts: a GatewayEmbedResponse; ``fields`` are GatewayEmbedRequest fields."""
        return await self._unary("Embed", request, timeout_s, metadata, fields)

    async def _unary(self, method: str, request: Message | None, timeout_s: Timeout, metadata: CallMetadata,
                     fields: dict[str, Any]) -> Any:
        rpc, message, call_md, deadline = self._unary_parts(method, request, timeout_s, metadata, fields)
        attempts = 0
        while True:
            attempts += 1
            try:
                return await rpc(message, timeout=deadline.remaining(), metadata=call_md)
            except grpc.aio.AioRpcError as exc:
                delay = self._retry.delay(exc.code(), attempts, deadline)
                if delay is None:
                    raise from_rpc_error(exc) from None
            await asyncio.sleep(delay)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
