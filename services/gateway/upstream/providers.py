"""External OpenAI-compatible HTTP providers as upstreams: our request in their wire
format (their model name), their SSE stream back as Delta/Finish, their errors as ours.
The API key is read when a call is made, from the environment or a secret file, as the
gateway's ``ProviderSecrets`` allow (``provider_secrets``); a URL the schema would refuse
is never called."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any
import urllib.request

import aiohttp
import orjson
from yarl import URL

from llmesh.errors import DeadlineExceeded, Internal, InvalidArgument, LlmeshError, Overloaded, Unavailable
from llmesh.liveconfig.schema import Provider, url_problem
from llmesh.types import Delta, Finish, FinishReason, Message, TokenLogprob, ToolCall, Tools, Usage
from llmesh.gateway.context import CompletionRequest, Items
from llmesh.gateway.upstream import json_pieces
from llmesh.gateway.upstream.provider_secrets import ProviderSecrets

log = logging.getLogger("llmesh.gateway.providers")


def request_body(req: CompletionRequest, remote_model: str) -> tuple[str, dict]:
    """(path, JSON body) for the provider."""
    s = req.sampling
    body: dict = ({"model": remote_model, "stream": True, "stream_options": {"include_usage": True}} if req.stream
                  else {"model": remote_model})  # a client that takes the answer at once: one JSON body
    for name, value in (("max_tokens", s.max_tokens), ("temperature", s.temperature), ("top_p", s.top_p),
                        ("seed", s.seed)):
        if value is not None:
            body[name] = value
    body.update(s.knobs())  # OpenAI's penalties; the vLLM-style extras for a provider that takes them
    if s.stop:
        body["stop"] = list(s.stop)
    if req.prompt.messages is not None:
        body["messages"] = [message_json(m) for m in req.prompt.messages]
        if req.tools is not None:
            body.update(tools_json(req.tools))
        if s.logprobs is not None:
            body["logprobs"] = True
            body["top_logprobs"] = s.logprobs
        path = "/chat/completions"
    else:
        body["prompt"] = req.prompt.text or ""
        if s.logprobs is not None:
            body["logprobs"] = s.logprobs
        path = "/completions"
    if s.response_format is not None:
        fmt: dict = {"type": s.response_format.type}
        if s.response_format.schema is not None:
            fmt["json_schema"] = {"name": "response", "schema": orjson.loads(s.response_format.schema)}
        body["response_format"] = fmt
    return path, body


async def encoded(body: dict, req: CompletionRequest) -> bytes | list[bytes]:
    """The body as JSON: at once when its prompt is small, else as pieces encoded one at a time
    (``json_pieces``), so a 16 MiB prompt does not hold the event loop while it is encoded."""
    prompt = req.prompt
    chars = (len(prompt.text or "") if prompt.messages is None
             else sum(len(m.content) + sum(len(c.arguments) for c in m.tool_calls) for m in prompt.messages))
    return orjson.dumps(body) if chars <= json_pieces.PIECE_CHARS else await json_pieces.pieces(body)


def posted(data: bytes | list[bytes], headers: dict[str, str]) -> tuple[Any, dict[str, str]]:
    """What aiohttp posts and its headers: bytes as they are; pieces one write each under their
    total's Content-Length (aiohttp joins a bytes body with its headers: for 16 MiB that copy held
    the event loop 20-100 ms)."""
    if isinstance(data, bytes):
        return data, headers

    return _coalesced(data), {**headers, "content-length": str(sum(len(piece) for piece in data))}


WRITE_BYTES = 256 << 10


async def _coalesced(pieces: list[bytes]) -> AsyncIterator[bytes]:
    """The pieces in writes of about ``WRITE_BYTES``: 2,048 short messages are ~20,000 pieces,
    and a socket write each held the event loop 80 ms."""
    held: list[bytes] = []
    size = 0
    for piece in pieces:
        held.append(piece)
        size += len(piece)
        if size >= WRITE_BYTES:
            yield b"".join(held) if len(held) > 1 else held[0]
            held, size = [], 0
    if held:
        yield b"".join(held)


def message_json(m: Message) -> dict:
    out: dict = {"role": m.role, "content": m.content}
    if m.tool_calls:  # content stays a string ("" with calls only): strict servers refuse null
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def tools_json(t: Tools) -> dict:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` as OpenAI's API takes them."""
    out: dict = {}
    if t.functions:
        out["tools"] = []
        for f in t.functions:
            fn: dict = {"name": f.name}
            if f.description:
                fn["description"] = f.description
            if f.parameters:
                fn["parameters"] = orjson.loads(f.parameters)
            if f.strict is not None:
                fn["strict"] = f.strict
            out["tools"].append({"type": "function", "function": fn})
        out["tool_choice"] = ({"type": "function", "function": {"name": t.function}} if t.choice == "function"
                              else t.choice)
    if t.parallel is not None and t.functions:
        out["parallel_tool_calls"] = t.parallel
    return out


