"""The picker's load ledger (uncached prompt tokens queued until the first chunk, decoding
sequences until the end, combined with the engines' lagging reports) and the scorers that
read it: token load, and the re-implemented llm-d sticky-until-saturated and Dynamo-style cost."""

from llmesh.gateway.upstream.picking import Endpoint, EndpointPicker, PickInput
from llmesh.gateway.upstream.picking.kvview import KvView
from llmesh.gateway.upstream.picking.load import KvCost, StickyAffinity, TokenLoad, uncached
from llmesh.gateway.upstream.picking.types import LocalState
from llmesh.kvhash import LLMESH_SCHEME

TOKENS = list(range(160))                      # 10 blocks of 16
H = LLMESH_SCHEME.block_hashes(TOKENS)


def ep(eid: str, running=0, waiting=0) -> Endpoint:
    return Endpoint(eid, eid, frozenset({"m"}), running=running, waiting=waiting, max_running=8,
                    kv_hash=LLMESH_SCHEME)


def req(tokens=TOKENS) -> PickInput:
    return PickInput("m", 0.0, work_tokens=len(tokens) + 8, tokens=lambda: tokens)


def test_the_ledger_queues_uncached_tokens_until_the_first_chunk_and_decoders_until_the_end():
    p = EndpointPicker()
    p.replace_all([ep("a"), ep("b")])
    p.kv.apply("a", True, H[:8], [])            # a holds 8 of the 10 blocks
    r = req()
    assert p.pick(r, "dynamo_kv").endpoint_id == "a" and r.uncached == 32
    t = p.acquire("a", r.work_tokens, r)
    loc = p.local
    assert loc.prefill_tokens == {"a": 32} and loc.prefill_requests == {"a": 1} and not loc.decode_seqs
    p.started(t)
    p.started(t)                                # a second call changes nothing
    assert not loc.prefill_tokens and loc.decode_seqs == {"a": 1} and loc.decode_tokens == {"a": 160}
    p.release("a", r.work_tokens, t)
    assert not loc.decode_seqs and not loc.decode_tokens and not loc.inflight
    # one that fails before its first chunk leaves the prefill queue at its release
    t = p.acquire("b", 50)
    assert loc.prefill_tokens == {"b": 50}
    p.release("b", 50, t)
    assert not loc.prefill_tokens and not loc.prefill_requests and not loc.decode_seqs
    # a caller without a ticket releases what acquire booked without a request
    p.acquire("b", 70)
    p.release("b", 70)
    assert not loc.prefill_tokens and not loc.decode_seqs


def test_lowest_priority_requests_are_counted_apart_until_released():
    """Batch lines (``low``) count in the ledger like any request and in ``low_inflight`` too: the
    gateway keeps a headroom of slots from them by the rest of the work."""
    p = EndpointPicker()
    p.replace_all([ep("a"), ep("b")])
    low = [p.acquire("a", 10, low=True), p.acquire("b", 10, low=True)]
    normal = p.acquire("a", 10)
    assert p.local.low_inflight == 2 and p.local.inflight == {"a": 2, "b": 1}
    p.release("a", 10, low[0])
    p.release("a", 10, normal)
    assert p.local.low_inflight == 1 and p.local.inflight == {"b": 1}
    p.release("b", 10, low[1])
    assert p.local.low_inflight == 0 and not p.local.inflight


def test_low_room_leaves_the_headroom_beside_the_other_work():
    """Batch lines may fill the generating engines' slots less a headroom and less the rest of
    the work there; their own lines do not count against them; with no engine, no bound."""
    p = EndpointPicker()
    assert p.low_room(0.25, 8) == 8  # providers only
    p.replace_all([ep("a"), ep("b"),
                   Endpoint("e", "e", frozenset({"emb"}), max_running=8, embeds=frozenset({"emb"}))])
    assert p.low_room(0.25, 8) == 16 - 4  # two engines of 8 slots, a quarter kept; the embedder is not counted
    interactive = [p.acquire("a", 10) for _ in range(3)]
    lows = [p.acquire("b", 10, low=True) for _ in range(5)]
    assert p.low_room(0.25, 8) == 12 - 3  # the 5 batch lines are this room's own
    for t in interactive:
        p.release("a", 10, t)
    assert p.low_room(0.25, 8) == 12 and p.low_room(0.0, 8) == 16
    for t in lows:
        p.release("b", 10, t)


def test_a_caller_acquiring_right_after_its_pick_books_what_the_pick_counted():
    p = EndpointPicker()
    p.replace_all([ep("a"), ep("b")])
    p.kv.apply("a", True, H[:8], [])
    r = req()
    assert p.pick(r, "prefix_aware").endpoint_id == "a"
    t = p.acquire("a", r.work_tokens)            # as the router does: no request passed
    assert (t.uncached, t.context) == (32, 160) and p.local.prefill_tokens == {"a": 32}
    p.release("a", r.work_tokens, t)
    # a pick it did not acquire is not taken for a later request elsewhere or after another call
    p.pick(req(), "prefix_aware")
    assert p.acquire("b", 99).uncached == 99
    p.pick(req(), "prefix_aware")
    p.routable("a", req())
    assert p.acquire("a", 77).uncached == 77


