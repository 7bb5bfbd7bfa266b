"""Page allocator: owner lanes, contiguous-preferred allocation, free-room targets (DESIGN section 9).

Owns: ``PagePool`` and its records and errors. A pool hands out logical page ids (numpy int64) for
a device (L1) KV pool or a host (L2) tier; under a CP ownership policy each owner lane's physical
pages come out contiguous whenever free space allows, found in O(log n) over free extents.
Must not import from layers above ``pdkv.mapping`` / ``pdkv.errors``, do I/O or read clocks.
"""

from pdkv.alloc.errors import (
    AllocatorError,
    DoubleFreeError,
    ForeignPageError,
    InvalidAllocationError,
    InvalidFreeError,
    OutOfPagesError,
    ReentrantAllocationError,
)
from pdkv.alloc.extents import ExtentList, LaneExtents
from pdkv.alloc.pool import EvictionCallback, FreeRoomTargets, PagePool, PoolStatistics

__all__ = [
    "AllocatorError",
    "DoubleFreeError",
    "EvictionCallback",
    "ExtentList",
    "ForeignPageError",
    "FreeRoomTargets",
    "InvalidAllocationError",
    "InvalidFreeError",
    "LaneExtents",
    "OutOfPagesError",
    "PagePool",
    "PoolStatistics",
    "ReentrantAllocationError",
]
