"""Staged gather: many small blocks whose destinations are contiguous, moved as few large blocks.

Owns: ``StagingSources`` (where each local buffer's bytes live: a source region, such as one tensor
storage, and the buffer's bounds in it), ``dst_merge_starts`` / ``staged_entries`` (how many engine
entries a block list needs once its bytes sit contiguously in staging memory), ``stageable``, and
``plan_staged_pieces`` with its records ``GatherPlan`` and ``StagedPiece``: the copy of a block
list's source bytes into a staging piece (one gather per source region run) and the blocks that then
move the piece to the peer. Pure and vectorised (numpy over blocks; one loop iteration per piece,
never per block or page). Must not allocate or copy memory, touch torch or a backend, or decide
*whether* to stage (the runtime's ``StagingPool`` does, from ``staged_entries``).

The layout of a piece (specs/mapping.md, section 14): the piece's blocks keep their order, and block
``i`` occupies staging bytes ``[o_i, o_i + length_i)`` with ``o_i`` the sum of the lengths before it
(so a piece holds exactly the bytes of its blocks, in order, with no gap). Consecutive blocks of one
local buffer whose destinations are contiguous (``dst_i + length_i == dst_{i+1}``) then lie next to
each other in staging too, so they become one staged block ``(staging + o_first, dst_first, sum of
lengths)``. Nothing is merged across buffers (two peer buffers may be adjacent in memory and still be
different registrations) or across pieces. Where the source is strided and the destination is not
(MHA/GQA heads from a prefill rank holding more heads than the decode rank: one slice per token), a
page of ``P`` token slices becomes one entry and a run of pages one entry; where the destination is
strided too (decode TP below prefill TP) nothing merges and staging gains nothing.

The gather of a piece is a list of groups, one per maximal run of consecutive blocks whose buffers
lie in the same source region. A group copies ``element_bytes``-sized elements: ``element_bytes`` is
the greatest common divisor of the group's block lengths and of their offsets from the region start,
so every block is ``length / element_bytes`` whole elements at element index ``offset /
element_bytes``. Viewing the region as ``[region_bytes // element_bytes, element_bytes]`` bytes, the
group is one ``index_select`` of rows ``index[first : first + count]`` into staging bytes
``[out_offset, out_offset + count x element_bytes)`` of the piece: one copy kernel per group on the
tensor's device.
"""

from __future__ import annotations

from typing import Any, Final

import attrs
import numpy as np
import numpy.typing as npt

from pdkv.errors import MappingError
from pdkv.mapping._arrays import IntArray, as_index_array, summarize
from pdkv.mapping.batches import batch_bounds
from pdkv.mapping.blocks import TransferBlocks

BoolArray = npt.NDArray[np.bool_]

NO_REGION: Final = -1
"""``StagingSources.buffer_region`` of a buffer whose bytes the stager cannot read (never staged)."""


def _array_eq() -> Any:
    return attrs.cmp_using(eq=np.array_equal)


def _int64(value: object) -> IntArray:
    return np.ascontiguousarray(np.asarray(value, dtype=np.int64).reshape(-1))


@attrs.frozen(kw_only=True)
class StagingSources:
    """Where the bytes of each local buffer (``BufferLayout.buffers`` order) can be read from.

    Buffer ``b`` lies at addresses ``[buffer_start[b], buffer_end[b])`` inside region
    ``buffer_region[b]`` (``NO_REGION``: not readable by the stager), and region ``r`` spans
    ``[region_start[r], region_start[r] + region_bytes[r])``. A region is what one gather indexes
    from: a tensor's whole storage, so that the buffers of one pool tensor are gathered together.
    """

    buffer_region: IntArray = attrs.field(converter=_int64, eq=_array_eq())
    buffer_start: IntArray = attrs.field(converter=_int64, eq=_array_eq())
    buffer_end: IntArray = attrs.field(converter=_int64, eq=_array_eq())
    region_start: IntArray = attrs.field(converter=_int64, eq=_array_eq())
    region_bytes: IntArray = attrs.field(converter=_int64, eq=_array_eq())

    def __attrs_post_init__(self) -> None:
        n = self.buffer_region.size
        if not (self.buffer_start.size == self.buffer_end.size == n):
            raise MappingError(
                f"staging sources: {n} buffer regions, {self.buffer_start.size} starts, "
                f"{self.buffer_end.size} ends: one of each per buffer"
            )
        if self.region_start.size != self.region_bytes.size:
            raise MappingError(
                f"staging sources: {self.region_start.size} region starts, {self.region_bytes.size} sizes"
            )
        if n and (int(self.buffer_region.min()) < NO_REGION or int(self.buffer_region.max()) >= self.regions):
            raise MappingError(
                f"staging sources: {summarize(self.buffer_region, 'buffer_region')} names a region outside "
                f"0..{self.regions - 1}"
            )
        if self.regions and int(self.region_bytes.min()) <= 0:
            raise MappingError(f"staging sources: {summarize(self.region_bytes, 'region_bytes')} must be > 0")
        known = self.buffer_region != NO_REGION
        region = np.maximum(self.buffer_region, 0)
        lo = self.region_start[region] if self.regions else np.zeros(n, dtype=np.int64)
        hi = lo + (self.region_bytes[region] if self.regions else 0)
        outside = known & (
            (self.buffer_start < lo) | (self.buffer_end > hi) | (self.buffer_end < self.buffer_start)
        )
        if bool(outside.any()):
            first = int(np.flatnonzero(outside)[0])
            raise MappingError(
                f"staging sources: buffer #{first} [{int(self.buffer_start[first]):#x}, "
                f"{int(self.buffer_end[first]):#x}) is not inside region #{int(self.buffer_region[first])} "
                f"[{int(lo[first]):#x}, {int(hi[first]):#x})"
            )

    @property
    def regions(self) -> int:
        return int(self.region_start.size)

    @property
    def buffers(self) -> int:
        return int(self.buffer_region.size)


