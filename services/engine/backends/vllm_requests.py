"""What the vllm backend hands vLLM for one request (its SamplingParams, structured outputs)
and what it makes of vLLM's outputs (one piece per token, with log probabilities when asked),
without importing vLLM: vLLM's classes come in ``api`` (a namespace ``VllmBackend.create``
fills), so the conversions are tested where vLLM is absent too."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from llmesh.errors import Internal, InvalidArgument
from llmesh.types import TokenLogprob
from llmesh.engine.backends.base import DecodeParams, Piece, Token


def sampling_params(api: SimpleNamespace, params: DecodeParams, tool_tag: str | None = None) -> Any:
    """vLLM's SamplingParams for ``params``: streamed as deltas; vLLM reports ``logprobs``
    alternatives a token (its default logprobs mode: log-softmax of the raw logits, as the
    llamacpp backend reports them). Stop strings stay with the engine core, as on every backend.
    ``tool_tag``: the structural tag of the tools offered (vllm_tools), which constrains the answer;
    special tokens are then kept in the text, as vLLM's hermes parser has its server do (models
    such as Hermes 2 Pro mark ``<tool_call>`` special; the stop token never reaches the text)."""
    if params.continues and params.response_format is not None:
        # vLLM's structured outputs start the grammar at the first generated token: it cannot
        # resume a JSON value another engine began (it would start a second one).
        raise InvalidArgument("The vllm backend cannot continue an answer constrained by response_format.",
                              param="continuation")
    return api.SamplingParams(
        max_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
        seed=params.seed, logprobs=params.logprobs, output_kind=api.RequestOutputKind.DELTA,
        structured_outputs=structured_outputs(api, params, tool_tag), skip_special_tokens=tool_tag is None,
        **knobs(params))


def knobs(params: DecodeParams) -> dict[str, int | float]:
    """The knobs a request turned on, as SamplingParams' fields of the same names (the same
    meanings: vLLM's repetition_penalty counts the prompt's tokens too, its presence and
    frequency penalties the answer's); those left off keep vLLM's own defaults."""
    on: dict[str, int | float] = {}
    if params.top_k > 0:
        on["top_k"] = params.top_k
    for name, value, off in (("min_p", params.min_p, 0.0), ("repetition_penalty", params.repetition_penalty, 1.0),
                             ("presence_penalty", params.presence_penalty, 0.0),
                             ("frequency_penalty", params.frequency_penalty, 0.0)):
        if value != off:
            on[name] = value
    return on


def structured_outputs(api: SimpleNamespace, params: DecodeParams, tool_tag: str | None = None) -> Any:
    """vLLM's StructuredOutputsParams for the request's tools (their structural tag) or its
    response_format (the engine core never lets both through; None: unconstrained)."""
    if tool_tag is not None:
        return api.StructuredOutputsParams(structural_tag=tool_tag)
    fmt = params.response_format
    if fmt is None:
        return None
    if fmt.type == "json_schema" and fmt.schema:
        return api.StructuredOutputsParams(json=fmt.schema)
    if fmt.type in ("json_object", "json_schema"):
        return api.StructuredOutputsParams(json_object=True)
    raise InvalidArgument(f"unsupported response_format {fmt.type!r}", param="response_format")


def pieces(completion: Any, top: int | None) -> list[Piece]:
    """One piece per token of a delta (vLLM's CompletionOutput): the delta's text rides on its
    first token; with ``top`` set (logprobs asked for), each a Token with its log probability
    and the ``top`` most likely alternatives at its position, best first."""
    ids = completion.token_ids
    if top is None:
        return [completion.text if i == 0 else "" for i in range(len(ids))]
    positions = completion.logprobs
    if positions is None or len(positions) < len(ids):
        raise Internal("vLLM sent tokens without the log probabilities asked for")
    return [Token(completion.text if i == 0 else "", token_logprob(tok, positions[i], top))
            for i, tok in enumerate(ids)]


def token_logprob(token_id: int, position: dict[int, Any], top: int) -> TokenLogprob:
    """A position's logprobs as vLLM reports them ({token id: Logprob(logprob, rank,
    decoded_token)}: the chosen token and the ``top`` ranked best, which may include it)."""
    chosen = position.get(token_id)
    if chosen is None:
        raise Internal("vLLM reported no log probability for a token it generated")
    best = sorted((lp for lp in position.values() if lp.rank is not None and lp.rank <= top),
                  key=lambda lp: (lp.rank, -lp.logprob))[:top]
    return TokenLogprob(chosen.decoded_token or "", float(chosen.logprob),
                        tuple((lp.decoded_token or "", float(lp.logprob)) for lp in best))
