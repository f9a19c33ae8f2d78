"""Model lifecycle on one engine: load a model (warm it up before it takes traffic),
unload it, list what is loaded; LoRA adapters where the backend has them. A load
that fails leaves the engine serving what it served. Pure: no gRPC."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass

from llmesh.errors import Internal, InvalidArgument, LlmeshError, ModelNotFound, NotFound, Unavailable
from llmesh.types import Prompt
from llmesh.engine.backends.base import Backend, Capabilities, DecodeParams, Piece, has_adapters
from llmesh.engine.core import EngineCore
from llmesh.engine.kvblocks import KvEventLog

log = logging.getLogger("llmesh.engine.lifecycle")


@dataclass(frozen=True, slots=True)
class LoadedModel:
    name: str
    backend: str
    context_length: int
    base_model: str = ""  # set for a LoRA adapter


@dataclass(frozen=True, slots=True)
class LoadResult:
    model: LoadedModel
    load_ms: float
    warmup_ms: float
    replaced: str
    swap: str = ""  # "beside": loaded next to the old model, which then drained;
                    # "unload_first": the two did not fit on the GPU: drained, unloaded, then loaded


class LoadFailed(Internal):
    """The model could not be loaded or warmed up; the message says why."""


class NoModel:
    """What an engine serves after its model is unloaded: nothing (every request for
    a model is NOT_FOUND) until the next load."""

    model = ""
    models: tuple[str, ...] = ()
    context_length = 0
    vocab_size = 0
    capabilities = Capabilities()
    gpu_memory_share = 0.0

    def __init__(self, name: str):
        self.name = name
        self.kv_blocks = KvEventLog()

    def tokenize(self, prompt: Prompt) -> list[int]:
        raise NotFound("this engine has no model loaded")

    async def stream(self, tokens: list[int], params: DecodeParams) -> AsyncGenerator[Piece, None]:
        raise NotFound("this engine has no model loaded")
        yield ""  # pragma: no cover - makes this an async generator

    def kv_usage(self) -> float:
        return 0.0

    def prefix_cache_stats(self) -> tuple[int, int]:
        return 0, 0

    async def close(self) -> None:
        pass


class Swapping(NoModel):
    """What an engine serves while it swaps models with the old one unloaded first:
    requests for either model are UNAVAILABLE (the gateway tries another engine; the
    scheduler already routes elsewhere, as the engine reports itself draining)."""

    def __init__(self, name: str, old: str, new: str):
        super().__init__(name)
        self.models = tuple(m for m in (old, new) if m)

    def tokenize(self, prompt: Prompt) -> list[int]:
        raise Unavailable(f"this engine is swapping its model to {self.models[-1]!r}; retry in a few seconds "
                          "or on another engine", reason="model_swap")


class ModelLifecycle:
    def __init__(self, core: EngineCore, build: Callable[[str], Backend],
                 on_change: Callable[[Backend], None] = lambda backend: None, drain_timeout_s: float = 60.0,
                 gpu_share: Callable[[str], float] = lambda name: 0.0,
                 out_of_routing: Callable[[bool], None] = lambda out: None,
                 prepare: Callable[[str], Awaitable[object]] | None = None):
        self._core = core
        self._build = build
        self._on_change = on_change
        self._drain_timeout = drain_timeout_s
        self._gpu_share = gpu_share            # the GPU memory share a backend for this model reserves
        self._out_of_routing = out_of_routing  # True: tell the scheduler to route elsewhere
        self._prepare = prepare                # puts a model's files in place (a fetch), before the load
        self._lock = asyncio.Lock()

    def list(self) -> list[LoadedModel]:
        b = self._core.backend
        return [LoadedModel(name, b.name, b.context_length, "" if name == b.model else b.model)
                for name in b.models]

    async def load(self, name: str, adapter_path: str = "", warmup: bool = True) -> LoadResult:
        if not name:
            raise InvalidArgument("name the model to load", param="name")
        if not adapter_path and self._prepare is not None and name != self._core.backend.model:
            await self._fetch(self._prepare, name)  # outside the lock: the engine serves and swaps while a fetch runs
        async with self._lock:
            if adapter_path:
                return await self._load_adapter(name, adapter_path)
            current = self._core.backend
            if name == current.model:
                return LoadResult(self._describe(name), 0.0, 0.0, "")
            if current.gpu_memory_share + self._gpu_share(name) > 1.0:
                return await self._unload_first(name, current, warmup)
            backend, load_ms, warmup_ms = await self._build_warm(name, warmup)
            self._core.backend = backend
            self._on_change(backend)
            log.info("model loaded", extra={"model": name, "load_ms": round(load_ms, 1), "swap": "beside",
                                            "warmup_ms": round(warmup_ms, 1), "replaced": current.model})
            await self._retire(current)
            return LoadResult(self._describe(name), load_ms, warmup_ms, current.model,
                              "beside" if current.model else "")

    @staticmethod
    async def _fetch(prepare: Callable[[str], Awaitable[object]], name: str) -> None:
        try:
            await prepare(name)
        except LlmeshError:
            raise
        except OSError as exc:
            log.error("model fetch failed", extra={"model": name, "error": f"{type(exc).__name__}: {exc}"})
            raise LoadFailed(f"fetching {name!r} failed: {type(exc).__name__}: {exc}") from exc

    async def _build_warm(self, name: str, warmup: bool) -> tuple[Backend, float, float]:
        started = time.monotonic()
        try:
            backend = await asyncio.to_thread(self._build, name)
        except ModelNotFound:
            raise
        except Exception as exc:  # any failure is reported, the engine stays as it was
            log.error("model load failed", extra={"model": name, "error": f"{type(exc).__name__}: {exc}"})
            raise LoadFailed(f"loading {name!r} failed: {type(exc).__name__}: {exc}") from exc
        load_ms = (time.monotonic() - started) * 1000
        warmup_ms = 0.0
        if warmup:
            ok, why, warmup_ms = await self._core.self_test(backend)
            if not ok:
                await backend.close()
                raise LoadFailed(f"{name!r} loaded but its warmup failed: {why}")
        return backend, load_ms, warmup_ms

    async def _unload_first(self, name: str, current: Backend, warmup: bool) -> LoadResult:
        """The new model does not fit on the GPU beside the old one (vLLM reserves its
        share of GPU memory up front and refuses to start without it free): out of
        routing, drain, unload, load, warm, back in. A failed load leaves no model."""
        log.info("model swap: unloading first", extra={"model": name, "replaced": current.model})
        self._out_of_routing(True)
        self._core.backend = Swapping(current.name, current.model, name)
        self._on_change(self._core.backend)
        try:
            await self._retire(current)
            try:
                backend, load_ms, warmup_ms = await self._build_warm(name, warmup)
            except BaseException:
                self._core.backend = NoModel(current.name)
                self._on_change(self._core.backend)
                raise
            self._core.backend = backend
            self._on_change(backend)
        finally:
            self._out_of_routing(False)
        log.info("model loaded", extra={"model": name, "load_ms": round(load_ms, 1), "swap": "unload_first",
                                        "warmup_ms": round(warmup_ms, 1), "replaced": current.model})
        return LoadResult(self._describe(name), load_ms, warmup_ms, current.model, "unload_first")

    async def unload(self, name: str) -> None:
        async with self._lock:
            current = self._core.backend
            if name != current.model:
                if name in current.models and has_adapters(current):  # only adapter backends list more than one
                    await current.unload_adapter(name)
                    self._on_change(current)
                    return
                raise ModelNotFound(name)
            self._core.backend = NoModel(current.name)
            self._on_change(self._core.backend)
            log.info("model unloaded", extra={"model": name})
            await self._retire(current)

    async def _load_adapter(self, name: str, path: str) -> LoadResult:
        backend = self._core.backend
        if not has_adapters(backend):
            raise InvalidArgument(f"the {backend.name} backend serves no LoRA adapters", param="adapter_path")
        started = time.monotonic()
        try:
            await backend.load_adapter(name, path)
        except LlmeshError:
            raise
        except Exception as exc:
            raise LoadFailed(f"loading adapter {name!r} from {path} failed: {type(exc).__name__}: {exc}") from exc
        self._on_change(backend)
        return LoadResult(self._describe(name), (time.monotonic() - started) * 1000, 0.0, "")

    def _describe(self, name: str) -> LoadedModel:
        return next(m for m in self.list() if m.name == name)

    async def _retire(self, old: Backend) -> None:
        """Waits for the old backend's in-flight requests, then frees it."""
        deadline = time.monotonic() + self._drain_timeout
        while self._core.active(old) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await old.close()
