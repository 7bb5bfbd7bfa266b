"""The allocator's errors, defined in ``pdkv.errors.alloc`` (every pdkv error lives under ``pdkv.errors``)
and importable here as before."""

from pdkv.errors.alloc import (
    AllocatorError,
    DoubleFreeError,
    ForeignPageError,
    InvalidAllocationError,
    InvalidFreeError,
    OutOfPagesError,
    ReentrantAllocationError,
    summarise_pages,
)

__all__ = [
    "AllocatorError",
    "DoubleFreeError",
    "ForeignPageError",
    "InvalidAllocationError",
    "InvalidFreeError",
    "OutOfPagesError",
    "ReentrantAllocationError",
    "summarise_pages",
]
