"""Pages of a chunk: chunk offsets, CP ownership, and the exact source -> destination page contract.

Owns: ``chunk_page_start``, ``cp_owned`` / ``OwnedPages``, ``dst_for_positions``,
``check_page_counts`` and ``map_chunk`` / ``MappedChunk`` (the three steps in one call). Pure and
vectorised over pages. Must not clip, pad or guess: any disagreement about page counts or positions
is a ``MappingError`` carrying compact summaries of both sides, because a page written to the wrong
place is silent KV corruption at the decode side.

Positions: page ``i`` of a chunk whose first token is ``start_token`` sits at absolute position
``start_token // page_size + i`` in the request; the decode side lists its destination pages by
position for the whole request, so chunk N > 0 lands after the pages of earlier chunks.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from pdkv.errors import MappingError
from pdkv.mapping._arrays import (
    IntArray,
    as_index_array,
    as_non_negative_index_array,
    check_int,
    int_bounds,
    summarize,
)
from pdkv.mapping.ownership import OwnershipPolicy, PageInterleaved

_IDENTITY = PageInterleaved(cp_size=1)


def _array_eq() -> Any:
    return attrs.cmp_using(eq=np.array_equal)


def chunk_page_start(start_send_idx: int | np.integer[Any], page_size: int | np.integer[Any]) -> int:
    """Absolute position of a chunk's first page: ``start_send_idx // page_size``.

    The token offset must be page-aligned: a non-last chunk is floored to a page boundary before
    it is sent (its partial page goes with the next chunk), so an unaligned offset means the caller
    lost track of a partial page.
    """
    start = check_int(start_send_idx, "start_send_idx", minimum=0)
    size = check_int(page_size, "page_size", minimum=1)
    if start % size:
        raise MappingError(
            f"chunk start token {start} is not aligned to page_size {size} "
            f"(pages {start // size} and {start // size + 1} both hold tokens of it); "
            "non-last chunks end on a page boundary"
        )
    return start // size


@attrs.frozen(kw_only=True)
class OwnedPages:
    """The pages of a chunk that one CP rank stores: where they are locally, where in the request.

    ``physical[i]`` is a page index in this rank's KV buffers; ``positions[i]`` its absolute position
    in the request (``chunk_page_start`` + index within the chunk), in increasing order.
    """

    cp_rank: int
    physical: IntArray = attrs.field(eq=_array_eq())
    positions: IntArray = attrs.field(eq=_array_eq())

    def __len__(self) -> int:
        return int(self.positions.size)


def _check_policy_rank(cp_rank: int, policy: OwnershipPolicy) -> int:
    rank = check_int(cp_rank, "cp_rank", minimum=0)
    if rank >= policy.cp_size:
        raise MappingError(f"cp_rank {rank} is outside cp_size {policy.cp_size}")
    return rank


def cp_owned(
    chunk_logical_pages: object,
    chunk_page_start: int,
    cp_rank: int,
    policy: OwnershipPolicy | None = None,
) -> OwnedPages:
    """The chunk's pages owned by ``cp_rank`` under ``policy``: physical pages and absolute positions.

    ``chunk_logical_pages`` lists the chunk's logical page ids as every CP rank sees them, in
    position order. With ``cp_size == 1`` (or ``policy=None``) every page is owned and physical ==
    logical. Over all CP ranks the positions partition the chunk's positions exactly once.
    """
    policy = _IDENTITY if policy is None else policy
    rank = _check_policy_rank(cp_rank, policy)
    first = check_int(chunk_page_start, "chunk_page_start", minimum=0)
    logical = as_non_negative_index_array(chunk_logical_pages, "chunk_logical_pages")
    if policy.cp_size == 1:
        return OwnedPages(
            cp_rank=rank,
            physical=logical.copy(),  # never alias the caller's array (it may be a live torch tensor)
            positions=np.arange(first, first + logical.size, dtype=np.int64),
        )
    owned_index = np.flatnonzero(policy.owner(logical) == rank)
    return OwnedPages(
        cp_rank=rank,
        physical=policy.physical(logical[owned_index]),
        positions=owned_index + first,
    )


def dst_for_positions(dst_pages: object, positions: object) -> IntArray:
    """``dst_pages[positions]`` under the exact contract: every position must exist.

    ``dst_pages`` is the decode side's page list for the whole request, by position. A position
    past its end (or negative) is a ``MappingError`` naming both lists; nothing is clipped.
    """
    dst = as_non_negative_index_array(dst_pages, "dst_pages")
    pos = as_index_array(positions, "positions")
    if pos.size == 0:
        return np.zeros(0, dtype=np.int64)
    lowest, highest = int_bounds(pos)
    if lowest < 0 or highest >= dst.size:
        outside = int(np.count_nonzero((pos < 0) | (pos >= dst.size)))
        raise MappingError(
            f"{outside} position(s) outside the destination list (valid 0..{dst.size - 1}, "
            f"got {lowest}..{highest}); {summarize(pos, 'positions')}; {summarize(dst, 'dst_pages')}"
        )
    out: IntArray = dst[pos]
    return out


def check_page_counts(src_pages: object, dst_pages: object) -> int:
    """Source and destination page lists of the same chunk must be equally long; returns that length.

    For callers that already sliced the destination themselves (the non-CP path). A difference is a
    ``MappingError`` with both summaries, never a truncation to the shorter list.
    """
    src = as_index_array(src_pages, "src_pages")
    dst = as_index_array(dst_pages, "dst_pages")
    require_equal_counts(src, dst)
    return int(src.size)


def require_equal_counts(src: IntArray, dst: IntArray) -> None:
    """``check_page_counts`` for lists already taken in by ``as_index_array``."""
    if src.size != dst.size:
        raise MappingError(
            f"page counts differ: {src.size} source vs {dst.size} destination pages; "
            f"{summarize(src, 'src_pages')}; {summarize(dst, 'dst_pages')}"
        )


@attrs.frozen(kw_only=True)
class MappedChunk:
    """One rank's share of a chunk: page ``src[i]`` goes to peer page ``dst[i]``, at ``positions[i]``."""

    positions: IntArray = attrs.field(eq=_array_eq())
    src: IntArray = attrs.field(eq=_array_eq())
    dst: IntArray = attrs.field(eq=_array_eq())

    def __len__(self) -> int:
        return int(self.src.size)


def map_chunk(
    chunk_logical_pages: object,
    *,
    start_token: int,
    page_size: int,
    dst_pages: object,
    cp_rank: int = 0,
    policy: OwnershipPolicy | None = None,
) -> MappedChunk:
    """``chunk_page_start`` + ``cp_owned`` + ``dst_for_positions`` for one chunk on one rank."""
    owned = cp_owned(chunk_logical_pages, chunk_page_start(start_token, page_size), cp_rank, policy)
    return MappedChunk(
        positions=owned.positions,
        src=owned.physical,
        dst=dst_for_positions(dst_pages, owned.positions),
    )
