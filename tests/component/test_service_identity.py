"""Real grpc.aio servers on 127.0.0.1 with real certificates (llmesh.rpc.pki), in each
trust mode: a call without identity is refused (UNAUTHENTICATED with tokens; the TLS
handshake fails under mutual TLS), another service's identity that the method does
not allow gets PERMISSION_DENIED, the allowed one gets through and the servicer sees
who it is; a replayed or re-targeted token is refused."""

from __future__ import annotations

import grpc
import pytest

from llmesh.rpc import identity as ident
from llmesh.rpc.channels import mesh_channel
from llmesh.rpc.identity import CERT_KEY, TOKEN_KEY, Credentials, Identity, IdentityError
from llmesh.rpc.pki import ensure_pki
from llmesh.rpc.server import GrpcServer, ServiceBinding

GENERATE = "/llmesh.v1.Engine/Generate"        # unary-stream, gateway and modelmgr only
UNLOAD = "/llmesh.v1.Engine/UnloadModel"       # unary-unary, modelmgr only
REPORT = "/llmesh.v1.Scheduler/Report"         # stream-unary, engine only
RAW = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)


def _seen(context) -> bytes:
    who = ident.caller.get()
    return b"-" if who is None else f"{who.service}/{who.instance}".encode()


async def _uu(request, context):
    return _seen(context)


async def _us(request, context):
    yield _seen(context)


async def _su(requests, context):
    async for _ in requests:
        pass
    return _seen(context)


def _bind(servicer, server) -> None:
    raw = lambda b: b  # noqa: E731
    server.add_generic_rpc_handlers([
        grpc.method_handlers_generic_handler("llmesh.v1.Engine", {
            "Generate": grpc.unary_stream_rpc_method_handler(_us, raw, raw),
            "UnloadModel": grpc.unary_unary_rpc_method_handler(_uu, raw, raw),
            "Tokenize": grpc.unary_unary_rpc_method_handler(_uu, raw, raw)}),
        grpc.method_handlers_generic_handler("llmesh.v1.Scheduler", {
            "Report": grpc.stream_unary_rpc_method_handler(_su, raw, raw)})])


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    files = ensure_pki(d, [("engine", "engine-0"), ("gateway", "gateway-0"), ("modelmgr", "modelmgr"),
                           ("cache", "cache-0"), ("scheduler", "scheduler-0")])
    other = ensure_pki(d / "other-mesh", [("gateway", "gateway-0")])
    creds = {name: Credentials.load(f.ca_file, f.cert_file, f.key_file) for name, f in files.items()}
    creds["rogue-gateway"] = Credentials.load(*vars(other["gateway-0"]).values())
    return creds


def _identity(pki, trust, instance, service=None) -> Identity:
    return Identity(service or instance.split("-")[0], trust, pki[instance])


async def _server(identity: Identity) -> GrpcServer:
    server = GrpcServer("127.0.0.1:0", [ServiceBinding("llmesh.v1.Engine", None, _bind)], identity=identity)
    await server.start()
    return server


async def _code(channel, method, kind="uu", metadata=None) -> grpc.StatusCode:
    try:
        if kind == "us":
            [r async for r in channel.unary_stream(method, **RAW)(b"x", metadata=metadata, timeout=5)]
        else:
            await channel.unary_unary(method, **RAW)(b"x", metadata=metadata, timeout=5)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("trust", ["token", "tls"])
async def test_the_allowed_caller_gets_through_on_every_call_kind_and_is_seen(pki, trust):
    server = await _server(_identity(pki, trust, "engine-0"))
    try:
        async with mesh_channel(server.bound_address, "engine", _identity(pki, trust, "gateway-0")) as ch:
            assert [r async for r in ch.unary_stream(GENERATE, **RAW)(b"x")] == [b"gateway/gateway-0"]
        async with mesh_channel(server.bound_address, "engine", _identity(pki, trust, "modelmgr")) as ch:
            assert await ch.unary_unary(UNLOAD, **RAW)(b"x") == b"modelmgr/modelmgr"
    finally:
        await server.stop(0)
    server = await _server(_identity(pki, trust, "scheduler-0"))
    try:
        async with mesh_channel(server.bound_address, "scheduler", _identity(pki, trust, "engine-0")) as ch:
            assert await ch.stream_unary(REPORT, **RAW)(iter([b"x"])) == b"engine/engine-0"
    finally:
        await server.stop(0)


@pytest.mark.parametrize("trust", ["token", "tls"])
async def test_another_services_identity_is_permission_denied(pki, trust):
    server = await _server(_identity(pki, trust, "engine-0"))
    try:
        async with mesh_channel(server.bound_address, "engine", _identity(pki, trust, "cache-0")) as ch:
            assert await _code(ch, GENERATE, "us") == grpc.StatusCode.PERMISSION_DENIED
        async with mesh_channel(server.bound_address, "engine", _identity(pki, trust, "gateway-0")) as ch:
            assert await _code(ch, UNLOAD) == grpc.StatusCode.PERMISSION_DENIED
            assert await _code(ch, "/llmesh.v1.Engine/NotInThePolicy") in (
                grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED)
    finally:
        await server.stop(0)


