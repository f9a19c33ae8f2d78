"""Bad input never gets a 5xx: generated request bodies (hypothesis) against a running
gateway (sim engine) answer 2xx or a 4xx in OpenAI's error body; a handful of
hostile shapes (huge, deeply nested, invalid UTF-8, 10,000 messages) too."""

from __future__ import annotations

import asyncio
import json

import random
import socket
import time

import grpc
import httpx
import pytest
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmesh.rpc.health import health_status
from llmesh.testing import Mesh, free_layout
from llmesh.v1 import cache_pb2, engine_pb2, gateway_pb2, modelmgr_pb2, scheduler_pb2

MODEL = "sim-small"
FIELDS = ("model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "stop", "seed", "n", "stream", "stream_options", "user")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad-input")
    mesh = Mesh(layout=free_layout(n_engines=1), engines="sim", model_dir=d / "models", log_dir=d / "logs",
                env={"LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": "0", "LLMESH_ENGINE_SIM_OUTPUT_TOKENS": "3",
                     "LLMESH_GATEWAY_BODY_TIMEOUT_S": "1"})
    mesh.start(timeout_s=60)
    yield mesh
    assert mesh.stop() == 0, mesh.logs()


@pytest.fixture(scope="module")
def gateway(mesh):
    with httpx.Client(base_url=mesh.layout.http_url, timeout=30) as http:
        yield http


def check(resp: httpx.Response) -> None:
    assert resp.status_code < 500, (resp.status_code, resp.text[:500])
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert err["message"] and err["type"], err
        assert set(err) == {"message", "type", "param", "code"}


# Any JSON value, integers far beyond 64 bits and strings with lone surrogates included.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", ""]) | json_values,
     "content": st.text(max_size=30) | json_values}), max_size=4) | json_values
base_chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@st.composite
def chat_bodies(draw) -> dict:
    """A valid request with some of its fields replaced by arbitrary values."""
    body = dict(base_chat)
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
        body[name] = draw(messages if name == "messages" else json_values)
    return body


@settings(max_examples=700, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=chat_bodies())
def test_generated_chat_bodies_get_no_5xx(gateway, body):
    check(gateway.post("/v1/chat/completions", content=json.dumps(body)))


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.fixed_dictionaries({"model": st.just(MODEL) | json_values, "prompt": st.text() | json_values},
                                  optional={k: json_values for k in ("max_tokens", "seed", "stop", "temperature")}))
def test_generated_completion_bodies_get_no_5xx(gateway, body):
    check(gateway.post("/v1/completions", content=json.dumps(body)))


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=st.binary(max_size=200))
def test_random_bytes_get_no_5xx(gateway, raw):
    check(gateway.post("/v1/chat/completions", content=raw))


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "seed"])
@pytest.mark.parametrize("value", [2**64, -(2**64), 2**100, 2**63, 2**32])
def test_integers_beyond_the_wire_type_are_400(gateway, field, value):
    resp = gateway.post("/v1/chat/completions", content=json.dumps({**base_chat, field: value}))
    if field == "seed" and value == 2**32:
        assert resp.status_code == 200
        return
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["type"] == "invalid_request_error"


def test_invalid_utf8_is_400(gateway):
    raw = json.dumps(base_chat).encode().replace(b"hi", b"h\xff\xfei")
    check(resp := gateway.post("/v1/chat/completions", content=raw))
    assert resp.status_code == 400


def test_lone_surrogate_is_400(gateway):
    raw = json.dumps(base_chat).replace("hi", "\\ud800")
    resp = gateway.post("/v1/chat/completions", content=raw)
    assert resp.status_code == 400, resp.text


def test_deep_nesting_is_400(gateway):
    raw = '{"model": "%s", "messages": %s}' % (MODEL, "[" * 100_000 + "]" * 100_000)
    resp = gateway.post("/v1/chat/completions", content=raw)
    assert resp.status_code == 400, resp.text


def test_huge_body_is_400(gateway):
    raw = json.dumps({**base_chat, "user": "x" * (17 << 20)})
    resp = gateway.post("/v1/chat/completions", content=raw)
    assert resp.status_code == 400, resp.text
    assert "larger than" in resp.json()["error"]["message"]


def test_a_chunked_body_is_read_whole_and_a_huge_one_is_400(gateway):
    raw = json.dumps(base_chat).encode()
    resp = gateway.post("/v1/chat/completions", content=iter([raw[:7], raw[7:]]))  # no Content-Length
    assert resp.status_code == 200, resp.text
    huge = json.dumps({**base_chat, "user": "x" * (17 << 20)}).encode()
    resp = gateway.post("/v1/chat/completions", content=(huge[i:i + (1 << 20)] for i in range(0, len(huge), 1 << 20)))
    assert resp.status_code == 400, resp.text
    assert "larger than" in resp.json()["error"]["message"]


