"""Model manager gRPC servicer: protobuf <-> registry, importer and rollout."""

from __future__ import annotations

import asyncio
import json
import time

from llmesh.errors import InvalidArgument, ModelNotFound
from llmesh.modelmgr.distribution import ArtifactServer
from llmesh.modelmgr.importer import Importer
from llmesh.modelmgr.registry import Alias, EvalReport, Registry, Version
from llmesh.modelmgr.rollout import Rollout
from llmesh.modelstore import ModelRecord, ModelStore
from llmesh.v1 import common_pb2, modelmgr_pb2, modelmgr_pb2_grpc


def record_pb(r: ModelRecord) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(name=r.name, format=r.format, size_bytes=r.size_bytes, sha256=r.sha256,
                                context_length=r.context_length, path=str(r.path), source=r.source)


def _ts(at) -> float:
    return at.timestamp() if at is not None else 0.0


def version_pb(v: Version) -> modelmgr_pb2.ModelVersion:
    return modelmgr_pb2.ModelVersion(
        name=v.name, version=v.number, state=v.state, served_name=v.served_name, source=v.source,
        parent_version=v.parent_version or 0, lineage={k: str(x) for k, x in v.lineage.items()},
        context_length=v.context_length, tokenizer=v.tokenizer,
        eval_scores_json=json.dumps(v.eval_scores) if v.eval_scores else "", created_unix=_ts(v.created_at),
        artifacts=[modelmgr_pb2.Artifact(variant=a.variant, format=a.format, quantization=a.quantization,
                                         sha256=a.sha256, size_bytes=a.size_bytes, derived_from=a.derived_from)
                   for a in v.artifacts],
        replicas=[modelmgr_pb2.Replica(endpoint_id=r.endpoint_id, address=r.address, variant=r.variant,
                                       state=r.state, detail=r.detail, updated_unix=_ts(r.updated_at))
                  for r in v.replicas])


def alias_pb(a: Alias) -> modelmgr_pb2.AliasInfo:
    return modelmgr_pb2.AliasInfo(name=a.name, current=a.current, previous=a.previous,
                                  updated_unix=_ts(a.updated_at))


def eval_pb(e: EvalReport) -> modelmgr_pb2.EvalReport:
    return modelmgr_pb2.EvalReport(id=e.id, at_unix=_ts(e.at), candidate=e.candidate, baseline=e.baseline,
                                   passed=e.passed, exact_match=e.exact_match, similarity=e.similarity,
                                   threshold=e.threshold, report_json=json.dumps(e.report))


def _ref(name: str, version: int) -> str:
    if not name or version < 1:
        raise InvalidArgument("name a model and a version (>= 1)", param="version")
    return f"{name}:{version}"


