import random

from llmesh.gateway.endpoints import Endpoint, EndpointPicker


def ep(eid: str, running=0, waiting=0, max_running=1, healthy=True, models=("m",)) -> Endpoint:
    return Endpoint(endpoint_id=eid, address=f"127.0.0.1:{hash(eid) % 1000 + 1000}", models=frozenset(models),
                    running=running, waiting=waiting, max_running=max_running, healthy=healthy)


def test_picks_least_loaded_healthy_endpoint_serving_the_model():
    p = EndpointPicker(random.Random(0))
    p.replace_all([ep("busy", running=3), ep("idle"), ep("sick", healthy=False),
                   ep("other", models=("x",))])
    assert p.pick("m", now=0).endpoint_id == "idle"
    assert p.pick("nope", now=0) is None


def test_load_is_relative_to_slots():
    p = EndpointPicker()
    p.replace_all([ep("small", running=1, max_running=1), ep("big", running=2, max_running=8)])
    assert p.pick("m", now=0).endpoint_id == "big"


def test_local_inflight_counts_before_the_next_report():
    p = EndpointPicker(random.Random(0))
    p.replace_all([ep("a"), ep("b")])
    first = p.pick("m", now=0)
    p.acquire(first.endpoint_id)
    second = p.pick("m", now=0)
    assert second.endpoint_id != first.endpoint_id
    p.release(first.endpoint_id)


def test_ties_are_spread():
    p = EndpointPicker(random.Random(1))
    p.replace_all([ep("a"), ep("b"), ep("c")])
    assert {p.pick("m", now=0).endpoint_id for _ in range(60)} == {"a", "b", "c"}


def test_excluded_and_marked_down_endpoints_are_skipped_until_they_recover():
    p = EndpointPicker(down_for_s=2.0)
    p.replace_all([ep("a"), ep("b", running=5)])
    assert p.pick("m", now=0, exclude=frozenset({"a"})).endpoint_id == "b"
    p.mark_down("a", now=10.0)
    assert p.pick("m", now=11.0).endpoint_id == "b"
    assert p.pick("m", now=12.5).endpoint_id == "a"


def test_models_seen_once_stay_known_after_their_endpoints_leave():
    p = EndpointPicker()
    p.replace_all([ep("a", models=("m1",))])
    p.replace_all([])
    assert p.models() == set() and p.seen_models() == {"m1"}


def test_random_policy_ignores_load():
    p = EndpointPicker(random.Random(3))
    p.replace_all([ep("busy", running=9), ep("idle")])
    assert {p.pick("m", now=0, policy="random").endpoint_id for _ in range(40)} == {"busy", "idle"}
