from llmesh.cache.keys import cacheable, exact_key
from llmesh.cache.memory import LruTtlStore
from llmesh.types import Message, Prompt, Sampling

CHAT = Prompt(messages=(Message("user", "hi"),))


def test_only_greedy_requests_are_cacheable():
    assert cacheable(Sampling(temperature=0.0))
    assert not cacheable(Sampling(temperature=0.7))
    assert not cacheable(Sampling())  # unset means the engine's default, which samples


def test_key_separates_what_changes_the_answer_and_ignores_seed():
    base = exact_key("t1", "m", CHAT, Sampling(temperature=0.0, max_tokens=10))
    assert base == exact_key("t1", "m", CHAT, Sampling(temperature=0.0, max_tokens=10, seed=7))
    assert base != exact_key("t2", "m", CHAT, Sampling(temperature=0.0, max_tokens=10))
    assert base != exact_key("t1", "m2", CHAT, Sampling(temperature=0.0, max_tokens=10))
    assert base != exact_key("t1", "m", CHAT, Sampling(temperature=0.0, max_tokens=11))
    assert base != exact_key("t1", "m", CHAT, Sampling(temperature=0.0, max_tokens=10, stop=("x",)))
    assert base != exact_key("t1", "m", Prompt(text="hi"), Sampling(temperature=0.0, max_tokens=10))
    other_role = Prompt(messages=(Message("system", "hi"),))
    assert base != exact_key("t1", "m", other_role, Sampling(temperature=0.0, max_tokens=10))


def test_lru_evicts_least_recently_used():
    store: LruTtlStore[str] = LruTtlStore(max_entries=2, ttl_s=60)
    store.put("a", "1")
    store.put("b", "2")
    assert store.get("a") == "1"
    store.put("c", "3")
    assert store.get("b") is None
    assert (store.get("a"), store.get("c")) == ("1", "3")


def test_entries_expire_after_ttl():
    now = [100.0]
    store: LruTtlStore[str] = LruTtlStore(max_entries=10, ttl_s=5, clock=lambda: now[0])
    store.put("k", "v")
    now[0] = 104.9
    assert store.get("k") == "v"
    now[0] = 105.1
    assert store.get("k") is None
    assert len(store) == 0
