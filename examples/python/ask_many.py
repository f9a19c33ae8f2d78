"""Ask several questions at once with the asyncio client, then list the models.

    .venv/bin/python examples/python/ask_many.py "What is 2+2?" "Name a colour."
"""

from __future__ import annotations

import argparse
import asyncio
import os

from llmesh.client import AsyncClient, GatewayError


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("questions", nargs="+")
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args()

    async with AsyncClient(args.address, credential=os.environ.get("LLMESH_API_KEY"), timeout_s=60) as client:
        answers = await asyncio.gather(
            *(client.chat(model=args.model, messages=[{"role": "user", "content": q}], max_tokens=30,
                          temperature=0.0) for q in args.questions),
            return_exceptions=True)
        for question, answer in zip(args.questions, answers):
            if isinstance(answer, GatewayError):
                print(f"{question} -> {answer.code.name}: {answer.message}")
            elif isinstance(answer, BaseException):
                raise answer
            else:
                print(f"{question} -> {answer.text.strip()!r} ({answer.usage.completion_tokens} tokens)")
        print("models:", ", ".join(await client.list_models()))
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
