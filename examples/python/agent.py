"""An agent loop with the official openai client on llmesh: the model calls a tool, gets its result,
and answers (SmolLM2 on the llama.cpp engine of `make run`, or any model that calls tools).

    .venv/bin/python examples/python/agent.py "What is the weather in Paris?"
    OPENAI_API_KEY=llm_... .venv/bin/python examples/python/agent.py --base-url http://gw:8080/v1 "..."
"""

from __future__ import annotations

import argparse
import json
import os

from openai import OpenAI

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 40}}}}}


def get_weather(city: str) -> str:
    """The tool itself (a real agent would call a weather service here)."""
    return json.dumps({"city": city, "weather": "sunny", "temperature_c": 21})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question")
    parser.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-turns", type=int, default=4)
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused"))
    messages: list = [{"role": "user", "content": args.question}]
    choice = "required"  # the first turn must call the tool; later ones may answer
    for turn in range(args.max_turns):
        last = turn == args.max_turns - 1
        resp = client.chat.completions.create(model=args.model, messages=messages, tools=[WEATHER],
                                              tool_choice="none" if last else choice, parallel_tool_calls=False,
                                              temperature=0, max_tokens=80)
        message = resp.choices[0].message
        if not message.tool_calls:
            print(message.content)
            return 0
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            result = get_weather(**json.loads(call.function.arguments))
            print(f"[{call.function.name}({call.function.arguments}) -> {result}]")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        choice = "auto"
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
