"""Model manager composition root: registry (SQLAlchemy, migrated by Alembic),
artifact store, importer, rollout over the mesh, gRPC servicer."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge

from llmesh.discovery.base import fixed
from llmesh.errors import FailedPrecondition
from llmesh.liveconfig.stores import ConfigStore, EtcdStore, FileStore
from llmesh.modelstore import ModelStore
from llmesh.platform import Platform
from llmesh.rpc.server import GrpcServer, ServiceBinding
from llmesh.settings import MeshSettings
from llmesh.v1 import modelmgr_pb2_grpc
from llmesh.modelmgr.artifacts import ArtifactStore
from llmesh.modelmgr.clients import ConfigSplits, GrpcMesh
from llmesh.modelmgr.config import ModelMgrSettings
from llmesh.modelmgr.db import make_engine, upgrade
from llmesh.modelmgr.distribution import ArtifactServer
from llmesh.modelmgr.evaluation import load_golden
from llmesh.modelmgr.hfdir import DirLimits
from llmesh.modelmgr.importer import Importer
from llmesh.modelmgr.registry import Registry
from llmesh.modelmgr.rollout import Rollout, RolloutPolicy
from llmesh.modelmgr.servicer import ModelManagerServicer

if TYPE_CHECKING:
    import aetcd


class NoSplits:
    """No live config backend (LLMESH_CONFIG_BACKEND=none): aliases cannot move."""

    async def set_split(self, alias: str, weights: dict[str, float]) -> int:
        raise FailedPrecondition("this mesh has no live config backend (LLMESH_CONFIG_BACKEND=none); "
                                 "aliases live in its traffic splits")

    async def targets(self) -> set[str]:
        return set()


def config_store(mesh: MeshSettings) -> tuple[ConfigStore | None, aetcd.Client | None]:
    if mesh.config_backend == "file":
        return FileStore(mesh.config_file), None
    if mesh.config_backend == "etcd":
        from llmesh.discovery.etcd import etcd_client
        client = etcd_client(mesh.etcd_address)
        return EtcdStore(client, mesh.etcd_address, mesh.config_prefix), client
    return None, None


class ModelMgrApp:
    def __init__(self, settings: ModelMgrSettings, platform: Platform | None = None):
        self.settings = settings
        self.store = ModelStore(settings.model_dir)
        self.db = make_engine(settings.database_url)
        self.registry = Registry(self.db)
        self.artifacts = ArtifactStore(settings.store_dir, settings.model_dir)
        self.importer = Importer(self.registry, self.artifacts, DirLimits(
            settings.import_max_files, settings.import_max_bytes, settings.import_max_depth))
        resolve = platform.resolver("scheduler", settings.scheduler_address) if platform \
            else fixed(settings.scheduler_address)
        self.mesh = GrpcMesh(resolve, load_timeout_s=settings.load_timeout_s,
                             identity=platform.identity if platform else None)
        store, self._etcd = config_store(platform.settings if platform else MeshSettings(config_backend="none"))
        self.rollout = Rollout(
            self.registry, self.artifacts, self.mesh, ConfigSplits(store) if store else NoSplits(),
            lambda: load_golden(settings.golden_set),
            RolloutPolicy(warmup_generations=settings.warmup_generations, memory_budget=settings.memory_budget,
                          memory_overhead=settings.memory_overhead, settle_s=settings.settle_s,
                          drain_timeout_s=settings.drain_timeout_s, eval_threshold=settings.eval_threshold,
                          eval_min_exact_match=settings.eval_min_exact_match,
                          eval_max_tokens=settings.eval_max_tokens,
                          vllm_gpus_per_replica=settings.vllm_gpus_per_replica))
        self.metrics = platform.metrics if platform else CollectorRegistry()
        self._models = Gauge("llmesh_models", "Models in the store by format.", ("format",), registry=self.metrics)
        sent = Counter("llmesh_modelmgr_artifact_sent_bytes", "Artifact bytes streamed to engines (FetchArtifact).",
                       registry=self.metrics)
        for_engines = ArtifactServer(settings.model_dir, self.artifacts.blob_path, settings.fetch_max_streams,
                                     on_sent=sent.inc)
        self.server = GrpcServer(settings.address, [ServiceBinding(
            "llmesh.v1.ModelManager",
            ModelManagerServicer(self.store, self.registry, self.importer, self.rollout, for_engines),
            modelmgr_pb2_grpc.add_ModelManagerServicer_to_server)],
            tracer=platform.tracing.tracer if platform else None,
            identity=platform.identity if platform else None, bind_wait_s=settings.bind_wait_s,
            serving=platform.serving if platform else None)

    @property
    def advertise_address(self) -> str:
        return self.server.bound_address

    @property
    def health_service(self) -> str:
        return "llmesh.v1.ModelManager"

    async def start(self) -> None:
        await asyncio.to_thread(upgrade, self.db)  # the schema is current before we say SERVING
        records = await asyncio.to_thread(self.store.list)  # checksums computed before we say SERVING
        for fmt in {r.format for r in records}:
            self._models.labels(fmt).set(sum(r.format == fmt for r in records))
        await self.server.start()

    async def stop(self, grace: float) -> None:
        await self.server.stop(grace)
        await self.mesh.close()
        if self._etcd is not None:
            await self._etcd.close()
        self.db.dispose()
