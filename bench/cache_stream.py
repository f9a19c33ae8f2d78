"""A realistic FAQ stream through the gateway with ``cache.mode: semantic`` (``--parts stream``).

The stream comes from the labelled pairs (the held-out ones when there are any, else the
development ones): each distinct first question is asked once (the base set), then events in a
Zipf-like mix over the base questions, each an exact repeat, a paraphrase (a hit pair's second
question) or a near-miss (a miss pair's second question). Any text already asked is a repeat, which
the cache may rightly answer; a paraphrase asked the first time may be served (a semantic hit); a
near-miss asked the first time must not be (if ``x-llmesh-cache: hit`` comes back, a false hit).
Tokens and money saved are read back from the gateway's /metrics (``llmesh_cache_saved_*``),
never computed here. Then the added latency of a miss: time to first token of fresh questions,
the cache on and off in live config, alternating in blocks.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

import httpx

from bench.cache_split import load_split
from bench.common import note, pct

MIX = {"repeat": 0.5, "paraphrase": 0.3, "near_miss": 0.2}
PRICE = {"input_per_1k": 0.5, "output_per_1k": 1.5}  # what a token costs here: the saving is read back in it


def stream_events(rows: list[dict], n: int, seed: int = 7, zipf_s: float = 1.1) -> list[dict]:
    """The base questions once each, then ``n`` events: a base question by Zipf rank, then one of
    its repeat / paraphrase / near-miss by MIX (a repeat when the pair kind is missing). Each event
    says ``expect``: "hit" (a repeat of a text asked before), "may_hit" (a first paraphrase),
    "must_miss" (a first near-miss) or "miss" (a first base question)."""
    rng = random.Random(seed)
    base = list(dict.fromkeys(r["a"] for r in rows))
    rng.shuffle(base)
    para = {a: [r["b"] for r in rows if r["a"] == a and r["hit"]] for a in base}
    near = {a: [r["b"] for r in rows if r["a"] == a and not r["hit"]] for a in base}
    weights = [1 / (rank + 1) ** zipf_s for rank in range(len(base))]
    events = [{"text": a, "type": "base", "of": a} for a in base]
    for a in rng.choices(base, weights, k=n):
        kind = rng.choices(list(MIX), list(MIX.values()))[0]
        pool = para[a] if kind == "paraphrase" else near[a] if kind == "near_miss" else []
        if not pool:
            kind, pool = "repeat", [a]
        events.append({"text": rng.choice(pool), "type": kind, "of": a})
    asked: set[str] = set()
    for e in events:
        first = e["text"] not in asked
        asked.add(e["text"])
        e["expect"] = ("hit" if not first else "miss" if e["type"] in ("base", "repeat")
                       else "may_hit" if e["type"] == "paraphrase" else "must_miss")
    return events


def tally(events: list[dict]) -> dict:
    """Hit rates from the events' answers (``hit``: the response header said so)."""
    def count(expect: str, hit: bool | None = None) -> int:
        return sum(e["expect"] == expect and (hit is None or e["hit"] == hit) for e in events)

    repeats, paras, nears = count("hit"), count("may_hit"), count("must_miss")
    exact, semantic, false = count("hit", True), count("may_hit", True), count("must_miss", True)
    hits = sum(e["hit"] for e in events)
    return {"requests": len(events), "hits": hits, "hit_rate": round(hits / len(events), 3) if events else None,
            "repeats": repeats, "exact_hits": exact, "exact_hit_rate": round(exact / repeats, 3) if repeats else None,
            "first_paraphrases": paras, "semantic_hits": semantic,
            "semantic_hit_rate": round(semantic / paras, 3) if paras else None,
            "first_near_misses": nears, "false_hits": false,
            "false_hit_rate": round(false / nears, 3) if nears else None,
            "first_questions_hit": count("miss", True)}


