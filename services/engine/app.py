"""Engine composition root: settings -> backend, admission, core, servicer, reporter."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Literal

from prometheus_client import CollectorRegistry

from llmesh.convert import hardware_to_pb
from llmesh.discovery.base import fixed
from llmesh.platform import Platform
from llmesh.rpc.server import GrpcServer, ServiceBinding
from llmesh.v1 import engine_pb2_grpc, scheduler_pb2
from llmesh.engine.admission import Admission
from llmesh.engine.backends.base import Backend
from llmesh.engine.backends.vllm_args import VllmEngineOptions
from llmesh.engine.config import EngineSettings
from llmesh.engine.core import Defaults, EngineCore
from llmesh.engine.fetcher import FetchLimits, ModelFetcher
from llmesh.engine.hardware import probe, replica_gpus
from llmesh.engine.lifecycle import ModelLifecycle, NoModel
from llmesh.engine.metrics import EngineMetrics
from llmesh.engine.modelsource import GrpcArtifactSource
from llmesh.engine.reporter import Reporter
from llmesh.engine.servicer import EngineServicer, load_pb

log = logging.getLogger("llmesh.engine")
VLLM_GENERATE_MAX_MODEL_LEN = 4096  # a generating vllm engine's window when LLMESH_ENGINE_VLLM_MAX_MODEL_LEN is unset


def build_backend(settings: EngineSettings) -> Backend:
    if settings.backend == "sim":
        from llmesh.engine.backends.sim import SimBackend, SimProfile
        if settings.sim_profile is not None:
            profile = replace(SimProfile.load(settings.sim_profile), output_tokens=settings.sim_output_tokens)
        else:
            profile = SimProfile(prefill_ms_per_token=settings.sim_prefill_ms_per_token,
                                 decode_ms_base=settings.sim_decode_ms_per_token,
                                 decode_ms_per_seq=settings.sim_decode_ms_per_seq,
                                 kv_blocks=settings.sim_kv_blocks, max_batch=settings.max_running,
                                 output_tokens=settings.sim_output_tokens, piggyback=settings.sim_piggyback)
        return SimBackend(model=settings.model, context_length=settings.sim_context_length, profile=profile,
                          die_on=settings.sim_die_on)
    if settings.backend == "vllm":
        from llmesh.engine.backends.vllm_pooling import VllmPoolingBackend, serves_pooling
        if serves_pooling(vllm_model_source(settings), settings.vllm_runner):  # an embedding model
            return VllmPoolingBackend.create(vllm_model_source(settings), served_name=settings.model,
                                             max_model_len=settings.vllm_max_model_len,
                                             gpu_memory_utilization=settings.vllm_gpu_memory_utilization,
                                             options=vllm_options(settings, "pooling"))
        from llmesh.engine.backends.vllm import VllmBackend
        return VllmBackend.create(vllm_model_source(settings), served_name=settings.model,
                                  max_model_len=settings.vllm_max_model_len or VLLM_GENERATE_MAX_MODEL_LEN,
                                  gpu_memory_utilization=settings.vllm_gpu_memory_utilization,
                                  enable_lora=settings.vllm_enable_lora, max_loras=settings.vllm_max_loras,
                                  max_lora_rank=settings.vllm_max_lora_rank,
                                  kv_events_endpoint=vllm_kv_events_endpoint(settings), options=vllm_options(settings))
    if settings.backend == "minilm":
        from llmesh.engine.backends.minilm import MiniLMBackend
        return MiniLMBackend.from_store(settings.model_dir, settings.model)
    if settings.backend == "llamacpp_embed":
        from llmesh.engine.backends.llamacpp_embed import LlamaCppEmbedBackend
        return LlamaCppEmbedBackend.from_store(settings.model_dir, settings.model, n_ctx=settings.n_ctx,
                                               n_threads=settings.n_threads, pooling=settings.embed_pooling)
    from llmesh.engine.backends.llamacpp import LlamaCppBackend
    return LlamaCppBackend.from_store(settings.model_dir, settings.model, n_ctx=settings.n_ctx,
                                      n_threads=settings.n_threads, n_batch=settings.n_batch,
                                      n_slots=settings.max_running, unified_kv=settings.unified_kv)


def vllm_model_source(settings: EngineSettings) -> str:
    """What vLLM loads for ``settings.model``: the Hugging Face directory of that name in the
    model store when there is one (a version the model manager published, ``NAME@N``), else
    the configured path or id (LLMESH_ENGINE_VLLM_MODEL_PATH), else the name itself."""
    name = settings.model
    if name and "/" not in name and name not in (".", ".."):
        folder = settings.model_dir / name
        if (folder / "config.json").is_file():
            return str(folder)
    return settings.vllm_model_path or name


def vllm_options(settings: EngineSettings, runner: Literal["generate", "pooling"] = "generate") -> VllmEngineOptions:
    """The GPU path's engine options from the settings (checked against vLLM's AsyncEngineArgs at create)."""
    return VllmEngineOptions(tensor_parallel_size=settings.vllm_tensor_parallel_size,
                             quantization=settings.vllm_quantization, dtype=settings.vllm_dtype,
                             max_num_seqs=settings.vllm_max_num_seqs, runner=runner,
                             extra=dict(settings.vllm_engine_args))


def vllm_kv_events_endpoint(settings: EngineSettings) -> str | None:
    """Where vLLM's KV-event publisher binds (our subscriber connects there)."""
    if not settings.vllm_kv_events:
        return None
    from llmesh.engine.backends.vllm_args import default_kv_events_endpoint
    return settings.vllm_kv_events_endpoint or default_kv_events_endpoint(settings.endpoint_id)


