"""``llmesh keys`` and ``llmesh usage``: API keys and what tenants used.

Both read the store the gateways share: Redis when LLMESH_REDIS_URL (or
--redis-url) is set, else the local files under var/state that a one-machine
gateway uses."""

from __future__ import annotations

import argparse
import asyncio
import csv
import os
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import redis.asyncio

from llmesh.keys import FileKeyStore, KeyStore, RedisKeyStore, new_key, revoke, rotate

DURATION = re.compile(r"^(\d+)([smhdw])$")
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_expiry(text: str, now: float) -> float:
    """'30d', '12h' (from now) or an ISO date/time (UTC unless it says otherwise)."""
    m = DURATION.match(text)
    if m:
        return now + int(m.group(1)) * UNITS[m.group(2)]
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--expires takes 30d, 12h, ... or an ISO date, not {text!r}") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return t.timestamp()


def _redis(args: argparse.Namespace) -> redis.asyncio.Redis | None:
    import redis.asyncio
    return redis.asyncio.from_url(args.redis_url) if args.redis_url else None


def _store(args: argparse.Namespace, client: redis.asyncio.Redis | None) -> KeyStore:
    return RedisKeyStore(client) if client is not None else FileKeyStore(args.keys_file)


def _when(ts: float | None) -> str:
    return "-" if ts is None else datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M")


def _admin_audit(args: argparse.Namespace, action: str, **fields: object) -> None:
    """Key changes are audited in their own chain (the gateways each write theirs)."""
    from llmesh.audit import AuditLog
    with AuditLog(args.admin_audit_file) as log:
        log.append("admin", {"actor": os.environ.get("USER", "unknown"), "action": action, "result": "ok",
                             **{k: v for k, v in fields.items() if v is not None}})


async def keys_main(args: argparse.Namespace) -> int:
    client = _redis(args)
    try:
        store = _store(args, client)
        if args.action == "create":
            models = tuple(m for m in args.models.split(",") if m) if args.models else None
            expires = parse_expiry(args.expires, time.time()) if args.expires else None
            plaintext, record = new_key(args.tenant, models=models, expires_at=expires, name=args.name or "")
            await store.put(record)
            _admin_audit(args, "key.create", key_id=record.key_id, tenant=record.tenant,
                         models=list(models) if models is not None else None, expires=expires)
            print(f"created key {record.key_id} for tenant {record.tenant}; it is shown once:\n{plaintext}")
        elif args.action == "list":
            print(f"{'id':<14}{'tenant':<16}{'models':<28}{'expires':<18}{'state':<9}name")
            now = time.time()
            for r in await store.all():
                state = "revoked" if r.revoked_at else ("expired" if not r.usable(now) else "active")
                shown = ",".join(r.models) if r.models is not None else "(tenant's)"
                print(f"{r.key_id:<14}{r.tenant:<16}{shown:<28}{_when(r.expires_at):<18}{state:<9}{r.name}")
        elif args.action == "rotate":
            plaintext, record = await rotate(store, args.key_id)
            _admin_audit(args, "key.rotate", key_id=args.key_id, target=record.key_id, tenant=record.tenant)
            print(f"key {args.key_id} revoked; its replacement {record.key_id} is shown once:\n{plaintext}")
        elif args.action == "revoke":
            record = await revoke(store, args.key_id)
            _admin_audit(args, "key.revoke", key_id=args.key_id, tenant=record.tenant)
            print(f"key {args.key_id} revoked")
        return 0
    except KeyError as exc:
        print(f"llmesh keys: no key {exc.args[0]}", file=sys.stderr)
        return 1
    finally:
        if client is not None:
            await client.aclose()


_FIELDS = ["day", "tenant", "model", "requests", "prompt_tokens", "completion_tokens", "cost_usd", "cache_hits",
           "saved_prompt_tokens", "saved_completion_tokens", "saved_usd"]
_MICRO = {"micro_usd": "cost_usd", "saved_micro_usd": "saved_usd"}  # stored in millionths of a dollar


def _row(day: str, tenant: str, model: str) -> dict[str, Any]:
    """One usage row: what a tenant's requests to a model spent that day, and what cache hits saved
    (their tokens, priced as usage prices them; they spent nothing)."""
    return {name: 0 for name in _FIELDS} | {"day": day, "tenant": tenant, "model": model, "cost_usd": 0.0,
                                            "saved_usd": 0.0}


async def usage_rows(client: redis.asyncio.Redis, days: list[str]) -> list[dict[str, Any]]:
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    for day in days:
        raw = await client.hgetall(f"llmesh:usage:{day}")
        for field, value in raw.items():
            key = field.decode() if isinstance(field, bytes) else field  # bytes: no decode_responses
            tenant, model, counter = key.split("\t")
            row = rows.setdefault((day, tenant, model), _row(day, tenant, model))
            if counter in _MICRO:
                row[_MICRO[counter]] = int(value) / 1e6
            elif counter in row:  # a counter this CLI does not know (a newer gateway's) is left out
                row[counter] = int(value)
    return [rows[k] for k in sorted(rows)]


