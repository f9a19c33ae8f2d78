"""Tenants and governance on a real mesh: three gateway processes sharing one
redis-server, sim engines, keys made with the `llmesh keys` CLI, JWTs signed by
a key the test owns; driven by the official openai package, httpx and gRPC."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import grpc
import httpx
import jwt
import openai
import pytest
import redis
from cryptography.hazmat.primitives.asymmetric import rsa

from llmesh.testing import Mesh, RedisServer, Service, free_layout, free_ports, port_open, wait_until
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

SIM = "sim-small"
TPM = 6000
CONFIG = {
    "default": {"max_attempts": 2},
    "tenants": {
        "acme": {"models": [SIM], "max_tokens": 64},
        "burst": {"models": [SIM]},
        "paced": {"models": [SIM]},
        "budgeted": {"models": [SIM], "budget": {"tokens": 300, "period": "day"}},
        "*": {"models": [SIM]},
    },
    "groups": {"eng": {"models": [SIM, "assistant"]}},
    "rate_limits": {"burst": {"tokens_per_minute": TPM}, "paced": {"requests_per_minute": 2}},
    "prices": {SIM: {"input_per_1k": 0.5, "output_per_1k": 1.5}},
    "splits": {"assistant": {"targets": [{"model": SIM, "weight": 1}]}},
}


@pytest.fixture(scope="module")
def signer():
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture(scope="module")
def gov(tmp_path_factory, signer, real_model_dir):
    """A sim mesh on a private redis-server with two more gateway replicas."""
    root = tmp_path_factory.mktemp("gov")
    server = RedisServer(root / "redis")
    server.start()
    config = root / "llmesh.yaml"
    config.write_text(json.dumps(CONFIG))
    public = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(signer.public_key()))
    public.update(kid="k1", alg="RS256")
    (root / "jwks.json").write_text(json.dumps({"keys": [public]}))
    env = {"LLMESH_REDIS_URL": server.url, "LLMESH_CONFIG_FILE": str(config),
           "LLMESH_GATEWAY_JWKS_FILE": str(root / "jwks.json"), "LLMESH_GATEWAY_JWT_AUDIENCE": "llmesh",
           "LLMESH_GATEWAY_JWT_ISSUER": "https://idp.test",
           "LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": "100", "LLMESH_ENGINE_MAX_RUNNING": "512",
           "LLMESH_ENGINE_MAX_WAITING": "512"}
    layout = free_layout(n_engines=1)
    mesh = Mesh(layout=layout, engines="sim", model_dir=real_model_dir, log_dir=root / "logs", env=env,
                args=["--no-cache"])
    replicas = []
    urls = [layout.http_url]
    grpc_addresses = [layout.address("gateway")]
    metrics_urls = [f"http://127.0.0.1:{layout.metrics_port('gateway')}/metrics"]
    try:  # the replicas, the mesh and the redis-server stop even if one of them does not start
        mesh.start()
        for i in range(2):
            grpc_port, http_port, metrics_port = free_ports(3)
            metrics_urls.append(f"http://127.0.0.1:{metrics_port}/metrics")
            svc = Service("llmesh.gateway", {
                **env, "LLMESH_GATEWAY_PORT": str(grpc_port), "LLMESH_GATEWAY_HTTP_PORT": str(http_port),
                "LLMESH_GATEWAY_METRICS_PORT": str(metrics_port),
                "LLMESH_GATEWAY_SCHEDULER_ADDRESS": layout.address("scheduler"),
                "LLMESH_GATEWAY_MODELMGR_ADDRESS": layout.address("modelmgr"),
                "LLMESH_GATEWAY_CACHE_ADDRESS": "", "LLMESH_GATEWAY_AUDIT_FILE": str(root / f"audit-{i}.jsonl")},
                root / f"gateway-{i}.log")
            svc.start()
            replicas.append(svc)
            urls.append(f"http://127.0.0.1:{http_port}")
            grpc_addresses.append(f"127.0.0.1:{grpc_port}")
        for url in urls:
            assert wait_until(lambda: _ready(url), 30), "a gateway replica did not start"
        yield {"urls": urls, "grpc": grpc_addresses, "redis": server, "root": root, "mesh": mesh,
               "metrics": metrics_urls}
    finally:
        for svc in replicas:
            svc.stop()
        mesh.stop()
        server.stop()


def _ready(url: str) -> bool:
    try:
        ok = httpx.get(url + "/healthz", timeout=1).status_code == 200
        return ok and bool(httpx.get(url + "/v1/models", timeout=1).status_code in (200, 401))
    except httpx.HTTPError:
        return False


def cli(*args: str, redis_url: str) -> str:
    out = subprocess.run([sys.executable, "-m", "llmesh", *args, "--redis-url", redis_url],
                         capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    return out.stdout


def create_key(gov, tenant: str, *extra: str) -> tuple[str, str]:
    out = cli("keys", "create", "--tenant", tenant, *extra, redis_url=gov["redis"].url)
    plaintext = out.strip().splitlines()[-1]
    return plaintext, plaintext.split("_")[1]


def token(signer, **claims) -> str:
    now = time.time()
    body = {"iss": "https://idp.test", "aud": "llmesh", "sub": "bob", "tenant": "acme", "exp": now + 300,
            **claims}
    return jwt.encode(body, signer, algorithm="RS256", headers={"kid": "k1"})


def chat(url: str, key: str, model: str = SIM, **kw) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4, **kw}
    return httpx.post(url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"},
                      timeout=30)


def grpc_chat(address: str, key: str | None, model: str = SIM):
    md = (("authorization", f"Bearer {key}"),) if key else ()
    with grpc.insecure_channel(address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        return list(stub.Chat(gateway_pb2.ChatRequest(
            model=model, messages=[common_pb2.ChatMessage(role="user", content="hi")],
            sampling=common_pb2.SamplingParams(max_tokens=3)), metadata=md, timeout=30))


def grpc_models(address: str, key: str):
    with grpc.insecure_channel(address) as ch:
        return gateway_pb2_grpc.GatewayStub(ch).ListModels(
            gateway_pb2.GatewayListModelsRequest(), metadata=(("authorization", f"Bearer {key}"),), timeout=10)


def test_without_credentials_every_front_says_401(gov):
    create_key(gov, "acme")  # from now on the mesh requires credentials
    client = openai.OpenAI(base_url=gov["urls"][1] + "/v1", api_key="not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        client.chat.completions.create(model=SIM, messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["code"] == "invalid_api_key"
    r = httpx.post(gov["urls"][0] + "/v1/chat/completions", json={"model": SIM, "messages": []}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
    with pytest.raises(grpc.RpcError) as err:
        grpc_chat(gov["grpc"][2], None)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_api_key_grants_and_403_on_both_fronts(gov):
    key, _ = create_key(gov, "acme")
    client = openai.OpenAI(base_url=gov["urls"][0] + "/v1", api_key=key, max_retries=0)
    answer = client.chat.completions.create(model=SIM, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert answer.usage.completion_tokens == 3
    assert [m.id for m in client.models.list()] == [SIM]
    assert list(grpc_models(gov["grpc"][1], key).models) == [SIM]  # the embedder in the registry: not granted
    with pytest.raises(openai.PermissionDeniedError) as info:
        client.chat.completions.create(model="assistant", messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["code"] == "model_not_allowed"
    with pytest.raises(openai.PermissionDeniedError):  # over the tenant's max_tokens
        client.chat.completions.create(model=SIM, messages=[{"role": "user", "content": "hi"}], max_tokens=65)
    assert grpc_chat(gov["grpc"][1], key)[-1].usage.completion_tokens == 3
    with pytest.raises(grpc.RpcError) as err:
        grpc_chat(gov["grpc"][1], key, model="assistant")
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize("case", ["expired", "wrong_audience", "wrong_signature", "not_yet_valid", "good"])
def test_jwts_on_http_and_grpc(gov, signer, case):
    now = time.time()
    tok = {
        "expired": lambda: token(signer, exp=now - 5),
        "wrong_audience": lambda: token(signer, aud="other"),
        "wrong_signature": lambda: token(rsa.generate_private_key(public_exponent=65537, key_size=2048)),
        "not_yet_valid": lambda: token(signer, nbf=now + 300),
        "good": lambda: token(signer, groups=["eng"]),
    }[case]()
    r = chat(gov["urls"][2], tok, model="assistant")
    if case == "good":  # the group 'eng' widens acme's grant to the alias
        assert r.status_code == 200, r.text
        assert grpc_chat(gov["grpc"][0], tok, model="assistant")[-1].usage.completion_tokens == 3
        listed = httpx.get(gov["urls"][2] + "/v1/models", headers={"authorization": f"Bearer {tok}"}, timeout=10)
        assert [m["id"] for m in listed.json()["data"]] == ["assistant", SIM]  # the group's grant, no more
        assert list(grpc_models(gov["grpc"][0], tok).models) == ["assistant", SIM]
        return
    assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(grpc.RpcError) as err:
        grpc_chat(gov["grpc"][0], tok)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_revoked_key_fails_on_every_replica_within_a_second(gov):
    """Every replica is asked continuously; every request sent a second or more
    after the revocation is refused, on all three."""
    key, key_id = create_key(gov, "acme")
    for url in gov["urls"]:
        assert chat(url, key).status_code == 200

    async def poll(client: httpx.AsyncClient, url: str, since: float, seen: list) -> None:
        while time.monotonic() - since < 2.5:
            sent = time.monotonic() - since
            r = await client.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                                  json={"model": SIM, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
            seen.append((url, sent, r.status_code))

    async def run() -> list:
        seen: list = []
        async with httpx.AsyncClient(timeout=30) as client:
            cli("keys", "revoke", key_id, redis_url=gov["redis"].url)
            since = time.monotonic()
            await asyncio.gather(*(poll(client, url, since, seen) for url in gov["urls"]))
        return seen

    seen = asyncio.run(run())
    late = [(url, status) for url, sent, status in seen if sent >= 1.0]
    assert {url for url, _ in late} == set(gov["urls"])  # each replica was asked after the second
    assert all(status == 401 for _, status in late), late


def test_rate_limit_facts_reach_grpc_callers_in_metadata(gov):
    """What HTTP callers read in x-ratelimit-* headers, gRPC callers read in the initial
    metadata and the trailers; a refusal is RESOURCE_EXHAUSTED with retry-after."""
    key, _ = create_key(gov, "paced")
    md = (("authorization", f"Bearer {key}"),)
    request = gateway_pb2.ChatRequest(model=SIM, messages=[common_pb2.ChatMessage(role="user", content="hi")],
                                      sampling=common_pb2.SamplingParams(max_tokens=3))
    with grpc.insecure_channel(gov["grpc"][0]) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        call = stub.Chat(request, metadata=md, timeout=30)
        assert list(call)[-1].usage.completion_tokens == 3
        initial, trailers = dict(call.initial_metadata()), dict(call.trailing_metadata())
        assert initial["x-ratelimit-limit-requests"] == trailers["x-ratelimit-limit-requests"] == "2"
        assert trailers["x-ratelimit-remaining-requests"] == "1" and trailers["x-request-id"]
        list(stub.Chat(request, metadata=md, timeout=30))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Chat(request, metadata=md, timeout=30))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    refused = dict(err.value.trailing_metadata())
    assert int(refused["retry-after"]) >= 1 and refused["x-ratelimit-remaining-requests"] == "0"


def test_three_gateways_share_one_tokens_per_minute_limit(gov):
    """500 concurrent streamed requests over three replicas: what they admit,
    counted in reserved tokens, is within 1 % of the shared limit and never over."""
    key, _ = create_key(gov, "burst")
    body = {"model": SIM, "messages": [{"role": "user", "content": "count slowly please"}], "max_tokens": 30,
            "stream": True}

    async def one(client: httpx.AsyncClient, url: str):
        async with client.stream("POST", url + "/v1/chat/completions", json=body,
                                 headers={"authorization": f"Bearer {key}"}) as r:
            # admitted streams are closed after the headers: a cancelled request keeps its reservation
            body_text = (await r.aread()).decode() if r.status_code != 200 else ""
            return r.status_code, dict(r.headers) | {"body": body_text}

    async def burst():
        limits = httpx.Limits(max_connections=600, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            return await asyncio.gather(*(one(client, gov["urls"][i % 3]) for i in range(500)))

    results = asyncio.run(burst())
    admitted = [h for s, h in results if s == 200]
    refused = [h for s, h in results if s == 429]
    assert len(admitted) + len(refused) == 500, {h["body"] for s, h in results if s not in (200, 429)}
    assert admitted and refused
    reserved_each = {TPM - int(h["x-ratelimit-remaining-tokens"]) for h in admitted}
    per_request = min(reserved_each)
    used = len(admitted) * per_request
    print(f"admitted {len(admitted)} x {per_request} reserved tokens = {used} of {TPM}; refused {len(refused)}")
    assert used <= TPM and used >= 0.99 * TPM, (len(admitted), per_request)
    assert all(int(h["retry-after"]) >= 1 and h["x-ratelimit-limit-tokens"] == str(TPM) for h in refused)
    r = redis.Redis.from_url(gov["redis"].url)
    assert int(r.get("llmesh:rl:{burst}:tok:sum")) <= TPM
    counted = 0.0  # the refusals, as the three replicas' metrics count them
    for url in gov["metrics"]:
        for line in httpx.get(url).text.splitlines():
            if line.startswith('llmesh_rate_limited_requests_total{tenant="burst"}'):
                counted += float(line.split()[-1])
    assert counted == len(refused)


def test_budget_stops_at_most_one_request_past_its_line(gov):
    key, _ = create_key(gov, "budgeted")
    used, refused = 0, None
    for _ in range(40):
        r = chat(gov["urls"][0], key, max_tokens=10)
        if r.status_code != 200:
            refused = r
            break
        used += r.json()["usage"]["total_tokens"]
    assert refused is not None and refused.status_code == 429
    assert refused.json()["error"]["code"] == "insufficient_quota" and int(refused.headers["retry-after"]) >= 1
    assert 300 <= used < 300 + 30  # at most one request (<= 30 tokens here) past the line
    time.sleep(0.3)  # usage is written when each request ends
    out = cli("usage", "--tenant", "budgeted", "--csv", redis_url=gov["redis"].url)
    rows = [line.split(",") for line in out.strip().splitlines()[1:]]
    assert sum(int(row[5]) + int(row[4]) for row in rows) == used
    assert float(rows[0][6]) > 0  # priced


def test_audit_log_records_requests_and_verify_catches_tampering(gov, tmp_path):
    key, key_id = create_key(gov, "acme")
    assert chat(gov["urls"][1], key).status_code == 200
    assert chat(gov["urls"][1], key, model="assistant").status_code == 403
    path = gov["root"] / "audit-0.jsonl"  # the second replica's log
    assert wait_until(lambda: path.exists() and path.read_text().count(key_id) >= 2, 5)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    mine = [r["fields"] for r in records if r["fields"].get("key_id") == key_id]
    assert [(f["decision"], f["status"]) for f in mine[-2:]] == [("allowed", "ok"), ("refused", "permission_denied")]
    assert "hello there" not in path.read_text()  # never the prompt
    ok = subprocess.run([sys.executable, "-m", "llmesh", "audit", "verify", "--file", str(path)],
                        capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    lines = path.read_text().splitlines(keepends=True)
    n = next(i for i, line in enumerate(lines) if key_id in line)
    lines[n] = lines[n].replace('"prompt_tokens":', '"prompt_tokens":1', 1)  # an edited count
    tampered = tmp_path / "audit.jsonl"
    tampered.write_text("".join(lines))
    bad = subprocess.run([sys.executable, "-m", "llmesh", "audit", "verify", "--file", str(tampered)],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 1 and f"line {n + 1}" in bad.stdout + bad.stderr, bad.stdout + bad.stderr


def test_redis_down_falls_back_to_local_limits(gov):
    key, _ = create_key(gov, "acme")
    assert chat(gov["urls"][1], key).status_code == 200  # key record cached from the store
    gov["redis"].stop()
    try:
        ok = [chat(gov["urls"][1], key).status_code for _ in range(5)]
        assert ok == [200] * 5
    finally:
        gov["redis"].start()
        assert wait_until(lambda: port_open(gov["redis"].port), 10)
