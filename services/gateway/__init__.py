"""gateway: the front door. OpenAI-compatible HTTP and a gRPC API over one pipeline."""
