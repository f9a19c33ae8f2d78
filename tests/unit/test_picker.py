"""The picking pipeline's parts on plain inputs: each filter, each scorer, the picker
combining them by a policy's weights, and the live-config policy behind it."""

import random

import pytest
from pydantic import ValidationError

from llmesh.gateway.upstream.picking import Endpoint, EndpointPicker, PickInput
from llmesh.gateway.upstream.picking.filters import BreakerClosed, Healthy, NotDegraded, NotTried, ServesModel
from llmesh.gateway.upstream.picking.kvview import KvView
from llmesh.gateway.upstream.picking.scorers import LeastLoad, PrefixAware, RoundRobin, SessionAffinity, TokenAware
from llmesh.gateway.upstream.picking.types import LocalState, work_tokens
from llmesh.kvhash import LLMESH_SCHEME, HashScheme
from llmesh.liveconfig.schema import MeshConfig, ModelPolicy
from llmesh.types import Message, Prompt


def ep(eid: str, running=0, waiting=0, max_running=1, healthy=True, models=("m",), degraded="",
       kv_hash=LLMESH_SCHEME) -> Endpoint:
    return Endpoint(endpoint_id=eid, address=f"127.0.0.1:{hash(eid) % 1000 + 1000}", models=frozenset(models),
                    running=running, waiting=waiting, max_running=max_running, healthy=healthy, degraded=degraded,
                    kv_hash=kv_hash)


TOKENS = list(range(64))                       # 4 blocks of 16
H = LLMESH_SCHEME.block_hashes(TOKENS)


def req(model="m", now=0.0, **kw) -> PickInput:
    return PickInput(model, now, **kw)


# --- filters -------------------------------------------------------------------------------------

def test_filters_each_drop_what_they_name():
    local = LocalState(down_until={"down": 5.0})
    r = req(now=1.0, exclude=frozenset({"tried"}))
    assert ServesModel().keep(ep("a"), r, local) and not ServesModel().keep(ep("a", models=("x",)), r, local)
    assert Healthy().keep(ep("a"), r, local) and not Healthy().keep(ep("a", healthy=False), r, local)
    calls = req(tools=True)  # a request that needs tool calling: only where the engine's backend calls tools
    assert not ServesModel().keep(ep("a"), calls, local) and ServesModel().keep(ep("a"), req(), local)
    assert ServesModel().keep(Endpoint("t", "127.0.0.1:1", frozenset({"m"}), tools=frozenset({"m"})), calls, local)
    assert NotDegraded().keep(ep("a"), r, local) and not NotDegraded().keep(ep("a", degraded="ecc"), r, local)
    assert NotTried().keep(ep("a"), r, local) and not NotTried().keep(ep("tried"), r, local)
    assert BreakerClosed().keep(ep("a"), r, local) and not BreakerClosed().keep(ep("down"), r, local)
    assert BreakerClosed().keep(ep("down"), req(now=6.0), local)


# --- scorers -------------------------------------------------------------------------------------

def test_least_load_prefers_fewer_requests_per_slot_and_counts_our_inflight():
    local = LocalState(inflight={"c": 4})
    s = LeastLoad().scores([ep("a", running=3), ep("b", running=2, max_running=8), ep("c")], req(), local)
    assert s[1] > s[0] and s[1] > s[2] and s[2] < s[0]


def test_token_aware_weighs_queued_tokens_not_request_counts():
    # a: one huge request of ours in flight; b: three small ones
    local = LocalState(inflight={"a": 1, "b": 3}, inflight_tokens={"a": 9000, "b": 300})
    s = TokenAware().scores([ep("a", running=1), ep("b", running=3)], req(work_tokens=100), local)
    assert s == [0.0, 1.0]
    # requests other gateways sent count at this request's size
    s = TokenAware().scores([ep("a", running=5), ep("b", running=0)], req(work_tokens=100), LocalState())
    assert s == [0.0, 1.0]


