"""The Batch API on one machine (a directory and the in-process queue), driven by the
official openai client: files.create, batches.create/retrieve/list/cancel and
files.content run a batch end to end through the gateway's pipeline onto a sim engine."""

from __future__ import annotations

import asyncio
import io

import openai
import orjson
import pytest

from llmesh.gateway.domain.batches.model import ENDED
from tests.component.batch_gateway import batch_gateway

MODEL = "sim-small"


def jsonl(lines: list[dict]) -> bytes:
    return b"".join(orjson.dumps(line) + b"\n" for line in lines)


def chat_line(i: int, model: str = MODEL, **body) -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 4,
                     **body}}


def wait_ended(client: openai.OpenAI, batch_id: str, timeout_s: float = 60):
    import time
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ENDED:
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} did not end: {batch.status} {batch.request_counts}")


def run_batch(client: openai.OpenAI, lines: list[dict], endpoint: str = "/v1/chat/completions"):
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h",
                                 metadata={"job": "test"})


def file_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [orjson.loads(x) for x in client.files.content(file_id).content.splitlines()]


@pytest.fixture
async def gateway(tmp_path, engines):
    endpoint = await engines("e1", MODEL, sim_output_tokens=4)
    async with batch_gateway(tmp_path / "state", [endpoint]) as gw:
        yield gw


async def test_a_batch_runs_end_to_end_and_its_files_follow_openais_format(gateway):
    client = gateway.client("acme")
    lines = [chat_line(i) for i in range(20)] + [chat_line(20, model="no-such-model")]

    def scenario():
        created = run_batch(client, lines)
        assert created.status == "in_progress" and created.request_counts.total == 21
        assert created.metadata == {"job": "test"}
        done = wait_ended(client, created.id)
        return created, done
    created, done = await asyncio.to_thread(scenario)
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (20, 1)
    out = await asyncio.to_thread(file_lines, client, done.output_file_id)
    err = await asyncio.to_thread(file_lines, client, done.error_file_id)
    assert sorted(line["custom_id"] for line in out) == sorted(f"req-{i}" for i in range(20))
    for line in out:
        assert set(line) == {"id", "custom_id", "response", "error"} and line["error"] is None
        assert line["id"].startswith("batch_req_")
        response = line["response"]
        assert response["status_code"] == 200 and response["request_id"] == line["id"]
        assert response["body"]["object"] == "chat.completion" and response["body"]["choices"][0]["message"]
    (bad,) = err
    assert bad["custom_id"] == "req-20" and bad["response"]["status_code"] == 404
    assert bad["response"]["body"]["error"]["code"] == "model_not_found"
    listed = await asyncio.to_thread(lambda: client.batches.list(limit=10))
    assert [b.id for b in listed.data] == [created.id]
    output_meta = await asyncio.to_thread(client.files.retrieve, done.output_file_id)
    assert output_meta.purpose == "batch_output"
    await gateway.app.pipeline.drain()  # the audit stage's records of the lines, as for live requests
    audit_path = gateway.app.settings.audit_file or gateway.app._platform.settings.state_dir / "audit.jsonl"
    await asyncio.to_thread(gateway.app.audit.flush)
    records = [orjson.loads(x)["fields"] for x in audit_path.read_bytes().splitlines()]
    lines_audited = [r for r in records if r["request_id"].startswith("batch_req_")]
    assert len(lines_audited) == 21
    assert {(r["tenant"], r["priority"]) for r in lines_audited} == {("acme", "low")}


async def test_another_tenant_gets_404_for_files_and_batches(gateway):
    acme, globex = gateway.client("acme"), gateway.client("globex")

    def scenario():
        batch = run_batch(acme, [chat_line(0)])
        outcomes = []
        for call in (lambda: globex.batches.retrieve(batch.id), lambda: globex.batches.cancel(batch.id),
                     lambda: globex.files.retrieve(batch.input_file_id),
                     lambda: globex.files.content(batch.input_file_id),
                     lambda: globex.files.delete(batch.input_file_id),
                     lambda: globex.batches.create(input_file_id=batch.input_file_id,
                                                   endpoint="/v1/chat/completions", completion_window="24h")):
            with pytest.raises(openai.NotFoundError) as caught:
                call()
            outcomes.append(caught.value.status_code)
        assert globex.batches.list().data == [] and globex.files.list().data == []
        return outcomes
    assert await asyncio.to_thread(scenario) == [404] * 6


async def test_cancel_stops_the_rest(tmp_path, engines):
    slow = await engines("slow", MODEL, sim_output_tokens=50, sim_decode_ms_per_token=20)
    async with batch_gateway(tmp_path / "state", [slow], batch_in_flight=2) as gw:
        client = gw.client("acme")

        def scenario():
            batch = run_batch(client, [chat_line(i, max_tokens=50) for i in range(40)])
            import time
            while client.batches.retrieve(batch.id).request_counts.completed < 2:
                time.sleep(0.05)
            cancelling = client.batches.cancel(batch.id)
            assert cancelling.status == "cancelling"
            done = wait_ended(client, batch.id)
            return done, file_lines(client, done.output_file_id)
        done, out = await asyncio.to_thread(scenario)
    assert done.status == "cancelled" and done.cancelled_at is not None
    counts = done.request_counts
    assert counts.total == 40 and 2 <= counts.completed < 40 and counts.failed == 0
    assert len(out) == counts.completed and done.error_file_id is None  # lines not run are in neither file


