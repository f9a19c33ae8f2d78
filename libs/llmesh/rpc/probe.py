"""A container health check on grpc.health.v1, for images and compose:

    python -m llmesh.rpc.probe 127.0.0.1:50051 [--service NAME] [--timeout 2]

Exits 0 when the server answers SERVING, 1 otherwise (the status is printed).
Kubernetes needs no such command: its probes speak grpc.health.v1 themselves."""

from __future__ import annotations

import argparse
import asyncio
import sys

from llmesh.rpc.health import health_status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmesh.rpc.probe", description=__doc__.splitlines()[0])
    parser.add_argument("address", help="host:port of a gRPC server")
    parser.add_argument("--service", default="", help="a service name; the server as a whole when empty")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    status = asyncio.run(health_status(args.address, args.service, timeout_s=args.timeout))
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
