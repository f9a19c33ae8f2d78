"""LangChain (langchain-openai's ChatOpenAI) against an llmesh gateway, as the llama.cpp and vLLM tool
tests run it: structured output by function calling, and a two-step agent (a tool call, the tool's
result, the answer)."""

from __future__ import annotations

from typing import Literal

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field


class Weather(BaseModel):
    """The weather in a city."""
    city: str = Field(max_length=20, description="The city")
    unit: Literal["celsius", "fahrenheit"]


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"Sunny, 21 C in {city}"


def chat_model(mesh, model: str, **kwargs) -> ChatOpenAI:
    return ChatOpenAI(model=model, base_url=mesh.layout.http_url + "/v1", api_key="unused", temperature=0,
                      max_retries=0, timeout=120, **kwargs)


def structured_output(mesh, model: str) -> None:
    structured = chat_model(mesh, model, max_tokens=80).with_structured_output(Weather, method="function_calling")
    answer = structured.invoke("What is the weather in Paris, in celsius?")
    assert isinstance(answer, Weather) and answer.city and len(answer.city) <= 20


def two_step_agent(mesh, model: str) -> None:
    """Step one must call the tool (tool_choice "any", LangChain's "required"); step two, with the
    tool still offered (auto), answers in text, else a last step without tools does, as agents cap
    their iterations."""
    llm = chat_model(mesh, model, max_tokens=60)
    messages: list[BaseMessage] = [HumanMessage("What is the weather in Paris?")]
    call = llm.bind_tools([get_weather], tool_choice="any").invoke(messages)
    assert isinstance(call, AIMessage) and [c["name"] for c in call.tool_calls] == ["get_weather"]
    assert isinstance(call.tool_calls[0]["args"]["city"], str)
    messages.append(call)
    messages += [ToolMessage(get_weather.invoke(c["args"]), tool_call_id=c["id"]) for c in call.tool_calls]
    for choice in ("auto", "none"):
        answer = llm.bind_tools([get_weather], tool_choice=choice).invoke(messages)
        if not answer.tool_calls:
            break
    assert isinstance(answer, AIMessage) and answer.content and not answer.tool_calls
