"""The smoke's checks against the running compose mesh, from the host through published ports
(127.0.0.1) and from containers with the CLI. Each returns a detail string or raises."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from llmesh.client import Client
from tests.compose_smoke.mesh import KEY, ComposeMesh

MODEL = "smollm2-135m-instruct"
TENANT = "demo"  # deploy/compose/llmesh.yaml grants it the model
PROMPT = [{"role": "user", "content": "Name three planets."}]
SERVICES = {"gateway", "scheduler", "modelmgr", "cache", "engine"}
# The CLI's mesh identity, made by mesh-certs (compose.yaml), for the model manager's admin methods.
CLI_TLS = {"LLMESH_TLS_CERT_FILE": "/certs/cli.pem", "LLMESH_TLS_KEY_FILE": "/certs/cli-key.pem"}


class CheckFailed(Exception):
    pass


def expect(cond: object, msg: str) -> None:
    if not cond:
        raise CheckFailed(msg)


@dataclass
class Context:
    mesh: ComposeMesh
    key: str = ""
    t_up: float = 0.0  # monotonic time `up` started
    times: dict[str, float] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.mesh.ports.http}/v1"

    def openai(self, key: str | None = None) -> OpenAI:
        return OpenAI(base_url=self.base_url, api_key=key or self.key, max_retries=0, timeout=120)


def api_key_gates(ctx: Context) -> str:
    """A key made with the CLI in the gateway's container; no key 401, a wrong one 401, the key 200."""
    made = ctx.mesh.exec("gateway", "llmesh", "keys", "create", "--tenant", TENANT)
    found = KEY.search(made.stdout)
    expect(made.returncode == 0 and found, f"llmesh keys create: rc {made.returncode}: {made.stdout[-400:]}")
    ctx.key = found.group(0)
    body = {"model": MODEL, "messages": PROMPT, "max_tokens": 8, "stream": True}
    url = f"{ctx.base_url}/chat/completions"
    codes = {}
    with httpx.Client(timeout=120) as http:
        codes["none"] = http.post(url, json=body).status_code
        codes["wrong"] = http.post(url, json=body, headers={"authorization": "Bearer llm_wrong"}).status_code
        with http.stream("POST", url, json=body, headers={"authorization": f"Bearer {ctx.key}"}) as answer:
            codes["key"] = answer.status_code
            for line in answer.iter_lines():
                if '"content"' in line:  # the mesh's first token
                    ctx.times.setdefault("first_token_since_up_s", time.monotonic() - ctx.t_up)
    expect(codes == {"none": 401, "wrong": 401, "key": 200}, f"status codes {codes}")
    return f"no key 401, a wrong key 401, the CLI's key 200 (tenant {TENANT})"


def openai_chat(ctx: Context) -> str:
    answer = ctx.openai().chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=24, temperature=0)
    text = answer.choices[0].message.content or ""
    expect(text.strip() and answer.usage and answer.usage.completion_tokens > 0, f"empty answer {answer}")
    return f"{answer.usage.completion_tokens} tokens: {text.strip()[:40]!r}"


def openai_stream(ctx: Context) -> str:
    start = time.monotonic()
    first = None
    parts, finish = [], None
    for chunk in ctx.openai().chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=24, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.monotonic()
            parts.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    expect(first and finish, f"stream: {len(parts)} deltas, finish {finish}")
    ctx.times["stream_ttft_s"] = first - start
    return f"{len(parts)} deltas, finish {finish}, first token after {first - start:.2f} s"


def grpc_client(ctx: Context) -> str:
    with Client(f"127.0.0.1:{ctx.mesh.ports.grpc}", credential=ctx.key, timeout_s=120) as client:
        result = client.chat(model=MODEL, messages=PROMPT, max_tokens=16, temperature=0)
    expect(result.text.strip() and result.usage.completion_tokens > 0, f"gRPC answer {result}")
    return f"Chat over gRPC: {result.usage.completion_tokens} tokens, finish {result.finish_reason}"


def prometheus_scraped(ctx: Context) -> str:
    """Every target up, and every service among them (both engines), within a minute."""
    url = f"http://127.0.0.1:{ctx.mesh.ports.prometheus}/api/v1/targets"
    deadline = time.monotonic() + 60
    while True:
        targets = httpx.get(url, timeout=10).json()["data"]["activeTargets"]
        down = [f"{t['scrapeUrl']}: {t['health']} {t.get('lastError', '')}" for t in targets if t["health"] != "up"]
        services = [t["labels"].get("service") for t in targets]
        ok = not down and SERVICES <= set(services) and services.count("engine") >= 2
        if ok or time.monotonic() > deadline:
            break
        time.sleep(3)
    expect(ok, f"targets down {down}, services {sorted(map(str, services))}")
    return f"{len(targets)} targets up: {', '.join(sorted(map(str, services)))}"


