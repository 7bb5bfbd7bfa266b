"""Free-room targets: eviction below the watermark, up to the target, with evictors that fall short."""

from __future__ import annotations

import enum

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdkv.alloc import FreeRoomTargets, OutOfPagesError, PagePool, ReentrantAllocationError
from pdkv.errors import ConfigError
from pdkv.mapping.ownership import PageInterleaved

IntArray = npt.NDArray[np.int64]


class Frees(enum.Enum):
    NOTHING = "nothing"
    ENOUGH = "enough"  # whole cached entries until at least the pages wanted
    HALF = "half"  # whole cached entries until at least half the pages wanted
    EVERYTHING = "everything"


class CacheEvictor:
    """A prefix cache stand-in: it holds allocations it may drop, and drops them as told."""

    def __init__(self, pool: PagePool, frees: Frees) -> None:
        self.pool = pool
        self.frees = frees
        self.cached: list[IntArray] = []
        self.asked: list[int] = []

    def cache(self, count: int, entries: int) -> None:
        self.cached.extend(self.pool.allocate(count) for _ in range(entries))

    def __call__(self, pages_wanted: int) -> None:
        self.asked.append(pages_wanted)
        goal = {
            Frees.NOTHING: 0,
            Frees.ENOUGH: pages_wanted,
            Frees.HALF: pages_wanted // 2,
            Frees.EVERYTHING: self.pool.total_pages,
        }[self.frees]
        freed = 0
        while self.cached and freed < goal:
            entry = self.cached.pop()
            self.pool.free(entry)
            freed += entry.size


def pool_with_cache(frees: Frees, *, low: int = 200, target: int = 400) -> tuple[PagePool, CacheEvictor]:
    """1000 pages, 500 of them in five cached entries of 100 pages."""
    pool = PagePool(
        pages_per_lane=1000, tier="host", free_room=FreeRoomTargets(low_watermark=low, target_free=target)
    )
    evictor = CacheEvictor(pool, frees)
    evictor.cache(100, 5)
    pool.set_evictor(evictor)
    return pool, evictor


def test_no_eviction_while_free_room_stays_above_the_watermark() -> None:
    pool, evictor = pool_with_cache(Frees.ENOUGH)
    pool.allocate(300)  # 200 left: exactly the watermark, not under it
    assert evictor.asked == []
    assert pool.statistics().eviction_calls == 0


def test_eviction_goes_up_to_the_target_then_hysteresis_holds() -> None:
    pool, evictor = pool_with_cache(Frees.ENOUGH)
    pool.allocate(250)  # 250 free
    pool.allocate(100)  # would leave 150 < 200: ask for 400 - 150 = 250; three entries (300) dropped
    assert evictor.asked == [250]
    assert pool.free_pages == 450
    pool.allocate(100)
    pool.allocate(100)  # 250 free, still above the watermark: nobody asked
    assert evictor.asked == [250]
    pool.allocate(100)  # would leave 150: ask 250 again; only two entries (200) are left
    assert evictor.asked == [250, 250]
    stats = pool.statistics()
    assert (stats.eviction_calls, stats.eviction_pages_asked, stats.eviction_pages_obtained) == (2, 500, 500)
    assert stats.eviction_shortfalls == 1
    assert stats.free_pages == 350


def test_evictor_that_frees_nothing_is_asked_once_per_allocation_then_out_of_pages() -> None:
    pool, evictor = pool_with_cache(Frees.NOTHING)
    pool.allocate(400)  # fits, though under the watermark: asked 400 - 100 = 300, got nothing
    assert evictor.asked == [300]
    with pytest.raises(OutOfPagesError) as caught:
        pool.allocate(150)  # 100 free: ask 400 - (100 - 150) = 450 once, then give up
    assert evictor.asked == [300, 450], "one request per allocation, no retry loop"
    error = caught.value
    assert (error.requested, error.free_pages, error.eviction_asked, error.eviction_obtained) == (
        150,
        100,
        450,
        0,
    )
    stats = pool.statistics()
    assert (stats.allocations, stats.failed_allocations) == (6, 1)  # five cache entries and one request
    assert (stats.eviction_pages_asked, stats.eviction_pages_obtained, stats.eviction_shortfalls) == (
        750,
        0,
        2,
    )


def test_evictor_that_frees_part_reports_the_shortfall_in_the_error() -> None:
    pool, evictor = pool_with_cache(Frees.HALF, low=0, target=0)
    with pytest.raises(OutOfPagesError) as caught:
        pool.allocate(800)  # 500 free: 300 missing; half of it is 150: two entries, 200 pages
    assert evictor.asked == [300]
    assert (caught.value.eviction_asked, caught.value.eviction_obtained) == (300, 200)
    assert caught.value.free_pages == 700
    assert pool.statistics().eviction_shortfalls == 1
    pool.allocate(700)  # the room obtained stays usable, and fits without asking again
    assert evictor.asked == [300]


