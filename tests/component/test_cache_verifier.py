"""The verifier stage: the cache service in process over real gRPC (in-process store, real MiniLM)
puts semantic candidates above the verifier's recall-oriented threshold to a judge over HTTP, a
constrained yes/no question; only a yes in time serves the entry, the guards still veto first,
and each stage's verdicts are counted.

``ScriptedJudge`` is a FAKE judge: a small aiohttp server speaking OpenAI's chat completions that
answers what the test scripts (yes, no, garbage, or too late) and records the questions it got."""

from __future__ import annotations

import asyncio
import uuid

import orjson
import pytest
from aiohttp import web

from llmesh.liveconfig.schema import MeshConfig
from llmesh.platform import standalone_platform
from llmesh.cache.app import CacheApp
from llmesh.cache.config import CacheSettings
from tests.component.helpers import serving
from tests.component.test_cache_service import Running, query

STORED = "How do I reset my password?"
CLOSE = "How can I reset my password?"          # cosine ~0.99 with STORED
LOOSER = "password reset pls"                   # a paraphrase below the default threshold
OTHER_NUMBER = "How do I reset 2 passwords?"     # the number guard vetoes it


class ScriptedJudge:
    """FAKE: answers each chat completion with ``self.reply`` after ``self.delay_s``."""

    def __init__(self):
        self.reply = '{"same": "yes"}'
        self.delay_s = 0.0
        self.asked: list[dict] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.asked.append(body)
        await asyncio.sleep(self.delay_s)
        return web.json_response({"id": "j", "object": "chat.completion", "model": body["model"],
                                  "choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant", "content": self.reply}}]})


@pytest.fixture
async def judged(minilm_dir):
    fake = ScriptedJudge()
    web_app = web.Application()
    web_app.router.add_post("/v1/chat/completions", fake.handle)
    async with serving(web_app) as port:
        platform = standalone_platform("cache")
        platform.config.current = MeshConfig.model_validate({"cache": {
            "mode": "semantic", "verifier": {"enabled": True, "base_url": f"http://127.0.0.1:{port}/v1",
                                             "model": "judge", "candidate_threshold": 0.6, "timeout_s": 0.5}}})
        app = CacheApp(CacheSettings(port=0, namespace=f"t:{uuid.uuid4().hex}", embed_model_dir=minilm_dir,
                                     store_budget_s=1.0), platform)
        await app.start()
        r = Running(app)
        r.app_platform = platform
        yield r, fake
        await r.stop()


def verdicts(r: Running, stage: str, verdict: str) -> float:
    return r.app.metrics.verdicts.labels(stage, verdict)._value.get()


async def test_only_the_judges_yes_in_time_serves_a_candidate(judged):
    r, fake = judged
    assert await r.store(query(STORED), "Use the reset link.")
    assert (await r.lookup(query(STORED))).hit and fake.asked == []  # exact hits are never judged

    found = await r.lookup(query(LOOSER))  # under the default 0.85, over the verifier's 0.6
    assert found.hit and found.response.text == "Use the reset link."
    asked = fake.asked[-1]
    assert asked["model"] == "judge" and asked["temperature"] == 0
    assert asked["response_format"]["json_schema"]["schema"]["properties"]["same"]["enum"] == ["yes", "no"]
    question = asked["messages"][-1]["content"]
    assert STORED in question and LOOSER in question

    fake.reply = '{"same": "no"}'
    assert not (await r.lookup(query(CLOSE))).hit  # even a near-identical question: the judge said no
    fake.reply = "I am not sure"
    assert not (await r.lookup(query(CLOSE))).hit  # not a yes
    fake.reply, fake.delay_s = "yes", 2.0
    assert not (await r.lookup(query(CLOSE))).hit  # too late: a miss, within the budget
    fake.delay_s = 0.0
    assert (await r.lookup(query(CLOSE))).hit  # a plain "yes" is read too

    judged_before = len(fake.asked)
    assert not (await r.lookup(query(OTHER_NUMBER))).hit
    assert len(fake.asked) == judged_before  # the guard vetoed it: never put to the judge

    assert (verdicts(r, "judge", "yes"), verdicts(r, "judge", "no"), verdicts(r, "judge", "timeout")) == (2, 2, 1)
    assert verdicts(r, "guards", "passed") == 5 and verdicts(r, "guards", "refused") == 1


async def test_a_judge_that_is_away_makes_misses_not_failures(judged):
    r, fake = judged
    assert await r.store(query(STORED), "Use the reset link.")
    config = r.app_platform.config.current
    away = config.cache.verifier.model_copy(update={"base_url": "http://127.0.0.1:9/v1"})
    r.config(config.model_copy(update={"cache": config.cache.model_copy(update={"verifier": away})}))
    assert not (await r.lookup(query(CLOSE))).hit
    assert verdicts(r, "judge", "error") == 1
    assert (await r.lookup(query(STORED))).hit  # exact hits go on
    assert orjson.dumps(fake.asked) == b"[]"


async def test_the_bench_scores_pairs_as_the_cache_judges_them():
    from bench.cache import _judge_pairs, _verified
    from llmesh.liveconfig.schema import CacheVerifier
    fake = ScriptedJudge()
    web_app = web.Application()
    web_app.router.add_post("/v1/chat/completions", fake.handle)
    rows = [{"hit": True, "a": "q1", "b": "q1?", "sim": 0.9, "guard": None},
            {"hit": True, "a": "q2", "b": "q2?", "sim": 0.5, "guard": None},      # under the threshold
            {"hit": False, "a": "q3", "b": "q4", "sim": 0.95, "guard": "number"},  # vetoed: never judged
            {"hit": False, "a": "q5", "b": "q6", "sim": 0.8, "guard": None}]
    async with serving(web_app) as port:
        verifier = CacheVerifier(enabled=True, base_url=f"http://127.0.0.1:{port}/v1", model="judge",
                                 candidate_threshold=0.7, timeout_s=2.0)
        await _judge_pairs(rows, verifier)
    assert [r.get("judge") for r in rows] == ["yes", None, None, "yes"]
    assert len(fake.asked) == 2
    assert _verified(rows) == {"pairs": 4, "recall": 0.5, "false_hit_rate": 0.5, "precision": 0.5, "candidates": 2}
