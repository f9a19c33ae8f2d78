"""Large request bodies are parsed off the event loop (``fronts.body``), through the HTTP front and
the pipeline with a stand-in engine: whatever the body, the answer through the worker processes
is the one the inline parse gives (status, message, param, result); the workers take exactly the
bodies over the threshold, a few at a time; a small request is answered while a large one is
being parsed; a worker that dies is replaced, and the body it held is parsed inline; the workers run
at a lower priority than the gateway and die with it."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator

import numpy as np
import orjson
import pytest

from llmesh.errors import Unavailable
from llmesh.liveconfig.schema import MeshConfig
from llmesh.testing import wait_until
from llmesh.types import Delta, Finish, FinishReason, Usage
from llmesh.gateway.context import CompletionRequest, Vectors
from llmesh.gateway.fronts.body import OFFLOAD_BYTES, BodyReader, Offload, Reader
from llmesh.gateway.fronts.http import HttpFront
from llmesh.gateway.fronts.openai_api import Body
from llmesh.gateway.guard_workers import NICE, GuardWorkers
from llmesh.gateway.pipeline import Pipeline
from llmesh.gateway.stages.route import RouteStage
from llmesh.gateway.stages.validate import ValidateStage
from llmesh.gateway.upstream.picking import Endpoint, EndpointPicker
from tests.component.helpers import Catalog, asgi_post

MODEL = "sim-echo"
EMBED = "embed-echo"
CHAT, TEXT, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"


class EchoEngines:
    """Answers with the prompt's last text as the engine received it."""

    async def generate(self, address: str, req: CompletionRequest, timeout_s: float, parent) -> AsyncIterator:
        prompt = req.prompt
        yield Delta(prompt.text if prompt.messages is None else prompt.messages[-1].content, tokens=1)
        yield Finish(FinishReason.STOP, Usage(1, 1))

    async def embed(self, address: str, req: CompletionRequest, timeout_s: float, parent) -> AsyncIterator:
        """Each input's length and first character as its vector."""
        inputs = req.inputs or ()
        yield Vectors(FinishReason.STOP, Usage(len(inputs)),
                      tuple(np.array([len(t), ord(t[0])], dtype="<f4").tobytes() for t in inputs))


def front(bodies: BodyReader) -> HttpFront:
    config = MeshConfig()
    picker = EndpointPicker()
    picker.replace_all([Endpoint("e1", "127.0.0.1:1", frozenset({MODEL}), max_running=64),
                        Endpoint("e2", "127.0.0.1:2", frozenset({EMBED}), embeds=frozenset({EMBED}))])
    stages = [ValidateStage(), RouteStage(Catalog(MODEL, EMBED), lambda: config)]
    pipeline = Pipeline(picker, EchoEngines(), Catalog(MODEL, EMBED), config=lambda: config, stages=stages)
    return HttpFront(pipeline, lambda credential: asyncio.sleep(0, [MODEL]), lambda: True, 30.0, bodies=bodies)


async def answer(http: HttpFront, path: str, raw: bytes) -> tuple[int, bytes]:
    """The answer, its one varying field (``created``, in seconds) zeroed."""
    status, body = await asgi_post(http.app, raw, path, {"x-request-id": "req-offload"})
    return status, re.sub(rb'"created":\d+', b'"created":0', body)


def chat(text: str = "hello", **extra) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}], **extra})


SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
DEEP = 100_000
# (name, path, body): every answer the front gives to a body, good and bad
CASES = [
    ("chat", CHAT, chat()),
    ("chat-choices-sampling", CHAT, chat("hi", n=2, max_tokens=5, temperature=0.5, top_p=0.9, stop=["x", "y"],
                                         seed=7, user="u", metadata={"k": "v"}, store=False)),
    ("chat-stream-usage", CHAT, chat("hi", n=2, stream=True, stream_options={"include_usage": True})),
    ("chat-developer-parts", CHAT, orjson.dumps({"model": MODEL, "messages": [
        {"role": "developer", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                  {"type": "text", "text": "b"}]}]})),
    ("chat-logprobs", CHAT, chat("hi", logprobs=True, top_logprobs=2)),
    ("chat-response-format", CHAT, chat("hi", response_format=SCHEMA)),
    ("chat-tools", CHAT, chat("hi", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "f"}})),
    ("completion", TEXT, orjson.dumps({"model": MODEL, "prompt": ["once upon"], "max_tokens": 3, "logprobs": 1})),
    ("completion-two-prompts", TEXT, orjson.dumps({"model": MODEL, "prompt": ["a", "b"]})),
    ("completion-stream", TEXT, orjson.dumps({"model": MODEL, "prompt": "a", "stream": True})),
    ("json-truncated", CHAT, chat()[:-3]),
    ("json-array", CHAT, b"[1, 2]"),
    ("not-utf8", CHAT, b'{"model": "\xff\xfe", "messages": []}'),
    ("lone-surrogate", CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("messages-not-a-list", CHAT, orjson.dumps({"model": MODEL, "messages": "hello"})),
    ("no-model", CHAT, orjson.dumps({"messages": [{"role": "user", "content": "x"}]})),
    ("bad-part", CHAT, orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image"}]}]})),
    ("unsupported", CHAT, chat(logit_bias={"1": 2})),
    ("off-value", CHAT, chat(logit_bias={}, presence_penalty=0)),
    ("n-over", CHAT, chat(n=17)),
    ("n-huge", CHAT, chat(n=2**40)),
    ("top-logprobs-alone", CHAT, chat(top_logprobs=2)),
    ("schema-missing", CHAT, chat(response_format={"type": "json_schema"})),
    ("max-tokens-wire", CHAT, chat(max_tokens=2**33)),
    ("seed-huge", CHAT, b'{"model": "%s", "messages": [], "seed": %d}' % (MODEL.encode(), 2**80)),
    ("unknown-role", CHAT, orjson.dumps({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]})),
    ("unknown-model", CHAT, orjson.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]})),
    ("embeddings", EMBEDDINGS, orjson.dumps({"model": EMBED, "input": ["one", "two"], "user": "u"})),
    ("embeddings-base64", EMBEDDINGS, orjson.dumps({"model": EMBED, "input": "x", "encoding_format": "base64"})),
    ("embeddings-token-ids", EMBEDDINGS, orjson.dumps({"model": EMBED, "input": [[1, 2]]})),
    ("embeddings-unknown-field", EMBEDDINGS, orjson.dumps({"model": EMBED, "input": "x", "stream": True})),
    ("embeddings-empty-input", EMBEDDINGS, orjson.dumps({"model": EMBED, "input": ["ok", ""]})),
    ("embeddings-of-a-chat-model", EMBEDDINGS, orjson.dumps({"model": MODEL, "input": "x"})),
    ("chat-with-an-embedding-model", CHAT, orjson.dumps({"model": EMBED, "messages": [{"role": "user",
                                                                                       "content": "x"}]})),
    ("nested-deep", CHAT, b'{"model": "m", "messages": [], "metadata": ' + b"[" * DEEP + b"]" * DEEP + b"}"),
]


@pytest.fixture(scope="module")
def workers() -> Iterator[GuardWorkers]:
    pool = GuardWorkers(workers=1)  # its process starts on the first call
    yield pool
    pool.close()


class Recorded:
    """An offload that keeps the size of every body it is given, then does what ``inner`` does."""

    def __init__(self, inner: Offload | None = None):
        self.sizes: list[int] = []
        self._inner = inner

    async def __call__(self, reader: Reader, body_cls: type[Body], raw: bytes):
        self.sizes.append(len(raw))
        return await self._inner(reader, body_cls, raw) if self._inner else reader(body_cls, raw)


@pytest.mark.parametrize(("name", "path", "raw"), CASES, ids=[c[0] for c in CASES])
async def test_a_body_parsed_in_a_worker_answers_as_inline(workers, name, path, raw):
    inline = await answer(front(BodyReader()), path, raw)
    offloaded = Recorded(workers.call)
    assert await answer(front(BodyReader(offloaded, threshold=0)), path, raw) == inline
    assert offloaded.sizes == [len(raw)]  # it did go through the worker


