"""The Consul adapter against the agent STAND-IN (tests/integration/consul_standin.py),
which reproduces the documented agent behaviours the adapter relies on. Each test
names the bug it guards against; each failed against the adapter before this fix."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request

import pytest

from llmesh.cache.app import CacheApp
from llmesh.cache.config import CacheSettings
from llmesh.discovery.base import Follower, Instance
from llmesh.discovery.consul import ConsulRegistry
from llmesh.errors import DiscoveryError
from llmesh.testing import free_ports
from tests.integration.consul_standin import ConsulStandin

FAST = {"check_interval_s": 0.2, "check_timeout_s": 0.2, "resync_s": 0.3, "wait_s": 1.0}


@pytest.fixture
async def cache_app():
    app = CacheApp(CacheSettings(port=0))
    await app.start()
    yield app
    await app.stop(0)


def put(standin: ConsulStandin, path: str, body: dict) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{standin.port}{path}", data=json.dumps(body).encode(),
                                 method="PUT")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


async def until(predicate, timeout_s: float, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while True:
        value = await predicate()
        if value or time.monotonic() > deadline:
            return value
        await asyncio.sleep(interval_s)


def instance_of(app: CacheApp, instance_id: str = "cache-1") -> Instance:
    return Instance("cache", instance_id, app.advertise_address, app.health_service)


async def test_unspecified_address_is_refused_with_a_clear_error(standin):
    # The agent answers 400 "Invalid service address" (the stand-in does too); the adapter
    # used to send 0.0.0.0 and surface only "BadRequest".
    assert put(standin, "/v1/agent/service/register", {"Name": "x", "Address": "0.0.0.0", "Port": 1}) == 400
    reg = ConsulRegistry(standin.address, **FAST)
    try:
        for address in ("0.0.0.0:50051", "[::]:50051"):
            with pytest.raises(DiscoveryError, match="names no host"):
                await reg.register(Instance("cache", "c", address))
    finally:
        await reg.close()


async def test_grpc_check_asks_for_the_service_with_a_timeout_and_not_serving_leaves(standin, cache_app):
    reg = ConsulRegistry(standin.address, **FAST)
    inst = instance_of(cache_app)
    try:
        await reg.register(inst)
        assert await until(lambda: reg.resolve("cache"), 5) == [inst]
        _, _, entries = standin.get("/v1/health/service/cache")
        definition = entries[0]["Checks"][1]["Definition"]
        assert definition["GRPC"] == f"{cache_app.advertise_address}/llmesh.v1.Cache"
        assert definition["Timeout"] == "0.2s"  # not Consul's 10 s default, longer than the interval
        assert definition["DeregisterCriticalServiceAfter"] == "60s"  # Consul's floor, not 10 s
        await cache_app.server.set_serving(False)  # draining: out of passing reads within a few checks
        assert await until(lambda: _empty(reg.resolve("cache")), 3)
    finally:
        await reg.close()


async def _empty(coro) -> bool:
    return await coro == []


async def test_agent_down_no_leader_and_acl_refusals_are_discovery_errors(standin, monkeypatch):
    dead = ConsulRegistry(f"127.0.0.1:{free_ports(1)[0]}", **FAST)
    for call in (dead.resolve("cache"), dead.register(Instance("cache", "c", "127.0.0.1:1")),
                 dead.deregister(Instance("cache", "c", "127.0.0.1:1"))):
        with pytest.raises(DiscoveryError, match="unreachable|Cannot connect|ClientConnectorError"):
            await call
    await dead.close()

    reg = ConsulRegistry(standin.address, **FAST)
    standin.control("/standin/leader?present=0")
    try:
        await reg.register(Instance("cache", "c", "127.0.0.1:1"))  # the agent takes it; anti-entropy syncs later
        with pytest.raises(DiscoveryError, match="No cluster leader"):
            await reg.resolve("cache")
    finally:
        standin.control("/standin/leader?present=1")
        await reg.close()


async def test_acl_token_setting_wins_and_reads_without_it_come_back_empty(tmp_path, monkeypatch):
    standin = ConsulStandin(acl_token="s3cret")
    standin.start()
    monkeypatch.setenv("CONSUL_HTTP_TOKEN", "wrong")  # py-consul would let this override the setting
    anonymous = ConsulRegistry(standin.address, token=None, **FAST)
    monkeypatch.delenv("CONSUL_HTTP_TOKEN")
    holder = ConsulRegistry(standin.address, token="s3cret", **FAST)
    monkeypatch.setenv("CONSUL_HTTP_TOKEN", "wrong")
    tokened = ConsulRegistry(standin.address, token="s3cret", **FAST)
    inst = Instance("cache", "c", "127.0.0.1:1")
    try:
        with pytest.raises(DiscoveryError, match="ACLPermissionDenied: Permission denied"):
            await anonymous.register(inst)
        await tokened.register(inst)
        status, headers, body = standin.get("/v1/health/service/cache")
        assert status == 200 and body == [] and headers["X-Consul-Results-Filtered-By-ACLs"] == "true"
        assert [i.instance_id for i in await holder.resolve("cache")] == []  # critical check: not passing
        _, _, services = standin.get("/v1/agent/services", token="s3cret")
        assert list(services) == ["c"]
    finally:
        for r in (anonymous, holder, tokened):
            await r.close()
        standin.stop()


async def test_per_service_tokens_with_a_deny_default(cache_app, monkeypatch):
    """Consul as compose runs it (ACLs on, default_policy deny, a token per service from the
    consul-acl bootstrap): the discovery client with the cache's token registers the cache
    and resolves it; without a token, or with the engine's, registering it is refused and an
    anonymous read comes back empty. https://developer.hashicorp.com/consul/docs/security/acl"""
    monkeypatch.delenv("CONSUL_HTTP_TOKEN", raising=False)
    standin = ConsulStandin(service_tokens={"cache": "cache-token", "engine": "engine-token"})
    standin.start()
    inst = instance_of(cache_app)
    cache = ConsulRegistry(standin.address, token="cache-token", **FAST)
    anonymous = ConsulRegistry(standin.address, token=None, **FAST)
    engine = ConsulRegistry(standin.address, token="engine-token", **FAST)
    try:
        for refused in (anonymous, engine):
            with pytest.raises(DiscoveryError, match="ACLPermissionDenied: Permission denied"):
                await refused.register(inst)
        assert standin.get("/v1/agent/services", token="cache-token")[2] == {}
        await cache.register(inst)
        assert await until(lambda: cache.resolve("cache"), 5) == [inst]  # passing: its gRPC check answers
        assert await engine.resolve("cache") == [inst]  # every service's token reads every service
        assert await anonymous.resolve("cache") == []  # the anonymous token reads nothing
        status, headers, body = standin.get("/v1/health/service/cache?passing=1")
        assert status == 200 and body == [] and headers["X-Consul-Results-Filtered-By-ACLs"] == "true"
        _, _, body = standin.get("/v1/health/service/cache?passing=1&token=cache-token")  # ?token= works too
        assert [e["Service"]["ID"] for e in body] == [inst.instance_id]
        with pytest.raises(DiscoveryError, match="Permission denied"):
            await engine.deregister(inst)  # write on "engine" only
        assert await cache.resolve("cache") == [inst]
        await cache.deregister(inst)
        assert await cache.resolve("cache") == []
    finally:
        for r in (cache, anonymous, engine):
            await r.close()
        standin.stop()


