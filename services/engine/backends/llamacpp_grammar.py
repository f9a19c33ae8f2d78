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
import json
import re
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from itertools import accumulate
from collections.abc import Callable
from typing import Any

from llmesh.errors import InvalidArgument
from llmesh.schema_bounds import LIMITS, check_schema
from llmesh.tool_prompt import ARGUMENTS_KEY, CALL_CLOSE, CALL_HEAD, CALL_OPEN, MAX_PARALLEL_CALLS, arguments_schema
from llmesh.types import ResponseFormat, Tools

PARAM = "response_format.json_schema.schema"
TOOLS_PARAM = "tools"
# auto's text answer: anything that does not start as a call does (tool_prompt.CALL_OPEN)
TEXT_RULE = r'[^<\x00] [^\x00]*'
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
        grammar = json_schema_to_gbnf(schema)
    except Exception as exc:  # noqa: BLE001 - the converter raises plain errors for schemas it cannot express
        raise InvalidArgument(f"The JSON schema cannot be enforced: {str(exc)[:300]}.", param=PARAM) from None
    return _held(grammar, max_bytes, PARAM)


def _held(grammar: str, max_bytes: int, param: str) -> str:
    """The converter's grammar with JSON's string characters, within the size and nesting bounds."""
    grammar = grammar.replace(_LAX_CHAR, _JSON_CHAR)
    if len(grammar) > max_bytes:
        raise InvalidArgument(f"The JSON schema expands to a grammar of {len(grammar)} bytes; at most {max_bytes} "
                              "are allowed.", param=param)
    nesting = gbnf_nesting(grammar)
    if nesting > MAX_NESTING:
        raise InvalidArgument(f"The JSON schema expands to a grammar nested {nesting} groups deep; at most "
                              f"{MAX_NESTING} are allowed.", param=param)
    return grammar


def tools_grammar(tools: Tools, max_bytes: int = LIMITS.max_grammar_bytes) -> str:
    """The GBNF of an answer to a request that offers ``tools`` (tool_prompt's call format): one call, or
    up to MAX_PARALLEL_CALLS with ``parallel`` (unset: true), of the named function or any offered one, its
    arguments matching that function's parameters; with choice "auto", text as the other branch. Each
    parameters schema is held to the schema bounds, all of them converted by one converter (their
    ``$ref``s resolved within their own schema)."""
    from llama_cpp.llama_grammar import SchemaConverter

    converter = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    literal = converter._format_literal
    branches = []
    for i, tool in enumerate(tools.functions):
        if tools.choice == "function" and tool.name != tools.function:
            continue
        param = f"tools[{i}].function.parameters"
        check_schema(tool.parameters or '{"type": "object"}', param)
        try:
            schema = arguments_schema(tool.parameters)
            rule = converter.visit(converter.resolve_refs(schema, f"tool{i}"), f"tool{i}-arguments")
        except Exception as exc:  # noqa: BLE001 - as in schema_grammar
            raise InvalidArgument(f"The JSON schema cannot be enforced: {str(exc)[:300]}.", param=param) from None
        branches.append(f"{literal(json.dumps(tool.name) + ARGUMENTS_KEY)} {rule}")
    call = f"{literal(CALL_OPEN + CALL_HEAD)} ( {' | '.join(branches)} ) {literal('}' + CALL_CLOSE)}"
    converter._add_rule("tool-call", call)
    calls = f'tool-call ("\\n" tool-call){{0,{MAX_PARALLEL_CALLS - 1}}}' if tools.parallel is not False \
        else "tool-call"
    if tools.choice == "auto":
        converter._add_rule("text", TEXT_RULE)
        converter._add_rule("root", f"{calls} | text")
    else:
        converter._add_rule("root", calls)
    return _held(converter.format_grammar(), max_bytes, TOOLS_PARAM)


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
        self._cache: OrderedDict[str | Tools, str | InvalidArgument] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")

    async def grammar(self, fmt: ResponseFormat) -> str:
        if fmt.type == "json_object":
            from llama_cpp.llama_grammar import JSON_GBNF

            return JSON_GBNF
        schema = fmt.schema or "{}"
        return await self._cached(schema, lambda: schema_grammar(schema, self._max_bytes), PARAM)

    async def tools_grammar(self, tools: Tools) -> str:
        """The grammar of an answer that may call ``tools`` (``tools_grammar``), made as a schema's."""
        return await self._cached(tools, lambda: tools_grammar(tools, self._max_bytes), TOOLS_PARAM)

    async def _cached(self, key: str | Tools, make: Callable[[], str], param: str) -> str:
        known = self._cache.get(key)
        if known is None:
            known = await self._make(make, param)
            self._cache[key] = known
            while len(self._cache) > self._entries:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        if isinstance(known, InvalidArgument):
            raise InvalidArgument(known.message, param=known.param)
        return known

    async def _make(self, make: Callable[[], str], param: str) -> str | InvalidArgument:
        job = asyncio.get_running_loop().run_in_executor(self._pool, self._build, make, param)
        try:
            return await asyncio.wait_for(job, self._timeout)
        except InvalidArgument as exc:
            return exc
        except TimeoutError:  # the worker finishes it (bounded), a queued one is dropped
            return InvalidArgument(f"The JSON schema could not be turned into a grammar within {self._timeout:g} s.",
                                   param=param)

    def _build(self, make: Callable[[], str], param: str) -> str:
        grammar = make()
        if self._vocab is not None:
            import llama_cpp as lc

            sampler = lc.llama_sampler_init_grammar(self._vocab, grammar.encode(), b"root")
            if not sampler:
                raise InvalidArgument("llama.cpp cannot use the grammar of this JSON schema (left recursion, or "
                                      "more repetition than its parser allows).", param=param)
            lc.llama_sampler_free(sampler)
        return grammar

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
