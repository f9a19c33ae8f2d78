"""Priority classes on the wire: every class round-trips, unset is NORMAL, an unknown
value is refused with INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import pytest

from llmesh.convert import priority_from_pb, priority_to_pb
from llmesh.errors import ErrorCode, InvalidArgument
from llmesh.types import Priority
from llmesh.v1 import common_pb2, engine_pb2


def test_classes_are_ordered():
    assert Priority.LOW < Priority.NORMAL < Priority.HIGH


@pytest.mark.parametrize("p", list(Priority))
def test_every_class_round_trips_through_a_request(p):
    wire = engine_pb2.GenerateRequest(priority=priority_to_pb(p)).SerializeToString()
    assert priority_from_pb(engine_pb2.GenerateRequest.FromString(wire).priority) is p


def test_unset_is_normal():
    assert engine_pb2.GenerateRequest().priority == common_pb2.PRIORITY_UNSPECIFIED
    assert priority_from_pb(engine_pb2.GenerateRequest().priority) is Priority.NORMAL


def test_an_unknown_value_is_refused():
    req = engine_pb2.GenerateRequest.FromString(engine_pb2.GenerateRequest(priority=7).SerializeToString())
    with pytest.raises(InvalidArgument) as info:
        priority_from_pb(req.priority)
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    assert info.value.param == "priority" and "PRIORITY_HIGH" in info.value.message