async def test_empty_service_address_falls_back_to_the_node_address(standin):
    assert put(standin, "/v1/agent/service/register", {"Name": "cache", "ID": "bare", "Port": 4321}) == 200
    reg = ConsulRegistry(standin.address, **FAST)
    try:
        assert [i.address for i in await reg.resolve("cache")] == ["127.0.0.1:4321"]
    finally:
        await reg.close()


class Collector:
    """Consumes a watch in a task, as a long-lived caller does (cancelling a pending
    ``anext`` would close the generator), and hands out what it yields."""

    def __init__(self, watch):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.create_task(self._run(watch))

    async def _run(self, watch) -> None:
        async for item in watch:
            self.queue.put_nowait(item)

    async def next(self, timeout_s: float):
        return await asyncio.wait_for(self.queue.get(), timeout_s)

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def test_watch_yields_real_changes_only(standin, cache_app):
    reg = ConsulRegistry(standin.address, **{**FAST, "wait_s": 0.3})
    watch = Collector(reg.watch("cache"))
    try:
        assert await watch.next(2) == []
        # Unrelated writes move the index and every wait times out: nothing to yield.
        for i in range(3):
            assert put(standin, "/v1/agent/service/register", {"Name": "other", "ID": f"o{i}", "Port": 1}) == 200
        await asyncio.sleep(1.5)
        assert watch.queue.empty()
        inst = instance_of(cache_app)
        await reg.register(inst)
        assert await watch.next(3) == [inst]
    finally:
        await watch.close()
        await reg.close()


async def test_watch_with_a_zero_index_does_not_busy_loop(standin):
    # Consul's docs: an index of 0 must be treated as 1, and clients must rate-limit;
    # the adapter used to send index=0 back, which never blocks (23 queries/s seen).
    standin.control("/standin/index?pin=0")
    reg = ConsulRegistry(standin.address, **{**FAST, "wait_s": 0.5})
    task = asyncio.create_task(_drain(reg.watch("cache")))
    try:
        await asyncio.sleep(0.2)
        before = standin.get("/standin/stats")[2]["health_queries"]
        await asyncio.sleep(2.0)
        queries = standin.get("/standin/stats")[2]["health_queries"] - before
        assert queries <= 2.0 / 0.5 + 2, f"{queries} queries in 2 s"
    finally:
        task.cancel()
        await reg.close()


async def _drain(watch) -> None:
    async for _ in watch:
        pass


