"""llmesh: a mesh of gRPC services that serves self-hosted LLMs.

This package holds the code every service shares; each service lives in
``llmesh.<service>`` (source under ``services/<service>/``).
"""
