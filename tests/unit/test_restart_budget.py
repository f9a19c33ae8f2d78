"""`llmesh up`'s restart policy: exponential backoff, a budget of restarts per window."""

from llmesh.cli.up import RestartBudget, RestartPolicy


def test_backoff_doubles_up_to_the_cap_then_the_budget_runs_out():
    budget = RestartBudget(RestartPolicy(max_restarts=5, window_s=60, backoff_initial_s=0.5, backoff_max_s=3,
                                         jitter=0))
    assert [budget.next_delay(t) for t in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert budget.next_delay(5) is None


def test_restarts_older_than_the_window_no_longer_count():
    budget = RestartBudget(RestartPolicy(max_restarts=2, window_s=10, backoff_initial_s=1, backoff_max_s=10, jitter=0))
    assert budget.next_delay(0) == 1 and budget.next_delay(1) == 2
    assert budget.next_delay(5) is None          # third exit inside 10 s
    assert budget.next_delay(11.5) == 1          # both earlier restarts have left the window


def test_zero_restarts_gives_up_on_the_first_exit():
    assert RestartBudget(RestartPolicy(max_restarts=0)).next_delay(0) is None


def test_delays_are_jittered_below_the_curve_by_default():
    import random
    waits = [RestartBudget(RestartPolicy(backoff_initial_s=1, backoff_max_s=8), rng=random.Random(seed))
             .next_delay(0) for seed in range(50)]
    assert all(0.5 <= w <= 1.0 for w in waits) and len(set(waits)) > 1  # children that died together spread out
    seeded = [RestartBudget(RestartPolicy(), rng=random.Random(3)).next_delay(0) for _ in range(2)]
    assert seeded[0] == seeded[1]
