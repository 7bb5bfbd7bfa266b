"""CP shared-KV ownership: which CP rank stores a logical page, and at which physical page.

Owns: the ``OwnershipPolicy`` protocol and its two policies. Pure and vectorised: every method maps a
whole int64 array at once. Must not loop over pages in Python, read clocks or do I/O.

Under CP shared KV each logical page id lives on exactly one CP rank (its owner), at a physical page
index on that rank. ``logical(owner, physical)`` inverts the pair, which the allocator uses to hand
out logical ids whose physical pages are contiguous on one owner lane.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import attrs
import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]


@runtime_checkable
class OwnershipPolicy(Protocol):
    """Maps logical page ids to (owner CP rank, physical page on the owner), and back."""

    @property
    def cp_size(self) -> int: ...

    def owner(self, logical: IntArray) -> IntArray: ...

    def physical(self, logical: IntArray) -> IntArray: ...

    def logical(self, owner: IntArray | int, physical: IntArray) -> IntArray: ...


def _positive(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{attribute.name} must be a positive int, got {value!r}")


@attrs.frozen(kw_only=True)
class PageInterleaved:
    """Default policy: owner = id % cp_size, physical = id // cp_size."""

    cp_size: int = attrs.field(validator=_positive)

    def owner(self, logical: IntArray) -> IntArray:
        return logical % self.cp_size

    def physical(self, logical: IntArray) -> IntArray:
        return logical // self.cp_size

    def logical(self, owner: IntArray | int, physical: IntArray) -> IntArray:
        return physical * self.cp_size + owner


@attrs.frozen(kw_only=True)
class BlockCyclic:
    """Blocks of ``block_pages`` consecutive logical pages go round-robin over CP ranks.

    Keeps ``block_pages`` consecutive logical pages contiguous on one owner, so transfers
    coalesce into runs of up to a block. ``block_pages == 1`` is ``PageInterleaved``.
    """

    cp_size: int = attrs.field(validator=_positive)
    block_pages: int = attrs.field(validator=_positive)

    def owner(self, logical: IntArray) -> IntArray:
        return (logical // self.block_pages) % self.cp_size

    def physical(self, logical: IntArray) -> IntArray:
        block = logical // self.block_pages
        return (block // self.cp_size) * self.block_pages + logical % self.block_pages

    def logical(self, owner: IntArray | int, physical: IntArray) -> IntArray:
        round_, offset = physical // self.block_pages, physical % self.block_pages
        return (round_ * self.cp_size + owner) * self.block_pages + offset
