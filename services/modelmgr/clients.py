"""The rollout's ports over the real mesh: engines and the scheduler through gRPC,
aliases through the live config's traffic splits (file or etcd store)."""

from __future__ import annotations

import asyncio

import grpc
import yaml

from llmesh.discovery.base import Resolver
from llmesh.liveconfig.document import InvalidConfig, parse
from llmesh.liveconfig.stores import ConfigStore
from llmesh.modelmgr.placement import Engine, Target
from llmesh.rpc.channels import mesh_channel
from llmesh.rpc.identity import Identity
from llmesh.rpc.status import from_rpc_error
from llmesh.errors import InvalidArgument, Unavailable
from llmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc


class GrpcMesh:
    def __init__(self, scheduler: Resolver, load_timeout_s: float = 300.0, call_timeout_s: float = 60.0,
                 identity: Identity | None = None):
        self._scheduler = scheduler
        self._identity = identity  # engines and the scheduler ask who calls
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._load_timeout = load_timeout_s
        self._timeout = call_timeout_s

    def _engine(self, address: str) -> engine_pb2_grpc.EngineStub:
        if address not in self._channels:
            self._channels[address] = mesh_channel(address, "engine", self._identity)
        return engine_pb2_grpc.EngineStub(self._channels[address])

    async def _scheduler_call(self, method: str, request):
        try:
            address = await self._scheduler()
            async with mesh_channel(address, "scheduler", self._identity) as ch:
                return await getattr(scheduler_pb2_grpc.SchedulerStub(ch), method)(request, timeout=10)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                raise Unavailable(f"the scheduler is unreachable ({exc.code().name})") from None
            raise from_rpc_error(exc) from None
        except LookupError as exc:
            raise Unavailable(f"the scheduler is not registered ({exc})") from None

    async def engines(self) -> list[Engine]:
        table = await self._scheduler_call("ListEndpoints", scheduler_pb2.ListEndpointsRequest())
        return [Engine(e.endpoint_id, e.address, e.backend, tuple(e.models), e.healthy,
                       e.load.running + e.load.waiting) for e in table.endpoints]

    async def place(self, model: str, replicas: int, memory_bytes: int, backends: tuple[str, ...], gpus: int,
                    avoid_models: set[str]) -> list[Target]:
        resp = await self._scheduler_call("Place", scheduler_pb2.PlaceRequest(
            model=model, replicas=replicas, memory_bytes=memory_bytes, gpus_per_replica=gpus,
            backends=backends, avoid_models=sorted(avoid_models)))
        return [Target(p.endpoint_id, p.address, p.already_serving) for p in resp.placements]

    async def load(self, address: str, model: str) -> tuple[float, float]:
        try:
            resp = await self._engine(address).LoadModel(engine_pb2.LoadModelRequest(name=model, warmup=True),
                                                         timeout=self._load_timeout)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        return resp.load_ms, resp.warmup_ms

    async def generate(self, address: str, model: str, prompt: str, max_tokens: int) -> str:
        req = engine_pb2.GenerateRequest(
            model=model, chat=engine_pb2.ChatInput(messages=[common_pb2.ChatMessage(role="user", content=prompt)]),
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=0))
        parts = []
        try:
            async for resp in self._engine(address).Generate(req, timeout=self._timeout):
                parts.append(resp.text)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        return "".join(parts)

    async def in_flight(self, address: str) -> int:
        try:
            st = await self._engine(address).GetStatus(engine_pb2.GetStatusRequest(), timeout=5)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        return st.load.running + st.load.waiting

    async def unload(self, address: str, model: str) -> None:
        try:
            await self._engine(address).UnloadModel(engine_pb2.UnloadModelRequest(name=model), timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        await asyncio.gather(*(c.close() for c in channels.values()), return_exceptions=True)


class ConfigSplits:
    """Aliases live in the config document's ``splits`` that every gateway applies:
    one document write moves an alias for the whole mesh at once."""

    def __init__(self, store: ConfigStore):
        self._store = store
        self._lock = asyncio.Lock()

    async def _doc(self) -> dict:
        current = await self._store.read()
        return (yaml.safe_load(current.text) if current else None) or {}

    async def set_split(self, alias: str, weights: dict[str, float]) -> int:
        async with self._lock:
            doc = await self._doc()
            splits = doc.get("splits") or {}
            splits[alias] = {"targets": [{"model": m, "weight": w} for m, w in weights.items()]}
            doc["splits"] = splits
            text = yaml.safe_dump(doc, sort_keys=True)
            try:
                parse(text)  # never write a document the services would reject
            except InvalidConfig as exc:
                raise InvalidArgument(f"the live config would be invalid with alias {alias!r}: {exc}",
                                      param="alias") from None
            return await self._store.write(text)

    async def targets(self) -> set[str]:
        doc = await self._doc()
        return {t["model"] for split in (doc.get("splits") or {}).values() for t in split.get("targets", ())}
