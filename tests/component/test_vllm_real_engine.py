"""The vllm backend's contract with the engine on vLLM's real engine (the session's ``real_vllm``:
AsyncLLM from vLLM's CPU build serving SmolLM2 in fp32): log probabilities checked against the
model itself (transformers on the same weights), an answer continued after a failover, every
sampling parameter the engine passes, stop strings and max_tokens as the engine core applies
them, a gRPC deadline aborting the request inside vLLM, and the load the engine reports to the
real scheduler and in its metrics while vLLM runs. Run with .venv-vllm's interpreter:

    LLMESH_VLLM_TEST_MODEL=~/.cache/llmesh/models/smollm2-135m-instruct-hf-fp32 \\
        .venv-vllm/bin/python -m pytest -q tests/component/test_vllm_real_engine.py"""

from __future__ import annotations

import math
from contextlib import aclosing

import grpc
import pytest

from llmesh.errors import InvalidArgument
from tests.component.helpers import generated
from llmesh.testing import free_ports, wait_until_async
from llmesh.types import Finish, Message, Prompt, ResponseFormat, Sampling
from llmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from llmesh.engine.admission import Admission
from llmesh.engine.backends.base import DecodeParams
from llmesh.engine.core import EngineCore

MODEL = "smollm2-vllm"  # the real_vllm fixture's served name


def ask(text: str) -> Prompt:
    return Prompt(messages=(Message("user", text),))


def unfinished(backend) -> int:
    """Requests vLLM's own output processor still holds (0: none left running inside vLLM)."""
    return backend._engine.output_processor.get_num_unfinished_requests()


async def run(core: EngineCore, prompt: Prompt, sampling: Sampling, continuation: str = "") -> tuple[str, list, Finish]:
    text, logprobs, finish = await generated(core, MODEL, prompt, sampling, continuation)
    assert finish is not None
    return text, logprobs, finish


@pytest.fixture
def core(real_vllm) -> EngineCore:
    return EngineCore(real_vllm, Admission(max_running=8, max_waiting=8))


@pytest.fixture(scope="module")
def reference(real_vllm):
    """The same fp32 weights in transformers: the model's own log probabilities."""
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = real_vllm._engine.vllm_config.model_config.model
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model


def reference_logprobs(model, prompt: list[int], steps: int, top: int) -> list[tuple[int, float, list[float]]]:
    """Greedy decoding in transformers: per step the chosen id, its log-softmax, the ``top`` best."""
    import torch

    ids = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            lsm = torch.log_softmax(logits, dim=-1)
            best = torch.topk(lsm, top)
            chosen = int(best.indices[0])
            out.append((chosen, float(lsm[chosen]), [float(v) for v in best.values]))
            ids.append(chosen)
    return out


# --- log probabilities ---

async def test_logprobs_are_the_models_own_for_the_chosen_tokens(real_vllm, core, reference):
    prompt = ask("What colour is the sky on a clear day?")
    text, lps, finish = await run(core, prompt, Sampling(max_tokens=8, temperature=0.0, logprobs=3))
    assert len(lps) == finish.usage.completion_tokens == 8
    assert "".join(t.token for t in lps) == text  # one entry per token, each the chosen token's text
    tokenizer = real_vllm._tokenizer
    want = reference_logprobs(reference, real_vllm.tokenize(prompt), 8, 3)
    for t, (chosen, logprob, best) in zip(lps, want, strict=True):
        assert t.token == tokenizer.decode([chosen])  # greedy in transformers chose the same token
        assert t.logprob == pytest.approx(logprob, abs=2e-3)  # log-softmax of the raw logits
        assert len(t.top) == 3 and [lp for _, lp in t.top] == pytest.approx(best, abs=2e-3)
        assert t.top[0] == (t.token, t.logprob)  # greedy: the chosen token is the best
        assert sum(math.exp(lp) for _, lp in t.top) <= 1.0 + 1e-4


async def test_sampled_tokens_logprobs_and_only_the_chosen_one(core):
    _, sampled, _ = await run(core, ask("Tell me a word."), Sampling(max_tokens=8, temperature=1.5, seed=3,
                                                                      logprobs=2))
    assert len(sampled) == 8 and all(len(t.top) == 2 and t.logprob <= t.top[0][1] + 1e-6 for t in sampled)
    _, only, _ = await run(core, ask("Tell me a word."), Sampling(max_tokens=4, temperature=0.0, logprobs=0))
    assert len(only) == 4 and all(t.top == () and t.logprob <= 0.0 for t in only)


async def test_more_logprobs_than_vllm_gives_is_invalid_and_vllm_serves_on(real_vllm, core):
    with pytest.raises(InvalidArgument, match="'top_logprobs': must be less than or equal to 20"):
        await run(core, ask("hi"), Sampling(max_tokens=2, logprobs=1000))  # the engine's check, as vLLM's max
    with pytest.raises(InvalidArgument, match="vLLM refused the request"):  # past the core's: vLLM's own
        async with aclosing(real_vllm.stream(real_vllm.tokenize(ask("hi")), DecodeParams(2, 0.0, 1.0, 0,
                                                                                        logprobs=1000))) as s:
            [p async for p in s]
    assert unfinished(real_vllm) == 0
    text, _, _ = await run(core, ask("hi"), Sampling(max_tokens=2, temperature=0.0))
    assert text


