"""Errors of the page allocator, each carrying the numbers an operator needs to act on.

Owns: the ``AllocatorError`` branch of the pdkv error tree and the compact page-id summary used in
its messages (``pdkv.alloc.errors`` re-exports them). Must not import anything from pdkv but
``pdkv.errors``.

    PdkvError
      AllocatorError
        OutOfPagesError           an allocation cannot be satisfied, even after asking for eviction
        InvalidAllocationError    a malformed request (negative count, unknown lane)
        ReentrantAllocationError  allocate() called from inside the pool's own eviction callback
        InvalidFreeError          a free that would corrupt the pool (or ids that are not CPU
                                  integers); nothing was freed
          DoubleFreeError         ... a page that is already free, or listed twice
          ForeignPageError        ... a page id this pool never hands out
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from pdkv.errors import PdkvError


def summarise_pages(pages: npt.NDArray[np.int64], *, edge: int = 3) -> str:
    """``5 pages [3, 4, 9 .. 20, 21, 22]``: count plus first and last few, never the whole array."""
    count = int(pages.size)
    values = pages.tolist()
    if count <= 2 * edge:
        shown = ", ".join(str(v) for v in values)
    else:
        head = ", ".join(str(v) for v in values[:edge])
        tail = ", ".join(str(v) for v in values[-edge:])
        shown = f"{head} .. {tail}"
    return f"{count} page{'s' if count != 1 else ''} [{shown}]"


class AllocatorError(PdkvError):
    """Base of the errors raised by ``pdkv.alloc``."""


class OutOfPagesError(AllocatorError):
    """The pool cannot hand out the pages asked for, even after asking its evictor for room.

    ``lane_needed[i]`` pages were needed on owner lane i, which had ``lane_free[i]`` free.
    ``eviction_asked`` / ``eviction_obtained`` describe the eviction attempted for this very
    allocation (both 0 when no evictor was asked).
    """

    def __init__(
        self,
        *,
        tier: str,
        requested: int,
        free_pages: int,
        total_pages: int,
        lane_needed: tuple[int, ...],
        lane_free: tuple[int, ...],
        eviction_asked: int,
        eviction_obtained: int,
    ) -> None:
        short = [
            f"lane {lane} needs {need}, has {have}"
            for lane, (need, have) in enumerate(zip(lane_needed, lane_free, strict=True))
            if need > have
        ]
        super().__init__(
            f"{tier} pool: cannot allocate {requested} pages ({'; '.join(short)}); "
            f"{free_pages} of {total_pages} pages free; "
            f"eviction asked for {eviction_asked} pages, obtained {eviction_obtained}"
        )
        self.tier = tier
        self.requested = requested
        self.free_pages = free_pages
        self.total_pages = total_pages
        self.lane_needed = lane_needed
        self.lane_free = lane_free
        self.eviction_asked = eviction_asked
        self.eviction_obtained = eviction_obtained


class InvalidAllocationError(AllocatorError, ValueError):
    """The allocation request itself is malformed (negative page count, lane out of range)."""


class ReentrantAllocationError(AllocatorError, RuntimeError):
    """The eviction callback tried to allocate from the pool it is freeing room in."""


class InvalidFreeError(AllocatorError, ValueError):
    """A free was refused as a whole: nothing was freed. ``pages`` are the offending logical ids."""

    def __init__(self, message: str, *, tier: str, pages: npt.NDArray[np.int64]) -> None:
        super().__init__(f"{tier} pool: {message}: {summarise_pages(pages)}")
        self.tier = tier
        self.pages = pages


class DoubleFreeError(InvalidFreeError):
    """A page being freed is already free, or appears twice in the same call."""


class ForeignPageError(InvalidFreeError):
    """A page id is negative or outside the pool: this pool never handed it out."""
