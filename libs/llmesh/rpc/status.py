"""The one mapping between domain errors and gRPC status codes, both ways."""

from __future__ import annotations

import grpc
from google.protobuf.any_pb2 import Any
from google.protobuf.duration_pb2 import Duration
from google.rpc import error_details_pb2, status_pb2

from llmesh.errors import ErrorCode, LlmeshError, error_for

_TO_GRPC = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorCode.CANCELLED: grpc.StatusCode.CANCELLED,
    ErrorCode.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorCode.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorCode.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
}
_FROM_GRPC = {v: k for k, v in _TO_GRPC.items()}

REASON_KEY = "llmesh-error-reason"
PARAM_KEY = "llmesh-error-param"
RETRY_MS_KEY = "retry-after-ms"  # an error's hint for when to come back (429s)
DETAILS_KEY = "grpc-status-details-bin"  # google.rpc.Status, as gRPC's rich error model carries it


def grpc_code(err: LlmeshError) -> grpc.StatusCode:
    return _TO_GRPC[err.code]


def trailing_metadata(err: LlmeshError) -> tuple[tuple[str, str | bytes], ...]:
    md: list[tuple[str, str | bytes]] = []
    if err.reason:
        md.append((REASON_KEY, err.reason))
    if err.param:
        md.append((PARAM_KEY, err.param))
    md.extend(err.headers.items())
    if RETRY_MS_KEY in err.headers:
        md.append((DETAILS_KEY, _retry_details(err, int(err.headers[RETRY_MS_KEY]))))
    return tuple(md)


def _retry_details(err: LlmeshError, retry_ms: int) -> bytes:
    """The retry hint as google.rpc.RetryInfo, which gRPC clients that know the rich
    error model read without knowing our metadata keys."""
    delay = Duration(seconds=retry_ms // 1000, nanos=retry_ms % 1000 * 1_000_000)
    detail = Any()
    detail.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    status: bytes = status_pb2.Status(code=grpc_code(err).value[0], message=err.message,
                                      details=[detail]).SerializeToString()
    return status


def from_rpc_error(exc: grpc.aio.AioRpcError) -> LlmeshError:
    """Turn an upstream call's failure back into the domain error it carried."""
    code = _FROM_GRPC.get(exc.code(), ErrorCode.INTERNAL)
    md = dict(exc.trailing_metadata() or ())
    return error_for(code, exc.details() or exc.code().name, reason=md.get(REASON_KEY), param=md.get(PARAM_KEY))
