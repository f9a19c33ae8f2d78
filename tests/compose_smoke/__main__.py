"""Runs the compose smoke (see __init__): build, up, wait for health, check, down -v."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import yaml

from llmesh.testing import free_ports
from tests.compose_smoke import checks
from tests.compose_smoke.mesh import NOISE, ComposeMesh, Ports
from tests.compose_smoke.prepare import (CACHE, COMPOSE_DIR, WheelhouseServer, compose_command, ensure_engine, log,
                                         plan, wheelhouse, write_override)

PROJECT = "llmesh-smoke"
BUDGET_S = 480.0  # issue 28: the whole smoke within 8 minutes in CI once the wheelhouse is filled
CHECKS: list[tuple[str, Callable[[checks.Context], str]]] = [
    ("an API key made with the CLI in a container gates requests", checks.api_key_gates),
    ("the openai client chats through the gateway's published port", checks.openai_chat),
    ("the openai client streams through the gateway's published port", checks.openai_stream),
    ("the gRPC client completes through the gateway's published port", checks.grpc_client),
    ("Prometheus has scraped every service (its targets all up)", checks.prometheus_scraped),
    ("the cache container embeds: a paraphrase hits in semantic mode", checks.semantic_cache),
    # the kill before the deploy: a deploy may place the new version on an engine in place of the
    # model the kill's load asks for (a run saw engine-2 serve only smollm2@1 after it: every request
    # 503 once engine-1 was down), and the kill check needs both engines serving that model
    ("an engine container killed under load: no request fails, it comes back into routing",
     checks.engine_killed_under_load),
    ("llmesh models deploy puts a model on an engine in another container and it answers", checks.models_deploy),
]


class Report:
    def __init__(self) -> None:
        self.passed, self.failed = 0, 0

    def record(self, name: str, ok: bool, detail: str) -> None:
        word = "PASS" if ok else "FAIL"
        if ok:
            self.passed += 1
        else:
            self.failed += 1
        print(f"{word}: {name}: {detail}", flush=True)


def _services_to_wait_for(compose: dict, left_out: set[str]) -> list[str]:
    return [name for name, svc in compose["services"].items()
            if name not in left_out and (not svc.get("profiles") or "cpu" in svc["profiles"])]


def _bring_up(mesh: ComposeMesh, compose: dict, left_out: set[str], report: Report,
              ctx: checks.Context, times: dict[str, float]) -> bool:
    start = time.monotonic()
    mesh.compose("build")
    times["image_build_s"] = time.monotonic() - start
    ctx.t_up = time.monotonic()
    # `up -d` waits on the depends_on conditions itself, forever for a service that crash-loops:
    # it runs beside the wait here, which gives up on a crash loop, an exit or after 5 minutes.
    with tempfile.TemporaryFile("w+") as out:
        up = subprocess.Popen([*mesh.compose_base, "up", "-d"], env=mesh.env, stdout=out,
                              stderr=subprocess.STDOUT, text=True)
        services = _services_to_wait_for(compose, left_out)
        try:
            bad = mesh.wait_healthy(services, timeout=300)
            times["first_healthy_s"] = time.monotonic() - ctx.t_up
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        finally:  # never leave `up` creating containers while `down -v` removes them
            if up.poll() is None:
                up.terminate()
                up.wait(timeout=30)
        out.seek(0)
        said = "".join(line for line in out.read().splitlines(keepends=True) if not NOISE.search(line))
    detail = (f"{len(services)} services healthy (one-shots exited 0) after {times['first_healthy_s']:.0f} s"
              if not bad else f"not healthy: {bad}; up said: {said[-600:]}")
    report.record("every healthcheck passes after up", not bad, detail)
    for service in sorted(bad):
        print(f"--- logs of {service} ---\n{mesh.logs(service)}", flush=True)
    return not bad


def _run_checks(mesh: ComposeMesh, report: Report, ctx: checks.Context) -> None:
    for name, check in CHECKS:
        try:
            report.record(name, True, check(ctx))
        except Exception as exc:  # noqa: BLE001 - a check's failure is a FAIL line, never the end of the run
            detail = f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, checks.CheckFailed):
                detail += "\n" + "".join(traceback.format_exception(exc)[-3:])
            report.record(name, False, detail)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.compose_smoke", description=__doc__)
    ap.add_argument("--no-down", action="store_true", help="leave the mesh running (for a look); no down check")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally below stops every container
    CACHE.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    report, times = Report(), {}
    dockerd = ensure_engine()
    compose = yaml.safe_load((COMPOSE_DIR / "compose.yaml").read_text())
    the_plan = plan(compose)
    for note in the_plan.notes:
        log(f"override: {note}")
    left_out = set(the_plan.left_out)
    began = time.monotonic()
    house = wheelhouse()
    times["wheelhouse_s"] = time.monotonic() - began  # a fill (once per lock) is not the smoke's own time
    with tempfile.TemporaryDirectory(prefix="compose-smoke-") as tmp, \
            WheelhouseServer(house) as wheels:
        if "PYTHON_IMAGE" in the_plan.build_args:  # no registry: pip in the builds reads the wheelhouse
            the_plan.build_args.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=wheels.url, BUILD_PACKAGES="")
            log(f"override: llmesh images: PIP_NO_INDEX=1 PIP_FIND_LINKS={wheels.url} (a wheelhouse of "
                "requirements.lock on the host, llama.cpp's wheel included; pip in a build reaches no index "
                "here) and BUILD_PACKAGES='' (nothing to compile)")
        override = Path(tmp) / "compose.smoke.yaml"
        write_override(the_plan, compose, override)
        http, grpc, prom = free_ports(3)
        mesh = ComposeMesh(compose_command(), PROJECT, override, Ports(http, grpc, prom))
        log(f"{' '.join(mesh.compose_base)}: gateway 127.0.0.1:{http} (HTTP), :{grpc} (gRPC), Prometheus :{prom}")
        mesh.compose("down", "-v", "--remove-orphans", capture=True, check=False)  # a crashed run's leftovers
        ctx = checks.Context(mesh, times=times)
        try:
            if _bring_up(mesh, compose, left_out, report, ctx, times):
                _run_checks(mesh, report, ctx)
            else:
                for name, _ in CHECKS:
                    report.record(name, False, "not run: the mesh did not come up healthy")
        finally:
            if not args.no_down:
                mesh.compose("down", "-v", "--remove-orphans", capture=True, check=False, timeout=300)
                left = mesh.leftovers()
                report.record("down -v leaves no container, volume or network of the project", not left,
                              "nothing left" if not left else f"left: {left}")
            if dockerd is not None:
                dockerd.terminate()
                dockerd.wait(timeout=60)
    times["total_s"] = time.monotonic() - t0
    own = times["total_s"] - times["wheelhouse_s"]
    report.record(f"the smoke took at most {BUDGET_S:.0f} s with a filled wheelhouse", own <= BUDGET_S,
                  f"{own:.0f} s (the wheelhouse took {times['wheelhouse_s']:.0f} s more)")
    print(json.dumps({"compose_smoke_times": {k: round(v, 1) for k, v in times.items()}}), flush=True)
    print(f"{report.passed} passed, {report.failed} failed", flush=True)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
