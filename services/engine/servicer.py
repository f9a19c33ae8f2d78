"""Engine gRPC servicer: protobuf <-> engine core, nothing else."""

from __future__ import annotations

from contextlib import aclosing

from opentelemetry import trace

from llmesh.convert import (finish_to_pb, logprobs_to_pb, priority_from_pb, prompt_from_pb, sampling_from_pb,
                            tool_calls_to_pb, tools_from_pb, usage_to_pb)
from llmesh.types import Delta
from llmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from llmesh.validation import check_message
from llmesh.engine.core import EngineCore, LastDelta
from llmesh.engine.lifecycle import LoadedModel, ModelLifecycle


class EngineServicer(engine_pb2_grpc.EngineServicer):
    def __init__(self, core: EngineCore, lifecycle: ModelLifecycle, endpoint_id: str):
        self._core = core
        self._lifecycle = lifecycle
        self._endpoint_id = endpoint_id

    async def Generate(self, request, context):
        items = self._core.generate(request.model, prompt_from_pb(request), sampling_from_pb(request.sampling),
                                    priority_from_pb(request.priority), request.continuation, tools_from_pb(request))
        whole = request.whole
        texts: list[str] = []
        logprobs: list = []
        calls: list = []
        tokens = 0
        response = engine_pb2.GenerateResponse
        async with aclosing(items):
            async for item in items:
                if isinstance(item, Delta):
                    if whole or type(item) is LastDelta:  # goes out with the finish: a whole answer, a last Delta
                        texts.append(item.text)
                        logprobs.extend(item.logprobs)
                        calls.extend(item.tool_calls)
                        tokens += item.tokens
                    elif item.tool_calls:
                        yield response(text=item.text, token_count=item.tokens,
                                       tool_calls=tool_calls_to_pb(item.tool_calls))
                    elif item.logprobs:
                        yield response(text=item.text, token_count=item.tokens, logprobs=logprobs_to_pb(item.logprobs))
                    else:
                        yield response(text=item.text, token_count=item.tokens)
                else:
                    span = trace.get_current_span()  # the interceptor's server span
                    if span.is_recording():
                        span.set_attribute("gen_ai.request.model", request.model)
                        span.set_attribute("gen_ai.usage.input_tokens", item.usage.prompt_tokens)
                        span.set_attribute("gen_ai.usage.output_tokens", item.usage.completion_tokens)
                        span.set_attribute("gen_ai.response.finish_reasons", [item.reason.value])
                    yield response(text="".join(texts), token_count=tokens,
                                   logprobs=logprobs_to_pb(tuple(logprobs)) if logprobs else None,
                                   tool_calls=tool_calls_to_pb(tuple(calls)) if calls else None,
                                   finish_reason=finish_to_pb(item.reason), usage=usage_to_pb(item.usage))

    async def Embed(self, request, context):
        check_message(request, lambda path: path.replace("inputs", "input"))  # the proto's bounds
        result = await self._core.embed(request.model, list(request.inputs),
                                        request.dimensions if request.HasField("dimensions") else None,
                                        priority_from_pb(request.priority))
        return engine_pb2.EmbedResponse(embeddings=[common_pb2.Embedding(values=v) for v in result.vectors],
                                        usage=common_pb2.Usage(prompt_tokens=result.prompt_tokens))

    async def Tokenize(self, request, context):
        count = self._core.count_tokens(request.model, prompt_from_pb(request))
        return engine_pb2.TokenizeResponse(count=count, context_length=self._core.backend.context_length)

    async def GetStatus(self, request, context):
        return engine_pb2.GetStatusResponse(
            endpoint_id=self._endpoint_id, backend=self._core.backend.name,
            models=list(self._core.backend.models), load=load_pb(self._core))

    async def LoadModel(self, request, context):
        result = await self._lifecycle.load(request.name, request.adapter_path, request.warmup)
        return engine_pb2.LoadModelResponse(model=loaded_pb(result.model), load_ms=result.load_ms,
                                            warmup_ms=result.warmup_ms, replaced=result.replaced,
                                            swap=result.swap)

    async def UnloadModel(self, request, context):
        await self._lifecycle.unload(request.name)
        return engine_pb2.UnloadModelResponse()

    async def ListLoadedModels(self, request, context):
        return engine_pb2.ListLoadedModelsResponse(models=[loaded_pb(m) for m in self._lifecycle.list()])


def loaded_pb(m: LoadedModel) -> engine_pb2.LoadedModel:
    return engine_pb2.LoadedModel(name=m.name, backend=m.backend, context_length=m.context_length,
                                  base_model=m.base_model)


def load_pb(core: EngineCore) -> engine_pb2.EngineLoad:
    a = core.admission
    return engine_pb2.EngineLoad(running=a.running, waiting=a.waiting,
                                 max_running=a.max_running, max_waiting=a.max_waiting)
