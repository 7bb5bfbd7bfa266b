"""Free space of one owner lane: maximal extents of free physical pages, O(log n) first-fit search.

Owns: ``LaneExtents``, the data structure behind every lane of a ``PagePool``. It speaks physical
page numbers of a single lane only; logical ids, ownership policies, eviction and statistics are
the pool's business. Must not loop in Python over more than one tree leaf's group of pages (bulk
per-page work is numpy slice operations) and must not scan the extent list: every search is a
descent of a tree whose height is log2 of the lane's page count.

Representation (4.25 to 4.5 bytes of metadata per page, independent of fragmentation):

* ``tag``: one int32 per page, boundary tags in the style of Knuth's allocator. ``0`` marks an
  allocated page; any non-zero value a free one. The first page of a free extent of ``L`` pages
  holds ``+L``, its last page ``-L`` (for ``L == 1`` the start tag ``+1`` wins), inner free pages hold
  ``-1``. So ``free`` finds its neighbours in O(1): the page before a freed run is, if free, the end
  of an extent and tells its length; the page after it is, if free, a start and tells its length.
* ``tree``: a max segment tree whose leaf ``g`` holds the largest start tag among pages
  ``[g * GROUP_PAGES, (g + 1) * GROUP_PAGES)``. Descending towards the leftmost leaf with a value
  >= n finds the lowest-addressed extent that can hold n pages (address-ordered first fit); descending
  along the maximum finds the largest extent. Grouping pages under one leaf keeps the tree at 1/4
  to 1/2 byte per page (leaves are a power of two); the scan inside a group is bounded by
  ``GROUP_PAGES`` (a constant), not by n.

Scalar reads and writes go through ``memoryview``s of the numpy arrays: they are several times
cheaper than numpy scalar indexing, and the descent is scalar work by nature.
"""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt

from pdkv.alloc.errors import InvalidAllocationError
from pdkv.errors import ConfigError
from pdkv.mapping._arrays import any_true

IntArray = npt.NDArray[np.int64]

GROUP_PAGES = 32
"""Pages summarised by one tree leaf: larger saves tree memory, smaller shortens the in-group scan."""

MAX_LANE_PAGES = 2**31 - 1
"""Tags are int32, so a lane holds at most this many pages (far beyond any real KV pool lane)."""

_INNER_FREE = -1  # tag of a free page that is neither the first nor the last of its extent


def _int64_1d(value: npt.ArrayLike) -> IntArray:
    array: IntArray = np.array(value, dtype=np.int64).reshape(-1)
    array.setflags(write=False)
    return array


@attrs.frozen(kw_only=True)
class ExtentList:
    """Free extents of one lane, struct of arrays: extent i spans ``lengths[i]`` pages from ``starts[i]``."""

    starts: IntArray = attrs.field(converter=_int64_1d, eq=attrs.cmp_using(eq=np.array_equal))
    lengths: IntArray = attrs.field(converter=_int64_1d, eq=attrs.cmp_using(eq=np.array_equal))

    def __attrs_post_init__(self) -> None:
        if self.starts.size != self.lengths.size:
            raise ValueError(f"{self.starts.size} starts but {self.lengths.size} lengths")


