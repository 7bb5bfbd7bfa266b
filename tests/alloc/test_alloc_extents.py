"""LaneExtents against a boolean free-page model: exact first fit, fewest extents, exact merging."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdkv.alloc import ExtentList, InvalidAllocationError, LaneExtents
from pdkv.alloc.extents import GROUP_PAGES, MAX_LANE_PAGES
from pdkv.errors import ConfigError

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


def runs_of(free: BoolArray) -> ExtentList:
    """Maximal runs of True in a free-page mask, computed independently of the code under test."""
    edges = np.diff(np.concatenate(([0], free.astype(np.int8), [0])))
    starts = np.flatnonzero(edges == 1)
    return ExtentList(starts=starts, lengths=np.flatnonzero(edges == -1) - starts)


def fewest_extents(lengths: IntArray, count: int) -> int:
    """Smallest k such that the k largest extents hold ``count`` pages."""
    covered = np.cumsum(np.sort(lengths)[::-1])
    return int(np.searchsorted(covered, count)) + 1


def run_count(pages: IntArray) -> int:
    return 1 + int(np.count_nonzero(np.diff(pages) != 1)) if pages.size else 0


def assert_matches(lane: LaneExtents, free: BoolArray) -> None:
    expected = runs_of(free)
    assert lane.extents() == expected
    assert lane.free_pages == int(free.sum())
    assert lane.extent_count == expected.starts.size
    assert lane.largest_extent == (int(expected.lengths.max()) if expected.lengths.size else 0)


OPS = st.lists(
    st.tuples(st.booleans(), st.integers(1, 90), st.integers(0, 2**16), st.booleans()),
    max_size=60,
)


@settings(max_examples=400)
@given(pages=st.integers(1, 4 * GROUP_PAGES + 7), ops=OPS)
def test_take_and_release_follow_the_model(pages: int, ops: list[tuple[bool, int, int, bool]]) -> None:
    lane = LaneExtents(pages)
    free = np.ones(pages, dtype=bool)
    live: list[IntArray] = []
    for is_take, amount, pick, partial in ops:
        if is_take and free.any():
            count = min(amount, int(free.sum()))
            before = runs_of(free)
            got = lane.take(count)
            assert got.dtype == np.int64 and got.size == count
            assert np.all(np.diff(got) > 0), "pages come out ascending and distinct"
            assert free[got].all(), "only free pages are handed out"
            fits = np.flatnonzero(before.lengths >= count)
            if fits.size:
                first = int(before.starts[fits[0]])  # address-ordered first fit
                np.testing.assert_array_equal(got, np.arange(first, first + count))
            else:
                assert run_count(got) == fewest_extents(before.lengths, count)
            free[got] = False
            live.append(got)
        elif live:
            pages_of = live.pop(pick % len(live))
            if partial and pages_of.size > 1:
                keep = np.zeros(pages_of.size, dtype=bool)
                keep[pick % pages_of.size] = True
                live.append(pages_of[keep])
                pages_of = pages_of[~keep]
            assert lane.all_allocated(pages_of)
            lane.release(pages_of)
            free[pages_of] = True
        assert_matches(lane, free)
    for pages_of in live:
        lane.release(pages_of)
    assert lane.extents() == ExtentList(starts=[0], lengths=[pages]), "free everything: one extent again"


def test_freeing_between_two_extents_merges_three_into_one() -> None:
    lane = LaneExtents(100)
    a, b, c = lane.take(30), lane.take(30), lane.take(30)
    lane.release(a)
    lane.release(c)
    assert lane.extent_count == 2  # [0, 30) and [60, 100)
    lane.release(b)
    assert lane.extents() == ExtentList(starts=[0], lengths=[100])


def test_one_page_extents_at_both_ends_merge() -> None:
    lane = LaneExtents(3)
    pages = lane.take(3)
    lane.release(pages[[0]])
    lane.release(pages[[2]])
    assert lane.extents() == ExtentList(starts=[0, 2], lengths=[1, 1])
    lane.release(pages[[1]])
    assert lane.extents() == ExtentList(starts=[0], lengths=[3])


def test_falls_back_to_largest_extents_first() -> None:
    lane = LaneExtents(200)
    blocks = [lane.take(size) for size in (10, 5, 40, 5, 20, 5, 115)]
    for index in (0, 2, 4):  # free extents of 10, 40 and 20 pages, in that address order
        lane.release(blocks[index])
    got = lane.take(55)
    # 40 + 20 is the fewest; first fit over the list would have taken 10 + 40 + 5 of the 20.
    assert run_count(got) == 2
    np.testing.assert_array_equal(got, np.concatenate([np.arange(15, 55), np.arange(60, 75)]))
    assert lane.extents() == ExtentList(starts=[0, 75], lengths=[10, 5])


def test_all_allocated_sees_a_free_page_inside_a_run() -> None:
    lane = LaneExtents(50)
    pages = lane.take(50)
    lane.release(pages[10:11])
    assert not lane.all_allocated(pages[5:20])
    assert not lane.all_allocated(pages[[5, 10, 30]])
    assert lane.all_allocated(pages[11:20])


@pytest.mark.parametrize("pages", [0, -1, True, 1.5, MAX_LANE_PAGES + 1])
def test_rejects_bad_lane_sizes(pages: object) -> None:
    with pytest.raises(ConfigError):
        LaneExtents(pages)  # type: ignore[arg-type]  # deliberately wrong types


@pytest.mark.parametrize("count", [0, -3, 11])
def test_take_outside_free_room_is_refused(count: int) -> None:
    lane = LaneExtents(10)
    with pytest.raises(InvalidAllocationError, match="free pages"):
        lane.take(count)


def test_metadata_stays_under_half_a_byte_over_the_tags_for_a_large_lane() -> None:
    lane = LaneExtents(10_000_000)
    per_page = lane.metadata_bytes / lane.pages
    assert 4.25 <= per_page <= 4.5
