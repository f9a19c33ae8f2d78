"""The response cache end to end: two gateway processes share one cache service on a
real redis-server (its own, so it can be stopped), a sim engine answers, the live
config is a watched YAML file, and the official `openai` client drives it."""

from __future__ import annotations

import concurrent.futures
import csv
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis
from openai import OpenAI

from llmesh.testing import RedisServer, Service, free_layout, free_ports, port_open, wait_until
from tests.e2e.conftest import sim_engine

MODEL = "sim-small"
CACHE_HEADER = "x-llmesh-cache"


class CacheMesh:
    def __init__(self, root: Path, minilm_dir: Path):
        self.root = root
        self.layout = free_layout(n_engines=1)
        self.config = root / "llmesh.yaml"
        self.config.write_text("cache: {mode: exact}\n")
        self.redis = RedisServer(root / "redis")
        self.http_b, self.grpc_b = free_ports(2)
        lay = self.layout
        self.keys_file = root / "keys.json"
        common = {"LLMESH_CONFIG_FILE": str(self.config), "LLMESH_DISCOVERY": "static",
                  "LLMESH_STATE_DIR": str(root / "state"), "LLMESH_GATEWAY_KEYS_FILE": str(self.keys_file)}
        self.cache = Service("llmesh.cache", {
            **common, "LLMESH_CACHE_PORT": str(lay.port("cache")), "LLMESH_CACHE_BACKEND": "redis",
            "LLMESH_CACHE_EMBED_MODEL_DIR": str(minilm_dir), "LLMESH_CACHE_STORE_PAUSE_S": "0.5",
            "LLMESH_CACHE_STORE_BUDGET_S": "0.25",  # a shared, busy machine: see the gateway's budget below
            "LLMESH_CACHE_NAMESPACE": "e2e"}, root / "cache.log")
        self.services = [
            Service("llmesh.scheduler", {**common, "LLMESH_SCHEDULER_PORT": str(lay.port("scheduler"))},
                    root / "scheduler.log"),
            self.cache,
            sim_engine("sim-0", lay.engine_address(0), root / "engine.log", model=MODEL, env=common,
                       scheduler_address=lay.address("scheduler"), sim_decode_ms_per_token=1, sim_output_tokens=16),
        ]
        for name, grpc_port, http_port in (("a", lay.port("gateway"), lay.http_port),
                                           ("b", self.grpc_b, self.http_b)):
            self.services.append(Service("llmesh.gateway", {
                **common, "LLMESH_GATEWAY_PORT": str(grpc_port), "LLMESH_GATEWAY_HTTP_PORT": str(http_port),
                "LLMESH_GATEWAY_SCHEDULER_ADDRESS": lay.address("scheduler"), "LLMESH_GATEWAY_MODELMGR_ADDRESS": "",
                "LLMESH_GATEWAY_CACHE_ADDRESS": lay.address("cache"),
                "LLMESH_GATEWAY_AUDIT_FILE": str(root / f"audit-{name}.jsonl"),  # usage without Redis
                # this machine is shared by several test runs: a budget that a busy core still meets
                "LLMESH_GATEWAY_CACHE_BUDGET_S": "0.5"}, root / f"gateway-{name}.log"))
        self.urls = [f"http://127.0.0.1:{lay.http_port}", f"http://127.0.0.1:{self.http_b}"]

    def start(self) -> None:
        self.redis.start()
        self.cache.env["LLMESH_CACHE_REDIS_URL"] = self.redis.url
        for svc in self.services:
            svc.start()
        assert wait_until(lambda: port_open(self.layout.port("cache")), 60), self.logs()
        for url in self.urls:
            assert wait_until(lambda: self._serves(url), 60), self.logs()

    @staticmethod
    def _serves(url: str) -> bool:
        try:
            return MODEL in httpx.get(url + "/v1/models", timeout=1).text
        except httpx.HTTPError:
            return False

    def client(self, i: int) -> OpenAI:
        return OpenAI(base_url=self.urls[i] + "/v1", api_key="none", max_retries=0)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.root.glob("*.log")))

    def stop(self) -> list[int]:
        codes = [svc.stop() for svc in reversed(self.services)]
        self.redis.stop()
        return codes


