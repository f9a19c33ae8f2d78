"""A typed Python client for the llmesh gateway's gRPC API (docs/client.md).

    from llmesh.client import Client
    with Client("127.0.0.1:50051", credential="llm_...") as client:
        for chunk in client.stream(model="smollm2-135m-instruct",
                                   messages=[{"role": "user", "content": "Hi"}], max_tokens=30):
            print(chunk.text, end="")
"""

from llmesh.client.aio import AsyncClient, AsyncStream
from llmesh.client.core import Choice, Result, RetryPolicy
from llmesh.client.errors import (CancelledError, DeadlineExceededError, FailedPreconditionError, GatewayError,
                                  InternalError, InvalidArgumentError, NotFoundError, PermissionDeniedError,
                                  ResourceExhaustedError, UnauthenticatedError, UnavailableError)
from llmesh.client.sync import Client, Stream

__all__ = ["AsyncClient", "AsyncStream", "CancelledError", "Choice", "Client",
           "DeadlineExceededError", "FailedPreconditionError", "GatewayError", "InternalError",
           "InvalidArgumentError", "NotFoundError", "PermissionDeniedError", "ResourceExhaustedError",
           "Result", "RetryPolicy", "Stream", "UnauthenticatedError", "UnavailableError"]
