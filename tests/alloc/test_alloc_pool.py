"""PagePool: logical-id layout over owner lanes, no page handed out twice, exact free, typed errors."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pdkv.alloc import (
    DoubleFreeError,
    ExtentList,
    ForeignPageError,
    InvalidAllocationError,
    InvalidFreeError,
    OutOfPagesError,
    PagePool,
)
from pdkv.errors import ConfigError
from pdkv.mapping.ownership import BlockCyclic, OwnershipPolicy, PageInterleaved

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


def runs_of(free: BoolArray) -> ExtentList:
    edges = np.diff(np.concatenate(([0], free.astype(np.int8), [0])))
    starts = np.flatnonzero(edges == 1)
    return ExtentList(starts=starts, lengths=np.flatnonzero(edges == -1) - starts)


def fewest_extents(lengths: IntArray, count: int) -> int:
    if count == 0:
        return 0
    covered = np.cumsum(np.sort(lengths)[::-1])
    return int(np.searchsorted(covered, count)) + 1


def run_count(pages: IntArray) -> int:
    return 1 + int(np.count_nonzero(np.diff(pages) != 1)) if pages.size else 0


POLICIES: st.SearchStrategy[OwnershipPolicy | None] = st.one_of(
    st.none(),
    st.builds(PageInterleaved, cp_size=st.integers(1, 4)),
    st.builds(BlockCyclic, cp_size=st.integers(1, 3), block_pages=st.integers(1, 4)),
)


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / free traffic against a model of which logical ids are handed out."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = PagePool(pages_per_lane=1)
        self.policy: OwnershipPolicy | None = None
        self.lanes = 1
        self.per_lane = 1
        self.free = np.ones((1, 1), dtype=bool)  # [lane, physical] -> free in the model
        self.live: list[IntArray] = []

    @initialize(policy=POLICIES, blocks=st.integers(1, 12))
    def create(self, policy: OwnershipPolicy | None, blocks: int) -> None:
        block = policy.block_pages if isinstance(policy, BlockCyclic) else 1
        self.per_lane = blocks * block * 3
        self.policy = policy
        self.lanes = 1 if policy is None else policy.cp_size
        self.pool = PagePool(pages_per_lane=self.per_lane, policy=policy, tier="device")
        self.free = np.ones((self.lanes, self.per_lane), dtype=bool)

    # ------------------------------------------------------------------------------ helpers

    def where(self, ids: IntArray) -> tuple[IntArray, IntArray]:
        if self.policy is None:
            return np.zeros(ids.size, dtype=np.int64), ids
        return self.policy.owner(ids), self.policy.physical(ids)

    def check_lane_shares(self, ids: IntArray, lane_of_position: IntArray, before: BoolArray) -> None:
        """Each lane's share: ascending physical pages from the fewest extents, first fit if one fits."""
        owner, physical = self.where(ids)
        np.testing.assert_array_equal(owner, lane_of_position)
        assert before[owner, physical].all(), "a page was handed out twice"
        for lane in range(self.lanes):
            share = physical[owner == lane]
            assert np.all(np.diff(share) > 0)
            extents = runs_of(before[lane])
            fits = np.flatnonzero(extents.lengths >= share.size)
            if share.size and fits.size:
                first = int(extents.starts[fits[0]])
                np.testing.assert_array_equal(share, np.arange(first, first + share.size))
            else:
                assert run_count(share) == fewest_extents(extents.lengths, share.size)

    def snapshot(self) -> list[ExtentList]:
        return [self.pool.free_extents(lane) for lane in range(self.lanes)]

    # -------------------------------------------------------------------------------- rules

    @rule(count=st.integers(0, 50), first_lane=st.none() | st.integers(0, 3))
    def allocate(self, count: int, first_lane: int | None) -> None:
        lane_free = self.free.sum(axis=1)
        start = int(np.argmax(lane_free)) if first_lane is None else first_lane % self.lanes
        positions = np.arange(count, dtype=np.int64)
        if self.policy is None:
            lane_of_position = np.zeros(count, dtype=np.int64)
        else:
            lane_of_position = (self.policy.owner(positions) + start) % self.lanes
        needed = np.bincount(lane_of_position, minlength=self.lanes)
        request = None if first_lane is None else first_lane % self.lanes
        if np.any(needed > lane_free):
            with pytest.raises(OutOfPagesError) as caught:
                self.pool.allocate(count, first_lane=request)
            assert caught.value.lane_needed == tuple(needed.tolist())
            assert caught.value.lane_free == tuple(lane_free.tolist())
            return
        before = self.free.copy()
        ids = self.pool.allocate(count, first_lane=request)
        assert ids.dtype == np.int64 and ids.shape == (count,)
        self.check_lane_shares(ids, lane_of_position, before)
        self.take(ids)

    @rule(count=st.integers(0, 40), lane=st.integers(0, 3))
    def allocate_in_lane(self, count: int, lane: int) -> None:
        lane %= self.lanes
        if count > int(self.free[lane].sum()):
            with pytest.raises(OutOfPagesError):
                self.pool.allocate_in_lane(count, lane)
            return
        before = self.free.copy()
        ids = self.pool.allocate_in_lane(count, lane)
        self.check_lane_shares(ids, np.full(count, lane, dtype=np.int64), before)
        self.take(ids)

    def take(self, ids: IntArray) -> None:
        owner, physical = self.where(ids)
        self.free[owner, physical] = False
        if ids.size:
            self.live.append(ids)

    @rule(pick=st.integers(0, 2**16), shuffle=st.booleans(), as_tensor=st.booleans())
    def free_allocation(self, pick: int, shuffle: bool, as_tensor: bool) -> None:
        if not self.live:
            return
        ids = self.live.pop(pick % len(self.live))
        given = np.random.default_rng(pick).permutation(ids) if shuffle else ids
        self.pool.free(torch.from_numpy(given) if as_tensor else given)
        owner, physical = self.where(ids)
        self.free[owner, physical] = True

    @rule(pick=st.integers(0, 2**16), keep_every=st.integers(2, 4))
    def free_part_of_allocation(self, pick: int, keep_every: int) -> None:
        if not self.live:
            return
        ids = self.live.pop(pick % len(self.live))
        kept = ids[::keep_every]
        gone = np.setdiff1d(ids, kept)
        self.pool.free(gone)
        owner, physical = self.where(gone)
        self.free[owner, physical] = True
        self.live.append(kept)

    @rule(pick=st.integers(0, 2**16))
    def double_free_changes_nothing(self, pick: int) -> None:
        before = self.snapshot()
        if self.live:
            ids = self.live[pick % len(self.live)]
            with pytest.raises(DoubleFreeError, match="more than once"):
                self.pool.free(np.concatenate([ids, ids[-1:]]))
        lane = pick % self.lanes
        free_physical = np.flatnonzero(self.free[lane])
        if free_physical.size:
            physical = free_physical[pick % free_physical.size : pick % free_physical.size + 1]
            free_id = physical if self.policy is None else self.policy.logical(lane, physical)
            mixed = np.concatenate([self.live[0], free_id]) if self.live else free_id
            with pytest.raises(DoubleFreeError, match="already free") as caught:
                self.pool.free(mixed)
            np.testing.assert_array_equal(caught.value.pages, free_id)
        assert self.snapshot() == before

    @rule(offset=st.integers(0, 5), negative=st.booleans())
    def foreign_free_changes_nothing(self, offset: int, negative: bool) -> None:
        before = self.snapshot()
        foreign = -1 - offset if negative else self.pool.total_pages + offset
        ids = np.array([foreign], dtype=np.int64)
        if self.live:
            ids = np.concatenate([self.live[-1], ids])
        with pytest.raises(ForeignPageError) as caught:
            self.pool.free(ids)
        np.testing.assert_array_equal(caught.value.pages, [foreign])
        assert self.snapshot() == before

    @rule(count=st.integers(1, 30))
    def allocate_then_free_restores_exactly(self, count: int) -> None:
        if count > int(self.free.sum(axis=1).min()) * self.lanes:
            return
        before = self.snapshot()
        stats = self.pool.statistics()
        try:
            ids = self.pool.allocate(count)
        except OutOfPagesError:
            return
        self.pool.free(ids)
        assert self.snapshot() == before
        assert self.pool.statistics().free_pages == stats.free_pages

    # --------------------------------------------------------------------------- invariants

    @invariant()
    def statistics_match_the_model(self) -> None:
        stats = self.pool.statistics()
        lane_runs = [runs_of(self.free[lane]) for lane in range(self.lanes)]
        assert stats.total_pages == self.lanes * self.per_lane
        assert stats.free_pages == int(self.free.sum())
        assert stats.free_pages_per_lane == tuple(self.free.sum(axis=1).tolist())
        assert stats.extents == sum(runs.starts.size for runs in lane_runs)
        assert stats.largest_extent == max(
            (int(r.lengths.max()) for r in lane_runs if r.lengths.size), default=0
        )
        live_ids = np.concatenate(self.live) if self.live else np.zeros(0, dtype=np.int64)
        assert np.unique(live_ids).size == live_ids.size == stats.used_pages

    @invariant()
    def snapshot_matches_the_model(self) -> None:
        assert self.snapshot() == [runs_of(self.free[lane]) for lane in range(self.lanes)]


