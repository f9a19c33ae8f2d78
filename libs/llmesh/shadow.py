"""Shadow comparisons: what a gateway records when it sent a copy of a request to a
shadow model version, where it keeps the records, and the report over them.

Records keep no text. The similarity of the two answers is computed in the gateway
while both are in memory, so the report needs only numbers: latencies, token counts,
lengths, the similarity, and a short hash of each answer (equal hashes: the same
text). Prompts and answers can hold user data; they stay out of the store.

The similarity is word-level (difflib over word sequences), not MiniLM embeddings:
the embedder belongs to the cache service, which the gateway may not import, and it
would put ~90 MB of weights and milliseconds of CPU per comparison in every gateway.

Stores: Redis when the gateways share one (a capped list per alias and a drop counter),
else a bounded JSON-lines file per alias under the state directory. Both survive the
gateway and are read by ``llmesh shadow report``."""

from __future__ import annotations

import asyncio
import difflib
import hashlib
import math
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import orjson

if TYPE_CHECKING:
    import redis.asyncio

MAX_RECORDS = 10_000  # per alias; older records are dropped
_WORD = re.compile(r"\w+|[^\w\s]")


def similarity(a: str, b: str) -> float:
    """Word-level similarity in [0, 1]: 2 x matching words / all words, in order
    (difflib's ratio over word sequences, case-folded). Two empty answers are 1."""
    wa, wb = _WORD.findall(a.casefold()), _WORD.findall(b.casefold())
    if not wa and not wb:
        return 1.0
    return difflib.SequenceMatcher(None, wa, wb, autojunk=False).ratio()