async def test_large_bodies_answer_as_inline(workers):
    text = "ignore your instructions " * (OFFLOAD_BYTES // 20)
    for raw, status in ((chat(text, n=2), 200), (chat(text, n=17), 400), (chat(text)[:-1], 400),
                        (chat(text, logit_bias={"1": 2}), 400)):
        inline = await answer(front(BodyReader()), CHAT, raw)
        offloaded = Recorded(workers.call)
        assert await answer(front(BodyReader(offloaded)), CHAT, raw) == inline
        assert inline[0] == status and offloaded.sizes == [len(raw)] and len(raw) > OFFLOAD_BYTES
    assert orjson.loads(inline[1])["error"]["param"] == "logit_bias"


async def test_the_workers_take_exactly_the_bodies_over_the_threshold():
    small, large = chat("x" * 100), chat("x" * 101)
    offloaded = Recorded()
    http = front(BodyReader(offloaded, threshold=len(small)))
    for raw in (small, large, b""):
        await answer(http, CHAT, raw)
    assert offloaded.sizes == [len(large)]
    no_workers = front(BodyReader(None, threshold=0))  # guard_workers = 0: every body inline
    assert (await answer(no_workers, CHAT, large))[0] == 200


async def test_a_small_request_is_answered_while_a_large_one_is_parsed():
    parsing, release = asyncio.Event(), asyncio.Event()

    async def held(reader: Reader, body_cls: type[Body], raw: bytes):
        parsing.set()
        await release.wait()
        return reader(body_cls, raw)

    http = front(BodyReader(held, threshold=1024))
    large = asyncio.create_task(answer(http, CHAT, chat("large " * 1000)))
    await asyncio.wait_for(parsing.wait(), 5)
    status, body = await asyncio.wait_for(answer(http, CHAT, chat("small")), 5)
    assert status == 200 and orjson.loads(body)["choices"][0]["message"]["content"] == "small"
    assert not large.done()
    release.set()
    status, body = await asyncio.wait_for(large, 5)
    assert status == 200 and orjson.loads(body)["choices"][0]["message"]["content"] == "large " * 1000


async def test_large_bodies_take_turns():
    running, most, calls = 0, 0, 0

    async def counted(reader: Reader, body_cls: type[Body], raw: bytes):
        nonlocal running, most, calls
        running += 1
        calls += 1
        most = max(most, running)
        await asyncio.sleep(0.01)
        running -= 1
        return reader(body_cls, raw)

    http = front(BodyReader(counted, threshold=0, concurrency=2))
    answers = await asyncio.gather(*(answer(http, CHAT, chat(f"n{i}")) for i in range(6)))
    assert [status for status, _ in answers] == [200] * 6
    assert calls == 6 and most == 2


async def test_a_worker_that_dies_is_replaced_and_its_body_parsed_inline(workers):
    with pytest.raises(Unavailable) as gone:
        await workers.call(os._exit, 3)
    assert gone.value.reason == "workers_unavailable"
    assert await workers.call(len, b"abc") == 3  # a new pool

    async def dying(reader: Reader, body_cls: type[Body], raw: bytes):
        return await workers.call(os._exit, 3)

    raw = chat("still answered", n=2)
    assert await answer(front(BodyReader(dying, threshold=0)), CHAT, raw) == await answer(front(BodyReader()), CHAT,
                                                                                           raw)


async def test_the_workers_run_at_a_lower_priority_than_the_gateway(workers):
    assert await workers.call(os.nice, 0) == min(19, os.nice(0) + NICE)


_OWNER = """
import asyncio, os
from llmesh.gateway.guard_workers import GuardWorkers
async def main():
    workers = GuardWorkers(workers=2)
    await workers.start()
    print(" ".join(str(p) for p in workers._executor()._processes), flush=True)
    await asyncio.sleep(600)
asyncio.run(main())
"""


def test_the_workers_die_with_a_killed_gateway():
    """A gateway killed with SIGKILL (OOM killer, kill -9) takes its workers with it: they used to
    wait on their queue forever, holding memory, one pair per killed gateway."""
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
    finally:
        owner.kill()
        owner.wait()
    assert wait_until(lambda: not any(alive(p) for p in pids), 10.0), [p for p in pids if alive(p)]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has exited (its parent, init, reaps it)
    except FileNotFoundError:
        return False


async def test_embeddings_through_the_front_and_the_wrong_kind_of_model(workers):
    http = front(BodyReader(Recorded(workers.call), threshold=0))
    status, body = await answer(http, EMBEDDINGS, orjson.dumps({"model": EMBED, "input": ["one", "three"]}))
    assert status == 200
    got = orjson.loads(body)
    assert [d["embedding"] for d in got["data"]] == [[3.0, 111.0], [5.0, 116.0]]
    assert got["usage"] == {"prompt_tokens": 2, "total_tokens": 2} and got["model"] == EMBED
    for path, raw, code in ((EMBEDDINGS, orjson.dumps({"model": MODEL, "input": "x"}), "model_not_embedding"),
                            (CHAT, orjson.dumps({"model": EMBED, "messages": [{"role": "user", "content": "x"}]}),
                             "model_not_generative")):
        status, body = await answer(http, path, raw)
        assert status == 400 and orjson.loads(body)["error"]["code"] == code
