"""Where the gateway's CPU goes in front of an instant OpenAI-compatible server (the
fronts setup of bench.dataplane: a provider route to bench.instant_openai): py-spy
samples the gateway process (``--native``, so time in uvloop's C code shows) while
one connection sends requests, and each sample of the event loop's thread is given to
the innermost component it is in. Samples where the loop waits in epoll are idle and
left out. Prints the share of each component as JSON.

    python -m bench.gateway_profile [--stream] [--seconds 20] [--raw FILE] [--json]

Needs py-spy (``make bench-tools``) and the right to trace the process (root, or
``kernel.yama.ptrace_scope=0``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from bench import instant_openai
from bench import provider as provider_bench
from bench.common import child_pid, cpu_seconds, drive, note

# (component, where its frames live); a sample goes to the innermost frame that matches one.
COMPONENTS: tuple[tuple[str, str], ...] = (
    ("audit log (stage, record, hash)", r"gateway/stages/audit\.py|llmesh/audit\.py"),
    ("guards: injection screen", r"gateway/domain/guards/injection\.py"),
    ("guards: PII masking", r"gateway/domain/guards/pii|gateway/stages/guards\.py"),
    ("metrics (prometheus_client)", r"gateway/metrics\.py|prometheus_client/"),
    ("access log", r"/logging/|llmesh/logs\.py|gateway/record\.py"),
    ("request checks (protovalidate, check_request)", r"llmesh/validation\.py|protovalidate|llmesh/convert\.py"),
    ("tracing (opentelemetry)", r"opentelemetry/|llmesh/telemetry\.py"),
    ("request parsing and answer encoding (pydantic, openai_api)", r"pydantic|gateway/fronts/openai_api\.py"),
    ("provider client (aiohttp, providers.py)", r"aiohttp/|yarl/|multidict/|gateway/upstream/providers\.py"),
    ("HTTP server (uvicorn, httptools)", r"uvicorn/|httptools"),
    ("limits and quota", r"gateway/stages/limits\.py|gateway/domain/(?:quota|limits|limits_redis)\.py"),
    ("authentication and grants", r"gateway/stages/(?:auth|grants)\.py"),
    ("HTTP front (http.py, choices.py)", r"gateway/fronts/(?:http|choices)\.py"),
    ("pipeline and the other stages", r"gateway/(?!__main__)|llmesh/(?!service)"),
)  # asyncio, contextlib and dataclasses frames count for the component that called them
_COMPILED = [(name, re.compile(rx)) for name, rx in COMPONENTS]
_PY_FRAME = re.compile(r"\((?:[^()]*\.py|<[^>]*>):\d+\)$")  # native frames name a .c/.h file or a library
IDLE = ("epoll_wait", "epoll_pwait", "uv__io_poll")
LOOP = "event loop (uvloop's C code, socket I/O, task steps)"


def breakdown(raw: str) -> tuple[int, dict[str, float]]:
    """py-spy ``--format raw`` lines of the loop's thread -> (busy samples, share per component)."""
    busy, counts = 0, Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if "Runner.run (asyncio/runners.py" not in stack:
            continue  # other threads: watchers, the audit writer (they sleep)
        frames = stack.split(";")
        python = [f for f in frames if _PY_FRAME.search(f)]
        leaf_native = frames[-1] if frames and not _PY_FRAME.search(frames[-1]) else ""
        if python and python[-1].startswith("Runner.run") and any(w in leaf_native for w in IDLE):
            continue  # the loop waiting for I/O
        busy += int(n)
        for frame in reversed(python):
            hit = next((name for name, rx in _COMPILED if rx.search(frame)), None)
            if hit is not None:
                counts[hit] += int(n)
                break
        else:
            counts[LOOP] += int(n)
    return busy, {name: round(100 * c / max(busy, 1), 1) for name, c in counts.most_common()}


async def load(url: str, stream: bool, until: subprocess.Popen) -> int:
    async with httpx.AsyncClient(timeout=60) as client:
        n = 0
        while until.poll() is None:
            n += (await drive(lambda i: provider_bench.call(client, url, stream), 1, 50))["requests"]
        return n


def profile(stream: bool, seconds: int, chunks: int, tmp: Path, raw: Path | None = None) -> dict:
    with instant_openai.running(chunks) as base_url:
        mesh = provider_bench.mesh(base_url, tmp, args=("--no-cache",))
        mesh.start(timeout_s=90)
        try:
            gw = child_pid(mesh.proc.pid, "llmesh.gateway")
            url = mesh.layout.http_url + "/v1/chat/completions"

            async def warm() -> None:
                async with httpx.AsyncClient(timeout=60) as client:
                    await drive(lambda i: provider_bench.call(client, url, stream), 1, 50)

            asyncio.run(warm())
            out = raw or tmp / "profile.txt"
            spy = subprocess.Popen([str(Path(sys.executable).with_name("py-spy")), "record", "-p", str(gw), "-r", "200",
                                    "-f", "raw", "--native", "-d", str(seconds), "-o", str(out)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            cpu0, t0 = cpu_seconds(gw), time.monotonic()
            n = asyncio.run(load(url, stream, spy))
            cpu = cpu_seconds(gw) - cpu0
            if spy.returncode != 0 or not out.exists():
                raise SystemExit("py-spy failed (is it installed: make bench-tools; may this user trace?)")
            busy, shares = breakdown(out.read_text())
        finally:
            mesh.stop(signal.SIGINT)
    return {"stream": stream, "requests": n, "seconds": round(time.monotonic() - t0, 1),
            "gateway_cpu_ms_per_request_while_sampled": round(cpu * 1000 / max(n, 1), 3),
            "busy_samples": busy, "share_percent": shares}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stream", action="store_true", help="streamed answers (else non-streamed)")
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--raw", type=Path, help="keep py-spy's raw samples in this file")
    parser.add_argument("--json", action="store_true", help="print only the JSON document on stdout (the default)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = profile(args.stream, args.seconds, args.chunks, Path(tmp), args.raw)
    note(" | ".join(f"{k} {v}%" for k, v in list(result["share_percent"].items())[:6]))
    print(json.dumps({"bench": "gateway_profile", **result}, indent=2))


if __name__ == "__main__":
    main()