@pytest.fixture(scope="module")
def cmesh(tmp_path_factory, minilm_dir):
    m = CacheMesh(tmp_path_factory.mktemp("cachemesh"), minilm_dir)
    try:
        m.start()
        yield m
    finally:
        codes = m.stop()
    assert codes == [0] * len(codes), m.logs()


def ask(client: OpenAI, text: str, system: str | None = None, **kw):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages,
                                                           **{"temperature": 0, "max_tokens": 16, **kw})
    return raw.headers.get(CACHE_HEADER), raw.parse()


def stored(client: OpenAI, text: str, system: str | None = None) -> str:
    """Ask and wait until the answer is in the cache (the store runs after the answer)."""
    _, resp = ask(client, text, system)
    assert wait_until(lambda: ask(client, text, system)[0] == "hit", 5)
    return resp.choices[0].message.content


def write_config(m: CacheMesh, text: str) -> float:
    m.config.write_text(text)
    return time.monotonic()


def test_exact_hit_is_shared_by_two_gateways_and_marked(cmesh):
    a, b = cmesh.client(0), cmesh.client(1)
    header, first = ask(a, "Name three primary colours.")
    assert header is None
    assert wait_until(lambda: ask(b, "Name three primary colours.")[0] == "hit", 5)
    header, again = ask(b, "Name three primary colours.")
    assert header == "hit" and again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.completion_tokens == first.usage.completion_tokens
    assert ask(b, "Name three primary colours.", max_tokens=15)[0] is None  # another max_tokens: another key
    assert ask(b, "Name three primary colours.", temperature=0.7)[0] is None  # sampling: not cached


def test_a_repeated_request_shows_its_saving_in_llmesh_usage(cmesh):
    a = cmesh.client(0)
    tenant_rows = []

    def usage() -> list[dict]:
        done = subprocess.run([sys.executable, "-m", "llmesh", "usage", "--csv", "--audit-file",
                               str(cmesh.root / "audit-a.jsonl")], capture_output=True, text=True, timeout=60,
                              env={k: v for k, v in os.environ.items() if k != "LLMESH_REDIS_URL"})
        assert done.returncode == 0, done.stderr
        return [r for r in csv.DictReader(io.StringIO(done.stdout)) if r["model"] == MODEL]

    before = usage()
    _, first = ask(a, "List two prime numbers under ten.")
    assert wait_until(lambda: ask(a, "List two prime numbers under ten.")[0] == "hit", 5)
    header, again = ask(a, "List two prime numbers under ten.")
    assert header == "hit" and again.usage == first.usage  # the client sees the answer's usage

    def grew() -> bool:
        tenant_rows[:] = usage()
        return sum(int(r["cache_hits"]) for r in tenant_rows) >= sum(int(r["cache_hits"]) for r in before) + 2

    assert wait_until(grew, 10), tenant_rows  # the audit log is written behind the answers

    def added(column: str) -> int:
        return sum(int(r[column]) for r in tenant_rows) - sum(int(r[column]) for r in before)

    hits, misses = added("cache_hits"), added("requests") - added("cache_hits")
    assert misses >= 1 and added("saved_completion_tokens") == hits * first.usage.completion_tokens
    assert added("saved_prompt_tokens") == hits * first.usage.prompt_tokens  # each hit saved the answer's tokens
    assert added("completion_tokens") == misses * first.usage.completion_tokens  # only the misses spent any


def test_a_streamed_hit_reads_as_a_normal_stream(cmesh):
    text = stored(cmesh.client(0), "Describe the sea in one line.")
    raw = cmesh.client(1).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe the sea in one line."}], temperature=0,
        max_tokens=16, stream=True, stream_options={"include_usage": True})
    assert raw.headers.get(CACHE_HEADER) == "hit" and raw.headers["content-type"] == "text/event-stream"
    chunks = list(raw.parse())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_no_hit_across_system_prompts(cmesh):
    stored(cmesh.client(0), "What should I cook tonight?", system="You are a chef.")
    assert ask(cmesh.client(1), "What should I cook tonight?", system="You are a doctor.")[0] is None
    assert ask(cmesh.client(1), "What should I cook tonight?")[0] is None
    assert ask(cmesh.client(1), "What should I cook tonight?", system="You are a chef.")[0] == "hit"


