"""API keys: random secrets shown once, stored only as salted hashes.

A key reads ``llm_<id>_<secret>``: the id finds the record, the secret is checked
against ``sha256(salt + secret)`` in constant time. The secret has 256 random
bits, so a fast hash is enough (a password hash like bcrypt protects guessable
secrets, which these are not) and keeps verification off the request's budget.

Records live where every gateway replica reads them: Redis in production, a JSON
file on one machine. Both stores keep revoked records, so revoking the last key
does not reopen the gateway to anonymous callers."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import redis.asyncio

PREFIX = "llm_"


@dataclass(frozen=True, slots=True)
class ApiKey:
    key_id: str
    tenant: str
    salt: str
    digest: str
    created_at: float
    models: tuple[str, ...] | None = None  # None: whatever the tenant may use
    expires_at: float | None = None
    revoked_at: float | None = None
    name: str = ""

    def usable(self, now: float) -> bool:
        return self.revoked_at is None and (self.expires_at is None or now < self.expires_at)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> ApiKey:
        data = json.loads(raw)
        if data.get("models") is not None:
            data["models"] = tuple(data["models"])
        return cls(**data)


def _digest(salt: str, secret: str) -> str:
    return hashlib.sha256((salt + secret).encode()).hexdigest()


def split_key(plaintext: str) -> tuple[str, str] | None:
    """(key id, secret) of a well-formed key, else None."""
    if not plaintext.startswith(PREFIX):
        return None
    parts = plaintext[len(PREFIX):].split("_", 1)
    if len(parts) != 2 or not parts[0] or not parts[1]:
        return None
    return parts[0], parts[1]


def matches(record: ApiKey, secret: str) -> bool:
    return hmac.compare_digest(record.digest, _digest(record.salt, secret))


def new_key(tenant: str, *, models: tuple[str, ...] | None = None, expires_at: float | None = None,
            name: str = "", key_id: str | None = None, now: float | None = None) -> tuple[str, ApiKey]:
    """A fresh key: (the plaintext, shown once; the record to store)."""
    key_id = key_id or secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    salt = secrets.token_hex(16)
    record = ApiKey(key_id=key_id, tenant=tenant, salt=salt, digest=_digest(salt, secret),
                    created_at=time.time() if now is None else now, models=models, expires_at=expires_at,
                    name=name)
    return f"{PREFIX}{key_id}_{secret}", record


class KeyStore(Protocol):
    async def get(self, key_id: str) -> ApiKey | None: ...
    async def put(self, record: ApiKey) -> None: ...
    async def all(self) -> list[ApiKey]: ...
    async def configured(self) -> bool:
        """Whether any key was ever created: then callers must authenticate."""
        ...


class FileKeyStore:
    """One JSON file (id -> record), replaced atomically on every change; read
    again when its modification time changes."""

    def __init__(self, path: Path):
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._records: dict[str, ApiKey] = {}

    def _load(self) -> dict[str, ApiKey]:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self._stamp, self._records = None, {}
            return self._records
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            raw = json.loads(self.path.read_text() or "{}")
            self._records = {k: ApiKey.from_json(json.dumps(v)) for k, v in raw.items()}
            self._stamp = stamp
        return self._records

    async def get(self, key_id: str) -> ApiKey | None:
        return self._load().get(key_id)

    async def put(self, record: ApiKey) -> None:
        records = dict(self._load())
        records[record.key_id] = record
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({k: json.loads(v.to_json()) for k, v in records.items()}, indent=1))
        os.chmod(tmp, 0o600)
        tmp.replace(self.path)

    async def all(self) -> list[ApiKey]:
        return sorted(self._load().values(), key=lambda r: r.created_at)

    async def configured(self) -> bool:
        return bool(self._load())


class RedisKeyStore:
    """A Redis hash: key id -> record JSON. ``client`` is a redis.asyncio client."""

    def __init__(self, client: redis.asyncio.Redis, key: str = "llmesh:keys"):
        self._redis = client
        self._key = key

    async def get(self, key_id: str) -> ApiKey | None:
        raw = await self._redis.hget(self._key, key_id)
        return ApiKey.from_json(raw) if raw else None

    async def put(self, record: ApiKey) -> None:
        await self._redis.hset(self._key, record.key_id, record.to_json())

    async def all(self) -> list[ApiKey]:
        raw = await self._redis.hgetall(self._key)
        return sorted((ApiKey.from_json(v) for v in raw.values()), key=lambda r: r.created_at)

    async def configured(self) -> bool:
        return bool(await self._redis.exists(self._key))


async def revoke(store: KeyStore, key_id: str, now: float | None = None) -> ApiKey:
    record = await store.get(key_id)
    if record is None:
        raise KeyError(key_id)
    if record.revoked_at is None:
        record = replace(record, revoked_at=time.time() if now is None else now)
        await store.put(record)
    return record


async def rotate(store: KeyStore, key_id: str) -> tuple[str, ApiKey]:
    """A new key with the old one's tenant, models and expiry; the old one is revoked."""
    old = await store.get(key_id)
    if old is None:
        raise KeyError(key_id)
    plaintext, record = new_key(old.tenant, models=old.models, expires_at=old.expires_at, name=old.name)
    await store.put(record)
    await revoke(store, key_id)
    return plaintext, record