PoolMachine.TestCase.settings = settings(max_examples=400, stateful_step_count=50)
TestPoolMachine = PoolMachine.TestCase


# ------------------------------------------------------------------------------ examples


def test_page_interleaved_positions_rotate_over_lanes() -> None:
    pool = PagePool(pages_per_lane=100, policy=PageInterleaved(cp_size=4))
    ids = pool.allocate(10, first_lane=1)
    # Lanes 1,2,3,0,1,2,3,0,1,2; each lane's physical pages 0,1,2 -> logical physical * 4 + lane.
    np.testing.assert_array_equal(ids, [1, 2, 3, 0, 5, 6, 7, 4, 9, 10])
    # Lanes 0 and 3 have used physical pages 0-1, lanes 1 and 2 pages 0-2.
    np.testing.assert_array_equal(pool.allocate(4, first_lane=0), [8, 13, 14, 11])


def test_block_cyclic_blocks_rotate_over_lanes() -> None:
    pool = PagePool(pages_per_lane=64, policy=BlockCyclic(cp_size=2, block_pages=4))
    ids = pool.allocate(10, first_lane=1)
    # Positions 0-3 on lane 1 (logical 4-7), 4-7 on lane 0 (0-3), 8-9 on lane 1 physical 4-5 (12, 13).
    np.testing.assert_array_equal(ids, [4, 5, 6, 7, 0, 1, 2, 3, 12, 13])


