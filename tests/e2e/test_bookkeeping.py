"""Bookkeeping that hostile input can neither bypass nor blow up, against a real mesh
(`llmesh up`, one sim engine, an API key so that auth is on):

- every request gets exactly one audit record under the id it was served with, whatever
  its x-request-id (hypothesis: printable, unicode, long, empty, absent, sent twice, reused);
  an id the gateway replaced is kept, escaped and cut short, as ``client_request_id``;
- so does every request its front refuses before anything else reads it, whatever its body
  and id (hypothesis): on HTTP bytes that are not JSON, JSON that is not a request, nesting
  too deep, a body over the limit, a body that never finishes arriving; on gRPC bytes that are
  not the method's message and messages that break the protos' rules;
- 10,000 requests with made-up model names and made-up API keys leave the gateway's
  Prometheus series and its key cache at a bound that does not grow with N."""

from __future__ import annotations

import asyncio
import json
import random
import re
import secrets
import socket
import string
import time
import uuid

import aiohttp
import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from llmesh.keys import FileKeyStore, new_key
from llmesh.request_id import kept, safe
from llmesh.testing import Mesh, free_layout, wait_until
from llmesh.gateway.fronts.http import MAX_BODY
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

MODEL = "sim-small"
KNOWN_KEYS, UNKNOWN_KEY_IDS = 4096, 1024  # the authenticator's bounds
CHAT = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("bookkeeping")
    state = d / "logs" / "state"  # the Mesh's LLMESH_STATE_DIR: keys and the audit log
    state.mkdir(parents=True)
    plaintext, record = new_key("acme")
    asyncio.run(FileKeyStore(state / "keys.json").put(record))
    (d / "llmesh.yaml").write_text("tenants: {acme: {}}\n")  # the key's tenant has a grant
    mesh = Mesh(layout=free_layout(n_engines=1), engines="sim", model_dir=d / "models", log_dir=d / "logs",
                env={"LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": "0", "LLMESH_ENGINE_SIM_OUTPUT_TOKENS": "1",
                     "LLMESH_CONFIG_FILE": str(d / "llmesh.yaml"), "LLMESH_GATEWAY_BODY_TIMEOUT_S": "2"},
                args=["--no-cache"])
    mesh.start(timeout_s=60)
    http = httpx.Client(base_url=mesh.layout.http_url, timeout=30, headers={"authorization": f"Bearer {plaintext}"})
    assert wait_until(lambda: http.post("/v1/chat/completions", json=CHAT).status_code == 200, 20)
    try:
        yield {"mesh": mesh, "http": http, "key": plaintext, "audit": Audit(state / "audit.jsonl")}
    finally:
        http.close()
        assert mesh.stop() == 0, mesh.logs()


class Audit:
    """The gateway's audit log, read as it grows: records by request id."""

    def __init__(self, path):
        self.path = path
        self.offset = 0
        self.by_id: dict[str, list[dict]] = {}
        self.total = 0

    def read(self) -> None:
        if not self.path.exists():
            return
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        for line in data[:end].splitlines():
            fields = json.loads(line)["fields"]
            self.by_id.setdefault(fields["request_id"], []).append(fields)
            self.total += 1

    def wait_for(self, rid: str, count: int, timeout_s: float = 5.0) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while True:
            self.read()
            records = self.by_id.get(rid, [])
            if len(records) >= count or time.monotonic() > deadline:
                return records
            time.sleep(0.02)


served: dict[str, int] = {}  # request id -> requests served under it, in this module


def header_values() -> st.SearchStrategy[str | None]:
    ids = st.sampled_from(["fixed-id-1", "fixed-id-2", "x" * 128])  # reused across requests
    return st.one_of(st.none(), st.just(""), ids, st.text(string.printable, max_size=300), st.text(max_size=300),
                     st.text(st.characters(codec="latin-1"), min_size=100, max_size=3000),
                     st.from_regex(r"[A-Za-z0-9_.:/+=@-]{1,140}", fullmatch=True))


def expect(value: str | None, rid: str) -> str | None:
    """The client_request_id the record should carry for what the server received."""
    if value is None or value == "":
        return None
    return None if rid == value else kept(value)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(value=header_values(), twice=st.booleans())