async def test_an_engine_with_lora_off_refuses_adapters_saying_which_setting(real_vllm):
    assert not real_vllm.enable_lora  # the session's engine runs with LLMESH_ENGINE_VLLM_ENABLE_LORA=false
    with pytest.raises(InvalidArgument, match="LLMESH_ENGINE_VLLM_ENABLE_LORA") as err:
        await real_vllm.load_adapter("any", "/some/adapter")
    assert err.value.param == "adapter_path" and real_vllm.models == (MODEL,)


# --- continuation (mid-stream failover) ---

async def test_an_answer_continued_from_another_engine_goes_on_where_it_stopped(real_vllm, core):
    prompt = ask("Write two sentences about the sea.")
    whole, _, _ = await run(core, prompt, Sampling(max_tokens=40, temperature=0.0))
    async with aclosing(real_vllm.stream(real_vllm.tokenize(prompt), DecodeParams(40, 0.0, 1.0, 0))) as s:
        pieces = [p async for p in s]
    assert "".join(pieces) == whole
    half = "".join(pieces[:8])  # what the first engine sent before it died
    assert half and whole.startswith(half)
    rest, _, finish = await run(core, prompt, Sampling(max_tokens=12, temperature=0.0), continuation=half)
    assert finish.usage.prompt_tokens == len(real_vllm.tokenize(prompt)) + len(real_vllm.tokenize_continuation(half))
    assert rest and whole.startswith(half + rest)  # greedy: the answer one engine would have written alone
    with pytest.raises(InvalidArgument, match="cannot continue an answer constrained by response_format"):
        await run(core, prompt, Sampling(max_tokens=4, response_format=ResponseFormat("json_object")),
                  continuation='{"a": ')


# --- sampling parameters, stop strings, max_tokens ---

async def test_top_p_and_temperature_reach_vllms_sampler(core):
    prompt = ask("Invent a name for a dog.")
    greedy, _, _ = await run(core, prompt, Sampling(max_tokens=10, temperature=0.0))
    # a nucleus of one token is greedy whatever the temperature and seed
    narrow = [await run(core, prompt, Sampling(max_tokens=10, temperature=1.5, top_p=1e-6, seed=s)) for s in (1, 2)]
    assert all(text == greedy for text, _, _ in narrow)
    wide = [(await run(core, prompt, Sampling(max_tokens=10, temperature=1.5, top_p=1.0, seed=s)))[0]
            for s in (1, 2, 3)]
    assert any(text != greedy for text in wide) and len(set(wide)) > 1
    cold = [(await run(core, prompt, Sampling(max_tokens=10, temperature=1e-3, seed=s)))[0] for s in (1, 2)]
    assert cold == [greedy, greedy]  # a near-zero temperature samples the best token


async def test_stop_strings_and_max_tokens_as_the_core_applies_them(real_vllm, core):
    prompt = ask("Describe a walk along the river at dawn.")
    full, _, whole = await run(core, prompt, Sampling(max_tokens=40, temperature=0.0))
    assert whole.usage.completion_tokens > 8 and len(full.split()) > 4
    stop = " " + full.split()[3]  # a word the greedy answer holds
    cut, _, short = await run(core, prompt, Sampling(max_tokens=4, temperature=0.0))
    assert short.reason.value == "length" and short.usage.completion_tokens == 4 and full.startswith(cut)
    text, _, finish = await run(core, prompt, Sampling(max_tokens=40, temperature=0.0, stop=(stop,)))
    assert finish.reason.value == "stop" and text == full[:full.index(stop)]
    assert finish.usage.completion_tokens < whole.usage.completion_tokens
    assert await wait_until_async(lambda: unfinished(real_vllm) == 0, 5.0)  # the stop aborted it inside vLLM


# --- deadlines and the load the engine reports, over gRPC to the real scheduler ---

class Borrowed:
    """The session's backend lent to one EngineApp: everything but close (the session closes it)."""

    def __init__(self, backend):
        self._backend = backend

    def __getattr__(self, name):
        return getattr(self._backend, name)

    async def close(self) -> None:
        pass


def kv_usage_metric(app) -> float:
    return app.metrics.kv_usage._child_samples()[0].value  # what a scrape of vllm:kv_cache_usage_perc reads


