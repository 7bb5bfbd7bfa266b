"""What one prefill rank writes for one chunk to one destination: pages -> byte blocks.

Owns: ``plan_chunk`` (pure: mapping calls only, no I/O), the glue between a chunk (its spec, the
room's aux row, one destination) and the mapping functions, and ``fence_of``. It decides, per chunk
and destination:

- KV: the pages this CP rank owns, at their absolute positions (``map_chunk``: ``chunk_page_start``
  + ``cp_owned`` + the exact position -> destination contract), coalesced into runs, then blocks in
  every KV buffer (target and draft models) of the two layouts, paired by (model, kind, layer)
  (``kv_blocks``: whole page items, or, for MHA/GQA layouts that describe heads, the heads this
  rank shares with the destination rank, which may run another TP size). A request with a landing
  grant (decode TP below prefill TP) takes the KV pages whole into the grant's region instead, slot
  by position (``pdkv.mapping.landing.source_region``), the decode scattering them before Success;
- on the last chunk, and only on the rank that writes the room's extras, the state slots of each
  state kind (clipped to the common length when the two sides disagree, and reported) and the aux
  row. State and aux rows are replicated across CP ranks and not split by heads, so one writer per
  destination is enough and two would race: the caller says whether this rank is the room's CP
  rank 0 (``writes_extras``), and ``writes_extras_to`` narrows that to the one real TP source of the
  destination whose head range holds the destination's first head (specs/protocol.md, "Who writes
  what"). Under MLA and equal-TP MHA each destination has one real TP source, which always qualifies.

Draft-model buffers that a registration under ``DEGRADE_DRAFT`` left out for this pair of ranks (only
one side registers them) are planned around: every block is made on the pair's ``transfer_view``
(the two layouts without those buffers), decided from the two registered layouts alone, and its
buffer index put back into the source layout's numbering.
"""

from __future__ import annotations

import attrs
import numpy as np

from pdkv.errors import MappingError
from pdkv.mapping import (
    BufferKind,
    BufferLayout,
    OwnershipPolicy,
    TransferBlocks,
    aux_blocks,
    clip_state,
    coalesce,
    kv_blocks,
    map_chunk,
    state_blocks,
    transfer_view,
)
from pdkv.mapping.landing import source_region
from pdkv.protocol.effects import ChunkSpec, Destination, FenceWrite
from pdkv.protocol.ids import RoomId, SessionId
from pdkv.protocol.messages import IntArray

FENCE_BYTES = 64
"""How much of a failed batch's first block a fence write repeats (it only has to pass the engine's queue)."""


def fence_of(session: SessionId, blocks: TransferBlocks) -> FenceWrite | None:
    """A fence for a failed write of ``blocks`` to ``session``: the start of its first non-empty block
    (inside the room's own destination pages, which the decode holds until the room's AbortAck);
    None when nothing was to be written."""
    sizes = blocks.length
    nonempty = (sizes > 0).nonzero()[0]
    if not nonempty.size:
        return None
    i = int(nonempty[0])
    return FenceWrite(
        session=session,
        src=int(blocks.src[i]),
        dst=int(blocks.dst[i]),
        length=min(int(sizes[i]), FENCE_BYTES),
    )


def _empty() -> IntArray:
    return np.zeros(0, dtype=np.int64)


@attrs.frozen(kw_only=True)
class ChunkPlan:
    """The blocks of one chunk towards one destination, and what they amount to."""

    blocks: TransferBlocks
    kv_pages: int  # KV pages (positions) this rank writes for the chunk
    state_slots: int  # state slots written (all kinds)
    aux_rows: int
    notes: tuple[str, ...]  # e.g. state clipping, for the log
    # What the blocks write, item by item (for checksums, ``pdkv.runtime.checksum``):
    kv_src: IntArray = attrs.field(factory=_empty)  # this rank's KV pages, by position
    kv_positions: IntArray = attrs.field(factory=_empty)
    state_src: tuple[tuple[BufferKind, IntArray], ...] = ()  # source slots written per kind (clipped)
    aux_src: int | None = None  # the aux row written (None: none)


def _first_head_range(layout: BufferLayout) -> tuple[int, int] | None:
    """(head_start, head_stop) of a layout's first K/V buffer, or None when it describes no heads.

    ``kv_blocks`` refuses layouts whose K/V buffers disagree on the head split, and in canonical
    order the first buffer of an MHA layout is the target model's first K buffer.
    """
    first = layout.buffers[0] if layout.buffers else None
    if first is None or first.heads is None:
        return None
    return first.heads.head_start, first.heads.head_stop


