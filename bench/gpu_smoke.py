"""``make gpu-smoke``: the vllm backend on a real NVIDIA GPU, in one short script.

Starts an engine with ``LLMESH_ENGINE_BACKEND=vllm`` on a small local Hugging Face
model, reporting to a scheduler run in this process, runs the core end-to-end cases
over gRPC (stream, max_tokens, stop, context overflow -> INVALID_ARGUMENT, unknown
model -> NOT_FOUND, cancel then serve again, concurrent streams), checks that vLLM's
KV events reach the scheduler and that a request's tokens, hashed our side with the
engine's reported scheme, find the blocks vLLM cached (a prefix-aware pick), loads a
LoRA adapter written here (rank 8; one of rank 32 is INVALID_ARGUMENT), swaps the model
(two do not fit: unload first), then sends the same requests to vLLM's own OpenAI
server on the same GPU and prints both throughputs as JSON.

    make gpu-smoke MODEL=/path/to/Qwen2.5-0.5B-Instruct    (needs: pip install -e '.[vllm]')

Exit 0: every case passed; 1: a case failed (named on stderr), or the installed vLLM is not the
version pyproject.toml pins; 2: no GPU or vLLM."""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry, Counter

from llmesh.rpc.channels import mesh_channel
from llmesh.rpc.server import GrpcServer, ServiceBinding
from llmesh.testing import Service, free_ports, port_open, wait_until
from llmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, scheduler_pb2_grpc
from llmesh.scheduler.kvindex import KvIndex
from llmesh.scheduler.servicer import SchedulerServicer
from llmesh.scheduler.table import EndpointTable
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
    async with mesh_channel(address, "engine") as ch:
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


async def kv_lora_swap(address: str, model_dir: str, kv: KvIndex, tmp: Path) -> list[str]:
    """KV events reach the scheduler and match our hashes; a LoRA load; a model swap."""
    from transformers import AutoTokenizer

    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        note(("ok   " if ok else "FAIL ") + what)
        if not ok:
            failures.append(what)

    shared = [{"role": "system", "content": "You answer questions about the solar system. " * 20}]
    tok = AutoTokenizer.from_pretrained(model_dir)
    async with mesh_channel(address, "engine") as ch:
        stub = engine_pb2_grpc.EngineStub(ch)
        await _collect(stub, gen(shared + [{"role": "user", "content": "Name a moon."}], max_tokens=4))
        ask = shared + [{"role": "user", "content": "Name a planet."}]
        tokens = tok.apply_chat_template(ask, tokenize=True, add_generation_prompt=True, return_dict=False)
        eid = "gpu-smoke"
        for _ in range(100):  # the scheduler runs on this event loop: wait without blocking it
            if ok := kv.count(eid) > 0 and kv.scheme(eid) is not None:
                break
            await asyncio.sleep(0.1)
        check(ok and kv.scheme(eid).kind == "vllm", f"vLLM's KV events reach the scheduler ({kv.count(eid)} blocks)")
        hit = 0
        if ok:  # leading tokens whose blocks vLLM holds, hashed as a gateway's picker does
            held, scheme = kv.held(eid), kv.scheme(eid)
            hashes = scheme.block_hashes(tokens)
            hit = next((i for i, h in enumerate(hashes) if h not in held), len(hashes)) * scheme.block_size
        check(hit >= 128, f"a request sharing a prefix finds vLLM's cached blocks by our hashes ({hit} tokens)")

        for rank, code in ((8, None), (32, grpc.StatusCode.INVALID_ARGUMENT)):
            path = write_lora(model_dir, tmp / f"lora-r{rank}", rank)
            try:
                await stub.LoadModel(engine_pb2.LoadModelRequest(name=f"lora-r{rank}", adapter_path=str(path)),
                                     timeout=300)
                text = await _collect(stub, gen([{"role": "user", "content": "Hi"}], model="lora-r8", max_tokens=4))
                check(code is None and bool(text), f"LoRA rank {rank} loads and serves")
            except grpc.aio.AioRpcError as exc:
                check(exc.code() == code, f"LoRA rank {rank} -> {code}: {exc.details()}")

        swapped = await stub.LoadModel(engine_pb2.LoadModelRequest(name=NAME + "-2", warmup=True), timeout=600)
        check(swapped.swap == "unload_first" and swapped.replaced == NAME, f"model swap ({swapped.swap})")
        text = await _collect(stub, gen([{"role": "user", "content": "Hi"}], model=NAME + "-2", max_tokens=4))
        check(bool(text), "the swapped-in model serves")
    return failures


