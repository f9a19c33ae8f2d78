"""``bench.fairness``'s virtual-time run: the same tenants, rates and phases in one process, on
``bench.virtual_time``'s clock, with the gateway's own flow control (``FlowController`` over the
real ``FairQueue``), its real picker fed engine reports every ``REPORT_S``, and real sim engine
backends (their batching and step timing). Per-request transport is left out, so a busy machine
cannot skew the figures: they are the policy's, not the host's."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

from llmesh.errors import LlmeshError
from llmesh.liveconfig.schema import MeshConfig
from llmesh.types import Message, Priority, Prompt
from llmesh.engine.backends.base import DecodeParams
from llmesh.engine.backends.sim import SimBackend, SimProfile
from llmesh.gateway.domain.fairness import Entry
from llmesh.gateway.stages.flow import CLASS_OF, FlowController
from llmesh.gateway.upstream.picking import Endpoint, EndpointPicker, PickInput
from bench.virtual_time import VirtualTimeLoop

MODEL = "sim-bench"
REPORT_S = 0.05  # engines' load reports reach the gateway's table this often
PROMPT = Prompt(messages=(Message("user", "tell me a story"),))


class Fleet:
    def __init__(self, engines: int, running: int, waiting: int, tokens: int, decode_ms: float, config: MeshConfig):
        profile = SimProfile(decode_ms_base=decode_ms, max_batch=running, output_tokens=2 * tokens)
        self.engines = {f"e{i}": SimBackend(MODEL, 1 << 16, profile) for i in range(engines)}
        self.inflight = {eid: 0 for eid in self.engines}
        self.running, self.waiting, self.tokens = running, waiting, tokens
        self.picker = EndpointPicker(rng=random.Random(0))
        self.config = config
        self.flow = FlowController(lambda: config, self._capacity, clock=lambda: asyncio.get_running_loop().time())
        self._report()

    def _capacity(self, model: str, embed: bool, engine_queue: int) -> tuple[int, int, int]:
        return self.picker.capacity(PickInput(model, asyncio.get_running_loop().time()), engine_queue)

    def _report(self) -> None:
        self.picker.replace_all(Endpoint(eid, eid, frozenset({MODEL}), running=min(n, self.running),
                                         waiting=max(n - self.running, 0), max_running=self.running,
                                         max_waiting=self.waiting) for eid, n in self.inflight.items())
        self.flow.poke()

    async def reporter(self) -> None:
        while True:
            await asyncio.sleep(REPORT_S)
            self._report()

    async def serve(self, tenant: str, deadline_s: float, max_tokens: int) -> tuple[float | None, int, str]:
        """(TTFT, tokens, refusal reason or '')."""
        loop = asyncio.get_running_loop()
        config, started = self.config, loop.time()
        priority = {"high": Priority.HIGH, "low": Priority.LOW}.get(config.tenant(tenant).priority or "",
                                                                    Priority.NORMAL)
        entry = Entry(tenant=tenant, klass=CLASS_OF[priority], cost=float(max_tokens + 5), arrived=started,
                      deadline=started + deadline_s, weight=config.tenant(tenant).weight)
        try:
            held = await self.flow.acquire(MODEL, entry, False)
        except LlmeshError as exc:
            return None, 0, exc.reason or "refused"
        ttft, n = None, 0
        endpoint = self.picker.pick(PickInput(MODEL, loop.time()), "least_loaded")
        assert endpoint is not None
        eid = endpoint.endpoint_id
        self.inflight[eid] += 1
        self.picker.acquire(eid, max_tokens)
        try:
            tokens = self.engines[eid].tokenize(PROMPT)
            async for _ in self.engines[eid].stream(tokens, DecodeParams(max_tokens, 0.0, 1.0, 0, priority=priority)):
                if ttft is None:
                    ttft = loop.time() - started
                n += 1
        finally:
            self.inflight[eid] -= 1
            self.picker.release(eid, max_tokens)
            if held:
                self.flow.done(MODEL, entry)
        return ttft, n, ""


async def _phase(fleet: Fleet, rates: dict[str, float], seconds: float, deadline_s: float, seed: int,
                 record: Callable[..., None]) -> None:
    loop = asyncio.get_running_loop()
    rng, t0 = random.Random(seed), loop.time()
    tasks: list[asyncio.Task] = []

    async def one(tenant: str, sent: float, max_tokens: int) -> None:
        ttft, tokens, reason = await fleet.serve(tenant, deadline_s, max_tokens)
        record(tenant, sent, ttft, tokens, reason, loop.time() - t0, max_tokens)

    async def arrivals(tenant: str, rate: float) -> None:
        t = rng.expovariate(rate)
        while t < seconds:
            await asyncio.sleep(max(0.0, t0 + t - loop.time()))
            max_tokens = rng.randint(fleet.tokens // 4, fleet.tokens * 7 // 4)  # answers of mixed lengths
            tasks.append(asyncio.create_task(one(tenant, loop.time() - t0, max_tokens)))
            t += rng.expovariate(rate)

    await asyncio.gather(*(arrivals(t, r) for t, r in rates.items() if r > 0))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def run_virtual(fleet_args: dict, config: MeshConfig, phases: list[tuple[dict[str, float], float]],
                deadline_s: float, record: Callable[[int], Callable[..., None]]) -> None:
    """Each phase on a fresh fleet; ``record(i)`` takes phase i's results."""
    async def main() -> None:
        for i, (rates, seconds) in enumerate(phases):
            fleet = Fleet(config=config, **fleet_args)
            tasks = [asyncio.create_task(fleet.reporter()), asyncio.create_task(fleet.flow.run())]
            await _phase(fleet, rates, seconds, deadline_s, i, record(i))
            for task in tasks:
                task.cancel()
            for backend in fleet.engines.values():
                await backend.close()

    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        runner.run(main())
