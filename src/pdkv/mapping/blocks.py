"""Transfer blocks: the byte-level work list handed from mapping to the transfer executor.

Owns: ``TransferBlocks``, a struct of arrays (never a list of tuples): block i copies
``length[i]`` bytes from local address ``src[i]`` to peer address ``dst[i]``; ``buffer[i]`` is the
index of the registered buffer (in ``BufferLayout.buffers`` order) both addresses lie in, so
shaping can refuse to merge across buffers. Must not do I/O.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from pdkv.mapping._arrays import int_min, int_sum

IntArray = npt.NDArray[np.int64]


def _int64_1d(value: Any) -> IntArray:
    arr = np.ascontiguousarray(value, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"block arrays are 1-D, got shape {arr.shape}")
    return arr


def _array_eq() -> Any:
    return attrs.cmp_using(eq=np.array_equal)


@attrs.frozen(kw_only=True)
class TransferBlocks:
    """Block i: ``length[i]`` bytes from ``src[i]`` (local) to ``dst[i]`` (peer), in ``buffer[i]``."""

    src: IntArray = attrs.field(converter=_int64_1d, eq=_array_eq())
    dst: IntArray = attrs.field(converter=_int64_1d, eq=_array_eq())
    length: IntArray = attrs.field(converter=_int64_1d, eq=_array_eq())
    buffer: IntArray = attrs.field(converter=_int64_1d, eq=_array_eq())

    def __attrs_post_init__(self) -> None:
        n = self.src.size
        if not (self.dst.size == self.length.size == self.buffer.size == n):
            raise ValueError(
                f"block arrays differ in length: src {n}, dst {self.dst.size}, "
                f"length {self.length.size}, buffer {self.buffer.size}"
            )
        if n and int_min(self.length) < 0:
            raise ValueError("block lengths are non-negative")

    @classmethod
    def _holding(cls, src: IntArray, dst: IntArray, length: IntArray, buffer: IntArray) -> TransferBlocks:
        """Blocks of arrays that already keep every rule above (1-D contiguous int64, one size,
        lengths >= 0), built without converting or checking them again: the arrays of blocks
        already built, concatenated, or computed from checked inputs (``runs_to_blocks``). Each
        check is a few numpy calls, and a chunk's plan builds several of these lists."""
        blocks = object.__new__(cls)
        object.__setattr__(blocks, "src", src)
        object.__setattr__(blocks, "dst", dst)
        object.__setattr__(blocks, "length", length)
        object.__setattr__(blocks, "buffer", buffer)
        return blocks

    @classmethod
    def empty(cls) -> TransferBlocks:
        z = np.zeros(0, dtype=np.int64)
        return cls(src=z, dst=z, length=z, buffer=z)

    @classmethod
    def concat(cls, parts: list[TransferBlocks]) -> TransferBlocks:
        if not parts:
            return cls.empty()
        if len(parts) == 1:
            return parts[0]  # immutable: the one part is already the whole list
        return cls._holding(
            np.concatenate([p.src for p in parts]),
            np.concatenate([p.dst for p in parts]),
            np.concatenate([p.length for p in parts]),
            np.concatenate([p.buffer for p in parts]),
        )

    def __len__(self) -> int:
        return int(self.src.size)

    @property
    def total_bytes(self) -> int:
        return int_sum(self.length)

    def take(self, selector: slice | IntArray) -> TransferBlocks:
        """A sub-list (by slice or index array)."""
        return TransferBlocks(
            src=self.src[selector],
            dst=self.dst[selector],
            length=self.length[selector],
            buffer=self.buffer[selector],
        )
