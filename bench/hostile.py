"""Hostile input against a real gateway: adversarial prompts per guard rule, per structure and per
header (``bench.hostile_cases``; per JSON-schema keyword too when ``bench.hostile_schemas`` is
there), at log-spaced sizes up to the body limit, sent through the HTTP front while a second
client (its own process) keeps sending small normal requests and probing ``/healthz``.

The mesh is `llmesh up` on 127.0.0.1 with a sim engine serving the victims' model (context 4,096
tokens) and an instant OpenAI-compatible provider serving the attackers' model: a provider's
context is unknown to the gateway, so its guards read every attack in full, and no engine's own
work on a huge prompt slows the victims. Three over-context attacks go to the sim model instead
(the context check refuses them before anything reads them).

Per class: cases, the worst and median time to an answer, the status codes, the gateway's peak
RSS (its processes, guard workers included), the victims' p99 and the worst ``/healthz`` probe
while the class ran, and the gateway's own loop watch (``LLMESH_GATEWAY_LOOP_WATCH_MS=20``): its
stalls over 50 ms, and the most CPU its loop thread and its process spent in one stalled tick, which
tells a loop held by the gateway's work from a machine too busy to run it. Overall: the victims'
p50/p99 without attackers and during the attack phase, their ratio, and the worst probe (the event
loop's longest stall as seen from outside: the probe does nothing but answer from the loop). Exit
status 1 when any case got a 5xx.

    python -m bench.hostile [--json] [--max-bytes 16777216] [--baseline-s 20] [--attackers 2]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import orjson

from llmesh.testing import Mesh, free_layout
from llmesh.workers import nice_session
from llmesh.gateway.fronts.http import MAX_BODY
from bench import instant_openai
from bench.common import child_pid, note, pct
from bench.dataplane import rss_mib
from bench.hostile_cases import ATTACK_MODEL, VICTIM_MODEL, Case, cases, encode

T = TypeVar("T")
VICTIM_BODY = orjson.dumps({"model": VICTIM_MODEL, "messages": [{"role": "user", "content": "What is 2 + 2?"}],
                            "max_tokens": 3})


def victims(url: str, out: str, stop: multiprocessing.synchronize.Event, concurrency: int,
            ready: multiprocessing.synchronize.Event | None = None) -> None:
    """In its own process: ``concurrency`` loops of small chat requests and one /healthz probe every
    10 ms until ``stop`` (``ready`` set once the first chat is answered); (kind, start, seconds,
    status) rows to ``out`` as JSON. It runs in a session of its own: a scheduling group of its own
    where Linux groups sessions (``run``)."""
    os.setsid()
    rows: list[tuple[str, float, float, int]] = []

    async def one(client: httpx.AsyncClient, kind: str) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                if kind == "chat":
                    resp = await client.post("/v1/chat/completions", content=VICTIM_BODY,
                                             headers={"content-type": "application/json"})
                else:
                    resp = await client.get("/healthz")
                status = resp.status_code
            except httpx.HTTPError:
                status = 0
            rows.append((kind, started, time.monotonic() - started, status))
            if ready is not None and kind == "chat":
                ready.set()
            await asyncio.sleep(0.01 if kind == "probe" else 0.005)

    async def main() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            await asyncio.gather(*(one(client, "chat") for _ in range(concurrency)), one(client, "probe"))

    asyncio.run(main())
    Path(out).write_text(json.dumps(rows))


class RssSampler:
    """The gateway's processes' RSS every 50 ms, in a thread: (time, MiB) rows."""

    def __init__(self, pid: int):
        self.pid, self.rows = pid, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.rows.append((time.monotonic(), rss_mib(self.pid)))
            except (LookupError, OSError):
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


async def send(client: httpx.AsyncClient, case: Case) -> tuple[str, float]:
    """The case's status code, or ``error:<exception>`` when no answer came (counted as a 5xx)."""
    body = encode(case.body)
    started = time.monotonic()
    try:
        resp = await client.post("/v1/chat/completions", content=body,
                                 headers={"content-type": "application/json", **case.headers})
        status = str(resp.status_code)
    except httpx.HTTPError as exc:
        status = f"error:{type(exc).__name__}"
    return status, time.monotonic() - started


