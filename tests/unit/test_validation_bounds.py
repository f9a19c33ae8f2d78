"""Values beyond the wire types of SamplingParams, and over-long conversations, are
INVALID_ARGUMENT before anything tries to encode them."""

import pytest

from llmesh.errors import InvalidArgument
from llmesh.types import Message, Prompt, Sampling
from llmesh.v1 import gateway_pb2
from llmesh.validation import check_request, check_sampling, rule


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
    most = rule(gateway_pb2.ChatRequest, "messages").repeated.max_items  # the limit the proto declares
    assert most == 2048

    def conversation(n):
        return Prompt(messages=tuple(Message(role="user", content="x") for _ in range(n)))
    check_request("m", conversation(most), Sampling())
    with pytest.raises(InvalidArgument, match="no more than 2048") as info:
        check_request("m", conversation(most + 1), Sampling())
    assert info.value.param == "messages"
