"""The scheduler's KV change log as gateways read it: deltas folded per engine since
a cursor, a resync once the log has moved past a slow watcher; and the shared prompt
hashing agreeing with the engines' own."""

from llmesh.engine.backends.sim import SimBackend
from llmesh.gateway.upstream.picking.kvview import KvView
from llmesh.kvhash import chain_hashes
from llmesh.prompt_tokens import sim_tokenize
from llmesh.scheduler.kvfeed import KvChangeLog
from llmesh.types import Message, Prompt


def test_changes_since_a_cursor_fold_per_engine_in_order():
    log = KvChangeLog()
    start = log.cursor
    log.record("a", [("stored", [1, 2, 3]), ("removed", [2])])
    log.record("b", [("stored", [9])])
    deltas, cursor = log.since(start)
    assert deltas["a"].stored == {1, 3} and deltas["a"].removed == {2} and not deltas["a"].resync
    assert deltas["b"].stored == {9}
    log.record("a", [("removed", [1]), ("stored", [1])])
    deltas, cursor = log.since(cursor)
    assert deltas["a"].stored == {1} and deltas["a"].removed == set() and "b" not in deltas
    log.forget("b")
    deltas, _ = log.since(cursor)
    assert deltas["b"].resync and not deltas["b"].stored


def test_a_watcher_the_bounded_log_moved_past_must_resync():
    log = KvChangeLog(max_hashes=10)
    start = log.cursor
    for n in range(10):
        log.record("a", [("stored", [n, n + 100])])
    assert log.since(start) is None
    assert log.since(log.cursor) == ({}, log.cursor)


def test_gateway_view_follows_the_deltas():
    log, view = KvChangeLog(), KvView()
    cursor = log.cursor
    log.record("a", [("stored", [1, 2]), ("cleared", []), ("stored", [5])])
    deltas, cursor = log.since(cursor)
    view.apply("a", True, [7], [])          # stale state from before
    for eid, d in deltas.items():
        view.apply(eid, d.resync, d.stored, d.removed)
    assert view.count("a") == 1 and view.matched("a", [5]) == 1


def test_the_gateways_sim_tokens_are_the_sim_engines_and_chain_prefixes():
    first = Prompt(messages=(Message("system", "policy " * 40), Message("user", "one")))
    follow = Prompt(messages=(*first.messages, Message("assistant", "alpha"), Message("user", "two")))
    assert sim_tokenize(follow) == SimBackend("sim-x", 4096).tokenize(follow)
    a, b = chain_hashes(sim_tokenize(first)), chain_hashes(sim_tokenize(follow))
    assert len(a) == 2 and b[:2] == a
