"""The ``llmesh`` command."""
