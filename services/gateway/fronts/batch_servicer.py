"""The Batch API on the gRPC front: each method checks its message (the protos' rules),
authenticates the caller as the HTTP front does, and calls the same ``BatchService``; the
service's OpenAI-shaped objects become the proto messages of the same field names."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from google.protobuf import json_format
from google.protobuf.message import Message

from llmesh.errors import Unavailable
from llmesh.validation import check_message
from llmesh.v1 import gateway_pb2 as pb

from llmesh.gateway.context import Caller
from llmesh.gateway.domain.batches.service import BatchService

M = TypeVar("M", bound=Message)


def _pb(obj: dict[str, Any], message: M) -> M:
    return json_format.ParseDict(obj, message, ignore_unknown_fields=True)


class BatchRpcs:
    """Mixed into the Gateway servicer; ``_batch_api`` and ``_credential`` come from it."""
    _batch_api: tuple[BatchService, Callable[[str | None], Awaitable[Caller]]] | None
    _credential: Callable[[Any], str | None]

    async def _caller(self, request: Message, context: Any) -> tuple[BatchService, Caller]:
        if self._batch_api is None:
            raise Unavailable("The Batch API is not served here.")
        check_message(request)
        service, authenticate = self._batch_api
        return service, await authenticate(self._credential(context))

    async def CreateFile(self, request: pb.CreateFileRequest, context: Any) -> pb.CreateFileResponse:
        service, caller = await self._caller(request, context)
        made = await service.create_file(caller, request.filename, request.purpose, request.content)
        return pb.CreateFileResponse(file=_pb(made, pb.BatchFile()))

    async def GetFile(self, request: pb.GetFileRequest, context: Any) -> pb.GetFileResponse:
        service, caller = await self._caller(request, context)
        return pb.GetFileResponse(file=_pb(await service.file(caller, request.file_id), pb.BatchFile()))

    async def ListFiles(self, request: pb.ListFilesRequest, context: Any) -> pb.ListFilesResponse:
        service, caller = await self._caller(request, context)
        page = await service.files(caller, request.after or None, request.limit or None)
        return _pb(page, pb.ListFilesResponse())

    async def GetFileContent(self, request: pb.GetFileContentRequest, context: Any) -> pb.GetFileContentResponse:
        service, caller = await self._caller(request, context)
        return pb.GetFileContentResponse(content=await service.content(caller, request.file_id))

    async def DeleteFile(self, request: pb.DeleteFileRequest, context: Any) -> pb.DeleteFileResponse:
        service, caller = await self._caller(request, context)
        return _pb(await service.delete_file(caller, request.file_id), pb.DeleteFileResponse())

    async def CreateBatch(self, request: pb.CreateBatchRequest, context: Any) -> pb.CreateBatchResponse:
        service, caller = await self._caller(request, context)
        made = await service.create_batch(caller, request.input_file_id, request.endpoint, request.completion_window,
                                          dict(request.metadata) or None)
        return pb.CreateBatchResponse(batch=_pb(made, pb.Batch()))

    async def GetBatch(self, request: pb.GetBatchRequest, context: Any) -> pb.GetBatchResponse:
        service, caller = await self._caller(request, context)
        return pb.GetBatchResponse(batch=_pb(await service.batch(caller, request.batch_id), pb.Batch()))

    async def ListBatches(self, request: pb.ListBatchesRequest, context: Any) -> pb.ListBatchesResponse:
        service, caller = await self._caller(request, context)
        page = await service.batches(caller, request.after or None, request.limit or None)
        return _pb(page, pb.ListBatchesResponse())

    async def CancelBatch(self, request: pb.CancelBatchRequest, context: Any) -> pb.CancelBatchResponse:
        service, caller = await self._caller(request, context)
        return pb.CancelBatchResponse(batch=_pb(await service.cancel(caller, request.batch_id), pb.Batch()))