def gpu_memory_share(settings: EngineSettings) -> float:
    """The GPU memory share a newly built backend will reserve."""
    return settings.vllm_gpu_memory_utilization if settings.backend == "vllm" else 0.0


class EngineApp:
    def __init__(self, settings: EngineSettings, platform: Platform | None = None, backend: Backend | None = None):
        self.settings = settings
        backend = backend or build_backend(settings)
        self.reporter: Reporter | None = None
        self.metrics = EngineMetrics(platform.metrics if platform else CollectorRegistry(), backend.model,
                                     kv_usage=lambda: self.core.kv_usage())
        self.admission = Admission(settings.max_running, settings.max_waiting, on_change=self._load_changed,
                                   on_refuse=self.metrics.refused)
        self.core = EngineCore(backend, self.admission,
                               Defaults(settings.default_temperature, settings.default_top_p), self.metrics)
        self.artifact_source, self.fetcher = self._fetcher(settings, platform)
        self.lifecycle = ModelLifecycle(
            self.core, lambda name: build_backend(settings.model_copy(update={"model": name})),
            on_change=self._model_changed, drain_timeout_s=settings.grace_s,
            gpu_share=lambda name: gpu_memory_share(settings), out_of_routing=self._out_of_routing,
            prepare=self.fetcher.ensure if self.fetcher else None)
        self.server = GrpcServer(settings.address, [ServiceBinding(
            "llmesh.v1.Engine", EngineServicer(self.core, self.lifecycle, settings.endpoint_id),
            engine_pb2_grpc.add_EngineServicer_to_server)],
            tracer=platform.tracing.tracer if platform else None,
            identity=platform.identity if platform else None, bind_wait_s=settings.bind_wait_s,
            serving=platform.serving if platform else None)
        self._platform = platform
        self.hardware = scheduler_pb2.HardwareProfile()
        self.self_test = scheduler_pb2.SelfTest()
        self._checker: asyncio.Task | None = None

    @staticmethod
    def _fetcher(settings: EngineSettings,
                 platform: Platform | None) -> tuple[GrpcArtifactSource | None, ModelFetcher | None]:
        """Backends that load files (not sim) fetch a deployed model from the model manager."""
        if not settings.modelmgr_address or settings.backend == "sim":
            return None, None
        address = settings.modelmgr_address
        source = GrpcArtifactSource(platform.resolver("modelmgr", address) if platform else fixed(address),
                                    identity=platform.identity if platform else None)
        limits = FetchLimits(max_bytes=settings.fetch_max_bytes, timeout_s=settings.fetch_timeout_s,
                             idle_timeout_s=settings.fetch_idle_timeout_s, attempts=settings.fetch_attempts)
        return source, ModelFetcher(settings.model_dir, source, limits)

    @property
    def backend(self) -> Backend:
        return self.core.backend  # what the engine serves now (a model load replaces it)

    def _model_changed(self, backend: Backend) -> None:
        if backend.model:
            self.metrics.use_model(backend.model)
        if self.reporter is not None:
            self.reporter.set_models(list(backend.models))

    def _out_of_routing(self, out: bool) -> None:
        if self.reporter is not None:
            self.reporter.set_draining(out)

    def _load_changed(self) -> None:
        self.metrics.load(self.admission.running, self.admission.waiting, self.core.kv_usage())
        self.metrics.prefix_cache(*self.core.backend.prefix_cache_stats())
        if self.reporter is not None:
            self.reporter.notify()

    @property
    def advertise_address(self) -> str:
        return self.settings.advertise_address or self.server.bound_address

    @property
    def health_service(self) -> str:
        return "llmesh.v1.Engine"

    async def start(self) -> None:
        await self.server.start()
        if self.settings.scheduler_address:
            await self._check()  # the first report already says what we run on and that we work
            identity = scheduler_pb2.EngineReport(
                endpoint_id=self.settings.endpoint_id,
                address=self.advertise_address,
                backend=self.backend.name, models=list(self.backend.models),
                replica_gpus=replica_gpus(self.settings.backend, self.settings.vllm_tensor_parallel_size,
                                          len(self.hardware.gpus)))
            address = self.settings.scheduler_address
            resolve = self._platform.resolver("scheduler", address) if self._platform else fixed(address)
            self.reporter = Reporter(resolve, identity, lambda: load_pb(self.core), self.settings.report_interval_s,
                                     extra=lambda: (self.hardware, self.self_test),
                                     kv=lambda: self.core.backend.kv_blocks,
                                     caller=self._platform.identity if self._platform else None,
                                     served=self._served)
            self.reporter.start()
        self._checker = asyncio.create_task(self._check_loop(), name="self-test")
        log.info("engine ready", extra={"backend": self.backend.name, "model": self.backend.model,
                                        "context_length": self.backend.context_length})

    def _served(self) -> list[scheduler_pb2.ServedModel]:
        """What requests may name here now (the model, then its LoRA adapters), each with its
        context length, the requests naming it in flight, whether it is an embedding model and
        whether its backend calls tools."""
        can = self.core.backend.capabilities
        embeddings = can.embeddings and not can.generates
        return [scheduler_pb2.ServedModel(name=m.name, context_length=m.context_length, base_model=m.base_model,
                                          in_flight=self.core.in_flight(m.name), embeddings=embeddings,
                                          tools=can.tools)
                for m in self.lifecycle.list()]

    async def _check(self) -> None:
        self.hardware = hardware_to_pb(await asyncio.to_thread(probe))
        if self.admission.running or self.admission.waiting:
            return  # serving is proof enough; don't queue a test behind real work
        if isinstance(self.core.backend, NoModel):
            return  # no model (unloaded, or swapping, out of routing meanwhile): nothing to test; the next
            # model's warmup is its test, and an empty engine stays placeable
        ok, detail, ms = await self.core.self_test()
        self.self_test = scheduler_pb2.SelfTest(ok=ok, detail=detail, checked_unix=time.time(), latency_ms=ms)
        if not ok:
            log.error("self-test failed", extra={"detail": detail})
        if self.reporter is not None:
            self.reporter.notify()

    async def _check_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.self_test_interval_s)
            await self._check()

    async def stop(self, grace: float) -> None:
        if self._checker is not None:
            self._checker.cancel()
        if self.reporter is not None:
            await self.reporter.stop()  # deregister first: no new work routed here
            if self.settings.route_away_s:
                await asyncio.sleep(self.settings.route_away_s)
        await self.server.stop(grace)
        if self.artifact_source is not None:
            await self.artifact_source.close()
        await self.backend.close()

