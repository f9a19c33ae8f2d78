"""Rollout through the mesh: deploy a version to engines (load, warm, then ready),
promote an alias to it behind the eval gate (optionally as a canary ramp on the
live config's traffic splits), drain the old version, and roll back. The mesh and
the live config come in through the small ports below; no gRPC here."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from llmesh.errors import FailedPrecondition, InvalidArgument, LlmeshError
from llmesh.modelmgr.artifacts import ArtifactStore
from llmesh.modelmgr.evaluation import GoldenCase, evaluate
from llmesh.modelmgr.hfdir import publish_artifact
from llmesh.modelmgr.placement import BACKENDS_FOR_FORMAT, Engine, Target, gpus_per_replica, place_variant
from llmesh.modelmgr.registry import Alias, EvalReport, Registry, Version, check_name, parse_ref

log = logging.getLogger("llmesh.modelmgr.rollout")

# Warmup generations: short, real prompts (the engine's own warmup is one token).
WARMUP_PROMPTS = ("Hello!", "What is 2 + 2?", "Name a color.", "Say something short.")


class MeshPort(Protocol):
    async def engines(self) -> list[Engine]: ...
    # The scheduler's plan (its Place RPC): where ``replicas`` replicas needing ``memory_bytes`` each go.
    async def place(self, model: str, replicas: int, memory_bytes: int, backends: tuple[str, ...], gpus: int,
                    avoid_models: set[str]) -> list[Target]: ...
    async def load(self, address: str, model: str) -> tuple[float, float]: ...   # (load_ms, warmup_ms)
    async def generate(self, address: str, model: str, prompt: str, max_tokens: int) -> str: ...
    async def in_flight(self, address: str) -> int: ...
    async def unload(self, address: str, model: str) -> None: ...


class SplitsPort(Protocol):
    async def set_split(self, alias: str, weights: dict[str, float]) -> int: ...
    async def targets(self) -> set[str]: ...   # every model some alias routes to now


@dataclass(frozen=True)
class RolloutPolicy:
    warmup_generations: int = 3
    memory_budget: float = 0.85
    memory_overhead: float = 0.25
    settle_s: float = 1.5           # time the mesh takes to apply a config change
    drain_timeout_s: float = 60.0
    eval_threshold: float = 0.4
    eval_min_exact_match: float = 0.0
    eval_max_tokens: int = 32
    vllm_gpus_per_replica: int = 1  # GPUs a safetensors (vllm) replica takes; 0: vLLM's CPU build


class Rollout:
    def __init__(self, registry: Registry, store: ArtifactStore, mesh: MeshPort, splits: SplitsPort,
                 golden: Callable[[], list[GoldenCase]], policy: RolloutPolicy = RolloutPolicy(),
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        self._registry = registry
        self._store = store
        self._mesh = mesh
        self._splits = splits
        self._golden = golden
        self.policy = policy
        self._sleep = sleep
        self._lock = asyncio.Lock()  # one rollout change at a time

    async def _db(self, fn, *args, **kwargs):
        return await asyncio.to_thread(partial(fn, *args, **kwargs))

    # --- deploy ---------------------------------------------------------
    async def deploy(self, ref: str, replicas: int = 1, variant: str = "") -> Version:
        if replicas < 1:
            raise InvalidArgument("replicas must be at least 1", param="replicas")
        name, number = parse_ref(ref)
        async with self._lock:
            v = await self._db(self._registry.get, name, number)
            if v.state in ("registered", "archived"):
                raise FailedPrecondition(f"{v.ref} is {v.state}; only a validated version can be deployed")
            busy = await self._splits.targets()
            live = {r.variant for r in v.replicas if r.state in ("loading", "warming", "ready")}
            artifacts = [a for a in v.artifacts if a.format == v.artifacts[0].format]
            fmt = artifacts[0].format
            if fmt not in BACKENDS_FOR_FORMAT:
                raise FailedPrecondition(f"no engine backend loads {fmt} artifacts through the model manager")
            if variant:
                artifacts = [v.artifact(variant)]
            elif live:
                artifacts = [v.artifact(sorted(live)[0])]  # every replica of a version runs one variant
            if live and artifacts[0].variant not in live:
                raise FailedPrecondition(f"{v.ref} already runs as {sorted(live)[0]}; undeploy it to switch variant")

            async def place(memory_bytes: int) -> list[Target]:
                backends = BACKENDS_FOR_FORMAT[fmt]
                try:
                    return await self._mesh.place(v.served_name, replicas, memory_bytes, backends,
                                                  gpus_per_replica(fmt, self.policy.vllm_gpus_per_replica),
                                                  busy - {v.served_name})
                except FailedPrecondition as exc:  # say why the kind of engine matters
                    raise FailedPrecondition(f"{v.ref} is a {fmt} version, which only {'/'.join(backends)} "
                                             f"engines load: {exc.message}", reason=exc.reason) from None

            chosen, targets = await place_variant(artifacts, place, self.policy.memory_budget,
                                                  self.policy.memory_overhead)
            await self._db(publish_artifact, self._store, v.served_name, chosen,
                           {"source": v.source, "version": v.ref, "variant": chosen.variant,
                            "sha256": chosen.sha256, "quantization": chosen.quantization,
                            "context_length": v.context_length, "parent_version": v.parent_version,
                            "files": [{"path": f"{chosen.variant}.{chosen.format}", "sha256": chosen.sha256,
                                       "size": chosen.size_bytes}]})
            await self._db(self._registry.event, name, number, "deploy",
                           detail={"replicas": replicas, "variant": chosen.variant,
                                   "engines": [t.endpoint_id for t in targets]})
            for engine in targets:
                if engine.already_serving and any(
                        r.endpoint_id == engine.endpoint_id and r.state == "ready" for r in v.replicas):
                    continue
                await self._deploy_one(v, chosen.variant, engine)
            if v.state in ("validated", "deprecated"):
                await self._db(self._registry.set_state, name, number, "staged")
            return await self._db(self._registry.get, name, number)

    async def _deploy_one(self, v: Version, variant: str, engine: Target) -> None:
        """loading -> warming -> ready: the replica is ready (promotable) only after
        the engine loaded and warmed it and our own warmup generations passed."""
        previous = await self._db(self._registry.replicas_on, engine.endpoint_id)
        rid = await self._db(self._registry.add_replica, v.name, v.number, variant, engine.endpoint_id,
                             engine.address)
        try:
            load_ms, warmup_ms = await self._mesh.load(engine.address, v.served_name)
        except LlmeshError as exc:
            await self._db(self._registry.set_replica, rid, "failed", exc.message)
            raise
        await self._db(self._registry.set_replica, rid, "warming",
                       f"loaded in {load_ms:.0f} ms; engine warmup {warmup_ms:.0f} ms")
        for name, number, rep in previous:
            if rep.id != rid:
                await self._db(self._registry.set_replica, rep.id, "unloaded", f"replaced by {v.ref}")
        started = time.monotonic()
        try:
            for i in range(self.policy.warmup_generations):
                await self._mesh.generate(engine.address, v.served_name, WARMUP_PROMPTS[i % len(WARMUP_PROMPTS)], 8)
        except LlmeshError as exc:
            await self._db(self._registry.set_replica, rid, "failed", f"warmup failed: {exc.message}")
            raise
        await self._db(self._registry.set_replica, rid, "ready",
                       f"{self.policy.warmup_generations} warmup generations in "
                       f"{(time.monotonic() - started) * 1000:.0f} ms")
        log.info("replica ready", extra={"version": v.ref, "endpoint": engine.endpoint_id, "variant": variant})

    # --- promote / rollback --------------------------------------------
    async def promote(self, alias: str, ref: str, canary: tuple[float, ...] = (), step_s: float = 5.0,
                      skip_eval: bool = False, threshold: float | None = None) -> tuple[Alias, EvalReport | None]:
        check_name(alias)
        name, number = parse_ref(ref)
        if any(not 0 < w < 100 for w in canary) or list(canary) != sorted(canary):
            raise InvalidArgument("canary steps are rising percentages between 0 and 100", param="canary")
        async with self._lock:
            cand = await self._serving_ready(name, number)
            cur = await self._db(self._registry.alias, alias)
            if cur is not None and cur.current == cand.ref:
                await self._splits.set_split(alias, {cand.served_name: 1})  # re-asserted, nothing moves
                return cur, None
            old = None
            if cur is not None and cur.current != cand.ref:
                old = await self._serving_ready(*parse_ref(cur.current))
            report = None
            if old is not None and not skip_eval:
                report = await self._evaluate(cand, old, threshold)
                if not report.passed:
                    await self._db(self._registry.event, name, number, "promotion_blocked", alias,
                                   {"eval": report.id, "similarity": round(report.similarity, 4),
                                    "threshold": report.threshold})
                    raise FailedPrecondition(
                        f"promotion of {cand.ref} to {alias!r} blocked by the eval gate: similarity "
                        f"{report.similarity:.3f} < {report.threshold} or exact match {report.exact_match:.3f} "
                        f"< {self.policy.eval_min_exact_match} against {old.ref} (eval report #{report.id})",
                        reason="eval_failed")
            if old is not None:
                for weight in canary:
                    await self._splits.set_split(alias, {old.served_name: 100 - weight, cand.served_name: weight})
                    await self._db(self._registry.event, name, number, "canary", alias, {"weight": weight})
                    await self._sleep(step_s)
            await self._splits.set_split(alias, {cand.served_name: 1})
            moved = await self._db(self._registry.point_alias, alias, name, number, "promoted",
                                   {"from": old.ref if old else ""})
            await self._db(self._registry.set_state, name, number, "serving", {}, alias)
            if old is not None:
                await self._retire(alias, old)
            return moved, report

    async def rollback(self, alias: str) -> Alias:
        async with self._lock:
            cur = await self._db(self._registry.alias, alias)
            if cur is None or not cur.previous:
                raise FailedPrecondition(f"alias {alias!r} has no earlier version to roll back to")
            prev = await self._serving_ready(*parse_ref(cur.previous))
            now = await self._db(self._registry.get, *parse_ref(cur.current))
            await self._splits.set_split(alias, {prev.served_name: 1})
            moved = await self._db(self._registry.point_alias, alias, prev.name, prev.number, "rolled_back",
                                   {"from": now.ref})
            await self._db(self._registry.set_state, prev.name, prev.number, "serving", {}, alias)
            await self._retire(alias, now)
            return moved

    async def archive(self, ref: str) -> Version:
        """Takes a version out of service for good: no alias may point to it; its
        replicas are unloaded and its artifacts unpublished (the blobs stay)."""
        name, number = parse_ref(ref)
        async with self._lock:
            v = await self._db(self._registry.get, name, number)
            users = [a.name for a in await self._db(self._registry.aliases) if v.ref in (a.current,)]
            if users:
                raise FailedPrecondition(f"{v.ref} serves alias(es) {users}; promote another version first")
            serving = {e.endpoint_id: e for e in await self._mesh.engines() if v.served_name in e.models}
            for rep in v.replicas:
                if rep.state in ("loading", "warming", "ready"):
                    if rep.endpoint_id in serving:
                        await self._mesh.unload(serving[rep.endpoint_id].address, v.served_name)
                    await self._db(self._registry.set_replica, rep.id, "unloaded", "archived")
            await self._db(self._store.unpublish, v.served_name)
            return await self._db(self._registry.set_state, name, number, "archived")

    async def _retire(self, alias: str, old: Version) -> None:
        """Waits until the mesh applied the change and the old version's replicas
        finished what they had, then marks it deprecated (its replicas stay loaded,
        so a rollback is instant)."""
        await self._sleep(self.policy.settle_s)
        deadline = time.monotonic() + self.policy.drain_timeout_s
        started = time.monotonic()
        pending = [r.address for r in old.ready_replicas()]
        while pending and time.monotonic() < deadline:
            counts = await asyncio.gather(*(self._mesh.in_flight(a) for a in pending), return_exceptions=True)
            pending = [a for a, c in zip(pending, counts) if isinstance(c, int) and c > 0]
            if pending:
                await self._sleep(0.1)
        await self._db(self._registry.event, old.name, old.number, "drained", alias,
                       {"ms": round((time.monotonic() - started) * 1000), "timed_out": bool(pending)})
        still_used = any(a.current == old.ref for a in await self._db(self._registry.aliases))
        if not still_used:
            await self._db(self._registry.set_state, old.name, old.number, "deprecated", {}, alias)

    async def _serving_ready(self, name: str, number: int) -> Version:
        """The version, if at least one of its ready replicas is still on an engine
        that serves it now (an engine restart loses what the registry remembers)."""
        v = await self._db(self._registry.get, name, number)
        serving = {e.endpoint_id for e in await self._mesh.engines() if e.healthy and v.served_name in e.models}
        live = [r for r in v.ready_replicas() if r.endpoint_id in serving]
        if not live:
            raise FailedPrecondition(f"{v.ref} has no ready replica in the mesh; deploy it first: "
                                     f"llmesh models deploy {v.ref}")
        return v

    # --- evaluation -----------------------------------------------------
    async def evaluate(self, candidate: str, baseline: str, threshold: float | None = None) -> EvalReport:
        """``baseline`` is NAME:VERSION or an alias (the version it points to)."""
        async with self._lock:
            if ":" not in baseline:
                alias = await self._db(self._registry.alias, baseline)
                if alias is None:
                    raise InvalidArgument(f"{baseline!r} is neither NAME:VERSION nor an alias", param="baseline")
                baseline = alias.current
            cand = await self._serving_ready(*parse_ref(candidate))
            base = await self._serving_ready(*parse_ref(baseline))
            return await self._evaluate(cand, base, threshold)

    async def _evaluate(self, cand: Version, base: Version, threshold: float | None = None) -> EvalReport:
        address = {cand.served_name: cand.ready_replicas()[0].address,
                   base.served_name: base.ready_replicas()[0].address}

        async def generate(model: str, prompt: str) -> str:
            return await self._mesh.generate(address[model], model, prompt, self.policy.eval_max_tokens)

        result = await evaluate(self._golden(), generate, cand.served_name, base.served_name,
                                self.policy.eval_threshold if threshold is None else threshold,
                                self.policy.eval_min_exact_match)
        stored = await self._db(self._registry.add_eval, (cand.name, cand.number), (base.name, base.number),
                                result.passed, result.exact_match, result.similarity, result.threshold,
                                result.report)
        await self._db(self._registry.record_eval, cand.name, cand.number,
                       {"against": base.ref, "exact_match": round(result.exact_match, 4),
                        "similarity": round(result.similarity, 4), "passed": result.passed, "eval": stored.id})
        return stored
