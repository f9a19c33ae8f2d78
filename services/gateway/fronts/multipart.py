"""multipart/form-data (RFC 7578), as the OpenAI SDK uploads a file: a body already read
within its cap into named parts. Linear in the body; header blocks are bounded."""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmesh.errors import InvalidArgument

MAX_BOUNDARY = 70  # RFC 2046
MAX_HEADERS = 8192  # one part's header block
MAX_PARTS = 16
_PARAM = re.compile(r';\s*([A-Za-z0-9_*-]{1,32})="([^"\r\n]{0,1024})"')
_BOUNDARY = re.compile(r'boundary="?([0-9A-Za-z\'()+_,./:=? -]{1,70})"?\s*(?:;|$)')


@dataclass(frozen=True, slots=True)
class Part:
    name: str
    filename: str | None
    data: bytes


def _bad(message: str) -> InvalidArgument:
    return InvalidArgument(message, reason="invalid_multipart", param="file")


def boundary(content_type: str) -> bytes:
    kind = content_type.split(";", 1)[0].strip().lower()
    match = _BOUNDARY.search(content_type[:512])
    if kind != "multipart/form-data" or match is None:
        raise _bad("Upload the file as multipart/form-data.")
    return match.group(1).rstrip().encode()


def parts(body: bytes | bytearray, content_type: str) -> dict[str, Part]:
    """The body's parts by name (the first of a name wins). One pass of ``find`` over the body;
    only each part's data is copied out of it (a split would copy the whole body twice, on the
    event loop: 50 MiB uploads are allowed)."""
    dash = b"--" + boundary(content_type)
    delimiter = b"\r\n" + dash
    view = memoryview(body)
    if body.startswith(dash):
        pos = 0
    else:  # a preamble before the first delimiter is skipped
        pos = body.find(delimiter) + 2
        if pos < 2:
            raise _bad("The multipart body is not complete.")
    found: dict[str, Part] = {}
    count = 0
    while True:
        pos += len(dash)
        if body.startswith(b"--", pos):  # the closing delimiter
            if count == 0:
                raise _bad("The multipart body is not complete.")
            return found
        end = body.find(delimiter, pos)
        if end < 0:
            raise _bad("The multipart body is not complete.")
        count += 1
        if count > MAX_PARTS:
            raise _bad(f"A multipart body holds at most {MAX_PARTS} parts.")
        head_end = body.find(b"\r\n\r\n", pos, min(end, pos + MAX_HEADERS))
        if head_end < 0:
            raise _bad("A multipart part has no header block, or one too long.")
        head = bytes(view[pos:head_end]).decode("utf-8", "replace")
        disposition = next((line for line in head.split("\r\n") if line.lower().startswith("content-disposition:")),
                           "")
        params = dict(_PARAM.findall(disposition))
        if "name" not in params:
            raise _bad("A multipart part has no name.")
        if params["name"] not in found:
            found[params["name"]] = Part(params["name"], params.get("filename"), bytes(view[head_end + 4:end]))
        pos = end + 2  # at the next "--boundary"
