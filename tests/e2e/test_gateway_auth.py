"""Gateway authentication never opens by itself, through real gateway processes: keys on
a real redis-server (made with `llmesh keys create`), FLUSHALL, a fresh gateway on an
empty Redis, JWT settings refused at start, a JWKS served over HTTP by the test, and two
gateways registered in a real etcd without a shared key store. (Off loopback is the
settings decision, tests/unit/test_auth_mode.py: tests bind 127.0.0.1 only.)"""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import jwt
import pytest
import redis
from cryptography.hazmat.primitives.asymmetric import rsa

from llmesh.testing import RedisServer, Service, free_ports, port_open, wait_until
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

CONFIG = {"tenants": {"acme": {}}, "splits": {"assistant": {"targets": [{"model": "sim-small", "weight": 1}]}}}
ISSUER, AUDIENCE = "https://idp.test", "llmesh"


class Gateway:
    """One gateway process on 127.0.0.1, nothing behind it (admission is what is tested)."""

    def __init__(self, root: Path, name: str, env: dict[str, str]):
        self.grpc_port, self.http_port, scheduler = free_ports(3)
        self.service = Service("llmesh.gateway", {
            "LLMESH_DISCOVERY": "static", "LLMESH_GATEWAY_PORT": str(self.grpc_port),
            "LLMESH_GATEWAY_HTTP_PORT": str(self.http_port), "LLMESH_GATEWAY_MODELMGR_ADDRESS": "",
            "LLMESH_GATEWAY_SCHEDULER_ADDRESS": f"127.0.0.1:{scheduler}", "LLMESH_GATEWAY_CACHE_ADDRESS": "",
            "LLMESH_REDIS_URL": "", **env}, root / f"{name}.log")

    def start(self) -> Gateway:
        self.service.start()
        assert wait_until(lambda: port_open(self.http_port) or self.service.proc.poll() is not None, 30), self.log()
        assert self.service.proc.poll() is None, self.log()
        return self

    def log(self) -> str:
        return self.service.log_path.read_text() if self.service.log_path.exists() else ""

    def models(self, credential: str | None = None) -> httpx.Response:
        headers = {"authorization": f"Bearer {credential}"} if credential else {}
        return httpx.get(f"http://127.0.0.1:{self.http_port}/v1/models", headers=headers, timeout=10)

    def chat(self, credential: str | None = None) -> httpx.Response:
        headers = {"authorization": f"Bearer {credential}"} if credential else {}
        return httpx.post(f"http://127.0.0.1:{self.http_port}/v1/chat/completions", headers=headers, timeout=10,
                          json={"model": "assistant", "messages": [{"role": "user", "content": "hi"}]})

    def grpc_code(self) -> grpc.StatusCode:
        with grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}") as channel:
            try:
                list(gateway_pb2_grpc.GatewayStub(channel).Chat(gateway_pb2.ChatRequest(
                    model="assistant", messages=[common_pb2.ChatMessage(role="user", content="hi")]), timeout=10))
            except grpc.RpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK


def refused(gw: Gateway, *credentials: str | None) -> bool:
    return all(gw.models(c).status_code == 401 and gw.chat(c).status_code == 401 for c in credentials)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("gwauth")
    server = RedisServer(root / "redis")
    server.start()
    config = root / "llmesh.yaml"
    config.write_text(json.dumps(CONFIG))
    gateways: list[Gateway] = []

    def gateway(name: str, **env: str) -> Gateway:
        gw = Gateway(root, name, {"LLMESH_CONFIG_FILE": str(config), **env})
        gateways.append(gw)
        return gw

    try:
        yield {"root": root, "redis": server, "gateway": gateway}
    finally:
        for gw in gateways:
            gw.service.stop()
        server.stop()


