"""Active-active gateways' shared in-flight load (picking.peers): a gateway's ledger as it is
published, the peers' snapshots summed per endpoint, a peer that stops changing left out and
then forgotten, and pickers that, given each other's counts, route as one gateway would."""

import json

from llmesh.gateway.upstream.picking import Endpoint, EndpointPicker, PickInput
from llmesh.gateway.upstream.picking.peers import PeerLoads, snapshot
from llmesh.gateway.upstream.picking.types import PEER_COUNTS, LocalState
from llmesh.kvhash import LLMESH_SCHEME

TOKENS = list(range(160))


def ep(eid: str, running=0, waiting=0) -> Endpoint:
    return Endpoint(eid, eid, frozenset({"m"}), running=running, waiting=waiting, max_running=4,
                    kv_hash=LLMESH_SCHEME)


def req(first: int = 0) -> PickInput:
    tokens = [first + t for t in TOKENS]
    return PickInput("m", 0.0, work_tokens=len(tokens) + 8, tokens=lambda: tokens)


def test_a_snapshot_carries_every_count_of_each_endpoint_with_work_in_flight():
    p = EndpointPicker()
    p.replace_all([ep("a"), ep("b")])
    r = req()
    t = p.acquire(p.pick(r, "prefix_aware").endpoint_id, r.work_tokens, r)
    doc = json.loads(snapshot(p.local, 7))
    assert doc["s"] == 7 and list(doc["e"]) == [t.endpoint_id]
    assert dict(zip(PEER_COUNTS, doc["e"][t.endpoint_id])) == {
        "prefill_tokens": 160, "prefill_requests": 1, "decode_seqs": 0, "decode_tokens": 0, "inflight": 1,
        "since_report": 1}
    p.release(t.endpoint_id, r.work_tokens, t)
    assert json.loads(snapshot(p.local, 8))["e"] == {}  # since_report -> 0 as well: nothing left in flight


def test_peers_are_summed_per_endpoint_and_a_gateway_skips_its_own():
    peers = PeerLoads("me")
    one = {"s": 1, "e": {"a": [10, 1, 2, 50, 3, 3], "b": [0, 0, 1, 20, 1, -1]}}
    two = {"s": 4, "e": {"a": [5, 1, 0, 0, 1, 1]}}
    mine = {"s": 9, "e": {"a": [1000, 9, 9, 9, 9, 9]}}
    sums, forget = peers.update({b"x": json.dumps(one), b"y": json.dumps(two), b"me": json.dumps(mine)}, 0.0)
    assert sums == {"a": (15, 2, 2, 50, 4, 4), "b": (0, 0, 1, 20, 1, -1)} and forget == []


def test_a_peer_that_stops_changing_is_left_out_then_forgotten_and_junk_is_dropped():
    peers = PeerLoads("me", stale_s=1.0, forget_s=10.0)
    alive = {"s": 1, "e": {"a": [0, 0, 1, 10, 1, 0]}}
    dead = json.dumps({"s": 5, "e": {"a": [0, 0, 2, 20, 2, 0]}})
    junk = [b"not json", json.dumps({"s": 1}), json.dumps({"s": "x", "e": {}})]
    bad_counts = [json.dumps({"s": 1, "e": {"a": [1, 2]}}), json.dumps({"s": 1, "e": {"a": [-1, 0, 0, 0, 0, 0]}}),
                  json.dumps({"s": 1, "e": {"a": "many"}})]
    for now in (0.0, 0.5):
        alive["s"] += 1
        sums, forget = peers.update({"alive": json.dumps(alive), "dead": dead}, now)
        assert sums == {"a": (0, 0, 3, 30, 3, 0)} and forget == []
    alive["s"] += 1
    sums, forget = peers.update({"alive": json.dumps(alive), "dead": dead}, 1.2)
    assert sums == {"a": (0, 0, 1, 10, 1, 0)} and forget == []  # unchanged for 1.2 s: not counted
    alive["s"] += 1
    assert peers.update({"alive": json.dumps(alive), "dead": dead}, 10.0)[1] == ["dead"]
    for n, raw in enumerate(junk):  # not a snapshot: dropped from the store
        assert peers.update({f"junk{n}": raw}, 11.0) == ({}, [f"junk{n}"])
    for n, raw in enumerate(bad_counts):  # a snapshot whose counts for an endpoint are not counts: those skipped
        assert peers.update({f"odd{n}": raw}, 11.0) == ({}, [])


def test_counts_over_every_gateway_feed_the_load_the_scorers_read():
    loc = LocalState(prefill_tokens={"a": 100}, prefill_requests={"a": 1}, inflight={"a": 1}, since_report={"a": 1})
    loc.peers = {"a": (300, 2, 3, 900, 5, 2)}
    e = ep("a", running=1, waiting=1)
    assert loc.all_of("prefill_tokens", "a") == 400 and loc.all_of("decode_tokens", "b") == 0
    assert loc.queued_prefill(e, each=50) == 400  # the report's one waiting is one of the ledgers' three
    assert loc.decoding(e) == 3
    assert loc.requests(e) == 6  # never less than the six in flight the ledgers count


def test_a_gateway_given_its_peers_counts_routes_around_their_work():
    """Gateway A has four requests queued on e1 that the reports do not show yet; gateway B,
    knowing only its own work, sees two idle engines; given A's counts it always picks e2."""
    a, b = EndpointPicker(), EndpointPicker()
    for p in (a, b):
        p.replace_all([ep("e1"), ep("e2")])
    for n in range(4):
        r = req(1000 * n)
        a.acquire("e1", r.work_tokens, r)
    for policy in ("prefix_aware", "least_loaded", "llmd_sticky", "dynamo_kv"):
        alone = {b.pick(req(10_000 * k), policy).endpoint_id for k in range(1, 41)}  # prompts held nowhere
        assert alone == {"e1", "e2"}, policy  # a tie, broken at random
        b.local.peers, _ = PeerLoads("b").update({"a": snapshot(a.local, 1)}, 0.0)
        assert {b.pick(req(10_000 * k), policy).endpoint_id for k in range(41, 81)} == {"e2"}, policy
        b.local.peers = {}
