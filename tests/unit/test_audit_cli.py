"""`llmesh audit verify` as an operator runs it: a process, its exit code and what it prints."""

import json
import os
import subprocess
import sys
from pathlib import Path

from llmesh.audit import AuditLog, record_hash


def llmesh(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmesh", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def make_log(path: Path, n: int = 5) -> list[str]:
    with AuditLog(path) as log:
        for i in range(n):
            log.append("request", {"request_id": f"r{i}", "tenant": "acme", "status": "ok"})
    return path.read_text().splitlines(keepends=True)


def test_intact_log_exits_0_with_a_summary_and_the_head(tmp_path):
    path = tmp_path / "audit.jsonl"
    lines = make_log(path)
    done = llmesh("audit", "verify", "--file", str(path))
    assert done.returncode == 0, done.stderr
    last = json.loads(lines[-1])
    assert f"{path}: intact, 5 records" in done.stdout
    assert f"head 5:{last['hash']}" in done.stdout


def test_tampered_log_exits_1_naming_the_line(tmp_path):
    path = tmp_path / "audit.jsonl"
    lines = make_log(path)
    record = json.loads(lines[1])
    record["fields"]["tenant"] = "other"
    record["hash"] = record_hash(record)
    lines[1] = json.dumps(record) + "\n"
    path.write_text("".join(lines))
    done = llmesh("audit", "verify", "--file", str(path))
    assert done.returncode == 1
    assert "TAMPERED" in done.stderr
    assert "line 2: edited: line 2 was rewritten with a new hash (line 3 does not chain to it)" in done.stderr


def test_json_output_and_head_anchor(tmp_path):
    path = tmp_path / "audit.jsonl"
    lines = make_log(path)
    head = json.loads(llmesh("audit", "verify", "--file", str(path), "--json").stdout)["head"]
    path.write_text("".join(lines[:-1]))
    done = llmesh("audit", "verify", "--file", str(path), "--head", head, "--json")
    assert done.returncode == 1
    report = json.loads(done.stdout)
    assert report["ok"] is False and report["records"] == 4
    assert report["problems"] == [{"line": 5, "what": "removed: the log ends at seq 4, before the expected head seq 5"}]


def test_default_file_is_the_gateways(tmp_path):
    path = tmp_path / "elsewhere.jsonl"
    make_log(path, 2)
    done = llmesh("audit", "verify", env={"LLMESH_GATEWAY_AUDIT_FILE": str(path)})
    assert done.returncode == 0 and "intact, 2 records" in done.stdout
    make_log(tmp_path / "state" / "audit.jsonl", 3)
    done = llmesh("audit", "verify", env={"LLMESH_GATEWAY_AUDIT_FILE": "", "LLMESH_STATE_DIR": str(tmp_path / "state")})
    assert done.returncode == 0 and "intact, 3 records" in done.stdout


def test_missing_file_and_bad_head_are_usage_errors(tmp_path):
    done = llmesh("audit", "verify", "--file", str(tmp_path / "none.jsonl"))
    assert done.returncode == 2 and "cannot read" in done.stderr
    done = llmesh("audit", "verify", "--file", str(tmp_path / "none.jsonl"), "--head", "12:abc")
    assert done.returncode == 2 and "SEQ:HASH" in done.stderr


def test_a_gateway_of_several_workers_has_one_chain_each_and_verify_checks_them_all(tmp_path):
    from llmesh.audit import worker_file
    path = tmp_path / "audit.jsonl"
    for i in (0, 1, 10):
        make_log(worker_file(path, i), n=2 + i)
    (tmp_path / "audit.workerX.jsonl").write_text("not a worker's chain\n")  # not a worker index: ignored
    done = llmesh("audit", "verify", "--json", env={"LLMESH_STATE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    reports = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(Path(r["file"]).name, r["records"], r["ok"]) for r in reports] == [
        ("audit.worker0.jsonl", 2, True), ("audit.worker1.jsonl", 3, True), ("audit.worker10.jsonl", 12, True)]
    lines = worker_file(path, 1).read_text().splitlines(keepends=True)
    worker_file(path, 1).write_text("".join(lines[:1] + lines[2:]))  # a record removed from worker 1's chain
    done = llmesh("audit", "verify", "--file", str(path))
    assert done.returncode == 1
    assert "audit.worker1.jsonl: TAMPERED" in done.stderr and "audit.worker0.jsonl: intact, 2 records" in done.stdout
    # a head belongs to one chain: with several, name the file
    done = llmesh("audit", "verify", "--file", str(path), "--head", f"1:{'0' * 64}")
    assert done.returncode == 2 and "name it with --file" in done.stderr


def test_usage_without_redis_sums_every_worker_chain(tmp_path):
    from llmesh.audit import worker_file
    for i, tokens in ((0, 5), (1, 7)):
        with AuditLog(worker_file(tmp_path / "audit.jsonl", i)) as log:
            log.append("request", {"tenant": "acme", "model": "m", "decision": "allowed", "prompt_tokens": tokens,
                                   "completion_tokens": 1})
    env = {k: v for k, v in os.environ.items() if k != "LLMESH_REDIS_URL"} | {"LLMESH_STATE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "llmesh", "usage", "--csv"], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    row = done.stdout.splitlines()[1].split(",")
    assert row[1:6] == ["acme", "m", "2", "12", "2"]
