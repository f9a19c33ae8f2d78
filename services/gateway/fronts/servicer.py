"""Gateway gRPC servicer: protobuf <-> the same pipeline the HTTP front uses."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import numpy as np

from llmesh.convert import finish_to_pb, logprobs_to_pb, tool_calls_to_pb, usage_to_pb
from llmesh.errors import Internal, LlmeshError, domain_error
from llmesh.logs import request_id_var
from llmesh.request_id import kept, new_request_id
from llmesh.rpc.interceptor import REQUEST_ID_KEY
from llmesh.types import Delta, Finish
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from llmesh.gateway.fronts.batch_servicer import BatchRpcs
from llmesh.gateway.fronts.choices import choice_requests, merge
from llmesh.gateway.context import Caller, CompletionRequest, Context, Vectors
from llmesh.gateway.domain.batches.service import BatchService
from llmesh.gateway.domain.listing import ListedModel, Serves
from llmesh.gateway.pipeline import Pipeline
from llmesh.gateway.fronts.proto_api import chat_request, complete_request, embed_request

_API = {Serves.CHAT: gateway_pb2.MODEL_API_CHAT, Serves.COMPLETIONS: gateway_pb2.MODEL_API_COMPLETIONS,
        Serves.EMBEDDINGS: gateway_pb2.MODEL_API_EMBEDDINGS}
_OPERATIONS = {"Chat": "chat", "Complete": "text_completion", "Embed": "embeddings"}  # the methods that run one


def credential(context) -> str | None:
    """The caller's API key or JWT, from the ``authorization`` metadata ("Bearer X" or X)."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            scheme, _, token = value.partition(" ")
            return (token if scheme.lower() == "bearer" else value).strip() or None
    return None


def request_ids(context) -> tuple[str, str | None]:
    """(the id the interceptor bound, the client's x-request-id as the record keeps it when
    that id replaced it)."""
    rid = request_id_var.get() or new_request_id()
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY and isinstance(value, str):  # the first, as the interceptor reads it
            return rid, None if value == rid else kept(value)
    return rid, None


