"""The per-method allow-list covers every method of every proto service."""

from llmesh.rpc import policy
from llmesh.v1 import cache_pb2, engine_pb2, gateway_pb2, modelmgr_pb2, scheduler_pb2

MODULES = (cache_pb2, engine_pb2, gateway_pb2, modelmgr_pb2, scheduler_pb2)
SERVICES = {"gateway", "engine", "scheduler", "modelmgr", "cache", "cli"}


def _methods():
    for module in MODULES:
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                yield f"/{service.full_name}/{method.name}", service.full_name


def test_every_method_has_an_entry_or_is_the_public_api():
    missing = [m for m, _ in _methods() if m not in policy.ALLOWED and m not in policy.PUBLIC_METHODS]
    assert missing == []
    assert set(policy.ALLOWED) | set(policy.PUBLIC_METHODS) == {m for m, _ in _methods()}  # no stale entries


def test_every_proto_service_has_its_mesh_service_and_every_entry_names_callers():
    assert {s for _, s in _methods()} == set(policy.SERVES)
    for method, callers in policy.ALLOWED.items():
        assert callers and callers <= SERVICES, method


def test_internal_methods_are_not_open_and_probes_are():
    assert not any(policy.is_open(m) for m in policy.ALLOWED)
    assert policy.is_open("/grpc.health.v1.Health/Check")
    assert policy.is_open("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
    assert policy.allowed_callers("/llmesh.v1.Engine/Nope") == frozenset()


def test_the_data_plane_is_scoped():
    assert policy.allowed_callers("/llmesh.v1.Cache/Lookup") == {"gateway"}
    assert policy.allowed_callers("/llmesh.v1.Cache/Store") == {"gateway"}
    assert policy.allowed_callers("/llmesh.v1.Scheduler/Report") == {"engine"}
    assert "engine" not in policy.allowed_callers("/llmesh.v1.ModelManager/Promote")
    assert "engine" not in policy.allowed_callers("/llmesh.v1.Engine/LoadModel")
    assert policy.allowed_callers("/llmesh.v1.Scheduler/WatchEndpoints") == {"gateway"}
