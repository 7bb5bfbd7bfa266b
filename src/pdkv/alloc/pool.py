"""The page pool: logical page ids for CP shared KV (device, L1) and for host (L2) tiers.

Owns: ``PagePool`` (allocate / free of logical page ids over owner lanes), ``FreeRoomTargets``
(low watermark and target of planned eviction), ``PoolStatistics`` and the ``EvictionCallback``
protocol. Must not do I/O, start threads or read clocks, and must not know what is evicted: the
caller's callback decides which cached pages to drop and frees them back into the pool.

Lanes. Under CP shared KV each logical page lives on one CP rank (its owner lane) at a physical
page of that rank, as an ``OwnershipPolicy`` says (``pdkv.mapping.ownership``). Transfers coalesce
runs of consecutive physical pages, so the pool keeps free space per lane as extents of physical
pages and hands each lane's share of a request out of one extent whenever one is large enough.
Without a policy (or with ``cp_size == 1``) the pool has one lane and logical == physical.

Free room. A pool that only evicts when it is full evicts the exact deficit at the capacity edge,
on every allocation, in the scheduler's critical path. Instead, when an allocation would leave
fewer than ``low_watermark`` pages free, the evictor is asked once for enough pages to bring free
room back to ``target_free`` (hysteresis: the next allocations find room without asking). What the
evictor really freed is measured, not trusted; an allocation that still does not fit raises
``OutOfPagesError`` with the numbers. There is no retry loop.

Not thread-safe: one owner (the scheduler thread or the runtime's control thread) calls it.
"""

from __future__ import annotations

from typing import Protocol

import attrs
import numpy as np
import numpy.typing as npt

from pdkv.alloc.errors import (
    DoubleFreeError,
    ForeignPageError,
    InvalidAllocationError,
    InvalidFreeError,
    OutOfPagesError,
    ReentrantAllocationError,
)
from pdkv.alloc.extents import ExtentList, LaneExtents
from pdkv.errors import ConfigError
from pdkv.mapping.ownership import OwnershipPolicy

IntArray = npt.NDArray[np.int64]

_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.setflags(write=False)


class EvictionCallback(Protocol):
    """Asked to free about ``pages_wanted`` pages back into the pool (by calling ``pool.free``).

    It may free fewer (nothing evictable) or more (whole cached entries); the pool measures what
    it obtained. It must not allocate from the pool (``ReentrantAllocationError``). Its return
    value is ignored.
    """

    def __call__(self, pages_wanted: int, /) -> object: ...


