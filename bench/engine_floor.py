"""What an engine's answer costs below the engine wrapper, for bench.dataplane's
sim section, so the wrapper's own CPU can be told apart from what it stands on:

- ``sim_alone``: the CPU the sim backend alone spends producing the same answers
  (tokenize, then its decode steps, taken as the engine takes them), driven in this
  process on its own uvloop thread: no gRPC, no engine core, no admission, no metrics;
- ``bare_server``: a bare grpc.aio server-streaming servicer (uvloop, the engine's
  server options, no interceptor, no work) that answers a Generate with as many
  messages as the request's ``max_tokens``: grpc.aio's own floor per call and per
  message, measured as the engine's process CPU is.

    python -m bench.engine_floor PORT   # the bare server alone (bench.dataplane starts it)
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import aclosing

from llmesh.testing import free_ports, port_open, terminate, wait_until
from llmesh.types import Message, Prompt

# A message of the sim's size: a word and its space.
WORD = " alpha"


def sim_alone(model: str, prompt: str, tokens: int, temperature: float, requests: int, warmup: int = 50) -> dict:
    """CPU ms per answer of the sim backend alone, built as the engine builds it at 0 ms a
    step with ``tokens`` output tokens, one answer at a time; on a thread of its own
    (``time.thread_time`` counts that thread only) with its own uvloop, as the engine runs."""
    result: dict = {}

    def run() -> None:
        import uvloop
        result.update(uvloop.run(_sim_alone(model, prompt, tokens, temperature, requests, warmup)))

    thread = threading.Thread(target=run, name="sim-alone")
    thread.start()
    thread.join()
    return result


async def _sim_alone(model: str, prompt: str, tokens: int, temperature: float, requests: int, warmup: int) -> dict:
    from llmesh.engine.app import build_backend
    from llmesh.engine.backends.base import DecodeParams, steps_of
    from llmesh.engine.config import EngineSettings

    settings = EngineSettings(backend="sim", model=model, sim_decode_ms_per_token=0.0, sim_output_tokens=tokens,
                              scheduler_address=None)
    backend = build_backend(settings)
    question = Prompt(messages=(Message(role="user", content=prompt),))
    steps = 0

    async def one() -> None:
        nonlocal steps
        ids = backend.tokenize(question)
        params = DecodeParams(max_new_tokens=tokens, temperature=temperature, top_p=settings.default_top_p, seed=None)
        async with aclosing(steps_of(backend, ids, params)) as answer:
            async for _ in answer:
                steps += 1

    try:
        for _ in range(warmup):
            await one()
        steps = 0
        started = time.thread_time()
        for _ in range(requests):
            await one()
        cpu = time.thread_time() - started
    finally:
        await backend.close()
    return {"requests": requests, "cpu_ms_per_request": round(cpu * 1000 / requests, 3),
            "steps_per_answer_mean": round(steps / requests, 2)}


async def grpc_floor(messages: int, requests: int) -> dict:
    """The bare server's process CPU per call, one connection: answers of one message and of
    ``messages`` messages (the engine's mean), and what each added message costs."""
    from llmesh.rpc.channels import mesh_channel
    from llmesh.v1 import engine_pb2_grpc
    from bench import gateway as gw_bench
    from bench.common import cpu_seconds, drive

    messages = max(messages, 2)
    out: dict = {"messages": messages}
    with bare_server() as (address, pid):
        async with mesh_channel(address, "engine") as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            seen: list[int] = []

            async def call(n: int):
                s = await gw_bench.engine_call(stub, n)
                seen.append(s.messages)
                return s

            for key, n in (("cpu_ms_one_message", 1), ("cpu_ms_per_request", messages)):
                await drive(lambda i: call(n), 1, min(20, requests))  # warm
                seen.clear()
                before = cpu_seconds(pid)
                r = await drive(lambda i: call(n), 1, requests)
                out[key] = round((cpu_seconds(pid) - before) * 1000 / max(r["requests"], 1), 3)
            out["messages_seen_mean"] = round(sum(seen) / max(len(seen), 1), 2)
    out["cpu_ms_per_added_message"] = round((out["cpu_ms_per_request"] - out["cpu_ms_one_message"])
                                            / (messages - 1), 4)
    return out


@contextlib.contextmanager
def bare_server() -> Iterator[tuple[str, int]]:
    """The bare server in a child process: (address, pid)."""
    port = free_ports(1)[0]
    proc = subprocess.Popen([sys.executable, "-m", "bench.engine_floor", str(port)], stdin=subprocess.DEVNULL)
    try:
        if not wait_until(lambda: port_open(port) or proc.poll() is not None, 30) or proc.poll() is not None:
            raise RuntimeError("the bare grpc.aio server did not start")
        yield f"127.0.0.1:{port}", proc.pid
    finally:
        terminate(proc, signal.SIGTERM, 10.0)


async def _serve(port: int) -> None:
    import grpc

    from llmesh.rpc.server import SERVER_OPTIONS
    from llmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc

    class Bare(engine_pb2_grpc.EngineServicer):
        async def Generate(self, request, context):  # noqa: N802 - the proto's method
            n = max(request.sampling.max_tokens, 1)
            for _ in range(n - 1):
                yield engine_pb2.GenerateResponse(text=WORD, token_count=1)
            yield engine_pb2.GenerateResponse(text=WORD, token_count=1, finish_reason=common_pb2.FINISH_REASON_LENGTH)

    server = grpc.aio.server(options=SERVER_OPTIONS)
    engine_pb2_grpc.add_EngineServicer_to_server(Bare(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    import uvloop
    uvloop.run(_serve(int(sys.argv[1])))
