"""GBNF grammars for response formats, made off the event loop within a time and size
budget, and checked to be safe for llama.cpp's parser before the decode thread sees them.

llama-cpp-python's JSON-Schema converter expands repetition bounds into grammar text and
llama.cpp's grammar parser recurses once per nested group (measured here: it refuses more
than 1,000 nested optional groups, and crashed the engine with SIGSEGV from 19,000 nested
groups on an 8 MB thread stack). So a schema is first held to ``llmesh.schema_bounds``
(the gateway checked them too; a direct caller may not have), converted on a worker
thread with a deadline, its grammar held to a size and a nesting, and parsed once there
(what llama.cpp refuses is INVALID_ARGUMENT, not a failed request on the decode thread)."""

from __future__ import annotations

import asyncio
import re
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from itertools import accumulate
from typing import Any

from llmesh.errors import InvalidArgument
from llmesh.schema_bounds import LIMITS, check_schema
from llmesh.types import ResponseFormat

PARAM = "response_format.json_schema.schema"
# Nested groups in one rule: llama.cpp refuses over 1,000 nested `?` groups by itself, and
# its parser's recursion crashed from 19,000 (18,000 parsed); plain groups are held to the same 1,000.
MAX_NESTING = 1_000
TIMEOUT_S = 2.0  # conversion and the trial parse; bounded schemas convert in under ~0.3 s here
CACHE_ENTRIES = 32  # grammars (or refusals) by schema text: a client sends one schema many times

_LITERALS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|\[[^\]\\]*(?:\\.[^\]\\]*)*\]', re.DOTALL)
_NOT_PAREN = re.compile(r"[^()]+")
_PAREN = {"(": 1, ")": -1}
# The converter's string characters admit raw control characters, which JSON forbids
# inside strings (its own JSON_GBNF excludes them): they are excluded here too.
_LAX_CHAR = r'char ::= [^"\\] |'
_JSON_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] |'


def gbnf_nesting(grammar: str) -> int:
    """The deepest nesting of ``( )`` groups in GBNF text (literals and classes skipped)."""
    parens = _NOT_PAREN.sub("", _LITERALS.sub("", grammar))
    return max(accumulate(map(_PAREN.__getitem__, parens)), default=0)


def schema_grammar(schema: str, max_bytes: int = LIMITS.max_grammar_bytes) -> str:
    """The GBNF of a JSON schema (text), or InvalidArgument: over the schema bounds, not
    expressible by the converter, or a grammar over ``max_bytes`` or ``MAX_NESTING``."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    check_schema(schema, PARAM)
    try:
        grammar = json_schema_to_gbnf(schema).replace(_LAX_CHAR, _JSON_CHAR)
    except Exception as exc:  # noqa: BLE001 - the converter raises plain errors for schemas it cannot express
        raise InvalidArgument(f"The JSON schema cannot be enforced: {str(exc)[:300]}.", param=PARAM) from None
    if len(grammar) > max_bytes:
        raise InvalidArgument(f"The JSON schema expands to a grammar of {len(grammar)} bytes; at most {max_bytes} "
                              "are allowed.", param=PARAM)
    nesting = gbnf_nesting(grammar)
    if nesting > MAX_NESTING:
        raise InvalidArgument(f"The JSON schema expands to a grammar nested {nesting} groups deep; at most "
                              f"{MAX_NESTING} are allowed.", param=PARAM)
    return grammar


class GrammarCompiler:
    """Grammars for one backend's requests: one worker thread, a deadline each, the
    recent ones remembered. ``vocab`` (a llama_vocab pointer) lets the worker parse each
    grammar once as llama.cpp will; None skips that (tests of the converter alone)."""

    def __init__(self, vocab: Any = None, *, timeout_s: float = TIMEOUT_S,
                 max_bytes: int = LIMITS.max_grammar_bytes, cache_entries: int = CACHE_ENTRIES):
        self._vocab = vocab
        self._timeout = timeout_s
        self._max_bytes = max_bytes
        self._entries = cache_entries
        self._cache: OrderedDict[str, str | InvalidArgument] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")

    async def grammar(self, fmt: ResponseFormat) -> str:
        if fmt.type == "json_object":
            from llama_cpp.llama_grammar import JSON_GBNF

            return JSON_GBNF
        schema = fmt.schema or "{}"
        known = self._cache.get(schema)
        if known is None:
            known = await self._make(schema)
            self._cache[schema] = known
            while len(self._cache) > self._entries:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(schema)
        if isinstance(known, InvalidArgument):
            raise InvalidArgument(known.message, param=known.param)
        return known

    async def _make(self, schema: str) -> str | InvalidArgument:
        job = asyncio.get_running_loop().run_in_executor(self._pool, self._build, schema)
        try:
            return await asyncio.wait_for(job, self._timeout)
        except InvalidArgument as exc:
            return exc
        except TimeoutError:  # the worker finishes it (bounded), a queued one is dropped
            return InvalidArgument(f"The JSON schema could not be turned into a grammar within {self._timeout:g} s.",
                                   param=PARAM)

    def _build(self, schema: str) -> str:
        grammar = schema_grammar(schema, self._max_bytes)
        if self._vocab is not None:
            import llama_cpp as lc

            sampler = lc.llama_sampler_init_grammar(self._vocab, grammar.encode(), b"root")
            if not sampler:
                raise InvalidArgument("llama.cpp cannot use the grammar of this JSON schema (left recursion, or "
                                      "more repetition than its parser allows).", param=PARAM)
            lc.llama_sampler_free(sampler)
        return grammar

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
