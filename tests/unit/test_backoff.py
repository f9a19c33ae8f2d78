import random

import pytest

from llmesh.backoff import Backoff


def test_delays_double_up_to_the_ceiling_and_reset_starts_over():
    b = Backoff(initial_s=0.5, max_s=4.0, jitter=0.0)
    assert [b.next() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert b.attempts == 6
    b.reset()
    assert b.next() == 0.5


def test_jitter_stays_within_its_band_and_spreads_clients():
    b = Backoff(initial_s=1.0, max_s=1.0, jitter=0.5, rng=random.Random(7))
    waits = [b.delay(1) for _ in range(200)]
    assert all(0.5 <= w <= 1.0 for w in waits)
    assert max(waits) - min(waits) > 0.3  # not all in step


def test_a_huge_attempt_number_is_the_ceiling_not_an_overflow():
    assert Backoff(initial_s=0.1, max_s=3.0, jitter=0.0).delay(10_000) == 3.0
    assert Backoff().ceiling(0) == 0.0


@pytest.mark.parametrize("kwargs", [{"initial_s": 0}, {"initial_s": 2, "max_s": 1}, {"factor": 0.5},
                                    {"jitter": 1.5}])
def test_nonsense_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        Backoff(**kwargs)


async def test_sleep_waits_what_next_says():
    b = Backoff(initial_s=0.01, max_s=0.01, jitter=0.0)
    assert await b.sleep() == 0.01
