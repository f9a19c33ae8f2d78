"""An input file's lines, checked as OpenAI checks a batch input line: a JSON object with
a ``custom_id`` unique in the file, ``method`` POST, ``url`` one of the batch endpoints and
a ``body`` object. Linear in the file; the caller bounds the file first."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from llmesh.errors import InvalidArgument
from llmesh.gateway.domain.batches.model import ENDPOINTS

MAX_CUSTOM_ID = 512


@dataclass(frozen=True, slots=True)
class Line:
    index: int
    custom_id: str
    url: str
    body: bytes  # the request body, as JSON


def _bad(number: int, message: str) -> InvalidArgument:
    return InvalidArgument(f"Line {number} of the file: {message}", reason="invalid_batch_file", param="file")


def _line(number: int, raw: bytes) -> tuple[str, str, dict[str, Any]]:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise _bad(number, "not valid JSON.") from None
    if not isinstance(obj, dict):
        raise _bad(number, "not a JSON object.")
    custom_id, method, url, body = obj.get("custom_id"), obj.get("method"), obj.get("url"), obj.get("body")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        raise _bad(number, f"'custom_id' must be a string of 1 to {MAX_CUSTOM_ID} characters.")
    if method != "POST":
        raise _bad(number, "'method' must be 'POST'.")
    if url not in ENDPOINTS:
        raise _bad(number, f"'url' must be one of {', '.join(ENDPOINTS)}.")
    if not isinstance(body, dict):
        raise _bad(number, "'body' must be a JSON object.")
    unknown = set(obj) - {"custom_id", "method", "url", "body"}
    if unknown:
        raise _bad(number, f"unknown field '{sorted(unknown)[0]}'.")
    return custom_id, url, body


def parse_lines(content: bytes, max_lines: int) -> list[Line]:
    """The file's lines (blank ones skipped), or InvalidArgument naming the first bad one."""
    out: list[Line] = []
    seen: set[str] = set()
    for number, raw in enumerate(content.split(b"\n"), start=1):
        if not raw.strip():
            continue
        if len(out) >= max_lines:
            raise _bad(number, f"a batch file holds at most {max_lines} requests.")
        custom_id, url, body = _line(number, raw)
        if custom_id in seen:
            raise _bad(number, f"the custom_id '{custom_id[:64]}' is not unique in the file.")
        seen.add(custom_id)
        out.append(Line(len(out), custom_id, url, orjson.dumps(body)))
    if not out:
        raise InvalidArgument("The file holds no requests.", reason="invalid_batch_file", param="file")
    return out
