"""``llmesh batches``: the caller's batches (the Batch API) through the gateway's gRPC API.

    llmesh batches list [--limit N] [--after ID] [--json]
    llmesh batches show BATCH_ID

The API key comes from LLMESH_API_KEY (the batches are its tenant's); --address names a
gateway other than this machine's mesh."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from llmesh.rpc.channels import CHANNEL_OPTIONS
from llmesh.v1 import gateway_pb2, gateway_pb2_grpc

TIMEOUT_S = 30.0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser],
               add_layout: Callable[[argparse.ArgumentParser], None]) -> argparse.ArgumentParser:
    batches = sub.add_parser("batches", help="list and inspect batches (API key from LLMESH_API_KEY)")
    add_layout(batches)
    batches.add_argument("--address", default=None, help="the gateway's gRPC address (default: this mesh's)")
    verbs = batches.add_subparsers(dest="verb", required=True)
    listing = verbs.add_parser("list", help="the tenant's batches, newest first")
    listing.add_argument("--limit", type=int, default=20, help="1..100")
    listing.add_argument("--after", default="", help="start after this batch id")
    listing.add_argument("--json", action="store_true")
    show = verbs.add_parser("show", help="one batch, as JSON")
    show.add_argument("batch_id")
    return batches


def _dict(message: Message) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True, unquote_int64_if_possible=True,
                                     always_print_fields_with_no_presence=True)


def _row(b: gateway_pb2.Batch) -> str:
    c = b.request_counts
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(b.created_at))
    return (f"{b.id}  {b.status:<11}  {c.completed}/{c.total} done, {c.failed} failed  {created}Z  {b.endpoint}"
            f"{'  output ' + b.output_file_id if b.HasField('output_file_id') else ''}")


async def run(args: argparse.Namespace, address: str, credential: str | None) -> int:
    metadata = (("authorization", f"Bearer {credential}"),) if credential else ()
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        try:
            if args.verb == "list":
                page = await stub.ListBatches(gateway_pb2.ListBatchesRequest(limit=args.limit, after=args.after),
                                              metadata=metadata, timeout=TIMEOUT_S)
                if args.json:
                    print(json.dumps(_dict(page), indent=2))
                else:
                    for b in page.data:
                        print(_row(b))
                    if page.has_more:
                        print(f"(more: --after {page.data[-1].id})")
                return 0
            got = await stub.GetBatch(gateway_pb2.GetBatchRequest(batch_id=args.batch_id), metadata=metadata,
                                      timeout=TIMEOUT_S)
            print(json.dumps(_dict(got.batch), indent=2))
            return 0
        except grpc.aio.AioRpcError as exc:
            print(f"llmesh batches: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