def test_live_config_switches_the_cache_within_a_second_and_semantic_hits_are_shared(cmesh):
    a, b = cmesh.client(0), cmesh.client(1)
    stored(a, "How do I reset my password?")
    t0 = write_config(cmesh, "cache: {enabled: false}\n")
    assert wait_until(lambda: ask(b, "How do I reset my password?")[0] is None, 1.0, 0.02)
    assert time.monotonic() - t0 < 1.0
    t0 = write_config(cmesh, "cache: {mode: semantic, semantic_threshold: 0.8}\n")
    assert wait_until(lambda: ask(b, "How do I reset my password?")[0] == "hit", 1.0, 0.02)
    assert time.monotonic() - t0 < 1.0
    stored(a, "How do I cancel my subscription?")  # stored in semantic mode: with its embedding
    header, resp = ask(b, "How can I cancel my subscription?")
    assert header == "hit"
    assert ask(b, "How do I pause my subscription?")[0] is None  # a near miss the guards refuse
    stats = subprocess.run([sys.executable, "-m", "llmesh", "cache", "stats", "--json",
                            "--base-port", str(cmesh.layout.base_port)], capture_output=True, text=True, timeout=30)
    assert stats.returncode == 0, stats.stderr
    report = json.loads(stats.stdout)
    assert report["backend"] == "redis" and report["semantic_indexed"] >= 1
    assert report["tenants"]["default"]["semantic_hits"] >= 1


def test_hits_survive_a_cache_service_restart_and_requests_never_fail_meanwhile(cmesh):
    a, b = cmesh.client(0), cmesh.client(1)
    write_config(cmesh, "cache: {mode: semantic, semantic_threshold: 0.8}\n")
    assert wait_until(lambda: ask(b, "How can I cancel my subscription?")[0] == "hit", 2)
    stored(a, "Why is the sky blue?")
    assert cmesh.cache.stop() == 0
    header, resp = ask(b, "Why is the sky blue?")  # the cache is down: the engine answers
    assert header is None and resp.choices[0].message.content
    cmesh.cache.start()
    assert wait_until(lambda: ask(b, "Why is the sky blue?")[0] == "hit", 30), cmesh.logs()
    assert wait_until(lambda: ask(a, "Why does the sky look blue?")[0] == "hit", 10)  # semantic, index rebuilt


def test_fail_open_when_redis_stops_mid_load_and_cache_returns_after(cmesh):
    """Load for a fixed time on 8 threads, Redis stopped one second in: however fast
    the machine, requests run before and after the stop, and none fails."""
    clients = [cmesh.client(0), cmesh.client(1)]
    started = time.monotonic()
    stop_at, end_at = started + 1.0, started + 2.5

    def worker(w: int) -> list[tuple[str | None, float]]:
        done, i = [], 0
        while time.monotonic() < end_at:
            header, resp = ask(clients[w % 2], f"Tell me fact number {(w + i) % 8} about owls.")
            assert resp.choices[0].message.content
            done.append((header, time.monotonic()))
            i += 1
        return done

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(worker, w) for w in range(8)]
        time.sleep(max(0.0, stop_at - time.monotonic()))
        cmesh.redis.stop()  # mid-load
        stopped = time.monotonic()
        results = [r for f in futures for r in f.result(timeout=60)]  # raises if any request failed
    before = [h for h, t in results if t < stopped]
    after = [h for h, t in results if t > stopped + 0.1]
    assert "hit" in before and len(after) >= 20, (len(before), len(after))  # the stop fell inside the load
    assert ask(clients[0], "A question while Redis is away?")[1].choices[0].message.content
    cmesh.redis.start()
    assert wait_until(lambda: ask(clients[0], "After Redis came back?")[0] == "hit", 15), cmesh.logs()


