"""Request ids: the client's ``x-request-id`` when it is a safe one, else a new one.

An id travels far: response headers, gRPC metadata to the engines, every log line, the
audit record (whose strings are at most 200 characters), the answer's ``id``. So the id a
request is served under is at most :data:`MAX_LENGTH` characters of :data:`SAFE_CHARS`
(what UUIDs, ULIDs, hex and base64 ids and most tracing systems' ids use). A client's
value outside that is replaced by a generated id, and kept, escaped and cut to
:data:`KEPT_LENGTH` characters, as the request's ``client_request_id`` so it can still be
found in the audit log and the access log."""

from __future__ import annotations

import os
import re

MAX_LENGTH = 128
SAFE_CHARS = "A-Z a-z 0-9 - _ . : / + = @"
_SAFE = re.compile(r"[A-Za-z0-9_.:/+=@-]{1,%d}" % MAX_LENGTH)
KEPT_LENGTH = 128  # of the escaped form


def new_request_id() -> str:
    """32 hex digits: uuid4's randomness, a third of its cost."""
    return os.urandom(16).hex()


def accept(value: str | None) -> tuple[str, str | None]:
    """(the id to serve the request under, the client's value as the record keeps it, or
    None when the client's own id is used or it sent none)."""
    if not value:
        return new_request_id(), None
    if safe(value):
        return value, None
    return new_request_id(), kept(value)


def safe(value: str) -> bool:
    """At most MAX_LENGTH characters of SAFE_CHARS."""
    return len(value) <= MAX_LENGTH and _SAFE.fullmatch(value) is not None


def kept(value: str) -> str:
    """``value`` with anything but printable ASCII escaped (``\\x..``, ``\\u....``),
    at most :data:`KEPT_LENGTH` characters."""
    return ascii(value[:KEPT_LENGTH])[1:-1][:KEPT_LENGTH]
