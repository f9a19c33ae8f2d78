"""The README's HTTP <-> gRPC table against both fronts: every field the HTTP front
accepts (or refuses by name) has a row, every field of the Gateway's request messages
has one, and every row names fields that exist. A field added to one front only fails."""

from __future__ import annotations

from pathlib import Path

from pydantic import create_model

from llmesh.gateway.fronts import http
from llmesh.gateway.fronts.openai_api import HARMLESS, OFF_VALUES, ChatBody, CompletionBody
from llmesh.gateway.stages import cache
from llmesh.gateway.upstream import router
from llmesh.v1 import gateway_pb2
from tests.unit.parity import Row, http_fields, problems, proto_fields, read_table, readme_text

ROOT = Path(__file__).resolve().parents[2]
# Headers the fronts read or write; the quota stage writes x-ratelimit-* and retry-after.
HEADERS = {http.REQUEST_ID, *http.TIMEOUT_HEADERS, "authorization", "traceparent", cache.CACHE_HEADER,
           router.FAILOVER_HEADER, router.FALLBACK_HEADER, "x-ratelimit-*", "retry-after"}


def fronts(chat=ChatBody, text=CompletionBody, chat_pb=gateway_pb2.ChatRequest, text_pb=gateway_pb2.CompleteRequest):
    return ({"chat": http_fields(chat), "text": http_fields(text)}, HARMLESS | set(OFF_VALUES),
            proto_fields(chat_pb.DESCRIPTOR) | proto_fields(text_pb.DESCRIPTOR), HEADERS)


def test_the_table_matches_both_fronts():
    rows = read_table(readme_text(ROOT))
    assert len(rows) > 40
    assert problems(rows, *fronts()) == []


def test_a_row_taken_out_of_the_table_fails():
    rows = [r for r in read_table(readme_text(ROOT)) if r.http != "top_p"]
    found = problems(rows, *fronts())
    assert "HTTP chat field 'top_p' is not in the table" in found
    assert "gRPC field 'ChatRequest.sampling.top_p' has no row in the table" in found


def test_a_field_added_to_the_http_front_only_fails():
    wider = create_model("WiderChat", __base__=ChatBody, presence_boost=(float | None, None))
    assert problems(read_table(readme_text(ROOT)), *fronts(chat=wider)) == [
        "HTTP chat field 'presence_boost' is not in the table"]


def test_a_field_missing_from_the_protos_fails():
    """The Gateway's ChatRequest without `user` (a copy of the message, minus that field)."""
    from google.protobuf import descriptor_pb2, descriptor_pool
    from google.protobuf.message_factory import GetMessageClass

    pool = descriptor_pool.DescriptorPool()
    for dep in gateway_pb2.DESCRIPTOR.dependencies:
        for file in (*dep.dependencies, dep):
            proto = descriptor_pb2.FileDescriptorProto()
            file.CopyToProto(proto)
            try:
                pool.Add(proto)
            except TypeError:  # already there
                pass
    proto = descriptor_pb2.FileDescriptorProto()
    gateway_pb2.DESCRIPTOR.CopyToProto(proto)
    chat = next(m for m in proto.message_type if m.name == "ChatRequest")
    kept = [f for f in chat.field if f.name != "user"]
    del chat.field[:]
    chat.field.extend(kept)
    pool.Add(proto)
    narrower = GetMessageClass(pool.FindMessageTypeByName("llmesh.v1.ChatRequest"))
    found = problems(read_table(readme_text(ROOT)), *fronts(chat_pb=narrower))
    assert found == ["gRPC field 'ChatRequest.user' (for 'both user') is not in the protos"]


def test_a_row_without_a_grpc_field_needs_a_reason():
    rows = [*read_table(readme_text(ROOT)), Row("chat", "model", "—", "")]
    assert "'chat model' has no gRPC field and no reason why" in problems(rows, *fronts())