async def attack(url: str, classes: Iterator[tuple[str, Iterator[Case]]], attackers: int) -> dict[str, dict]:
    """Each class's cases, ``attackers`` at a time: per class its window, statuses and times."""
    out: dict[str, dict] = {}
    async with httpx.AsyncClient(base_url=url, timeout=120,
                                 limits=httpx.Limits(max_connections=attackers)) as client:
        for cls, items in classes:
            started, statuses, times, sizes = time.monotonic(), Counter(), [], []
            queue: asyncio.Queue = asyncio.Queue(maxsize=attackers)

            async def worker() -> None:
                while (case := await queue.get()) is not None:
                    status, seconds = await send(client, case)
                    statuses[status] += 1
                    times.append(seconds)
                    sizes.append(case.size)

            tasks = [asyncio.create_task(worker()) for _ in range(attackers)]
            for case in items:
                await queue.put(case)
            for _ in tasks:
                await queue.put(None)
            await asyncio.gather(*tasks)
            out[cls] = {"window": (started, time.monotonic()), "statuses": dict(statuses), "times": times,
                        "sizes": sizes}
            note(f"{cls:<36} {len(times):>4} cases, worst {max(times):6.2f} s, {dict(statuses)}")
    return out


def by_class(max_bytes: int, only: set[str]) -> Iterator[tuple[str, Iterator[Case]]]:
    try:
        from bench.hostile_schemas import cases as schemas
    except ImportError:
        schemas = None
    current: list[Case] = []
    for case in cases(max_bytes, schemas):  # lazily: the whole set is ~1 GB of text
        if only and case.cls not in only:
            continue
        if current and case.cls != current[0].cls:
            yield current[0].cls, iter(current)
            current = []
        current.append(case)
    if current:
        yield current[0].cls, iter(current)


def stalls(log_file: Path, offset: float) -> list[tuple[float, float, float, float, list[str]]]:
    """The gateway's loop-watch warnings (``LLMESH_GATEWAY_LOOP_WATCH_MS``): (monotonic time, lag,
    the loop thread's CPU, the process's CPU meanwhile, in ms; where the loop was)."""
    out = []
    for line in log_file.read_text().splitlines() if log_file.exists() else ():
        if '"event loop stalled"' in line:
            e = json.loads(line)
            out.append((e["ts"] - offset, e["lag_ms"], e["loop_cpu_ms"], e["process_cpu_ms"], e.get("stacks", [])))
    return out


def loop_figures(events: list, start: float, end: float) -> dict:
    """The loop watch's view of a window: stalls over 50 ms by wall clock, and the most CPU the
    loop's thread (a callback holding the loop) and the process (the GIL held elsewhere too)
    spent in one stalled tick, and where the loop was in its longest stall (innermost frames)."""
    here = [e for e in events if start <= e[0] <= end + 0.1]
    worst = max(here, key=lambda e: e[1], default=None)
    return {"stalls_over_50ms": sum(1 for e in here if e[1] > 50), "lag_max_ms": max((e[1] for e in here), default=0),
            "loop_cpu_max_ms": max((e[2] for e in here), default=0),
            "process_cpu_max_ms": max((e[3] for e in here), default=0),
            "worst_stall_at": worst[4] if worst else []}


