"""Cache keys, the live-config cache policy and the in-process store's own rules."""

import pytest
from pydantic import ValidationError

from llmesh.cache.keys import Request, exact_key, normalise, semantic_query
from llmesh.cache.memory import MemoryStore
from llmesh.cache.store import Entry, Name
from llmesh.liveconfig.schema import MeshConfig
from llmesh.types import Message, Prompt, Sampling

GREEDY = Sampling(temperature=0.0, max_tokens=10)


def chat(*turns: tuple[str, str]) -> Prompt:
    return Prompt(messages=tuple(Message(r, c) for r, c in turns))


def key(tenant="t1", model="m", prompt=chat(("user", "hi")), sampling=GREEDY, version="") -> str:
    return exact_key(Request(tenant, model, prompt, sampling, version))


def test_deterministic_means_greedy_or_seeded():
    assert Sampling(temperature=0.0).deterministic
    assert Sampling(temperature=0.7, seed=3).deterministic
    assert not Sampling(temperature=0.7).deterministic
    assert not Sampling().deterministic  # unset means the engine's default, which samples


def test_exact_key_separates_what_changes_the_answer():
    base = key()
    assert base == key(sampling=Sampling(temperature=0.0, max_tokens=10, seed=7, top_p=0.5))  # greedy: no effect
    assert base == key(prompt=chat(("user", "  hi \n")))  # formatting is normalised
    assert base == key(sampling=Sampling(temperature=0.0, max_tokens=10, top_k=-1, presence_penalty=0.0))  # off
    for other in (key(tenant="t2"), key(model="m2"), key(version="v2"),
                  key(sampling=Sampling(temperature=0.0, max_tokens=11)),
                  key(sampling=Sampling(temperature=0.0, max_tokens=10, stop=("x",))),
                  key(prompt=Prompt(text="hi")), key(prompt=chat(("system", "hi"))),
                  key(prompt=chat(("user", "Hi"))),
                  *(key(sampling=Sampling(temperature=0.0, max_tokens=10, **{knob: value}))
                    for knob, value in (("repetition_penalty", 1.3), ("presence_penalty", 1.0),
                                        ("frequency_penalty", -1.0), ("top_k", 3), ("min_p", 0.2)))):
        assert other != base
    seeded = Sampling(temperature=0.8, seed=1, max_tokens=10)
    assert key(sampling=seeded) != key(sampling=Sampling(temperature=0.8, seed=2, max_tokens=10))
    assert key(sampling=seeded) != key(sampling=Sampling(temperature=0.9, seed=1, max_tokens=10))


def test_normalise_keeps_case_and_content():
    assert normalise(" a\t b\n\nc ") == "a b c"
    assert normalise("Ｅ") == "Ｅ"  # NFC, not NFKC: width is the user's choice


def test_semantic_scope_fingerprints_everything_but_the_last_user_turn():
    q = semantic_query(Request("t", "m", chat(("system", "Be brief."), ("user", "How do I reset my password?")),
                               GREEDY))
    assert q.text == "How do I reset my password?"
    same_scope = semantic_query(Request("t", "m", chat(("system", "Be brief."), ("user", "Password reset?")),
                                        GREEDY))
    assert same_scope.scope == q.scope
    for other in (Request("t2", "m", chat(("system", "Be brief."), ("user", "x")), GREEDY),
                  Request("t", "m", chat(("system", "Be long."), ("user", "x")), GREEDY),
                  Request("t", "m", chat(("user", "x")), GREEDY),
                  Request("t", "m", chat(("system", "Be brief."), ("user", "a"), ("assistant", "b"), ("user", "x")),
                          GREEDY),
                  Request("t", "m", chat(("system", "Be brief."), ("user", "x")), GREEDY, model_version="2")):
        assert semantic_query(other).scope != q.scope
    assert semantic_query(Request("t", "m", Prompt(text="raw"), GREEDY)) is None
    assert semantic_query(Request("t", "m", chat(("user", "a"), ("assistant", "b")), GREEDY)) is None


def test_cache_policy_layers_default_model_and_tenant():
    cfg = MeshConfig.model_validate({"cache": {
        "mode": "semantic", "semantic_threshold": 0.9,
        "models": {"m": {"semantic_threshold": 0.8, "ttl_s": 60}},
        "tenants": {"quiet": {"enabled": False}, "sampler": {"cache_sampled": True, "mode": "exact"}}}}).cache
    assert cfg.policy("any", "other").semantic_threshold == 0.9
    assert (cfg.policy("any", "m").semantic_threshold, cfg.policy("any", "m").ttl_s) == (0.8, 60)
    assert cfg.policy("sampler", "m").mode == "exact" and cfg.policy("sampler", "m").ttl_s == 60
    assert not cfg.applies("quiet", "m", deterministic=True)
    assert cfg.applies("any", "m", deterministic=True) and not cfg.applies("any", "m", deterministic=False)
    assert cfg.applies("sampler", "m", deterministic=False)
    with pytest.raises(ValidationError):
        MeshConfig.model_validate({"cache": {"mode": "fuzzy"}})
    with pytest.raises(ValidationError):
        MeshConfig.model_validate({"cache": {"tenants": {"t": {"semantic_threshold": 1.5}}}})


async def test_memory_store_expires_entries_after_their_ttl():
    now = [100.0]
    store = MemoryStore(max_entries_per_tenant=10, clock=lambda: now[0])
    name = Name("t", "m", "x", "ab")
    await store.put(name, Entry(b"v"), ttl_s=5)
    now[0] = 104.9
    assert (await store.get(name)).response == b"v"
    now[0] = 105.1
    assert await store.get(name) is None
    assert (await store.stats("t"))["t"].entries == 0


def test_cache_stats_table_shows_the_hit_ratio_and_an_unavailable_backend():
    from llmesh.cli.cache import render

    out = render({"backend": "redis", "backend_available": False, "semantic_indexed": 3, "tenants": {
        "acme": {"entries": 5, "hits": 3, "semantic_hits": 1, "misses": 1, "stores": 6, "evictions": 0},
        "idle": {"entries": 0, "hits": 0, "semantic_hits": 0, "misses": 0, "stores": 0, "evictions": 0}}})
    assert "UNAVAILABLE" in out and "semantic index 3 entries" in out
    acme, idle = out.splitlines()[2:]
    assert acme.split()[:7] == ["acme", "5", "3", "1", "1", "75.0", "6"]
    assert idle.split()[5] == "-"


def test_response_format_is_part_of_the_key():
    from llmesh.types import ResponseFormat
    plain = key()
    as_json = key(sampling=Sampling(temperature=0.0, max_tokens=10, response_format=ResponseFormat("json_object")))
    schema = key(sampling=Sampling(temperature=0.0, max_tokens=10,
                                   response_format=ResponseFormat("json_schema", '{"type": "object"}')))
    assert len({plain, as_json, schema}) == 3
