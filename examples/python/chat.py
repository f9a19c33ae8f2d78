"""Stream one answer from the llmesh gateway with llmesh.client.

    .venv/bin/python examples/python/chat.py "Why is the sea salty?"
    LLMESH_API_KEY=llm_... .venv/bin/python examples/python/chat.py --address gw:50051 --tls "Hi"
"""

from __future__ import annotations

import argparse
import os
import sys

from llmesh.client import Client, GatewayError


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt")
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-tokens", type=int, default=60)
    parser.add_argument("--timeout", type=float, default=60.0, help="deadline of the whole call, seconds")
    parser.add_argument("--tls", action="store_true", help="TLS with the system's root certificates")
    args = parser.parse_args()

    with Client(args.address, credential=os.environ.get("LLMESH_API_KEY"), tls=args.tls,
                timeout_s=args.timeout) as client:
        try:
            with client.stream(model=args.model, messages=[{"role": "user", "content": args.prompt}],
                               max_tokens=args.max_tokens) as answer:
                for chunk in answer:
                    print(chunk.text, end="", flush=True)
                    if chunk.finish_reason:
                        print(f"\n[{chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} "
                              f"completion tokens; request {answer.trailing_metadata().get('x-request-id')}]",
                              file=sys.stderr)
        except GatewayError as err:  # typed: NotFoundError, UnauthenticatedError, DeadlineExceededError, ...
            print(f"\nerror: {err.code.name}: {err.message}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