def _non_negative(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{attribute.name} must be a non-negative int, got {value!r}")


@attrs.frozen(kw_only=True)
class FreeRoomTargets:
    """Planned eviction: below ``low_watermark`` free pages, evict up to ``target_free`` free pages.

    ``low_watermark == target_free == 0`` (the default) only asks the evictor when an allocation
    does not fit at all, and then for exactly the pages missing.
    """

    low_watermark: int = attrs.field(default=0, validator=_non_negative)
    target_free: int = attrs.field(default=0, validator=_non_negative)

    def __attrs_post_init__(self) -> None:
        if self.target_free < self.low_watermark:
            raise ConfigError(
                f"target_free ({self.target_free}) must be >= low_watermark ({self.low_watermark}): "
                "evicting to a target below the watermark would ask again on the next allocation"
            )


@attrs.frozen(kw_only=True)
class PoolStatistics:
    """A snapshot of one pool. Page counts are logical pages; extents are free physical extents."""

    tier: str
    lanes: int
    total_pages: int
    free_pages: int
    free_pages_per_lane: tuple[int, ...]
    extents: int  # free extents over all lanes (1 per lane when nothing is allocated)
    largest_extent: int  # largest free extent of any lane, in pages
    metadata_bytes_per_page: float
    allocations: int  # successful allocate / allocate_in_lane calls that handed out pages
    failed_allocations: int  # calls that raised OutOfPagesError
    frees: int  # successful free calls that returned pages
    eviction_calls: int
    eviction_pages_asked: int
    eviction_pages_obtained: int
    eviction_shortfalls: int  # eviction calls that obtained fewer pages than asked

    @property
    def used_pages(self) -> int:
        return self.total_pages - self.free_pages


class PagePool:
    """Hands out logical page ids whose physical pages are contiguous per owner lane when possible.

    ``pages_per_lane`` physical pages on each of ``policy.cp_size`` lanes (one lane without a
    policy). The logical ids handed out are ``policy.logical(lane, physical)``; for the two
    policies of ``pdkv.mapping`` they are exactly ``0 .. total_pages - 1`` when ``pages_per_lane``
    is a multiple of the block size. ``tier`` names the pool in statistics and errors
    (e.g. ``"device"`` for L1 KV, ``"host"`` for an L2 tier); the behaviour is the same.
    """

    def __init__(
        self,
        *,
        pages_per_lane: int,
        policy: OwnershipPolicy | None = None,
        tier: str = "device",
        free_room: FreeRoomTargets | None = None,
        evictor: EvictionCallback | None = None,
    ) -> None:
        if not isinstance(tier, str) or not tier:
            raise ConfigError(f"tier must be a non-empty name, got {tier!r}")
        self._policy = policy
        self._lane_count = 1 if policy is None else policy.cp_size
        self._lanes = [LaneExtents(pages_per_lane) for _ in range(self._lane_count)]
        self._pages_per_lane = pages_per_lane
        self._total = pages_per_lane * self._lane_count
        self._tier = tier
        self._targets = free_room if free_room is not None else FreeRoomTargets()
        if self._targets.target_free > self._total:
            raise ConfigError(
                f"{tier} pool: target_free ({self._targets.target_free}) exceeds the pool "
                f"({self._total} pages)"
            )
        self._evictor = evictor
        self._in_eviction = False
        self._allocations = 0
        self._failed_allocations = 0
        self._frees = 0
        self._eviction_calls = 0
        self._eviction_asked = 0
        self._eviction_obtained = 0
        self._eviction_shortfalls = 0

    # ------------------------------------------------------------------------------- properties

    @property
    def tier(self) -> str:
        return self._tier

    @property
    def lanes(self) -> int:
        return self._lane_count

    @property
    def pages_per_lane(self) -> int:
        return self._pages_per_lane

    @property
    def total_pages(self) -> int:
        return self._total

    @property
    def policy(self) -> OwnershipPolicy | None:
        return self._policy

    @property
    def free_room(self) -> FreeRoomTargets:
        return self._targets

    @property
    def free_pages(self) -> int:
        return sum(lane.free_pages for lane in self._lanes)

    def lane_free_pages(self, lane: int) -> int:
        return self._lanes[self._check_lane(lane)].free_pages

    def set_evictor(self, evictor: EvictionCallback | None) -> None:
        """Install (or remove) the eviction callback; the evictor usually needs the pool first."""
        self._evictor = evictor

    # ------------------------------------------------------------------------------- allocation

    def allocate(self, count: int, *, first_lane: int | None = None) -> IntArray:
        """``count`` logical ids laid out for CP shared KV, in request position order.

        Position i goes to lane ``(first_lane + policy.owner(i)) % cp_size``: with page-interleaved
        ownership consecutive positions rotate over the lanes, with block-cyclic ownership blocks
        do. Each lane's pages are ascending physical pages, from one free extent when one is large
        enough. ``first_lane=None`` starts at the lane with the most free pages (it receives the
        largest share when ``count`` is not a multiple of the lane count). With one lane this is
        plain allocation.
        """
        count = self._check_count(count)
        if count == 0:
            return _EMPTY.copy()
        if self._lane_count == 1:
            return self._allocate_single(count, 0)
        policy = self._policy
        assert policy is not None  # more than one lane only comes from a policy
        if first_lane is None:
            free = [lane.free_pages for lane in self._lanes]
            first_lane = free.index(max(free))
        else:
            first_lane = self._check_lane(first_lane)
        positions = np.arange(count, dtype=np.int64)
        lane_of_position = (policy.owner(positions) + first_lane) % self._lane_count
        needed = np.bincount(lane_of_position, minlength=self._lane_count).tolist()
        return self._allocate_spread(count, needed, lane_of_position)

    def allocate_in_lane(self, count: int, lane: int) -> IntArray:
        """``count`` logical ids all owned by ``lane``, with ascending (contiguous if possible) pages."""
        count = self._check_count(count)
        lane = self._check_lane(lane)
        if count == 0:
            return _EMPTY.copy()
        return self._allocate_single(count, lane)

    def ensure_free_room(self) -> int:
        """Ask the evictor now if free pages are under the watermark; returns pages obtained.

        ``allocate`` does this itself; calling it off the critical path (e.g. between scheduler
        steps) moves eviction out of the allocation that would otherwise trigger it.
        """
        self._guard_reentry()
        return self._make_room(0, [0] * self._lane_count)

    def _allocate_single(self, count: int, lane_index: int) -> IntArray:
        self._guard_reentry()
        lane = self._lanes[lane_index]
        if self._evictor is not None or count > lane.free_pages:
            needed = [0] * self._lane_count
            needed[lane_index] = count
            self._reserve(count, needed)
        self._allocations += 1
        physical = lane.take(count)
        return physical if self._policy is None else self._policy.logical(lane_index, physical)

    def _allocate_spread(self, count: int, needed: list[int], lane_of_position: IntArray) -> IntArray:
        self._guard_reentry()
        self._reserve(count, needed)
        self._allocations += 1
        # Positions of one lane take that lane's pages in ascending order: sort positions by lane
        # (stable, so each lane's positions stay in request order) and fill lane by lane.
        order = np.argsort(lane_of_position, kind="stable")
        physical = np.concatenate([self._lanes[lane].take(need) for lane, need in enumerate(needed) if need])
        logical = np.empty(count, dtype=np.int64)
        logical[order] = self._to_logical(lane_of_position[order], physical)
        return logical

    def _reserve(self, count: int, needed: list[int]) -> None:
        """Ask for eviction if the free-room targets say so; raise unless every lane has its share."""
        asked_before, obtained_before = self._eviction_asked, self._eviction_obtained
        self._make_room(count, needed)
        lane_free = [lane.free_pages for lane in self._lanes]
        if any(need > have for need, have in zip(needed, lane_free, strict=True)):
            self._failed_allocations += 1
            raise OutOfPagesError(
                tier=self._tier,
                requested=count,
                free_pages=sum(lane_free),
                total_pages=self._total,
                lane_needed=tuple(needed),
                lane_free=tuple(lane_free),
                eviction_asked=self._eviction_asked - asked_before,
                eviction_obtained=self._eviction_obtained - obtained_before,
            )

    def _make_room(self, count: int, needed: list[int]) -> int:
        """Ask the evictor once if this allocation would break the free-room targets."""
        evictor = self._evictor
        if evictor is None:
            return 0
        free_before = self.free_pages
        projected = free_before - count
        lane_shortfall = sum(
            max(0, need - lane.free_pages) for need, lane in zip(needed, self._lanes, strict=True)
        )
        if projected >= self._targets.low_watermark and lane_shortfall == 0:
            return 0
        wanted = max(self._targets.target_free - projected, lane_shortfall)
        if wanted <= 0:
            return 0
        self._in_eviction = True
        try:
            evictor(wanted)
        finally:
            self._in_eviction = False
        obtained = self.free_pages - free_before
        self._eviction_calls += 1
        self._eviction_asked += wanted
        self._eviction_obtained += obtained
        if obtained < wanted:
            self._eviction_shortfalls += 1
        return obtained

    # ------------------------------------------------------------------------------------- free

    def free(self, pages: npt.ArrayLike) -> None:
        """Return logical page ids to the pool, merging each lane's free extents.

        All or nothing: a foreign id (negative or outside the pool) raises ``ForeignPageError``,
        a page already free or listed twice raises ``DoubleFreeError``, ids that are not integers
        or not on the CPU raise ``InvalidFreeError``; in every case no page is freed. Accepts numpy
        arrays, CPU torch tensors and sequences of ints.
        """
        device = getattr(pages, "device", None)
        if device is not None and getattr(device, "type", "cpu") != "cpu":
            # Converting would copy to the host behind the caller's back (a hidden device sync).
            raise InvalidFreeError(
                f"page ids must live on the CPU, got a tensor on {device}", tier=self._tier, pages=_EMPTY
            )
        ids = np.asarray(pages)
        if ids.size == 0:
            return
        if ids.dtype.kind not in "iu":
            raise InvalidFreeError(
                f"page ids must be integers, got dtype {ids.dtype}", tier=self._tier, pages=_EMPTY
            )
        ids = ids.astype(np.int64, copy=False).reshape(-1)
        per_lane = self._lane_pages_to_free(ids)
        for lane, lane_pages in zip(self._lanes, per_lane, strict=True):
            lane.release(lane_pages)
        self._frees += 1

    def _lane_pages_to_free(self, ids: IntArray) -> list[IntArray]:
        """Each lane's physical pages among ``ids``, sorted; raises unless every id may be freed."""
        policy = self._policy
        if policy is None:
            owner = None
            physical = ids
        else:
            owner = policy.owner(ids)
            physical = policy.physical(ids)
        # Lane-major sort key; physical pages are in range before it is trusted.
        key = physical if owner is None else owner * self._pages_per_lane + physical
        ascending = key.size == 1 or bool((key[1:] > key[:-1]).all())
        if ascending and owner is None:
            in_range = int(key[0]) >= 0 and int(key[-1]) < self._pages_per_lane
        else:
            in_range = not bool(((ids < 0) | (physical < 0) | (physical >= self._pages_per_lane)).any())
        if not in_range:
            bad = (ids < 0) | (physical < 0) | (physical >= self._pages_per_lane)
            raise ForeignPageError(
                f"ids outside this pool of {self._total} pages", tier=self._tier, pages=ids[bad]
            )
        if ascending:
            order = np.arange(ids.size, dtype=np.int64)
            sorted_key = key
        else:
            order = np.argsort(key, kind="stable")
            sorted_key = key[order]
            repeated = np.flatnonzero(sorted_key[1:] == sorted_key[:-1]) + 1
            if repeated.size:
                raise DoubleFreeError(
                    "ids listed more than once", tier=self._tier, pages=ids[np.sort(order[repeated])]
                )
        if owner is None:
            bounds = [0, ids.size]
            sorted_physical = sorted_key
        else:
            lane_firsts = np.arange(self._lane_count + 1, dtype=np.int64) * self._pages_per_lane
            bounds = np.searchsorted(sorted_key, lane_firsts).tolist()
            sorted_physical = physical[order]
        per_lane: list[IntArray] = []
        for lane_index, lane in enumerate(self._lanes):
            lane_pages = sorted_physical[bounds[lane_index] : bounds[lane_index + 1]]
            if not lane.all_allocated(lane_pages):
                already_free = ~lane.allocated_mask(lane_pages)
                offending = order[bounds[lane_index] : bounds[lane_index + 1]][already_free]
                raise DoubleFreeError("ids already free", tier=self._tier, pages=ids[np.sort(offending)])
            per_lane.append(lane_pages)
        return per_lane

    # ------------------------------------------------------------------------------- statistics

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(
            tier=self._tier,
            lanes=self._lane_count,
            total_pages=self._total,
            free_pages=self.free_pages,
            free_pages_per_lane=tuple(lane.free_pages for lane in self._lanes),
            extents=sum(lane.extent_count for lane in self._lanes),
            largest_extent=max(lane.largest_extent for lane in self._lanes),
            metadata_bytes_per_page=sum(lane.metadata_bytes for lane in self._lanes) / self._total,
            allocations=self._allocations,
            failed_allocations=self._failed_allocations,
            frees=self._frees,
            eviction_calls=self._eviction_calls,
            eviction_pages_asked=self._eviction_asked,
            eviction_pages_obtained=self._eviction_obtained,
            eviction_shortfalls=self._eviction_shortfalls,
        )

    def free_extents(self, lane: int = 0) -> ExtentList:
        """``lane``'s free physical extents in address order; O(pages), for reports and tests."""
        return self._lanes[self._check_lane(lane)].extents()

    # ---------------------------------------------------------------------------------- helpers

    def _to_logical(self, lane: npt.NDArray[np.int64] | int, physical: IntArray) -> IntArray:
        if self._policy is None:
            return physical
        return self._policy.logical(lane, physical)

    def _check_count(self, count: int) -> int:
        if isinstance(count, bool) or not isinstance(count, int | np.integer) or count < 0:
            raise InvalidAllocationError(f"{self._tier} pool: page count must be an int >= 0, got {count!r}")
        return int(count)

    def _check_lane(self, lane: int) -> int:
        valid = isinstance(lane, int | np.integer) and not isinstance(lane, bool)
        if not valid or not 0 <= lane < self._lane_count:
            raise InvalidAllocationError(
                f"{self._tier} pool: lane must be in 0 .. {self._lane_count - 1}, got {lane!r}"
            )
        return int(lane)

    def _guard_reentry(self) -> None:
        if self._in_eviction:
            raise ReentrantAllocationError(
                f"{self._tier} pool: the eviction callback may free pages but not allocate them"
            )
