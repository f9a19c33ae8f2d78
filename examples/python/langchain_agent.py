"""A LangChain agent on llmesh: langchain-openai's ChatOpenAI pointed at the gateway, a tool the
model must call first, the tool's result, then the model's answer (SmolLM2 on the llama.cpp engine
of `make run`, or any model that calls tools). Also structured output by function calling.

    .venv/bin/python examples/python/langchain_agent.py "What is the weather in Paris?"
    OPENAI_API_KEY=llm_... .venv/bin/python examples/python/langchain_agent.py --base-url http://gw:8080/v1 "..."
"""

from __future__ import annotations

import argparse
import os
from typing import Literal

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"Sunny, 21 C in {city}"  # a real agent would call a weather service here


class Weather(BaseModel):
    """What the user asked about."""
    city: str = Field(max_length=40, description="The city")
    unit: Literal["celsius", "fahrenheit"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question")
    parser.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-steps", type=int, default=3)
    args = parser.parse_args()

    llm = ChatOpenAI(model=args.model, base_url=args.base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused"),
                     temperature=0, max_tokens=80, max_retries=1)
    asked = llm.with_structured_output(Weather, method="function_calling").invoke(args.question)
    print(f"[structured: {asked!r}]")

    messages: list[BaseMessage] = [HumanMessage(args.question)]
    choice = "any"  # LangChain's "required": the first step must call the tool
    for step in range(args.max_steps):
        last = step == args.max_steps - 1
        answer = llm.bind_tools([get_weather], tool_choice="none" if last else choice).invoke(messages)
        assert isinstance(answer, AIMessage)
        if not answer.tool_calls:
            print(answer.content)
            return 0
        messages.append(answer)
        for call in answer.tool_calls:
            result = get_weather.invoke(call["args"])
            print(f"[{call['name']}({call['args']}) -> {result}]")
            messages.append(ToolMessage(result, tool_call_id=call["id"]))
        choice = "auto"
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
