"""Active-active gateways' shared in-flight load (picking.peers): a gateway's ledger as it is
published, the peers' snapshots summed per endpoint, a peer counted only while its snapshot
changes (never a dead one's last), unreadable or hostile snapshots bounded and never counted,
and a picker that, given its peers' counts, routes around their work."""

import json

import pytest

from llmesh.gateway.upstream.picking import Endpoint, EndpointPicker, PickInput
from llmesh.gateway.upstream.picking.peers import FORGET_S, MAX_BYTES, MAX_ENDPOINTS, PeerLoads, parse, snapshot
from llmesh.gateway.upstream.picking.types import PEER_COUNTS, LocalState
from llmesh.kvhash import LLMESH_SCHEME

TOKENS = list(range(160))


def ep(eid: str, running=0, waiting=0) -> Endpoint:
    return Endpoint(eid, eid, frozenset({"m"}), running=running, waiting=waiting, max_running=4,
                    kv_hash=LLMESH_SCHEME)


def req(first: int = 0) -> PickInput:
    tokens = [first + t for t in TOKENS]
    return PickInput("m", 0.0, work_tokens=len(tokens) + 8, tokens=lambda: tokens)


def snap(seq: int, counts: dict, interval: float = 0.05) -> str:
    return json.dumps({"v": 1, "s": seq, "i": interval, "e": counts})


def test_a_snapshot_carries_every_count_of_each_endpoint_with_work_in_flight():
    p = EndpointPicker()
    p.replace_all([ep("a"), ep("b")])
    r = req()
    t = p.acquire(p.pick(r, "prefix_aware").endpoint_id, r.work_tokens, r)
    doc = json.loads(snapshot(p.local, 7, 0.05))
    name = f"{t.endpoint_id} {t.endpoint_id}"  # its id and its address (here the same)
    assert (doc["v"], doc["s"], doc["i"], list(doc["e"])) == (1, 7, 0.05, [name])
    assert dict(zip(PEER_COUNTS, doc["e"][name])) == {
        "prefill_tokens": 160, "prefill_requests": 1, "decode_seqs": 0, "decode_tokens": 0, "inflight": 1}
    p.release(t.endpoint_id, r.work_tokens, t)
    assert json.loads(snapshot(p.local, 8, 0.05))["e"] == {}
    assert parse(snapshot(p.local, 8, 0.05)).seq == 8


def test_peers_count_once_they_change_and_are_summed_per_endpoint_skipping_our_own():
    peers = PeerLoads("me")
    one = {"a": [10, 1, 2, 50, 3], "b": [0, 0, 1, 20, 1]}
    two = {"a": [5, 1, 0, 0, 1]}
    mine = snap(9, {"a": [1000, 9, 9, 9, 9]})
    # first seen: not counted yet (a killed process's last snapshot looks just like this)
    assert peers.update({b"x": snap(1, one), b"y": snap(4, two), b"me": mine}, 0.0) == ({}, [])
    sums, forget = peers.update({b"x": snap(2, one), b"y": snap(5, two), b"me": mine}, 0.05)
    assert sums == {"a": (15, 2, 2, 50, 4), "b": (0, 0, 1, 20, 1)} and forget == [] and peers.live == 2


def test_a_pushed_snapshot_counts_at_once_an_older_one_never_replaces_a_newer():
    peers = PeerLoads("me")
    # a round read the store before x first wrote, then x pushed: x is alive now, counted now
    assert peers.update({b"me": snap(1, {})}, 0.0) == ({}, [])
    peers.offer("x", snap(3, {"a": [1, 1, 0, 0, 1]}), 0.1)
    assert peers.sums(0.1) == {"a": (1, 1, 0, 0, 1)} and peers.live == 1
    # a round that then reads x's older field keeps the pushed one; one of our own is never taken
    assert peers.update({b"x": snap(2, {"a": [9, 9, 9, 9, 9]})}, 0.2)[0] == {"a": (1, 1, 0, 0, 1)}
    peers.offer("me", snap(9, {"a": [5, 5, 5, 5, 5]}), 0.3)
    peers.offer("x", "not a snapshot", 0.3)
    assert peers.sums(0.3) == {"a": (1, 1, 0, 0, 1)}
    # pushed, then silent: it lapses like any peer that stops changing
    assert peers.sums(0.1 + 1.0) == {} and peers.live == 0


