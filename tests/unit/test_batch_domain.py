"""The Batch API's pure parts: input lines as OpenAI checks them, multipart bodies, the
local store's once-per-line results and paging, the runner's headroom rule."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from llmesh.errors import InvalidArgument
from llmesh.gateway.domain.batches.kv import DirKv
from llmesh.gateway.domain.batches.lines import parse_lines
from llmesh.gateway.domain.batches.runner import BatchRunner, RunnerSettings, line_id
from llmesh.gateway.fronts.multipart import parts


def line(custom_id: str, **over) -> bytes:
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                         "body": {"model": "m", "prompt": "hi"}, **over})


def test_lines_keep_order_and_skip_blank_ones():
    parsed = parse_lines(line("a") + b"\n\n" + line("b") + b"\n", max_lines=10)
    assert [(p.index, p.custom_id) for p in parsed] == [(0, "a"), (1, "b")]
    assert orjson.loads(parsed[0].body) == {"model": "m", "prompt": "hi"}


@pytest.mark.parametrize("content, says", [
    (line("a") + b"\n" + line("a"), "Line 2 of the file: the custom_id 'a' is not unique"),
    (line("a", extra=1), "unknown field 'extra'"),
    (line("", ), "'custom_id'"),
    (line("a" * 513), "'custom_id'"),
    (b"[1]", "not a JSON object"),
])
def test_a_bad_line_is_named(content, says):
    with pytest.raises(InvalidArgument) as caught:
        parse_lines(content, max_lines=10)
    assert says in caught.value.message and caught.value.param == "file"


def test_the_line_cap_counts_requests():
    with pytest.raises(InvalidArgument, match="at most 2"):
        parse_lines(b"\n".join(line(str(i)) for i in range(3)), max_lines=2)


def test_multipart_parts_by_name():
    body = (b"--XyZ\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
            b"Content-Type: application/octet-stream\r\n\r\nline1\r\nline2\r\n--XyZ--\r\n")
    found = parts(body, "multipart/form-data; boundary=XyZ")
    assert found["purpose"].data == b"batch"
    assert (found["file"].filename, found["file"].data) == ("in.jsonl", b"line1\r\nline2")
    with pytest.raises(InvalidArgument):
        parts(body[:-10], "multipart/form-data; boundary=XyZ")
    with pytest.raises(InvalidArgument):
        parts(body, "application/json")


def test_multipart_edges():
    part = b"--XyZ\r\nContent-Disposition: form-data; name=\"p\"\r\n\r\n%s\r\n"
    ct = "multipart/form-data; boundary=XyZ"
    found = parts(bytearray(b"preamble\r\n" + part % b"one" + part % b"two" + b"--XyZ--"), ct)
    assert found["p"].data == b"one"                                       # the first of a name wins
    assert parts(part % b"" + b"--XyZ--", ct)["p"].data == b""             # an empty part
    for bad in (b"--XyZ--", b"no delimiter at all", part % b"x",          # no part, none, not closed
                part.replace(b"\r\n\r\n", b"\r\n") % b"x" + b"--XyZ--",  # no header block end
                part % (b"x" * 10) * 17 + b"--XyZ--",                       # over MAX_PARTS
                b"--XyZ\r\nContent-Type: text/plain\r\n\r\nx\r\n--XyZ--"):  # no name
        with pytest.raises(InvalidArgument):
            parts(bad, ct)


async def test_a_line_is_recorded_once_and_survives_a_restart(tmp_path):
    kv = DirKv(tmp_path)
    assert await kv.record("results:b", "0", "completed", b'{"first":1}')
    assert not await kv.record("results:b", "0", "failed", b'{"second":1}')
    assert await kv.record("results:b", "1", "failed", b'{"x":1}')
    again = DirKv(tmp_path)  # a gateway started again reads what was written
    assert await again.results("results:b") == {"0": ("completed", b'{"first":1}'), "1": ("failed", b'{"x":1}')}
    assert await again.counts("results:b") == {"completed": 1, "failed": 1}


async def test_swap_and_pages(tmp_path):
    kv = DirKv(tmp_path)
    await kv.put("k", b"1")
    assert await kv.swap("k", b"1", b"2") and not await kv.swap("k", b"1", b"3")
    assert await kv.get("k") == b"2"
    for i in range(5):
        await kv.index_add("ix", f"m{i}", i)
    assert await kv.index_page("ix", None, 2) == (["m4", "m3"], True)
    assert await kv.index_page("ix", "m3", 2) == (["m2", "m1"], True)
    assert await kv.index_page("ix", "m1", 2) == (["m0"], False)


def test_lines_in_flight_leave_the_headroom_free_within_the_bounds():
    room = [20]
    runner = BatchRunner(None, None, None, lambda: room[0], RunnerSettings(in_flight=8, busy_in_flight=1))
    assert runner.limit() == 8  # idle engines: up to in_flight
    room[0] = 3
    assert runner.limit() == 3  # what the headroom leaves
    room[0] = -4  # interactive work ate into the headroom: no line beyond busy_in_flight
    assert runner.limit() == 1
    assert line_id("batch_x", 3) == line_id("batch_x", 3) != line_id("batch_x", 4)


async def test_a_batch_whose_finalizing_worker_died_is_finalized_by_another(tmp_path):
    from llmesh.gateway.context import Caller
    from llmesh.gateway.domain.batches.model import Batch
    from llmesh.gateway.domain.batches.queue import LocalQueue
    from llmesh.gateway.domain.batches.store import BatchStore

    now = [1000.0]
    store = BatchStore(DirKv(tmp_path), wall=lambda: now[0])
    batch = Batch("batch_1", Caller("acme", "k", "api_key"), "/v1/completions", "file-x", "24h", 1000, 90000, 2)
    await store.add_batch(batch)
    batch = await store.move(await store.move(batch, "in_progress"), "finalizing")  # its worker died here
    await store.record("batch_1", 0, "completed", b'{"custom_id":"a"}')
    await store.record("batch_1", 1, "failed", b'{"custom_id":"b"}')
    runner = BatchRunner(store, LocalQueue(), None, lambda: 8, RunnerSettings(stale_finalizing_s=60),
                         clock=lambda: now[0])
    await runner.finish("batch_1")
    assert (await store.batch("batch_1")).status == "finalizing"  # not stale yet: its worker may be at it
    now[0] += 61
    await runner.finish("batch_1")
    done = await store.batch("batch_1")
    assert done.status == "completed" and done.counts == {"completed": 1, "failed": 1}
    assert await store.content("acme", done.output_file_id) == b'{"custom_id":"a"}\n'
    assert await store.content("acme", done.error_file_id) == b'{"custom_id":"b"}\n'


async def test_a_line_whose_run_raises_is_recorded_as_a_500_once(tmp_path):
    from llmesh.gateway.context import Caller
    from llmesh.gateway.domain.batches.lines import parse_lines
    from llmesh.gateway.domain.batches.model import Batch
    from llmesh.gateway.domain.batches.queue import LocalQueue
    from llmesh.gateway.domain.batches.store import BatchStore

    store, queue = BatchStore(DirKv(tmp_path)), LocalQueue()
    batch = Batch("batch_2", Caller("acme", "k", "api_key"), "/v1/completions", "file-x", "24h", 0, 2**40, 1)
    await store.add_batch(batch)
    await store.move(batch, "in_progress")
    await queue.push("batch_2", parse_lines(line("a"), 10))

    async def broken(*_):
        raise RuntimeError("a bug")
    runner = BatchRunner(store, queue, broken, lambda: 8, RunnerSettings())
    task = asyncio.create_task(runner.run())
    for _ in range(200):
        done = await store.batch("batch_2")
        if done.status == "completed":
            break
        await asyncio.sleep(0.01)
    task.cancel()
    assert done.status == "completed" and done.counts == {"completed": 0, "failed": 1}
    (result,) = (await store.content("acme", done.error_file_id)).splitlines()
    assert orjson.loads(result)["response"]["status_code"] == 500