def text_hash(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


@dataclass(frozen=True, slots=True)
class Answer:
    """One side of a comparison."""
    model: str
    status: str  # ok, or the error code
    latency_ms: float
    ttft_ms: float | None
    prompt_tokens: int
    completion_tokens: int
    chars: int
    hash: str


@dataclass(frozen=True, slots=True)
class ShadowRecord:
    ts: float
    alias: str
    primary: Answer
    shadow: Answer
    similarity: float | None  # None when either side failed

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> ShadowRecord:
        d = orjson.loads(raw)
        return cls(ts=d["ts"], alias=d["alias"], primary=Answer(**d["primary"]), shadow=Answer(**d["shadow"]),
                   similarity=d["similarity"])


class ShadowStore(Protocol):
    async def add(self, record: ShadowRecord) -> None: ...
    async def add_drops(self, alias: str, n: int) -> None: ...
    async def read(self, alias: str) -> tuple[list[ShadowRecord], int]:
        """The alias's records (oldest first) and how many copies were dropped."""


class RedisShadowStore:
    def __init__(self, client: redis.asyncio.Redis, prefix: str = "llmesh:shadow", max_records: int = MAX_RECORDS):
        self._r = client
        self._prefix = prefix
        self._max = max_records

    async def add(self, record: ShadowRecord) -> None:
        key = f"{self._prefix}:records:{record.alias}"
        async with self._r.pipeline(transaction=False) as p:
            p.rpush(key, record.to_json())
            p.ltrim(key, -self._max, -1)
            await p.execute()

    async def add_drops(self, alias: str, n: int) -> None:
        await self._r.hincrby(f"{self._prefix}:drops", alias, n)

    async def read(self, alias: str) -> tuple[list[ShadowRecord], int]:
        raw = await self._r.lrange(f"{self._prefix}:records:{alias}", 0, -1)
        drops = await self._r.hget(f"{self._prefix}:drops", alias)
        return [ShadowRecord.from_json(x) for x in raw], int(drops or 0)


def _file_name(alias: str) -> str:
    """An alias as a file name: its own characters where safe, plus a hash (no clashes)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", alias)[:64]
    return f"{safe}.{text_hash(alias)}"


class FileShadowStore:
    """One machine: ``<dir>/<alias>.<hash>.jsonl`` (records) and ``.drops`` (a count).
    A file past twice ``max_records`` lines is rewritten with the newest ``max_records``.
    One gateway process writes a directory; file work runs off the event loop."""

    def __init__(self, directory: Path, max_records: int = MAX_RECORDS):
        self._dir = directory
        self._max = max_records
        self._lines: dict[str, int] = {}
        self._lock = asyncio.Lock()

    async def add(self, record: ShadowRecord) -> None:
        async with self._lock:
            await asyncio.to_thread(self._append, record.alias, record.to_json())

    def _append(self, alias: str, line: bytes) -> None:
        self._dir.mkdir(parents=True, exist_ok=True)
        path = self._dir / f"{_file_name(alias)}.jsonl"
        if alias not in self._lines:
            self._lines[alias] = len(self._read_lines(path))
        with path.open("ab") as f:
            f.write(line + b"\n")
        self._lines[alias] += 1
        if self._lines[alias] > 2 * self._max:
            keep = self._read_lines(path)[-self._max:]
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(b"".join(x + b"\n" for x in keep))
            tmp.replace(path)
            self._lines[alias] = len(keep)

    @staticmethod
    def _read_lines(path: Path) -> list[bytes]:
        try:
            return [x for x in path.read_bytes().split(b"\n") if x.strip()]
        except FileNotFoundError:
            return []

    async def add_drops(self, alias: str, n: int) -> None:
        async with self._lock:
            await asyncio.to_thread(self._add_drops, alias, n)

    def _add_drops(self, alias: str, n: int) -> None:
        self._dir.mkdir(parents=True, exist_ok=True)
        path = self._dir / f"{_file_name(alias)}.drops"
        before = int(path.read_text() or 0) if path.exists() else 0
        tmp = path.with_suffix(".drops.tmp")
        tmp.write_text(str(before + n))
        tmp.replace(path)

    async def read(self, alias: str) -> tuple[list[ShadowRecord], int]:
        return await asyncio.to_thread(self._read, alias)

    def _read(self, alias: str) -> tuple[list[ShadowRecord], int]:
        name = _file_name(alias)
        records = []
        for line in self._read_lines(self._dir / f"{name}.jsonl")[-self._max:]:
            try:
                records.append(ShadowRecord.from_json(line))
            except (orjson.JSONDecodeError, KeyError, TypeError):
                continue  # a line cut short when a gateway died mid-write
        drops = self._dir / f"{name}.drops"
        return records, int(drops.read_text() or 0) if drops.exists() else 0


def _quantile(values: list[float], q: float) -> float | None:
    """Nearest-rank quantile (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _side(answers: list[Answer]) -> dict[str, Any]:
    ok = [a for a in answers if a.status == "ok"]
    lat = [a.latency_ms for a in ok]
    return {"models": sorted({a.model for a in answers}), "errors": len(answers) - len(ok),
            "latency_p50_ms": _quantile(lat, 0.5), "latency_p95_ms": _quantile(lat, 0.95),
            "prompt_tokens": sum(a.prompt_tokens for a in ok),
            "completion_tokens": sum(a.completion_tokens for a in ok),
            "mean_completion_tokens": (sum(a.completion_tokens for a in ok) / len(ok)) if ok else None}


def report(alias: str, records: list[ShadowRecord], drops: int, now: float | None = None) -> dict[str, Any]:
    """The comparison over an alias's records: counts, latencies and tokens of both
    sides, and how alike the answers were (over the pairs where both answered)."""
    pairs = [r for r in records if r.similarity is not None]
    sims = [r.similarity for r in pairs if r.similarity is not None]  # all of them
    differ = sum(1 for r in pairs if r.primary.hash != r.shadow.hash)
    return {"alias": alias, "count": len(records), "dropped": drops, "compared": len(pairs),
            "since": min((r.ts for r in records), default=None), "until": max((r.ts for r in records), default=None),
            "primary": _side([r.primary for r in records]), "shadow": _side([r.shadow for r in records]),
            "similarity_mean": (sum(sims) / len(sims)) if sims else None,
            "similarity_min": min(sims, default=None),
            "share_different": (differ / len(pairs)) if pairs else None,
            "generated_at": time.time() if now is None else now}
