"""Process lifecycle: `llmesh up` stops every child cleanly on Ctrl-C, leaves no
orphans if it is killed, restarts a child that dies (giving up past its restart
budget), and an engine drains in-flight streams on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import openai
import pytest
from openai import OpenAI

from llmesh.testing import Mesh, children_of, free_layout, pid_alive, wait_until
from tests.e2e.conftest import endpoints, sim_engine


@pytest.fixture
def sim_mesh(tmp_path):
    m = Mesh(layout=free_layout(n_engines=2), engines="sim", model_dir=tmp_path / "models",
             log_dir=tmp_path / "logs", env={"LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": "20"})
    m.start(timeout_s=60)
    yield m
    m.stop(signal.SIGKILL)


def test_ctrl_c_stops_every_service_with_exit_0(sim_mesh):
    kids = children_of(sim_mesh.proc.pid)
    assert len(kids) == 5
    assert sim_mesh.stop(signal.SIGINT) == 0
    assert not [k for k in kids if pid_alive(k)]
    out = "".join(sim_mesh.output)
    for name in ("scheduler", "modelmgr", "cache", "engine-0", "gateway"):
        assert f"{name} (0)" in out


def test_killed_supervisor_leaves_no_orphans(sim_mesh):
    kids = children_of(sim_mesh.proc.pid)
    assert len(kids) == 5
    sim_mesh.proc.kill()
    sim_mesh.proc.wait()
    assert wait_until(lambda: not [k for k in kids if pid_alive(k)], 15.0)


def test_engine_drains_in_flight_stream_then_leaves_the_table(sim_mesh, tmp_path):
    lay = sim_mesh.layout
    address = lay.engine_address(1)
    engine = sim_engine("drain", address, tmp_path / "drain.log", model="sim-drain",
                        scheduler_address=lay.address("scheduler"), sim_decode_ms_per_token=30, sim_output_tokens=40,
                        grace_s=10)
    engine.start()
    try:
        assert wait_until(lambda: any(e.endpoint_id == "drain" for e in endpoints(sim_mesh)), 20)
        client = OpenAI(base_url=lay.http_url + "/v1", api_key="unused", max_retries=0)
        wait_until(lambda: "sim-drain" in {m.id for m in client.models.list()}, 5)
        result = {}

        def consume():
            stream = client.chat.completions.create(
                model="sim-drain", messages=[{"role": "user", "content": "x"}], stream=True,
                stream_options={"include_usage": True})
            chunks = list(stream)
            result["finish"] = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            result["usage"] = chunks[-1].usage

        reader = threading.Thread(target=consume)
        reader.start()
        assert wait_until(lambda: any(e.endpoint_id == "drain" and e.load.running == 1
                                      for e in endpoints(sim_mesh)), 5)
        engine.proc.send_signal(signal.SIGTERM)
        # Deregistered first: gone from the table while its stream still runs.
        assert wait_until(lambda: not any(e.endpoint_id == "drain" for e in endpoints(sim_mesh)), 2.0)
        # A request that reached the engine in the moment between its leaving the table and its server
        # stopping is still served (as route_away_s means it to be); new work is refused right after.
        refused = []

        def new_request_refused() -> bool:
            try:
                client.chat.completions.create(model="sim-drain", max_tokens=1,
                                               messages=[{"role": "user", "content": "x"}])
            except openai.InternalServerError as exc:
                refused.append(exc.status_code)
                return True
            return False

        assert wait_until(new_request_refused, 2.0) and refused == [503]
        reader.join(timeout=10)
        assert result["finish"] == "stop" and result["usage"].completion_tokens == 40  # all 40 sim tokens
        assert engine.proc.wait(timeout=10) == 0
    finally:
        engine.stop(signal.SIGKILL)


def _engine_pid(mesh: Mesh, name: str) -> int:
    state = json.loads((mesh.log_dir / "supervisor.json").read_text())
    return next(c["pid"] for c in state["children"] if c["name"] == name)


def _chat_ok(mesh: Mesh) -> bool:
    client = OpenAI(base_url=mesh.layout.http_url + "/v1", api_key="unused", max_retries=0)
    try:
        return bool(client.chat.completions.create(model="sim-small", max_tokens=2,
                                                   messages=[{"role": "user", "content": "x"}]).choices)
    except openai.APIError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_dead_engine_is_restarted_and_the_mesh_keeps_serving(sim_mesh, sig):
    old = _engine_pid(sim_mesh, "engine-0")
    os.kill(old, sig)
    assert wait_until(lambda: any("restarted engine-0" in line for line in sim_mesh.output), 15)
    assert sim_mesh.proc.poll() is None                     # the mesh did not stop
    # supervisor.json is rewritten once the restart round ends, just after the line is printed
    assert wait_until(lambda: _engine_pid(sim_mesh, "engine-0") != old, 5)
    assert wait_until(lambda: any(e.endpoint_id == "engine-0" and e.healthy for e in endpoints(sim_mesh)), 20)
    assert _chat_ok(sim_mesh)
    lay = sim_mesh.layout
    out = subprocess.run([sys.executable, "-m", "llmesh", "status", "--json", "--base-port", str(lay.base_port),
                          "--http-port", str(lay.http_port), "--log-dir", str(sim_mesh.log_dir)],
                         capture_output=True, text=True, timeout=60)
    services = {s["name"]: s for s in json.loads(out.stdout)["services"]}
    assert services["engine-0"]["restarts"] == 1
    assert services["engine-0"]["last_exit_code"] == (-9 if sig == signal.SIGKILL else 0)
    assert services["gateway"]["restarts"] == 0
    assert f"exited with code {-9 if sig == signal.SIGKILL else 0}; restarting" in "".join(sim_mesh.output)


def test_a_child_failing_past_its_budget_stops_the_mesh_and_says_which(tmp_path):
    mesh = Mesh(layout=free_layout(n_engines=1), engines="sim", model_dir=tmp_path / "models",
                log_dir=tmp_path / "logs", args=["--max-restarts", "1", "--restart-window", "60"])
    mesh.start(timeout_s=60)
    try:
        kids = children_of(mesh.proc.pid)
        os.kill(_engine_pid(mesh, "engine-0"), signal.SIGKILL)
        assert wait_until(lambda: any("restarted engine-0" in line for line in mesh.output), 15)
        time.sleep(0.3)
        os.kill(_engine_pid(mesh, "engine-0"), signal.SIGKILL)
        assert mesh.proc.wait(timeout=30) == 1
        out = "".join(mesh.output)
        assert "engine-0 exited 2 times within 60s (last exit code -9), past its restart budget" in out
        assert wait_until(lambda: not [k for k in children_of(mesh.proc.pid) + kids if pid_alive(k)], 15)
        assert not (mesh.log_dir / "supervisor.json").exists()
    finally:
        mesh.stop(signal.SIGKILL)
