"""LangChain (langchain-openai's ChatOpenAI) on an llmesh engine: structured output by function
calling, and a two-step agent (a tool call, the tool's result, the answer), on SmolLM2 served by
the mesh's llama.cpp engine (tests/e2e/langchain_cases.py; on vLLM: test_vllm_mesh.py); and
examples/python/langchain_agent.py runs."""

from __future__ import annotations

from tests.e2e.conftest import SMOL
from tests.e2e.langchain_cases import structured_output, two_step_agent
from tests.e2e.tool_cases import run_example


def test_structured_output_by_function_calling(mesh):
    structured_output(mesh, SMOL)


def test_a_two_step_agent_runs_to_completion(mesh):
    two_step_agent(mesh, SMOL)


def test_the_langchain_agent_example_runs(mesh):
    lines = run_example(mesh, "langchain_agent.py")
    assert lines[0].startswith("[structured: Weather(city=")
    assert lines[1].startswith("[get_weather({") and lines[-1].strip() and not lines[-1].startswith("[")
