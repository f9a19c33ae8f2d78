"""What request validation costs per request, in process: the protos' buf.validate rules
checked by protovalidate, as the gateway does for every request (the HTTP front's domain
request in its protobuf form; a gRPC ChatRequest as it arrives), for a short chat and a
long conversation.

    python -m bench.validation [--rounds 5] [--seconds 0.4]

Each figure is the median of ``rounds`` rounds, each repeating the check for about
``seconds``; costs are CPU time of the calling thread, so a busy machine does not inflate
them. Prints one JSON document."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from llmesh.convert import request_to_pb
from llmesh.types import Message, Prompt, ResponseFormat, Sampling
from llmesh.validation import check_message, check_request


def per_call_us(fn: Callable[[], None], rounds: int, seconds: float) -> float:
    results = []
    for _ in range(rounds):
        n, start = 0, time.thread_time()
        while (used := time.thread_time() - start) < seconds:
            for _ in range(100):
                fn()
            n += 100
        results.append(used / n * 1e6)
    return round(statistics.median(results), 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=0.4)
    args = ap.parse_args()
    sampling = Sampling(max_tokens=64, temperature=0.7, top_p=0.9, stop=("\n\n",), seed=1,
                        response_format=ResponseFormat("json_object"))
    short = Prompt(messages=(Message("system", "You are terse."), Message("user", "What color is the sky?")))
    long = Prompt(messages=tuple(Message("user" if i % 2 == 0 else "assistant", "word " * 200) for i in range(64)))
    out = {"bench": "validation", "unit": "us CPU per request"}
    for name, prompt in (("short_chat", short), ("64_message_chat", long)):
        pb = request_to_pb("smollm2-135m-instruct", prompt, sampling, user="u1")
        out[name] = {
            "domain_request": per_call_us(lambda: check_request("smollm2-135m-instruct", prompt, sampling, user="u1",
                                                                tools_allowed=True), args.rounds, args.seconds),
            "grpc_request": per_call_us(lambda: check_message(pb), args.rounds, args.seconds),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
