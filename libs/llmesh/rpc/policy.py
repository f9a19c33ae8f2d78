"""Who may call what inside the mesh: one table, every method of every internal service
to the caller services it allows (by need: each entry names the services whose code
calls the method; ``llmesh`` CLI commands are the ``cli`` service).

Health and reflection stay open (probes, grpcurl). The gateway's own API (Chat,
Complete, ListModels) is for applications: it is not internal, and the gateway's
API-key/JWT authentication guards it, not this table. A method that is in neither
is refused to every caller (tests/unit/test_rpc_policy.py walks the protos so that
none is forgotten)."""

from __future__ import annotations

from collections.abc import Mapping

GATEWAY, ENGINE, SCHEDULER, MODELMGR, CACHE, CLI = "gateway", "engine", "scheduler", "modelmgr", "cache", "cli"

# The mesh service (the certificate's <service>.llmesh.internal) that serves each proto service.
SERVES: Mapping[str, str] = {
    "llmesh.v1.Engine": ENGINE, "llmesh.v1.Scheduler": SCHEDULER, "llmesh.v1.ModelManager": MODELMGR,
    "llmesh.v1.Cache": CACHE, "llmesh.v1.Gateway": GATEWAY,
}

OPEN_SERVICES = frozenset({"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                           "grpc.reflection.v1.ServerReflection"})

# The client-facing API: applications call it with API keys or JWTs (the gateway's auth stage).
PUBLIC_METHODS = frozenset({f"/llmesh.v1.Gateway/{method}" for method in (
    "Chat", "Complete", "ListModels", "Embed",
    # the Batch API: a tenant's own files and batches
    "CreateFile", "GetFile", "ListFiles", "GetFileContent", "DeleteFile",
    "CreateBatch", "GetBatch", "ListBatches", "CancelBatch")})


def _service(name: str, methods: Mapping[str, frozenset[str]]) -> dict[str, frozenset[str]]:
    return {f"/llmesh.v1.{name}/{method}": callers for method, callers in methods.items()}


def _only(*services: str) -> frozenset[str]:
    return frozenset(services)


ALLOWED: Mapping[str, frozenset[str]] = {
    **_service("Engine", {
        "Generate": _only(GATEWAY, MODELMGR),  # the request path; the rollout's warm-up and evaluation
        "Embed": _only(GATEWAY),  # the embeddings request path
        "Tokenize": _only(GATEWAY, CLI),
        "GetStatus": _only(MODELMGR, CLI),  # a rollout's drain waits on in-flight work
        "LoadModel": _only(MODELMGR),
        "UnloadModel": _only(MODELMGR),
        "ListLoadedModels": _only(MODELMGR, CLI),
    }),
    **_service("Scheduler", {
        "Report": _only(ENGINE),
        "WatchEndpoints": _only(GATEWAY),
        "ListEndpoints": _only(GATEWAY, MODELMGR, CLI),  # modelmgr places replicas; `llmesh status`
        "Place": _only(MODELMGR),
        "ReportDemand": _only(GATEWAY),
        "GetScale": _only(CLI),  # `llmesh up`'s launcher (scale to zero and back)
    }),
    **_service("Cache", {
        "Lookup": _only(GATEWAY),
        "Store": _only(GATEWAY),
        "Invalidate": _only(CLI),
        "Stats": _only(CLI),
    }),
    **_service("ModelManager", {
        "ListModels": _only(GATEWAY, CLI),  # the gateway's model catalogue
        "GetModel": _only(CLI),
        "ImportModel": _only(CLI),
        "ListVersions": _only(CLI),
        "GetVersion": _only(CLI),
        "QuantizeVersion": _only(CLI),
        "Deploy": _only(CLI),
        "Promote": _only(CLI),
        "Rollback": _only(CLI),
        "ArchiveVersion": _only(CLI),
        "ListAliases": _only(CLI),
        "History": _only(CLI),
        "Evaluate": _only(CLI),
        "ListEvals": _only(CLI),
        # engines fetch a deployed model's files (no filesystem shared with the model manager)
        "GetArtifactManifest": _only(ENGINE),
        "FetchArtifact": _only(ENGINE),
    }),
}


def proto_service(method: str) -> str:
    """``/llmesh.v1.Engine/Generate`` -> ``llmesh.v1.Engine``."""
    return method[1:].split("/", 1)[0] if method.startswith("/") else ""


def audience(method: str) -> str | None:
    """The mesh service a method's calls go to (a token's audience), None for a foreign one."""
    return SERVES.get(proto_service(method))


def is_open(method: str) -> bool:
    """Needs no mesh identity: health, reflection, and the gateway's client-facing API."""
    return method in PUBLIC_METHODS or proto_service(method) in OPEN_SERVICES


def allowed_callers(method: str) -> frozenset[str]:
    """The services that may call ``method``; empty (nobody) for a method not in the table."""
    return ALLOWED.get(method, frozenset())
