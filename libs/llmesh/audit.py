"""Append-only audit log: one JSON line per request or admin action, chained by hashes.

A record is ``{"seq", "ts", "kind", "fields", "prev", "hash"}``: ``seq`` counts from 1 in the
file, ``ts`` is UTC (RFC 3339, milliseconds), ``kind`` is ``request`` or ``admin``, ``prev`` is
the previous record's ``hash`` (64 zeros for the first) and ``hash`` is the SHA-256 of the
record's canonical JSON without ``hash`` (keys sorted, no spaces, UTF-8). Editing, inserting or
removing a line, or cutting the last one short, breaks the chain where it happened, and
:func:`verify` names the line. Removing whole records from the *end* leaves a shorter valid
chain; to catch that, keep the head (``seq:hash``, printed by ``llmesh audit verify``) somewhere
else and pass it back as ``head``. One file holds one chain, written by one process.

Records never hold prompts or answers: ``fields`` must use the names allowed for its kind
(:data:`REQUEST_FIELDS`, :data:`ADMIN_FIELDS`, or the sets given to :class:`AuditLog`), and
values are scalars, short strings (at most :data:`MAX_STRING` characters), short lists of those,
or small string-to-number maps (token counts, PII counts by kind). Anything else is refused with
``ValueError`` before it is written.

:class:`AuditLog` is safe for concurrent ``append`` from threads and coroutines of one process.
``append`` only builds, hashes and queues the line (microseconds; it never touches the disk or wakes
a thread); a writer thread writes what is queued every ``batch_s`` (50 ms) with one ``write`` (and
``fsync`` when asked), sooner when 512 lines wait or someone flushes.
``flush`` waits until everything appended so far is written; ``aflush`` does so off the event loop.
Records still queued when a process dies are lost: ``close()`` (or ``flush()``) on shutdown.
A write that fails (disk full, I/O error) stops the log: the records of that batch and any
still queued are lost (``on_lost`` is told how many), ``writable`` turns False, and every
later ``append`` raises :class:`AuditError`, until the process restarts.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

GENESIS = "0" * 64
KINDS = ("request", "admin")
REQUEST_FIELDS = frozenset({
    "request_id", "tenant", "key_id", "subject", "groups", "model", "endpoint", "operation", "status",
    "decision", "reason", "priority", "prompt_tokens", "completion_tokens", "cost", "latency_ms", "cache",
    "pii", "injection_score", "injection_rules", "injection_truncated", "client", "client_request_id",
    "cache_kind", "saved_prompt_tokens", "saved_completion_tokens", "saved_cost",
})
ADMIN_FIELDS = frozenset({
    "actor", "action", "target", "tenant", "key_id", "models", "expires", "revision", "result", "reason",
})
MAX_STRING = 200
MAX_ITEMS = 32
_RECORD_KEYS = frozenset({"seq", "ts", "kind", "fields", "prev", "hash"})


class AuditError(Exception):
    """The log cannot be appended to (damaged tail, write failure)."""


def canonical(record: Mapping[str, Any]) -> bytes:
    return orjson.dumps(record, option=orjson.OPT_SORT_KEYS)


def record_hash(record: Mapping[str, Any]) -> str:
    """SHA-256 over the canonical JSON of ``record`` without its ``hash``."""
    body = {k: v for k, v in record.items() if k != "hash"}
    return hashlib.sha256(canonical(body)).hexdigest()


def worker_file(path: str | os.PathLike[str], index: int) -> Path:
    """The log of worker ``index`` of a gateway run as several processes, beside ``path``
    (``audit.jsonl`` -> ``audit.worker0.jsonl``): one chain per process, and a restarted
    worker continues its own file."""
    p = Path(path)
    return p.with_name(f"{p.stem}.worker{index}{p.suffix}")


def chain_files(path: str | os.PathLike[str]) -> list[Path]:
    """``path`` if it exists, then the worker logs beside it, in worker order."""
    p = Path(path)
    workers = [(int(f.stem.rpartition(".worker")[2]), f) for f in p.parent.glob(f"{p.stem}.worker*{p.suffix}")
               if f.stem.rpartition(".worker")[2].isdigit()]
    return [p] * p.exists() + [f for _, f in sorted(workers)]


def _check_value(name: str, value: object) -> None:
    if value is None or isinstance(value, bool | int | float):
        return
    if isinstance(value, str):
        if len(value) > MAX_STRING:
            raise ValueError(f"audit field {name!r}: strings are at most {MAX_STRING} characters")
        return
    if isinstance(value, list | tuple):
        if len(value) > MAX_ITEMS:
            raise ValueError(f"audit field {name!r}: at most {MAX_ITEMS} items")
        for item in value:
            if not isinstance(item, str | int | float | bool) or isinstance(item, str) and len(item) > MAX_STRING:
                raise ValueError(f"audit field {name!r}: list items are scalars or short strings")
        return
    if isinstance(value, dict):
        if len(value) > MAX_ITEMS or not all(
                isinstance(k, str) and len(k) <= MAX_STRING and isinstance(v, int | float) and not isinstance(v, bool)
                for k, v in value.items()):
            raise ValueError(f"audit field {name!r}: maps go from short strings to numbers")
        return
    raise ValueError(f"audit field {name!r}: {type(value).__name__} is not allowed")


def _read_head(path: Path) -> tuple[int, str]:
    """The last record's seq and hash (0 and GENESIS for an empty or new file)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return 0, GENESIS
    if size == 0:
        return 0, GENESIS
    with path.open("rb") as f:
        chunk, pos = b"", size
        while pos > 0 and chunk.count(b"\n") < 2:
            step = min(65536, pos)
            pos -= step
            f.seek(pos)
            chunk = f.read(step) + chunk
    if not chunk.endswith(b"\n"):
        raise AuditError(f"{path}: the last line is incomplete (cut short by a crash or an edit); "
                         f"check it with 'llmesh audit verify --file {path}' and move the file aside "
                         "to start a new chain")
    last = chunk[:-1].rsplit(b"\n", 1)[-1]
    try:
        record = orjson.loads(last)
        seq, stored = int(record["seq"]), record["hash"]
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        raise AuditError(f"{path}: the last line is not an audit record; "
                         f"check it with 'llmesh audit verify --file {path}'") from None
    if record_hash(record) != stored:
        raise AuditError(f"{path}: the last record does not match its hash; "
                         f"check it with 'llmesh audit verify --file {path}'")
    return seq, stored


