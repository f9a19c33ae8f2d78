"""A 429's retry hint on gRPC: our metadata keys, and google.rpc.RetryInfo in the
status details for clients that read gRPC's rich error model."""

import grpc
from google.rpc import error_details_pb2, status_pb2

from llmesh.errors import QueueFull, RateLimited, Unavailable
from llmesh.rpc.status import DETAILS_KEY, trailing_metadata


def retry_info(md: dict) -> error_details_pb2.RetryInfo:
    status = status_pb2.Status.FromString(md[DETAILS_KEY])
    assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    info = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(info)
    return info


def test_queue_full_carries_its_hint_both_ways():
    md = dict(trailing_metadata(QueueFull("m", 1.5)))
    assert md["llmesh-error-reason"] == "queue_full" and md["retry-after"] == "2" and md["retry-after-ms"] == "1500"
    delay = retry_info(md).retry_delay
    assert (delay.seconds, delay.nanos) == (1, 500_000_000)


def test_a_tenant_limit_too_and_other_errors_have_none():
    md = dict(trailing_metadata(RateLimited("slow down", "rate_limit_exceeded",
                                            {"retry-after": "3", "retry-after-ms": "2500"})))
    assert retry_info(md).retry_delay.seconds == 2
    assert DETAILS_KEY not in dict(trailing_metadata(Unavailable("down")))
