"""Shadow traffic and the confidence cascade on the real mesh, through the official
`openai` client: SmolLM2 on llama.cpp (real log probabilities) and the sim engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import pytest

from llmesh.testing import wait_until
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.e2e.conftest import SMOL

SIM = "sim-small"
ENV = {k: v for k, v in os.environ.items() if k != "LLMESH_REDIS_URL"}  # the file store
PROMPTS = ["What is the capital of France?", "Describe the colour of a quiet thought in exactly five words.",
           "What is 12 times 12?", "Invent a name for a purple zebra-like animal.", "Say hello.",
           "Translate 'good morning' into an imaginary language."]


def ask(client, prompt: str, **kw):
    return client.chat.completions.with_raw_response.create(
        model=kw.pop("model"), messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=8, **kw)


def use_config(client, live_config, text: str, name: str) -> None:
    live_config(text)
    assert name in {m.id for m in client.models.list()}


@pytest.fixture
def restore_config(client, live_config):
    yield
    live_config("default: {max_attempts: 2}\n")
    assert not {"smart", "assistant"} & {m.id for m in client.models.list()}


@pytest.mark.timeout(600)  # 16 llama.cpp answers; a busy shared machine makes each take seconds
def test_cascade_escalates_exactly_the_low_confidence_answers(client, mesh, live_config, restore_config):
    # Each prompt's confidence on the cheap model, asked directly (greedy: the same answer every time).
    confidence, direct = {}, {}
    for prompt in PROMPTS:
        resp = ask(client, prompt, model=SMOL, logprobs=True).parse()
        lps = [t.logprob for t in resp.choices[0].logprobs.content]
        confidence[prompt] = sum(lps) / len(lps)
        direct[prompt] = resp.choices[0].message.content
    ranked = sorted(confidence.values())
    assert ranked[0] < ranked[-1]  # real logprobs: the prompts differ in confidence
    mid = len(ranked) // 2
    threshold = (ranked[mid - 1] + ranked[mid]) / 2  # half the prompts under it, half over
    use_config(client, live_config, f"cascades:\n  smart: {{cheap: {SMOL}, strong: {SIM}, "
                                    f"min_confidence: {threshold!r}}}\n", "smart")
    escalated = set()
    for prompt in PROMPTS:
        raw = ask(client, prompt, model="smart")
        resp = raw.parse()
        low = confidence[prompt] < threshold
        assert raw.headers["x-llmesh-cascade"] == ("escalated" if low else "accepted"), (prompt, confidence)
        assert raw.headers["x-llmesh-model"] == (SIM if low else SMOL)
        assert float(raw.headers["x-llmesh-confidence"]) == pytest.approx(confidence[prompt], abs=1e-3)
        assert resp.model == "smart" and resp.choices[0].logprobs is None  # not asked for: not given
        if low:
            escalated.add(prompt)
            assert resp.choices[0].message.content != direct[prompt]  # the sim's words, not SmolLM2's
        else:
            assert resp.choices[0].message.content == direct[prompt]
    assert escalated == {p for p in PROMPTS if confidence[p] < threshold} and 0 < len(escalated) < len(PROMPTS)

    # Streamed: the decision is in the headers, before the first chunk; one model's text only.
    for prompt in (min(confidence, key=confidence.get), max(confidence, key=confidence.get)):
        with client.chat.completions.with_streaming_response.create(
                model="smart", messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=8,
                stream=True) as raw:
            assert raw.headers["x-llmesh-cascade"] == ("escalated" if prompt in escalated else "accepted")
            text = "".join(chunk.choices[0].delta.content or "" for chunk in raw.parse() if chunk.choices)
        assert (text == direct[prompt]) == (prompt not in escalated)
        # gRPC: the same decision in the initial metadata, before the first chunk
        with grpc.insecure_channel(mesh.layout.address("gateway")) as ch:
            call = gateway_pb2_grpc.GatewayStub(ch).Chat(gateway_pb2.ChatRequest(
                model="smart", messages=[common_pb2.ChatMessage(role="user", content=prompt)],
                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=8)), timeout=60)
            meta = dict(call.initial_metadata())
            assert "".join(c.text for c in call) == text
        assert meta["x-llmesh-cascade"] == ("escalated" if prompt in escalated else "accepted")
        assert meta["x-llmesh-model"] == (SIM if prompt in escalated else SMOL)


def report(mesh, alias: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "llmesh", "shadow", "report", alias, "--json",
                          "--dir", str(mesh.log_dir / "state" / "shadow")],
                         capture_output=True, text=True, timeout=30, env=ENV)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_shadow_report_after_traffic(client, mesh, live_config, restore_config):
    use_config(client, live_config, f"splits:\n  assistant:\n    targets: [{{model: {SMOL}, weight: 1}}]\n"
                                    f"shadows:\n  assistant: {{model: {SIM}, max_concurrency: 4}}\n", "assistant")
    for prompt in PROMPTS[:4]:
        assert ask(client, prompt, model="assistant").parse().choices[0].message.content
    with client.chat.completions.create(model="assistant", stream=True, max_tokens=8, temperature=0,
                                        messages=[{"role": "user", "content": PROMPTS[4]}]) as stream:
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert wait_until(lambda: report(mesh, "assistant")["count"] == 5, 20.0, interval_s=0.5)
    r = report(mesh, "assistant")
    assert r["dropped"] == 0 and r["compared"] == 5
    assert r["primary"]["models"] == [SMOL] and r["shadow"]["models"] == [SIM]
    assert r["primary"]["latency_p50_ms"] > 0 and r["shadow"]["latency_p95_ms"] >= r["shadow"]["latency_p50_ms"]
    assert r["primary"]["completion_tokens"] > 0 and r["shadow"]["completion_tokens"] == 5 * 8
    assert 0 <= r["similarity_min"] <= r["similarity_mean"] < 1 and r["share_different"] == 1.0
    # the records keep no prompt text
    stored = "".join(p.read_text() for p in (mesh.log_dir / "state" / "shadow").glob("*.jsonl"))
    assert not any(prompt in stored for prompt in PROMPTS)
    text = subprocess.run([sys.executable, "-m", "llmesh", "shadow", "report", "assistant",
                           "--dir", str(mesh.log_dir / "state" / "shadow")],
                          capture_output=True, text=True, timeout=30, env=ENV).stdout
    assert "5 copies recorded" in text and SIM in text
