"""The Batch API on a real Redis: files and batch state in Redis, the lines on a stream with
a consumer group. Two gateways share one batch; one of them dies mid-batch (its dispatcher and
its lines in flight cut, nothing acknowledged) and the other claims what it held (XAUTOCLAIM
after batch_claim_idle_s): the batch completes with every custom_id exactly once."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import io

import orjson
import pytest
import redis.asyncio

from tests.component.batch_gateway import batch_gateway
from tests.component.conftest import SimEngines
from tests.component.test_batch_api import MODEL, chat_line, file_lines, jsonl, wait_ended

LINES = 60


@pytest.fixture
async def engines():
    started = SimEngines()
    yield started
    await started.stop_all()


async def test_a_worker_that_dies_mid_batch_loses_and_duplicates_nothing(tmp_path, redis_server, engines):
    client = redis.asyncio.Redis.from_url(redis_server.url)
    await client.flushdb()  # the queue's stream and group are the mesh's, one per Redis
    await client.aclose()
    endpoint = await engines("e1", MODEL, sim_output_tokens=10, sim_decode_ms_per_token=20, max_running=16)
    settings = dict(redis_url=redis_server.url, batch_in_flight=4, batch_claim_idle_s=1.0)
    async with contextlib.AsyncExitStack() as stack:
        a = await stack.enter_async_context(batch_gateway(tmp_path / "a", [endpoint], **settings))
        b = await stack.enter_async_context(batch_gateway(tmp_path / "b", [endpoint], **settings))
        b.keys = a.keys  # one key store (Redis): the keys made for b's tenants are there too
        api_a, api_b = a.client("acme"), b.client("acme")

        def start():
            uploaded = api_a.files.create(file=("in.jsonl", io.BytesIO(jsonl([chat_line(i) for i in range(LINES)]))),
                                          purpose="batch")
            return api_a.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
        batch = await asyncio.to_thread(start)
        while a.app.batch_runner.in_flight < 2:  # a holds lines now
            await asyncio.sleep(0.01)
        held = a.app.batch_runner.in_flight
        a.app._batch_task.cancel()  # a dies: it takes no more lines...
        await a.app.batch_runner.stop(0)  # ...and its lines in flight end unacknowledged
        done = await asyncio.to_thread(wait_ended, api_b, batch.id, 60)
        out = await asyncio.to_thread(file_lines, api_b, done.output_file_id)
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (LINES, LINES, 0)
    seen = collections.Counter(line["custom_id"] for line in out)
    assert seen == collections.Counter(f"req-{i}" for i in range(LINES))  # each once
    assert all(line["response"]["status_code"] == 200 for line in out)
    client = redis.asyncio.Redis.from_url(redis_server.url)
    pending = await client.xpending("llmesh:batch:queue", "llmesh-batches")
    await client.aclose()
    assert pending["pending"] == 0 and held >= 2  # a's lines were claimed and run by b


async def test_files_and_batches_live_in_redis_and_belong_to_their_tenant(tmp_path, redis_server, engines):
    endpoint = await engines("e1", MODEL, sim_output_tokens=4)
    async with batch_gateway(tmp_path / "a", [endpoint], redis_url=redis_server.url) as gw:
        acme, globex = gw.client("acme"), gw.client("globex")

        def scenario():
            uploaded = acme.files.create(file=("in.jsonl", io.BytesIO(jsonl([chat_line(0)]))), purpose="batch")
            batch = acme.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
            done = wait_ended(acme, batch.id)
            assert globex.batches.list().data == [] and globex.files.list().data == []
            return done, [b.id for b in acme.batches.list(limit=1).data], file_lines(acme, done.output_file_id)
        done, listed, out = await asyncio.to_thread(scenario)
    assert done.status == "completed" and listed == [done.id]
    client = redis.asyncio.Redis.from_url(redis_server.url)
    assert await client.exists(f"llmesh:batch:batch:{done.id}", f"llmesh:batch:file:{done.output_file_id}") == 2
    await client.aclose()
    assert orjson.loads(orjson.dumps(out[0]))["response"]["body"]["object"] == "chat.completion"