def test_invalidate_verb_removes_entries_and_redis_holds_no_prompt(cmesh):
    write_config(cmesh, "cache: {mode: exact}\n")
    # The services run no metrics port here to report the revision; a config applies within a second
    # (test_live_config_switches_the_cache_within_a_second...). Until then the earlier tests' semantic
    # mode may still store a prompt (a loaded CI run did), so wait that second out and start clean.
    time.sleep(1.5)
    r = redis.Redis.from_url(cmesh.redis.url)
    try:
        r.flushdb()
    finally:
        r.close()
    canary = "alice.canary@example.com"
    a = cmesh.client(0)
    assert wait_until(lambda: ask(a, "Is the store open on Sunday?")[0] == "hit", 5)
    ask(a, f"My address is [EMAIL_1], not {canary}.")  # exact mode keeps digests and answers only
    time.sleep(0.3)
    r = redis.Redis.from_url(cmesh.redis.url)
    try:
        dump = b"".join(k + b"".join(r.hgetall(k).values()) if r.type(k) == b"hash" else k for k in r.keys("*"))
    finally:
        r.close()
    assert canary.encode() not in dump and b"Sunday" not in dump
    out = subprocess.run([sys.executable, "-m", "llmesh", "cache", "invalidate", "--tenant", "default",
                          "--base-port", str(cmesh.layout.base_port)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.startswith("removed "), out.stderr
    assert int(out.stdout.split()[1]) >= 1
    assert ask(a, "Is the store open on Sunday?")[0] is None


def test_a_grpc_hit_says_so_in_its_metadata(cmesh):
    import grpc

    from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

    stored(cmesh.client(0), "List two rivers.")
    req = gateway_pb2.ChatRequest(model=MODEL,
                                  messages=[common_pb2.ChatMessage(role="user", content="List two rivers.")],
                                  sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=16))
    with grpc.insecure_channel(f"127.0.0.1:{cmesh.grpc_b}") as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Chat(req, timeout=10)
        text = "".join(r.text for r in call)
        assert text and dict(call.initial_metadata()).get("x-llmesh-cache") == "hit"
    req.messages[0].content = "List three rivers."
    with grpc.insecure_channel(f"127.0.0.1:{cmesh.grpc_b}") as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Chat(req, timeout=10)
        list(call)
        assert "x-llmesh-cache" not in dict(call.initial_metadata())


def test_zero_cross_tenant_hits_through_the_gateways(cmesh):
    """Last in this module: the first API key ends the gateways' local mode. A key's tenant
    needs a grant in the config (an unknown tenant is refused)."""
    write_config(cmesh, "cache: {mode: semantic, semantic_threshold: 0.8}\ntenants: {acme: {}, globex: {}}\n")
    keys = {}
    for tenant in ("acme", "globex"):
        out = subprocess.run([sys.executable, "-m", "llmesh", "keys", "create", "--tenant", tenant,
                              "--keys-file", str(cmesh.keys_file)], capture_output=True, text=True, timeout=30,
                             env={**os.environ, "LLMESH_STATE_DIR": str(cmesh.root / "state")})
        assert out.returncode == 0, out.stderr
        keys[tenant] = out.stdout.strip().splitlines()[-1]
    for url, key in ((cmesh.urls[0], keys["acme"]), (cmesh.urls[1], keys["globex"])):
        assert wait_until(lambda: httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {key}"},
                                            timeout=5).status_code == 200, 10), cmesh.logs()
    acme = OpenAI(base_url=cmesh.urls[0] + "/v1", api_key=keys["acme"], max_retries=0)
    globex = OpenAI(base_url=cmesh.urls[1] + "/v1", api_key=keys["globex"], max_retries=0)
    for question in ("What is our refund policy?", "How do I delete my account?"):
        assert wait_until(lambda: ask(acme, question)[0] == "hit", 10), cmesh.logs()
    assert ask(acme, "How can I delete my account?")[0] == "hit"  # semantic, within the tenant
    assert ask(globex, "What is our refund policy?")[0] is None  # exact: not acme's entry
    assert ask(globex, "How can I delete my account?")[0] is None  # semantic: not acme's either
    stats = subprocess.run([sys.executable, "-m", "llmesh", "cache", "stats", "--json", "--tenant", "globex",
                            "--base-port", str(cmesh.layout.base_port)], capture_output=True, text=True, timeout=30)
    assert json.loads(stats.stdout)["tenants"]["globex"]["hits"] == 0
