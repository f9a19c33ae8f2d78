"""``python -m bench``: the benchmarks, listed once (``make bench``, ``llmesh bench`` and the
docs go by this list). Each runs as ``python -m bench.NAME`` and prints one JSON document on
stdout; progress goes to stderr.

    python -m bench                 this help and the list
    python -m bench all             every benchmark of the full run, in order (``make bench``)
    python -m bench NAME [ARGS]     one benchmark, ARGS passed on (``NAME --help`` for its own)
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Bench:
    name: str       # the module bench.NAME
    summary: str
    in_all: bool = True  # part of ``python -m bench all``; False: needs something the full run has not


BENCHES = (
    Bench("gateway", "the gateway's overhead over a sim engine, next to a bare gRPC relay"),
    Bench("governance", "what auth, limits, guards and audit cost a request"),
    Bench("llamacpp", "single-stream tokens/s through the mesh next to raw llama_cpp.Llama"),
    Bench("engine", "the llama.cpp engine under concurrent streams next to llama-cpp-python's server"),
    Bench("engine_newcomer", "a request arriving while others decode on the llama.cpp engine: its TTFT, their gaps"),
    Bench("guards", "PII masking, the injection screen and audit appends, in process"),
    Bench("prompt_tokens", "tokenizing long prompts in the gateway: its event loop's stall, inline vs on a thread"),
    Bench("cache", "response cache: hit latency, lookup at scale and with the verifier, quality (dev/held-out), "
                   "an FAQ stream through the gateway"),
    Bench("routing", "routing policies compared on one fleet of sim engines"),
    Bench("routing_gateway", "multi-turn follow-ups' TTFT through the gateway at 80 % load next to a lone "
                             "cached-prefix turn, prefix_aware and round_robin, 4 sim engines"),
    Bench("fairness", "flow control under 1.5x and 3x overload: tenants' token shares, TTFT, refusals"),
    Bench("provider", "the gateway in front of an instant OpenAI-compatible server"),
    Bench("shadow", "shadow traffic's cost on the hot path"),
    Bench("batch", "interactive streams' TTFT p99 with and without a 500-request batch (Batch API), sim engine"),
    Bench("validation", "request validation (protovalidate) per request, in process"),
    Bench("hostile", "adversarial prompts up to the body limit: stalls, memory, victims' p99, no 5xx"),
    Bench("model_fetch", "an engine fetching a deployed model from the model manager over gRPC, next to a local copy"),
    Bench("dataplane", "the data plane's cost as ratios against peers and floors (make bench-tools)"),
    Bench("gateway_profile", "py-spy profile of the gateway in front of an instant server", in_all=False),
    Bench("vllm", "llmesh (gateway + vllm engine) next to vLLM's own OpenAI server (.venv-vllm, make bench-vllm)",
          in_all=False),
    Bench("dynamo_replay", "Dynamo's offline router replay, kv_router vs round_robin (.venv-dynamo, make bench-tools)",
          in_all=False),
    Bench("gpu_smoke", "the vllm backend on a real NVIDIA GPU (make gpu-smoke MODEL=...)", in_all=False),
)


def usage() -> str:
    width = max(len(b.name) for b in BENCHES)
    lines = [f"  {b.name:<{width}}  {b.summary}{'' if b.in_all else ' [not in all]'}" for b in BENCHES]
    return __doc__.rstrip() + "\n\nBenchmarks:\n" + "\n".join(lines)


def run(name: str, args: list[str]) -> int:
    return subprocess.run([sys.executable, "-m", f"bench.{name}", *args]).returncode


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print(usage())
        return 0
    name, args = argv[0], argv[1:]
    if name == "all":
        for bench in (b for b in BENCHES if b.in_all):
            print(f"# bench.{bench.name}", file=sys.stderr, flush=True)
            if code := run(bench.name, args):
                return code
        return 0
    if name not in {b.name for b in BENCHES}:
        print(f"python -m bench: no benchmark {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    return run(name, args)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
