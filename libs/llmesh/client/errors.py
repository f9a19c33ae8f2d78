"""Typed errors: one exception class per gRPC status code the gateway returns.

Every error carries the status ``code``, the server's ``message`` and, where the
gateway sent them in trailing metadata, a machine-readable ``reason`` (OpenAI's
``code`` field, e.g. ``model_not_found``), the offending request field ``param``
and the request id.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc

REASON_KEY = "llmesh-error-reason"
PARAM_KEY = "llmesh-error-param"
REQUEST_ID_KEY = "x-request-id"


class GatewayError(Exception):
    """Base of every error the client raises for a failed call."""

    def __init__(self, code: grpc.StatusCode, message: str, metadata: dict[str, str] | None = None):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.metadata = metadata or {}
        self.reason = self.metadata.get(REASON_KEY)
        self.param = self.metadata.get(PARAM_KEY)
        self.request_id = self.metadata.get(REQUEST_ID_KEY)


class InvalidArgumentError(GatewayError): ...
class NotFoundError(GatewayError): ...
class UnauthenticatedError(GatewayError): ...
class PermissionDeniedError(GatewayError): ...
class ResourceExhaustedError(GatewayError): ...  # rate limit, budget or a full queue
class UnavailableError(GatewayError): ...
class DeadlineExceededError(GatewayError): ...
class CancelledError(GatewayError): ...
class FailedPreconditionError(GatewayError): ...
class InternalError(GatewayError): ...


_BY_CODE: dict[grpc.StatusCode, type[GatewayError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.INTERNAL: InternalError,
}


def from_rpc_error(exc: grpc.RpcError) -> GatewayError:
    """The typed error for a failed call (sync ``grpc.RpcError`` or ``grpc.aio.AioRpcError``)."""
    code = exc.code()
    # (key, value) pairs at runtime: namedtuples (grpc) or tuples (grpc.aio), whatever the stub says.
    trailing: Iterable[tuple[str, str | bytes]] = exc.trailing_metadata() or ()  # type: ignore[assignment]
    metadata = {key: value for key, value in trailing if isinstance(value, str)}
    return _BY_CODE.get(code, GatewayError)(code, exc.details() or "", metadata)
