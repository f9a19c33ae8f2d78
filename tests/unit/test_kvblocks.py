from llmesh.engine.kvblocks import BlockLedger, KvEvent, chain_hashes


def test_chain_hashes_cover_the_whole_prefix():
    a = chain_hashes(list(range(40)), 16)
    b = chain_hashes(list(range(32)) + [99] * 8, 16)
    c = chain_hashes([7] + list(range(1, 40)), 16)
    assert len(a) == 2 and a == b  # the partial last block is not hashed
    assert c[0] != a[0] and c[1] != a[1]  # same tokens 16..31, different parent
    assert chain_hashes(list(range(16, 32)), 16, parent=a[0]) == [a[1]]


def test_shared_blocks_are_stored_once_and_removed_with_the_last_owner():
    led = BlockLedger(16)
    prefix = list(range(32))
    assert led.hold("s0", prefix + [1] * 16) == 0
    first = led.take_events()
    assert [e.kind for e in first] == ["stored"] and len(first[0].hashes) == 3
    assert led.hold("s1", prefix + [2] * 16) == 32  # two blocks held by s0 already
    second = led.take_events()
    assert [e.kind for e in second] == ["stored"] and len(second[0].hashes) == 1
    assert second[0].hashes == (chain_hashes([2] * 16, 16, parent=first[0].hashes[1])[0],)  # chained from s0's
    led.release("s0")
    gone = led.take_events()
    assert gone == [KvEvent("removed", (first[0].hashes[2],))]
    led.release("s1")
    assert {h for e in led.take_events() for h in e.hashes} == set(first[0].hashes[:2]) | set(second[0].hashes)


def test_grow_stores_each_completed_block():
    led = BlockLedger(4)
    tokens = [1, 2, 3]
    led.hold("s", tokens)
    assert led.take_events() == []
    for t in range(4, 10):
        tokens.append(t)
        led.grow("s", tokens)
    events = led.take_events()
    assert [len(e.hashes) for e in events] == [1, 1]
    assert [h for e in events for h in e.hashes] == chain_hashes(tokens, 4)


def test_released_blocks_stay_cached_until_evicted_lru():
    led = BlockLedger(4, keep_released=True)
    led.hold("a", [1, 2, 3, 4])
    led.hold("b", [5, 6, 7, 8])
    led.release("a")
    led.release("b")
    led.take_events()
    assert led.cached_blocks == 2
    assert led.hold("c", [1, 2, 3, 4, 9]) == 4  # a cache hit, no new event
    assert led.take_events() == []
    assert led.evict(5) == 1  # only b's block is evictable
    assert led.take_events() == [KvEvent("removed", tuple(chain_hashes([5, 6, 7, 8], 4)))]


def test_a_released_owners_tail_is_evicted_before_its_prefix():
    """As vLLM frees a request's blocks: the last first, so eviction takes a history before the prefix
    it grew from, and never a block it is told to spare."""
    led = BlockLedger(4, keep_released=True)
    tokens = list(range(12))
    blocks = chain_hashes(tokens, 4)
    led.hold("a", tokens)
    led.release("a")
    led.take_events()
    assert led.evict(1) == 1 and led.take_events() == [KvEvent("removed", (blocks[2],))]
    assert led.present(blocks) == (2, frozenset(blocks[:2]))
    assert led.evict(1, spare=frozenset({blocks[1]})) == 1
    assert led.take_events() == [KvEvent("removed", (blocks[0],))]
    assert led.present(blocks) == (0, frozenset())  # the chain is broken at its head


def test_held_blocks_count_a_shared_block_once():
    led = BlockLedger(4, keep_released=True)
    led.hold("a", list(range(8)) + [1, 1, 1, 1])
    led.hold("b", list(range(8)) + [2, 2, 2, 2])
    assert led.held_blocks == 4 and led.owned("a") == led.owned("b") == 3
    assert led.present(chain_hashes(list(range(8)) + [3, 3, 3, 3], 4)) == (2, frozenset())  # held, not only cached
    led.release("a")
    assert led.held_blocks == 3 and led.cached_blocks == 1


def test_resync_lists_everything_present():
    led = BlockLedger(4, keep_released=True)
    led.hold("a", list(range(8)))
    led.release("a")
    led.hold("b", list(range(100, 104)))
    events = led.resync()
    assert events[0] == KvEvent("cleared")
    assert set(events[1].hashes) == set(chain_hashes(range(8), 4)) | set(chain_hashes(range(100, 104), 4))
    assert led.take_events() == []


def test_unsent_events_are_bounded_and_replaced_by_a_resync():
    from llmesh.engine.kvblocks import KvEventLog

    log = KvEventLog(max_pending=3)
    for h in range(5):
        log.stored([h])  # nobody takes them: an engine without a scheduler
    log.removed([0])
    events = log.take_events()
    assert events[0] == KvEvent("cleared") and set(events[1].hashes) == {1, 2, 3, 4}
    log.stored([9])
    assert log.take_events() == [KvEvent("stored", (9,))]  # back to plain events
