"""Audit log: the hash chain, concurrent appends, resuming, and tampering found at the right line."""

import asyncio
import hashlib
import json
import threading
from pathlib import Path

import orjson
import pytest

from llmesh.audit import GENESIS, AuditError, AuditLog, record_hash, verify


def write_log(path: Path, n: int) -> list[str]:
    with AuditLog(path) as log:
        for i in range(n):
            log.append("request", {"request_id": f"r{i}", "tenant": "acme", "model": "m", "status": "ok",
                                   "prompt_tokens": i, "completion_tokens": 2 * i, "pii": {"email": 1}})
        log.append("admin", {"actor": "ops", "action": "keys.revoke", "key_id": "k1"})
    return path.read_text().splitlines(keepends=True)


def rehash(line: str, **changes) -> str:
    record = json.loads(line)
    record.update(changes)
    record["hash"] = record_hash(record)
    return json.dumps(record) + "\n"


def problems(path: Path, **kw) -> list[tuple[int, str]]:
    return [(p.line, p.what) for p in verify(path, **kw).problems]


def test_records_chain_and_hash_their_canonical_json(tmp_path):
    lines = write_log(tmp_path / "a.jsonl", 3)
    records = [json.loads(line) for line in lines]
    assert [r["seq"] for r in records] == [1, 2, 3, 4]
    assert records[0]["prev"] == GENESIS
    for before, record in zip(records, records[1:]):
        assert record["prev"] == before["hash"]
    body = {k: v for k, v in records[1].items() if k != "hash"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert records[1]["hash"] == hashlib.sha256(canonical).hexdigest()
    assert records[3]["kind"] == "admin" and records[3]["fields"]["action"] == "keys.revoke"
    assert records[0]["ts"].endswith("Z") and "T" in records[0]["ts"]
    report = verify(tmp_path / "a.jsonl")
    assert report.ok and report.records == 4 and report.head_seq == 4 and report.head_hash == records[3]["hash"]


def test_fields_outside_the_allowlist_are_refused(tmp_path):
    with AuditLog(tmp_path / "a.jsonl") as log:
        with pytest.raises(ValueError, match="prompt"):
            log.append("request", {"tenant": "acme", "prompt": "my secret question"})
        with pytest.raises(ValueError, match="messages"):
            log.append("request", {"messages": [{"role": "user"}]})
        with pytest.raises(ValueError, match="200 characters"):
            log.append("request", {"reason": "x" * 201})
        with pytest.raises(ValueError, match="maps"):
            log.append("request", {"pii": {"email": "bob@example.com"}})
        with pytest.raises(ValueError, match="list items"):
            log.append("request", {"injection_rules": [{"nested": 1}]})
        with pytest.raises(ValueError, match="kind"):
            log.append("billing", {"tenant": "acme"})
        with pytest.raises(ValueError, match="action"):
            log.append("request", {"action": "keys.create"})  # an admin field, not a request field
        log.append("request", {"tenant": "acme", "injection_rules": ["ignore_instructions"], "cost": 0.0012})
    assert verify(tmp_path / "a.jsonl").records == 1


def test_custom_field_sets(tmp_path):
    with AuditLog(tmp_path / "a.jsonl", fields={"request": frozenset({"tenant"})}) as log:
        log.append("request", {"tenant": "t"})
        with pytest.raises(ValueError):
            log.append("request", {"model": "m"})
        with pytest.raises(ValueError):
            log.append("admin", {"actor": "a"})


def test_concurrent_appends_from_threads_and_tasks(tmp_path):
    path = tmp_path / "a.jsonl"
    log = AuditLog(path)

    def worker(w: int) -> None:
        for i in range(300):
            log.append("request", {"request_id": f"t{w}-{i}"})

    async def tasks() -> None:
        async def one(i: int) -> None:
            log.append("request", {"request_id": f"a{i}"})
            await asyncio.sleep(0)
        await asyncio.gather(*(one(i) for i in range(600)))
        await log.aflush()

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    asyncio.run(tasks())
    for t in threads:
        t.join()
    log.close()
    records = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    assert [r["seq"] for r in records] == list(range(1, 1801))
    assert len({r["fields"]["request_id"] for r in records}) == 1800
    assert verify(path).ok


def test_append_does_not_wait_for_the_disk_and_flush_does(tmp_path):
    path = tmp_path / "a.jsonl"
    log = AuditLog(path, fsync=True)
    appended = [log.append("request", {"request_id": str(i)}) for i in range(50)]
    assert [a.seq for a in appended] == list(range(1, 51))
    log.flush()
    assert len(path.read_bytes().splitlines()) == 50
    assert log.head == appended[-1]
    log.close()
    with pytest.raises(AuditError, match="closed"):
        log.append("request", {"request_id": "late"})


def test_reopening_resumes_the_chain(tmp_path):
    path = tmp_path / "a.jsonl"
    write_log(path, 2)
    with AuditLog(path) as log:
        assert log.head.seq == 3
        log.append("admin", {"actor": "ops", "action": "config.apply", "revision": 7})
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records[3]["seq"] == 4 and records[3]["prev"] == records[2]["hash"]
    assert verify(path).ok


def test_reopening_refuses_a_damaged_tail(tmp_path):
    path = tmp_path / "a.jsonl"
    lines = write_log(path, 2)
    path.write_text("".join(lines)[:-10])
    with pytest.raises(AuditError, match="incomplete"):
        AuditLog(path)
    path.write_text("".join(lines[:-1]) + lines[-1].replace("keys.revoke", "keys.create"))
    with pytest.raises(AuditError, match="does not match its hash"):
        AuditLog(path)


def tamper(path: Path, lines: list[str]) -> None:
    path.write_text("".join(lines))


def test_edited_line_is_named(tmp_path):
    path = tmp_path / "a.jsonl"
    lines = write_log(path, 6)
    lines[2] = lines[2].replace('"tenant":"acme"', '"tenant":"evil"')
    tamper(path, lines)
    assert problems(path) == [(3, "record seq 3 does not match its hash (edited)")]


def test_edited_line_with_recomputed_hash_is_named(tmp_path):
    path = tmp_path / "a.jsonl"
    lines = write_log(path, 6)
    lines[2] = rehash(lines[2], fields={"tenant": "evil"})
    tamper(path, lines)
    assert problems(path) == [(3, "edited: line 3 was rewritten with a new hash (line 4 does not chain to it)")]


@pytest.mark.parametrize("removed", [0, 3, 5])
def test_removed_line_is_named(tmp_path, removed):
    path = tmp_path / "a.jsonl"
    lines = write_log(path, 6)
    del lines[removed]
    tamper(path, lines)
    assert problems(path) == [(removed + 1, f"removed: 1 record(s) missing before this line "
                                            f"(seq jumps from {removed} to {removed + 2})")]


def test_removed_run_of_lines(tmp_path):
    path = tmp_path / "a.jsonl"
    lines = write_log(path, 9)
    del lines[2:5]
    tamper(path, lines)
    assert problems(path) == [(3, "removed: 3 record(s) missing before this line (seq jumps from 2 to 6)")]


def test_inserted_forged_line_is_named(tmp_path):
    path = tmp_path / "a.jsonl"
    lines = write_log(path, 6)
    before = json.loads(lines[2])
    forged = {"seq": before["seq"] + 1, "ts": before["ts"], "kind": "admin",
              "fields": {"actor": "mallory", "action": "keys.create"}, "prev": before["hash"]}
    forged["hash"] = record_hash(forged)
    lines.insert(3, json.dumps(forged) + "\n")
    tamper(path, lines)
    assert problems(path) == [(4, "inserted: line 4 not in the chain (line 5 follows line 3)")]


def test_inserted_garbage_line_is_named(tmp_path):
    path = tmp_path / "a.jsonl"
    lines = write_log(path, 6)
    lines.insert(2, '{"note": "hello"}\n')
    tamper(path, lines)
    assert problems(path) == [(3, "not an audit record (edited or inserted)")]


def test_inserted_copy_of_a_line_is_named(tmp_path):
    path = tmp_path / "a.jsonl"
    lines = write_log(path, 6)
    lines.insert(4, lines[1])
    tamper(path, lines)
    assert problems(path) == [(5, "inserted: a copy of line 2")]


def test_truncated_tail_is_named(tmp_path):
    path = tmp_path / "a.jsonl"
    lines = write_log(path, 6)
    tamper(path, lines[:-1] + [lines[-1][:25]])
    assert problems(path) == [(7, "incomplete last line: the log was cut short (truncated tail)")]


def test_removed_tail_is_caught_only_against_a_kept_head(tmp_path):
    path = tmp_path / "a.jsonl"
    lines = write_log(path, 6)
    head = verify(path)
    anchor = (head.head_seq, head.head_hash)
    assert verify(path, head=anchor).ok
    tamper(path, lines[:-2])
    assert verify(path).ok  # a shorter chain is still a chain
    assert problems(path, head=anchor) == [(6, "removed: the log ends at seq 5, before the expected head seq 7")]


def test_every_problem_is_reported_and_the_check_goes_on(tmp_path):
    path = tmp_path / "a.jsonl"
    lines = write_log(path, 12)
    lines[1] = lines[1].replace('"status":"ok"', '"status":"error"')
    del lines[6]
    tamper(path, lines)
    report = verify(path)
    assert [p.line for p in report.problems] == [2, 7]
    assert report.records == 12


def test_empty_log_is_intact(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text("")
    report = verify(path)
    assert report.ok and report.records == 0 and report.head_hash == GENESIS


def test_timestamps_are_utc_milliseconds(tmp_path):
    now = [1700000000.1234]
    with AuditLog(tmp_path / "a.jsonl", clock=lambda: now[0]) as log:
        log.append("request", {"tenant": "a"})
        now[0] += 0.5
        log.append("request", {"tenant": "b"})
    stamps = [json.loads(line)["ts"] for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert stamps == ["2023-11-14T22:13:20.123Z", "2023-11-14T22:13:20.623Z"]