def test_default_first_lane_is_the_one_with_most_free_pages() -> None:
    pool = PagePool(pages_per_lane=10, policy=PageInterleaved(cp_size=3))
    pool.allocate_in_lane(4, 0)
    pool.allocate_in_lane(2, 2)
    ids = pool.allocate(4)  # lane 1 has 10 free: it starts, and takes two pages
    np.testing.assert_array_equal(ids % 3, [1, 2, 0, 1])


def test_single_lane_pool_hands_out_consecutive_ids_and_reuses_holes_first() -> None:
    pool = PagePool(pages_per_lane=1000, tier="host")
    first, second, third = pool.allocate(100), pool.allocate(50), pool.allocate(100)
    np.testing.assert_array_equal(second, np.arange(100, 150))
    pool.free(first)
    np.testing.assert_array_equal(pool.allocate(60), np.arange(0, 60))  # lowest hole that fits
    np.testing.assert_array_equal(pool.allocate(60), np.arange(250, 310))  # [60, 100) is too small
    assert third.size == 100


def test_statistics_count_calls_and_report_metadata() -> None:
    pool = PagePool(pages_per_lane=1_000_000, policy=PageInterleaved(cp_size=2), tier="host")
    a = pool.allocate(10)
    pool.allocate(6)
    pool.free(a)
    with pytest.raises(OutOfPagesError):
        pool.allocate_in_lane(1_000_001, 0)
    stats = pool.statistics()
    assert (stats.tier, stats.lanes, stats.total_pages) == ("host", 2, 2_000_000)
    assert (stats.allocations, stats.failed_allocations, stats.frees) == (2, 1, 1)
    assert stats.free_pages == 2_000_000 - 6
    assert stats.extents == 4  # per lane: the hole of 5 pages left by `a` and the rest
    assert stats.largest_extent == 1_000_000 - 8
    assert 4.25 <= stats.metadata_bytes_per_page <= 4.5


def test_out_of_pages_error_carries_the_numbers() -> None:
    pool = PagePool(pages_per_lane=8, policy=PageInterleaved(cp_size=2), tier="host")
    pool.allocate_in_lane(7, 1)
    with pytest.raises(OutOfPagesError) as caught:
        pool.allocate(4, first_lane=0)
    error = caught.value
    assert (error.tier, error.requested, error.free_pages, error.total_pages) == ("host", 4, 9, 16)
    assert (error.lane_needed, error.lane_free) == ((2, 2), (8, 1))
    assert (error.eviction_asked, error.eviction_obtained) == (0, 0)
    assert "lane 1 needs 2, has 1" in str(error)
    assert pool.statistics().free_pages == 9, "a failed allocation takes nothing"


def test_zero_pages_is_an_empty_allocation() -> None:
    pool = PagePool(pages_per_lane=4)
    assert pool.allocate(0).shape == (0,)
    assert pool.allocate_in_lane(0, 0).shape == (0,)
    pool.free(np.zeros(0, dtype=np.int64))
    assert pool.statistics().allocations == 0


@pytest.mark.parametrize("count", [-1, True, 2.0])
def test_malformed_counts_are_refused(count: object) -> None:
    with pytest.raises(InvalidAllocationError):
        PagePool(pages_per_lane=4).allocate(count)  # type: ignore[arg-type]  # deliberately wrong


@pytest.mark.parametrize("lane", [-1, 2, False])
def test_lane_out_of_range_is_refused(lane: int) -> None:
    with pytest.raises(InvalidAllocationError):
        PagePool(pages_per_lane=4, policy=PageInterleaved(cp_size=2)).allocate_in_lane(1, lane)


def test_float_ids_are_refused() -> None:
    pool = PagePool(pages_per_lane=4)
    pool.allocate(2)
    with pytest.raises(InvalidFreeError, match="integers"):
        pool.free(np.array([0.0, 1.0]))
    assert pool.statistics().free_pages == 2


def test_ids_off_the_cpu_are_refused_without_a_copy() -> None:
    pool = PagePool(pages_per_lane=4)
    pool.allocate(2)
    with pytest.raises(InvalidFreeError, match="on the CPU"):
        pool.free(torch.empty(2, dtype=torch.int64, device="meta"))
    assert pool.statistics().free_pages == 2


def test_empty_tier_name_is_refused() -> None:
    with pytest.raises(ConfigError):
        PagePool(pages_per_lane=4, tier="")
