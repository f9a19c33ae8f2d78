"""A container health check, for images and compose:

    python -m llmesh.rpc.probe --http HOST:METRICS_PORT   # GET http://HOST:PORT/healthz
    python -m llmesh.rpc.probe http://HOST:PORT/healthz   # the same, any URL
    python -m llmesh.rpc.probe HOST:PORT [--service NAME] # grpc.health.v1 on the gRPC port

Exits 0 when the service answers SERVING (HTTP: a 2xx), 1 otherwise; the status is printed
(SERVING, NOT_SERVING, ... or UNREACHABLE). The HTTP check is the cheap one (no gRPC import,
no certificate: the metrics port's /healthz, llmesh.metrics_http). The gRPC check dials as the
service does (LLMESH_TRUST and LLMESH_TLS_*): in "tls" trust with this container's own
certificate, expecting the service that certificate names, since a container probes itself."""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request

HEALTH_PATH = "/healthz"
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_status(url: str, timeout_s: float) -> tuple[bool, str]:
    """(2xx?, the status the body names) for a GET of ``url``; (False, "UNREACHABLE") without an answer."""
    try:
        with _NO_PROXY.open(urllib.request.Request(url), timeout=timeout_s) as resp:
            return 200 <= resp.status < 300, _status_text(resp.read(64)) or "SERVING"
    except urllib.error.HTTPError as exc:
        return False, _status_text(exc.read(64)) or f"HTTP {exc.code}"
    except (OSError, ValueError):
        return False, "UNREACHABLE"


def _status_text(body: bytes) -> str:
    text = body.decode("ascii", "replace").strip()
    return text if text.isidentifier() else ""  # SERVING / NOT_SERVING, never an arbitrary page


def health_url(target: str) -> str:
    return target if "://" in target else f"http://{target}{HEALTH_PATH}"


def grpc_status(address: str, service: str, timeout_s: float) -> str:
    """grpc.health.v1 at ``address`` with this process's mesh identity (llmesh.settings.MeshSettings)."""
    import asyncio

    from llmesh.rpc.health import health_status
    from llmesh.rpc.identity import Credentials, Identity
    from llmesh.settings import MeshSettings

    mesh = MeshSettings()
    if mesh.trust == "local" or not (mesh.tls_ca_file and mesh.tls_cert_file and mesh.tls_key_file):
        return asyncio.run(health_status(address, service, timeout_s=timeout_s))
    # A container probes itself: the service it is, and expects at the address, is the one its certificate names.
    credentials = Credentials.load(mesh.tls_ca_file, mesh.tls_cert_file, mesh.tls_key_file)
    own = credentials.principal.service
    identity = Identity(own, mesh.trust, credentials)
    return asyncio.run(health_status(address, service, timeout_s=timeout_s, identity=identity, target_service=own))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmesh.rpc.probe", description=__doc__.splitlines()[0])
    parser.add_argument("target", help="host:port of a gRPC server; with --http, or as a URL (http://...), "
                        "of a /healthz endpoint")
    parser.add_argument("--http", action="store_true", help=f"GET http://TARGET{HEALTH_PATH} (the metrics port)")
    parser.add_argument("--service", default="", help="gRPC only: a service name; the server as a whole when empty")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    if args.http or "://" in args.target:
        ok, status = http_status(health_url(args.target), args.timeout)
        print(status)
        return 0 if ok else 1
    try:
        status = grpc_status(args.target, args.service, args.timeout)
    except ValueError as exc:  # settings or TLS files that are not usable (pydantic, IdentityError, PkiError)
        print(f"UNREACHABLE: {exc}")
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