BAD_FILES = {
    b"not json\n": "not valid JSON",
    jsonl([chat_line(0), chat_line(0)]): "not unique",
    jsonl([{**chat_line(0), "method": "GET"}]): "'method'",
    jsonl([{**chat_line(0), "url": "/v1/embeddings"}]): "'url'",
    jsonl([{**chat_line(0), "body": "hi"}]): "'body'",
    b"\n\n": "no requests",
}


async def test_bad_files_are_400s(tmp_path, engines):
    endpoint = await engines("e1", MODEL)
    async with batch_gateway(tmp_path / "state", [endpoint], batch_max_file_bytes=4096, batch_max_lines=3) as gw:
        client = gw.client("acme")

        def upload(content: bytes, purpose: str = "batch") -> str:
            with pytest.raises(openai.BadRequestError) as caught:
                client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose=purpose)
            assert caught.value.body["type"] == "invalid_request_error"
            return caught.value.body["message"]

        def scenario():
            for content, says in BAD_FILES.items():
                assert says in upload(content)
            assert "at most 4096 bytes" in upload(b"x" * 10_000)  # within the form's slack: read, then refused
            assert "larger than" in upload(b"x" * 100_000)  # past it: refused as it arrives
            assert "at most 3" in upload(jsonl([chat_line(i) for i in range(4)]))
            assert "purpose" in upload(jsonl([chat_line(0)]), purpose="fine-tune")
            good = client.files.create(file=("in.jsonl", io.BytesIO(jsonl([chat_line(0)]))), purpose="batch")
            with pytest.raises(openai.BadRequestError):
                client.batches.create(input_file_id=good.id, endpoint="/v1/embeddings", completion_window="24h")
            mismatched = client.batches.create(input_file_id=good.id, endpoint="/v1/completions",
                                               completion_window="24h")
            assert mismatched.status == "failed" and mismatched.errors.data[0].code == "mismatched_endpoint"
            assert client.files.list().data[0].id == good.id
        await asyncio.to_thread(scenario)


async def test_the_batch_example_runs(gateway):
    import os
    import sys
    from pathlib import Path
    example = Path(__file__).resolve().parents[2] / "examples" / "python" / "batch.py"
    client = gateway.client("acme")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(example), "--base-url", str(client.base_url).rstrip("/"), "--model", MODEL,
        "What is 2+2?", "Name a colour.", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "OPENAI_API_KEY": gateway.keys["acme"]})
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    lines = out.decode().splitlines()
    assert "completed, 2 of 2 completed, 0 failed" in lines[0]
    assert lines[1].startswith("What is 2+2? -> ") and lines[2].startswith("Name a colour. -> ")
    assert "(no result)" not in out.decode()


