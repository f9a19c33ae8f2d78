"""Model lifecycle on one engine with vLLM's real engine (its CPU build, SmolLM2 in fp32): LoRA
adapters made with peft loaded, served and unloaded at run time (vLLM's CPU build serves LoRA
through its CPU punica kernels), the adapters vLLM refuses refused clearly, a model swap that
does not fit beside the old one (two GPU memory shares over 1) unloading first, and an unload
that ends vLLM's engine-core process. The engine is its own (LoRA on), not the session's, and
the test runs before any test that starts the session's (the Makefile lists this file first),
so one AsyncLLM runs at a time. Run with .venv-vllm's interpreter:

    LLMESH_VLLM_TEST_MODEL=~/.cache/llmesh/models/smollm2-135m-instruct-hf-fp32 \\
        .venv-vllm/bin/python -m pytest -q tests/component/test_vllm_real_lifecycle.py"""

from __future__ import annotations

from contextlib import aclosing
from pathlib import Path

import pytest

from llmesh.errors import InvalidArgument, ModelNotFound
from llmesh.testing import free_ports, pid_alive, wait_until_async
from llmesh.types import Delta, Message, Prompt, Sampling
from llmesh.engine.core import EngineCore
from tests.component.conftest import real_vllm_settings

BASE = "smollm2-vllm"
MIB = 2**20


def descendants() -> dict[int, int]:
    """This process's descendants (vLLM's engine core runs in one): pid -> resident bytes."""
    import psutil

    out = {}
    for child in psutil.Process().children(recursive=True):
        try:
            out[child.pid] = child.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return out


def make_adapters(model_dir: str, root: Path) -> dict[str, str]:
    """LoRA adapters for SmolLM2 made by peft (random, non-zero weights, so they change the
    answer): rank 8, which the engine takes, and rank 32, over its max rank of 16."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = {}
    for name, rank in (("tiny", 8), ("big", 32)):
        torch.manual_seed(rank)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"],
                            init_lora_weights=False, task_type="CAUSAL_LM")
        get_peft_model(base, config).save_pretrained(root / name)
        paths[name] = str(root / name)
    return paths


async def answer(core: EngineCore, model: str) -> str:
    text = []
    prompt = Prompt(messages=(Message("user", "Name three fruits."),))
    async with aclosing(core.generate(model, prompt, Sampling(max_tokens=12, temperature=0.0))) as items:
        async for item in items:
            if isinstance(item, Delta):
                text.append(item.text)
    return "".join(text)


@pytest.mark.timeout(900)  # two AsyncLLM starts (~20 s each on a quiet machine; minutes on a loaded one)
async def test_lora_a_swap_and_an_unload_on_real_vllm(tmp_path):
    from llmesh.engine.app import EngineApp

    settings = real_vllm_settings("vllm-lifecycle", vllm_enable_lora=True, vllm_max_lora_rank=16,
                                  scheduler_address=None, port=free_ports(1)[0], self_test_interval_s=600,
                                  grace_s=10)
    before = descendants()
    app = EngineApp(settings)  # built from the settings, as the engine's main does
    started = {pid: rss for pid, rss in descendants().items() if pid not in before}
    first = max(started, key=started.__getitem__)  # vLLM's engine core (beside it: multiprocessing's helpers)
    assert started[first] > 1024 * MIB  # it holds the weights and a 1 GiB KV cache
    core, life = app.core, app.lifecycle
    try:
        adapters = make_adapters(settings.vllm_model_path, tmp_path)
        base = await answer(core, BASE)
        assert base

        # LoRA: loaded at run time, served by name beside the base model, unloaded
        loaded = await life.load("tiny-lora", adapter_path=adapters["tiny"])
        assert loaded.model.base_model == BASE and [m.name for m in life.list()] == [BASE, "tiny-lora"]
        tuned = await answer(core, "tiny-lora")
        assert tuned and tuned != base  # the adapter's weights changed the answer
        assert await answer(core, BASE) == base  # and only for requests naming it
        with pytest.raises(InvalidArgument, match=r"higher rank than this engine takes \(16; "
                                                  r"LLMESH_ENGINE_VLLM_MAX_LORA_RANK\)") as err:
            await life.load("big-lora", adapter_path=adapters["big"])
        assert err.value.param == "adapter_path"
        with pytest.raises(InvalidArgument, match="no LoRA adapter at /no/such/adapter"):
            await life.load("missing-lora", adapter_path="/no/such/adapter")
        assert [m.name for m in life.list()] == [BASE, "tiny-lora"]
        await life.unload("tiny-lora")
        with pytest.raises(ModelNotFound):
            await answer(core, "tiny-lora")

        # a swap: two 0.85 GPU memory shares do not fit, so the old engine goes first
        swapped = await life.load("smollm2-swapped")
        assert swapped.swap == "unload_first" and swapped.replaced == BASE and swapped.warmup_ms > 0
        assert await wait_until_async(lambda: not pid_alive(first), 10.0)  # the old engine core is gone
        now = {pid: rss for pid, rss in descendants().items() if pid not in before and pid not in started}
        second = max(now, key=now.__getitem__)
        assert now[second] > 1024 * MIB  # the new one holds what the old one held
        assert await answer(core, "smollm2-swapped") == base  # the same weights under the new name
        with pytest.raises(ModelNotFound):
            await answer(core, BASE)

        # an unload ends vLLM's engine core: its memory is the system's again
        await life.unload("smollm2-swapped")
        assert await wait_until_async(lambda: not pid_alive(second), 10.0)
        assert life.list() == []
        with pytest.raises(ModelNotFound):
            await answer(core, "smollm2-swapped")
    finally:
        await app.stop(0)
