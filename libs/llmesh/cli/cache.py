"""``llmesh cache``: the response cache's figures and invalidation.

    llmesh cache stats [--tenant T] [--json]        entries, hits, misses per tenant
    llmesh cache invalidate [--tenant T] [--model M] [--prefix HEX] [--all]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import grpc

from llmesh.platform import service_identity
from llmesh.rpc.channels import mesh_channel
from llmesh.settings import MeshSettings
from llmesh.v1 import cache_pb2, cache_pb2_grpc


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser],
               add_layout_args: Callable[[argparse.ArgumentParser], None]) -> None:
    cache = sub.add_parser("cache", help="response cache: stats, invalidate")
    verbs = cache.add_subparsers(dest="verb", required=True)
    stats = verbs.add_parser("stats", help="entries, hits and misses per tenant")
    add_layout_args(stats)
    stats.add_argument("--tenant")
    stats.add_argument("--json", action="store_true")
    inv = verbs.add_parser("invalidate", help="remove entries by tenant, model and/or key prefix")
    add_layout_args(inv)
    inv.add_argument("--tenant")
    inv.add_argument("--model")
    inv.add_argument("--prefix", default="", help="start of the entries' key digest (hex)")
    inv.add_argument("--all", action="store_true", help="every entry of every tenant")


def _stats_dict(resp: cache_pb2.StatsResponse) -> dict[str, Any]:
    return {"backend": resp.backend, "backend_available": resp.backend_available,
            "semantic_indexed": resp.semantic_indexed,
            "tenants": {t.tenant: {"entries": t.entries, "hits": t.hits, "semantic_hits": t.semantic_hits,
                                   "misses": t.misses, "stores": t.stores, "evictions": t.evictions}
                        for t in resp.tenants}}


def render(stats: dict[str, Any]) -> str:
    state = "available" if stats["backend_available"] else "UNAVAILABLE (bypassed)"
    lines = [f"backend {stats['backend']} ({state}), semantic index {stats['semantic_indexed']} entries",
             f"{'tenant':<20} {'entries':>8} {'hits':>8} {'semantic':>8} {'misses':>8} {'hit%':>6} "
             f"{'stores':>8} {'evicted':>8}"]
    for tenant, s in stats["tenants"].items():
        lookups = s["hits"] + s["misses"]
        ratio = f"{100 * s['hits'] / lookups:.1f}" if lookups else "-"
        lines.append(f"{tenant:<20} {s['entries']:>8} {s['hits']:>8} {s['semantic_hits']:>8} {s['misses']:>8} "
                     f"{ratio:>6} {s['stores']:>8} {s['evictions']:>8}")
    return "\n".join(lines)


async def run(args: argparse.Namespace, address: str) -> int:
    try:
        caller = service_identity("cli", MeshSettings())
    except (OSError, ValueError) as exc:  # IdentityError, or mesh settings that do not validate
        print(f"llmesh cache: no usable mesh identity (LLMESH_TRUST, LLMESH_TLS_*): {exc}", file=sys.stderr)
        return 2
    async with mesh_channel(address, "cache", caller) as channel:
        stub = cache_pb2_grpc.CacheStub(channel)
        try:
            if args.verb == "stats":
                ask = cache_pb2.StatsRequest(tenant=args.tenant) if args.tenant else cache_pb2.StatsRequest()
                stats = _stats_dict(await stub.Stats(ask, timeout=10))
                print(json.dumps(stats, indent=2) if args.json else render(stats))
                return 0
            if not (args.all or args.tenant or args.model or args.prefix):
                print("llmesh cache invalidate: name --tenant, --model and/or --prefix, or --all", file=sys.stderr)
                return 2
            req = cache_pb2.InvalidateRequest(key_prefix=args.prefix)
            if args.tenant:
                req.tenant = args.tenant
            if args.model:
                req.model = args.model
            req.all = args.all
            resp = await stub.Invalidate(req, timeout=30)
            print(f"removed {resp.removed} entries")
            return 0
        except grpc.aio.AioRpcError as exc:
            print(f"llmesh cache: {exc.code().name}: {exc.details()} (cache at {address})", file=sys.stderr)
            return 1