def test_prefix_aware_scores_the_leading_run_of_cached_tokens_in_each_engines_scheme():
    # max_tokens=1: the share alone, every cached part at least the answer (the proportion: next test)
    kv = KvView()
    kv.apply("a", True, H[:3], [])
    kv.apply("b", True, [H[0], H[2], H[3]], [])   # holds blocks 3 and 4 but not 2: only the first counts
    vllm = HashScheme("vllm", 32, "sha256", "seed")
    kv.apply("v", True, vllm.block_hashes(TOKENS)[:1], [])   # a vLLM engine: 32-token blocks, its own hashes
    cands = [ep("a"), ep("b"), ep("c"), ep("v", kv_hash=vllm), ep("unknown", kv_hash=None)]
    kv.apply("unknown", True, H, [])
    share = PrefixAware(kv)
    assert share.scores(cands, req(tokens=lambda: TOKENS, max_tokens=1), LocalState()) == [0.75, 0.25, 0.0, 0.5, 0.0]
    kv.apply("a", False, [], [H[0]])               # an eviction of the first block ends a's run
    assert share.scores([ep("a")], req(tokens=lambda: TOKENS, max_tokens=1), LocalState()) == [0.0]
    assert share.scores([ep("b")], req(tokens=lambda: [], max_tokens=1), LocalState()) == [0.0]


def test_prefix_aware_counts_a_cached_prefix_shorter_than_the_answer_in_proportion():
    """A share counts in full where the cached part is at least the answer asked for: 48 cached tokens
    of a 64-token prompt (0.75) asking for 384 count 48/384 of that; asking for 32, in full; with no
    max_tokens, against DEFAULT_OUTPUT_TOKENS (256). 1,536 of 2,048 count in full."""
    long = list(range(2048))
    kv = KvView()
    kv.apply("short", True, H[:3], [])
    kv.apply("long", True, LLMESH_SCHEME.block_hashes(long)[:96], [])
    short = [ep("short")]
    assert PrefixAware(kv).scores(short, req(tokens=lambda: TOKENS, max_tokens=384), LocalState()) == [0.75 * 48 / 384]
    assert PrefixAware(kv).scores(short, req(tokens=lambda: TOKENS, max_tokens=32), LocalState()) == [0.75]
    assert PrefixAware(kv).scores(short, req(tokens=lambda: TOKENS), LocalState()) == [0.75 * 48 / 256]
    assert PrefixAware(kv).scores([ep("long")], req(tokens=lambda: long, max_tokens=384), LocalState()) == [0.75]


def test_kv_view_resync_replaces_and_keep_only_forgets():
    kv = KvView()
    kv.apply("a", True, [1, 2], [])
    kv.apply("a", True, [7], [])
    assert kv.count("a") == 1 and kv.matched("a", [7]) == 1
    kv.keep_only(set())
    assert kv.count("a") == 0


def test_kv_view_counts_expected_blocks_until_they_expire():
    kv = KvView()
    kv.apply("a", True, H[:1], [])
    kv.expect("a", H[:3], until=2.0)
    assert kv.matched("a", H, now=1.0) == 3            # held (1) and expected (2 more)
    assert kv.matched("a", H) == 1                     # without a time: what reports say only
    assert kv.matched("b", H, now=1.0) == 0
    kv.expect("a", H[1:2], until=5.0)                  # sent again later: its block stays expected longer
    assert kv.matched("a", H, now=3.0) == 2
    assert kv.matched("a", H, now=6.0) == 1            # all expired: reports alone again
    kv.expect("gone", H, until=9.0)
    kv.keep_only({"a"})
    assert kv.matched("gone", H, now=7.0) == 0


def test_kv_events_replace_what_was_expected_of_a_block():
    kv = KvView()
    kv.expect("a", H, until=100.0)
    kv.apply("a", False, [], [H[1]])                   # the engine evicted block 2: no longer expected
    assert kv.matched("a", H, now=1.0) == 1
    kv.apply("a", False, H[:1], [])                    # stored: held, the expectation is spent
    kv.apply("a", False, [], H[:1])                    # then evicted: gone, though expected until 100
    assert kv.matched("a", H, now=2.0) == 0


