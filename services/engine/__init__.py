"""engine: wraps one inference backend and streams tokens over gRPC."""
