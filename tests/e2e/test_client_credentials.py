"""llmesh.client's credentials and retries on a sim mesh with a key store on its own
redis-server: a key made with `llmesh keys create`, a gateway that is down when the
call starts (retried until it is up) and one killed mid-stream (never retried)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from llmesh.client import Client, PermissionDeniedError, RetryPolicy, UnauthenticatedError, UnavailableError
from llmesh.testing import Mesh, RedisServer, Service, free_layout, free_ports, port_open, wait_until

SIM = "sim-small"
HI = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def creds_mesh(tmp_path_factory, real_model_dir):
    root = tmp_path_factory.mktemp("client-creds")
    redis_server = RedisServer(root / "redis")
    redis_server.start()
    config = root / "llmesh.yaml"
    config.write_text(json.dumps({"tenants": {"acme": {"models": [SIM]}}}))
    env = {"LLMESH_REDIS_URL": redis_server.url, "LLMESH_CONFIG_FILE": str(config),
           "LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": "50"}
    mesh = Mesh(layout=free_layout(n_engines=1), engines="sim", model_dir=real_model_dir,
                log_dir=root / "logs", env=env, args=["--no-cache"])
    try:  # the redis-server stops even if the mesh does not start
        mesh.start()
        out = subprocess.run([sys.executable, "-m", "llmesh", "keys", "create", "--tenant", "acme",
                              "--redis-url", redis_server.url], capture_output=True, text=True, timeout=30,
                             stdin=subprocess.DEVNULL)
        assert out.returncode == 0, out.stderr
        yield {"mesh": mesh, "env": env, "root": root, "key": out.stdout.strip().splitlines()[-1]}
    finally:
        mesh.stop()
        redis_server.stop()


def replica(creds_mesh, name: str) -> tuple[Service, str]:
    """A second gateway process of the mesh (not started), and its gRPC address."""
    layout = creds_mesh["mesh"].layout
    grpc_port, http_port, metrics_port = free_ports(3)
    svc = Service("llmesh.gateway", {
        **creds_mesh["env"], "LLMESH_GATEWAY_PORT": str(grpc_port), "LLMESH_GATEWAY_HTTP_PORT": str(http_port),
        "LLMESH_GATEWAY_METRICS_PORT": str(metrics_port),
        "LLMESH_GATEWAY_SCHEDULER_ADDRESS": layout.address("scheduler"),
        "LLMESH_GATEWAY_MODELMGR_ADDRESS": layout.address("modelmgr"), "LLMESH_GATEWAY_CACHE_ADDRESS": ""},
        creds_mesh["root"] / f"{name}.log")
    return svc, f"127.0.0.1:{grpc_port}"


def test_the_key_travels_as_authorization_metadata(creds_mesh):
    address = creds_mesh["mesh"].layout.address("gateway")
    with Client(address, timeout_s=30) as anonymous:
        with pytest.raises(UnauthenticatedError) as info:
            anonymous.chat(model=SIM, messages=HI, max_tokens=3)
        assert info.value.reason == "missing_api_key"
    with Client(address, credential="llm_not_a_key", timeout_s=30) as wrong:
        with pytest.raises(UnauthenticatedError) as info:
            wrong.list_models()
        assert info.value.reason == "invalid_api_key"
    with Client(address, credential=creds_mesh["key"], timeout_s=30) as client:
        assert client.list_models() == [SIM]
        result = client.chat(model=SIM, messages=HI, max_tokens=3)
        assert result.usage.completion_tokens == 3 and result.text
        with pytest.raises(PermissionDeniedError) as info:  # acme's grant is sim-small only
            client.chat(model="smollm2-135m-instruct", messages=HI, max_tokens=3)
        assert info.value.reason == "model_not_allowed" and info.value.param == "model"
        completion = client.complete(model=SIM, prompt="hello there", max_tokens=3)
        assert completion.usage.completion_tokens == 3 and completion.text
    with Client(address, timeout_s=30) as anonymous:
        with pytest.raises(UnauthenticatedError):
            anonymous.complete(model=SIM, prompt="hello there", max_tokens=3)


def test_the_chat_cli_sends_the_key_from_the_environment(creds_mesh):
    def llmesh_chat(env: dict) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "llmesh", "chat", "--base-port",
                               str(creds_mesh["mesh"].layout.base_port), "-m", SIM, "--max-tokens", "3", "hello"],
                              capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, env=env)
    keyless = {k: v for k, v in os.environ.items() if k != "LLMESH_API_KEY"}
    out = llmesh_chat({**keyless, "LLMESH_API_KEY": creds_mesh["key"]})
    assert out.returncode == 0 and out.stdout.strip() and "+ 3 completion tokens]" in out.stderr, out.stderr
    out = llmesh_chat(keyless)
    assert out.returncode == 1 and "llmesh chat: UNAUTHENTICATED: " in out.stderr


def test_a_gateway_down_when_the_call_starts_is_retried_until_it_serves(creds_mesh):
    svc, address = replica(creds_mesh, "late-gateway")
    policy = RetryPolicy(max_attempts=200, initial_backoff_s=0.05, max_backoff_s=0.25)
    starter = threading.Timer(1.0, svc.start)
    try:
        with Client(address, credential=creds_mesh["key"], retry=policy, timeout_s=90) as client:
            starter.start()
            stream = client.stream(model=SIM, messages=HI, max_tokens=4)
            chunks = list(stream)
        assert stream.attempts > 1  # the first attempts met a closed port
        assert chunks[-1].usage.completion_tokens == 4
    finally:
        starter.cancel()
        starter.join()
        svc.stop()


def test_a_gateway_killed_after_the_first_token_is_not_retried(creds_mesh):
    svc, address = replica(creds_mesh, "doomed-gateway")
    svc.start()
    try:
        assert wait_until(lambda: port_open(int(address.rsplit(":", 1)[1])), 30)
        policy = RetryPolicy(max_attempts=50, initial_backoff_s=0.05)
        with Client(address, credential=creds_mesh["key"], retry=policy, timeout_s=60) as client:
            # the fresh gateway may not know the engines yet: UNAVAILABLE before any token is retried
            stream = client.stream(model=SIM, messages=HI, max_tokens=60)  # 50 ms a token: 3 s
            first = next(stream)
            assert first.role == "assistant"
            attempts = stream.attempts
            began = time.monotonic()
            svc.proc.send_signal(signal.SIGKILL)
            with pytest.raises(UnavailableError):
                for _ in stream:
                    pass
            assert stream.attempts == attempts  # no RPC started after tokens were yielded
            assert time.monotonic() - began < 2.0
            with pytest.raises(StopIteration):
                next(stream)
    finally:
        svc.stop()
