"""A real grpc.aio server and client: the token rides on every call kind, and the
server's admin check refuses a call without it (UNAUTHENTICATED) or, with no secret
and no local trust, at all (PERMISSION_DENIED)."""

from __future__ import annotations

import grpc
import pytest

from llmesh.rpc.channels import insecure_channel
from llmesh.rpc.identity import TOKEN_KEY, Identity, verify
from llmesh.rpc.server import GrpcServer, ServiceBinding

SECRET = b"k" * 32
UNLOAD = "/llmesh.v1.Engine/UnloadModel"  # an admin method (unary-unary)


def _caller(context) -> bytes:
    token = dict(context.invocation_metadata()).get(TOKEN_KEY)
    return verify(SECRET, token, now=__import__("time").time()).encode() if token else b"-"


async def _uu(request, context):
    return _caller(context)


async def _us(request, context):
    yield _caller(context)


async def _su(requests, context):
    async for _ in requests:
        pass
    return _caller(context)


async def _ss(requests, context):
    async for _ in requests:
        yield _caller(context)


def _bind(servicer, server) -> None:
    ident = lambda b: b  # noqa: E731 - raw bytes
    handlers = {"UU": grpc.unary_unary_rpc_method_handler(_uu, ident, ident),
                "US": grpc.unary_stream_rpc_method_handler(_us, ident, ident),
                "SU": grpc.stream_unary_rpc_method_handler(_su, ident, ident),
                "SS": grpc.stream_stream_rpc_method_handler(_ss, ident, ident)}
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Echo", handlers)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "llmesh.v1.Engine", {"UnloadModel": grpc.unary_unary_rpc_method_handler(_uu, ident, ident)})])


async def _server(identity: Identity) -> GrpcServer:
    server = GrpcServer("127.0.0.1:0", [ServiceBinding("test.Echo", None, _bind)], identity=identity)
    await server.start()
    return server


async def test_every_call_kind_carries_the_token():
    server = await _server(Identity("engine", SECRET))
    try:
        async with insecure_channel(server.bound_address, Identity("modelmgr", SECRET)) as ch:
            ident = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
            assert await ch.unary_unary("/test.Echo/UU", **ident)(b"x") == b"modelmgr"
            assert [r async for r in ch.unary_stream("/test.Echo/US", **ident)(b"x")] == [b"modelmgr"]
            assert await ch.stream_unary("/test.Echo/SU", **ident)(iter([b"x"])) == b"modelmgr"
            assert [r async for r in ch.stream_stream("/test.Echo/SS", **ident)(iter([b"x"]))] == [b"modelmgr"]
            assert await ch.unary_unary(UNLOAD, **ident)(b"x") == b"modelmgr"
        async with insecure_channel(server.bound_address) as ch:  # no identity: no token
            call = ch.unary_unary(UNLOAD, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(b"x")
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await server.stop(0)


async def test_no_secret_and_no_local_trust_refuses_admin_methods():
    server = await _server(Identity("engine"))
    try:
        async with insecure_channel(server.bound_address) as ch:
            ident = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
            assert await ch.unary_unary("/test.Echo/UU", **ident)(b"x") == b"-"   # not an admin method
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await ch.unary_unary(UNLOAD, **ident)(b"x")
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await server.stop(0)


async def test_local_trust_refuses_to_listen_beyond_loopback():
    from llmesh.rpc.identity import IdentityError

    with pytest.raises(IdentityError, match="loopback"):
        await GrpcServer("0.0.0.0:0", [ServiceBinding("test.Echo", None, _bind)],
                         identity=Identity("engine", local_trust=True)).start()