class LaneExtents:
    """The free pages of one lane as maximal extents; allocation prefers one contiguous extent.

    Not thread-safe: the owning ``PagePool`` serialises access.
    """

    def __init__(self, pages: int) -> None:
        if isinstance(pages, bool) or not isinstance(pages, int) or not 0 < pages <= MAX_LANE_PAGES:
            raise ConfigError(f"a lane holds 1 .. {MAX_LANE_PAGES} pages, got {pages!r}")
        self._pages = pages
        self._tag_array = np.full(pages, _INNER_FREE, dtype=np.int32)
        groups = -(-pages // GROUP_PAGES)
        self._leaves = 1 << (groups - 1).bit_length()
        self._tree_array = np.zeros(2 * self._leaves, dtype=np.int32)
        self._tag = self._tag_array.data  # a memoryview: cheap scalar access to the same memory
        self._tree = self._tree_array.data
        self._set_extent(0, pages)
        self._raise_leaf(0, pages)
        self._free_pages = pages
        self._extent_count = 1

    # ----------------------------------------------------------------------------------- queries

    @property
    def pages(self) -> int:
        return self._pages

    @property
    def free_pages(self) -> int:
        return self._free_pages

    @property
    def extent_count(self) -> int:
        return self._extent_count

    @property
    def largest_extent(self) -> int:
        """Length of the largest free extent (0 when the lane is full); O(1)."""
        return max(self._tree[1], 0)

    @property
    def metadata_bytes(self) -> int:
        return int(self._tag_array.nbytes + self._tree_array.nbytes)

    def extents(self) -> ExtentList:
        """Every free extent in address order; O(pages), for tests, reports and debugging."""
        starts = np.flatnonzero(self._tag_array > 0).astype(np.int64)
        return ExtentList(starts=starts, lengths=self._tag_array[starts].astype(np.int64))

    def allocated_mask(self, physical: IntArray) -> npt.NDArray[np.bool_]:
        """For each in-range physical page, whether it is currently handed out."""
        result: npt.NDArray[np.bool_] = self._tag_array[physical] == 0
        return result

    def all_allocated(self, physical: IntArray) -> bool:
        """Whether every page of ``physical`` (sorted, unique, in range) is currently handed out."""
        if physical.size == 0:
            return True
        first, last = int(physical[0]), int(physical[-1])
        if last - first + 1 == physical.size:  # one run: a slice, no gather
            return not any_true(self._tag_array[first : last + 1])
        return not any_true(self._tag_array[physical])

    # ------------------------------------------------------------------------------- allocation

    def take(self, count: int) -> IntArray:
        """Hand out ``count`` free pages (1 <= count <= free_pages), ascending physical order.

        One extent when any extent holds ``count`` pages (the lowest-addressed such extent);
        otherwise the fewest extents: whole largest extents first, then the remainder by first fit
        (which leaves the large extents that are not needed intact).
        """
        if not 0 < count <= self._free_pages:
            raise InvalidAllocationError(f"take({count}) with {self._free_pages} free pages")
        start = self._first_fit(count)
        if start >= 0:
            self._carve(start, count)
            return np.arange(start, start + count, dtype=np.int64)
        starts: list[int] = []
        lengths: list[int] = []
        remaining = count
        while remaining > self._tree[1]:
            start = self._largest()
            length = self._tag[start]
            self._carve(start, length)
            starts.append(start)
            lengths.append(length)
            remaining -= length
        start = self._first_fit(remaining)
        self._carve(start, remaining)
        starts.append(start)
        lengths.append(remaining)
        return _pages_of_runs(starts, lengths)

    def _first_fit(self, count: int) -> int:
        """Start of the lowest-addressed free extent of >= count pages, or -1."""
        tree = self._tree
        if tree[1] < count:
            return -1
        node = 1
        leaves = self._leaves
        while node < leaves:
            node <<= 1
            if tree[node] < count:
                node += 1
        first = (node - leaves) * GROUP_PAGES
        tag = self._tag
        for offset, value in enumerate(tag[first : first + GROUP_PAGES].tolist()):
            if value >= count:
                return first + offset
        raise AssertionError(f"tree leaf {node} promises {tree[node]} free pages its group lacks")

    def _largest(self) -> int:
        """Start of the lowest-addressed largest free extent; the lane is not full."""
        tree = self._tree
        best = tree[1]
        if best <= 0:
            raise AssertionError("_largest() called on a full lane")
        node = 1
        leaves = self._leaves
        while node < leaves:
            node <<= 1
            if tree[node] != best:
                node += 1
        first = (node - leaves) * GROUP_PAGES
        return first + self._tag[first : first + GROUP_PAGES].tolist().index(best)

    def _carve(self, start: int, count: int) -> None:
        """Allocate the first ``count`` pages of the free extent starting at ``start``."""
        length = self._tag[start]
        self._tag_array[start : start + count] = 0
        rest = length - count
        if rest:
            self._set_extent(start + count, rest)
        else:
            self._extent_count -= 1
        self._free_pages -= count
        self._refresh_group(start // GROUP_PAGES)
        if rest and (start + count) // GROUP_PAGES != start // GROUP_PAGES:
            self._raise_leaf(start + count, rest)

    # ------------------------------------------------------------------------------------ free

    def release(self, physical: IntArray) -> None:
        """Return pages to the free extents, merging with free neighbours.

        ``physical`` must be sorted, unique, in range and currently allocated (the pool validates
        all lanes before releasing any, so a refused free changes nothing).
        """
        if physical.size == 0:
            return
        first, last = int(physical[0]), int(physical[-1])
        if last - first + 1 == physical.size:  # sorted and unique, so this is one run
            self._release_run(first, last + 1)
            return
        breaks = np.flatnonzero(physical[1:] != physical[:-1] + 1) + 1
        run_starts = physical[0:1].tolist() + physical[breaks].tolist()
        run_ends = [*(physical[breaks - 1] + 1).tolist(), last + 1]
        for run_first, run_end in zip(run_starts, run_ends, strict=True):
            self._release_run(run_first, run_end)

    def _release_run(self, first: int, end: int) -> None:
        tag = self._tag
        left_free = first > 0 and tag[first - 1] != 0
        right_free = end < self._pages and tag[end] != 0
        self._tag_array[first:end] = _INNER_FREE
        start, stop = first, end
        if left_free:
            left_tail = tag[first - 1]
            start = first - (-left_tail if left_tail < 0 else 1)
            tag[first - 1] = _INNER_FREE
            self._extent_count -= 1
        if right_free:
            stop = end + tag[end]
            tag[end] = _INNER_FREE
            self._extent_count -= 1
        self._set_extent(start, stop - start)
        self._extent_count += 1
        self._free_pages += end - first
        self._raise_leaf(start, stop - start)
        if right_free:
            self._refresh_group(end // GROUP_PAGES)

    # ----------------------------------------------------------------------------- tree upkeep

    def _set_extent(self, start: int, length: int) -> None:
        # End tag first: for a one-page extent the start tag must be the one that survives.
        self._tag[start + length - 1] = -length
        self._tag[start] = length

    def _raise_leaf(self, page: int, value: int) -> None:
        """A start tag at ``page`` grew to ``value``: lift the leaf and its ancestors as needed."""
        tree = self._tree
        node = self._leaves + page // GROUP_PAGES
        while node and tree[node] < value:
            tree[node] = value
            node >>= 1

    def _refresh_group(self, group: int) -> None:
        """Recompute a leaf from its pages (a start tag shrank or vanished) and repair ancestors."""
        tree = self._tree
        first = group * GROUP_PAGES
        value = max(self._tag[first : first + GROUP_PAGES].tolist())
        node = self._leaves + group
        if tree[node] == value:
            return
        tree[node] = value
        node >>= 1
        while node:
            left = tree[2 * node]
            right = tree[2 * node + 1]
            value = left if left > right else right
            if tree[node] == value:
                return
            tree[node] = value
            node >>= 1


def _pages_of_runs(starts: list[int], lengths: list[int]) -> IntArray:
    """Pages of several runs, runs in ascending address order (no Python loop over pages)."""
    order = sorted(range(len(starts)), key=starts.__getitem__)
    run_start = np.array([starts[i] for i in order], dtype=np.int64)
    run_length = np.array([lengths[i] for i in order], dtype=np.int64)
    offsets = np.cumsum(run_length) - run_length
    total = int(run_length.sum())
    within = np.arange(total, dtype=np.int64) - np.repeat(offsets, run_length)
    pages: IntArray = np.repeat(run_start, run_length) + within
    return pages