def _tool_calls(delta: dict) -> tuple[ToolCall, ...]:
    return tuple(ToolCall(index=c.get("index", i), id=c.get("id") or "",
                          name=(c.get("function") or {}).get("name") or "",
                          arguments=(c.get("function") or {}).get("arguments") or "")
                 for i, c in enumerate(delta.get("tool_calls") or ()))


FINISH = {"length": FinishReason.LENGTH, "tool_calls": FinishReason.TOOL_CALLS,
          "function_call": FinishReason.TOOL_CALLS}


def error_for_status(status: int, body: bytes) -> LlmeshError:
    try:
        err = orjson.loads(body).get("error") or {}
        message = err.get("message") if isinstance(err, dict) else str(err)
    except (orjson.JSONDecodeError, AttributeError):
        message = None
    message = f"The provider answered {status}: {message or 'no detail'}"
    if status == 429:
        return Overloaded(message, reason="provider_rate_limited")
    if status in (401, 403):
        return Unavailable(message, reason="provider_auth")
    if 400 <= status < 500:
        return InvalidArgument(message, reason="provider_rejected")
    return Unavailable(message, reason="provider_error")


def _logprobs(choice: dict) -> tuple[TokenLogprob, ...]:
    lp = choice.get("logprobs") or {}
    if "content" in lp:
        return tuple(TokenLogprob(t["token"], t["logprob"], tuple((a["token"], a["logprob"])
                                                                  for a in t.get("top_logprobs") or ()))
                     for t in lp["content"] or ())
    if "tokens" in lp:
        tops = lp.get("top_logprobs") or [{}] * len(lp["tokens"])
        return tuple(TokenLogprob(t, v, tuple((top or {}).items()))
                     for t, v, top in zip(lp["tokens"], lp["token_logprobs"], tops))
    return ()


class _Events:
    """Server-sent events from a byte stream: the ``data`` of each complete event,
    up to ``[DONE]`` (what follows it is read and ignored)."""

    def __init__(self) -> None:
        self._rest = b""
        self.done = False

    def feed(self, raw: bytes) -> list[bytes]:
        buf = self._rest + raw if self._rest else raw
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *events, self._rest = buf.split(b"\n\n")
        out = []
        for event in events:
            if self.done:
                break
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    self.done = True
                    break
                out.append(data)
        return out