@attrs.frozen(kw_only=True)
class GatherPlan:
    """Struct of arrays, one entry per group (a run of a piece's blocks in one source region).

    Group ``k`` copies rows ``index[first[k] : first[k] + count[k]]`` of region ``region[k]`` viewed as
    rows of ``element_bytes[k]`` bytes (row ``j`` = region bytes ``[j x e, (j + 1) x e)``) to piece bytes
    ``[out_offset[k], out_offset[k] + count[k] x element_bytes[k])``, in index order.
    """

    region: IntArray = attrs.field(converter=_int64, eq=_array_eq())
    element_bytes: IntArray = attrs.field(converter=_int64, eq=_array_eq())
    first: IntArray = attrs.field(converter=_int64, eq=_array_eq())
    count: IntArray = attrs.field(converter=_int64, eq=_array_eq())
    out_offset: IntArray = attrs.field(converter=_int64, eq=_array_eq())
    index: IntArray = attrs.field(converter=_int64, eq=_array_eq())

    def __len__(self) -> int:
        return int(self.region.size)

    @property
    def total_bytes(self) -> int:
        return int((self.count * self.element_bytes).sum())


@attrs.frozen(kw_only=True)
class StagedPiece:
    """One staging piece: ``nbytes`` bytes gathered by ``gather``, moved by ``blocks``.

    ``blocks.src`` are byte offsets from the piece's start (the runtime adds the staging address);
    ``dst``, ``buffer`` are the peer addresses and local buffer indices of the source blocks.
    ``source`` is the piece's share of the original block list (the same bytes, unstaged).
    """

    gather: GatherPlan
    blocks: TransferBlocks
    source: TransferBlocks
    nbytes: int

    def at(self, address: int) -> TransferBlocks:
        """``blocks`` with the piece placed at staging address ``address``."""
        return TransferBlocks(
            src=self.blocks.src + address,
            dst=self.blocks.dst,
            length=self.blocks.length,
            buffer=self.blocks.buffer,
        )


def non_empty(blocks: TransferBlocks) -> TransferBlocks:
    keep = blocks.length > 0
    return blocks if bool(keep.all()) else blocks.take(np.flatnonzero(keep))


def dst_merge_starts(blocks: TransferBlocks) -> BoolArray:
    """True where a staged block starts: the first block, a new buffer, or a destination gap.

    Block ``i > 0`` continues the staged block before it when ``buffer[i] == buffer[i - 1]`` and
    ``dst[i] == dst[i - 1] + length[i - 1]`` (in staging the two are adjacent by construction).
    """
    n = len(blocks)
    starts = np.ones(n, dtype=np.bool_)
    if n > 1:
        follows = (blocks.buffer[1:] == blocks.buffer[:-1]) & (
            blocks.dst[1:] == blocks.dst[:-1] + blocks.length[:-1]
        )
        starts[1:] = ~follows
    return starts


def staged_entries(blocks: TransferBlocks) -> int:
    """Engine entries the non-empty blocks need once staged (before slicing): runs of
    ``dst_merge_starts``. ``len(blocks) / staged_entries(blocks)`` is what staging saves."""
    return int(dst_merge_starts(non_empty(blocks)).sum())


