"""Bookkeeping a client cannot blow up or bypass: request ids (a safe one kept, any other
replaced and kept escaped), the audit stage (every request gets its record, whatever its
values; a log that cannot be written is counted, and fails requests closed when asked),
model labels (unknown names are one label) and the authenticator's key cache (bounded
LRUs, made-up ids never pushing a real key out)."""

from __future__ import annotations

import secrets

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from llmesh.audit import MAX_STRING, AuditError, AuditLog, read_records, verify
from llmesh.errors import InvalidArgument, Unauthenticated, Unavailable
from llmesh.keys import FileKeyStore, new_key
from llmesh.request_id import KEPT_LENGTH, MAX_LENGTH, accept, safe
from llmesh.types import Message, Prompt, Sampling
from llmesh.gateway.context import Caller, CompletionRequest, Context
from llmesh.gateway.metrics import GatewayMetrics
from llmesh.gateway.pipeline import Pipeline
from llmesh.gateway.record import RequestRecord
from llmesh.gateway.stages.audit import AuditStage
from llmesh.gateway.stages.base import Stage
from llmesh.gateway.stages.auth import Authenticator


# ---- request ids

@pytest.mark.parametrize("value", ["abc", "0f" * 16, "req_01HZX:a/b+c=d@e.f-g", "x" * MAX_LENGTH])
def test_a_safe_request_id_is_kept(value):
    assert accept(value) == (value, None)


@pytest.mark.parametrize("value, kept", [
    ("x" * (MAX_LENGTH + 1), "x" * KEPT_LENGTH),
    ("has space", "has space"),
    ("caf\xe9", "caf\\xe9"),
    ("\u2603\U0001f600", "\\u2603\\U0001f600"),
    ("a\x00b\nc", "a\\x00b\\nc"),
])
def test_any_other_is_replaced_and_kept_escaped(value, kept):
    rid, client = accept(value)
    assert safe(rid) and rid != value and client == kept


def test_no_id_or_an_empty_one_gets_a_new_one():
    for value in (None, ""):
        rid, client = accept(value)
        assert len(rid) == 32 and safe(rid) and client is None


@given(st.text(max_size=3000))
def test_every_value_gives_a_safe_id_and_a_short_printable_copy(value):
    rid, client = accept(value)
    assert safe(rid) and len(rid) <= MAX_LENGTH
    if client is None:
        assert rid == value or not value
    else:
        assert len(client) <= KEPT_LENGTH and client.isascii() and client.isprintable()


# ---- the audit stage

def context(request_id: str = "r1", model: str = "m", **record) -> Context:
    req = CompletionRequest(request_id=request_id, tenant="acme", model=model, timeout_s=1,
                            prompt=Prompt(messages=(Message("user", "a secret prompt"),)), sampling=Sampling(),
                            caller=Caller(tenant="acme", subject="alice", method="jwt",
                                          groups=tuple(f"group-{i}-" + "g" * 300 for i in range(50))))
    return Context(req, RequestRecord(model=model, tenant="acme", **record), None)


async def test_oversized_values_are_fitted_and_the_request_still_gets_its_record(tmp_path):
    failures = []
    with AuditLog(tmp_path / "a.jsonl") as log:
        stage = AuditStage(log, on_failure=lambda: failures.append(1))
        await stage.finish(context(model="m" * 5000, reason="x" * 1000, client_request_id="c" * 128,
                                   pii={f"kind{i}": i for i in range(100)}))
    records = [r["fields"] for r in read_records(tmp_path / "a.jsonl")]
    assert len(records) == 1 and not failures and verify(tmp_path / "a.jsonl").ok
    fields = records[0]
    assert fields["model"] == "m" * MAX_STRING and fields["reason"] == "x" * MAX_STRING
    assert len(fields["groups"]) == 32 and all(len(g) == MAX_STRING for g in fields["groups"])
    assert len(fields["pii"]) == 32 and fields["client_request_id"] == "c" * 128
    assert "secret" not in (tmp_path / "a.jsonl").read_text()