class ModelManagerServicer(modelmgr_pb2_grpc.ModelManagerServicer):
    def __init__(self, store: ModelStore, registry: Registry, importer: Importer, rollout: Rollout,
                 artifacts: ArtifactServer):
        self._store = store
        self._registry = registry
        self._importer = importer
        self._rollout = rollout
        self._artifacts = artifacts

    async def ListModels(self, request, context):
        # Hashing a new artifact reads the whole file: keep it off the event loop.
        records = await asyncio.to_thread(self._store.list)
        return modelmgr_pb2.ListModelsResponse(models=[record_pb(r) for r in records])

    async def GetModel(self, request, context):
        record = await asyncio.to_thread(self._store.get, request.name)
        if record is None:
            raise ModelNotFound(request.name)
        return record_pb(record)

    async def ImportModel(self, request, context):
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()
        last = [0.0]

        def progress(done: int, total: int) -> None:  # runs in the import thread
            now = time.monotonic()
            if now - last[0] >= 0.2 or done == total:
                last[0] = now
                loop.call_soon_threadsafe(updates.put_nowait, (done, total))

        job = asyncio.ensure_future(asyncio.to_thread(
            self._importer.import_version, request.name, request.source, request.sha256,
            request.parent_version or None, dict(request.lineage), progress))
        while not job.done():
            getter = asyncio.ensure_future(updates.get())
            await asyncio.wait({job, getter}, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                done, total = getter.result()
                yield modelmgr_pb2.ImportProgress(bytes_done=done, bytes_total=total)
            else:
                getter.cancel()
        version = job.result()
        yield modelmgr_pb2.ImportProgress(bytes_done=version.artifacts[0].size_bytes,
                                          bytes_total=version.artifacts[0].size_bytes, version=version_pb(version))

    async def ListVersions(self, request, context):
        versions = await asyncio.to_thread(self._registry.list, request.name)
        return modelmgr_pb2.ListVersionsResponse(versions=[version_pb(v) for v in versions])

    async def GetVersion(self, request, context):
        _ref(request.name, request.version)
        return version_pb(await asyncio.to_thread(self._registry.get, request.name, request.version))

    async def QuantizeVersion(self, request, context):
        _ref(request.name, request.version)
        if not request.quantization:
            raise InvalidArgument("name the quantization (Q8_0, Q4_0, ...)", param="quantization")
        return version_pb(await asyncio.to_thread(self._importer.quantize, request.name, request.version,
                                                  request.quantization, request.from_variant))

    async def Deploy(self, request, context):
        v = await self._rollout.deploy(_ref(request.name, request.version), request.replicas or 1, request.variant)
        return version_pb(v)

    async def Promote(self, request, context):
        if not request.alias:
            raise InvalidArgument("name the alias to promote", param="alias")
        alias, report = await self._rollout.promote(
            request.alias, _ref(request.name, request.version), tuple(request.canary_percent),
            request.canary_step_s or 5.0, request.skip_eval,
            request.threshold if request.HasField("threshold") else None)
        return modelmgr_pb2.PromoteResponse(alias=alias_pb(alias), eval=eval_pb(report) if report else None)

    async def Rollback(self, request, context):
        if not request.alias:
            raise InvalidArgument("name the alias to roll back", param="alias")
        return alias_pb(await self._rollout.rollback(request.alias))

    async def ArchiveVersion(self, request, context):
        return version_pb(await self._rollout.archive(_ref(request.name, request.version)))

    async def ListAliases(self, request, context):
        aliases = await asyncio.to_thread(self._registry.aliases)
        return modelmgr_pb2.ListAliasesResponse(aliases=[alias_pb(a) for a in aliases])

    async def History(self, request, context):
        events = await asyncio.to_thread(self._registry.history, request.name, request.alias)
        return modelmgr_pb2.HistoryResponse(events=[
            modelmgr_pb2.HistoryEvent(id=e.id, at_unix=_ts(e.at), model=e.model, version=e.version, kind=e.kind,
                                      alias=e.alias, detail_json=json.dumps(e.detail) if e.detail else "")
            for e in events])

    async def Evaluate(self, request, context):
        if not request.baseline:
            raise InvalidArgument("name the baseline: NAME:VERSION or an alias", param="baseline")
        report = await self._rollout.evaluate(_ref(request.name, request.version), request.baseline,
                                              request.threshold if request.HasField("threshold") else None)
        return eval_pb(report)

    async def ListEvals(self, request, context):
        reports = await asyncio.to_thread(self._registry.evals, request.name, request.version)
        return modelmgr_pb2.ListEvalsResponse(reports=[eval_pb(r) for r in reports])

    async def GetArtifactManifest(self, request, context):
        m = await asyncio.to_thread(self._artifacts.manifest, request.served_name)
        return modelmgr_pb2.GetArtifactManifestResponse(
            served_name=m.served_name, metadata_json=m.metadata_json,
            files=[modelmgr_pb2.ArtifactFile(path=f.path, sha256=f.sha256, size_bytes=f.size_bytes) for f in m.files])

    async def FetchArtifact(self, request, context):
        async for offset, data, size in self._artifacts.chunks(request.sha256, request.offset):
            yield modelmgr_pb2.FetchArtifactResponse(offset=offset, data=data, size_bytes=size)