async def test_watch_keeps_following_when_the_index_goes_backwards(standin, cache_app):
    # Consul's blocking-query notes: an index lower than the last one restarts from 0
    # (a fresh read). A client that kept its old, higher index would wait out every wait.
    reg = ConsulRegistry(standin.address, **{**FAST, "wait_s": 3.0})
    for i in range(20):  # move the index well forward
        put(standin, "/v1/agent/service/register", {"Name": "other", "ID": f"o{i}", "Port": 1})
    watch = Collector(reg.watch("cache"))
    try:
        assert await watch.next(2) == []
        await asyncio.sleep(0.3)  # now blocked on an index past 20
        standin.control("/standin/index?value=3")  # e.g. a server restored from an older snapshot
        await asyncio.sleep(3.6)  # the query in flight returns at its wait with index 3 < ours
        inst = instance_of(cache_app)
        await reg.register(inst)
        t0 = time.monotonic()
        # Passing after one check (0.2 s); without the reset the watch would block on the
        # old index until the next 3 s wait ran out.
        assert await watch.next(5) == [inst]
        assert time.monotonic() - t0 < 1.5
    finally:
        await watch.close()
        await reg.close()


async def test_watch_and_registration_survive_an_agent_restart(standin, cache_app):
    reg = ConsulRegistry(standin.address, **FAST)
    inst = instance_of(cache_app)
    await reg.register(inst)
    follower = Follower(reg, "cache")
    try:
        assert await until(lambda: _address_is(follower, inst.address), 5)
        standin.kill()
        await asyncio.sleep(1.0)
        assert await follower() == inst.address  # the last known instance stays in use meanwhile
        standin.start()  # a fresh agent: no registrations, a low index
        # The registry notices within its resync period and registers again; the watch
        # (which failed while the agent was away) retries and follows a new instance.
        assert await until(lambda: _registered(standin, "cache-1"), 5)
        second = Instance("cache", "cache-2", inst.address, inst.health_name)
        await reg.register(second)
        assert await until(lambda: _instances_are(follower, [inst, second]), 8)
    finally:
        await follower.close()
        await reg.close()


async def _address_is(follower: Follower, address: str) -> bool:
    try:
        return await follower() == address
    except DiscoveryError:
        return False


async def _instances_are(follower: Follower, expected: list[Instance]) -> bool:
    return follower.instances == expected


async def _registered(standin: ConsulStandin, instance_id: str) -> bool:
    return instance_id in standin.get("/v1/agent/services")[2]


async def test_cancelling_a_watch_in_flight_is_prompt_and_leaves_no_thread(standin):
    reg = ConsulRegistry(standin.address, **{**FAST, "wait_s": 30.0})
    threads = threading.active_count()
    task = asyncio.create_task(_drain(reg.watch("cache")))
    await asyncio.sleep(0.5)  # first answer in; now blocked in a 30 s query
    assert threading.active_count() == threads  # a coroutine, not a worker thread
    t0 = time.monotonic()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await reg.close()
    assert time.monotonic() - t0 < 1.0


def test_a_process_with_a_watch_in_flight_exits_in_under_a_second(standin):
    # The old adapter's blocking query ran in a worker thread: asyncio.run waited for it
    # (up to the 30 s wait) after the task was cancelled.
    script = textwrap.dedent(f"""
        import asyncio, time
        from llmesh.discovery.consul import ConsulRegistry
        async def main():
            reg = ConsulRegistry("{standin.address}", wait_s=30)
            watch = reg.watch("cache")
            await anext(watch)
            task = asyncio.create_task(anext(watch))
            await asyncio.sleep(0.3)
            print("blocking", flush=True)
            task.cancel()
            await reg.close()
        asyncio.run(main())
        print("exited", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "blocking"
        t0 = time.monotonic()
        assert proc.stdout.readline().strip() == "exited"
        assert time.monotonic() - t0 < 1.0
        assert proc.wait(5) == 0
    finally:
        proc.kill()


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def pki(tmp_path):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, by openssl."""
    d = tmp_path
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
             "-days", "1", "-subj", "/CN=test-ca", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "1", "-extfile", "san.ext", cwd=d)
    return d


async def test_https_with_a_ca_and_a_client_certificate(pki):
    standin = ConsulStandin(tls=(str(pki / "server.pem"), str(pki / "server.key"), str(pki / "ca.pem")))
    standin.start()
    # https:// used to be mangled into http://https://...; the CA and client cert had no setting.
    reg = ConsulRegistry(standin.address, ca_file=str(pki / "ca.pem"), cert_file=str(pki / "client.pem"),
                         key_file=str(pki / "client.key"), **FAST)
    no_cert = ConsulRegistry(standin.address, ca_file=str(pki / "ca.pem"), **FAST)
    no_ca = ConsulRegistry(standin.address, cert_file=str(pki / "client.pem"), key_file=str(pki / "client.key"),
                           **FAST)
    try:
        assert standin.address.startswith("https://")
        await reg.register(Instance("cache", "c", "127.0.0.1:1"))
        assert await reg.resolve("cache") == []  # registered; its check is not passing
        for refused in (no_cert, no_ca):
            with pytest.raises(DiscoveryError):
                await refused.resolve("cache")
    finally:
        for r in (reg, no_cert, no_ca):
            await r.close()
        standin.stop()