def test_stale_reports_never_hide_the_ledger_and_others_work_counts_from_them():
    loc = LocalState(prefill_tokens={"a": 900}, prefill_requests={"a": 2}, decode_seqs={"a": 3})
    idle_report = ep("a")                        # the last report, from before our requests
    assert loc.queued_prefill(idle_report, 100) == 900 and loc.decoding(idle_report) == 3
    # the report shows 5 waiting: 2 of them ours, 3 from elsewhere at 100 tokens each
    assert loc.queued_prefill(ep("a", running=6, waiting=5), 100) == 1200
    assert loc.decoding(ep("a", running=6)) == 6


def test_token_load_prefers_less_prefill_ahead_counting_what_the_request_lacks_there():
    kv = KvView()
    kv.apply("a", True, H, [])                  # a holds the whole prompt (1 token to prefill: 0 here)
    cands = [ep("a"), ep("b")]
    assert uncached(kv, cands[0], req()) == 0 and uncached(kv, cands[1], req()) == 160
    assert TokenLoad(kv).scores(cands, req(), LocalState()) == [1.0, 0.0]
    # 500 tokens queued at a outweigh the 160 b would prefill
    busy = LocalState(prefill_tokens={"a": 500}, prefill_requests={"a": 1})
    assert TokenLoad(kv).scores(cands, req(), busy) == [0.0, 1.0]
    # decoding sequences count too, in prompt-token equivalents
    assert TokenLoad(kv, decode_tokens=100).scores([ep("a", running=4), ep("c", running=0)],
                                                   req([]), LocalState()) == [0.0, 1.0]


def test_sticky_affinity_holds_until_saturated_by_the_calibrated_penalty():
    kv = KvView()
    kv.apply("a", True, H[:8], [])              # 80 %: at the threshold
    kv.apply("b", True, H[:7], [])              # 70 %: below it
    cands = [ep("a"), ep("b"), ep("c")]
    sticky = StickyAffinity(kv, threshold=0.8, penalty_tokens=1100)
    assert sticky.scores(cands, req(), LocalState()) == [1.0, 0.0, 0.0]
    # a: 1100 queued + its own 32, over the best (b: its 48 to prefill) by 1084: within the penalty
    within = LocalState(prefill_tokens={"a": 1100}, prefill_requests={"a": 3})
    assert sticky.scores(cands, req(), within) == [1.0, 0.0, 0.0]
    saturated = LocalState(prefill_tokens={"a": 1200}, prefill_requests={"a": 3})
    assert sticky.scores(cands, req(), saturated) == [0.0, 0.0, 0.0]
    # the preset: sticky while it holds, then the least token load
    p = EndpointPicker(sticky_penalty_tokens=1100)
    p.replace_all(cands)
    p.kv.apply("a", True, H[:8], [])
    p.local.prefill_tokens, p.local.prefill_requests = {"a": 1100, "c": 40}, {"a": 3, "c": 1}
    assert p.pick(req(), "llmd_sticky").endpoint_id == "a"
    p.local.prefill_tokens["a"] = 1300
    assert p.pick(req(), "llmd_sticky").endpoint_id == "b"  # b: 48 to prefill, c: 40 + 160


def test_kv_cost_weighs_overlap_blocks_against_active_decode_blocks():
    kv = KvView()
    kv.apply("a", True, H[:8], [])
    cands = [ep("a"), ep("b")]
    # idle: a costs 2 prefill + 10 decode blocks, b 10 + 10
    assert KvCost(kv).scores(cands, req(), LocalState()) == [1.0, 0.0]
    # a holds 20 blocks of decoding context: 2 + 30 > 10 + 10
    busy = LocalState(decode_seqs={"a": 2}, decode_tokens={"a": 320})
    assert KvCost(kv).scores(cands, req(), busy) == [0.0, 1.0]
    # the overlap weight tips it back: 4 x 2 + 30 < 4 x 10 + 10
    assert KvCost(kv, overlap_weight=4.0).scores(cands, req(), busy) == [1.0, 0.0]


def test_live_config_weights_can_name_the_ledger_scorers():
    from llmesh.liveconfig.schema import MeshConfig
    policy = MeshConfig.model_validate({"models": {"m": {
        "routing": "prefix_aware", "scorers": {"token_load": 1, "sticky_affinity": 2}}}}).policy("m")
    p = EndpointPicker(sticky_penalty_tokens=1000)
    p.replace_all([ep("a"), ep("b")])
    p.kv.apply("a", True, H, [])
    assert p.pick(req(), policy.routing, policy.scorers).endpoint_id == "a"
    p.local.prefill_tokens, p.local.prefill_requests = {"a": 1500}, {"a": 2}   # a is saturated
    assert p.pick(req(), policy.routing, policy.scorers).endpoint_id == "b"


def test_token_load_sends_nothing_to_wait_for_a_slot_a_cached_prefix_would_save():
    kv = KvView()
    kv.apply("full", True, H, [])               # holds the whole prompt, every slot taken
    full = Endpoint("full", "full", frozenset({"m"}), running=8, max_running=8, kv_hash=LLMESH_SCHEME)
    free = Endpoint("free", "free", frozenset({"m"}), running=7, max_running=8, kv_hash=LLMESH_SCHEME)
    assert TokenLoad(kv).scores([full, free], req(), LocalState()) == [0.0, 1.0]
    # without the slot term the cached prompt (160 tokens saved) outweighs one more decoder (16)
    assert TokenLoad(kv, slot_tokens=0).scores([full, free], req(), LocalState()) == [1.0, 0.0]
