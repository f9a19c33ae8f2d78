"""PII masking inside JSON text that must stay JSON: tool-call arguments, a tool's answer, a
tool's parameter schema. Masking the text as prose would break it (a card number written as a
JSON number becomes ``[CARD_1]``, not JSON; a private key without its END line swallows the
closing quote and brace) and miss what escapes hide (``bob\\u0040example.com``). So the text is
parsed, each string is masked as the prose rules mask text, a number that masks (a card or a
phone written as a JSON number) becomes its placeholder as a string, and the value is written
back, only when something changed (an untouched argument keeps its exact bytes). The standard
library's parser keeps integers exact at any size (orjson turns those past 64 bits into floats).

``mask(text) -> text`` is the prose masker of the request (one shared placeholder registry).
Work is iterative (no recursion however deep the document) and each string is visited once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import json

Mask = Callable[[str], str]

# A parameter schema's human text (and sample values): masked. Everything else in a schema
# (property names, types, patterns, formats, $refs, required lists) is left as it is: the model
# must still produce arguments that fit it.
SCHEMA_TEXT = frozenset({"description", "title", "examples", "example", "enum", "const", "default", "$comment"})
# Maps whose keys are names the schema author chose (property names, definitions) rather than keywords.
SCHEMA_NAMED = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def mask_json_text(text: str, mask: Mask) -> str | None:
    """``text`` with every string and number masked, still JSON; None when ``text`` is not a JSON
    object or array, or nests deeper than the parser goes (the caller masks it as prose)."""
    value = _load(text)
    if value is None:
        return None
    return _dump(value) if _mask_values(value, mask) else text


def mask_schema_text(text: str, mask: Mask) -> str | None:
    """A JSON Schema's descriptions, titles, examples, enum/const/default values masked; None when
    ``text`` is not a JSON object or array (or nests too deep)."""
    schema = _load(text)
    if schema is None:
        return None
    changed = False
    stack: list[tuple[Any, bool]] = [(schema, False)]  # (node, its keys are names, not keywords)
    while stack:
        node, named = stack.pop()
        if isinstance(node, list):
            stack.extend((v, False) for v in node if isinstance(v, (dict, list)))
            continue
        for key, value in node.items():
            if not named and key in SCHEMA_TEXT:
                if isinstance(value, str):
                    masked = mask(value)
                    if masked is not value:
                        node[key], changed = masked, True
                elif isinstance(value, (dict, list)):
                    changed |= _mask_values(value, mask)
                elif (masked_number := _number(value, mask)) is not None:
                    node[key], changed = masked_number, True
            elif isinstance(value, (dict, list)):
                stack.append((value, not named and key in SCHEMA_NAMED))
    return _dump(schema) if changed else text


def _load(text: str) -> Any:
    stripped = text.lstrip()
    if not stripped or stripped[0] not in "[{":
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested deeper than the parser goes
        return None


def _dump(value: Any) -> str | None:
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    except (ValueError, RecursionError):
        return None  # deeper than the writer goes: the caller masks the text as prose


def _number(value: Any, mask: Mask) -> str | None:
    """The placeholder a JSON number masks to, or None (booleans and null are never PII)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    written = str(value)
    masked = mask(written)
    return masked if masked != written else None


def _mask_values(root: Any, mask: Mask) -> bool:
    """Masks, in place, every string (object keys included) and number under ``root``; True if any changed."""
    changed = False
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            for i, v in enumerate(node):
                if isinstance(v, str):
                    if (m := mask(v)) is not v:
                        node[i], changed = m, True
                elif isinstance(v, (dict, list)):
                    stack.append(v)
                elif (n := _number(v, mask)) is not None:
                    node[i], changed = n, True
            continue
        items = list(node.items())
        node.clear()
        for k, v in items:
            key = mask(k)
            changed |= key is not k
            if isinstance(v, str):
                if (m := mask(v)) is not v:
                    v, changed = m, True
            elif isinstance(v, (dict, list)):
                stack.append(v)
            elif (n := _number(v, mask)) is not None:
                v, changed = n, True
            node[key] = v
    return changed
