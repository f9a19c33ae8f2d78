"""Internal trust: with a service secret the mesh serves (engines register with a
signed token), while a rogue registration and an unauthenticated UnloadModel are
refused; without a secret and outside local trust, admin RPCs are refused."""

from __future__ import annotations

import secrets
import signal

import grpc
import pytest
from openai import OpenAI

from llmesh.rpc.identity import TOKEN_KEY, Identity, mint
from llmesh.testing import Mesh, Service, free_layout, free_ports, wait_until
from llmesh.v1 import engine_pb2, engine_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.e2e.conftest import endpoints


@pytest.fixture(scope="module")
def secret_mesh(tmp_path_factory):
    d = tmp_path_factory.mktemp("identity")
    secret = d / "service-secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    mesh = Mesh(layout=free_layout(n_engines=1), engines="sim", model_dir=d / "models", log_dir=d / "logs",
                env={"LLMESH_SERVICE_SECRET_FILE": str(secret), "LLMESH_LOCAL_TRUST": "0"})
    mesh.start(timeout_s=60)
    mesh.secret = secret.read_bytes().strip()
    yield mesh
    assert mesh.stop() == 0, mesh.logs()


def _rogue_report(address: str, metadata=()) -> grpc.RpcError:
    report = scheduler_pb2.EngineReport(endpoint_id="rogue", address="127.0.0.1:1", backend="sim",
                                        models=["sim-small"])
    with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError) as info:
        scheduler_pb2_grpc.SchedulerStub(ch).Report(iter([report]), metadata=metadata, timeout=5)
    return info.value


def test_the_mesh_with_a_secret_serves(secret_mesh):
    assert wait_until(lambda: any(e.endpoint_id == "engine-0" and e.healthy for e in endpoints(secret_mesh)), 10)
    client = OpenAI(base_url=secret_mesh.layout.http_url + "/v1", api_key="unused", max_retries=0)
    out = client.chat.completions.create(model="sim-small", max_tokens=3, messages=[{"role": "user", "content": "x"}])
    assert out.choices[0].message.content


@pytest.mark.parametrize("metadata", [(), ((TOKEN_KEY, mint(b"w" * 32, "engine", 2e9)),),
                                      ((TOKEN_KEY, "v1.engine.1.00"),)], ids=["none", "wrong-secret", "forged"])
def test_a_rogue_registration_is_refused(secret_mesh, metadata):
    err = _rogue_report(secret_mesh.layout.address("scheduler"), metadata)
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err.details()
    assert not any(e.endpoint_id == "rogue" for e in endpoints(secret_mesh))


def test_an_unauthenticated_unload_is_refused_and_the_model_stays(secret_mesh):
    address = secret_mesh.layout.engine_address(0)
    with grpc.insecure_channel(address) as ch:
        engine = engine_pb2_grpc.EngineStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            engine.UnloadModel(engine_pb2.UnloadModelRequest(name="sim-small"), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        loaded = engine.ListLoadedModels(engine_pb2.ListLoadedModelsRequest(), timeout=5)
        assert "sim-small" in str(loaded)
        # The same call with the mesh's token gets past the check (and to the engine's own answer).
        token = Identity("modelmgr", secret_mesh.secret).token()
        with pytest.raises(grpc.RpcError) as info:
            engine.UnloadModel(engine_pb2.UnloadModelRequest(name="no-such-model"), timeout=5,
                               metadata=[(TOKEN_KEY, token)])
        assert info.value.code() not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


def test_without_a_secret_or_local_trust_registration_is_refused(tmp_path):
    port = free_ports(1)[0]
    scheduler = Service("llmesh.scheduler", {"LLMESH_SCHEDULER_PORT": str(port), "LLMESH_LOCAL_TRUST": "0"},
                        tmp_path / "scheduler.log")
    scheduler.start()
    try:
        address = f"127.0.0.1:{port}"
        assert wait_until(lambda: _probe(address), 20)
        err = _rogue_report(address)
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "LLMESH_SERVICE_SECRET_FILE" in err.details()
    finally:
        scheduler.stop(signal.SIGTERM)


def _probe(address: str) -> bool:
    with grpc.insecure_channel(address) as ch:
        try:
            scheduler_pb2_grpc.SchedulerStub(ch).ListEndpoints(scheduler_pb2.ListEndpointsRequest(), timeout=1)
            return True
        except grpc.RpcError:
            return False
