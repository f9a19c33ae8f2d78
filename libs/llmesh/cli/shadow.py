"""``llmesh shadow report ALIAS``: how an alias's shadow version compared with its primary.

Reads the store the gateways write: Redis when LLMESH_REDIS_URL (or --redis-url) is
set, else the files under <LLMESH_STATE_DIR>/shadow (var/state/shadow) of a
one-machine gateway. Prints counts (compared, dropped), p50/p95 latency and tokens of
both sides, the mean and minimum similarity, and the share of answers that differ."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from llmesh.shadow import FileShadowStore, RedisShadowStore, report


async def _read(args: argparse.Namespace) -> tuple[list[Any], int]:
    if args.redis_url:
        import redis.asyncio
        client = redis.asyncio.from_url(args.redis_url)
        try:
            return await RedisShadowStore(client).read(args.alias)
        finally:
            await client.aclose()
    return await FileShadowStore(args.dir).read(args.alias)


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def render(r: dict[str, Any]) -> str:
    lines = [f"shadow report for {r['alias']}: {r['count']} copies recorded, {r['compared']} compared, "
             f"{r['dropped']} dropped"]
    if not r["count"]:
        return lines[0] + " (no shadow records: is a 'shadows' entry for it in the live config?)"
    lines.append(f"{'':<10}{'models':<30}{'errors':>7}{'p50 ms':>10}{'p95 ms':>10}{'prompt tok':>12}"
                 f"{'output tok':>12}")
    for side in ("primary", "shadow"):
        s = r[side]
        lines.append(f"{side:<10}{','.join(s['models']) or '-':<30}{s['errors']:>7}{_fmt(s['latency_p50_ms']):>10}"
                     f"{_fmt(s['latency_p95_ms']):>10}{s['prompt_tokens']:>12}{s['completion_tokens']:>12}")
    lines.append(f"similarity mean {_fmt(r['similarity_mean'], '.3f')}, min {_fmt(r['similarity_min'], '.3f')}; "
                 f"answers that differ: {_fmt(None if r['share_different'] is None else 100 * r['share_different'])} %")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from redis.exceptions import RedisError
    try:
        records, drops = asyncio.run(_read(args))
    except (OSError, RedisError) as exc:
        where = args.redis_url or args.dir
        print(f"llmesh shadow: cannot read the shadow records at {where}: {exc}", file=sys.stderr)
        return 2
    summary = report(args.alias, records, drops)
    print(json.dumps(summary) if args.json else render(summary))
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("shadow", help="compare an alias's shadow version with its primary", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="action", required=True)
    r = actions.add_parser("report", help="summarise the recorded comparisons of one alias")
    r.add_argument("alias")
    r.add_argument("--redis-url", default=os.environ.get("LLMESH_REDIS_URL"),
                   help="the gateways' Redis (default: LLMESH_REDIS_URL)")
    r.add_argument("--dir", type=Path, default=Path(os.environ.get("LLMESH_STATE_DIR", "var/state")) / "shadow",
                   help="without Redis: the gateway's shadow directory (default <LLMESH_STATE_DIR>/shadow)")
    r.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
