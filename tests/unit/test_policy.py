from collections import Counter

from llmesh.liveconfig.document import InvalidConfig, parse
from llmesh.types import Message, Prompt, Sampling
from llmesh.gateway.domain.policy import apply_policy, pick_target, route

import pytest

CONFIG = parse("""
default:
  generation: {temperature: 0.3}
models:
  big:
    max_attempts: 3
    system_prompt: Be brief.
    generation: {temperature: 0.1, max_tokens: 50}
splits:
  chat:
    targets: [{model: big, weight: 9}, {model: small, weight: 1}]
""")


def test_split_follows_weights_and_sticks_per_user():
    counts = Counter(route("chat", CONFIG, f"user-{i}")[0] for i in range(2000))
    assert 0.85 < counts["big"] / 2000 < 0.95
    assert {route("chat", CONFIG, "alice")[0] for _ in range(10)} == {route("chat", CONFIG, "alice")[0]}


def test_unsplit_models_route_to_themselves_with_their_policy():
    target, policy = route("big", CONFIG, "k")
    assert target == "big" and policy.max_attempts == 3
    assert route("other", CONFIG, "k")[1] == CONFIG.default


def test_policy_fills_only_what_the_request_left_unset():
    chat = Prompt(messages=(Message("user", "hi"),))
    prompt, sampling = apply_policy(chat, Sampling(temperature=0.9), CONFIG.policy("big"))
    assert sampling.temperature == 0.9 and sampling.max_tokens == 50
    assert prompt.messages[0] == Message("system", "Be brief.")
    with_system = Prompt(messages=(Message("system", "Mine."), Message("user", "hi")))
    assert apply_policy(with_system, Sampling(), CONFIG.policy("big"))[0] == with_system


@pytest.mark.parametrize("doc, problem", [
    ("default: {max_attempts: 0}", "max_attempts"),
    ("models: {m: {routing: fastest}}", "routing"),
    ("splits: {a: {targets: []}}", "targets"),
    ("unknown_section: 1", "unknown_section"),
    ("- a list", "mapping"),
])
def test_invalid_documents_say_what_is_wrong(doc, problem):
    with pytest.raises(InvalidConfig) as info:
        parse(doc)
    assert problem in str(info.value)


def test_pick_target_is_deterministic():
    split = CONFIG.splits["chat"]
    assert pick_target(split, "x") == pick_target(split, "x")
