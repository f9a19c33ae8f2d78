"""One sequence's llama.cpp sampler chain, built from its DecodeParams in the order vLLM
samples: the response format's grammar, the penalties, then greedy, or temperature, min_p,
top_k, top_p and a seeded draw. ``llama_sampler_sample`` accepts each drawn token into
every sampler of the chain, so the penalties count the answer as it grows."""

from __future__ import annotations

import ctypes
import random
from typing import Any

from llmesh.engine.backends.base import DecodeParams


def sampler_chain(lc: Any, vocab: Any, n_vocab: int, p: DecodeParams, grammar: str | None,
                  prompt: list[int], answered: list[int]) -> Any:
    """The chain (free it with ``llama_sampler_free``). ``prompt`` is every token the model
    was given (``answered``, an answer begun elsewhere, at its end). ValueError: the grammar
    does not parse, or ``answered`` breaks it."""
    chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    try:
        if grammar is not None:
            _grammar(lc, vocab, chain, grammar, answered)
        if p.repetition_penalty != 1.0:  # vLLM's: over the prompt's tokens and the answer's
            _penalties(lc, chain, n_vocab, prompt, p.max_new_tokens, repeat=p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:  # OpenAI's: over the answer's tokens only
            _penalties(lc, chain, n_vocab, answered, p.max_new_tokens, freq=p.frequency_penalty,
                       present=p.presence_penalty)
        if p.temperature <= 0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
            return chain
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(p.temperature))
        if p.min_p > 0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_min_p(p.min_p, 1))
        if p.top_k > 0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_k(p.top_k))
        if p.top_p < 1.0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_p(p.top_p, 1))
        seed = p.seed % 2**32 if p.seed is not None else random.getrandbits(32)
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(seed))
        return chain
    except BaseException:
        lc.llama_sampler_free(chain)
        raise


def _grammar(lc: Any, vocab: Any, chain: Any, grammar: str, answered: list[int]) -> None:
    constrain = lc.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
    if not constrain:
        raise ValueError("llama.cpp could not parse the grammar")
    lc.llama_sampler_chain_add(chain, constrain)  # the chain owns it from here
    # An answer begun on another engine: the grammar resumes where that one's stopped
    # (from the root it would start a second JSON value after the first half).
    for tok in answered:
        if not _allows(lc, constrain, tok):  # accepting it would abort the process
            raise ValueError("the answer so far does not match the response format")
        lc.llama_sampler_accept(constrain, tok)


def _allows(lc: Any, grammar: Any, tok: int) -> bool:
    """Whether ``grammar`` lets ``tok`` come next (it masks what it refuses to -inf)."""
    data = (lc.llama_token_data * 1)(lc.llama_token_data(tok, 0.0, 0.0))
    lc.llama_sampler_apply(grammar, ctypes.byref(lc.llama_token_data_array(data, 1, -1, False)))
    return data[0].logit != float("-inf")


def _penalties(lc: Any, chain: Any, n_vocab: int, seen: list[int], max_new: int, repeat: float = 1.0,
               freq: float = 0.0, present: float = 0.0) -> None:
    """llama.cpp's penalties sampler over ``seen`` and the up to ``max_new`` tokens drawn after
    them: its window (a ring buffer it allocates) holds them all, and no more."""
    penalties = lc.llama_sampler_init_penalties(n_vocab, len(seen) + max_new, repeat, freq, present)
    lc.llama_sampler_chain_add(chain, penalties)
    for tok in seen:
        lc.llama_sampler_accept(penalties, tok)
