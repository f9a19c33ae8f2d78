"""Internal trust across processes, LLMESH_TRUST=token, each service with its own certificate
(llmesh.rpc.pki): the mesh serves (the engine registers, the gateway answers), while a
registration without identity is UNAUTHENTICATED, an engine identity reporting another
endpoint is PERMISSION_DENIED, an unauthenticated UnloadModel is refused and the model stays;
a service told to use tokens without certificate files does not start."""

from __future__ import annotations

import signal
import time

import grpc
import pytest
from openai import OpenAI

from llmesh.rpc.identity import Credentials, Identity
from llmesh.rpc.pki import ensure_pki
from llmesh.testing import Service, free_ports, wait_until
from llmesh.v1 import engine_pb2, engine_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.e2e.conftest import sim_engine

IDENTITIES = [("scheduler", "scheduler"), ("engine", "engine-0"), ("engine", "engine-1"), ("gateway", "gateway"),
              ("modelmgr", "modelmgr"), ("cli", "cli")]


def _env(files) -> dict[str, str]:
    return {"LLMESH_TRUST": "token", "LLMESH_TLS_CA_FILE": str(files.ca_file),
            "LLMESH_TLS_CERT_FILE": str(files.cert_file), "LLMESH_TLS_KEY_FILE": str(files.key_file)}


class TokenMesh:
    def __init__(self, d):
        self.files = ensure_pki(d / "pki", IDENTITIES)
        sched, eng, gw, http = free_ports(4)
        self.scheduler, self.engine = f"127.0.0.1:{sched}", f"127.0.0.1:{eng}"
        self.http_url = f"http://127.0.0.1:{http}"
        self.services = [
            Service("llmesh.scheduler", {**_env(self.files["scheduler"]), "LLMESH_SCHEDULER_PORT": str(sched)},
                    d / "scheduler.log"),
            sim_engine("engine-0", self.engine, d / "engine.log", env=_env(self.files["engine-0"]),
                       scheduler_address=self.scheduler),
            Service("llmesh.gateway", {**_env(self.files["gateway"]), "LLMESH_GATEWAY_PORT": str(gw),
                                       "LLMESH_GATEWAY_HTTP_PORT": str(http),
                                       "LLMESH_GATEWAY_SCHEDULER_ADDRESS": self.scheduler,
                                       "LLMESH_GATEWAY_MODELMGR_ADDRESS": "", "LLMESH_GATEWAY_CACHE_ADDRESS": ""},
                    d / "gateway.log")]

    def identity(self, instance: str) -> Identity:
        f = self.files[instance]
        return Identity(dict((i, s) for s, i in IDENTITIES)[instance], "token",
                        Credentials.load(f.ca_file, f.cert_file, f.key_file))

    def metadata(self, instance: str, method: str, audience: str):
        return self.identity(instance).call_metadata(method, audience)

    def endpoints(self) -> list:
        with grpc.insecure_channel(self.scheduler) as ch:
            return list(scheduler_pb2_grpc.SchedulerStub(ch).ListEndpoints(
                scheduler_pb2.ListEndpointsRequest(), timeout=5,
                metadata=self.metadata("cli", "/llmesh.v1.Scheduler/ListEndpoints", "scheduler")).endpoints)

    def logs(self) -> str:
        return "\n".join(s.log_path.read_text() for s in self.services if s.log_path.exists())


@pytest.fixture(scope="module")
def token_mesh(tmp_path_factory):
    mesh = TokenMesh(tmp_path_factory.mktemp("identity"))
    for service in mesh.services:
        service.start()
    try:
        assert wait_until(lambda: _up(mesh), 60), mesh.logs()
        yield mesh
    finally:
        for service in reversed(mesh.services):
            service.stop(signal.SIGTERM)


def _up(mesh: TokenMesh) -> bool:
    try:
        if not any(e.endpoint_id == "engine-0" and e.healthy for e in mesh.endpoints()):
            return False
        OpenAI(base_url=mesh.http_url + "/v1", api_key="unused", max_retries=0, timeout=5).models.list()
        return True
    except Exception:  # noqa: BLE001 - not up yet
        return False


def _report(address: str, endpoint_id: str, metadata=()) -> grpc.RpcError:
    report = scheduler_pb2.EngineReport(endpoint_id=endpoint_id, address="127.0.0.1:1", backend="sim",
                                        models=["sim-small"])
    with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError) as info:
        scheduler_pb2_grpc.SchedulerStub(ch).Report(iter([report]), metadata=metadata, timeout=5)
    return info.value


def test_the_mesh_with_identities_serves(token_mesh):
    client = OpenAI(base_url=token_mesh.http_url + "/v1", api_key="unused", max_retries=0)
    for _ in range(20):  # the gateway's endpoint table follows the scheduler's
        try:
            out = client.chat.completions.create(model="sim-small", max_tokens=3,
                                                 messages=[{"role": "user", "content": "x"}])
            break
        except Exception:  # noqa: BLE001
            time.sleep(0.25)
    assert out.choices[0].message.content, token_mesh.logs()


def test_a_registration_without_identity_is_unauthenticated(token_mesh):
    err = _report(token_mesh.scheduler, "rogue")
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err.details()
    assert not any(e.endpoint_id == "rogue" for e in token_mesh.endpoints())


@pytest.mark.parametrize("endpoint_id", ["rogue", "engine-0"])
def test_an_engine_cannot_report_another_endpoint(token_mesh, endpoint_id):
    metadata = token_mesh.metadata("engine-1", "/llmesh.v1.Scheduler/Report", "scheduler")
    err = _report(token_mesh.scheduler, endpoint_id, metadata)
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED, err.details()
    assert [e.address for e in token_mesh.endpoints() if e.endpoint_id == "engine-0"] == [token_mesh.engine]


def test_an_unauthenticated_unload_is_refused_and_the_model_stays(token_mesh):
    unload = "/llmesh.v1.Engine/UnloadModel"
    with grpc.insecure_channel(token_mesh.engine) as ch:
        engine = engine_pb2_grpc.EngineStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            engine.UnloadModel(engine_pb2.UnloadModelRequest(name="sim-small"), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:  # the gateway's identity does not open it either
            engine.UnloadModel(engine_pb2.UnloadModelRequest(name="sim-small"), timeout=5,
                               metadata=token_mesh.metadata("gateway", unload, "engine"))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        loaded = engine.ListLoadedModels(engine_pb2.ListLoadedModelsRequest(), timeout=5, metadata=token_mesh.metadata(
            "modelmgr", "/llmesh.v1.Engine/ListLoadedModels", "engine"))
        assert "sim-small" in str(loaded)
        # the modelmgr's identity gets past the check (and to the engine's own answer)
        with pytest.raises(grpc.RpcError) as info:
            engine.UnloadModel(engine_pb2.UnloadModelRequest(name="no-such-model"), timeout=5,
                               metadata=token_mesh.metadata("modelmgr", unload, "engine"))
        assert info.value.code() not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


def test_token_trust_without_certificate_files_does_not_start(tmp_path):
    port = free_ports(1)[0]
    scheduler = Service("llmesh.scheduler", {"LLMESH_SCHEDULER_PORT": str(port), "LLMESH_TRUST": "token"},
                        tmp_path / "scheduler.log")
    scheduler.start()
    try:
        assert wait_until(lambda: scheduler.proc.poll() is not None, 20)
        assert scheduler.proc.returncode != 0
        assert "LLMESH_TLS_CA_FILE" in scheduler.log_path.read_text()
    finally:
        scheduler.stop(signal.SIGTERM)