def write_lora(model_dir: str, path: Path, rank: int) -> Path:
    """A PEFT LoRA adapter on q_proj and v_proj with zero B (it leaves the model as it was)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_out = cfg.get("num_key_value_heads", heads) * cfg.get("head_dim", hidden // heads)
    tensors = {}
    for i in range(cfg["num_hidden_layers"]):
        for proj, out in (("q_proj", cfg.get("head_dim", hidden // heads) * heads), ("v_proj", kv_out)):
            key = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, hidden, dtype=torch.float16) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.zeros(out, rank, dtype=torch.float16)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"], "bias": "none",
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": model_dir}))
    return path


async def smoke(args, engine_port: int, scheduler_port: int, tmp: Path) -> dict:
    kv = KvIndex()
    scheduler = GrpcServer(f"127.0.0.1:{scheduler_port}", [ServiceBinding(
        "llmesh.v1.Scheduler", SchedulerServicer(EndpointTable(), Counter("reports", "", registry=CollectorRegistry()),
                                                 kv), scheduler_pb2_grpc.add_SchedulerServicer_to_server)])
    await scheduler.start()
    try:
        if not await asyncio.to_thread(wait_until, lambda: port_open(engine_port), 600):
            return {"cases_failed": ["the vllm engine did not start"]}
        address = f"127.0.0.1:{engine_port}"
        failures = await cases(address, args.max_model_len)
        result = {"llmesh_engine": await throughput(Engine(address, NAME), args.concurrency, args.requests,
                                                    args.max_tokens)}
        failures += await kv_lora_swap(address, args.model, kv, tmp)
        return {**result, "cases_failed": failures}
    finally:
        await scheduler.stop(0)


async def _collect(stub, req) -> str:
    return "".join([r.text async for r in stub.Generate(req, timeout=300)])


async def throughput(target, concurrency: int, requests: int, max_tokens: int) -> dict:
    prompts = questions(requests)

    async def one(i: int):
        return await target.one([{"role": "user", "content": prompts[i]}], max_tokens)

    await one(0)  # warm
    return await drive(one, concurrency, requests)


def vllm_version_problem() -> str | None:
    """The installed vLLM against the pin of the installed llmesh's `vllm` extra (pyproject.toml)."""
    pins = [r.split(";")[0].strip().removeprefix("vllm==") for r in importlib.metadata.requires("llmesh") or []
            if r.startswith("vllm==")]
    have = importlib.metadata.version("vllm").split("+")[0]
    if pins != [have]:
        return f"vLLM {have} is installed; llmesh pins vllm=={pins[0] if pins else '(none)'}: pip install -e '.[vllm]'"
    return None


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
    problem = vllm_version_problem()
    if problem:
        note(problem)
        sys.exit(1)
    engine_port, scheduler_port, server_port = free_ports(3)
    result: dict = {"model": args.model, "vllm": importlib.metadata.version("vllm")}
    with tempfile.TemporaryDirectory() as tmp:
        svc = Service("llmesh.engine", {
            "LLMESH_ENGINE_BACKEND": "vllm", "LLMESH_ENGINE_MODEL": NAME, "LLMESH_ENGINE_VLLM_MODEL_PATH": args.model,
            "LLMESH_ENGINE_VLLM_MAX_MODEL_LEN": str(args.max_model_len),
            "LLMESH_ENGINE_VLLM_GPU_MEMORY_UTILIZATION": str(args.gpu_memory_utilization),
            "LLMESH_ENGINE_PORT": str(engine_port), "LLMESH_ENGINE_ENDPOINT_ID": "gpu-smoke",
            "LLMESH_ENGINE_SCHEDULER_ADDRESS": f"127.0.0.1:{scheduler_port}", "LLMESH_ENGINE_MAX_RUNNING": "256",
            "LLMESH_ENGINE_MAX_WAITING": "1024"}, Path(tmp) / "engine.log")
        svc.start()
        try:
            result.update(asyncio.run(smoke(args, engine_port, scheduler_port, Path(tmp))))
            if result["cases_failed"]:
                note(svc.log_path.read_text()[-4000:])
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
