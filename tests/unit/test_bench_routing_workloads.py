"""The routing bench's generated workloads have the shapes they are named for: a long shared
prefix under most of a SaaS prompt, prefill-heavy code generation, decode-heavy reasoning,
nothing shared in the control, agent sessions whose every turn mostly repeats the last."""

import statistics

from bench.routing_workloads import SHAPES, WORKLOADS, Sessions, poisson_starts


def shared_share(s: Sessions, n: int) -> float:
    """Share of session ``n``'s first prompt that other sessions' first prompts also start with."""
    first = s.session(n)[0].messages
    return len(first[0].content.split()) / sum(len(m.content.split()) for m in first) if s.prefixes else 0.0


def test_every_workload_is_fixed_by_its_seed():
    assert set(WORKLOADS) < set(SHAPES)                                   # the field's generators run on request
    for name in SHAPES:
        assert [Sessions(name, 3).session(n) for n in range(10)] == [Sessions(name, 3).session(n) for n in range(10)]
        assert Sessions(name, 3).session(0) != Sessions(name, 4).session(0)


def test_shared_prefix_groups_prompts_over_a_few_long_system_prompts():
    s = Sessions("shared_prefix")
    systems = [s.session(n)[0].messages[0].content for n in range(200)]
    assert len(set(systems)) == SHAPES["shared_prefix"].groups           # every group used, no other prefix
    assert min(shared_share(s, n) for n in range(50)) > 0.9               # the prompt is mostly its group's
    assert all(len(s.session(n)) == 1 for n in range(50))


def test_code_gen_is_prefill_heavy_and_reasoning_decode_heavy():
    code, reason = Sessions("code_gen"), Sessions("reasoning")
    c, r = code.session(0)[0], reason.session(0)[0]
    c_in = sum(len(m.content.split()) for m in c.messages)
    r_in = sum(len(m.content.split()) for m in r.messages)
    assert c_in > 40 * c.max_tokens                                       # thousands in, tens out
    assert r.max_tokens > 1.5 * r_in                                      # hundreds out of a short prompt
    assert 0.8 < shared_share(code, 0) < 0.95                             # the repository is shared


def test_zero_reuse_shares_nothing():
    s = Sessions("zero_reuse")
    firsts = [s.session(n)[0].messages for n in range(50)]
    assert all(len(m) == 1 for m in firsts)                               # no system prompt
    heads = {" ".join(m[0].content.split()[:16]) for m in firsts}
    assert len(heads) == 50                                               # not even a block in common


def test_agentic_sessions_grow_and_reuse_most_of_each_turn():
    s = Sessions("agentic")
    lengths = [s.prompt_words(n) for n in range(40)]
    assert statistics.mean(len(x) for x in lengths) >= 4 and min(len(x) for x in lengths) >= 4
    for x in lengths:
        assert all(b > a for a, b in zip(x, x[1:]))                        # the context grows
        reused = [a / b for a, b in zip(x, x[1:])]                         # the last turn's context, resent
        assert min(reused) > 0.8 and x[-1] - x[0] >= (len(x) - 1) * 300    # each turn adds a tool's output


def test_llmd_shared_prefix_repeats_a_fixed_pool_of_prompts_as_inference_perf_does():
    s, shape = Sessions("shared_prefix_llmd"), SHAPES["shared_prefix_llmd"]
    every = shape.groups * shape.prompts_per_group
    prompts = [s.session(n)[0].messages for n in range(2 * every)]
    assert len(set(prompts)) == every                                     # each prompt once a round
    assert prompts[:every] == prompts[every:]                             # then the same round again
    assert len({p[0].content for p in prompts[:every]}) == shape.groups   # 5 questions under each system prompt
    assert len({p[0].content for p in prompts[:shape.prompts_per_group]}) > 1  # shuffled, not group by group


def test_agentic_replay_gives_each_session_its_own_system_prompt_after_the_shared_one():
    s, shape = Sessions("agentic_replay"), SHAPES["agentic_replay"]
    systems = [s.session(n)[0].messages[0].content.split() for n in range(40)]
    heads = {" ".join(w[:shape.prefix_words]) for w in systems}
    tails = {" ".join(w[shape.prefix_words:]) for w in systems}
    assert len(heads) == shape.groups and len(tails) == 40                # shared by kind, then the session's own
    assert all(len(w) == shape.prefix_words + shape.session_words for w in systems)
    assert all(len(s.session(n)) >= 4 for n in range(40))


def test_scale_shrinks_every_size():
    full, small = Sessions("code_gen"), Sessions("code_gen", scale=0.1)
    assert sum(small.prompt_words(0)) < 0.15 * sum(full.prompt_words(0))
    assert small.session(0)[0].max_tokens >= 1


def test_open_loop_arrivals_are_poisson():
    starts = poisson_starts(20.0, 200.0, seed=1)
    assert all(0 <= a < b < 200 for a, b in zip(starts, starts[1:]))
    assert 3800 < len(starts) < 4200                                      # about rate x duration
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert 0.85 < statistics.stdev(gaps) / statistics.mean(gaps) < 1.15  # exponential: cv 1