def test_evictor_that_frees_everything_overshoots_without_a_shortfall() -> None:
    pool, evictor = pool_with_cache(Frees.EVERYTHING)
    pool.allocate(400)
    assert evictor.asked == [300]
    stats = pool.statistics()
    assert (stats.eviction_pages_asked, stats.eviction_pages_obtained, stats.eviction_shortfalls) == (
        300,
        500,
        0,
    )
    assert stats.free_pages == 600


def test_default_targets_evict_the_exact_deficit_at_the_capacity_edge() -> None:
    pool = PagePool(pages_per_lane=100)
    evictor = CacheEvictor(pool, Frees.ENOUGH)
    evictor.cache(10, 6)
    pool.set_evictor(evictor)
    pool.allocate(30)
    assert evictor.asked == []
    pool.allocate(20)  # 10 free: the deficit is 10
    assert evictor.asked == [10]


def test_a_short_lane_asks_for_eviction_even_above_the_watermark() -> None:
    pool = PagePool(pages_per_lane=50, policy=PageInterleaved(cp_size=2))
    evictor = CacheEvictor(pool, Frees.ENOUGH)
    evictor.cached.append(pool.allocate_in_lane(30, 1))
    pool.set_evictor(evictor)
    ids = pool.allocate_in_lane(30, 1)  # 70 free in the pool, 20 on lane 1: 10 missing there
    assert evictor.asked == [10]
    assert np.all(ids % 2 == 1)


def test_evictor_may_not_allocate_from_its_pool() -> None:
    pool = PagePool(pages_per_lane=100, free_room=FreeRoomTargets(low_watermark=50, target_free=60))

    def greedy(pages_wanted: int) -> None:
        pool.allocate(1)

    pool.set_evictor(greedy)
    with pytest.raises(ReentrantAllocationError):
        pool.allocate(60)
    assert pool.free_pages == 100
    pool.set_evictor(None)
    assert pool.allocate(60).size == 60, "the pool is usable after the refused re-entry"


def test_an_evictor_that_raises_leaves_the_pool_unchanged() -> None:
    pool = PagePool(pages_per_lane=100, free_room=FreeRoomTargets(low_watermark=50, target_free=60))
    calls: list[int] = []

    def broken(pages_wanted: int) -> None:
        calls.append(pages_wanted)
        raise RuntimeError("cache index corrupt")

    pool.set_evictor(broken)
    with pytest.raises(RuntimeError, match="corrupt"):
        pool.allocate(60)
    assert pool.free_pages == 100
    assert pool.allocate(10).size == 10  # above the watermark: the evictor is not involved
    assert calls == [20]


def test_ensure_free_room_asks_only_under_the_watermark() -> None:
    pool, evictor = pool_with_cache(Frees.ENOUGH)
    assert pool.ensure_free_room() == 0
    pool.allocate(350)  # 150 free, asked 250, three entries dropped: 450 free
    assert pool.ensure_free_room() == 0
    evictor.asked.clear()
    pool.set_evictor(None)
    pool.allocate(300)  # 150 free, no evictor to ask
    pool.set_evictor(evictor)
    assert pool.ensure_free_room() == 200  # asked 400 - 150 = 250; two entries left
    assert evictor.asked == [250]


@pytest.mark.parametrize(("low", "target"), [(10, 5), (-1, 5), (0, -1), (True, 3)])
def test_targets_are_validated(low: int, target: int) -> None:
    with pytest.raises(ConfigError):
        FreeRoomTargets(low_watermark=low, target_free=target)


def test_target_beyond_the_pool_is_refused() -> None:
    with pytest.raises(ConfigError, match="exceeds"):
        PagePool(pages_per_lane=10, free_room=FreeRoomTargets(low_watermark=5, target_free=11))


@settings(max_examples=300)
@given(
    low=st.integers(0, 300),
    extra=st.integers(0, 300),
    frees=st.sampled_from(Frees),
    cached_entries=st.integers(0, 8),
    sizes=st.lists(st.integers(0, 400), max_size=12),
)
def test_eviction_requests_follow_the_targets_for_any_evictor(
    low: int, extra: int, frees: Frees, cached_entries: int, sizes: list[int]
) -> None:
    target = low + extra
    pool = PagePool(pages_per_lane=1000, free_room=FreeRoomTargets(low_watermark=low, target_free=target))
    evictor = CacheEvictor(pool, frees)
    evictor.cache(50, cached_entries)
    pool.set_evictor(evictor)
    asked = obtained = failed = 0
    for size in sizes:
        free_before = pool.free_pages
        calls_before = len(evictor.asked)
        try:
            pool.allocate(size)
            succeeded = True
        except OutOfPagesError:
            succeeded = False
        new_calls = evictor.asked[calls_before:]
        projected = free_before - size
        if size and projected < low:
            assert new_calls == [target - projected]
        else:
            assert new_calls == []
        free_after_eviction = pool.free_pages + (size if succeeded else 0)
        assert succeeded == (size <= free_after_eviction)
        asked += sum(new_calls)
        obtained += free_after_eviction - free_before
        failed += not succeeded
    stats = pool.statistics()
    assert (stats.eviction_pages_asked, stats.eviction_pages_obtained) == (asked, obtained)
    assert stats.failed_allocations == failed
    assert stats.eviction_calls == len(evictor.asked)