async def test_deadlines_abort_inside_vllm_and_reports_follow_vllms_load(real_vllm):
    from llmesh.engine.app import EngineApp
    from llmesh.engine.config import EngineSettings
    from llmesh.rpc.channels import mesh_channel
    from llmesh.scheduler.app import SchedulerApp
    from llmesh.scheduler.config import SchedulerSettings
    from llmesh.scheduler.table import Load

    scheduler = SchedulerApp(SchedulerSettings(port=0, host="127.0.0.1"))
    await scheduler.start()
    app = EngineApp(EngineSettings(backend="vllm", model=MODEL, port=free_ports(1)[0], host="127.0.0.1",
                                   endpoint_id="vllm-real", scheduler_address=scheduler.advertise_address,
                                   self_test_interval_s=600, report_interval_s=0.2, max_running=4),
                    backend=Borrowed(real_vllm))

    def reported() -> Load | None:  # the load the scheduler last heard from this engine
        return next((e.load for e in scheduler.table.snapshot() if e.endpoint_id == "vllm-real"), None)

    try:
        await app.start()
        assert await wait_until_async(lambda: reported() is not None)
        async with mesh_channel(app.server.bound_address, "engine") as channel:
            stub = engine_pb2_grpc.EngineStub(channel)

            def call(text: str, max_tokens: int, timeout: float):
                return stub.Generate(engine_pb2.GenerateRequest(model=MODEL, chat=engine_pb2.ChatInput(messages=[
                    common_pb2.ChatMessage(role="user", content=text)]), sampling=common_pb2.SamplingParams(
                        max_tokens=max_tokens, temperature=0.0)), timeout=timeout)

            # three long answers at once: the scheduler hears 3 running, vLLM's stat logger KV use
            calls = [call(f"Write a long story about a {animal}.", 1500, 120) for animal in ("cat", "dog", "fox")]
            for c in calls:
                assert await c.read() is not grpc.aio.EOF  # streaming
            assert await wait_until_async(lambda: (reported() or Load()).running == 3)
            assert unfinished(real_vllm) == 3
            assert await wait_until_async(lambda: kv_usage_metric(app) > 0)  # live, from vLLM's own stats
            for c in calls:
                c.cancel()
            assert await wait_until_async(lambda: unfinished(real_vllm) == 0)  # a cancel aborts inside vLLM
            assert await wait_until_async(lambda: reported().running == 0 and kv_usage_metric(app) == 0)

            # a deadline: DEADLINE_EXCEEDED for the caller, and the request gone from vLLM too
            late = call("Write a very long essay about the history of ships.", 1500, 1.5)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in late:
                    pass
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert await wait_until_async(lambda: unfinished(real_vllm) == 0 and app.core.active(app.backend) == 0)
            assert app.admission.running == 0 and await wait_until_async(lambda: reported().running == 0)
            # and the engine serves on
            done = [r async for r in call("Say hi.", 3, 30)]
            assert done[-1].usage.completion_tokens >= 1
    finally:
        await app.stop(0)
        await scheduler.stop(0)
    async with aclosing(real_vllm.stream(real_vllm.tokenize(ask("hi")), DecodeParams(2, 0.0, 1.0, 0))) as s:
        assert [p async for p in s]  # the lent backend serves on after the app stopped


# --- the sampling knobs (top_k, min_p, repetition_penalty, presence_penalty, frequency_penalty) ---

async def test_the_knobs_reach_vllms_sampling_params_and_its_sampler(real_vllm, core, monkeypatch):
    made = []
    real = real_vllm._api.SamplingParams

    def recording(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(real_vllm._api, "SamplingParams", recording)
    knobs = {"top_k": 40, "min_p": 0.25, "repetition_penalty": 1.5, "presence_penalty": 0.5,
             "frequency_penalty": -0.5}
    await run(core, ask("Invent a name for a dog."), Sampling(max_tokens=4, temperature=0.8, seed=1, **knobs))
    assert {name: getattr(made[-1], name) for name in knobs} == knobs
    await run(core, ask("Invent a name for a dog."), Sampling(max_tokens=4, top_k=-1, repetition_penalty=1.0))
    assert (made[-1].top_k, made[-1].repetition_penalty) == (real().top_k, real().repetition_penalty)  # off: vLLM's own

    prompt = ask("Tell me a short story about a fox.")
    greedy, _, _ = await run(core, prompt, Sampling(max_tokens=16, temperature=0.0))
    for seed in (1, 2):  # one candidate left: greedy whatever the temperature and seed
        for knob in ({"top_k": 1}, {"min_p": 1.0}):
            assert (await run(core, prompt, Sampling(max_tokens=16, temperature=1.5, seed=seed, **knob)))[0] == greedy
    counting = Prompt(text="1, 2, 3, 1, 2, 3, 1, 2, 3,")
    plain, _, _ = await run(core, counting, Sampling(max_tokens=24, temperature=0.0))
    for knob in ({"repetition_penalty": 10.0}, {"frequency_penalty": 2.0}):
        text, _, _ = await run(core, counting, Sampling(max_tokens=24, temperature=0.0, **knob))
        assert text != plain and text.count("1, 2, 3") < plain.count("1, 2, 3"), (knob, text)
