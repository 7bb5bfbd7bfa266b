"""Allocation prefers contiguous runs: the pool against a plain first-fit free list, runs per allocation.

The reference below is the allocator the pool replaces: an address-ordered list of free extents,
first fit, and when no extent holds a request, extents taken front to back until it is covered.
"""

from __future__ import annotations

import bisect

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdkv.alloc import PagePool

IntArray = npt.NDArray[np.int64]


class FirstFitList:
    """Address-ordered free list with first fit; frees merge with adjacent extents."""

    def __init__(self, pages: int) -> None:
        self.starts = [0]
        self.lengths = [pages]

    def allocate(self, count: int) -> IntArray:
        for index, length in enumerate(self.lengths):
            if length >= count:
                return self._cut(index, count)
        pieces = []
        remaining = count
        while remaining:
            taken = min(self.lengths[0], remaining)
            pieces.append(self._cut(0, taken))
            remaining -= taken
        return np.sort(np.concatenate(pieces))

    def _cut(self, index: int, count: int) -> IntArray:
        first = self.starts[index]
        if self.lengths[index] == count:
            del self.starts[index], self.lengths[index]
        else:
            self.starts[index] += count
            self.lengths[index] -= count
        return np.arange(first, first + count, dtype=np.int64)

    def free(self, pages: IntArray) -> None:
        for page in np.sort(pages).tolist():
            index = bisect.bisect_left(self.starts, page)
            self.starts.insert(index, page)
            self.lengths.insert(index, 1)
            # Merge with the right neighbour, then the left one.
            if index + 1 < len(self.starts) and page + 1 == self.starts[index + 1]:
                self.lengths[index] += self.lengths.pop(index + 1)
                self.starts.pop(index + 1)
            if index > 0 and self.starts[index - 1] + self.lengths[index - 1] == page:
                self.lengths[index - 1] += self.lengths.pop(index)
                self.starts.pop(index)


def run_count(pages: IntArray) -> int:
    return 1 + int(np.count_nonzero(np.diff(np.sort(pages)) != 1))


def first_fit_plan_runs(starts: IntArray, lengths: IntArray, count: int) -> int:
    """Runs a first-fit list would use for ``count`` pages on these free extents."""
    if np.any(lengths >= count):
        return 1
    return int(np.searchsorted(np.cumsum(lengths), count)) + 1


def drive(allocator: PagePool | FirstFitList, pages: int, seed: int, steps: int, fill: float) -> list[int]:
    """Random alloc/free traffic held near ``fill`` occupancy; returns runs of each allocation."""
    rng = np.random.default_rng(seed)
    sizes = np.floor(np.exp(rng.uniform(0, np.log(65), steps))).astype(int).tolist()
    victims = rng.integers(0, 2**31, 4 * steps).tolist()
    live: list[IntArray] = []
    used = 0
    runs: list[int] = []
    for size in sizes:
        while used + size > fill * pages:
            index = victims.pop() % len(live)
            used -= live[index].size
            allocator.free(live.pop(index))
        got = allocator.allocate(size)
        runs.append(run_count(got))
        used += size
        live.append(got)
    return runs


@pytest.mark.parametrize("seed", range(4))
def test_pool_needs_no_more_runs_than_first_fit_on_the_same_workload(seed: int) -> None:
    pool_runs = drive(PagePool(pages_per_lane=4096), 4096, seed, 3000, 0.92)
    list_runs = drive(FirstFitList(4096), 4096, seed, 3000, 0.92)
    # The workload must actually fragment, or the comparison says nothing.
    assert max(list_runs) > 1
    assert np.mean(pool_runs) <= np.mean(list_runs)


@settings(max_examples=200)
@given(
    pages=st.integers(16, 600),
    steps=st.lists(st.tuples(st.integers(1, 70), st.integers(0, 2**16)), min_size=1, max_size=60),
)
def test_every_allocation_uses_at_most_the_runs_first_fit_would_on_the_same_free_space(
    pages: int, steps: list[tuple[int, int]]
) -> None:
    pool = PagePool(pages_per_lane=pages)
    free = np.ones(pages, dtype=bool)  # the model of free space, kept apart from the pool
    live: list[IntArray] = []
    for size, pick in steps:
        if size > int(free.sum()):
            if live:
                freed = live.pop(pick % len(live))
                pool.free(freed)
                free[freed] = True
            continue
        edges = np.diff(np.concatenate(([0], free.astype(np.int8), [0])))
        starts = np.flatnonzero(edges == 1)
        planned = first_fit_plan_runs(starts, np.flatnonzero(edges == -1) - starts, size)
        got = pool.allocate(size)
        assert free[got].all()
        assert run_count(got) <= planned
        free[got] = False
        live.append(got)