async def test_a_value_the_log_cannot_encode_still_leaves_the_core_record(tmp_path):
    with AuditLog(tmp_path / "a.jsonl") as log:
        await AuditStage(log).finish(context(model="bad\ud800surrogate"))
    (record,) = [r["fields"] for r in read_records(tmp_path / "a.jsonl")]
    assert record["request_id"] == "r1" and record["model"] == "bad\\ud800surrogate"
    assert set(record) == {"request_id", "tenant", "model", "operation", "status", "decision"}


@pytest.mark.parametrize("required", [False, True])
async def test_a_log_that_cannot_be_written_is_counted_and_fails_closed_when_required(required):
    lost, failures = [], []
    log = AuditLog("/dev/full", on_lost=lost.append)  # every write: ENOSPC, as a full disk
    stage = AuditStage(log, required=required, on_failure=lambda: failures.append(1))
    first = context("r1")
    await stage.admit(first)  # nothing has failed yet
    await stage.finish(first)
    with pytest.raises(AuditError):
        log.flush()
    assert lost == [1] and not log.writable
    second = context("r2")
    if required:
        with pytest.raises(Unavailable) as info:
            await stage.admit(second)
        assert info.value.reason == "audit_unavailable"
    else:
        await stage.admit(second)  # served, and its record counted as not written
    await stage.finish(second)
    assert failures == [1]
    with pytest.raises(AuditError):
        log.close()


class Remembers(Stage):
    """A stage that keeps no record of front refusals (the default): its finish must not run."""
    def __init__(self) -> None:
        self.finished: list[str] = []

    async def finish(self, ctx: Context) -> None:
        self.finished.append(ctx.req.request_id)


async def test_a_request_the_front_refused_gets_one_record_and_is_counted(tmp_path):
    observed: list[RequestRecord] = []
    other = Remembers()
    with AuditLog(tmp_path / "a.jsonl") as log:
        pipeline = Pipeline(None, None, None, stages=[AuditStage(log), other],  # type: ignore[arg-type]
                            observe=observed.append)
        pipeline.refused(CompletionRequest.unread("r9", "text_completion", "client's id"),
                         InvalidArgument("The request body is not valid JSON.", param="body"))
        await pipeline.drain()
    (record,) = [r["fields"] for r in read_records(tmp_path / "a.jsonl")]
    assert record["request_id"] == "r9" and record["operation"] == "text_completion"
    assert record["status"] == "invalid_argument" and record["decision"] == "refused"
    assert record["client_request_id"] == "client's id" and record["model"] == "" and record["tenant"] == ""
    assert [(r.status, r.model) for r in observed] == [("invalid_argument", "")]
    assert other.finished == []


# ---- metric labels

def test_a_model_the_gateway_does_not_know_is_one_label():
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry, known=lambda model: model == "real")
    for i in range(500):
        metrics.observe(RequestRecord(model=f"made-up-{i}", tenant="", status="not_found"))
    metrics.observe(RequestRecord(model="real", tenant="acme"))
    models = {s.labels["model"] for m in registry.collect() for s in m.samples if "model" in s.labels}
    assert models == {"unknown", "real"}


# ---- the key cache

class CountingStore(FileKeyStore):
    def __init__(self, path):
        super().__init__(path)
        self.reads: list[str] = []

    async def get(self, key_id):
        self.reads.append(key_id)
        return await super().get(key_id)


async def test_the_key_cache_is_bounded_and_made_up_ids_never_push_a_real_key_out(tmp_path):
    store = CountingStore(tmp_path / "keys.json")
    plaintext, record = new_key("acme")
    await store.put(record)
    sizes: dict[str, int] = {}
    auth = Authenticator(store, cache_s=3600, max_keys=8, max_unknown=16,
                         on_size=lambda kind, n: sizes.__setitem__(kind, n))
    assert (await auth.authenticate(plaintext)).tenant == "acme"
    for _ in range(2000):
        with pytest.raises(Unauthenticated):
            await auth.authenticate(f"llm_{secrets.token_hex(6)}_{secrets.token_hex(8)}")
    assert auth.cache_sizes() == {"known": 1, "unknown": 16} == sizes
    reads = len(store.reads)
    assert (await auth.authenticate(plaintext)).tenant == "acme"
    assert len(store.reads) == reads  # still cached
    with pytest.raises(Unauthenticated):
        await auth.authenticate(f"llm_{'k' * 65}_{secrets.token_hex(8)}")
    assert len(store.reads) == reads  # an overlong id is not even looked up
