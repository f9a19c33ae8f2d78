"""A RecursionError anywhere in a call's handling is the client's nesting, not a bug: the one
error interceptor answers INVALID_ARGUMENT (code nested_too_deep), with no traceback, for a
unary and a streaming call alike, on a real grpc.aio server."""

from __future__ import annotations

import logging

import grpc
import pytest

from llmesh.rpc.channels import mesh_channel
from llmesh.rpc.server import GrpcServer, ServiceBinding
from llmesh.rpc.status import REASON_KEY


def _deep(n: int) -> int:
    return _deep(n + 1)


async def _unary(request, context):
    return bytes(_deep(0))


async def _stream(request, context):
    yield b"first"
    _deep(0)


def _bind(servicer, server) -> None:
    ident = lambda b: b  # noqa: E731 - raw bytes
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Deep", {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary, ident, ident),
        "Stream": grpc.unary_stream_rpc_method_handler(_stream, ident, ident)})])


async def test_recursion_errors_are_invalid_argument_without_a_traceback(caplog):
    server = GrpcServer("127.0.0.1:0", [ServiceBinding("test.Deep", None, _bind)])
    await server.start()
    ident = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
    try:
        async with mesh_channel(server.bound_address, "engine") as ch:
            with caplog.at_level(logging.WARNING, logger="llmesh.rpc"):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await ch.unary_unary("/test.Deep/Unary", **ident)(b"x")
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "nested too deeply" in info.value.details() and "Traceback" not in info.value.details()
                assert dict(info.value.trailing_metadata())[REASON_KEY] == "nested_too_deep"
                call = ch.unary_stream("/test.Deep/Stream", **ident)(b"x")
                assert await call.read() == b"first"
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call.read()
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        warnings = [r for r in caplog.records if r.name == "llmesh.rpc"]
        assert warnings and all(r.levelno == logging.WARNING and r.exc_info is None for r in warnings)
    finally:
        await server.stop(0)