def _utc(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).isoformat(timespec="milliseconds")[:-6] + "Z"


@dataclass(frozen=True, slots=True)
class Appended:
    seq: int
    hash: str


class AuditLog:
    """Appends records to ``path``, continuing the chain already in it."""

    def __init__(self, path: str | os.PathLike[str], *, fields: Mapping[str, frozenset[str]] | None = None,
                 fsync: bool = False, clock: Callable[[], float] = time.time, batch_s: float = 0.05,
                 on_lost: Callable[[int], None] = lambda n: None):
        self.path = Path(path)
        self._on_lost = on_lost  # told how many queued records a failed write lost (from the writer thread)
        self._batch_s = batch_s  # the writer wakes this often (or at 512 queued, or on flush), not per record
        self._allowed = dict(fields) if fields is not None else {"request": REQUEST_FIELDS, "admin": ADMIN_FIELDS}
        self._fsync = fsync
        self._clock = clock
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._seq, self._head = _read_head(self.path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        self._cond = threading.Condition()
        self._queue: list[bytes] = []
        self._queued_seq = self._written_seq = self._seq
        self._error: BaseException | None = None
        self._closing = False
        self._urgent = False
        self._ts_ms, self._ts = -1, ""
        self._writer = threading.Thread(target=self._write_loop, name=f"audit-writer:{self.path.name}", daemon=True)
        self._writer.start()

    @property
    def writable(self) -> bool:
        """Records appended now will be written (as far as the log knows): no write has
        failed and it is not closed."""
        return self._error is None and not self._closing

    @property
    def head(self) -> Appended:
        with self._cond:
            return Appended(self._seq, self._head)

    def append(self, kind: str, fields: Mapping[str, object]) -> Appended:
        """Queues one record; returns its seq and hash. Never waits for the disk."""
        allowed = self._allowed.get(kind)
        if allowed is None:
            raise ValueError(f"audit kind {kind!r} is not one of {sorted(self._allowed)}")
        unknown = fields.keys() - allowed
        if unknown:
            raise ValueError(f"audit fields {sorted(unknown)} are not allowed for {kind!r} records")
        for name, value in fields.items():
            _check_value(name, value)
        with self._cond:
            if self._error is not None:
                raise AuditError(f"{self.path}: writing failed: {self._error}")
            if self._closing:
                raise AuditError(f"{self.path}: the log is closed")
            now_ms = int(self._clock() * 1000)
            if now_ms != self._ts_ms:  # formatting the time costs more than the rest of the record
                self._ts_ms, self._ts = now_ms, _utc(now_ms / 1000)
            record: dict[str, Any] = {"seq": self._seq + 1, "ts": self._ts, "kind": kind, "fields": dict(fields),
                      "prev": self._head}
            try:
                body = canonical(record)
            except orjson.JSONEncodeError as exc:
                raise ValueError(f"audit fields cannot be encoded: {exc}") from None
            digest = hashlib.sha256(body).hexdigest()
            self._queue.append(body[:-1] + b',"hash":"' + digest.encode() + b'"}\n')
            self._seq, self._head = record["seq"], digest
            self._queued_seq = self._seq
            if len(self._queue) >= 512:
                self._urgent = True
                self._cond.notify_all()
            return Appended(self._seq, digest)

    def flush(self, timeout: float | None = 10.0) -> None:
        """Waits until every record appended so far is written (and fsynced when asked)."""
        with self._cond:
            target = self._queued_seq
            if self._written_seq < target:
                self._urgent = True
                self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._written_seq >= target or self._error is not None, timeout):
                raise AuditError(f"{self.path}: writing did not finish within {timeout} s")
            if self._error is not None:
                raise AuditError(f"{self.path}: writing failed: {self._error}")

    async def aflush(self, timeout: float | None = 10.0) -> None:
        await asyncio.to_thread(self.flush, timeout)

    def close(self) -> None:
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify_all()
        self._writer.join()
        os.close(self._fd)
        if self._error is not None:
            raise AuditError(f"{self.path}: writing failed: {self._error}")

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._urgent or self._closing, self._batch_s)
                self._urgent = False
                batch, self._queue = self._queue, []
                upto = self._queued_seq
                if not batch:
                    if self._closing:
                        return
                    continue
            try:
                data = memoryview(b"".join(batch))
                while data:
                    data = data[os.write(self._fd, data):]
                if self._fsync:
                    os.fsync(self._fd)
            except OSError as exc:
                with self._cond:
                    self._error = exc
                    lost = len(batch) + len(self._queue)
                    self._queue = []
                    self._cond.notify_all()
                self._on_lost(lost)
                return
            with self._cond:
                self._written_seq = upto
                self._cond.notify_all()