def create_key(redis_url: str, tenant: str) -> str:
    out = subprocess.run([sys.executable, "-m", "llmesh", "keys", "create", "--tenant", tenant, "--redis-url",
                          redis_url], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_redis_keys_a_fresh_gateway_a_flushall_and_unknown_tenants(world):
    url = world["redis"].url
    gw = world["gateway"]("redis-gw", LLMESH_REDIS_URL=url).start()
    assert refused(gw, None, "sk-anything", "llm_0123456789ab_made-up")  # empty Redis: no local mode
    assert gw.grpc_code() == grpc.StatusCode.UNAUTHENTICATED
    assert "holds no keys" in gw.log()  # says why; never a credential
    assert "sk-anything" not in gw.log() and "made-up" not in gw.log()
    acme, stranger = create_key(url, "acme"), create_key(url, "stranger")
    assert wait_until(lambda: gw.models(acme).status_code == 200, 5), gw.models(acme).text
    # let in, and told the truth: no engine serves sim-small here, so its split is not listed
    assert gw.models(acme).json() == {"object": "list", "data": []}
    resp = gw.models(stranger)  # a real key of a tenant the config does not know, and no "*"
    assert resp.status_code == 403 and "unknown_tenant" in resp.text, resp.text
    assert gw.chat(stranger).status_code == 403
    assert refused(gw, None, "sk-anything", acme[:-1] + ("x" if acme[-1] != "x" else "y"))
    redis.Redis.from_url(url).flushall()  # emptied: Redis flushed or evicted
    time.sleep(1.0)  # past the gateway's 0.5 s record cache
    assert refused(gw, None, "sk-anything", acme)
    assert gw.grpc_code() == grpc.StatusCode.UNAUTHENTICATED
    fresh = world["gateway"]("fresh-gw", LLMESH_REDIS_URL=url).start()  # a new replica on the emptied Redis
    assert refused(fresh, None, "sk-anything", acme)


def test_require_auth_on_loopback_and_local_mode_otherwise(world):
    strict = world["gateway"]("strict-gw", LLMESH_GATEWAY_REQUIRE_AUTH="true").start()
    assert refused(strict, None, "sk-anything")
    local = world["gateway"]("local-gw").start()  # loopback, no Redis, no JWT: `make run`'s local mode
    assert local.models().status_code == 200 and local.models("sk-anything").status_code == 200


@pytest.mark.parametrize("missing", ["LLMESH_GATEWAY_JWT_ISSUER", "LLMESH_GATEWAY_JWT_AUDIENCE"])
def test_jwt_without_issuer_or_audience_does_not_start(world, missing):
    env = {"LLMESH_GATEWAY_JWKS_URL": "http://127.0.0.1:9/jwks", "LLMESH_GATEWAY_JWT_ISSUER": ISSUER,
           "LLMESH_GATEWAY_JWT_AUDIENCE": AUDIENCE}
    del env[missing]
    gw = world["gateway"](f"jwt-{missing}", **env)
    gw.service.start()
    assert gw.service.proc.wait(timeout=30) != 0
    assert "LLMESH_GATEWAY_JWT_ISSUER and LLMESH_GATEWAY_JWT_AUDIENCE" in gw.log()
    assert not port_open(gw.http_port)


class Jwks:
    """A JWKS endpoint on 127.0.0.1 that counts its reads."""

    def __init__(self) -> None:
        self.signers = {"k1": rsa.generate_private_key(public_exponent=65537, key_size=2048)}
        self.reads = 0
        jwks = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # http.server's name for it
                jwks.reads += 1
                body = json.dumps(jwks.document()).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/jwks"

    def document(self) -> dict:
        keys = []
        for kid, key in self.signers.items():
            public = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))
            public.update(kid=kid, alg="RS256")
            keys.append(public)
        return {"keys": keys}

    def token(self, kid: str, signer: str | None = None) -> str:
        now = time.time()
        claims = {"iss": ISSUER, "aud": AUDIENCE, "sub": "alice", "tenant": "acme", "iat": now, "exp": now + 300}
        return jwt.encode(claims, self.signers[signer or kid], algorithm="RS256", headers={"kid": kid})


def test_an_unknown_kid_storm_reads_the_jwks_at_most_once_per_interval(world):
    jwks = Jwks()
    refetch_s = 3.0
    gw = world["gateway"]("jwks-gw", LLMESH_GATEWAY_JWKS_URL=jwks.url, LLMESH_GATEWAY_JWT_ISSUER=ISSUER,
                          LLMESH_GATEWAY_JWT_AUDIENCE=AUDIENCE, LLMESH_GATEWAY_JWKS_REFETCH_S=str(refetch_s)).start()
    try:
        started = time.monotonic()
        assert gw.models(jwks.token("k1")).status_code == 200, gw.log()[-2000:]
        assert jwks.reads == 1
        storm = [jwks.token(f"made-up-{i}", signer="k1") for i in range(40)]
        with httpx.Client(timeout=10) as client:
            codes = [client.get(f"http://127.0.0.1:{gw.http_port}/v1/models",
                                headers={"authorization": f"Bearer {t}"}).status_code for t in storm]
        assert set(codes) == {401}
        intervals = int((time.monotonic() - started) // refetch_s) + 1
        assert jwks.reads <= 1 + intervals, (jwks.reads, intervals)
        jwks.signers["k2"] = rsa.generate_private_key(public_exponent=65537, key_size=2048)  # a rotation
        time.sleep(refetch_s)
        reads = jwks.reads
        assert gw.models(jwks.token("k2")).status_code == 200  # the new key, after one read
        assert jwks.reads == reads + 1
        assert {gw.models(t).status_code for t in storm[:20]} == {401}
        assert jwks.reads == reads + 1  # the storm right after it reads nothing
    finally:
        jwks.server.shutdown()


async def test_a_second_gateway_without_a_shared_key_store_refuses_to_start(world, etcd):
    import uuid

    import asyncio

    from llmesh.discovery.etcd import EtcdRegistry, etcd_client

    prefix = f"/gwauth-{uuid.uuid4().hex[:8]}"
    env = {"LLMESH_DISCOVERY": "etcd", "LLMESH_ETCD_ADDRESS": etcd.address, "LLMESH_DISCOVERY_PREFIX": prefix,
           "LLMESH_CONFIG_BACKEND": "none", "LLMESH_GATEWAY_GRACE_S": "1"}
    registry = EtcdRegistry(etcd_client(etcd.address), prefix=prefix)
    try:
        first = world["gateway"]("etcd-gw-a", **env).start()

        for _ in range(300):
            if len(await registry.resolve("gateway")) == 1:
                break
            await asyncio.sleep(0.1)
        assert len(await registry.resolve("gateway")) == 1, first.log()[-2000:]
        second = world["gateway"]("etcd-gw-b", **env)
        second.service.start()
        assert await asyncio.to_thread(second.service.proc.wait, 30) == 1, second.log()[-2000:]
        assert "LLMESH_REDIS_URL" in second.log() and "cannot start" in second.log()
        assert first.service.proc.poll() is None
    finally:
        await registry.close()
