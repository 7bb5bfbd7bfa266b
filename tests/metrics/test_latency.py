"""LatencyDistribution: the documented quantile error bound against numpy, exact count/sum/min/max,
bounded memory, and refusal of impossible durations."""

from __future__ import annotations

import json
import math

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdkv.metrics import QUANTILES, RELATIVE_ERROR, LatencyDistribution, MetricValueError
from pdkv.metrics.latency import BUCKET_COUNT, MAX_TRACKED_SECONDS, MIN_TRACKED_SECONDS

# log() rounding can move a value sitting exactly on a bucket edge into the next bucket, which adds
# a few ulps to the bound; nothing else may exceed it
BOUND = RELATIVE_ERROR * (1 + 1e-9)

FloatArray = npt.NDArray[np.float64]


def _distribution(values: FloatArray | list[float]) -> LatencyDistribution:
    distribution = LatencyDistribution()
    for value in values:
        distribution.record(float(value))
    return distribution


def _assert_within_bound(distribution: LatencyDistribution, values: FloatArray) -> None:
    for q in (*QUANTILES, 0.0, 0.25, 0.75, 0.999, 1.0):
        estimate = distribution.quantile(q)
        # numpy.quantile rather than numpy.percentile(q * 100): percentile divides by 100 in floating
        # point, and 99.9 / 100 lands one ulp above 0.999, which moves the nearest rank by one
        nearest_rank = float(np.quantile(values, q, method="inverted_cdf"))
        assert abs(estimate - nearest_rank) <= BOUND * nearest_rank, (q, estimate, nearest_rank)
        # against numpy's default (linear interpolation) the estimate is bracketed by the two order
        # statistics numpy interpolates between, each widened by the relative error
        lower = float(np.quantile(values, q, method="lower"))
        higher = float(np.quantile(values, q, method="higher"))
        linear = float(np.quantile(values, q))
        assert lower <= linear <= higher
        assert (1 - BOUND) * lower <= estimate <= (1 + BOUND) * higher, (q, estimate, lower, higher)


def _random_seconds(shape: str, rng: np.random.Generator) -> FloatArray:
    """Seconds shaped like what a transport sees: mostly milliseconds with a long tail."""
    n = 20_000
    if shape == "lognormal":
        return rng.lognormal(mean=-4.0, sigma=1.5, size=n)
    if shape == "uniform":
        return rng.uniform(0.001, 2.0, size=n)
    if shape == "exponential":
        return rng.exponential(0.05, size=n) + MIN_TRACKED_SECONDS
    if shape == "pareto_tail":
        return np.asarray((rng.pareto(1.2, size=n) + 1) * 1e-3, dtype=np.float64)
    assert shape == "two_links"  # one link 80x slower than the other, 5 % of rooms
    mixed = np.concatenate([rng.normal(0.01, 0.001, n - n // 20), rng.normal(0.8, 0.05, n // 20)])
    return np.asarray(np.abs(mixed), dtype=np.float64)


SHAPES = ("lognormal", "uniform", "exponential", "pareto_tail", "two_links")


@pytest.mark.parametrize("shape", SHAPES)
def test_quantiles_are_within_the_documented_bound_of_numpy(shape: str) -> None:
    values = _random_seconds(shape, np.random.default_rng(20240607))
    values = values[(values >= MIN_TRACKED_SECONDS) & (values <= MAX_TRACKED_SECONDS)]
    distribution = _distribution(values)
    _assert_within_bound(distribution, values)


@given(
    st.lists(
        st.floats(min_value=MIN_TRACKED_SECONDS, max_value=MAX_TRACKED_SECONDS, allow_nan=False),
        min_size=1,
        max_size=300,
    )
)
def test_quantile_bound_holds_for_any_sample(values: list[float]) -> None:
    _assert_within_bound(_distribution(values), np.array(values, dtype=np.float64))


def test_count_sum_min_max_are_exact() -> None:
    values = [0.003, 0.25, 0.0, 1.5, 0.003]
    summary = _distribution(values).summary()
    assert summary.count == 5
    assert summary.sum == math.fsum(values)
    assert summary.min == 0.0
    assert summary.max == 1.5
    assert summary.mean == pytest.approx(1.756 / 5)


def test_p99_of_a_few_rooms_is_their_slowest() -> None:
    # nearest rank: below 100 samples p99 is the maximum, so one slow room out of two shows up
    summary = _distribution([0.010, 0.500]).summary()
    assert summary.p99 == 0.5
    assert summary.p50 == pytest.approx(0.010, rel=RELATIVE_ERROR)


def test_a_single_value_is_reported_exactly() -> None:
    # clamping to the exact [min, max] makes one sample exact even though its bucket is 2 % wide
    summary = _distribution([0.123456]).summary()
    assert summary.p50 == summary.p90 == summary.p99 == 0.123456


def test_values_outside_the_tracked_range_report_the_exact_extremes() -> None:
    distribution = _distribution([0.0, 0.0, 0.0, 5e-7, 2e5])
    assert distribution.quantile(0.5) == 0.0
    assert distribution.quantile(1.0) == 2e5


def test_empty_distribution_summarises_to_zeros() -> None:
    summary = LatencyDistribution().summary()
    assert summary.to_dict() == {
        "count": 0,
        "sum": 0.0,
        "min": 0.0,
        "max": 0.0,
        "p50": 0.0,
        "p90": 0.0,
        "p99": 0.0,
    }
    assert summary.mean == 0.0
    assert LatencyDistribution().quantile(0.99) == 0.0


def test_memory_does_not_grow_with_records() -> None:
    distribution = _distribution(np.random.default_rng(1).lognormal(-3, 2, size=50_000))
    # the only per-record storage is a fixed array of bucket counts
    assert distribution._counts.shape == (BUCKET_COUNT,)
    assert BUCKET_COUNT < 1_500
    assert int(distribution._counts.sum()) == len(distribution) == 50_000


@pytest.mark.parametrize("bad", [-1e-9, -1.0, math.nan, math.inf, -math.inf])
def test_impossible_durations_are_refused(bad: float) -> None:
    distribution = LatencyDistribution()
    with pytest.raises(MetricValueError, match="finite and >= 0"):
        distribution.record(bad)
    assert len(distribution) == 0


def test_quantile_outside_zero_one_is_refused() -> None:
    with pytest.raises(MetricValueError, match=r"\[0, 1\]"):
        LatencyDistribution().quantile(1.5)


def test_copy_is_independent() -> None:
    original = _distribution([0.1, 0.2])
    twin = original.copy()
    original.record(9.0)
    assert twin.summary().count == 2
    assert twin.summary().max == 0.2
    assert original.summary().max == 9.0


def test_summary_is_json_ready() -> None:
    summary = _distribution([0.1, 0.2, 0.3]).summary()
    assert json.loads(json.dumps(summary.to_dict())) == summary.to_dict()


def test_quantile_rank_reads_q_as_a_decimal() -> None:
    # 0.07 * 100 is 7.000000000000001 in binary, whose ceiling is the 8th value (numpy's
    # inverted_cdf returns 0.008 here); the nearest rank of q = 7 % over 100 values is the 7th
    distribution = _distribution([v / 1000 for v in range(1, 101)])
    assert distribution.quantile(0.07) == pytest.approx(0.007, rel=RELATIVE_ERROR)