def audit_usage_rows(paths: list[Path]) -> list[dict[str, Any]]:
    """Usage summed from gateways' audit logs: what a mesh without Redis keeps."""
    from llmesh.audit import read_records
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    for path in paths:
        for rec in read_records(path):
            f = rec["fields"]
            if rec["kind"] != "request" or f.get("decision") != "allowed":
                continue
            day = rec["ts"][:10]
            row = rows.setdefault((day, f["tenant"], f["model"]), _row(day, f["tenant"], f["model"]))
            row["requests"] += 1
            row["prompt_tokens"] += f.get("prompt_tokens", 0)
            row["completion_tokens"] += f.get("completion_tokens", 0)
            row["cost_usd"] += f.get("cost", 0.0)
            if "cache_kind" in f:  # a cache hit: it spent nothing and saved these
                row["cache_hits"] += 1
                row["saved_prompt_tokens"] += f.get("saved_prompt_tokens", 0)
                row["saved_completion_tokens"] += f.get("saved_completion_tokens", 0)
                row["saved_usd"] += f.get("saved_cost", 0.0)
    return [rows[k] for k in sorted(rows)]


async def usage_main(args: argparse.Namespace) -> int:
    from llmesh.audit import chain_files  # the default log and the worker logs beside it
    client = _redis(args)
    if client is None:
        rows = [r for r in audit_usage_rows(args.audit_file or chain_files(args.audit_default))
                if args.tenant in (None, r["tenant"]) and (not args.day or r["day"] in args.day)]
        return _print_usage(rows, args.csv)
    try:
        if args.day:
            days = args.day
        else:
            found = [k.decode().rsplit(":", 1)[1] async for k in client.scan_iter("llmesh:usage:*")]
            days = sorted(found)[-args.last:]
        rows = [r for r in await usage_rows(client, days) if args.tenant in (None, r["tenant"])]
    finally:
        await client.aclose()
    return _print_usage(rows, args.csv)


def _print_usage(rows: list[dict[str, Any]], as_csv: bool) -> int:
    if as_csv:
        out = csv.DictWriter(sys.stdout, fieldnames=_FIELDS)
        out.writeheader()
        out.writerows(rows)
    else:
        print(f"{'day':<12}{'tenant':<16}{'model':<28}{'requests':>9}{'prompt':>10}{'completion':>12}{'cost $':>12}"
              f"{'cache hits':>11}{'saved tok':>10}{'saved $':>12}")
        for r in rows:
            saved = r["saved_prompt_tokens"] + r["saved_completion_tokens"]
            print(f"{r['day']:<12}{r['tenant']:<16}{r['model']:<28}{r['requests']:>9}{r['prompt_tokens']:>10}"
                  f"{r['completion_tokens']:>12}{r['cost_usd']:>12.6f}{r['cache_hits']:>11}{saved:>10}"
                  f"{r['saved_usd']:>12.6f}")
    return 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    def redis_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--redis-url", default=os.environ.get("LLMESH_REDIS_URL"),
                       help="the gateways' Redis (default: LLMESH_REDIS_URL)")

    state = Path(os.environ.get("LLMESH_STATE_DIR", "var/state"))

    def store_args(p: argparse.ArgumentParser) -> None:
        redis_arg(p)
        p.add_argument("--keys-file", type=Path,
                       default=Path(os.environ.get("LLMESH_GATEWAY_KEYS_FILE", state / "keys.json")),
                       help="the key file of a gateway without Redis (default: <state_dir>/keys.json, as the "
                            "gateway's)")

    keys = sub.add_parser("keys", help="create, list, rotate and revoke API keys")
    kinds = keys.add_subparsers(dest="action", required=True)
    create = kinds.add_parser("create", help="a new key for a tenant (shown once)")
    create.add_argument("--tenant", required=True)
    create.add_argument("--models", help="comma-separated models and aliases the key may use "
                                         "(default: whatever the tenant may)")
    create.add_argument("--expires", help="30d, 12h, ... from now, or an ISO date")
    create.add_argument("--name", help="a label for people")
    kinds.add_parser("list", help="every key, without secrets")
    for verb, text in (("rotate", "revoke a key and print its replacement"), ("revoke", "revoke a key")):
        p = kinds.add_parser(verb, help=text)
        p.add_argument("key_id")
    for p in kinds.choices.values():
        store_args(p)
        p.add_argument("--admin-audit-file", type=Path, default=state / "audit-admin.jsonl",
                       help="where key changes are audited")
    keys.set_defaults(func=lambda a: asyncio.run(keys_main(a)))

    usage = sub.add_parser("usage", help="tokens and cost per tenant, model and day")
    usage.add_argument("--tenant")
    usage.add_argument("--day", action="append", help="YYYY-MM-DD (repeatable; default: the last --last days)")
    usage.add_argument("--last", type=int, default=7)
    usage.add_argument("--csv", action="store_true")
    usage.add_argument("--audit-file", type=Path, action="append",
                       help="without Redis: the gateways' audit logs to sum (default <state_dir>/audit.jsonl and the "
                            "worker logs beside it, audit.worker<i>.jsonl)")
    redis_arg(usage)
    usage.set_defaults(func=lambda a: asyncio.run(usage_main(a)), audit_default=state / "audit.jsonl")
