"""The client side of bench.routing_gateway: multi-turn conversations through the OpenAI front,
and the load they put on the fleet.

A closed loop of users (each sends its conversation's next turn as soon as the last one's answer
ends) measures the fleet's capacity when there are as many users as running slots: every slot is
taken all the time. "80 % load" is 80 % of that capacity, as ``bench.routing`` defines load (a share
of saturation): turns start by a Poisson process at that rate (:class:`Pacer`), each taken by a
free user for its conversation's next turn. Users stand by in twice the slots' number, so the
client itself caps no burst; a start no user was free for is counted late."""

from __future__ import annotations

import random
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
from openai import OpenAI

from llmesh.v1 import scheduler_pb2, scheduler_pb2_grpc

MODEL = "sim-small"
OUTPUT_TOKENS = 8
LATE_S = 0.05  # a start taken this long after its time waited for a free user


@dataclass
class Turn:
    conv: str
    index: int        # 0: the first turn
    rid: str
    ttft_s: float
    endpoint: str = ""
    gateway_ttft_ms: float | None = None  # the access log's ttft_ms: the gateway's own view


@dataclass
class Gauge:
    """The client's in-flight requests and the engines' reported running counts, sampled; the
    turns that failed, by their exception's name (the user then starts a new conversation)."""
    in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    client: list[int] = field(default_factory=list)
    engines: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def add(self, n: int) -> None:
        with self.lock:
            self.in_flight += n


@dataclass
class _Seat:
    picked: bool = False


class Pacer:
    """Turn starts by a Poisson process at ``rate`` a second (:meth:`run`, in a thread of its own),
    each handed to a free user picked at random: users freed in turn would otherwise take starts in
    turn, and round robin's rotation would then keep each on one engine."""

    def __init__(self, rate: float, seed: int = 1, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.rate = rate
        self._rng = random.Random(seed)
        self._clock, self._sleep = clock, sleep
        self._cond = threading.Condition()
        self._free: list[_Seat] = []  # the users waiting to be picked
        self._over = False
        self.started = self.late = 0

    def times(self, start: float, stop_at: float) -> Iterator[float]:
        """The process's start times from ``start`` until ``stop_at``."""
        at = start + self._rng.expovariate(self.rate)
        while at < stop_at:
            yield at
            at += self._rng.expovariate(self.rate)

    def run(self, stop_at: float) -> None:
        for at in self.times(self._clock(), stop_at):
            now = self._clock()
            if at > now:
                self._sleep(at - now)
            with self._cond:
                if not self._free and not self._cond.wait_for(lambda: self._free, stop_at - self._clock()):
                    break
                self.late += self._clock() - at > LATE_S
                self.started += 1
                self._free.pop(self._rng.randrange(len(self._free))).picked = True
                self._cond.notify_all()
        with self._cond:
            self._over = True
            self._cond.notify_all()

    def wait(self) -> bool:
        """A free user waits to be picked for the next start; False once the starts are over."""
        seat = _Seat()
        with self._cond:
            self._free.append(seat)
            self._cond.notify_all()
            self._cond.wait_for(lambda: seat.picked or self._over)
            if not seat.picked:
                self._free = [s for s in self._free if s is not seat]
        return seat.picked


def system_prompt(i: int, words: int) -> str:
    return " ".join(f"sys{i}w{k}" for k in range(words))


def turn(client: OpenAI, messages: list[dict], gauge: Gauge | None = None) -> tuple[str, float, str]:
    """(x-request-id, TTFT in s, answer) of one streamed chat completion."""
    rid = uuid.uuid4().hex
    if gauge:
        gauge.add(1)
    try:
        started, ttft, parts = time.perf_counter(), None, []
        for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=OUTPUT_TOKENS,
                                                    stream=True, extra_headers={"x-request-id": rid}):
            if chunk.choices and chunk.choices[0].delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - started
                parts.append(chunk.choices[0].delta.content)
    finally:
        if gauge:
            gauge.add(-1)
    if ttft is None:
        raise RuntimeError(f"request {rid} streamed no text")
    return rid, ttft, "".join(parts)


@dataclass(frozen=True)
class Users:
    """Who sends: ``count`` users, each with conversations of ``turns`` turns over ``prompts`` shared
    system prompts of ``system_words`` words; paced by ``pacer``, or a closed loop without one."""
    count: int
    prompts: int
    system_words: int
    turns: tuple[int, int]
    pacer: Pacer | None = None


def conversation_loop(client: OpenAI, users: Users, worker: int, stop_at: float, gauge: Gauge | None,
                      out: list[Turn], errors: list[str] | None = None) -> None:
    """One user: conversations back to back until ``stop_at``, each on one of the shared system
    prompts, each turn adding the answer and a new question. With ``errors``, a turn that fails is
    counted there by its exception's name and the user starts a new conversation; without, it raises."""
    rng = random.Random(worker)
    n = 0
    while time.monotonic() < stop_at:
        conv, n = f"w{worker}c{n}", n + 1
        messages = [{"role": "system", "content": system_prompt(rng.randrange(users.prompts), users.system_words)},
                    {"role": "user", "content": f"conversation {conv}: the first question"}]
        for index in range(rng.randint(*users.turns)):
            if users.pacer is not None and not users.pacer.wait() or time.monotonic() >= stop_at:
                return
            try:
                rid, ttft, answer = turn(client, messages, gauge)
            except Exception as exc:
                if errors is None:
                    raise
                errors.append(type(exc).__name__)
                break
            out.append(Turn(conv, index, rid, ttft))
            messages += [{"role": "assistant", "content": answer},
                         {"role": "user", "content": f"question {index + 2} of {conv}"}]


def sample_load(scheduler: str, gauge: Gauge, stop: threading.Event) -> None:
    with grpc.insecure_channel(scheduler) as ch:
        stub = scheduler_pb2_grpc.SchedulerStub(ch)
        while not stop.wait(0.2):
            table = stub.ListEndpoints(scheduler_pb2.ListEndpointsRequest(), timeout=2)
            gauge.engines.append(sum(e.load.running for e in table.endpoints if e.healthy))
            gauge.waiting.append(sum(e.load.waiting for e in table.endpoints if e.healthy))
            gauge.client.append(gauge.in_flight)


def loaded(client: OpenAI, scheduler: str, users: Users, duration_s: float) -> tuple[list[Turn], Gauge, float]:
    """The users for ``duration_s``, load sampled meanwhile: their turns, the gauge, and the
    turns a second that ended within the window."""
    gauge, out, stop = Gauge(), [], threading.Event()
    sampler = threading.Thread(target=sample_load, args=(scheduler, gauge, stop), daemon=True)
    began = time.monotonic()
    stop_at = began + duration_s
    threads = [threading.Thread(target=conversation_loop, args=(client, users, w, stop_at, gauge, out, gauge.errors))
               for w in range(users.count)]
    if users.pacer is not None:
        threads.append(threading.Thread(target=users.pacer.run, args=(stop_at,)))
    sampler.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ended = len(out)  # every turn was appended when its answer ended; the last ones after stop_at
    stop.set()
    sampler.join()
    return out, gauge, round(ended / (time.monotonic() - began), 2)


def occupancy(gauge: Gauge, slots: int) -> dict:
    def mean(xs: list[int]) -> float | None:
        return round(statistics.fmean(xs) / slots, 3) if xs else None

    return {"slots": slots, "samples": len(gauge.client), "client_in_flight_share": mean(gauge.client),
            "engines_running_share": mean(gauge.engines),
            "engines_waiting_mean": round(statistics.fmean(gauge.waiting), 2) if gauge.waiting else None}