# (question, paraphrase): MiniLM puts each pair at a cosine of 0.99 and no guard refuses it
PARAPHRASES = [("How do I cancel my subscription?", "How can I cancel my subscription?"),
               ("How do I reset my password?", "How can I reset my password?"),
               ("How do I change my email address?", "How can I change my email address?")]


def _metric(ctx: Context, service: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples with ``labels`` on ``service``'s own metrics port, read from
    inside its container (the port is published to no one)."""
    code = ("import urllib.request;print(urllib.request.urlopen("
            f"'http://{service}:9090/metrics', timeout=10).read().decode())")
    out = ctx.mesh.exec(service, "python", "-c", code)
    expect(out.returncode == 0, f"{service} metrics: {out.stdout[-300:]}")
    return sum(s.value for family in text_string_to_metric_families(out.stdout) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _semantic_hits(ctx: Context) -> tuple[float, float]:
    """The cache service's own counts of semantic hits: in time, and late (the gateway had given up)."""
    return (_metric(ctx, "cache", "llmesh_cache_lookups_total", result="hit_semantic"),
            _metric(ctx, "cache", "llmesh_cache_late_lookups_total", result="hit_semantic"))


def semantic_cache(ctx: Context) -> str:
    """The cache container loaded its embedder (MiniLM, baked into the image): with the live config's
    cache in semantic mode, a paraphrase of a question answered before is a semantic hit in the cache
    service's own count. Without an embedder semantic mode matches exactly only: none would be.

    The counts, not the answer's header: a semantic lookup (the paraphrase embedded on the cache's
    CPU) can outlast the gateway's lookup budget on a busy machine, and the engine answers then; the
    cache still ends the lookup and counts it as late. A paraphrase is asked once only (a miss stores
    it); a question answered before the cache service applied the mode is stored without its
    embedding, so a miss moves on to the next pair."""
    def mode(value: str) -> None:
        done = ctx.mesh.exec("gateway", "llmesh", "config", "set", "cache.mode", value)
        expect(done.returncode == 0, f"config set cache.mode {value}: {done.stdout[-300:]}")

    client = ctx.openai()

    def ask(question: str) -> str | None:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=8)
        return raw.headers.get("x-llmesh-cache")

    before = _semantic_hits(ctx)

    def new_hits() -> list[float]:
        return [now - then for now, then in zip(_semantic_hits(ctx), before, strict=True)]

    mode("semantic")
    missed = []
    try:
        time.sleep(2)  # the services apply the config's revision
        for question, paraphrase in PARAPHRASES:
            deadline = time.monotonic() + 10
            while ask(question) != "hit" and time.monotonic() < deadline:
                time.sleep(0.5)  # the answer is stored behind it, with its embedding
            time.sleep(1)  # the semantic entry is written and indexed after the exact one
            header = ask(paraphrase)
            counted = time.monotonic() + 5  # a late lookup may still be embedding on a busy CPU
            while not any(hits := new_hits()) and time.monotonic() < counted:
                time.sleep(0.5)
            in_time, late = hits
            if in_time or late:
                when = "in time" if in_time else "late: after the gateway had given up"
                return (f"{paraphrase!r} a semantic hit in the cache after {question!r} ({when}; the answer's "
                        f"header: {header}; {len(missed)} pair(s) missed first): MiniLM loaded in the cache container")
            missed.append(paraphrase)
    finally:
        mode("exact")  # the default again, for the checks after this one
    lookups = [r for r in _records(ctx.mesh.logs("gateway", tail=2000)) if r.get("msg") == "cache lookup failed"]
    raise CheckFailed(f"no paraphrase was a semantic hit ({missed}): no embedder? the gateway's failed cache "
                      f"lookups: {len(lookups)} {lookups[-3:]}; cache logs: {ctx.mesh.logs('cache', tail=20)[-1500:]}")