def stageable(blocks: TransferBlocks, sources: StagingSources) -> bool:
    """Whether every non-empty block names a buffer the stager can read and lies inside it."""
    kept = non_empty(blocks)
    if not len(kept):
        return False
    buffer = kept.buffer
    if int(buffer.min()) < 0 or int(buffer.max()) >= sources.buffers:
        return False
    inside = (
        (sources.buffer_region[buffer] != NO_REGION)
        & (kept.src >= sources.buffer_start[buffer])
        & (kept.src + kept.length <= sources.buffer_end[buffer])
    )
    return bool(inside.all())


def _element_bytes(rel: IntArray, length: IntArray, group_starts: IntArray) -> IntArray:
    """Per group: the gcd of its block lengths and of their offsets from the region start."""
    by_length = np.gcd.reduceat(length, group_starts)
    owner = np.repeat(
        np.arange(group_starts.size, dtype=np.int64), np.diff(np.append(group_starts, length.size))
    )
    if not bool((rel % by_length[owner]).any()):
        return by_length  # the usual case: every block starts on a multiple of the group's lengths
    return np.gcd.reduceat(np.gcd(rel, length), group_starts)


def plan_piece(blocks: TransferBlocks, sources: StagingSources) -> StagedPiece:
    """One piece from non-empty blocks already checked to be ``stageable`` (``piece_bounds`` cuts
    them): its gather groups and its staged blocks, offsets counted from the piece's start."""
    offset = np.cumsum(blocks.length) - blocks.length
    region = sources.buffer_region[blocks.buffer]
    rel = blocks.src - sources.region_start[region]
    group_starts = np.flatnonzero(np.concatenate([np.ones(1, dtype=np.bool_), region[1:] != region[:-1]]))
    element = _element_bytes(rel, blocks.length, group_starts)
    sizes = np.diff(np.append(group_starts, len(blocks)))
    e = np.repeat(element, sizes)
    per_block = blocks.length // e
    block_first = np.cumsum(per_block) - per_block
    index = np.repeat(rel // e - block_first, per_block) + np.arange(int(per_block.sum()), dtype=np.int64)
    count = np.add.reduceat(per_block, group_starts)
    gather = GatherPlan(
        region=region[group_starts],
        element_bytes=element,
        first=np.cumsum(count) - count,
        count=count,
        out_offset=offset[group_starts],
        index=index,
    )
    starts = np.flatnonzero(dst_merge_starts(blocks))
    staged = TransferBlocks(
        src=offset[starts],
        dst=blocks.dst[starts],
        length=np.add.reduceat(blocks.length, starts),
        buffer=blocks.buffer[starts],
    )
    return StagedPiece(gather=gather, blocks=staged, source=blocks, nbytes=int(blocks.length.sum()))


def piece_bounds(blocks: TransferBlocks, piece_bytes: int) -> IntArray:
    """End index (exclusive) of each piece: greedy, at block boundaries, each <= ``piece_bytes``
    (every block must be no longer than that)."""
    return batch_bounds(blocks.length, max_entries=max(1, len(blocks)), max_batch_bytes=piece_bytes)


def plan_staged_pieces(
    blocks: TransferBlocks, sources: StagingSources, *, piece_bytes: int
) -> list[StagedPiece]:
    """Cut ``blocks`` (zero-length ones dropped) into pieces of at most ``piece_bytes`` bytes, at block
    boundaries and in order, and plan each piece's gather and staged blocks.

    Every block must be ``stageable`` (else ``MappingError``, naming the first offender) and at most
    ``piece_bytes`` long (else ``MappingError``: it would fit no piece; such a block gains nothing
    from staging anyway). Concatenating the pieces' ``source`` gives the non-empty blocks back; each
    piece's staged blocks move exactly its source bytes to the same destinations (property-tested).
    """
    if isinstance(piece_bytes, bool) or not isinstance(piece_bytes, int) or piece_bytes <= 0:
        raise MappingError(f"piece_bytes must be a positive int, got {piece_bytes!r}")
    kept = non_empty(blocks)
    if not len(kept):
        return []
    if not stageable(kept, sources):
        buffer = as_index_array(kept.buffer, "buffer")
        raise MappingError(
            f"{len(kept)} blocks are not all inside buffers the stager can read "
            f"({summarize(buffer, 'buffer')}; {sources.buffers} buffers, {sources.regions} regions)"
        )
    longest = int(kept.length.max())
    if longest > piece_bytes:
        raise MappingError(f"a block of {longest} bytes exceeds piece_bytes {piece_bytes}: it fits no piece")
    pieces: list[StagedPiece] = []
    start = 0
    for end in piece_bounds(kept, piece_bytes).tolist():
        pieces.append(plan_piece(kept.take(slice(start, end)), sources))
        start = end
    return pieces