def _metric(text: str, name: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    return {s.labels.get("kind", ""): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == name}


def saved(metrics_url: str) -> dict:
    text = httpx.get(metrics_url, timeout=5).text
    return {"tokens": _metric(text, "llmesh_cache_saved_tokens_total"),
            "usd": _metric(text, "llmesh_cache_saved_usd_total")}


def delta(after: dict, before: dict) -> dict:
    return {k: {kind: round(v - before[k].get(kind, 0.0), 6) for kind, v in after[k].items()} for k in after}


def _ask(client: httpx.Client, model: str, text: str, stream: bool = False) -> tuple[bool, float]:
    """One question: whether the cache answered it, and the time to the first answer bytes."""
    body = {"model": model, "messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": 16,
            "stream": stream}
    start = time.perf_counter()
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        first = None
        for _ in resp.iter_bytes():
            first = first or time.perf_counter() - start
        return resp.headers.get("x-llmesh-cache") == "hit", first or time.perf_counter() - start


def fresh_questions(n: int, asked: set[str]) -> list[str]:
    """Questions asked nowhere before, each a sure miss: they differ from one another in their
    numbers, which the number guard never lets one answer for another."""
    return [q for q in (f"What is {101 + 7 * i} plus {203 + 13 * i}?" for i in range(n)) if q not in asked]


def _config(cache_on: bool, model: str) -> str:
    cache = "{mode: semantic}" if cache_on else "{enabled: false}"
    return (f"cache: {cache}\nprices: {{{model}: {{input_per_1k: {PRICE['input_per_1k']}, "
            f"output_per_1k: {PRICE['output_per_1k']}}}}}\n")


def miss_latency(client: httpx.Client, mesh, path: Path, model: str, fresh: list[str], block: int) -> dict:
    """TTFT of first-asked questions, the cache on and off by turns (``block`` questions each turn)."""
    from llmesh.testing import write_config_file

    ttft: dict[str, list[float]] = {"on": [], "off": []}
    hits = 0
    for i in range(0, len(fresh), block):
        mode = ("on", "off")[(i // block) % 2]
        mesh.wait_for_config(write_config_file(path, _config(mode == "on", model)), 30)
        for text in fresh[i:i + block]:
            hit, first = _ask(client, model, text, stream=True)
            hits += hit
            if not hit:
                ttft[mode].append(first * 1000)
    out = {m: {"n": len(v), "p50_ms": round(pct(v, 50), 2), "p99_ms": round(pct(v, 99), 2)} if v else None
           for m, v in ttft.items()}
    added = round(out["on"]["p50_ms"] - out["off"]["p50_ms"], 2) if out["on"] and out["off"] else None
    return {"ttft_cache_on": out["on"], "ttft_cache_off": out["off"], "added_p50_ms": added, "hits_not_timed": hits}


def bench_stream(data: Path, engine: str, n: int, misses: int, model_root: Path) -> dict:
    from llmesh.testing import Mesh, free_layout, write_config_file

    files, rows = load_split(data)
    split = "heldout" if any(r["split"] == "heldout" for r in rows) else "dev"
    rows = [r for r in rows if r["split"] == split]
    events = stream_events(rows, n)
    asked = {e["text"] for e in events}
    fresh = fresh_questions(misses, asked)
    model = "smollm2-135m-instruct" if engine == "llamacpp" else "sim-small"
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "llmesh.yaml"
        write_config_file(config, _config(True, model))
        mesh = Mesh(layout=free_layout(1), engines=engine, model_dir=model_root.resolve(), log_dir=Path(tmp) / "logs",
                    env={"LLMESH_CONFIG_FILE": str(config), "LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": "25",
                         "LLMESH_ENGINE_SIM_OUTPUT_TOKENS": "16"})
        try:
            note(f"stream: starting the mesh ({engine} engine), {len(events)} requests")
            mesh.start()
            metrics_url = f"http://127.0.0.1:{mesh.metrics_ports()['gateway']}/metrics"
            with httpx.Client(base_url=mesh.layout.http_url, timeout=120) as client:
                _ready(client, model)
                before = saved(metrics_url)
                for e in events:
                    e["hit"] = _ask(client, model, e["text"])[0]
                time.sleep(0.5)  # the records are observed just after the answer
                gained = delta(saved(metrics_url), before)
                latency = miss_latency(client, mesh, config, model, fresh, max(1, misses // 6))
        finally:
            mesh.stop()
    return {"engine": engine, "model": model, "pairs_from": split, "files": files[split], "mix": MIX,
            "price": PRICE, **tally(events), "saved_from_gateway_metrics": gained, "miss_latency": latency}


def _ready(client: httpx.Client, model: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if client.post("/v1/chat/completions", json={"model": model, "max_tokens": 1, "messages": [
                {"role": "user", "content": "ready?"}]}).status_code != 503:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{model} was never served")
