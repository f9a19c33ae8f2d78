"""What the upstream clients share about gRPC."""

from __future__ import annotations

import grpc


def why(exc: Exception) -> str:
    """A failed call's status code name, or the error's text (discovery)."""
    return exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
