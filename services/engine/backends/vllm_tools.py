"""Tool calls on the vllm backend, as vLLM 0.32's own OpenAI server serves them with its ``hermes``
tool parser: the parser's structural tag constrains the answer (xgrammar, through
``StructuredOutputsParams(structural_tag=...)``), the parser reads the calls out of it.

- Constraint: vLLM's ``Hermes2ProToolParser.get_structural_tag`` at strict level ``parameter`` (every
  call's arguments follow its function's schema, as llmesh promises on every engine): "required"
  one or more ``<tool_call>`` blocks and nothing else, a named function exactly one block of it,
  "auto" free text in which ``<tool_call>`` starts a block that must then be a valid call.
  ``parallel_tool_calls`` false stops after the first call (vLLM's ``limit_to_single_tool_call``);
  otherwise the reader ends the answer after ``MAX_PARALLEL_CALLS``, the bound llama.cpp's grammar has.
- Reading: ``HermesCallReader`` passes text through until ``<tool_call>`` (holding back what may be
  its start), then hands each completed block to the parser's ``extract_tool_calls`` and gives out
  its calls as llmesh ToolCalls, as ``toolcalls.CallReader`` does for llama.cpp (whose stop-string,
  finish-reason and id handling it inherits). Text after the first call is not content (vLLM's
  server keeps only what precedes it).

vLLM's classes come in ``VllmToolApi`` (``load()`` imports them), so the reader is tested without vLLM."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmesh.errors import Internal, InvalidArgument
from llmesh.tool_prompt import MAX_PARALLEL_CALLS, arguments_schema, offered
from llmesh.types import Delta, Prompt, ToolCall, Tools
from llmesh.engine.toolcalls import CallReader, call_id

TAG = "<tool_call>"
CLOSE = "</tool_call>"
CACHE_ENTRIES = 32  # requests' tools remembered (VllmToolCalls)


@dataclass(frozen=True, slots=True)
class VllmToolApi:
    """The parts of vLLM tool calling uses (vLLM 0.32's module paths in ``load``)."""
    parser: Any            # the hermes parser, made once with the model's tokenizer
    request: Callable      # ChatCompletionRequest
    strict: Any            # ToolStrictLevel.PARAMETER
    single_call: Callable  # limit_to_single_tool_call
    overlap: Callable[[str, str], int]  # partial_tag_overlap(text, tag)
    refusals: tuple[type[Exception], ...] = (ValueError,)  # what vLLM raises for tools it cannot take

    @classmethod
    def load(cls, tokenizer) -> VllmToolApi:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.exceptions import VLLMClientError
        from vllm.tool_parsers.abstract_tool_parser import ToolParserManager
        from vllm.tool_parsers.structural_tag_registry import limit_to_single_tool_call
        from vllm.tool_parsers.tool_strict_level import ToolStrictLevel
        from vllm.tool_parsers.utils import partial_tag_overlap

        return cls(ToolParserManager.get_tool_parser("hermes")(tokenizer), ChatCompletionRequest,
                   ToolStrictLevel.PARAMETER, limit_to_single_tool_call, partial_tag_overlap,
                   (ValueError, VLLMClientError))


class VllmToolCalls:
    """One backend's tool calling: each request's tools as vLLM takes them and their structural tag
    (remembered by Tools: a client sends the same tools turn after turn), and its reader."""

    def __init__(self, api: VllmToolApi, model: str):
        self._api = api
        self._model = model
        self._known: OrderedDict[Tools, tuple[Any, str]] = OrderedDict()

    def structural_tag(self, tools: Tools) -> str:
        """The structural tag (JSON text) that constrains an answer to ``tools`` (module docstring)."""
        return self._entry(tools)[1]

    def reader(self, tools: Tools, stops: tuple[str, ...] = ()) -> HermesCallReader:
        request = self._entry(tools)[0]
        return HermesCallReader(lambda text: self._api.parser.extract_tool_calls(text, request), self._api.overlap,
                                stops)

    def _entry(self, tools: Tools) -> tuple[Any, str]:
        known = self._known.get(tools)
        if known is not None:
            self._known.move_to_end(tools)
            return known
        listed = [{"type": "function", "function": {
            "name": t.name, "description": t.description or None,
            "parameters": arguments_schema(t.parameters)}} for t in tools.functions]
        choice: Any = {"type": "function", "function": {"name": tools.function}} \
            if tools.choice == "function" else tools.choice
        try:  # vLLM's ChatCompletionRequest: what its parser reads
            request = self._api.request(model=self._model, messages=[], tools=listed, tool_choice=choice,
                                        parallel_tool_calls=tools.parallel)
            tag = self._api.parser.get_structural_tag(request, reasoning=False, strict_level=self._api.strict)
        except self._api.refusals as exc:  # pydantic's ValidationError is a ValueError
            raise InvalidArgument(f"vLLM refused the tools: {str(exc)[:300]}", param="tools") from None
        if tag is None:
            raise Internal("vLLM's hermes parser made no structural tag for tools it was offered")
        if tools.parallel is False:
            self._api.single_call(tag)
        known = self._known[tools] = (request, json.dumps(tag.model_dump()))
        while len(self._known) > CACHE_ENTRIES:
            self._known.popitem(last=False)
        return known


class HermesCallReader(CallReader):
    """One answer's items through vLLM's hermes parser (``parse``: its ``extract_tool_calls`` on
    one ``<tool_call>`` block); ``feed`` each Delta, then ``flush`` and ``reason`` (CallReader's)."""

    __slots__ = ("_parse", "_overlap")

    def __init__(self, parse: Callable[[str], Any], overlap: Callable[[str, str], int], stops: tuple[str, ...] = ()):
        super().__init__(calls_only=False, stops=stops)
        self._mode = "text"  # until TAG: "calls" from then on
        self._parse = parse
        self._overlap = overlap

    def feed(self, delta: Delta) -> Delta | None:
        if self._stops.stopped:
            return None  # the text answer ended at its stop string
        if self._mode == "calls":
            self._held += delta.text
            self._tokens += delta.tokens
            return self._completed()
        held, tokens, self._tokens = self._held + delta.text, self._tokens + delta.tokens, 0
        at = held.find(TAG)
        if at < 0:  # text, less what may be the tag's start
            cut = len(held) - self._overlap(held, TAG)
            self._held = held[cut:]
            return self._text(held[:cut], tokens, delta)
        self._mode, self._held = "calls", held[at:]
        if not at:
            self._tokens = tokens
            return self._completed()
        text = self._text(held[:at], tokens, delta)
        if self.stopped:  # the text before the call met a stop string: the answer ended there
            return text
        said = (text.text if text is not None else "") + self._stops.flush()  # no stop string can follow
        calls = self._completed()
        return Delta(said, tokens, tool_calls=calls.tool_calls if calls is not None else ())

    def _completed(self) -> Delta | None:
        calls: list[ToolCall] = []
        while self.calls + len(calls) < MAX_PARALLEL_CALLS and (end := self._held.find(CLOSE, self._from)) >= 0:
            end += len(CLOSE)
            calls.extend(self._read(self._held[:end], len(calls)))
            rest = self._held[end:]
            start = rest.find(TAG)  # what lies between calls is not content (but may begin the next call)
            self._held, self._from = (rest[start:] if start >= 0 else rest[len(rest) - self._overlap(rest, TAG):]), 0
        if not calls:
            self._from = max(0, len(self._held) - len(CLOSE))
            return None
        self.calls += len(calls)
        tokens, self._tokens = self._tokens, 0
        return Delta("", tokens, tool_calls=tuple(calls))

    def _read(self, block: str, before: int) -> list[ToolCall]:
        found = self._parse(block)
        if not found.tools_called or not found.tool_calls:
            raise Internal("The model's tool call does not parse as vLLM's structural tag should have made it.")
        return [ToolCall(index=self.calls + before + i, id=call_id(), name=c.function.name,
                         arguments=_compact(c.function.arguments)) for i, c in enumerate(found.tool_calls)]

    def flush(self) -> Delta | None:
        """Text held back at the answer's end: what might have begun the tag, or a stop string."""
        held, self._held = (self._held, "") if self._mode == "text" and not self._stops.stopped else ("", self._held)
        rest = (self._stops.feed(held) if held else "") + self._stops.flush()
        return Delta(rest, 0) if rest else None

    @property
    def stopped(self) -> bool:
        """A text answer met a stop string, or the calls reached MAX_PARALLEL_CALLS."""
        return self._stops.stopped or self.calls >= MAX_PARALLEL_CALLS


def _compact(arguments: str) -> str:
    """Arguments as llama.cpp's calls have them: compact JSON text."""
    try:
        return json.dumps(json.loads(arguments), ensure_ascii=False, separators=(",", ":"))
    except ValueError:
        raise Internal("vLLM's parser returned arguments that are not JSON") from None


def takes_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` (Qwen2.5's, Hermes', Llama 3.1's do;
    SmolLM2's does not): then it shows them and the history's calls, else tool_prompt's Hermes
    rendering does. A template that Jinja cannot parse alone (transformers' own tags) counts as not."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "tools" not in template:
        return False
    import jinja2
    import jinja2.meta

    try:
        parsed = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return False
    return "tools" in jinja2.meta.find_undeclared_variables(parsed)


def template_chat(prompt: Prompt, tools: Tools | None) -> tuple[list[dict], list[dict] | None]:
    """The chat and the offered tools as transformers' ``apply_chat_template`` takes them (OpenAI's
    shapes; a call's arguments as an object, as chat templates expect)."""
    messages: list[dict] = []
    for m in prompt.messages or ():
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": _arguments(c.arguments)}} for c in m.tool_calls]
        messages.append(message)
    shown = offered(tools)
    if shown is None:
        return messages, None
    return messages, [{"type": "function", "function": {
        "name": t.name, "description": t.description, "parameters": arguments_schema(t.parameters)}}
        for t in shown.functions]


def _arguments(text: str) -> Any:
    try:
        return json.loads(text) if text else {}
    except ValueError:  # the gateway checked history calls' arguments; a direct caller's stay text
        return text