def test_a_follow_up_goes_where_its_prefix_was_just_sent_before_any_report():
    p = EndpointPicker(random.Random(0), expect_for_s=2.0)
    p.replace_all([ep(f"e{i}", max_running=4) for i in range(4)])
    first = p.pick(req(now=0.0, tokens=lambda: TOKENS[:48]), "prefix_aware").endpoint_id
    p.replace_all([ep(e.endpoint_id, running=int(e.endpoint_id == first), max_running=4) for e in p.all()])
    # the longer next turn, 0.5 s later: no KV event has come, the blocks sent are expected there
    assert p.pick(req(now=0.5, tokens=lambda: TOKENS), "prefix_aware").endpoint_id == first
    # a policy that never hashes the prompt expects nothing
    q = EndpointPicker(random.Random(0))
    q.replace_all([ep("x"), ep("y")])
    q.pick(req(tokens=lambda: TOKENS), "least_loaded")
    assert q.kv.matched("x", H, now=0.0) == q.kv.matched("y", H, now=0.0) == 0


def test_session_affinity_sticks_and_moves_only_when_overloaded():
    cands = [ep(f"e{i}") for i in range(5)]
    s = SessionAffinity()
    homes = {}
    for user in ("u1", "u2", "u3", "u4", "u5", "u6"):
        first = s.scores(cands, req(session=user), LocalState())
        assert sum(first) == 1.0
        assert s.scores(cands, req(session=user), LocalState()) == first   # sticky
        homes[user] = first.index(1.0)
    assert len(set(homes.values())) > 1                                       # spread
    # the home of u1 is overloaded: u1 moves; its home comes back when the load drops
    home = homes["u1"]
    busy = [ep(e.endpoint_id, running=10 if n == home else 0) for n, e in enumerate(cands)]
    assert s.scores(busy, req(session="u1"), LocalState()).index(1.0) != home
    # an endpoint leaving moves only its own sessions
    gone = next(n for n in range(5) if n not in homes.values()) if len(set(homes.values())) < 5 else home
    rest = [e for n, e in enumerate(cands) if n != gone]
    for user, n in homes.items():
        if n != gone:
            assert rest[s.scores(rest, req(session=user), LocalState()).index(1.0)].endpoint_id == cands[n].endpoint_id
    assert s.scores(cands, req(), LocalState()) == [0.0] * 5               # no session: no opinion


def test_round_robin_cycles_per_model():
    rr = RoundRobin()
    cands = [ep("b"), ep("a"), ep("c")]
    picks = [cands[rr.scores(cands, req(), LocalState()).index(1.0)].endpoint_id for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]
    assert cands[rr.scores(cands, req("other"), LocalState()).index(1.0)].endpoint_id == "a"


def test_work_estimate_counts_prompt_bytes_and_answer():
    assert work_tokens(Prompt(messages=(Message("user", "x" * 30),)), 10) == 20
    assert work_tokens(Prompt(text="abc"), None) == 257


# --- picker --------------------------------------------------------------------------------------

def test_picks_least_loaded_healthy_endpoint_serving_the_model():
    p = EndpointPicker(random.Random(0))
    p.replace_all([ep("busy", running=3), ep("idle"), ep("sick", healthy=False),
                   ep("other", models=("x",)), ep("degraded", degraded="ECC errors rising")])
    assert p.pick(req()).endpoint_id == "idle"
    assert p.pick(req("nope")) is None


def test_a_degraded_endpoint_gets_a_request_only_when_no_other_can_take_it():
    """Envoy's rule for degraded hosts: a slow answer beats a 503."""
    p = EndpointPicker(random.Random(0))
    p.replace_all([ep("slow", degraded="self-test latency 900 ms"), ep("fine", running=5, max_running=8)])
    assert {p.pick(req()).endpoint_id for _ in range(20)} == {"fine"}
    assert p.pick(req(exclude=frozenset({"fine"}))).endpoint_id == "slow"   # a retry after "fine" failed
    p.replace_all([ep("slow", degraded="self-test latency 900 ms"), ep("gone", healthy=False)])
    assert p.pick(req()).endpoint_id == "slow"
    p.replace_all([ep("slow", degraded="ecc", models=("x",))])
    assert p.pick(req()) is None                                            # still only where the model is


def test_load_is_relative_to_slots():
    p = EndpointPicker()
    p.replace_all([ep("small", running=1, max_running=1), ep("big", running=2, max_running=8)])
    assert p.pick(req()).endpoint_id == "big"


