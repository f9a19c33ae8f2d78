"""Process lifecycle: `llmesh up` stops every child cleanly on Ctrl-C, leaves no
orphans if it is killed, and an engine drains in-flight streams on SIGTERM."""

from __future__ import annotations

import signal
import threading

import openai
import pytest
from openai import OpenAI

from llmesh.testing import Mesh, Service, children_of, free_layout, pid_alive, wait_until
from tests.e2e.conftest import endpoints


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
    engine = Service("llmesh.engine", {
        "LLMESH_ENGINE_BACKEND": "sim", "LLMESH_ENGINE_MODEL": "sim-drain", "LLMESH_ENGINE_ENDPOINT_ID": "drain",
        "LLMESH_ENGINE_PORT": address.rsplit(":", 1)[1], "LLMESH_ENGINE_SCHEDULER_ADDRESS": lay.address("scheduler"),
        "LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": "30", "LLMESH_ENGINE_SIM_OUTPUT_TOKENS": "40",
        "LLMESH_ENGINE_GRACE_S": "10"}, tmp_path / "drain.log")
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
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model="sim-drain", messages=[{"role": "user", "content": "x"}])
        assert info.value.status_code == 503
        reader.join(timeout=10)
        assert result["finish"] == "stop" and result["usage"].completion_tokens == 40  # all 40 sim tokens
        assert engine.proc.wait(timeout=10) == 0
    finally:
        engine.stop(signal.SIGKILL)
