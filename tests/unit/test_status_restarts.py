"""`llmesh status` takes restart counts from the supervisor.json of the `llmesh up`
that runs the mesh asked about, and shows them."""

import json
import os

from llmesh.cli.status import render, supervised


def _state(path, pid, address="127.0.0.1:50152"):
    path.write_text(json.dumps({"supervisor_pid": pid, "children": [
        {"name": "scheduler", "address": address, "pid": 1, "alive": True, "restarts": 2, "last_exit_code": -9}]}))
    return path


def test_a_live_supervisor_s_counts_are_read(tmp_path):
    procs = supervised(_state(tmp_path / "s.json", os.getpid()))
    assert procs["scheduler"]["restarts"] == 2


def test_a_dead_supervisor_s_or_missing_file_gives_nothing(tmp_path):
    assert supervised(_state(tmp_path / "s.json", 2**22 + 12345)) == {}
    assert supervised(tmp_path / "missing.json") == {}
    (tmp_path / "bad.json").write_text("{")
    assert supervised(tmp_path / "bad.json") == {}


def test_render_shows_restarts_and_the_last_exit_code():
    report = {"gateway_http": "http://x", "endpoints": [], "models": [],
              "live": {"requests_per_s": None, "requests_total": None, "ttft_ms_p50": None, "ttft_ms_p99": None,
                       "engines": []},
              "services": [{"name": "scheduler", "address": "a", "health": "SERVING", "restarts": 2,
                            "last_exit_code": -9},
                           {"name": "engine-9", "address": "b", "health": "SERVING", "restarts": None,
                            "last_exit_code": None}]}
    text = render(report, as_json=False)
    assert "RESTARTS" in text
    assert "SERVING      2 (last exit -9)" in text
    assert "SERVING      -" in text
