"""Backends declare what they can do beyond plain sampling (``Backend.capabilities``); the engine
goes by the declaration, never by which methods a backend happens to have."""

from contextlib import aclosing

import pytest

from llmesh.errors import InvalidArgument
from llmesh.types import Message, Prompt, Sampling, Tool, ToolCall, Tools
from llmesh.engine.admission import Admission
from llmesh.engine.backends.base import Capabilities
from llmesh.engine.backends.llamacpp import LlamaCppBackend
from llmesh.engine.backends.sim import SimBackend, SimProfile
from llmesh.engine.backends.vllm import VllmBackend
from llmesh.engine.core import EngineCore
from llmesh.engine.lifecycle import ModelLifecycle, NoModel


class PlainSim(SimBackend):
    """The sim with nothing declared: it still has every method, and none is used."""
    capabilities = Capabilities()


def test_every_backend_declares_its_capabilities():
    knobs = frozenset({"top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"})
    assert LlamaCppBackend.capabilities == Capabilities(logprobs=True, response_format=True, continuation=True,
                                                        steps=True, knobs=knobs, tools=True)
    assert SimBackend.capabilities == Capabilities(logprobs=True, continuation=True, steps=True)
    assert VllmBackend.capabilities == Capabilities(logprobs=True, response_format=True, continuation=True,
                                                     adapters=True, knobs=knobs, tools=True)
    assert NoModel.capabilities == Capabilities() and NoModel.gpu_memory_share == 0.0


async def test_what_a_backend_does_not_declare_is_refused_and_its_methods_unused():
    backend = PlainSim("sim-plain", 512, SimProfile(decode_ms_base=0.0, output_tokens=8))
    core = EngineCore(backend, Admission(2, 2))
    try:
        with pytest.raises(InvalidArgument) as info:
            await anext(core.generate("sim-plain", Prompt(text="a b"), Sampling(max_tokens=4, logprobs=1)))
        assert info.value.param == "logprobs"
        with pytest.raises(InvalidArgument) as info:
            await anext(core.generate("sim-plain", Prompt(text="a b"), Sampling(max_tokens=4), continuation="c"))
        assert info.value.param == "continuation"
        chat = Prompt(messages=(Message("user", "a b"),))
        with pytest.raises(InvalidArgument, match="cannot call tools") as info:
            await anext(core.generate("sim-plain", chat, Sampling(max_tokens=4), tools=Tools((Tool("f"),))))
        assert info.value.param == "tools"
        history = Prompt(messages=(Message("user", "a"), Message("assistant", "", (ToolCall(0, "call_1", "f"),))))
        with pytest.raises(InvalidArgument, match="cannot call tools") as info:
            await anext(core.generate("sim-plain", history, Sampling(max_tokens=4)))
        assert info.value.param == "messages[1].tool_calls"
        async with aclosing(core.generate("sim-plain", Prompt(text="a b"), Sampling(max_tokens=6, seed=1))) as items:
            deltas = [item async for item in items][:-1]
        assert len(deltas) == 6 and all(d.tokens == 1 for d in deltas)  # no stream_steps: a piece a message
        life = ModelLifecycle(core, build=lambda name: backend)
        with pytest.raises(InvalidArgument, match="no LoRA adapters"):
            await life.load("sql", adapter_path="/adapters/sql")
    finally:
        await backend.close()
