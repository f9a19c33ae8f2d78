"""``python -m llmesh.gateway [--workers N]``: one gateway process, or with N > 1 a
supervisor and N worker processes sharing its ports (llmesh.workers)."""

import argparse
import logging
import sys

from llmesh.audit import worker_file
from llmesh.logs import setup_logging
from llmesh.malloc import keep_large_blocks
from llmesh.service import Worker, run
from llmesh.settings import MeshSettings
from llmesh.workers import ready_signal, supervise
from llmesh.gateway.app import GatewayApp
from llmesh.gateway.config import GatewaySettings
from llmesh.gateway.fronts.http import MAX_BODY


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m llmesh.gateway", description=__doc__)
    p.add_argument("--workers", type=int, default=None,
                   help="worker processes on the same ports (default: LLMESH_GATEWAY_WORKERS, 1)")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)     # set by the supervisor
    p.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)   # set by the supervisor
    return p


def worker_settings(settings: GatewaySettings, mesh: MeshSettings, index: int) -> GatewaySettings:
    """Worker ``index``'s settings: its own audit chain beside the configured file."""
    return settings.model_copy(update={
        "audit_file": worker_file(settings.audit_file or mesh.state_dir / "audit.jsonl", index)})


def workers_problem(settings: GatewaySettings, mesh: MeshSettings) -> str | None:
    """Why this gateway cannot run as several workers, or None. Without Redis each worker's
    in-process rate limiter would admit the whole limit (N times it in all) and the file
    shadow store would be written by N processes."""
    if settings.workers > 1 and not mesh.redis_url:
        return (f"LLMESH_GATEWAY_WORKERS={settings.workers} needs LLMESH_REDIS_URL: rate limits, budgets and "
                "shadow records must be shared by the workers (each would otherwise admit the full limit)")
    return None


def _keep_large_blocks() -> None:
    """In a process that serves (not the workers' supervisor, which reads no body): a large body's
    copies (read, pickled to a guard worker, its text back) reuse mapped memory instead of faulting
    fresh pages in: 20-30 ms of the gateway's CPU for a 16 MiB body, not 50-80 ms."""
    keep_large_blocks(prefault=(MAX_BODY,) * 3)


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    settings = GatewaySettings(**({"workers": args.workers} if args.workers is not None else {}))
    if args.worker is not None:
        if args.ready_fd is None:
            raise SystemExit("--worker is set by the gateway's supervisor, with --ready-fd")
        _keep_large_blocks()
        run("gateway", worker_settings(settings, MeshSettings(), args.worker), GatewayApp,
            Worker(args.worker, ready_signal(args.ready_fd)))
    elif settings.workers > 1:
        problem = workers_problem(settings, MeshSettings())
        if problem:
            setup_logging("gateway", settings.log_level)
            logging.getLogger("llmesh.gateway").error("cannot start", extra={"error": problem})
            raise SystemExit(1)
        supervise("gateway", settings, [sys.executable, "-m", "llmesh.gateway", "--workers", str(settings.workers)],
                  settings.workers, "llmesh.v1.Gateway",
                  shared=[settings.address, f"{settings.http_host}:{settings.http_port}"])
    else:
        _keep_large_blocks()
        run("gateway", settings, GatewayApp)


if __name__ == "__main__":
    main()
