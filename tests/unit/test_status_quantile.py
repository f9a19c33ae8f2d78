import math

from llmesh.cli.status import quantile


def test_quantile_interpolates_inside_the_bucket_like_promql():
    buckets = {0.1: 0, 0.5: 10, 1.0: 20, math.inf: 20}
    assert quantile(0.5, buckets) == 0.5
    assert abs(quantile(0.75, buckets) - 0.75) < 1e-9
    assert quantile(0.25, buckets) == 0.1 + 0.4 * 0.5


def test_quantile_of_nothing_is_none_and_the_inf_bucket_caps_at_the_last_bound():
    assert quantile(0.5, {}) is None
    assert quantile(0.5, {1.0: 0, math.inf: 0}) is None
    assert quantile(0.99, {1.0: 1, math.inf: 10}) == 1.0
