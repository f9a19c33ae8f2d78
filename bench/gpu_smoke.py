"""``make gpu-smoke``: the vllm backend on a real NVIDIA GPU, in one short script.

Starts an engine with ``LLMESH_ENGINE_BACKEND=vllm`` on a small local Hugging Face
model, runs the core end-to-end cases over gRPC (stream, max_tokens, stop, context
overflow -> INVALID_ARGUMENT, unknown model -> NOT_FOUND, cancel then serve again,
concurrent streams, KV-cache use reported), then sends the same requests to vLLM's
own OpenAI server on the same GPU and prints both throughputs as JSON.

    make gpu-smoke MODEL=/path/to/Qwen2.5-0.5B-Instruct    (needs: pip install -e '.[vllm]')

Exit 0: every case passed; 1: a case failed (named on stderr); 2: no GPU or vLLM."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

import grpc

from llmesh.rpc.channels import insecure_channel
from llmesh.testing import Service, free_ports, port_open, wait_until
from llmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from bench.common import drive, note
from bench.engine import Engine, OpenAIServer, questions

NAME = "smoke-model"


def gen(messages: list[dict], model: str = NAME, **sampling) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        model=model, chat=engine_pb2.ChatInput(messages=[common_pb2.ChatMessage(**m) for m in messages]),
        sampling=common_pb2.SamplingParams(**sampling))


async def cases(address: str, max_model_len: int) -> list[str]:
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        note(("ok   " if ok else "FAIL ") + what)
        if not ok:
            failures.append(what)

    user = [{"role": "user", "content": "Name three planets."}]
    async with insecure_channel(address) as ch:
        stub = engine_pb2_grpc.EngineStub(ch)
        out = [r async for r in stub.Generate(gen(user, max_tokens=16, temperature=0.0), timeout=120)]
        text = "".join(r.text for r in out)
        check(bool(text.strip()) and out[-1].usage.completion_tokens <= 16, "streams text within max_tokens")
        out = [r async for r in stub.Generate(gen(user, max_tokens=64, temperature=0.0, stop=["\n"]), timeout=120)]
        check("\n" not in "".join(r.text for r in out), "stop string ends the answer")
        for what, req, code in (
                ("prompt over the context -> INVALID_ARGUMENT",
                 gen([{"role": "user", "content": "word " * (max_model_len + 10)}], max_tokens=4),
                 grpc.StatusCode.INVALID_ARGUMENT),
                ("unknown model -> NOT_FOUND", gen(user, model="no-such-model", max_tokens=4),
                 grpc.StatusCode.NOT_FOUND)):
            try:
                [r async for r in stub.Generate(req, timeout=60)]
                check(False, what)
            except grpc.aio.AioRpcError as exc:
                check(exc.code() == code, what)
        call = stub.Generate(gen([{"role": "user", "content": "Write a long essay."}], max_tokens=2000), timeout=120)
        async for _ in call:
            break
        call.cancel()
        out = [r async for r in stub.Generate(gen(user, max_tokens=4), timeout=120)]
        check(out[-1].finish_reason != 0, "serves again after a cancelled stream")
        results = await asyncio.gather(*(
            _collect(stub, gen([{"role": "user", "content": q}], max_tokens=32)) for q in questions(32)))
        check(all(r for r in results), "32 concurrent streams complete")
        status = await stub.GetStatus(engine_pb2.GetStatusRequest(), timeout=10)
        check(status.backend == "vllm" and NAME in status.models, "GetStatus names the vllm backend and model")
    return failures


async def _collect(stub, req) -> str:
    return "".join([r.text async for r in stub.Generate(req, timeout=300)])


async def throughput(target, concurrency: int, requests: int, max_tokens: int) -> dict:
    prompts = questions(requests)

    async def one(i: int):
        return await target.one([{"role": "user", "content": prompts[i]}], max_tokens)

    await one(0)  # warm
    return await drive(one, concurrency, requests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a local HF model directory (these machines are offline)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    args = parser.parse_args()
    if shutil.which("nvidia-smi") is None or importlib.util.find_spec("vllm") is None:
        note("gpu-smoke needs an NVIDIA GPU and vLLM: pip install -e '.[vllm]'")
        sys.exit(2)
    engine_port, kv_port, server_port = free_ports(3)
    result: dict = {"model": args.model}
    with tempfile.TemporaryDirectory() as tmp:
        svc = Service("llmesh.engine", {
            "LLMESH_ENGINE_BACKEND": "vllm", "LLMESH_ENGINE_MODEL": NAME, "LLMESH_ENGINE_VLLM_MODEL_PATH": args.model,
            "LLMESH_ENGINE_VLLM_MAX_MODEL_LEN": str(args.max_model_len),
            "LLMESH_ENGINE_VLLM_GPU_MEMORY_UTILIZATION": str(args.gpu_memory_utilization),
            "LLMESH_ENGINE_VLLM_KV_EVENTS_PORT": str(kv_port), "LLMESH_ENGINE_PORT": str(engine_port),
            "LLMESH_ENGINE_SCHEDULER_ADDRESS": "", "LLMESH_ENGINE_MAX_RUNNING": "256",
            "LLMESH_ENGINE_MAX_WAITING": "1024"}, Path(tmp) / "engine.log")
        svc.start()
        try:
            if not wait_until(lambda: port_open(engine_port), 600):
                sys.exit("the vllm engine did not start:\n" + svc.log_path.read_text()[-4000:])
            address = f"127.0.0.1:{engine_port}"
            failures = asyncio.run(cases(address, args.max_model_len))
            result["cases_failed"] = failures
            result["llmesh_engine"] = asyncio.run(throughput(Engine(address, NAME), args.concurrency,
                                                             args.requests, args.max_tokens))
        finally:
            svc.stop(timeout_s=60)
        server = Service("vllm.entrypoints.openai.api_server", {}, Path(tmp) / "vllm.log", args=[
            "--model", args.model, "--served-model-name", NAME, "--port", str(server_port), "--host", "127.0.0.1",
            "--max-model-len", str(args.max_model_len), "--gpu-memory-utilization", str(args.gpu_memory_utilization)])
        server.start()
        try:
            if wait_until(lambda: port_open(server_port), 600):
                client = OpenAIServer(f"http://127.0.0.1:{server_port}", name="vllm_openai_server", model=NAME)
                result["vllm_openai_server"] = asyncio.run(throughput(client, args.concurrency, args.requests,
                                                                     args.max_tokens))
                result["aggregate_ratio"] = round(result["llmesh_engine"]["tokens_per_s"]
                                                  / result["vllm_openai_server"]["tokens_per_s"], 3)
            else:
                result["vllm_openai_server"] = "did not start: " + server.log_path.read_text()[-1000:]
        finally:
            server.stop(timeout_s=60)
    print(json.dumps(result, indent=2))
    sys.exit(1 if result["cases_failed"] else 0)


if __name__ == "__main__":
    main()
