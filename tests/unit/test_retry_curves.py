"""The retry loops outside the gateway share llmesh.backoff.Backoff: the client's retries and the
supervisor's restarts keep their curves, now with jitter that a test can turn off or seed."""

import random

import grpc

from llmesh.backoff import Backoff
from llmesh.client.core import Deadline, RetryPolicy

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


def test_the_clients_curve_doubles_to_its_cap_and_jitter_can_be_turned_off():
    policy = RetryPolicy(max_attempts=6, initial_backoff_s=0.1, max_backoff_s=0.5, jitter=0)
    assert [policy.delay(UNAVAILABLE, n, Deadline(None)) for n in range(1, 6)] == [0.1, 0.2, 0.4, 0.5, 0.5]


def test_the_clients_jitter_is_the_shared_helpers_given_the_same_rng():
    policy = RetryPolicy(max_attempts=6, rng=random.Random(11))
    same = Backoff(initial_s=0.1, max_s=2.0, jitter=0.5, rng=random.Random(11))
    assert [policy.delay(UNAVAILABLE, n, Deadline(None)) for n in (1, 2, 3)] == [same.delay(n) for n in (1, 2, 3)]
    assert RetryPolicy() == RetryPolicy()  # the rng takes no part in comparing policies