def test_every_request_has_one_audit_record_whatever_its_request_id(world, value, twice):
    headers = [] if value is None else [(b"x-request-id", value.encode())] * (2 if twice else 1)
    try:
        resp = world["http"].post("/v1/chat/completions", json=CHAT, headers=headers)
    except httpx.LocalProtocolError:
        reject()  # a value HTTP cannot carry (a control character): no request at all
    if resp.status_code == 400 and resp.text == "Invalid HTTP request received.":
        reject()  # the HTTP server refused it as malformed HTTP: it never reached the gateway
    assert resp.status_code == 200, resp.text
    rid = resp.headers["x-request-id"]
    assert safe(rid) and resp.json()["id"].endswith(rid)
    # What the server received: HTTP strips the value's surrounding blanks and reads its bytes as Latin-1.
    received = None if value is None else value.encode().decode("latin-1").strip(" \t")
    if received and safe(received):
        assert rid == received  # a safe id is the client's own
    else:
        assert re.fullmatch(r"[0-9a-f]{32}", rid)
    served[rid] = served.get(rid, 0) + 1
    records = world["audit"].wait_for(rid, served[rid])
    assert len(records) == served[rid]
    assert records[-1].get("client_request_id") == expect(received, rid)
    assert records[-1]["status"] == "ok"


OTHER_HEADERS = ("x-request-timeout", "x-stainless-timeout", "user-agent", "openai-organization", "openai-project",
                 "x-stainless-retry-count", "traceparent", "tracestate", "baggage", "x-llmesh-priority", "x-user",
                 "x-forwarded-for", "idempotency-key", "content-language")


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(extra=st.lists(st.tuples(st.one_of(st.sampled_from(OTHER_HEADERS), st.from_regex(r"x-[a-z0-9-]{1,40}",
                                                                                          fullmatch=True)),
                                header_values().filter(lambda v: v is not None)), max_size=6))
def test_every_request_has_one_audit_record_whatever_its_other_headers(world, extra):
    """Beside the request id: timeouts, trace context, the SDK's own headers, made-up ones, with any
    value a client can send (repeated too). Whatever the gateway answers, served or refused, the
    request has exactly one audit record, under the id it answered with."""
    rid = f"other-headers-{uuid.uuid4().hex}"
    headers = [(b"x-request-id", rid.encode())] + [(name.encode(), value.encode()) for name, value in extra]
    try:
        resp = world["http"].post("/v1/chat/completions", json=CHAT, headers=headers)
    except httpx.LocalProtocolError:
        reject()
    if resp.status_code == 400 and resp.text == "Invalid HTTP request received.":
        reject()
    assert resp.status_code < 500, resp.text
    assert resp.headers["x-request-id"] == rid
    served[rid] = served.get(rid, 0) + 1
    records = world["audit"].wait_for(rid, 1)
    assert len(records) == 1, records
    assert (records[0]["status"] == "ok") == (resp.status_code == 200), (resp.status_code, records[0]["status"])


def test_grpc_request_ids_are_bounded_the_same_way(world):
    mesh = world["mesh"]
    with grpc.insecure_channel(mesh.layout.address("gateway")) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        for value in ("grpc-id-1", "g" * 129, "has spaces, commas", "x" * 4000, "~!#$%^&*(){}[]|;<>?"):
            call = stub.Chat(gateway_pb2.ChatRequest(
                model=MODEL, messages=[common_pb2.ChatMessage(role="user", content="hi")],
                sampling=common_pb2.SamplingParams(max_tokens=1)),
                metadata=(("x-request-id", value), ("authorization", f"Bearer {world['key']}")), timeout=10)
            assert list(call)
            rid = dict(call.trailing_metadata())["x-request-id"]
            assert safe(rid) and (rid == value) == safe(value)
            served[rid] = served.get(rid, 0) + 1
            records = world["audit"].wait_for(rid, served[rid])
            assert len(records) == served[rid]
            assert records[-1].get("client_request_id") == (None if safe(value) else kept(value.strip()))


def encoded(value: object) -> bytes:
    return json.dumps(value).encode()  # integers of any size; a float past the range is Infinity (not JSON)


