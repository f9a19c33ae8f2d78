"""The gateway's two front doors over one pipeline: OpenAI-compatible HTTP
(``http``, ``openai_api``) and gRPC (``servicer``, ``proto_api``), and what they share
(``choices``: n > 1 as side-by-side runs)."""