def test_a_peer_that_stops_changing_is_left_out_after_twenty_of_its_rounds_then_forgotten():
    peers = PeerLoads("me")
    dead_counts = {"a": [0, 0, 2, 20, 2]}
    for seq, now in ((1, 0.0), (2, 0.1)):  # both seen changing
        sums, _ = peers.update({"alive": snap(seq, {"a": [0, 0, 1, 10, 1]}), "dead": snap(seq, dead_counts)}, now)
    assert sums == {"a": (0, 0, 3, 30, 3)}
    sums, forget = peers.update({"alive": snap(3, {"a": [0, 0, 1, 10, 1]}), "dead": snap(2, dead_counts)}, 1.05)
    assert sums == {"a": (0, 0, 3, 30, 3)} and forget == []  # unchanged 0.95 s = 19 rounds of 0.05: in ...
    sums, forget = peers.update({"alive": snap(4, {"a": [0, 0, 1, 10, 1]}), "dead": snap(2, dead_counts)}, 1.1)
    assert sums == {"a": (0, 0, 1, 10, 1)}  # ... at 1 s (20 rounds, at least 1 s) it is out
    slow = PeerLoads("me")  # a peer publishing every 0.5 s is stale after 10 s, not 1
    for seq, now in ((1, 0.0), (2, 0.5), (2, 9.0)):
        sums, _ = slow.update({"slow": snap(seq, dead_counts, interval=0.5)}, now)
    assert sums == {"a": (0, 0, 2, 20, 2)}
    assert slow.update({"slow": snap(2, dead_counts, interval=0.5)}, 10.6)[0] == {}
    assert peers.update({"dead": snap(2, dead_counts)}, 0.1 + FORGET_S)[1] == ["dead"]


@pytest.mark.parametrize("raw", [
    b"not json", "[1, 2]", snap(1, {})[:-1], json.dumps({"s": 1, "i": 0.05, "e": {}}),  # no version
    json.dumps({"v": 2, "s": 1, "i": 0.05, "e": {}}), json.dumps({"v": 1, "s": "1", "i": 0.05, "e": {}}),
    json.dumps({"v": 1, "s": 1, "i": 0, "e": {}}), json.dumps({"v": 1, "s": 1, "i": 1e9, "e": {}}),
    '{"v": 1, "s": 1, "i": NaN, "e": {}}', '{"v": 1, "s": 1, "i": Infinity, "e": {}}',
    json.dumps({"v": 1, "s": 1, "i": True, "e": {}}), json.dumps({"v": 1, "s": 1, "i": 0.05, "e": []}),
    "[" * 100_000 + "]" * 100_000, " " * (MAX_BYTES + 1) + snap(1, {})])
def test_what_is_not_a_snapshot_of_this_version_is_never_counted_and_forgotten_only_when_unchanged(raw):
    assert parse(raw) is None
    peers = PeerLoads("me")
    assert peers.update({"odd": raw}, 0.0) == ({}, [])
    assert peers.update({"odd": raw}, 1.0) == ({}, [])  # not counted, not dropped (a newer version's?) ...
    assert peers.update({"odd": raw}, FORGET_S) == ({}, ["odd"])  # ... until unchanged for a minute


@pytest.mark.parametrize("counts", [[1, 2], [-1, 0, 0, 0, 0], [0, 0, 0, 0, 1 << 31], [0, 0, 0, 0, 10 ** 400],
                                    [0, 0, 0, 0, 1.5], [0, 0, 0, 0, True], [0, 0, 0, 0, "3"], "many", None])
def test_an_endpoint_whose_counts_are_not_counts_is_skipped_the_rest_counted(counts):
    peers = PeerLoads("me")
    body = {"bad": counts, "good": [1, 1, 0, 0, 1]}
    peers.update({"p": snap(1, body)}, 0.0)
    assert peers.update({"p": snap(2, body)}, 0.05) == ({"good": (1, 1, 0, 0, 1)}, [])


def test_a_snapshot_is_read_up_to_its_endpoint_bound():
    body = {f"e{n}": [0, 0, 0, 0, 1] for n in range(MAX_ENDPOINTS + 10)}
    assert len(parse(snap(1, body)).counts) == MAX_ENDPOINTS


