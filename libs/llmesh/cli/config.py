"""``llmesh config``: read, check and change the live config in its backend.

    llmesh config get                  the document in force and its revision
    llmesh config set PATH VALUE       change one field (dotted path, YAML value)
    llmesh config apply -f FILE        replace the document
    llmesh config diff -f FILE         what apply would change
    llmesh config validate -f FILE     check a document, change nothing
    llmesh config history              every applied version (etcd)
    llmesh config rollback REV         make an earlier version current again

Every write is validated first; an invalid document never reaches the backend."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    import aetcd

from llmesh.liveconfig.document import InvalidConfig, diff, parse, render
from llmesh.liveconfig.schema import MeshConfig
from llmesh.liveconfig.stores import ConfigStore, EtcdStore, FileStore
from llmesh.settings import MeshSettings


def open_store(args: argparse.Namespace) -> tuple[ConfigStore, aetcd.Client | None]:
    mesh = MeshSettings()
    backend = args.backend or ("etcd" if mesh.config_backend == "etcd" else "file")
    if backend == "etcd":
        from llmesh.discovery.etcd import etcd_client
        address = args.etcd or mesh.etcd_address
        client = etcd_client(address)
        return EtcdStore(client, address, mesh.config_prefix), client
    return FileStore(Path(args.file or mesh.config_file)), None


def _read_file(path: str) -> tuple[str, MeshConfig]:
    text = Path(path).read_text()
    return text, parse(text)


def _set_path(doc: dict[str, Any], dotted: str, value: object) -> None:
    node = doc
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise InvalidConfig(f"{dotted}: '{part}' is not a section")
    node[parts[-1]] = value


async def run(args: argparse.Namespace) -> int:
    store, client = open_store(args)
    try:
        return await _run(args, store)
    except InvalidConfig as exc:
        print(f"invalid config: {exc}", file=sys.stderr)
        return 1
    finally:
        if client is not None:
            await client.close()


async def _run(args: argparse.Namespace, store: ConfigStore) -> int:
    current = await store.read()  # may be invalid (written behind our back): history and rollback still work
    if args.action == "get":
        print(f"# revision {current.revision if current else 0} ({store.address})")
        print(current.text if current else render(MeshConfig()), end="")
    elif args.action == "validate":
        _read_file(args.f)
        print(f"{args.f}: valid")
    elif args.action == "diff":
        _, new = _read_file(args.f)
        old = parse(current.text) if current else MeshConfig()
        print(diff(old, new, store.address, args.f) or "no change")
    elif args.action == "apply":
        text, _ = _read_file(args.f)
        print(f"applied as revision {await store.write(text)}")
    elif args.action == "set":
        doc = (yaml.safe_load(current.text) if current else None) or {}
        _set_path(doc, args.path, yaml.safe_load(args.value))
        text = yaml.safe_dump(doc, sort_keys=True)
        parse(text)
        print(f"applied as revision {await store.write(text)}")
    elif args.action == "history":
        versions = await store.history()
        for v in versions:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(v.ts)) if v.ts else "-"
            mark = " (current)" if v is versions[-1] and current and v.revision == current.revision else ""
            print(f"{v.revision:>8}  {when}{mark}")
    elif args.action == "rollback":
        version = next((v for v in await store.history() if v.revision == args.rev), None)
        if version is None:
            print(f"no revision {args.rev} in the history of {store.address}", file=sys.stderr)
            return 1
        parse(version.text)
        print(f"revision {args.rev} is current again as revision {await store.write(version.text)}")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("config", help="read and change the live config", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["file", "etcd"], help="default: LLMESH_CONFIG_BACKEND")
    p.add_argument("--etcd", help="etcd address (default LLMESH_ETCD_ADDRESS)")
    p.add_argument("--file", help="config file (default LLMESH_CONFIG_FILE, llmesh.yaml)")
    actions = p.add_subparsers(dest="action", required=True)
    actions.add_parser("get")
    for name in ("apply", "diff", "validate"):
        actions.add_parser(name).add_argument("-f", required=True, metavar="FILE")
    s = actions.add_parser("set")
    s.add_argument("path")
    s.add_argument("value")
    actions.add_parser("history")
    actions.add_parser("rollback").add_argument("rev", type=int)