def summarise(rows: list, windows: dict[str, dict], rss: list, baseline: tuple[float, float],
              events: list | None = None) -> dict:
    def chats(start: float, end: float) -> list[float]:
        return [s for kind, t, s, _ in rows if kind == "chat" and start <= t <= end]

    def probes(start: float, end: float) -> list[float]:
        return [s for kind, t, s, _ in rows if kind == "probe" and start <= t <= end]

    def peak(start: float, end: float) -> float:
        return max((m for t, m in rss if start <= t <= end + 0.1), default=float("nan"))

    ms = lambda seconds: round(seconds * 1000, 2)  # noqa: E731
    base = chats(*baseline)
    classes = {}
    for cls, w in windows.items():
        start, end = w["window"]
        victims_here, probes_here = chats(start, end), probes(start, end)
        classes[cls] = {"cases": len(w["times"]), "max_bytes": max(w["sizes"], default=0),
                        "worst_s": round(max(w["times"]), 3), "median_s": round(statistics.median(w["times"]), 3),
                        "statuses": w["statuses"], "peak_rss_mib": peak(start, end),
                        "victim_p99_ms": ms(pct(victims_here, 99)) if victims_here else None,
                        "probe_max_ms": ms(max(probes_here)) if probes_here else None,
                        "loop": loop_figures(events or [], start, end)}
    first = min(w["window"][0] for w in windows.values())
    last = max(w["window"][1] for w in windows.values())
    during = chats(first, last)
    base_p99, attack_p99 = pct(base, 99), pct(during, 99)
    five_xx = sum(n for w in windows.values() for code, n in w["statuses"].items() if not code < "500")
    failed_victims = sum(1 for kind, _, _, status in rows if status != 200)
    return {
        "cases": sum(c["cases"] for c in classes.values()), "five_xx": five_xx, "failed_victims": failed_victims,
        "baseline": {"victim_requests": len(base), "victim_p50_ms": ms(pct(base, 50)), "victim_p99_ms": ms(base_p99),
                     "probe_max_ms": ms(max(probes(*baseline), default=0)), "rss_mib": peak(*baseline),
                     "loop": loop_figures(events or [], *baseline)},
        "attack": {"seconds": round(last - first, 1), "victim_requests": len(during),
                   "victim_p50_ms": ms(pct(during, 50)), "victim_p99_ms": ms(attack_p99),
                   "victim_p99_ratio": round(attack_p99 / base_p99, 2),
                   "probe_max_ms": ms(max(probes(first, last), default=0)),
                   "peak_rss_mib": peak(first, last), "loop": loop_figures(events or [], first, last)},
        "classes": classes,
    }


def config(base_url: str) -> str:
    return json.dumps({"providers": {"instant": {"base_url": base_url, "models": {ATTACK_MODEL: "instant"}}},
                       "tenants": {"*": {"guards": {"injection": "block"}}}})


def run_niced(nice: int, fn: Callable[[], T]) -> T:
    """``fn()`` in a thread of its own at ``nice`` (Linux: a thread's nice value is its own)."""
    result: list[T] = []

    def body() -> None:
        os.nice(nice)
        result.append(fn())

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(body).result()
    return result[0]