def writes_extras_to(src_layout: BufferLayout, dst_layout: BufferLayout) -> bool:
    """Whether a real TP source with ``src_layout`` writes the extras of a destination with ``dst_layout``.

    True when either layout describes no heads (one real TP source per destination), else when this
    rank's head range holds the destination's first head: exactly one of a decode rank's real
    sources (their ranges tile the decode rank's range; dummies never plan). Decided from the two
    registered layouts alone, so both sides agree without a message field.
    """
    mine, theirs = _first_head_range(src_layout), _first_head_range(dst_layout)
    if mine is None or theirs is None:
        return True
    start, stop = mine
    return start <= theirs[0] < stop


def plan_chunk(
    room: RoomId,
    spec: ChunkSpec,
    destination: Destination,
    *,
    src_aux_row: int | None,
    src_layout: BufferLayout,
    cp_rank: int,
    policy: OwnershipPolicy | None,
    writes_extras: bool,
) -> ChunkPlan:
    """Map chunk ``spec`` of ``room`` for ``destination``; MappingError/LayoutMismatchError on a
    broken contract. Plain values in: the monolithic path, the per-layer path and tests call it alike.

    ``src_aux_row``: the room's aux row on this rank (written with the last chunk's extras).
    ``writes_extras``: this rank may write the room's extras (its CP rank 0); on the last chunk they
    are written when, in addition, ``writes_extras_to`` names this rank for the destination.
    """
    request = destination.request
    # The pair's view: both layouts without the draft buffers left out for it (the layouts themselves
    # when nothing is), so no block reads a buffer the peer lacks or writes one it did not register.
    view = transfer_view(src_layout, destination.peer.layout)
    mapped = map_chunk(
        spec.pages,
        start_token=spec.start_token,
        page_size=src_layout.page_size,
        dst_pages=request.dst_pages,
        cp_rank=cp_rank,
        policy=policy,
    )
    grant = request.landing
    if grant is None:
        parts = [kv_blocks(coalesce(mapped.src, mapped.dst), view.src, view.dst)]
    else:
        # Decode TP below prefill TP: this rank's page items go whole into its landing region (slot
        # = position - first_position), a run of pages one block; the decode scatters them into its
        # pages before Success (specs/mapping.md section 15). Validated with the request.
        region = source_region(destination.peer.layout, src_layout, base=grant.address, slots=grant.slots)
        slots = mapped.positions - grant.first_position
        if slots.size and (int(slots.min()) < 0 or int(slots.max()) >= grant.slots):
            raise MappingError(
                f"room {room}: chunk positions outside the landing window of {grant.slots} slots"
            )
        parts = [kv_blocks(coalesce(mapped.src, slots), view.src, region)]
    notes: list[str] = []
    state_slots = aux_rows = 0
    state_src: list[tuple[BufferKind, IntArray]] = []
    aux_src: int | None = None
    if spec.last and writes_extras and writes_extras_to(view.src, view.dst):
        wanted = {s.kind: s.indices for s in request.dst_state}
        for src_state in spec.state:
            if view.leaves_out and not view.src.select(src_state.kind) and src_layout.select(src_state.kind):
                continue  # every buffer of this kind is a draft buffer the peer lacks
            if src_state.kind not in wanted:
                raise MappingError(
                    f"room {room}: prefill sends {src_state.kind.value} state but the decode request "
                    f"names no destination slots for it (kinds: {sorted(k.value for k in wanted)})"
                )
            clipped = clip_state(src_state.indices, wanted[src_state.kind])
            if clipped.clipped:
                notes.append(f"{src_state.kind.value} state: {clipped.describe()}")
            parts.append(state_blocks(src_state.kind, clipped.src, clipped.dst, view.src, view.dst))
            state_slots += len(clipped.src)
            state_src.append((src_state.kind, clipped.src))
        if src_aux_row is not None and request.dst_aux_row is not None:
            parts.append(aux_blocks(src_aux_row, request.dst_aux_row, view.src, view.dst))
            aux_rows = 1
            aux_src = src_aux_row
    return ChunkPlan(
        blocks=view.restore(TransferBlocks.concat(parts)),
        kv_pages=len(mapped),
        state_slots=state_slots,
        aux_rows=aux_rows,
        notes=tuple(notes),
        kv_src=mapped.src,
        kv_positions=mapped.positions,
        state_src=tuple(state_src),
        aux_src=aux_src,
    )
