"""The one server interceptor: binds the request id to the logs, checks the caller's
identity against the method's policy (``llmesh.rpc.identity``, which sets ``caller``)
and turns domain errors into gRPC status codes. Servicers raise; they never call
context.abort."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from llmesh.errors import InvalidArgument, domain_error
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Tracer

from llmesh.logs import request_id_var
from llmesh.request_id import accept, new_request_id
from llmesh.rpc.identity import Identity, caller
from llmesh.telemetry import bind_trace_id, extract
from llmesh.rpc.status import grpc_code, trailing_metadata

log = logging.getLogger("llmesh.rpc")

REQUEST_ID_KEY = "x-request-id"

Context = grpc.aio.ServicerContext[Any, Any]
Metadata = tuple[tuple[str, str | bytes], ...]
Unparsed = Callable[[str, Context, InvalidArgument], None]  # (method, context, why): a request not parsed


def _request_id(context: Context) -> str:
    """The caller's x-request-id when it is a safe one (``llmesh.request_id``), else a new one."""
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY and isinstance(value, str):  # a -bin key's value is bytes
            return accept(value)[0]
    return new_request_id()


def _merged(already: Iterable[tuple[str, str | bytes]] | None, error: Metadata) -> Metadata:
    """What the servicer set before the error (x-request-id, ...) plus the error's own
    trailers; a key the error sets is the error's."""
    ours = {key for key, _ in error}
    return (*((k, v) for k, v in already or () if k not in ours), *error)


async def _abort(context: Context, exc: BaseException, method: str) -> None:
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    err = domain_error(exc)
    if err is not None:
        if err is not exc:  # a RecursionError: said without its traceback
            log.warning("request nested too deeply", extra={"method": method, "error": type(exc).__name__})
        context.set_trailing_metadata(_merged(context.trailing_metadata(), trailing_metadata(err)))
        await context.abort(grpc_code(err), err.message)
    log.exception("unhandled error", extra={"method": method})
    await context.abort(grpc.StatusCode.INTERNAL, "internal error")


def _text(metadata: Iterable[tuple[str, str | bytes]] | None) -> list[tuple[str, str]] | None:
    """The text entries (trace context is text; -bin keys carry bytes)."""
    return None if metadata is None else [(k, v) for k, v in metadata if isinstance(v, str)]


def _parser(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    """Requests are parsed inside the call, so malformed bytes are INVALID_ARGUMENT
    (grpc.aio answers UNKNOWN, naming the exception, when its deserializer raises)."""
    if deserialize is None:
        return lambda raw: raw

    def parse(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except DecodeError as exc:
            raise InvalidArgument(f"The request is not a valid protobuf message: {exc}") from None
    return parse


async def _parsed(raw_iterator: AsyncIterator[bytes], parse: Callable[[bytes], Any]) -> AsyncIterator[Any]:
    async for raw in raw_iterator:
        yield parse(raw)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Also opens the server span of each call, child of the caller's (W3C trace
    context in the metadata), current while the handler runs."""

    def __init__(self, tracer: Tracer | None = None, identity: Identity | None = None,
                 unparsed: Mapping[str, Unparsed] | None = None):
        """``unparsed``: per service name, who is told of a call whose request bytes were not
        its method's message (the gateway keeps a record of every request)."""
        self._tracer = tracer or trace.NoOpTracer()
        self._identity = identity
        self._unparsed = dict(unparsed or {})

    def _span(self, context: Context, method: str) -> Span:
        parent = extract(_text(context.invocation_metadata()))
        span = self._tracer.start_span(method.lstrip("/"), context=parent, kind=SpanKind.SERVER,
                                       attributes={"rpc.system": "grpc", "rpc.method": method})
        bind_trace_id(span)
        return span

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        span_for = self._span
        parse = _parser(handler.request_deserializer)
        streamed_requests = bool(handler.stream_unary or handler.stream_stream)
        identity = self._identity

        def authorize(context: Context) -> None:
            # The handler runs in this task's context: the servicer reads the caller from it.
            if identity:
                caller.set(identity.authenticate(method, context))

        told = self._unparsed.get(method.lstrip("/").rsplit("/", 1)[0])

        def request(raw: Any, context: Context) -> Any:
            if streamed_requests:
                return _parsed(raw, parse)
            try:
                return parse(raw)
            except InvalidArgument as exc:
                if told is not None:
                    told(method, context, exc)
                raise

        def unary(inner: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:  # one response
            async def call(request_or_iterator: Any, context: Context) -> Any:
                request_id_var.set(_request_id(context))
                with trace.use_span(span_for(context, method), end_on_exit=True):
                    try:
                        authorize(context)
                        return await inner(request(request_or_iterator, context), context)
                    except Exception as exc:  # noqa: BLE001 - mapped to a status below
                        await _abort(context, exc, method)
            return call

        def streaming(inner: Callable[..., Any]) -> Callable[..., AsyncIterator[Any]]:  # a response stream
            async def call(request_or_iterator: Any, context: Context) -> AsyncIterator[Any]:
                request_id_var.set(_request_id(context))
                with trace.use_span(span_for(context, method), end_on_exit=True):
                    try:
                        authorize(context)
                        async for item in inner(request(request_or_iterator, context), context):
                            yield item
                    except Exception as exc:  # noqa: BLE001
                        await _abort(context, exc, method)
            return call

        codec = (None, handler.response_serializer)  # requests arrive as bytes, parsed by request()
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), *codec)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), *codec)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream), *codec)
        assert handler.stream_stream is not None  # the one kind left
        return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), *codec)
