"""A bounded-memory latency distribution: ``LatencyDistribution`` and its frozen ``LatencySummary``.

Owns: recording durations and answering p50 / p90 / p99 with exact count, sum, min and max. Must
not lock (``TransportMetrics`` holds the one lock around it), read a clock, or import anything above
pdkv.errors.

Why fixed log-spaced buckets and not a reservoir: a reservoir keeps k samples and its p99 error
depends on how many samples fell past the 99th percentile (with k = 1024 and a million records,
about 10 samples decide p99), so its error is probabilistic and grows in the tail that an operator
looks at. Log buckets (the DDSketch idea) bound the *relative* error of every quantile
deterministically, cost one ``log`` and one increment per record, and take the same memory whether
a peer saw ten rooms or ten million.

The bound. Bucket ``k`` holds values in ``(g**(k-1), g**k]`` with ``g = (1 + a) / (1 - a)`` and is
reported as ``2 * g**k / (g + 1)``, which lies within ``a`` (relative) of every value in the
bucket. Quantiles use the nearest-rank definition: for ``n`` values, quantile ``q`` is the
``ceil(q * n)``-th smallest (``numpy.quantile(method="inverted_cdf")``), so p99 of fewer than 100
rooms is their maximum and the tail is never understated by interpolation. With
``a = RELATIVE_ERROR`` (1 %) and ``x`` that exact order statistic, ``|estimate - x| <= a * x``.
Against numpy's default linear interpolation the estimate lies in
``[(1 - a) * lower, (1 + a) * higher]`` (``method="lower"`` / ``"higher"``), because the
nearest rank always falls between those two. Estimates are also clamped to the exact [min, max]
seen, which only moves them closer. Values below ``MIN_TRACKED_SECONDS`` (including 0) share one
bucket reported as the exact minimum; values above ``MAX_TRACKED_SECONDS`` share one reported as the
exact maximum: no relative bound holds there, and pdkv's deadlines (300 s) keep real latencies far
inside.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from typing import Final

import attrs
import numpy as np
import numpy.typing as npt

from pdkv.metrics.errors import MetricValueError

RELATIVE_ERROR: Final = 0.01
"""Every quantile estimate is within 1 % of the exact order statistic (see the module docstring)."""
MIN_TRACKED_SECONDS: Final = 1e-6
"""Below 1 us the relative bound is dropped: no transfer or handshake is that fast."""
MAX_TRACKED_SECONDS: Final = 1e5
"""About 28 hours; every pdkv deadline is orders of magnitude shorter."""

_GAMMA: Final = (1 + RELATIVE_ERROR) / (1 - RELATIVE_ERROR)
_LOG_GAMMA: Final = math.log(_GAMMA)
_FIRST_KEY: Final = math.ceil(math.log(MIN_TRACKED_SECONDS) / _LOG_GAMMA)
_LAST_KEY: Final = math.ceil(math.log(MAX_TRACKED_SECONDS) / _LOG_GAMMA)
# slot 0: under the tracked range (and zero); slots 1..: one per key; last slot: over the range
_UNDERFLOW: Final = 0
_OVERFLOW: Final = _LAST_KEY - _FIRST_KEY + 2
BUCKET_COUNT: Final = _OVERFLOW + 1
"""Slots per distribution (about 1,270 at 1 %: 10 KiB of int64 per peer)."""

QUANTILES: Final = (0.5, 0.9, 0.99)


@attrs.frozen(kw_only=True)
class LatencySummary:
    """A distribution's figures at one moment, in seconds; every field is 0 when nothing was recorded."""

    count: int
    sum: float
    min: float
    max: float
    p50: float
    p90: float
    p99: float

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else 0.0

    def quantile_items(self) -> tuple[tuple[float, float], ...]:
        """(quantile, seconds) pairs in ``QUANTILES`` order, for exporters that label by quantile."""
        return ((0.5, self.p50), (0.9, self.p90), (0.99, self.p99))

    def to_dict(self) -> dict[str, float | int]:
        return {
            "count": self.count,
            "sum": self.sum,
            "min": self.min,
            "max": self.max,
            "p50": self.p50,
            "p90": self.p90,
            "p99": self.p99,
        }