def bad_bodies() -> st.SearchStrategy[bytes]:
    """Bodies the HTTP front refuses before any stage: not JSON, not UTF-8, JSON that is not a
    request (missing fields, wrong types, values out of range), nesting too deep."""
    request = st.fixed_dictionaries({"model": st.just(MODEL)}, optional={
        "messages": st.one_of(st.just([]), st.just("hi"), st.just([{"role": "wizard", "content": "hi"}]),
                              st.just([{"role": "user"}])),
        "max_tokens": st.one_of(st.integers(max_value=0), st.integers(min_value=2**32), st.text(max_size=5)),
        "n": st.integers(min_value=129), "temperature": st.one_of(st.floats(min_value=2.01), st.just("hot")),
        "stream": st.just("yes")})
    scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=20))
    return st.one_of(
        st.binary(max_size=2000), st.text(max_size=300).map(str.encode), st.sampled_from([b"", b"{", b"[]", b"null"]),
        request.filter(lambda d: "messages" in d and (len(d) > 2 or d["messages"] != [])).map(encoded),
        st.dictionaries(st.text(max_size=10), scalars, max_size=5).map(encoded),
        st.integers(min_value=1000, max_value=200_000).map(lambda n: b"[" * n + b"]" * n),
        st.integers(min_value=300, max_value=5_000).map(lambda n: b'{"model": "m", "messages": ' + b"[" * n))


