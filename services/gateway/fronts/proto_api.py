"""The Gateway's protobuf requests -> domain requests (the gRPC front's counterpart of
openai_api's JSON bodies). Rules on values are the protos' own (llmesh.validation)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from llmesh.convert import messages_from_pb, sampling_from_pb, tools_from_pb
from llmesh.types import Prompt, Sampling
from llmesh.v1 import gateway_pb2
from llmesh.validation import check_message

from llmesh.gateway.context import CompletionRequest

TEXT_MAX_TOKENS = 16  # a text completion's default length, as on OpenAI's (and our HTTP) API


def chat_request(pb: gateway_pb2.ChatRequest, request_id: str, timeout_s: float, credential: str | None,
                 trace_headers: Mapping[str, str] | None = None, client_request_id: str | None = None
                 ) -> tuple[CompletionRequest, int]:
    """(the request, how many choices); INVALID_ARGUMENT naming the field on a broken rule."""
    check_message(pb)
    req = CompletionRequest(request_id=request_id, tenant="", model=pb.model,
                            prompt=Prompt(messages=messages_from_pb(pb.messages)),
                            sampling=sampling_from_pb(pb.sampling),
                            timeout_s=timeout_s, user=pb.user or None, credential=credential,
                            trace_headers=trace_headers, tools=tools_from_pb(pb), checked=True,
                            client_request_id=client_request_id)
    return req, pb.n if pb.HasField("n") else 1


def complete_request(pb: gateway_pb2.CompleteRequest, request_id: str, timeout_s: float, credential: str | None,
                     trace_headers: Mapping[str, str] | None = None, client_request_id: str | None = None
                     ) -> tuple[CompletionRequest, int]:
    check_message(pb)
    sampling = sampling_from_pb(pb.sampling)
    if sampling.max_tokens is None:
        sampling = replace(sampling, max_tokens=TEXT_MAX_TOKENS)
    req = CompletionRequest(request_id=request_id, tenant="", model=pb.model, prompt=Prompt(text=pb.prompt),
                            sampling=sampling, timeout_s=timeout_s, user=pb.user or None, credential=credential,
                            trace_headers=trace_headers, operation="text_completion", checked=True,
                            client_request_id=client_request_id)
    return req, pb.n if pb.HasField("n") else 1


def embed_request(pb: gateway_pb2.GatewayEmbedRequest, request_id: str, timeout_s: float,
                  credential: str | None,
                  client_request_id: str | None = None) -> CompletionRequest:
    check_message(pb)
    return CompletionRequest(request_id=request_id, tenant="", model=pb.model, prompt=Prompt(), sampling=Sampling(),
                             timeout_s=timeout_s, user=pb.user or None, credential=credential,
                             operation="embeddings", checked=True, client_request_id=client_request_id,
                             inputs=tuple(pb.inputs), dimensions=pb.dimensions if pb.HasField("dimensions") else None,
                             stream=False)
