"""A long prompt is tokenized off the gateway's event loop (``PromptTokens.ahead``), once per
request however many picks it takes (``RequestTokens``); a short one, or the sim's, where a
pick needs it. The real tokenizers: llama.cpp's (SmolLM2's GGUF) and a byte-level BPE built with
the ``tokenizers`` library."""

from __future__ import annotations

import asyncio
import threading

import pytest

from llmesh.gateway.domain.prompt_tokens import AHEAD_CHARS, NoTokens, PromptTokens, RequestTokens, worth_a_thread
from llmesh.gateway.domain.tokens import TokenCounter
from llmesh.prompt_tokens import GgufChatTokenizer, HfChatTokenizer
from llmesh.types import Message, Prompt
from tests.unit.test_hf_chat_tokenizer import byte_level_dir

SMOL = "smollm2-135m-instruct"
LONG = Prompt(messages=(Message("system", "You answer briefly."),
                        Message("user", "the harbour, the boats and the tides " * (AHEAD_CHARS // 30))))
SHORT = Prompt(messages=(Message("user", "hello there"),))


def on_threads(monkeypatch, cls) -> list[int]:
    """The threads ``cls``'s tokenizer runs on, from now on."""
    seen: list[int] = []
    call = cls.__call__

    def recording(self, prompt):
        seen.append(threading.get_ident())
        return call(self, prompt)
    monkeypatch.setattr(cls, "__call__", recording)
    return seen


@pytest.mark.parametrize("kind", ["gguf", "hf"])
async def test_a_long_prompt_is_tokenized_on_a_thread_as_the_pick_would_and_a_short_one_is_left_to_it(
        kind, real_model_dir, tmp_path, monkeypatch):
    if kind == "gguf":
        tokens, model, cls = PromptTokens(real_model_dir), SMOL, GgufChatTokenizer
    else:
        byte_level_dir(tmp_path)
        tokens, model, cls = PromptTokens(tmp_path), "byte-level", HfChatTokenizer
    seen = on_threads(monkeypatch, cls)
    try:
        assert await tokens.ahead(model, [SHORT]) is None and seen == []
        [ahead] = await tokens.ahead(model, [LONG])
        assert seen and seen[-1] != threading.get_ident()  # not the event loop's thread
        assert list(ahead) == tokens(model, LONG) and len(ahead) > AHEAD_CHARS // 8
        assert seen[-1] == threading.get_ident()
    finally:
        tokens.close()


def test_a_chat_of_many_short_messages_is_worth_a_thread_and_a_lone_question_is_not():
    assert not worth_a_thread([SHORT]) and worth_a_thread([LONG])
    assert worth_a_thread([Prompt(messages=tuple(Message("user", "hi") for _ in range(6)))])  # the template's work
    assert worth_a_thread([Prompt(text="x" * AHEAD_CHARS)])
    assert not worth_a_thread([Prompt(text="x" * (AHEAD_CHARS - 1))])
    assert worth_a_thread([Prompt(text="x" * 64)] * (AHEAD_CHARS // 64))  # many short texts: long together


async def test_the_sim_tokenizer_and_a_model_without_one_are_not_sent_to_a_thread():
    tokens = PromptTokens(None)
    try:
        assert await tokens.ahead("sim-small", [LONG]) is None  # Python: it would hold the GIL anyway
        assert await tokens.ahead("unknown", [LONG]) is None
        assert len(tokens("sim-small", LONG)) > AHEAD_CHARS // 8
    finally:
        tokens.close()


class Counting:
    """A tokenizer double that counts its calls: one token per word."""

    def __init__(self, ahead: bool) -> None:
        self.inline = self.threaded = 0
        self._ahead = ahead

    def __call__(self, model: str, prompt: Prompt) -> list[int]:
        self.inline += 1
        return list(range(sum(len(m.content.split()) for m in prompt.messages or ())))

    async def ahead(self, model: str, prompts: list[Prompt]) -> list[list[int]] | None:
        if not self._ahead:
            return None
        self.threaded += 1
        return await asyncio.to_thread(lambda: [list(range(sum(len(m.content.split()) for m in p.messages)))
                                                for p in prompts])


async def test_one_request_is_tokenized_once_per_model_over_all_its_picks():
    long, short = Counting(ahead=True), Counting(ahead=False)
    for tok in (long, short):
        request = RequestTokens(tok, LONG)
        for _ in range(3):  # a retry, then a failover
            await request.ready("m")
            assert len(request.of("m")()) == len(request.of("m")())
        await request.ready("fallback")
        request.of("fallback")()
    assert (long.threaded, long.inline) == (2, 0)
    assert (short.threaded, short.inline) == (0, 2)
    lazy = Counting(ahead=False)
    RequestTokens(lazy, LONG).of("m")  # a policy that never reads the tokens
    assert lazy.inline == 0


async def test_the_token_count_for_limits_takes_the_tokens_worked_out_ahead():
    tok = Counting(ahead=True)
    counter = TokenCounter(tok)
    assert await counter.count("m", counter.tokens(LONG)) == sum(len(m.content.split()) for m in LONG.messages)
    assert (tok.threaded, tok.inline) == (1, 0)
    assert await TokenCounter(NoTokens()).count("m", counter.tokens(SHORT)) > 0  # no tokenizer: the estimate


async def test_an_embeddings_request_s_many_short_inputs_are_counted_in_one_trip_to_a_thread(real_model_dir,
                                                                                              monkeypatch):
    tokens = PromptTokens(real_model_dir)
    texts = tuple(f"input {i}: " + "the harbour and the tides " * 3 for i in range(64))  # ~90 characters each
    seen = on_threads(monkeypatch, GgufChatTokenizer)
    try:
        counted = await TokenCounter(tokens).count_texts(SMOL, texts)
        assert len(seen) == len(texts) and len(set(seen)) == 1 and seen[0] != threading.get_ident()
        assert counted == sum(len(tokens(SMOL, Prompt(text=t))) for t in texts)
        seen.clear()
        two = await TokenCounter(tokens).count_texts(SMOL, texts[:2])
        assert seen == [threading.get_ident()] * 2  # two short texts: in place
        assert two == sum(len(tokens(SMOL, Prompt(text=t))) for t in texts[:2])
    finally:
        tokens.close()
    assert await TokenCounter(NoTokens()).count_texts(SMOL, texts) == sum(-(-len(t) // 3) for t in texts)


def test_the_sim_tokenizer_memo_keeps_short_words_only_and_changes_no_token():
    import hashlib

    from llmesh.prompt_tokens import SIM_WORD_MEMO, _memo_token, sim_token

    def hashed(word: str) -> int:
        return int.from_bytes(hashlib.blake2s(word.encode(), digest_size=2).digest(), "big")
    short, long = "harbour", "x" * (SIM_WORD_MEMO + 1)
    assert sim_token(short) == sim_token(short) == hashed(short)
    held = _memo_token.cache_info().currsize
    assert sim_token(long) == hashed(long)
    assert _memo_token.cache_info().currsize == held  # a long word (a hostile one) is never kept
    assert _memo_token.cache_info().maxsize == 1 << 16


async def test_the_tokens_are_the_chat_s_as_an_engine_sees_it_with_the_offered_tools():
    from llmesh.tool_prompt import render
    from llmesh.types import Tool, Tools

    tools = Tools((Tool("get_weather", "The weather in a city", '{"type": "object"}'),))
    tok = Counting(ahead=False)
    with_tools = RequestTokens(tok, SHORT, tools).of("m")()
    assert len(with_tools) == len(tok("m", render(SHORT, tools))) > len(tok("m", SHORT))
    # the limits count what the engine will: the offered tools too, with a tokenizer or by the estimate
    counter = TokenCounter(tok)
    assert await counter.count("m", counter.tokens(SHORT, tools)) == len(with_tools)
    estimate = TokenCounter(NoTokens())
    assert await estimate.count("m", estimate.tokens(SHORT, tools)) > await estimate.count("m", estimate.tokens(SHORT))
    # the router takes the limits' tokens only for the same prompt and tools (a masked prompt is a new one)
    counted = counter.tokens(SHORT, tools)
    assert counted.serves(SHORT, tools)
    assert not counted.serves(Prompt(messages=SHORT.messages), tools) and not counted.serves(SHORT, None)


async def test_the_limits_stage_counts_the_offered_tools_and_leaves_its_tokens_for_the_router():
    """Through the real LimitStage and the sim tokenizer: the tokens a limited request is charged grow by its
    offered tools as the engine renders them, and the request's tokens stay on its context for the picks."""
    from llmesh.gateway.context import CompletionRequest, Context
    from llmesh.gateway.domain.limits import LocalLimiter
    from llmesh.gateway.stages.limits import LimitStage
    from llmesh.liveconfig.schema import MeshConfig
    from llmesh.prompt_tokens import sim_tokenize
    from llmesh.tool_prompt import render
    from llmesh.types import Sampling, Tool, Tools

    tools = Tools((Tool("get_weather", "The weather in a city", '{"type": "object"}'),))
    config = MeshConfig.model_validate({"rate_limits": {"t": {"tokens_per_minute": 100_000}}})
    remaining = []
    for offered in (None, tools):
        stage = LimitStage(LocalLimiter(), lambda: config, TokenCounter(PromptTokens(None)))
        ctx = Context.of(CompletionRequest(request_id="r", tenant="t", model="sim-a", prompt=SHORT,
                                           sampling=Sampling(max_tokens=10), timeout_s=5, tools=offered))
        await stage.admit(ctx)
        remaining.append(int(ctx.headers["x-ratelimit-remaining-tokens"]))
        assert ctx.tokens is not None and ctx.tokens.serves(ctx.req.prompt, offered)
    assert remaining[0] == 100_000 - 10 - len(sim_tokenize(SHORT))
    assert remaining[0] - remaining[1] == len(sim_tokenize(render(SHORT, tools))) - len(sim_tokenize(SHORT)) > 0


def test_the_sim_floor_is_its_token_count_when_the_prompt_is_short_and_stops_at_enough():
    """The sim's floor counts what ``sim_tokenize`` makes (each "role:", the words, the answer's
    header), so under ``enough`` it is exact, and past it the count stops."""
    tokens = PromptTokens(None)
    chat = Prompt(messages=(Message("system", "be brief"), Message("user", "one two three")))
    assert tokens.floor("sim-small", chat, 100) == len(tokens("sim-small", chat)) == 8
    text = Prompt(text="a b c d e")
    assert tokens.floor("sim-small", text, 100) == len(tokens("sim-small", text)) == 5
    assert 3 < tokens.floor("sim-small", Prompt(text="w " * 10_000), 3) <= 5
