"""The fronts bench's own parts: the profile's attribution of samples to components, and
the Python floor relay passing answers through byte for byte (real servers: the instant
OpenAI-compatible server and the relay, each in its own process)."""

import httpx

from bench import instant_openai, relay_floor
from bench.gateway_profile import LOOP, breakdown

MAIN = "run (uvloop/__init__.py:92);Runner.run (asyncio/runners.py:118);run_until_complete (loop.c:35410)"


def test_samples_go_to_their_innermost_component_and_idle_is_left_out():
    raw = "\n".join([
        f"{MAIN};uv_run (core.c:452);uv__io_poll (linux.c:1);epoll_wait (libc.so.6) 50",  # idle: not counted
        f"{MAIN};HttpFront.app (gateway/fronts/http.py:141);Pipeline.run (gateway/pipeline.py:254);"
        "ProviderClients._whole (gateway/upstream/providers.py:258);"
        "StreamWriter._writelines (aiohttp/http_writer.py:116);"
        "write (libc.so.6) 3",
        f"{MAIN};Pipeline.run (gateway/pipeline.py:232);GuardStage.admit (gateway/stages/guards.py:37);"
        "replace (dataclasses.py:1494);__init__ (<string>:2) 1",  # dataclasses count for their caller
        f"{MAIN};Handle__run (loop.c:70905) 1",
        "Thread.run (threading.py:975);AuditLog._write_loop (llmesh/audit.py:240) 9",  # another thread
    ])
    busy, shares = breakdown(raw)
    assert busy == 5
    assert shares == {"provider client (aiohttp, providers.py)": 60.0,
                      "guards: PII masking": 20.0, LOOP: 20.0}


def test_the_floor_relays_answers_byte_for_byte():
    body = {"model": "instant", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with instant_openai.running(4) as base_url, relay_floor.running(base_url + "/chat/completions") as (url, _):
        with httpx.Client(timeout=10) as client:
            for stream in (False, True):
                direct = client.post(base_url + "/chat/completions", json=dict(body, stream=stream))
                relayed = client.post(url, json=dict(body, stream=stream))
                assert relayed.status_code == direct.status_code == 200
                assert relayed.content == direct.content
                assert relayed.headers["content-type"] == direct.headers["content-type"]