def test_local_inflight_counts_before_the_next_report():
    p = EndpointPicker(random.Random(0))
    p.replace_all([ep("a"), ep("b")])
    first = p.pick(req())
    p.acquire(first.endpoint_id, 100)
    assert p.pick(req()).endpoint_id != first.endpoint_id
    p.release(first.endpoint_id, 100)
    assert p.local.inflight == {} and p.local.inflight_tokens == {}


def test_a_stale_report_counting_our_finished_work_does_not_hide_new_work():
    p = EndpointPicker(random.Random(0))
    p.replace_all([ep("a", running=1), ep("b", running=1)])   # both reported our earlier requests...
    p.acquire("a"), p.release("a"), p.acquire("b"), p.release("b")   # ...which have finished since
    p.acquire("a")                                                    # a new one went to a
    assert p.pick(req()).endpoint_id == "b"
    p.replace_all([ep("a", running=2), ep("b", running=0)])          # a fresh report already counts it
    assert p.local.since_report == {} and p.local.load(ep("a", running=2)) == 2


def test_ties_are_spread():
    p = EndpointPicker(random.Random(1))
    p.replace_all([ep("a"), ep("b"), ep("c")])
    assert {p.pick(req()).endpoint_id for _ in range(60)} == {"a", "b", "c"}


def test_excluded_and_marked_down_endpoints_are_skipped_until_they_recover():
    p = EndpointPicker(down_for_s=2.0)
    p.replace_all([ep("a"), ep("b", running=5)])
    assert p.pick(req(exclude=frozenset({"a"}))).endpoint_id == "b"
    p.mark_down("a", now=10.0)
    assert p.pick(req(now=11.0)).endpoint_id == "b"
    assert p.pick(req(now=12.5)).endpoint_id == "a"


def test_models_seen_once_stay_known_after_their_endpoints_leave():
    p = EndpointPicker()
    p.replace_all([ep("a", models=("m1",))])
    p.replace_all([])
    assert p.models() == set() and p.seen_models() == {"m1"}


def test_random_policy_ignores_load():
    p = EndpointPicker(random.Random(3))
    p.replace_all([ep("busy", running=9), ep("idle")])
    assert {p.pick(req(), "random").endpoint_id for _ in range(40)} == {"busy", "idle"}


def test_prefix_aware_policy_weighs_the_cached_prefix_against_load():
    p = EndpointPicker(random.Random(0))
    p.replace_all([ep("warm", running=1, max_running=4), ep("cold")])
    p.kv.apply("warm", True, H, [])
    r = req(tokens=lambda: TOKENS)
    assert p.pick(r, "least_loaded").endpoint_id == "cold"
    assert p.pick(r, "prefix_aware").endpoint_id == "warm"
    # far too busy: the load outweighs the cached prefix
    p.replace_all([ep("warm", running=12, max_running=1), ep("cold")])
    assert p.pick(r, "prefix_aware").endpoint_id == "cold"


def test_prompt_is_hashed_only_when_a_policy_needs_it():
    calls = []
    p = EndpointPicker()
    p.replace_all([ep("a"), ep("b")])
    p.pick(req(tokens=lambda: calls.append(1) or TOKENS), "least_loaded")
    assert calls == []
    r = req(tokens=lambda: calls.append(1) or TOKENS)
    p.pick(r, "prefix_aware")
    p.pick(r, "prefix_aware")
    assert calls == [1]


def test_weights_from_live_config_replace_the_preset():
    p = EndpointPicker(random.Random(0))
    p.replace_all([ep("warm", running=12), ep("cold")])
    p.kv.apply("warm", True, H, [])
    r = req(tokens=lambda: TOKENS)
    policy = MeshConfig.model_validate({"models": {"m": {
        "routing": "prefix_aware", "scorers": {"prefix_aware": 10, "least_load": 1}}}}).policy("m")
    assert p.pick(r, policy.routing, policy.scorers).endpoint_id == "warm"
    assert p.pick(r, policy.routing).endpoint_id == "cold"


def test_config_rejects_unknown_policies_scorers_and_negative_weights():
    for bad in ({"routing": "fastest"}, {"scorers": {"magic": 1}}, {"scorers": {"least_load": -1}}):
        with pytest.raises(ValidationError):
            ModelPolicy.model_validate(bad)
