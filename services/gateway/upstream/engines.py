"""The engines' gRPC client (Engine.Generate, server streaming): one channel per
engine address, the client's deadline and trace context on every call."""

from __future__ import annotations

import grpc
import numpy as np
from opentelemetry.trace import NoOpTracer, Span, SpanKind, Status, StatusCode, Tracer

from llmesh.convert import (finish_from_pb, logprobs_from_pb, priority_to_pb, prompt_fields, sampling_to_pb,
                            tool_calls_from_pb, tools_to_pb, usage_from_pb)
from llmesh.errors import EngineLost, Unavailable
from llmesh.rpc.channels import mesh_channel
from llmesh.rpc.identity import Identity
from llmesh.rpc.interceptor import REQUEST_ID_KEY
from llmesh.rpc.status import REASON_KEY, from_rpc_error
from llmesh.telemetry import child_context, inject
from llmesh.types import Delta, Finish, FinishReason, Usage
from llmesh.v1 import engine_pb2, engine_pb2_grpc
from llmesh.gateway.context import CompletionRequest, Items, Vectors


# What grpc-core says when a connection that carried the call reset or closed under it: the engine's
# process was gone mid-call. "Stream removed (Socket closed)" or "(recvmsg:Connection reset by peer)" on
# a direct connection; Envoy's "reset reason: connection termination" behind a proxy. Not a death:
# "failed to connect to all addresses" (refused before the call reached an engine: it was gone
# already) or "sendmsg: Broken pipe" (our send found the connection dead: the call never arrived).
_LOST_SIGNS = ("Stream removed", "reset reason: connection termination")


def lost(exc: grpc.aio.AioRpcError) -> bool:
    """The engine went away under this call (see ``_LOST_SIGNS``), as opposed to a refusal
    it sent (those carry a reason) or an engine that was gone before the call."""
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    details = exc.details() or ""
    if "sendmsg" in details or not any(sign in details for sign in _LOST_SIGNS):
        return False
    return not any(key == REASON_KEY for key, _ in exc.trailing_metadata() or ())


class EngineClients:
    """One channel per engine address, opened on first use."""

    def __init__(self, tracer: Tracer | None = None, identity: Identity | None = None) -> None:
        self._tracer = tracer or NoOpTracer()
        self._identity = identity
        self._stubs: dict[str, tuple[grpc.aio.Channel, engine_pb2_grpc.EngineStub]] = {}

    def _entry(self, address: str) -> tuple[grpc.aio.Channel, engine_pb2_grpc.EngineStub]:
        entry = self._stubs.get(address)
        if entry is None:
            channel = mesh_channel(address, "engine", self._identity)
            entry = self._stubs[address] = (channel, engine_pb2_grpc.EngineStub(channel))
        return entry

    def _stub(self, address: str) -> engine_pb2_grpc.EngineStub:
        return self._entry(address)[1]

    def connected(self, address: str) -> bool:
        """Whether the channel to the engine at ``address`` is connected now; an idle or failed
        one is asked to connect. A channel whose engine died tries again after its reconnect
        backoff (at most 2 s, ``rpc.channels``): a call before that fails at once, unsent."""
        channel = self._entry(address)[0]
        return channel.get_state(try_to_connect=True) is grpc.ChannelConnectivity.READY

    async def generate(self, address: str, req: CompletionRequest, timeout_s: float, parent: Span
                       ) -> Items:
        request = engine_pb2.GenerateRequest(
            request_id=req.request_id, model=req.model, sampling=sampling_to_pb(req.sampling),
            priority=priority_to_pb(req.priority), continuation=req.continuation, whole=not req.stream,
            **prompt_fields(req.prompt, engine_pb2.ChatInput), **(tools_to_pb(req.tools) if req.tools else {}))
        span = self._tracer.start_span("llmesh.v1.Engine/Generate", context=child_context(parent),
                                       kind=SpanKind.CLIENT, attributes={"server.address": address})
        call = self._stub(address).Generate(request, timeout=timeout_s,
                                            metadata=((REQUEST_ID_KEY, req.request_id), *inject(span)))
        try:
            async for resp in call:
                if resp.text or resp.token_count or resp.logprobs or resp.tool_calls:  # the last may carry text (whole)
                    yield Delta(text=resp.text, tokens=resp.token_count,
                                logprobs=logprobs_from_pb(resp.logprobs) if resp.logprobs else (),
                                tool_calls=tool_calls_from_pb(resp.tool_calls) if resp.tool_calls else ())
                if resp.finish_reason:
                    yield Finish(reason=finish_from_pb(resp.finish_reason), usage=usage_from_pb(resp.usage))
        except grpc.aio.AioRpcError as exc:
            span.set_status(Status(StatusCode.ERROR, exc.code().name))
            if exc.code() == grpc.StatusCode.CANCELLED:
                # Our own cancel arrives as asyncio.CancelledError; this one is the engine's (a server
                # stopping cancels what it still holds): the engine is going away, try another.
                raise Unavailable(f"The engine at {address} cancelled the call.", reason="engine_cancelled") from None
            if lost(exc):
                raise EngineLost(f"The engine at {address} went away during the call ({exc.details()}).") from None
            raise from_rpc_error(exc) from None
        finally:
            call.cancel()  # no-op once finished; frees the engine's slot if we stop early
            span.end()

    async def embed(self, address: str, req: CompletionRequest, timeout_s: float, parent: Span) -> Items:
        """Engine.Embed (unary): one ``Vectors`` item, each vector as little-endian float32 bytes."""
        request = engine_pb2.EmbedRequest(request_id=req.request_id, model=req.model, inputs=req.inputs,
                                          dimensions=req.dimensions, priority=priority_to_pb(req.priority))
        span = self._tracer.start_span("llmesh.v1.Engine/Embed", context=child_context(parent),
                                       kind=SpanKind.CLIENT, attributes={"server.address": address})
        try:
            resp = await self._stub(address).Embed(request, timeout=timeout_s,
                                                   metadata=((REQUEST_ID_KEY, req.request_id), *inject(span)))
        except grpc.aio.AioRpcError as exc:
            span.set_status(Status(StatusCode.ERROR, exc.code().name))
            if lost(exc):
                raise EngineLost(f"The engine at {address} went away during the call ({exc.details()}).") from None
            raise from_rpc_error(exc) from None
        finally:
            span.end()
        vectors = tuple(np.asarray(e.values, dtype="<f4").tobytes() for e in resp.embeddings)
        yield Vectors(FinishReason.STOP, Usage(prompt_tokens=resp.usage.prompt_tokens), vectors)

    async def close(self) -> None:
        for channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()