class GatewayServicer(BatchRpcs, gateway_pb2_grpc.GatewayServicer):
    def __init__(self, pipeline: Pipeline, model_names: Callable[[str | None], Awaitable[list[ListedModel]]],
                 default_timeout_s: float,
                 batch_api: tuple[BatchService, Callable[[str | None], Awaitable[Caller]]] | None = None):
        self._pipeline = pipeline
        self._batch_api = batch_api  # the Batch API's service and the authenticator (BatchRpcs)
        self._credential = credential
        self._model_names = model_names
        self._default_timeout = default_timeout_s

    def _call(self, context) -> tuple[str, float, str | None]:
        """(request id, timeout, the client's id when it was replaced): the interceptor read
        x-request-id (a safe one is kept, any other replaced); the deadline caps the timeout."""
        rid, client_rid = request_ids(context)
        context.set_trailing_metadata(((REQUEST_ID_KEY, rid),))
        remaining = context.time_remaining()
        return rid, self._default_timeout if remaining is None else min(remaining, self._default_timeout), client_rid

    def _refused(self, rid: str, operation: str, client_rid: str | None, exc: BaseException) -> None:
        """A request refused before the pipeline ran (its message broke the protos' rules, or
        nested too deep): it gets its record (audit, metrics) all the same."""
        err = domain_error(exc)
        if err is not None:
            self._pipeline.refused(CompletionRequest.unread(rid, operation, client_rid), err)

    def unparsed(self, method: str, context, exc: LlmeshError) -> None:
        """A call whose request bytes were not its method's message (told by the server's
        interceptor, which answers it): Chat and Complete get their record."""
        operation = _OPERATIONS.get(method.rsplit("/", 1)[-1])
        if operation is not None:
            rid, client_rid = request_ids(context)
            context.set_trailing_metadata(((REQUEST_ID_KEY, rid),))
            self._refused(rid, operation, client_rid, exc)

    def Chat(self, request, context) -> AsyncIterator[gateway_pb2.ChatResponse]:
        rid, timeout, client_rid = self._call(context)
        try:
            req, n = chat_request(request, rid, timeout, credential(context), client_request_id=client_rid)
        except (LlmeshError, RecursionError) as exc:
            self._refused(rid, "chat", client_rid, exc)
            raise
        chat_id = "chatcmpl-" + rid

        def message(index: int, item: Delta | Finish) -> gateway_pb2.ChatResponse:
            if isinstance(item, Delta):
                if not (item.logprobs or item.tool_calls):  # a token's message: a third of the cost
                    return gateway_pb2.ChatResponse(id=chat_id, index=index, text=item.text)
                return gateway_pb2.ChatResponse(id=chat_id, index=index, text=item.text,
                                                logprobs=logprobs_to_pb(item.logprobs),
                                                tool_calls=tool_calls_to_pb(item.tool_calls))
            return gateway_pb2.ChatResponse(id=chat_id, index=index, finish_reason=finish_to_pb(item.reason),
                                            usage=usage_to_pb(item.usage))

        return self._stream(req, n, context, message, role="assistant")

    def Complete(self, request, context) -> AsyncIterator[gateway_pb2.CompleteResponse]:
        rid, timeout, client_rid = self._call(context)
        try:
            req, n = complete_request(request, rid, timeout, credential(context), client_request_id=client_rid)
        except (LlmeshError, RecursionError) as exc:
            self._refused(rid, "text_completion", client_rid, exc)
            raise
        cmpl_id = "cmpl-" + rid

        def message(index: int, item: Delta | Finish) -> gateway_pb2.CompleteResponse:
            if isinstance(item, Delta):
                if not item.logprobs:
                    return gateway_pb2.CompleteResponse(id=cmpl_id, index=index, text=item.text)
                return gateway_pb2.CompleteResponse(id=cmpl_id, index=index, text=item.text,
                                                    logprobs=logprobs_to_pb(item.logprobs))
            return gateway_pb2.CompleteResponse(id=cmpl_id, index=index, finish_reason=finish_to_pb(item.reason),
                                                usage=usage_to_pb(item.usage))

        return self._stream(req, n, context, message)

    async def _stream(self, req: CompletionRequest, n: int, context, message, role: str = "") -> AsyncIterator:
        """Runs the request's choices; each choice's first message carries the model (and
        ``role``). Response headers of the HTTP front travel as metadata: the stages'
        (rate-limit facts, cache hit) in the initial metadata, all of them again in the
        trailers, once failover and fallback are known. One choice is read straight from
        its pipeline run: every generator a token passes through costs CPU per token."""
        shared: dict | None = {} if n > 1 else None  # the choices' common work (the guards')
        ctxs = [Context.of(r, shared) for r in choice_requests(req, n)]
        started: set[int] = set()
        runs = [self._pipeline.run(c.req, c) for c in ctxs]
        # n > 1: (index, item) pairs from merge; one choice: its run's items
        stream: AsyncGenerator[Any, None] = merge(runs) if n > 1 else runs[0]
        index: int
        item: Delta | Finish
        async with aclosing(stream) as items:
            async for entry in items:
                index, item = entry if n > 1 else (0, entry)
                if isinstance(item, Delta) and not (item.text or item.logprobs or item.tool_calls):
                    continue
                msg = message(index, item)
                if index not in started:
                    started.add(index)
                    msg.model = req.model
                    if role:
                        msg.role = role  # a choice's first message also says who speaks
                    if not started - {index} and ctxs[0].headers:  # the call's first message
                        await context.send_initial_metadata(tuple(ctxs[0].headers.items()))
                yield msg
        context.set_trailing_metadata(((REQUEST_ID_KEY, req.request_id), *ctxs[0].headers.items()))

    async def Embed(self, request, context) -> gateway_pb2.GatewayEmbedResponse:
        rid, timeout, client_rid = self._call(context)
        try:
            req = embed_request(request, rid, timeout, credential(context), client_request_id=client_rid)
        except (LlmeshError, RecursionError) as exc:
            self._refused(rid, "embeddings", client_rid, exc)
            raise
        ctx = Context.of(req)
        async with aclosing(self._pipeline.run(req, ctx)) as items:
            async for item in items:
                if isinstance(item, Vectors):
                    context.set_trailing_metadata(((REQUEST_ID_KEY, rid), *ctx.headers.items()))
                    return gateway_pb2.GatewayEmbedResponse(
                        embeddings=[common_pb2.Embedding(values=np.frombuffer(v, dtype="<f4").tolist())
                                    for v in item.vectors],
                        model=request.model, usage=usage_to_pb(item.usage))
        raise Internal("The upstream answered an embeddings request without vectors.")

    async def ListModels(self, request, context):
        models = await self._model_names(credential(context))
        return gateway_pb2.GatewayListModelsResponse(
            models=[m.name for m in models],
            details=[gateway_pb2.GatewayModel(name=m.name, owned_by=m.owned_by, serves=[_API[s] for s in m.serves])
                     for m in models])
