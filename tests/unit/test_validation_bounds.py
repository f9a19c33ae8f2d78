"""Values beyond the wire types of SamplingParams, and over-long conversations, are
INVALID_ARGUMENT before anything tries to encode them."""

import pytest

from llmesh.errors import InvalidArgument
from llmesh.types import Message, Sampling
from llmesh.validation import MAX_MESSAGES, check_messages, check_sampling


@pytest.mark.parametrize("sampling,param", [
    (Sampling(max_tokens=2**32), "max_tokens"), (Sampling(max_tokens=2**70), "max_tokens"),
    (Sampling(seed=2**63), "seed"), (Sampling(seed=-(2**63) - 1), "seed")])
def test_out_of_range_integers_name_their_field(sampling, param):
    with pytest.raises(InvalidArgument) as info:
        check_sampling(sampling)
    assert info.value.param == param


def test_the_edges_of_the_wire_types_are_accepted():
    check_sampling(Sampling(max_tokens=2**32 - 1, seed=2**63 - 1))
    check_sampling(Sampling(seed=-(2**63)))


def test_a_conversation_longer_than_the_limit_is_refused():
    check_messages(tuple(Message(role="user", content="x") for _ in range(MAX_MESSAGES)))
    with pytest.raises(InvalidArgument, match="at most 2048"):
        check_messages(tuple(Message(role="user", content="x") for _ in range(MAX_MESSAGES + 1)))