@dataclass(frozen=True, slots=True)
class Problem:
    line: int
    what: str


@dataclass
class VerifyReport:
    path: Path
    records: int = 0
    problems: list[Problem] = field(default_factory=list)
    head_seq: int = 0
    head_hash: str = GENESIS
    first_ts: str | None = None
    last_ts: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


_WINDOW = 4096  # how far back an inserted run of lines is traced to the line it should follow


def _lines(path: Path) -> Iterator[tuple[int, bytes, bool]]:
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            yield number, raw.rstrip(b"\n"), raw.endswith(b"\n")


def read_records(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The well-formed records of a log, in order (``verify`` says whether to trust them)."""
    path = Path(path)
    if not path.exists():
        return
    for _, raw, _ in _lines(path):
        record = _parse(raw)
        if record is not None:
            yield record


def _parse(raw: bytes) -> dict[str, Any] | None:
    try:
        record = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if (not isinstance(record, dict) or record.keys() != _RECORD_KEYS or not isinstance(record["seq"], int)
            or not isinstance(record["prev"], str) or not isinstance(record["hash"], str)
            or record["kind"] not in KINDS or not isinstance(record["fields"], dict)):
        return None
    return record


def verify(path: str | os.PathLike[str], head: tuple[int, str] | None = None, max_problems: int = 100) -> VerifyReport:
    """Checks every line of the log; each problem names the line where the chain shows it."""
    report = VerifyReport(Path(path))
    problems = report.problems
    prev_hash: str | None = GENESIS  # None: the previous line was unreadable, so resynchronise
    prev_seq, prev_intact = 0, True
    recent: dict[str, int] = {GENESIS: 0}  # hash -> line, for the last _WINDOW lines
    order: deque[str] = deque([GENESIS])
    anchor_seen = False
    for number, raw, terminated in _lines(report.path):
        if len(problems) >= max_problems:
            break
        if not terminated:
            problems.append(Problem(number, "incomplete last line: the log was cut short (truncated tail)"))
            break
        record = _parse(raw)
        if record is None:
            problems.append(Problem(number, "not an audit record (edited or inserted)"))
            prev_hash = None
            continue
        seq, stored = record["seq"], record["hash"]
        intact = record_hash(record) == stored
        if intact and stored in recent:
            problems.append(Problem(number, f"inserted: a copy of line {recent[stored]}"))
            continue
        if not intact:
            problems.append(Problem(number, f"record seq {seq} does not match its hash (edited)"))
        elif prev_hash is not None and record["prev"] != prev_hash:
            follows = recent.get(record["prev"])
            if follows is not None and follows < number - 1:
                lines = f"line {follows + 1}" if follows + 1 == number - 1 else f"lines {follows + 1}-{number - 1}"
                problems.append(Problem(follows + 1, f"inserted: {lines} not in the chain "
                                                     f"(line {number} follows line {follows})"))
            elif seq > prev_seq + 1:
                problems.append(Problem(number, f"removed: {seq - prev_seq - 1} record(s) missing before this "
                                                f"line (seq jumps from {prev_seq} to {seq})"))
            elif prev_intact:
                problems.append(Problem(number - 1, f"edited: line {number - 1} was rewritten with a new hash "
                                                    f"(line {number} does not chain to it)"))
        elif prev_hash is not None and seq != prev_seq + 1:
            problems.append(Problem(number, f"seq {seq} does not follow {prev_seq} (edited)"))
        if head is not None and seq == head[0]:
            anchor_seen = True
            if stored != head[1]:
                problems.append(Problem(number, f"record seq {seq} differs from the expected head {head[1][:12]}…"))
        recent[stored] = number
        order.append(stored)
        if len(order) > _WINDOW:
            recent.pop(order.popleft(), None)
        prev_hash, prev_seq, prev_intact = stored, seq, intact
        report.records += 1
        report.head_seq, report.head_hash = seq, stored
        report.first_ts = report.first_ts or record["ts"]
        report.last_ts = record["ts"]
    if head is not None and not anchor_seen and len(problems) < max_problems:
        problems.append(Problem(report.records + 1, f"removed: the log ends at seq {report.head_seq}, "
                                                    f"before the expected head seq {head[0]}"))
    return report