class ProviderClients:
    """One aiohttp session, so one connection pool, for every provider: connections are
    kept and reused between calls. A call's ``timeout_s`` is its deadline, the whole call
    included (connecting, sending, every read). Cancelling a call (a client that went
    away) closes its connection, so the provider stops generating. Cookies are never kept
    (one tenant's would reach another's calls); an HTTP(S)_PROXY / NO_PROXY in the
    environment is read once, when the clients are made. ``secrets`` says which key files and
    variables may be read (default: none)."""

    def __init__(self, proxies: dict[str, str] | None = None, secrets: ProviderSecrets | None = None) -> None:
        self.secrets = secrets or ProviderSecrets()
        self._session: aiohttp.ClientSession | None = None
        self._proxies = urllib.request.getproxies_environment() if proxies is None else proxies
        self._targets: dict[tuple[str, str], tuple[URL, str | None]] = {}

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:  # made in the running loop: an aiohttp session belongs to one
            # Idle connections are dropped after 4 s, before the 5 s after which common servers (uvicorn,
            # Node) close them: a request is not sent on a connection the provider is closing.
            self._session = aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar(),
                                                  connector=aiohttp.TCPConnector(limit=100, keepalive_timeout=4.0))
        return self._session

    def _target(self, base_url: str, path: str) -> tuple[URL, str | None]:
        """The URL to call and the proxy to reach it through, worked out once per provider."""
        found = self._targets.get((base_url, path))
        if found is None:
            problem = url_problem(base_url)  # the schema refused it already; a config built around it is not called
            if problem:
                log.warning("provider URL refused; nothing sent", extra={"reason": problem})
                raise Unavailable("The provider's URL is refused by the gateway.", reason="provider_url_refused")
            url = URL(base_url.rstrip("/") + path)
            proxy = self._proxies.get(url.scheme) or self._proxies.get("all")
            # no_proxy, as urllib reads it; typeshed lacks this (undocumented) function of urllib.request
            bypass = urllib.request.proxy_bypass_environment  # type: ignore[attr-defined]
            if proxy and url.host and bypass(url.host, self._proxies):
                proxy = None
            found = self._targets[(base_url, path)] = (url, proxy or None)
        return found

    async def generate(self, provider: Provider, remote_model: str, req: CompletionRequest, timeout_s: float
                       ) -> Items:
        path, body = request_body(req, remote_model)
        url, proxy = self._target(provider.base_url, path)
        headers = {"content-type": "application/json"}
        key = self.secrets.api_key(provider)
        if key:
            headers["authorization"] = f"Bearer {key}"
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        data = await encoded(body, req)
        if not body.get("stream"):
            async for item in self._whole(url, proxy, data, headers, timeout):
                yield item
            return
        reason, usage, produced = FinishReason.STOP, None, 0
        try:
            sent, sent_headers = posted(data, headers)
            async with self._client().post(url, data=sent, headers=sent_headers, timeout=timeout,
                                           proxy=proxy) as resp:
                if resp.status != 200:
                    raise error_for_status(resp.status, await resp.read())
                events = _Events()
                # Every event one read brought becomes one Delta; reading to the end returns the connection to the pool.
                async for raw in resp.content.iter_any():
                    texts: list[str] = []
                    logprobs: list[TokenLogprob] = []
                    calls: list[ToolCall] = []
                    tokens = 0
                    for data in events.feed(raw):
                        chunk = orjson.loads(data)
                        if "error" in chunk:
                            raise Unavailable(f"The provider failed mid-answer: {chunk['error']}",
                                              reason="provider_error")
                        if chunk.get("usage"):
                            usage = Usage(chunk["usage"].get("prompt_tokens", 0),
                                          chunk["usage"].get("completion_tokens", 0))
                        for choice in chunk.get("choices") or ():
                            delta = choice.get("delta") or {}
                            text = delta.get("content") or choice.get("text") or ""
                            lps = _logprobs(choice) if choice.get("logprobs") else ()  # most events carry neither
                            pieces = _tool_calls(delta) if delta.get("tool_calls") else ()
                            if text or lps or pieces:
                                produced += 1
                                tokens += max(1, len(lps))
                                texts.append(text)
                                logprobs.extend(lps)
                                calls.extend(pieces)
                            if choice.get("finish_reason"):
                                reason = FINISH.get(choice["finish_reason"], FinishReason.STOP)
                    if tokens:
                        yield Delta(text="".join(texts), tokens=tokens, logprobs=tuple(logprobs),
                                    tool_calls=tuple(calls))
        except TimeoutError:
            raise DeadlineExceeded() from None
        except aiohttp.ClientError as exc:
            raise Unavailable(f"The provider cannot be reached: {type(exc).__name__}.",
                              reason="provider_error") from None
        except orjson.JSONDecodeError:
            raise Internal("The provider sent a malformed stream.", reason="provider_error") from None
        yield Finish(reason=reason, usage=usage or Usage(0, produced))

    async def _whole(self, url: URL, proxy: str | None, data: bytes | list[bytes], headers: dict,
                     timeout: aiohttp.ClientTimeout) -> Items:
        """A non-streamed call: the answer in one body, as one Delta and the Finish."""
        try:
            sent, sent_headers = posted(data, headers)
            async with self._client().post(url, data=sent, headers=sent_headers, timeout=timeout,
                                           proxy=proxy) as resp:
                content = await resp.read()
                if resp.status != 200:
                    raise error_for_status(resp.status, content)
            answer = orjson.loads(content)
            choice = (answer.get("choices") or [{}])[0]
            message = choice.get("message") or {}
            text = message.get("content") or choice.get("text") or ""
            logprobs = _logprobs(choice)
            calls = _tool_calls(message)
            u = answer.get("usage") or {}
        except TimeoutError:
            raise DeadlineExceeded() from None
        except aiohttp.ClientError as exc:
            raise Unavailable(f"The provider cannot be reached: {type(exc).__name__}.",
                              reason="provider_error") from None
        except (orjson.JSONDecodeError, AttributeError, IndexError, TypeError):
            raise Internal("The provider sent a malformed answer.", reason="provider_error") from None
        completion = u.get("completion_tokens", len(logprobs) or int(bool(text)))
        if text or logprobs or calls:
            yield Delta(text=text, tokens=completion, logprobs=logprobs, tool_calls=calls)
        reason = FINISH.get(choice.get("finish_reason") or "stop", FinishReason.STOP)
        yield Finish(reason=reason, usage=Usage(u.get("prompt_tokens", 0), completion))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