@pytest.mark.parametrize("extra", [{}, {"max_tokens": "many"}, {"logit_bias": {"1": 2}}, {"n": 17},
                                   {"messages": [{"role": "user", "content": [{"type": "image"}]}]}],
                         ids=["ok", "type", "unsupported", "n", "part"])
def test_a_body_over_the_offload_size_answers_as_a_small_one(gateway, extra):
    """A body over LLMESH_GATEWAY_BODY_OFFLOAD_BYTES (256 KiB) is parsed in the guard workers, a
    small one on the event loop: the same answer (status, message, param)."""
    small = {**base_chat, **extra}
    large = {**small, "metadata": {"pad": "x" * (1 << 20)}}  # a field that changes nothing
    answers = [gateway.post("/v1/chat/completions", json=body) for body in (small, large)]
    assert [r.status_code for r in answers] == [200 if not extra else 400] * 2, answers[1].text
    if extra:
        assert answers[0].json()["error"] == answers[1].json()["error"]
    else:
        assert answers[0].json()["choices"] == answers[1].json()["choices"]


def test_a_slow_client_gets_408_and_the_gateway_serves_on(mesh, gateway):
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 200\r\n\r\n{\"model\": ")
    with socket.create_connection(("127.0.0.1", mesh.layout.http_port), timeout=10) as sock:
        sock.sendall(head)  # ... and the rest never comes
        started = time.monotonic()
        reply = b""
        while chunk := sock.recv(65536):  # the gateway closes the connection after its answer
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert 0.5 < time.monotonic() - started < 6
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    check(gateway.post("/v1/chat/completions", content=json.dumps(base_chat)))


def test_ten_thousand_messages_are_a_clear_4xx(gateway):
    body = {**base_chat, "messages": [{"role": "user", "content": f"message {i}"} for i in range(10_000)]}
    resp = gateway.post("/v1/chat/completions", content=json.dumps(body))
    check(resp)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "messages"


# Every gRPC method of every service: random bytes, truncated varints, a wrong wire
# type, invalid UTF-8 in a string field. A payload that fails to parse is
# INVALID_ARGUMENT; one that happens to parse is judged by the method (INVALID_ARGUMENT,
# NOT_FOUND...). Never UNKNOWN or INTERNAL (an unhandled error), and every service
# still answers its health check afterwards.
SERVICES = {"Gateway": (gateway_pb2, "gateway"), "Engine": (engine_pb2, "engine"),
            "Scheduler": (scheduler_pb2, "scheduler"), "ModelManager": (modelmgr_pb2, "modelmgr"),
            "Cache": (cache_pb2, "cache")}
HOSTILE = [b"\xff", b"\x80\x80\x80", b"\x0a\x05\xff\xfe\xfd\xfc\xfb", b"\x0b", b"\x0c",
           b"\x0a\xff\xff\xff\xff\x0f", b"\x08" + b"\xff" * 10 + b"\x01"]


def _payloads(seed: int, n: int = 25) -> list[bytes]:
    rng = random.Random(seed)
    return HOSTILE + [rng.randbytes(rng.randrange(1, 300)) for _ in range(n)]


def _parses(method, raw: bytes) -> bool:
    try:
        GetMessageClass(method.input_type).FromString(raw)
    except DecodeError:
        return False
    return True


def _address(mesh: Mesh, role: str) -> str:
    return mesh.layout.engine_address(0) if role == "engine" else mesh.layout.address(role)


def _methods():
    for service, (module, role) in SERVICES.items():
        for method in module.DESCRIPTOR.services_by_name[service].methods:
            yield pytest.param(role, method, id=f"{service}.{method.name}")


@pytest.mark.parametrize("role,method", list(_methods()))
def test_random_bytes_on_every_grpc_method_answer_cleanly(mesh, role, method):
    path = f"/{method.containing_service.full_name}/{method.name}"
    codes = []
    with grpc.insecure_channel(_address(mesh, role)) as ch:
        for raw in _payloads(sum(path.encode())):
            ident = lambda b: b  # noqa: E731 - raw bytes on the wire
            try:
                if method.client_streaming:
                    call = (ch.stream_stream if method.server_streaming else ch.stream_unary)(
                        path, request_serializer=ident, response_deserializer=ident)
                    result = call(iter([raw, raw]), timeout=3)
                else:
                    call = (ch.unary_stream if method.server_streaming else ch.unary_unary)(
                        path, request_serializer=ident, response_deserializer=ident)
                    result = call(raw, timeout=3)
                if method.server_streaming:
                    for _ in result:
                        pass
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())
                assert exc.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
                                          grpc.StatusCode.UNAVAILABLE), (path, raw, exc.code(), exc.details())
                if not _parses(method, raw):
                    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, raw, exc.details())
                    assert "not a valid protobuf message" in exc.details()
    assert grpc.StatusCode.INVALID_ARGUMENT in codes and not all(map(lambda r: _parses(method, r), HOSTILE))
    assert asyncio.run(health_status(_address(mesh, role))) == "SERVING"
