"""What one prefill rank writes for one chunk to one destination: pages -> byte blocks.

Owns: ``plan_chunk`` (pure: mapping calls only, no I/O), the glue between a protocol
``SubmitChunk`` and the mapping functions. It decides, per chunk and destination:

- KV: the pages this CP rank owns, at their absolute positions (``map_chunk``: ``chunk_page_start``
  + ``cp_owned`` + the exact position -> destination contract), coalesced into runs, then blocks in
  every KV buffer (target and draft models) of the two layouts, paired by (model, kind, layer);
- on the last chunk, and only on the rank that writes the room's extras (CP rank 0: state and aux
  rows are replicated across CP ranks, so one writer is enough), the state slots of each state kind
  (clipped to the common length when the two sides disagree, and reported) and the aux row.
"""

from __future__ import annotations

import attrs

from pdkv.errors import MappingError
from pdkv.mapping import (
    BufferLayout,
    OwnershipPolicy,
    TransferBlocks,
    aux_blocks,
    clip_state,
    coalesce,
    layer_blocks,
    map_chunk,
    state_blocks,
)
from pdkv.protocol.effects import Destination, SubmitChunk


@attrs.frozen(kw_only=True)
class ChunkPlan:
    """The blocks of one chunk towards one destination, and what they amount to."""

    blocks: TransferBlocks
    kv_pages: int  # KV pages (positions) this rank writes for the chunk
    state_slots: int  # state slots written (all kinds)
    aux_rows: int
    notes: tuple[str, ...]  # e.g. state clipping, for the log


def plan_chunk(
    submit: SubmitChunk,
    destination: Destination,
    *,
    src_layout: BufferLayout,
    cp_rank: int,
    policy: OwnershipPolicy | None,
    writes_extras: bool,
) -> ChunkPlan:
    """Map ``submit``'s chunk for ``destination``; MappingError/LayoutMismatchError on a broken contract."""
    spec = submit.spec
    request = destination.request
    dst_layout = destination.peer.layout
    mapped = map_chunk(
        spec.pages,
        start_token=spec.start_token,
        page_size=src_layout.page_size,
        dst_pages=request.dst_pages,
        cp_rank=cp_rank,
        policy=policy,
    )
    parts = [layer_blocks(coalesce(mapped.src, mapped.dst), src_layout, dst_layout)]
    notes: list[str] = []
    state_slots = aux_rows = 0
    if spec.last and writes_extras:
        wanted = {s.kind: s.indices for s in request.dst_state}
        for src_state in spec.state:
            if src_state.kind not in wanted:
                raise MappingError(
                    f"room {submit.room}: prefill sends {src_state.kind.value} state but the decode request "
                    f"names no destination slots for it (kinds: {sorted(k.value for k in wanted)})"
                )
            clipped = clip_state(src_state.indices, wanted[src_state.kind])
            if clipped.clipped:
                notes.append(f"{src_state.kind.value} state: {clipped.describe()}")
            parts.append(state_blocks(src_state.kind, clipped.src, clipped.dst, src_layout, dst_layout))
            state_slots += len(clipped.src)
        if submit.src_aux_row is not None and request.dst_aux_row is not None:
            parts.append(aux_blocks(submit.src_aux_row, request.dst_aux_row, src_layout, dst_layout))
            aux_rows = 1
    return ChunkPlan(
        blocks=TransferBlocks.concat(parts),
        kv_pages=len(mapped),
        state_slots=state_slots,
        aux_rows=aux_rows,
        notes=tuple(notes),
    )