def run(args: argparse.Namespace) -> dict:
    # This process's session (the attack client's thread and the provider) niced as a whole: where Linux
    # groups each session for scheduling (sched_autogroup_enabled, on here), a thread's nice value weighs
    # only within its session, and the niced attack side got a whole session's share of the cores next to
    # the gateway's (victims' p99 over baseline 1.5x -> 3.3x in one comparison, bodies to 4 MiB). The
    # mesh's services and the victims run in sessions of their own; this process leads its own
    # (own_session), so the caller's session is left as it was.
    grouped = nice_session(args.attacker_nice)
    with tempfile.TemporaryDirectory() as tmp, instant_openai.running(1, nice=args.attacker_nice) as provider:
        cfg = Path(tmp) / "llmesh.yaml"
        cfg.write_text(config(provider))
        mesh = Mesh(layout=free_layout(1), engines="sim", model_dir=Path(tmp) / "models", log_dir=Path(tmp) / "logs",
                    env={"LLMESH_CONFIG_FILE": str(cfg), "LLMESH_GATEWAY_LOG_LEVEL": "warning",
                         "LLMESH_ENGINE_LOG_LEVEL": "warning", "LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": "0",
                         "LLMESH_ENGINE_SIM_OUTPUT_TOKENS": "3", "LLMESH_GATEWAY_LOOP_WATCH_MS": "20"})
        mesh.start(timeout_s=120)
        try:
            url = mesh.layout.http_url
            gateway = child_pid(mesh.proc.pid, "llmesh.gateway")
            with httpx.Client(base_url=url, timeout=30) as warm:
                for model in (VICTIM_MODEL, ATTACK_MODEL):
                    for _ in range(20):
                        warm.post("/v1/chat/completions", json={"model": model, "max_tokens": 1,
                                                                "messages": [{"role": "user", "content": "hi"}]})
            rss = RssSampler(gateway)
            ctx = multiprocessing.get_context("spawn")
            stop, ready, out = ctx.Event(), ctx.Event(), str(Path(tmp) / "victims.json")
            proc = ctx.Process(target=victims, args=(url, out, stop, args.victims, ready), daemon=True)
            proc.start()
            try:
                ready.wait(120)  # the victims' process up and answered (slow to start on a busy machine)
                time.sleep(0.5)  # its connections up
                base_start = time.monotonic()
                note(f"baseline: {args.baseline_s:g} s of small requests alone")
                time.sleep(args.baseline_s)
                baseline = (base_start, time.monotonic())
                # The attack client's own CPU (building and sending bodies of up to 16 MiB) stands in
                # for attackers on other machines: on this one it runs niced, in its own thread, so
                # the victims' p99 measures the gateway's share of the machine, not the client's. The
                # provider (an external service in production) runs niced for the same reason.
                windows = run_niced(args.attacker_nice, lambda: asyncio.run(
                    attack(url, by_class(args.max_bytes, set(args.only)), args.attackers)))
            finally:
                stop.set()
                proc.join(60)
                rss.stop()
            rows = json.loads(Path(out).read_text())
            events = stalls(mesh.log_dir / "gateway.log", time.time() - time.monotonic())
        finally:
            mesh.stop(signal.SIGINT)
        return {**summarise(rows, windows, rss.rows, baseline, events), "attacker_nice": args.attacker_nice,
            "attack_session_niced": grouped}


def own_session() -> int | None:
    """None when this process leads its session; else this bench run again as the leader of a new
    one, and its exit status (a signal here is passed on to it, which stops its mesh)."""
    if os.getsid(0) == os.getpid():
        return None
    child = subprocess.Popen([sys.executable, "-m", "bench.hostile", *sys.argv[1:]], start_new_session=True)
    try:
        return child.wait()
    except BaseException:
        child.terminate()
        child.wait()
        raise


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the JSON summary only (else with a table)")
    p.add_argument("--max-bytes", type=int, default=MAX_BODY, help="largest request body (default: the limit)")
    p.add_argument("--baseline-s", type=float, default=20.0, help="seconds of small requests alone")
    p.add_argument("--attackers", type=int, default=2, help="attack requests in flight")
    p.add_argument("--victims", type=int, default=2, help="small requests in flight")
    p.add_argument("--attacker-nice", type=int, default=10,
                   help="nice value of the attack client's thread and of the provider's process, which stand "
                        "for other machines (0: on an equal footing with the mesh)")
    p.add_argument("--only", action="append", default=[], metavar="CLASS", help="run only this class (repeatable)")
    args = p.parse_args()
    # SIGTERM (a timeout, Ctrl-C's cousin) unwinds like an exception, so the mesh and the victims are stopped.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if (status := own_session()) is not None:
        return status
    report = run(args)
    print(json.dumps(report, indent=None if args.json else 2))
    return 1 if report["five_xx"] else 0


if __name__ == "__main__":
    sys.exit(main())