EMPTY_SUMMARY: Final = LatencySummary(count=0, sum=0.0, min=0.0, max=0.0, p50=0.0, p90=0.0, p99=0.0)


def _slot(seconds: float) -> int:
    if seconds < MIN_TRACKED_SECONDS:
        return _UNDERFLOW
    if seconds > MAX_TRACKED_SECONDS:
        return _OVERFLOW
    key = math.ceil(math.log(seconds) / _LOG_GAMMA)
    # rounding in log() can put a value exactly on the range edge one key outside it
    return min(max(key, _FIRST_KEY), _LAST_KEY) - _FIRST_KEY + 1


def _nearest_rank(q: float, n: int) -> int:
    """0-based index of the ``ceil(q * n)``-th smallest of ``n`` values.

    ``q`` is read as the decimal it was written as: in binary ``0.07 * 100`` is ``7.000000000000001``,
    whose ceiling would pick the 8th value instead of the 7th.
    """
    return max(math.ceil(_decimal(float(q)) * n) - 1, 0)


@functools.lru_cache(maxsize=64)
def _decimal(q: float) -> Fraction:
    # cached: exporters ask for the same three quantiles of every peer at every scrape
    return Fraction(repr(q))


def _representative(slot: int, minimum: float, maximum: float) -> float:
    if slot == _UNDERFLOW:
        return minimum
    if slot == _OVERFLOW:
        return maximum
    upper = _GAMMA ** (slot - 1 + _FIRST_KEY)
    return min(max(2.0 * upper / (_GAMMA + 1.0), minimum), maximum)


class LatencyDistribution:
    """Durations in seconds, bounded memory, relative quantile error <= ``RELATIVE_ERROR``.

    Not thread-safe on its own: the owner serialises ``record`` and ``summary`` (TransportMetrics
    does, under its one lock).
    """

    __slots__ = ("_counts", "_max", "_min", "_n", "_sum")

    def __init__(self) -> None:
        self._counts: npt.NDArray[np.int64] = np.zeros(BUCKET_COUNT, dtype=np.int64)
        self._n = 0
        self._sum = 0.0
        self._min = math.inf
        self._max = 0.0

    def __len__(self) -> int:
        return self._n

    def copy(self) -> LatencyDistribution:
        """An independent copy (so a snapshot can be summarised outside its owner's lock)."""
        twin = LatencyDistribution()
        twin._counts = self._counts.copy()
        twin._n = self._n
        twin._sum = self._sum
        twin._min = self._min
        twin._max = self._max
        return twin

    def record(self, seconds: float) -> None:
        """Add one duration; negative, NaN or infinite durations are a caller bug and raise."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise MetricValueError(f"a latency is a number of seconds, got {seconds!r}")
        if not math.isfinite(seconds) or seconds < 0:
            raise MetricValueError(f"a latency must be finite and >= 0 seconds, got {seconds!r}")
        value = float(seconds)
        self._counts[_slot(value)] += 1
        self._n += 1
        self._sum += value
        self._min = min(self._min, value)
        self._max = max(self._max, value)

    def quantile(self, q: float) -> float:
        """The estimate of the ``ceil(q * count)``-th smallest value (nearest rank); 0 when empty."""
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0.0 <= q <= 1.0:
            raise MetricValueError(f"a quantile lies in [0, 1], got {q!r}")
        return self._quantiles((q,))[0]

    def summary(self) -> LatencySummary:
        if self._n == 0:
            return EMPTY_SUMMARY
        p50, p90, p99 = self._quantiles(QUANTILES)
        return LatencySummary(
            count=self._n, sum=self._sum, min=self._min, max=self._max, p50=p50, p90=p90, p99=p99
        )

    def _quantiles(self, qs: tuple[float, ...]) -> list[float]:
        if self._n == 0:
            return [0.0 for _ in qs]
        cumulative = np.cumsum(self._counts)
        ranks = np.array([_nearest_rank(q, self._n) for q in qs], dtype=np.int64)
        # the value of 0-based rank r sits in the first slot whose cumulative count exceeds r
        slots = np.searchsorted(cumulative, ranks, side="right")
        return [_representative(int(s), self._min, self._max) for s in slots]