async def test_the_grpc_front_runs_the_same_operations(gateway):
    import grpc

    from llmesh.v1 import gateway_pb2 as pb
    from llmesh.v1 import gateway_pb2_grpc

    def auth(tenant: str) -> tuple:
        return (("authorization", f"Bearer {gateway.keys[tenant]}"),)
    async with grpc.aio.insecure_channel(gateway.app.grpc.bound_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        made = await stub.CreateFile(pb.CreateFileRequest(content=jsonl([chat_line(i) for i in range(3)]),
                                                          filename="in.jsonl", purpose="batch"), metadata=auth("acme"))
        assert made.file.id.startswith("file-") and made.file.purpose == "batch"
        batch = (await stub.CreateBatch(pb.CreateBatchRequest(
            input_file_id=made.file.id, endpoint="/v1/chat/completions", completion_window="24h",
            metadata={"via": "grpc"}), metadata=auth("acme"))).batch
        assert batch.status == "in_progress" and batch.request_counts.total == 3 and batch.metadata == {"via": "grpc"}
        for _ in range(600):
            batch = (await stub.GetBatch(pb.GetBatchRequest(batch_id=batch.id), metadata=auth("acme"))).batch
            if batch.status in ENDED:
                break
            await asyncio.sleep(0.05)
        assert batch.status == "completed" and batch.request_counts.completed == 3
        assert not batch.HasField("error_file_id") and batch.HasField("completed_at")
        content = (await stub.GetFileContent(pb.GetFileContentRequest(file_id=batch.output_file_id),
                                             metadata=auth("acme"))).content
        assert sorted(orjson.loads(x)["custom_id"] for x in content.splitlines()) == ["req-0", "req-1", "req-2"]
        page = await stub.ListBatches(pb.ListBatchesRequest(limit=5), metadata=auth("acme"))
        assert [b.id for b in page.data] == [batch.id] and not page.has_more
        files = await stub.ListFiles(pb.ListFilesRequest(), metadata=auth("acme"))
        assert {f.purpose for f in files.data} == {"batch", "batch_output"}
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.GetBatch(pb.GetBatchRequest(batch_id=batch.id), metadata=auth("globex"))
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.CreateFile(pb.CreateFileRequest(content=b"nope\n", purpose="batch"), metadata=auth("acme"))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "Line 1" in caught.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.ListBatches(pb.ListBatchesRequest(limit=101), metadata=auth("acme"))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.CancelBatch(pb.CancelBatchRequest(batch_id=batch.id), metadata=auth("acme"))
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # it completed
        deleted = await stub.DeleteFile(pb.DeleteFileRequest(file_id=made.file.id), metadata=auth("acme"))
        assert deleted.deleted and deleted.id == made.file.id
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.GetFile(pb.GetFileRequest(file_id=made.file.id), metadata=auth("acme"))
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_llmesh_batches_lists_and_shows_the_tenants_batches(gateway, capsys):
    from llmesh.cli.main import build_parser
    from llmesh.cli.batches import run

    client = gateway.client("acme")
    done = await asyncio.to_thread(lambda: wait_ended(client, run_batch(client, [chat_line(0)]).id))
    address = gateway.app.grpc.bound_address
    assert await run(build_parser().parse_args(["batches", "list"]), address, gateway.keys["acme"]) == 0
    (row,) = capsys.readouterr().out.splitlines()
    assert row.startswith(f"{done.id}  completed") and "1/1 done, 0 failed" in row and done.output_file_id in row
    assert await run(build_parser().parse_args(["batches", "show", done.id]), address, gateway.keys["acme"]) == 0
    shown = orjson.loads(capsys.readouterr().out)
    assert shown["id"] == done.id and shown["request_counts"] == {"total": 1, "completed": 1, "failed": 0}
    assert await run(build_parser().parse_args(["batches", "show", done.id]), address, gateway.keys["globex"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


async def test_a_revoked_key_stops_its_batchs_remaining_lines(tmp_path, engines):
    from llmesh.keys import new_key, revoke

    slow = await engines("slow", MODEL, sim_output_tokens=20, sim_decode_ms_per_token=20)
    async with batch_gateway(tmp_path / "state", [slow], batch_in_flight=2) as gw:
        plaintext, record = new_key("acme")  # a second key of the tenant, to read the batch after
        await gw.app.keys.put(record)
        client, reader = gw.client("acme"), gw.client("acme")
        reader.api_key = plaintext

        def start():
            return run_batch(client, [chat_line(i, max_tokens=20) for i in range(30)])
        batch = await asyncio.to_thread(start)
        while (await asyncio.to_thread(reader.batches.retrieve, batch.id)).request_counts.completed < 2:
            await asyncio.sleep(0.05)
        await revoke(gw.app.keys, gw.keys["acme"].split("_")[1])
        done = await asyncio.to_thread(wait_ended, reader, batch.id)
        errors = await asyncio.to_thread(file_lines, reader, done.error_file_id)
    assert done.status == "completed" and done.request_counts.failed > 0 and done.request_counts.completed < 30
    assert {e["response"]["status_code"] for e in errors} == {401}
    assert errors[0]["response"]["body"]["error"]["code"] == "key_revoked"


async def test_a_completions_batch(gateway):
    client = gateway.client("acme")
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": f"count to {i}", "max_tokens": 4, "stream": True}} for i in range(3)]

    def scenario():
        done = wait_ended(client, run_batch(client, lines, endpoint="/v1/completions").id)
        return done, file_lines(client, done.output_file_id)
    done, out = await asyncio.to_thread(scenario)
    assert done.status == "completed" and done.request_counts.completed == 3
    assert {line["response"]["body"]["object"] for line in out} == {"text_completion"}  # never streamed


async def test_a_gateway_started_again_takes_its_open_batches_up(tmp_path, engines):
    slow = await engines("slow", MODEL, sim_output_tokens=10, sim_decode_ms_per_token=20)
    async with batch_gateway(tmp_path / "state", [slow], batch_in_flight=2) as first:
        client = first.client("acme")
        batch = await asyncio.to_thread(run_batch, client, [chat_line(i, max_tokens=10) for i in range(20)])
        while (await asyncio.to_thread(client.batches.retrieve, batch.id)).request_counts.completed < 3:
            await asyncio.sleep(0.05)
        await first.app.batch_runner.stop(0)  # lines in flight cut short, as a process that dies
    async with batch_gateway(tmp_path / "state", [slow], batch_in_flight=2) as second:
        client = second.client("acme")
        assert (await asyncio.to_thread(client.batches.retrieve, batch.id)).request_counts.completed < 20
        done = await asyncio.to_thread(wait_ended, client, batch.id)
        out = await asyncio.to_thread(file_lines, client, done.output_file_id)
    assert done.status == "completed" and done.request_counts.completed == 20
    assert sorted(line["custom_id"] for line in out) == sorted(f"req-{i}" for i in range(20))  # each once