def models_deploy(ctx: Context) -> str:
    """`llmesh models import` and `deploy` with the CLI in the model manager's container; the version
    lands on an engine container and answers through the gateway."""
    cli = ["llmesh", "models", "--address", "modelmgr:50053"]
    gguf = "/var/lib/llmesh/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
    imp = ctx.mesh.exec("modelmgr", *cli, "import", "smollm2", gguf, "--quiet", env=CLI_TLS)
    expect(imp.returncode == 0, f"import: {imp.stdout[-400:]}")
    dep = ctx.mesh.exec("modelmgr", *cli, "deploy", "smollm2:1", env=CLI_TLS, timeout=600)
    expect(dep.returncode == 0, f"deploy: {dep.stdout[-600:]}")
    grant = ctx.mesh.exec("gateway", "llmesh", "config", "set", "tenants.demo.models",
                          f'["{MODEL}", "smollm2@1"]')
    expect(grant.returncode == 0, f"config set: {grant.stdout[-300:]}")
    time.sleep(2)  # the gateways apply the config's revision
    answer = ctx.openai().chat.completions.create(model="smollm2@1", messages=PROMPT, max_tokens=8)
    expect(answer.choices[0].message.content, f"smollm2@1 answered {answer}")
    fetched = {svc: rec for svc in ("engine-1", "engine-2") for rec in _records(ctx.mesh.logs(svc, tail=5000))
               if rec.get("msg") == "model fetched" and str(rec.get("model", "")).startswith("smollm2")}
    expect(fetched, "no engine logged 'model fetched' for smollm2: the version reached no engine over the wire")
    svc, rec = next(iter(fetched.items()))
    return (f"smollm2@1 deployed from modelmgr, fetched by {svc} over gRPC ({rec.get('bytes')} bytes, no shared "
            f"volume), answered: {answer.choices[0].message.content[:30]!r}")


def _records(logs: str) -> list[dict]:
    """The JSON log records in a container's output (llmesh logs one JSON object a line)."""
    out = []
    for line in logs.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


class Load:
    """Bounded load: `workers` threads of short streamed chats on the gateway, each counted."""

    def __init__(self, ctx: Context, workers: int = 3) -> None:
        self._ctx = ctx
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.ok, self.failed = 0, []
        self.durations: list[float] = []
        self._threads = [threading.Thread(target=self._work, daemon=True) for _ in range(workers)]

    def _work(self) -> None:
        client = self._ctx.openai()
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                    model=MODEL, messages=PROMPT, max_tokens=16, stream=True) if c.choices)
                with self._lock:
                    self.durations.append(time.monotonic() - start)
                    self.ok += 1 if text else 0
                    if not text:
                        self.failed.append("empty answer")
            except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
                with self._lock:
                    self.failed.append(f"{type(exc).__name__}: {str(exc)[:120]}")

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=180)


def _engine_generations(ctx: Context, service: str) -> float:
    """The engine's vllm:generation_tokens_total."""
    return _metric(ctx, service, "vllm:generation_tokens_total")


def engine_killed_under_load(ctx: Context) -> str:
    """engine-1's process SIGKILLed from the host (a crash: Docker's restart policy applies) while three
    clients stream; no request fails, engine-1 comes back healthy and serves again."""
    victim = "engine-1"
    before = ctx.mesh.container(victim)
    with Load(ctx) as load:  # from before the kill until the engine is healthy again
        time.sleep(5)
        os.kill(before["State"]["Pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        time.sleep(5)
        bad = ctx.mesh.wait_healthy([victim], timeout=180)
        back_s = time.monotonic() - killed_at
    expect(not bad, f"{victim} after the kill: {bad}")
    after = ctx.mesh.container(victim)
    expect(after["State"]["StartedAt"] != before["State"]["StartedAt"], f"{victim} was not restarted")
    expect(not load.failed and load.ok >= 3, f"{load.ok} ok, {len(load.failed)} failed: {load.failed[:3]}")
    # Back in routing: concurrent requests reach the restarted engine (its counters start at zero).
    deadline = time.monotonic() + 90
    served = 0.0
    while served <= 0 and time.monotonic() < deadline:
        with Load(ctx, workers=4) as again:
            time.sleep(5)
        expect(not again.failed, f"after the restart: {again.failed[:3]}")
        served = _engine_generations(ctx, victim)
    expect(served > 0, f"{victim} restarted but got no request within 90 s")
    ctx.times["engine_back_healthy_s"] = back_s
    return (f"{load.ok} streams ok (the longest {max(load.durations):.1f} s), 0 failed across the kill; "
            f"{victim} healthy again after {back_s:.0f} s "
            f"and generated {served:.0f} tokens since")
