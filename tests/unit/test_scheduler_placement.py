"""The scheduler's placement planner on plain inputs: bin-packing by memory, gang
placement of tensor-parallel replicas (all k GPUs on one node, or nothing), and
refusals that say why."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmesh.errors import ErrorCode, FailedPrecondition, InvalidArgument, LlmeshError, ResourceExhausted
from llmesh.scheduler.placement import Ask, Node, plan

GIB = 2**30


def gpu_node(eid, *free_gib, models=(), load=0, backend="vllm", tp=0):
    return Node(eid, f"10.0.0.{eid[-1]}:50051", backend, tuple(models), tuple(int(f * GIB) for f in free_gib),
                64 * GIB, load, tp)


def cpu_node(eid, free_gib, models=(), load=0, backend="llamacpp"):
    return Node(eid, f"127.0.0.1:{eid[-1]}", backend, tuple(models), (), int(free_gib * GIB), load)


def ids(slots):
    return [s.node.endpoint_id for s in slots]


def test_best_fit_keeps_big_nodes_for_big_replicas():
    nodes = [cpu_node("big", 64), cpu_node("small", 10), cpu_node("mid", 20)]
    assert ids(plan(nodes, Ask("m", 1, 8 * GIB))) == ["small"]
    assert ids(plan(nodes, Ask("m", 2, 8 * GIB))) == ["small", "mid"]
    assert ids(plan(nodes, Ask("m", 1, 30 * GIB))) == ["big"]


def test_idle_engines_before_ones_serving_another_model_and_serving_ones_kept():
    nodes = [cpu_node("e1", 10, models=["other"]), cpu_node("e2", 40), cpu_node("e3", 10, models=["m"], load=7)]
    slots = plan(nodes, Ask("m", 2, 8 * GIB))
    assert ids(slots) == ["e3", "e2"]
    assert slots[0].already_serving and not slots[1].already_serving
    # an engine serving a model an alias routes to is never taken
    with pytest.raises(FailedPrecondition, match="2 found"):
        plan(nodes, Ask("m", 3, 8 * GIB, avoid_models=frozenset({"other"})))


def test_backends_filter():
    nodes = [cpu_node("e1", 10), cpu_node("e2", 10, backend="sim")]
    assert ids(plan(nodes, Ask("m", 1, GIB, backends=frozenset({"sim"})))) == ["e2"]


def test_gang_takes_k_gpus_of_one_node_best_fit():
    nodes = [gpu_node("a", 80, 80, 80, 80), gpu_node("b", 40, 10, 40, 30)]
    # 60 GiB over 2 GPUs, 30 each: three of b's GPUs hold a share; b keeps 60 GiB free, a better fit than
    # a's 260 GiB (a stays whole for a replica needing its 4 GPUs)
    [slot] = plan(nodes, Ask("m", 1, 60 * GIB, gpus=2))
    assert slot.node.endpoint_id == "b" and not slot.already_serving
    # 4 x 30 GiB: only a holds it
    [slot] = plan(nodes, Ask("m", 1, 120 * GIB, gpus=4))
    assert slot.node.endpoint_id == "a"


def test_an_engine_started_for_another_tensor_parallel_size_is_no_place():
    # a: vLLM started with tensor_parallel_size 2 on 4 roomy GPUs; b: tp 4; c: does not fix it
    nodes = [gpu_node("a", 80, 80, 80, 80, tp=2), gpu_node("b", 80, 80, 80, 80, tp=4), gpu_node("c", 80, 80, tp=0)]
    [slot] = plan(nodes, Ask("m", 1, 200 * GIB, gpus=4))
    assert slot.node.endpoint_id == "b"  # a has room for a 4-GPU gang, but its engine would run it over 2
    assert ids(plan(nodes, Ask("m", 2, 100 * GIB, gpus=2))) == ["c", "a"]  # best fit first, b left out
    with pytest.raises(FailedPrecondition) as exc:
        plan(nodes, Ask("m", 3, 100 * GIB, gpus=2))
    assert exc.value.reason == "too_few_engines"
    assert "2 found; left out, as they run a replica over another number of GPUs than 2: b" in exc.value.message
    # every refusal names the engines left out: too few GPUs anywhere else, or too little memory now
    with pytest.raises(FailedPrecondition, match="the most .* is 2 .*; left out, .* than 8: a, b"):
        plan(nodes, Ask("m", 1, 100 * GIB, gpus=8))
    with pytest.raises(ResourceExhausted, match=r"c: 0 of its 2 GPU\(s\).*nothing was placed; left out, .* than 2: b"):
        plan(nodes, Ask("m", 1, 400 * GIB, gpus=2))
    # an engine already serving the model keeps its replica whatever it was started with
    nodes = [gpu_node("a", 80, 80, models=["m"], tp=2), gpu_node("b", 80, 80, 80, 80, tp=4)]
    assert ids(plan(nodes, Ask("m", 1, 100 * GIB, gpus=4))) == ["a"]


def test_gang_is_refused_rather_than_split_across_nodes():
    # 8 GPUs with room in the fleet, but no node has 4 of them with room
    nodes = [gpu_node("a", 80, 80, 5, 5), gpu_node("b", 80, 80, 5, 5)]
    with pytest.raises(ResourceExhausted) as exc:
        plan(nodes, Ask("m", 1, 160 * GIB, gpus=4))
    assert "a: 2 of its 4 GPU(s) have 40.0 GiB free; 4 needed" in exc.value.message
    assert exc.value.code is ErrorCode.RESOURCE_EXHAUSTED and "nothing was placed" in exc.value.message
    # more GPUs than any node has: never placeable
    with pytest.raises(FailedPrecondition, match="need 8 GPUs each on one node; the most .* is 4"):
        plan(nodes, Ask("m", 1, 8 * GIB, gpus=8))


def test_all_or_nothing_over_replicas():
    nodes = [gpu_node("a", 80, 80), gpu_node("b", 80, 10)]
    assert len(plan(nodes, Ask("m", 1, 100 * GIB, gpus=2))) == 1
    with pytest.raises(ResourceExhausted, match="1 of 2 place"):
        plan(nodes, Ask("m", 2, 100 * GIB, gpus=2))


def test_cpu_memory_refusal_names_each_node():
    with pytest.raises(ResourceExhausted, match=r"e1: 2.0 GiB memory free, 4.0 GiB needed"):
        plan([cpu_node("e1", 2)], Ask("m", 1, 4 * GIB))


@pytest.mark.parametrize("ask, param", [(Ask("m", 0, GIB), "replicas"), (Ask("m", 1, 0), "memory_bytes"),
                                        (Ask("", 1, GIB), "model"), (Ask("m", 1, GIB, gpus=-1), "gpus_per_replica")])
def test_bad_asks(ask, param):
    with pytest.raises(InvalidArgument) as exc:
        plan([cpu_node("e1", 8)], ask)
    assert exc.value.param == param


# --- property: a gang is placed whole on one node, or not at all ---------------

fleets = st.lists(st.lists(st.integers(0, 80), min_size=0, max_size=8), min_size=0, max_size=6)


@settings(max_examples=400, deadline=None)
@given(fleet=fleets, replicas=st.integers(1, 4), k=st.integers(1, 8), need_gib=st.integers(1, 400),
       serving=st.sets(st.integers(0, 5), max_size=2))
def test_gang_never_half_places(fleet, replicas, k, need_gib, serving):
    nodes = [gpu_node(f"n{i}", *free, models=["m"] if i in serving else ()) for i, free in enumerate(fleet)]
    ask = Ask("m", replicas, need_gib * GIB, gpus=k)
    try:
        slots = plan(nodes, ask)
    except LlmeshError as exc:
        assert isinstance(exc, (ResourceExhausted, FailedPrecondition))
        return
    assert len(slots) == replicas
    assert len({s.node.endpoint_id for s in slots}) == replicas  # one replica per engine
    share = math.ceil(ask.memory_bytes / k)
    for s in slots:
        if s.already_serving:
            assert "m" in s.node.models
            continue
        assert sum(free >= share for free in s.node.gpu_free_bytes) >= k  # k GPUs of this one node hold a share


@settings(max_examples=200, deadline=None)
@given(fleet=fleets, k=st.integers(1, 8), need_gib=st.integers(1, 400))
def test_gang_refused_only_when_no_node_has_room(fleet, k, need_gib):
    nodes = [gpu_node(f"n{i}", *free) for i, free in enumerate(fleet)]
    share = math.ceil(need_gib * GIB / k)
    placeable = any(sum(f * GIB >= share for f in free) >= k for free in fleet)
    try:
        plan(nodes, Ask("m", 1, need_gib * GIB, gpus=k))
    except (ResourceExhausted, FailedPrecondition):
        assert not placeable
    else:
        assert placeable