def audited_once(world, resp_rid: str, received: str | None) -> dict:
    """The one record of a request the front refused, under the id it was answered with."""
    served[resp_rid] = served.get(resp_rid, 0) + 1
    records = world["audit"].wait_for(resp_rid, served[resp_rid])
    assert len(records) == served[resp_rid]
    record = records[-1]
    assert record["decision"] == "refused" and record.get("client_request_id") == expect(received, resp_rid)
    return record


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(body=bad_bodies(), value=header_values(), path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_a_body_the_http_front_refuses_gets_one_audit_record_too(world, body, value, path):
    headers = [(b"content-type", b"application/json")] + ([] if value is None else [(b"x-request-id", value.encode())])
    try:
        resp = world["http"].post(path, content=body, headers=headers)
    except httpx.LocalProtocolError:
        reject()
    if resp.status_code == 400 and resp.text == "Invalid HTTP request received.":
        reject()
    if resp.status_code != 400:
        # a body the front accepts after all (e.g. a message with no content: 200, or 404 for a model
        # that does not exist): served or refused by the pipeline, audited like every request;
        # counted (the bounded-series test below counts every record), then not this test's case
        rid = resp.headers["x-request-id"]
        served[rid] = served.get(rid, 0) + 1
        assert len(world["audit"].wait_for(rid, served[rid])) == served[rid]
        reject()
    assert resp.status_code == 400, resp.text
    received = None if value is None else value.encode().decode("latin-1").strip(" \t")
    record = audited_once(world, resp.headers["x-request-id"], received)
    assert record["status"] == "invalid_argument"
    assert record["operation"] == ("chat" if path == "/v1/chat/completions" else "text_completion")


def test_a_body_over_the_limit_and_a_body_too_slow_get_one_audit_record_each(world):
    mesh = world["mesh"]
    resp = world["http"].post("/v1/chat/completions", content=b" " * (MAX_BODY + 1),
                              headers={"x-request-id": "too-large-1"})
    assert resp.status_code == 400 and resp.headers["x-request-id"] == "too-large-1"
    assert audited_once(world, "too-large-1", "too-large-1")["status"] == "invalid_argument"

    host, port = mesh.layout.http_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:  # half a body, then nothing
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\nx-request-id: too-slow-1\r\n\r\n{\"model\": ")
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 408") and b"too-slow-1" in answer
    record = audited_once(world, "too-slow-1", "too-slow-1")
    assert record["status"] == "deadline_exceeded" and record["reason"] == "request_timeout"


def bad_messages() -> st.SearchStrategy[tuple[str, bytes]]:
    """(method, request bytes) the gRPC front refuses before any stage: bytes that are not the
    method's message, and messages that break the protos' rules."""
    hi = [common_pb2.ChatMessage(role="user", content="hi")]
    broken = st.sampled_from([
        ("Chat", gateway_pb2.ChatRequest(model=MODEL)),  # no messages
        ("Chat", gateway_pb2.ChatRequest(model="", messages=hi)),
        ("Chat", gateway_pb2.ChatRequest(model=MODEL, messages=[common_pb2.ChatMessage(role="wizard", content="x")])),
        ("Chat", gateway_pb2.ChatRequest(model=MODEL, messages=hi, n=1000)),
        ("Chat", gateway_pb2.ChatRequest(model=MODEL, messages=hi, user="u" * 300)),
        ("Chat", gateway_pb2.ChatRequest(model=MODEL, messages=hi,
                                         sampling=common_pb2.SamplingParams(temperature=9, max_tokens=0))),
        ("Complete", gateway_pb2.CompleteRequest(model="")),
        ("Complete", gateway_pb2.CompleteRequest(model=MODEL, prompt="hi", n=1000)),
    ]).map(lambda case: (case[0], case[1].SerializeToString()))
    garbage = st.tuples(st.sampled_from(["Chat", "Complete"]),
                        st.binary(min_size=1, max_size=500).filter(not_a_request))
    return st.one_of(broken, garbage)


def not_a_request(raw: bytes) -> bool:
    """Bytes that do not parse as a ChatRequest (most random bytes): the interceptor refuses them."""
    try:
        gateway_pb2.ChatRequest.FromString(raw)
        gateway_pb2.CompleteRequest.FromString(raw)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError, or a RecursionError on deep groups
        return True
    return False


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(case=bad_messages(), value=st.one_of(st.none(), st.from_regex(r"[!-~]{1,300}", fullmatch=True)))
def test_a_message_the_grpc_front_refuses_gets_one_audit_record_too(world, case, value):
    method, raw = case
    metadata = [("authorization", f"Bearer {world['key']}")] + ([] if value is None else [("x-request-id", value)])
    with grpc.insecure_channel(world["mesh"].layout.address("gateway")) as ch:
        call = ch.unary_stream(f"/llmesh.v1.Gateway/{method}")(raw, metadata=metadata, timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    record = audited_once(world, dict(info.value.trailing_metadata())["x-request-id"], value)
    assert record["status"] == "invalid_argument"
    assert record["operation"] == ("chat" if method == "Chat" else "text_completion")


def metric_lines(url: str) -> list[str]:
    return [line for line in httpx.get(url).text.splitlines() if line and not line.startswith("#")]


async def flood(url: str, key: str, n: int, rng: random.Random) -> dict[int, int]:
    """``n`` requests, 64 at a time: a third with made-up keys and models, a third with the
    real key and made-up models (one in ten the real model), a third with made-up keys and
    the real model; the status codes counted."""
    statuses: dict[int, int] = {}
    queue = list(range(n))

    async def worker(session: aiohttp.ClientSession) -> None:
        while queue:
            i = queue.pop()
            model = f"model-{rng.getrandbits(64):x}-{'z' * rng.randrange(200)}"
            credential = key if i % 3 == 1 else f"llm_{secrets.token_hex(6)}_{secrets.token_urlsafe(16)}"
            body = {**CHAT, "model": MODEL if i % 3 == 2 or i % 30 == 1 else model}
            async with session.post(f"{url}/v1/chat/completions", json=body,
                                    headers={"authorization": f"Bearer {credential}"}) as resp:
                await resp.read()
                statuses[resp.status] = statuses.get(resp.status, 0) + 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
        await asyncio.gather(*(worker(session) for _ in range(64)))
    return statuses


def test_series_and_key_cache_stay_bounded_under_10000_made_up_models_and_keys(world):
    mesh = world["mesh"]
    metrics_url = f"http://127.0.0.1:{mesh.layout.metrics_port('gateway')}/metrics"
    rng = random.Random(26)
    started = time.monotonic()
    first = asyncio.run(flood(mesh.layout.http_url, world["key"], 1000, rng))
    after_1000 = metric_lines(metrics_url)
    rest = asyncio.run(flood(mesh.layout.http_url, world["key"], 9000, rng))
    elapsed = time.monotonic() - started
    after_10000 = metric_lines(metrics_url)
    statuses = {code: first.get(code, 0) + rest.get(code, 0) for code in {*first, *rest}}
    assert sum(statuses.values()) == 10_000 and set(statuses) == {200, 401, 404}, statuses
    assert elapsed < 60, elapsed

    def series(lines: list[str]) -> set[str]:
        return {line.rsplit(" ", 1)[0] for line in lines if line.startswith("llmesh_")}

    assert series(after_10000) == series(after_1000)  # nothing new after the first thousand
    assert len(series(after_10000)) < 400
    assert not [line for line in after_10000 if "model-" in line]  # no made-up name became a label
    assert any('model="unknown"' in line for line in after_10000)
    cache = {m["kind"]: float(line.rsplit(" ", 1)[1]) for line in after_10000
             if line.startswith("llmesh_auth_cache_entries{") and (m := dict(re.findall(r'(\w+)="([^"]*)"', line)))}
    assert cache == {"known": 1, "unknown": UNKNOWN_KEY_IDS}

    # ... and each of them has exactly one audit record (each got a new id).
    audit = world["audit"]
    assert wait_until(lambda: (audit.read(), audit.total)[1] >= sum(served.values()) + 10_000 + 1, 10)
    assert audit.total == sum(served.values()) + 10_000 + 1  # +1: the fixture's readiness request
