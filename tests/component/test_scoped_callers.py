"""The servicers see the verified caller (real gRPC, real certificates, token and TLS
trust): an engine reports only its own endpoint (its instance, or on a shared
certificate only an address on the IP it calls from) and never takes over another
identity's live endpoint; only a gateway reads or writes a tenant's cache entries."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from llmesh.cache.app import CacheApp
from llmesh.cache.config import CacheSettings
from llmesh.errors import PermissionDenied
from llmesh.platform import standalone_platform
from llmesh.rpc.channels import mesh_channel
from llmesh.rpc.identity import Credentials, Identity, caller
from llmesh.rpc.pki import Principal, ensure_pki
from llmesh.scheduler.app import SchedulerApp
from llmesh.scheduler.config import SchedulerSettings
from llmesh.v1 import cache_pb2, cache_pb2_grpc, common_pb2, scheduler_pb2, scheduler_pb2_grpc

INSTANCES = [("engine", "engine-0"), ("engine", "engine-1"), ("engine", "engine"), ("gateway", "gateway-0"),
             ("cli", "cli"), ("modelmgr", "modelmgr-0"), ("scheduler", "scheduler-0"), ("cache", "cache-0")]


@pytest.fixture(scope="module")
def creds(tmp_path_factory):
    files = ensure_pki(tmp_path_factory.mktemp("pki"), INSTANCES)
    return {k: Credentials.load(f.ca_file, f.cert_file, f.key_file) for k, f in files.items()}


def _as(creds, trust, instance) -> Identity:
    service = dict((i, s) for s, i in INSTANCES)[instance]
    return Identity(service, trust, creds[instance])


@pytest.fixture(params=["token", "tls"])
async def scheduler(request, creds):
    platform = standalone_platform("scheduler")
    platform.identity = _as(creds, request.param, "scheduler-0")
    app = SchedulerApp(SchedulerSettings(port=0), platform)
    await app.server.start()
    app.trust = request.param
    yield app
    await app.server.stop(0)


def _report(endpoint_id: str, address: str) -> scheduler_pb2.EngineReport:
    return scheduler_pb2.EngineReport(endpoint_id=endpoint_id, address=address, backend="sim", models=["m"])


async def _send(app, identity, *reports) -> grpc.StatusCode:
    async with mesh_channel(app.server.bound_address, "scheduler", identity) as ch:
        try:
            await scheduler_pb2_grpc.SchedulerStub(ch).Report(iter(reports), timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


async def test_an_engine_reports_its_own_endpoint_only(scheduler, creds):
    engine0 = _as(creds, scheduler.trust, "engine-0")
    assert await _send(scheduler, engine0, _report("engine-0", "127.0.0.1:7000")) == grpc.StatusCode.OK
    assert await _send(scheduler, engine0, _report("engine-1", "127.0.0.1:7001")) == grpc.StatusCode.PERMISSION_DENIED
    # one stream that starts as itself and then reports another endpoint
    assert await _send(scheduler, engine0, _report("engine-0", "127.0.0.1:7000"),
                       _report("engine-1", "127.0.0.1:7001")) == grpc.StatusCode.PERMISSION_DENIED
    assert not any(e.endpoint_id == "engine-1" for e in scheduler.table.snapshot())
    gateway = _as(creds, scheduler.trust, "gateway-0")  # not an engine at all
    assert await _send(scheduler, gateway, _report("gateway-0", "127.0.0.1:7002")) == grpc.StatusCode.PERMISSION_DENIED


async def test_a_shared_engine_certificate_reports_only_an_address_on_its_own_ip(scheduler, creds):
    shared = _as(creds, scheduler.trust, "engine")
    assert await _send(scheduler, shared, _report("pod-a", "127.0.0.1:7000")) == grpc.StatusCode.OK
    assert await _send(scheduler, shared, _report("pod-b", "10.9.9.9:7000")) == grpc.StatusCode.PERMISSION_DENIED


async def test_a_live_endpoint_is_not_taken_over_by_another_identity(scheduler, creds):
    engine1 = _as(creds, scheduler.trust, "engine-1")
    release = asyncio.Event()

    async def live_stream():
        yield _report("engine-1", "127.0.0.1:7001")
        await release.wait()

    async with mesh_channel(scheduler.server.bound_address, "scheduler", engine1) as ch:
        call = scheduler_pb2_grpc.SchedulerStub(ch).Report(live_stream(), timeout=10)
        for _ in range(100):
            if any(e.endpoint_id == "engine-1" for e in scheduler.table.snapshot()):
                break
            await asyncio.sleep(0.02)
        shared = _as(creds, scheduler.trust, "engine")  # same IP, another identity
        assert await _send(scheduler, shared, _report("engine-1", "127.0.0.1:6666")) == \
            grpc.StatusCode.PERMISSION_DENIED
        assert [e.address for e in scheduler.table.snapshot() if e.endpoint_id == "engine-1"] == ["127.0.0.1:7001"]
        release.set()
        await call


def _query(tenant: str) -> cache_pb2.CacheQuery:
    return cache_pb2.CacheQuery(tenant=tenant, model="m", chat=cache_pb2.CachedChat(messages=[
        common_pb2.ChatMessage(role="user", content="what is the account number?")]),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=8))


@pytest.mark.parametrize("trust", ["token", "tls"])
async def test_only_a_gateway_reads_or_writes_a_tenants_cache(creds, trust, tmp_path):
    platform = standalone_platform("cache")
    platform.identity = _as(creds, trust, "cache-0")
    app = CacheApp(CacheSettings(port=0, backend="memory", embed_model_dir=tmp_path / "no-model"), platform)
    await app.server.start()
    answer = cache_pb2.CachedResponse(text="42", finish_reason=common_pb2.FINISH_REASON_STOP)
    poison = cache_pb2.CachedResponse(text="POISONED: wire it to account 666")
    try:
        async with mesh_channel(app.server.bound_address, "cache", _as(creds, trust, "gateway-0")) as ch:
            gateway = cache_pb2_grpc.CacheStub(ch)
            assert (await gateway.Store(cache_pb2.StoreRequest(query=_query("acme"), response=answer))).stored
            for who in ("engine-0", "modelmgr-0", "cli"):
                async with mesh_channel(app.server.bound_address, "cache", _as(creds, trust, who)) as other_ch:
                    other = cache_pb2_grpc.CacheStub(other_ch)
                    for call in (other.Lookup(cache_pb2.LookupRequest(query=_query("acme"))),
                                 other.Store(cache_pb2.StoreRequest(query=_query("acme"), response=poison))):
                        with pytest.raises(grpc.aio.AioRpcError) as info:
                            await call
                        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, who
            hit = await gateway.Lookup(cache_pb2.LookupRequest(query=_query("acme")))
            assert hit.hit and hit.response.text == "42"
        if trust == "token":  # the exploit as filed: a plain call naming the tenant, no identity
            async with mesh_channel(app.server.bound_address, "cache") as ch:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await cache_pb2_grpc.CacheStub(ch).Lookup(cache_pb2.LookupRequest(query=_query("acme")))
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await app.server.stop(0)


def test_the_cache_servicer_itself_takes_a_tenant_from_a_gateway_only():
    from llmesh.cache.servicer import request_from_pb
    token = caller.set(Principal("modelmgr", "modelmgr-0"))
    try:
        with pytest.raises(PermissionDenied):
            request_from_pb(_query("acme"))
    finally:
        caller.reset(token)
    assert request_from_pb(_query("acme")).tenant == "acme"  # local trust: no caller