async def test_token_trust_without_identity_is_unauthenticated_and_health_stays_open(pki):
    server = await _server(_identity(pki, "token", "engine-0"))
    try:
        async with mesh_channel(server.bound_address, "engine") as ch:  # no identity: no token
            assert await _code(ch, GENERATE, "us") == grpc.StatusCode.UNAUTHENTICATED
            assert await _code(ch, UNLOAD) == grpc.StatusCode.UNAUTHENTICATED
        from llmesh.rpc.health import health_status
        assert await health_status(server.bound_address) == "SERVING"
    finally:
        await server.stop(0)


async def test_a_replayed_or_retargeted_or_foreign_token_is_refused(pki):
    server = await _server(_identity(pki, "token", "engine-0"))
    modelmgr = _identity(pki, "token", "modelmgr")
    try:
        async with mesh_channel(server.bound_address, "engine") as ch:
            seen = dict(modelmgr.call_metadata(UNLOAD, "engine"))
            once = tuple(seen.items())
            assert await _code(ch, UNLOAD, metadata=once) == grpc.StatusCode.OK
            assert await _code(ch, UNLOAD, metadata=once) == grpc.StatusCode.UNAUTHENTICATED  # replayed
            # minted for Generate, sent to UnloadModel; minted for another audience (the scheduler)
            for method, aud in ((GENERATE, "engine"), ("/llmesh.v1.Scheduler/Place", "scheduler")):
                other = modelmgr.call_metadata(method, aud)
                assert await _code(ch, UNLOAD, metadata=other) == grpc.StatusCode.UNAUTHENTICATED
            # a token and certificate from another mesh's CA
            rogue = _identity(pki, "token", "rogue-gateway", "gateway").call_metadata(GENERATE, "engine")
            assert await _code(ch, GENERATE, "us", metadata=rogue) == grpc.StatusCode.UNAUTHENTICATED
            # this mesh's certificate of the gateway, with a token the modelmgr signed
            token = dict(modelmgr.call_metadata(GENERATE, "engine"))[TOKEN_KEY]
            cert = dict(_identity(pki, "token", "gateway-0").call_metadata(GENERATE, "engine"))[CERT_KEY]
            forged = ((TOKEN_KEY, token), (CERT_KEY, cert))
            assert await _code(ch, GENERATE, "us", metadata=forged) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await server.stop(0)


async def test_an_expired_token_is_refused(pki):
    server = await _server(_identity(pki, "token", "engine-0"))
    import time
    late = Identity("modelmgr", "token", pki["modelmgr"], clock=lambda: time.time() - 60)
    try:
        async with mesh_channel(server.bound_address, "engine", late) as ch:
            assert await _code(ch, UNLOAD) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await server.stop(0)


async def test_tls_trust_refuses_a_caller_without_a_mesh_certificate_in_the_handshake(pki):
    server = await _server(_identity(pki, "tls", "engine-0"))
    try:
        async with grpc.aio.insecure_channel(server.bound_address) as ch:  # no TLS at all
            assert await _code(ch, GENERATE, "us") == grpc.StatusCode.UNAVAILABLE
        ca = pki["engine-0"].ca_pem
        creds = grpc.ssl_channel_credentials(ca)  # TLS, the right CA, but no client certificate
        opts = (("grpc.ssl_target_name_override", "engine.llmesh.internal"),)
        async with grpc.aio.secure_channel(server.bound_address, creds, options=opts) as ch:
            assert await _code(ch, GENERATE, "us") == grpc.StatusCode.UNAVAILABLE
        rogue = _identity(pki, "tls", "rogue-gateway", "gateway")  # another mesh's CA
        async with mesh_channel(server.bound_address, "engine", rogue) as ch:
            assert await _code(ch, GENERATE, "us") == grpc.StatusCode.UNAVAILABLE
        # the client checks the server too: an engine's port is not the scheduler's
        async with mesh_channel(server.bound_address, "scheduler", _identity(pki, "tls", "engine-0")) as ch:
            assert await _code(ch, REPORT.replace("Report", "ListEndpoints")) == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)


async def test_local_trust_asks_no_identity_and_listens_on_loopback_only(pki):
    server = await _server(Identity("engine"))
    try:
        async with mesh_channel(server.bound_address, "engine") as ch:
            assert await ch.unary_unary(UNLOAD, **RAW)(b"x") == b"-"
    finally:
        await server.stop(0)
    with pytest.raises(IdentityError, match="loopback"):
        await GrpcServer("0.0.0.0:0", [ServiceBinding("llmesh.v1.Engine", None, _bind)],
                         identity=Identity("engine")).start()
    await GrpcServer("0.0.0.0:0", [ServiceBinding("llmesh.v1.Engine", None, _bind)],
                     identity=_identity(pki, "token", "engine-0")).stop(0)  # constructs; binding 0.0.0.0 is fine


def test_an_identity_needs_files_that_name_its_service(pki):
    with pytest.raises(IdentityError, match="LLMESH_TLS_CA_FILE"):
        Identity("engine", "tls")
    with pytest.raises(IdentityError, match="engine.llmesh.internal"):
        Identity("gateway", "token", pki["engine-0"])
