"""``llmesh audit``: check the audit log's hash chain.

    llmesh audit verify [--file PATH] [--head SEQ:HASH] [--json]

A gateway run as several worker processes writes one chain per worker
(``audit.worker0.jsonl``, ...) beside the file: each is checked, one report (JSON line) per file.
Exit status 0 when every line chains to the one before it (a summary with the head to keep
elsewhere), 1 with the lines that were edited, inserted or removed, or a truncated tail,
2 when the file cannot be read."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from llmesh.audit import chain_files, verify
from llmesh.settings import MeshSettings


def _head(text: str) -> tuple[int, str]:
    seq, sep, digest = text.partition(":")
    if not (sep and seq.isdigit() and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
        raise argparse.ArgumentTypeError("write the head as SEQ:HASH (the hash is 64 hex digits)")
    return int(seq), digest


def run(args: argparse.Namespace) -> int:
    path = Path(args.file or os.environ.get("LLMESH_GATEWAY_AUDIT_FILE") or MeshSettings().state_dir / "audit.jsonl")
    # A gateway run as several workers writes one chain per worker beside the file it was given.
    files = chain_files(path) or [path]
    if args.head is not None and len(files) > 1:
        print(f"llmesh audit: {path} has {len(files)} chains ({', '.join(f.name for f in files)}); "
              "a head belongs to one: name it with --file", file=sys.stderr)
        return 2
    return max(_verify_one(f, args) for f in files)


def _verify_one(path: Path, args: argparse.Namespace) -> int:
    try:
        report = verify(path, head=args.head)
    except OSError as exc:
        print(f"llmesh audit: cannot read {path}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"file": str(path), "ok": report.ok, "records": report.records,
                          "head": f"{report.head_seq}:{report.head_hash}", "first_ts": report.first_ts,
                          "last_ts": report.last_ts,
                          "problems": [{"line": p.line, "what": p.what} for p in report.problems]}))
    elif report.ok:
        span = f", {report.first_ts} .. {report.last_ts}" if report.records else ""
        print(f"{path}: intact, {report.records} records{span}\nhead {report.head_seq}:{report.head_hash}")
    else:
        print(f"{path}: TAMPERED ({len(report.problems)} problem(s) in {report.records} records)", file=sys.stderr)
        for problem in report.problems:
            print(f"  line {problem.line}: {problem.what}", file=sys.stderr)
    return 0 if report.ok else 1


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("audit", help="check the audit log", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="action", required=True)
    v = actions.add_parser("verify", help="check the hash chain of an audit log")
    v.add_argument("--file", help="the log (default: the gateway's, LLMESH_GATEWAY_AUDIT_FILE or "
                                  "<LLMESH_STATE_DIR>/audit.jsonl, var/state/audit.jsonl)")
    v.add_argument("--head", type=_head, metavar="SEQ:HASH",
                   help="a head printed by an earlier verify: fails if that record changed or is gone")
    v.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
