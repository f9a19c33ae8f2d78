"""What decides whether and how a gateway runs as several worker processes: the typed
setting and its checks, the CLI flag, per-worker state (audit chains), SO_REUSEPORT."""

from __future__ import annotations

import socket

import pytest
from pydantic import ValidationError

from llmesh.cli.layout import Layout
from llmesh.cli.up import MeshSpec, plan
from llmesh.gateway.__main__ import _parser, worker_settings, workers_problem
from llmesh.gateway.config import GatewaySettings
from llmesh.rpc.server import server_options
from llmesh.settings import MeshSettings
from llmesh.ports import listen_socket


def test_one_worker_by_default_and_from_the_environment(monkeypatch):
    assert GatewaySettings().workers == 1
    monkeypatch.setenv("LLMESH_GATEWAY_WORKERS", "4")
    assert GatewaySettings().workers == 4
    assert GatewaySettings(workers=2).workers == 2  # the --workers flag wins over the environment
    assert _parser().parse_args(["--workers", "3"]).workers == 3
    assert _parser().parse_args([]).workers is None


@pytest.mark.parametrize("bad", [{"workers": 0}, {"workers": 2, "port": 0}, {"workers": 2, "http_port": 0}])
def test_bad_worker_settings_are_refused(bad):
    with pytest.raises(ValidationError):
        GatewaySettings(**bad)


def test_several_workers_need_redis_for_shared_limits():
    problem = workers_problem(GatewaySettings(workers=2), MeshSettings(redis_url=None))
    assert problem and "LLMESH_REDIS_URL" in problem
    assert workers_problem(GatewaySettings(workers=2), MeshSettings(redis_url="redis://127.0.0.1:6379/0")) is None
    assert workers_problem(GatewaySettings(workers=1), MeshSettings(redis_url=None)) is None


def test_each_worker_writes_its_own_audit_chain(tmp_path):
    mesh = MeshSettings(state_dir=tmp_path)
    assert worker_settings(GatewaySettings(workers=2), mesh, 1).audit_file == tmp_path / "audit.worker1.jsonl"
    custom = GatewaySettings(workers=2, audit_file=tmp_path / "logs" / "gw.log")
    assert worker_settings(custom, mesh, 0).audit_file == tmp_path / "logs" / "gw.worker0.log"


def test_llmesh_up_passes_gateway_workers_to_the_gateway(tmp_path):
    spec = MeshSpec(layout=Layout(), engines=["sim"], model_dir=tmp_path, log_dir=tmp_path, gateway_workers=3)
    gateway = next(c for c in plan(spec) if c.name == "gateway")
    assert gateway.env["LLMESH_GATEWAY_WORKERS"] == "3"


def test_grpc_so_reuseport_is_off_unless_asked():
    assert dict(server_options())["grpc.so_reuseport"] == 0
    assert dict(server_options(reuse_port=True))["grpc.so_reuseport"] == 1


def test_reuse_port_sockets_share_a_port_that_others_cannot_take():
    first = listen_socket("127.0.0.1", 0, reuse_port=True)
    port = first.getsockname()[1]
    second = listen_socket("127.0.0.1", port, reuse_port=True)
    try:
        for s in (first, second):
            s.listen()
        plain = socket.socket()
        with pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))
        plain.close()
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("value, ok", [(0, True), (0.01, True), (0.05, True), (5, True), (0.001, False),
                                       (-1, False), (6, False)])
def test_the_ledger_share_interval_is_off_or_not_a_busy_loop(value, ok):
    if ok:
        assert GatewaySettings(ledger_share_s=value).ledger_share_s == value
    else:
        with pytest.raises(ValidationError, match="ledger_share_s"):
            GatewaySettings(ledger_share_s=value)
