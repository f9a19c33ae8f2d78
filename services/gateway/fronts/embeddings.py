"""OpenAI's embeddings on the wire (POST /v1/embeddings): the request body into an
embeddings request, the vectors into OpenAI's response. ``encoding_format`` "float"
answers JSON numbers (float32 values, as computed), "base64" each vector's little-endian
float32 bytes in base64, as the openai client decodes them (it asks for base64 unless
told otherwise). Token-id inputs (lists of integers) are refused with a 400 naming
``input``: engines here embed text."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Literal

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict

from llmesh.errors import InvalidArgument
from llmesh.types import Prompt, Sampling
from llmesh.gateway.context import CompletionRequest, Vectors
from llmesh.gateway.fronts.openai_api import parse

_TOKEN_IDS = ("The input must be a string or a list of strings; token-id arrays are not supported by this gateway "
              "(send the text).")


class EmbeddingsBody(BaseModel):
    model_config = ConfigDict(extra="allow")  # an unknown field is refused, naming it (``values``)

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


@dataclass(frozen=True, slots=True)
class EmbeddingsCall:
    """A parsed embeddings body: what the request needs and how to answer."""
    model: str
    inputs: tuple[str, ...]
    encoding_format: str
    dimensions: int | None
    user: str | None


def read_embeddings(body_cls: type[EmbeddingsBody], raw: bytes | bytearray) -> EmbeddingsCall:
    """The body's values; 400 for bad JSON, a wrong type, token ids or an unknown field. Plain
    values in and out: a large body is read in a worker process (``BodyReader.parse``)."""
    body = parse(body_cls, raw)
    for name in body.model_extra or ():
        raise InvalidArgument(f"The parameter '{name}' is not supported by this gateway.", param=name)
    value = body.input
    if isinstance(value, str):
        inputs: tuple[str, ...] = (value,)
    elif all(isinstance(v, str) for v in value):
        inputs = tuple(value)  # type: ignore[arg-type]  # every item is a str
    else:  # an empty list is a list of strings: the rules refuse it (input: at least 1 item)
        raise InvalidArgument(_TOKEN_IDS, param="input")
    return EmbeddingsCall(body.model, inputs, body.encoding_format, body.dimensions, body.user)


def embeddings_request(call: EmbeddingsCall, request_id: str, timeout_s: float, **fields: object
                       ) -> CompletionRequest:
    """The pipeline's request for ``call`` (``fields``: the front's own, credential and headers)."""
    return CompletionRequest(request_id=request_id, tenant="", model=call.model, prompt=Prompt(), sampling=Sampling(),
                             timeout_s=timeout_s, user=call.user, operation="embeddings", inputs=call.inputs,
                             dimensions=call.dimensions, stream=False, **fields)  # type: ignore[arg-type]


def embeddings_json(vectors: Vectors, model: str, encoding_format: str) -> bytes:
    """OpenAI's response body, encoded (float32 arrays serialized by orjson as they are)."""
    if encoding_format == "base64":
        data = [{"object": "embedding", "index": i, "embedding": base64.b64encode(v).decode()}
                for i, v in enumerate(vectors.vectors)]
    else:
        data = [{"object": "embedding", "index": i, "embedding": np.frombuffer(v, dtype="<f4")}
                for i, v in enumerate(vectors.vectors)]
    tokens = vectors.usage.prompt_tokens
    return orjson.dumps({"object": "list", "data": data, "model": model,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}},
                        option=orjson.OPT_SERIALIZE_NUMPY)
