"""The blocking client: ``Client(address).chat(...)``, ``.stream(...)``, ``.complete(...)``,
``.stream_complete(...)``, ``.list_models()``, ``.embed(...)``."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from typing import Any

import grpc
from google.protobuf.message import Message

from llmesh.client.core import (CallMetadata, Deadline, Response, Result, RetryPolicy, Timeout, as_dict,
                                ClientBase)
from llmesh.client.errors import from_rpc_error


class Stream:
    """The answer's messages (ChatResponse or CompleteResponse) as they arrive; with
    n > 1 the choices' messages interleave, each with its ``index``. Iterate it;
    ``close()`` (or leaving its ``with`` block) cancels the RPC."""

    def __init__(self, rpc: Callable[..., Any], request: Message, metadata: tuple[tuple[str, str], ...],
                 deadline: Deadline, policy: RetryPolicy):
        self._rpc, self._request, self._metadata = rpc, request, metadata
        self._deadline, self._policy = deadline, policy
        self._call: Any = None  # the current attempt's call
        self.attempts = 0  # RPCs started: more than 1 only after UNAVAILABLE before the first message
        self._messages = self._run()

    def _run(self) -> Generator[Response, None, None]:
        yielded = False
        while True:
            self.attempts += 1
            self._call = self._rpc(self._request, timeout=self._deadline.remaining(), metadata=self._metadata)
            try:
                for message in self._call:
                    yielded = True
                    yield message
                return
            except grpc.RpcError as exc:
                delay = None if yielded else self._policy.delay(exc.code(), self.attempts, self._deadline)
                if delay is None:
                    raise from_rpc_error(exc) from None
            finally:
                self._call.cancel()  # a no-op once the call has ended
            time.sleep(delay)

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Response:
        return next(self._messages)

    def close(self) -> None:
        self._messages.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def initial_metadata(self) -> dict[str, str]:
        return as_dict(self._call.initial_metadata()) if self._call else {}

    def trailing_metadata(self) -> dict[str, str]:
        return as_dict(self._call.trailing_metadata()) if self._call else {}


class Client(ClientBase):
    """A blocking client for the gateway's gRPC API.

    ``credential`` is an API key or a JWT, sent as ``authorization: Bearer ...``;
    ``tls`` is False (plaintext), True (system roots) or ``grpc.ChannelCredentials``;
    ``timeout_s`` is the default deadline of each call (all its attempts together).
    """

    _grpc = grpc

    def _start(self, method: str, request: Message | None, timeout_s: Timeout, metadata: CallMetadata,
               fields: dict[str, Any]) -> Stream:
        return Stream(*self._call_parts(method, request, timeout_s, metadata, fields))

    @staticmethod
    def _collect(stream: Stream) -> Result:
        with stream:
            result = Result(responses=list(stream))
            result.initial_metadata = stream.initial_metadata()
            result.trailing_metadata = stream.trailing_metadata()
        return result

    def stream(self, request: Message | None = None, /, *, timeout_s: Timeout = ..., metadata: CallMetadata = None,
               **fields: Any) -> Stream:
        """Start a chat; ``fields`` are ChatRequest fields (``model``, ``messages`` as dicts,
        ``n``, ``tools``) or sampling fields (``max_tokens``, ``temperature``, ...), merged onto ``request``."""
        return self._start("Chat", request, timeout_s, metadata, fields)

    def chat(self, request: Message | None = None, /, *, timeout_s: Timeout = ..., metadata: CallMetadata = None,
             **fields: Any) -> Result:
        """The whole answer: every streamed message collected by choice, with the call's metadata."""
        return self._collect(self.stream(request, timeout_s=timeout_s, metadata=metadata, **fields))

    def stream_complete(self, request: Message | None = None, /, *, timeout_s: Timeout = ...,
                        metadata: CallMetadata = None, **fields: Any) -> Stream:
        """Start a text completion of a raw prompt; ``fields`` are CompleteRequest fields
        (``model``, ``prompt``, ``n``) or sampling fields, merged onto ``request``."""
        return self._start("Complete", request, timeout_s, metadata, fields)

    def complete(self, request: Message | None = None, /, *, timeout_s: Timeout = ..., metadata: CallMetadata = None,
                 **fields: Any) -> Result:
        """The whole text completion, collected by choice, with the call's metadata."""
        return self._collect(self.stream_complete(request, timeout_s=timeout_s, metadata=metadata, **fields))

    def list_models(self, *, timeout_s: Timeout = ..., metadata: CallMetadata = None) -> list[str]:
        """The models this caller may use."""
        return list(self._unary("ListModels", None, timeout_s, metadata, {}).models)

    def embed(self, request: Message | None = None, /, *, timeout_s: Timeout = ..., metadata: CallMetadata = None,
              **fields: Any) -> Any:
        """Vectors for texts: a GatewayEmbedResponse (``embeddings[i].values``, ``usage``); ``fields``
        are GatewayEmbedRequest fields (``model``, ``inputs``, ``dimensions``), merged onto ``request``."""
        return self._unary("Embed", request, timeout_s, metadata, fields)

    def _unary(self, method: str, request: Message | None, timeout_s: Timeout, metadata: CallMetadata,
               fields: dict[str, Any]) -> Any:
        """One unary call, tried again after UNAVAILABLE as the retry policy allows."""
        rpc, message, call_md, deadline = self._unary_parts(method, request, timeout_s, metadata, fields)
        attempts = 0
        while True:
            attempts += 1
            try:
                return rpc(message, timeout=deadline.remaining(), metadata=call_md)
            except grpc.RpcError as exc:
                delay = self._retry.delay(exc.code(), attempts, deadline)
                if delay is None:
                    raise from_rpc_error(exc) from None
            time.sleep(delay)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
