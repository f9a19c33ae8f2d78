"""The HTTP <-> gRPC table (docs/api.md), read and checked against both fronts: the request
bodies the HTTP front accepts (its pydantic models, and the fields it knows to refuse
or ignore) and the Gateway's proto descriptors. Used by test_parity."""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from pathlib import Path

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from pydantic import BaseModel

START, END = "<!-- parity:start -->", "<!-- parity:end -->"
NONE = "—"
REQUEST = {"chat": "ChatRequest", "text": "CompleteRequest"}  # each HTTP route's gRPC request message


@dataclass(frozen=True)
class Row:
    front: str  # chat | text | both (chat and text) | header
    http: str
    grpc: str  # a field of the front's request message ("sampling.top_p"), "metadata `name`", "deadline" or "—"
    note: str


def read_table(readme: str) -> list[Row]:
    body = readme.split(START, 1)[1].split(END, 1)[0]
    rows = []
    for line in body.strip().splitlines()[2:]:  # after the header and the |---| line
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        front, http, grpc, note = cells
        rows.append(Row(front, http.strip("`"), grpc.strip("`"), note))
    return rows


def readme_text(root: Path) -> str:
    return (root / "docs" / "api.md").read_text()  # the table moved there from the README


def _models(annotation) -> tuple[list[type[BaseModel]], bool, bool]:
    """(models inside, whether a scalar is allowed too, whether inside a list)."""
    models, scalar, listed = [], False, False
    stack = [(annotation, False)]
    while stack:
        a, in_list = stack.pop()
        origin = typing.get_origin(a)
        if isinstance(a, type) and issubclass(a, BaseModel):
            models.append(a)
            listed = listed or in_list
        elif origin in (list, tuple):
            stack.extend((x, True) for x in typing.get_args(a))
        elif origin in (typing.Union, types.UnionType):
            stack.extend((x, in_list) for x in typing.get_args(a))
        elif a is type(None):
            continue
        else:
            scalar = True
    return models, scalar, listed


def http_fields(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every field path a body may hold: ``messages[].role``, ``response_format.json_schema.schema``;
    a field that takes a scalar or an object (``tool_choice``) is listed both ways."""
    out: set[str] = set()
    for name, info in model.model_fields.items():
        key = info.alias or name
        models, scalar, listed = _models(info.annotation)
        path = prefix + key
        if scalar or not models:
            out.add(path)
        for m in models:
            out |= http_fields(m, path + ("[]." if listed else "."))
    return out


def proto_fields(desc: Descriptor, prefix: str | None = None, seen: frozenset = frozenset()) -> set[str]:
    """``ChatRequest.sampling.temperature``...: every field reachable from a request
    message, through the llmesh message types it holds."""
    prefix = desc.name if prefix is None else prefix
    out: set[str] = set()
    for f in desc.fields:
        path = f"{prefix}.{f.name}"
        sub = f.message_type
        if f.type == FieldDescriptor.TYPE_MESSAGE and sub.full_name.startswith("llmesh.") and sub not in seen:
            out |= proto_fields(sub, path, seen | {desc})
        else:
            out.add(path)
    return out


def problems(rows: list[Row], http: dict[str, set[str]], known_off: set[str], grpc: set[str],
             headers: set[str]) -> list[str]:
    """What keeps the table and the two fronts from agreeing, in words; empty: parity.
    ``http``: front -> body field paths; ``known_off``: fields the HTTP front refuses
    or ignores by name; ``grpc``: proto field paths; ``headers``: header names."""
    out = []
    listed = {(front, r.http) for r in rows for front in (("chat", "text") if r.front == "both" else (r.front,))}
    for front, fields in http.items():
        for f in sorted(fields | known_off):
            if (front, f) not in listed:
                out.append(f"HTTP {front} field '{f}' is not in the table")
    mapped = set()
    for r in rows:
        if r.front == "header":
            if r.http.lower() not in headers:
                out.append(f"header '{r.http}' is not one the gateway reads or writes")
        elif r.front != "both" and r.front not in http:
            out.append(f"unknown front '{r.front}'")
        else:
            fields = set().union(*http.values()) if r.front == "both" else http[r.front]
            if r.http not in fields | known_off and not any(
                    f.startswith(r.http + ".") or f.startswith(r.http + "[]") for f in fields):
                out.append(f"table row '{r.front} {r.http}' names no field of the HTTP front")
        if r.grpc == NONE:
            if not r.note:
                out.append(f"'{r.front} {r.http}' has no gRPC field and no reason why")
        elif r.grpc.startswith("metadata") or r.grpc == "deadline":
            if r.front != "header":
                out.append(f"'{r.front} {r.http}' maps to metadata but is a body field")
        else:
            for front in ("chat", "text") if r.front == "both" else (r.front,):
                path = REQUEST[front] + "." + r.grpc
                if path not in grpc:
                    out.append(f"gRPC field '{path}' (for '{r.front} {r.http}') is not in the protos")
                mapped.add(path)
    for path in sorted(grpc - mapped):
        out.append(f"gRPC field '{path}' has no row in the table")
    return out
