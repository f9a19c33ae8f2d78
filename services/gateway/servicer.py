"""Gateway gRPC servicer: protobuf <-> the same pipeline the HTTP front uses."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from contextlib import aclosing

from llmesh.convert import finish_to_pb, logprobs_to_pb, messages_from_pb, sampling_from_pb, usage_to_pb
from llmesh.logs import request_id_var
from llmesh.rpc.interceptor import REQUEST_ID_KEY
from llmesh.types import Delta, Prompt
from llmesh.v1 import gateway_pb2, gateway_pb2_grpc

from llmesh.gateway.pipeline import FAILOVER_HEADER, CompletionRequest, Context, Pipeline


def credential(context) -> str | None:
    """The caller's API key or JWT, from the ``authorization`` metadata ("Bearer X" or X)."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            scheme, _, token = value.partition(" ")
            return (token if scheme.lower() == "bearer" else value).strip() or None
    return None


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, pipeline: Pipeline, model_names: Callable[[str | None], Awaitable[list[str]]],
                 default_timeout_s: float):
        self._pipeline = pipeline
        self._model_names = model_names
        self._default_timeout = default_timeout_s

    async def Chat(self, request, context):
        rid = request_id_var.get() or uuid.uuid4().hex  # the interceptor read x-request-id
        context.set_trailing_metadata(((REQUEST_ID_KEY, rid),))
        remaining = context.time_remaining()
        timeout = self._default_timeout if remaining is None else min(remaining, self._default_timeout)
        req = CompletionRequest(request_id=rid, tenant="", model=request.model,
                                prompt=Prompt(messages=messages_from_pb(request.messages)),
                                sampling=sampling_from_pb(request.sampling), timeout_s=timeout,
                                credential=credential(context))
        chat_id = "chatcmpl-" + rid
        first = True
        ctx = Context.of(req)
        async with aclosing(self._pipeline.run(req, ctx)) as items:
            async for item in items:
                if isinstance(item, Delta):
                    if not item.text and not item.logprobs:
                        continue
                    msg = gateway_pb2.ChatResponse(id=chat_id, text=item.text, logprobs=logprobs_to_pb(item.logprobs))
                else:
                    msg = gateway_pb2.ChatResponse(id=chat_id, finish_reason=finish_to_pb(item.reason),
                                                   usage=usage_to_pb(item.usage))
                if first:  # the first message also says who speaks: one write less before the first token
                    msg.role, msg.model, first = "assistant", request.model, False
                    if ctx.headers:  # rate-limit facts, as the HTTP front's headers
                        await context.send_initial_metadata(tuple(ctx.headers.items()))
                yield msg
        if FAILOVER_HEADER in ctx.headers:  # the answer moved engines mid-stream: say so in the trailer
            context.set_trailing_metadata(((REQUEST_ID_KEY, rid), (FAILOVER_HEADER, ctx.headers[FAILOVER_HEADER])))

    async def ListModels(self, request, context):
        return gateway_pb2.GatewayListModelsResponse(models=await self._model_names(credential(context)))
