"""KVTransferMetric: counted bytes, non-negative durations, ordered timestamps, combining chunks."""

from __future__ import annotations

import math

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdkv.errors import PdkvError
from pdkv.metrics import KVTransferMetric, MetricValueError, bytes_written

TIMESTAMP_FIELDS = ("queued_at", "first_submit_at", "last_completion_at")


def _with_stamps(
    queued_at: float | None, first_submit_at: float | None, last_completion_at: float | None
) -> KVTransferMetric:
    return KVTransferMetric(
        room=1, queued_at=queued_at, first_submit_at=first_submit_at, last_completion_at=last_completion_at
    )


def test_gb_per_s_is_bytes_over_engine_seconds() -> None:
    metric = KVTransferMetric(room=7, pages=10, bytes=3_000_000_000, seconds=2.0)
    assert metric.gb_per_s == pytest.approx(1.5)


def test_gb_per_s_is_zero_without_engine_time() -> None:
    assert KVTransferMetric(room=7, pages=1, bytes=4096, seconds=0.0).gb_per_s == 0.0


def test_empty_metric_reports_nothing() -> None:
    metric = KVTransferMetric.empty(42)
    assert metric.room == 42
    assert (metric.pages, metric.bytes, metric.seconds) == (0, 0, 0.0)
    assert metric.is_empty
    assert metric.gb_per_s == 0.0
    assert (metric.queue_seconds, metric.transfer_span_seconds, metric.end_to_end_seconds) == (0, 0, 0)


def test_durations_come_from_the_timestamps() -> None:
    metric = KVTransferMetric(
        room=1,
        pages=2,
        bytes=2,
        seconds=0.5,
        queued_at=100.0,
        first_submit_at=100.25,
        last_completion_at=101.0,
    )
    assert metric.queue_seconds == 0.25
    assert metric.transfer_span_seconds == 0.75
    assert metric.end_to_end_seconds == 1.0


@pytest.mark.parametrize("unset", TIMESTAMP_FIELDS)
def test_a_duration_touching_an_unset_timestamp_is_zero(unset: str) -> None:
    stamps: dict[str, float | None] = {
        "queued_at": 1000.0,
        "first_submit_at": 1001.0,
        "last_completion_at": 1003.0,
    }
    stamps[unset] = None
    metric = _with_stamps(stamps["queued_at"], stamps["first_submit_at"], stamps["last_completion_at"])
    spans = {
        "queue_seconds": ("queued_at", "first_submit_at", 1.0),
        "transfer_span_seconds": ("first_submit_at", "last_completion_at", 2.0),
        "end_to_end_seconds": ("queued_at", "last_completion_at", 3.0),
    }
    for prop, (start, end, when_both_set) in spans.items():
        expected = 0.0 if unset in (start, end) else when_both_set
        assert getattr(metric, prop) == expected, prop


def test_timestamps_out_of_order_are_refused_not_clamped() -> None:
    with pytest.raises(MetricValueError, match=r"first_submit_at=4\.0 is before queued_at=5\.0"):
        KVTransferMetric(room=3, queued_at=5.0, first_submit_at=4.0)
    # the check skips an unset event in the middle: completion before queueing is still wrong
    with pytest.raises(MetricValueError, match="last_completion_at"):
        KVTransferMetric(room=3, queued_at=5.0, last_completion_at=1.0)


@given(
    stamps=st.lists(
        st.one_of(st.none(), st.floats(min_value=-1e9, max_value=1e9, allow_nan=False)),
        min_size=3,
        max_size=3,
    )
)
def test_no_duration_is_ever_negative(stamps: list[float | None]) -> None:
    try:
        metric = _with_stamps(*stamps)
    except MetricValueError:
        set_values = [s for s in stamps if s is not None]
        assert set_values != sorted(set_values), "refused timestamps that were in order"
        return
    assert metric.queue_seconds >= 0
    assert metric.transfer_span_seconds >= 0
    assert metric.end_to_end_seconds >= 0


@pytest.mark.parametrize(
    "field, value",
    [
        ("pages", -1),
        ("bytes", -4096),
        ("seconds", -0.001),
        ("seconds", math.nan),
        ("seconds", math.inf),
        ("room", -1),
        ("room", 2**63),
        ("pages", True),
        ("pages", 1.0),
        ("queued_at", math.nan),
        ("first_submit_at", math.inf),
    ],
)
def test_impossible_values_are_refused(field: str, value: object) -> None:
    with pytest.raises(MetricValueError, match=field):
        KVTransferMetric(**{"room": 1, field: value})  # type: ignore[arg-type]  # deliberately wrong values


def test_metric_errors_are_pdkv_value_errors() -> None:
    with pytest.raises(PdkvError):
        KVTransferMetric(room=1, pages=-1)
    with pytest.raises(ValueError):
        KVTransferMetric(room=1, pages=-1)


def test_metric_is_frozen() -> None:
    metric = KVTransferMetric(room=1, pages=1, bytes=1)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        metric.pages = 2  # type: ignore[misc]  # proving it is refused


def test_bytes_written_sums_pages_times_page_bytes_per_buffer() -> None:
    # MLA: 61 layers x 128 pages x 73,728 B, plus one NSA state buffer that got 3 pages of 512 B
    pages = [128] * 61 + [3]
    page_bytes = [73_728] * 61 + [512]
    assert bytes_written(pages, page_bytes) == 575_668_224 + 1_536


def test_bytes_written_is_exact_past_int64() -> None:
    assert bytes_written([2**40, 1], [2**40, 1]) == 2**80 + 1


def test_bytes_written_refuses_mismatched_or_negative_input() -> None:
    with pytest.raises(MetricValueError, match="2 page counts for 3 buffers"):
        bytes_written([1, 2], [1, 2, 3])
    with pytest.raises(MetricValueError, match="pages of buffer 1"):
        bytes_written([1, -2], [1, 2])
    with pytest.raises(MetricValueError, match="bytes per page of buffer 0"):
        bytes_written([1], [-8])


def test_combining_chunks_adds_counts_and_keeps_the_outer_timestamps() -> None:
    first = KVTransferMetric(
        room=9, pages=4, bytes=400, seconds=0.5, queued_at=10.0, first_submit_at=11.0, last_completion_at=12.0
    )
    second = KVTransferMetric(
        room=9,
        pages=2,
        bytes=200,
        seconds=0.25,
        queued_at=10.5,
        first_submit_at=13.0,
        last_completion_at=14.0,
    )
    total = first.combined_with(second)
    assert (total.pages, total.bytes, total.seconds) == (6, 600, 0.75)
    assert (total.queued_at, total.first_submit_at, total.last_completion_at) == (10.0, 11.0, 14.0)
    assert total == second.combined_with(first)
    # an empty chunk (nothing owned on this CP rank) changes nothing
    assert first.combined_with(KVTransferMetric.empty(9)) == first


def test_combining_two_rooms_is_refused() -> None:
    with pytest.raises(MetricValueError, match="rooms 1 and 2"):
        KVTransferMetric(room=1).combined_with(KVTransferMetric(room=2))
