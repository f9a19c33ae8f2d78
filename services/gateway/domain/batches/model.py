"""Files and batches as OpenAI's API shows them (``/v1/files``, ``/v1/batches``)."""

from __future__ import annotations

import secrets
from dataclasses import asdict, dataclass, field, replace
import builtins
from typing import Any

import orjson

from llmesh.gateway.context import Caller

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
WINDOWS = {"24h": 24 * 3600}
OPEN = ("validating", "in_progress", "cancelling")  # a batch whose lines may still run
ENDED = ("completed", "failed", "cancelled", "expired")


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


@dataclass(frozen=True, slots=True)
class FileObject:
    id: str
    tenant: str
    bytes: int
    created_at: int
    filename: str
    purpose: str  # batch | batch_output

    def json(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "status_details": None}

    def dumps(self) -> builtins.bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def loads(cls, raw: builtins.bytes) -> FileObject:
        return cls(**orjson.loads(raw))


@dataclass(frozen=True, slots=True)
class Batch:
    id: str
    caller: Caller  # who made it: its lines run as this caller
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    total: int
    status: str = "validating"
    metadata: dict[str, str] | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    expired_at: int | None = None
    counts: dict[str, int] | None = None  # once ended: the request counts (the results are gone)

    @property
    def tenant(self) -> str:
        return self.caller.tenant

    def moved(self, status: str, now: int, **fields: Any) -> Batch:
        stamp = {"in_progress": "in_progress_at", "finalizing": "finalizing_at", "completed": "completed_at",
                 "failed": "failed_at", "cancelling": "cancelling_at", "cancelled": "cancelled_at",
                 "expired": "expired_at"}[status]
        changes: dict[str, Any] = {stamp: now, **fields}
        return replace(self, status=status, **changes)

    def json(self, counts: dict[str, int]) -> dict[str, Any]:
        counts = self.counts if self.counts is not None else counts
        return {"id": self.id, "object": "batch", "endpoint": self.endpoint, "input_file_id": self.input_file_id,
                "completion_window": self.completion_window, "status": self.status,
                "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
                "created_at": self.created_at, "in_progress_at": self.in_progress_at,
                "expires_at": self.expires_at, "finalizing_at": self.finalizing_at,
                "completed_at": self.completed_at, "failed_at": self.failed_at, "expired_at": self.expired_at,
                "cancelling_at": self.cancelling_at, "cancelled_at": self.cancelled_at,
                "request_counts": {"total": self.total, "completed": counts.get("completed", 0),
                                   "failed": counts.get("failed", 0)},
                "metadata": self.metadata,
                "errors": {"object": "list", "data": self.errors} if self.errors else None}

    def dumps(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def loads(cls, raw: bytes) -> Batch:
        data = orjson.loads(raw)
        caller = data.pop("caller")
        caller["groups"] = tuple(caller["groups"])
        if caller["models"] is not None:
            caller["models"] = tuple(caller["models"])
        return cls(caller=Caller(**caller), **data)


def result_line(line_id: str, custom_id: str, status: int | None, request_id: str, body: Any,
                error: dict[str, str] | None) -> bytes:
    """One line of an output or error file, in OpenAI's format."""
    response = None if status is None else {"status_code": status, "request_id": request_id, "body": body}
    return orjson.dumps({"id": line_id, "custom_id": custom_id, "response": response, "error": error})