def test_counts_over_every_gateway_feed_the_load_the_scorers_read():
    loc = LocalState(prefill_tokens={"a": 100}, prefill_requests={"a": 1}, inflight={"a": 1}, since_report={"a": 1})
    loc.peers = {"a": (300, 2, 3, 900, 5)}
    e = ep("a", running=1, waiting=1)
    assert loc.all_of("prefill_tokens", "a") == 400 and loc.all_of("decode_tokens", "b") == 0
    assert loc.queued_prefill(e, each=50) == 400  # the report's one waiting is one of the ledgers' three
    assert loc.decoding(e) == 3
    assert loc.requests(e) == 6  # never less than the six in flight the ledgers count
    loc.peers = {}
    assert loc.requests(e) == 3  # the report's two and the one we started since


def test_a_gateway_given_its_peers_counts_routes_around_their_work():
    """Gateway A has four requests queued on e1 that the reports do not show yet; gateway B,
    knowing only its own work, sees two idle engines; given A's counts it always picks e2."""
    a, b = EndpointPicker(), EndpointPicker()
    for p in (a, b):
        p.replace_all([ep("e1"), ep("e2")])
    for n in range(4):
        r = req(1000 * n)
        a.acquire("e1", r.work_tokens, r)
    peers = PeerLoads("b")
    peers.update({"a": snapshot(a.local, 1, 0.05)}, 0.0)
    shared, _ = peers.update({"a": snapshot(a.local, 2, 0.05)}, 0.05)
    for policy in ("prefix_aware", "least_loaded", "llmd_sticky", "dynamo_kv"):
        alone = {b.pick(req(10_000 * k), policy).endpoint_id for k in range(1, 41)}  # prompts held nowhere
        assert alone == {"e1", "e2"}, policy  # a tie, broken at random
        b.local.peers = shared
        assert {b.pick(req(10_000 * k), policy).endpoint_id for k in range(41, 81)} == {"e2"}, policy
        b.local.peers = {}


def test_a_peers_requests_since_a_report_count_only_against_that_same_report():
    """A peer ended a request on e1 after the report that still shows it running: while we hold that
    report too, its -1 corrects it (a follow-up is not kept off the engine its previous turn just
    left); once we hold a newer report, which counts that end already, it is not added again."""
    a, b = EndpointPicker(), EndpointPicker()
    for p in (a, b):
        p.replace_all([ep("e1", running=2), ep("e2", running=1)])
    t = a.acquire("e1", 10)
    for p in (a, b):  # the report counts a's request
        p.replace_all([ep("e1", running=3), ep("e2", running=1)])
    a.started(t)
    a.release("e1", 10, t)
    a.acquire("e2", 10)
    doc = json.loads(snapshot(a.local, 1, 0.05))
    assert doc["r"] == {"e1 e1": [-1, 3, 0], "e2 e2": [1, 1, 0]}
    peers = PeerLoads("b")
    peers.update({"a": snapshot(a.local, 1, 0.05)}, 0.0)
    peers.update({"a": snapshot(a.local, 2, 0.05)}, 0.05)
    b.local.peer_since = peers.since(0.05)
    e1, e2 = (next(e for e in b.all() if e.endpoint_id == n) for n in ("e1", "e2"))
    assert (b.local.requests(e1), b.local.requests(e2)) == (2, 2)
    b.replace_all([ep("e1", running=2), ep("e2", running=2)])  # the reports caught up; a's still counts from the old
    e1, e2 = (next(e for e in b.all() if e.endpoint_id == n) for n in ("e1", "e2"))
    assert (b.local.requests(e1), b.local.requests(e2)) == (2, 2)


@pytest.mark.parametrize("r", [{"e1": [1, 2]}, {"e1": [1 << 31, 0, 0]}, {"e1": [1, -1, 0]}, {"e1": [1.0, 0, 0]},
                               {"e1": "x"}, [1, 2, 3], "x"])
def test_requests_since_a_report_that_are_not_counts_are_skipped(r):
    raw = json.dumps({"v": 1, "s": 1, "i": 0.05, "e": {}, "r": r})
    assert parse(raw).since == {}
