"""A sender room's page contract, checked at the scheduler's call (DESIGN section 8).

Owns: the checks of one chunk before it joins a room: where it starts (``chunk_page_start``), the one
chunk-window rule (a room covers exactly [decode prefix, ``num_pages``), contiguous and
non-overlapping), repeated source pages, and source pages or state slots outside this rank's
buffers. Each raises at the call (``MappingError`` naming the room, the argument and both sides, or
``InvalidArgumentError``) and changes nothing: a caller's bug is refused before any byte moves,
never a failed room later. Must not hold a protocol rule: those are the machines' rows.
"""

from __future__ import annotations

import numpy as np

from pdkv.errors import InvalidArgumentError, MappingError
from pdkv.mapping import OwnershipPolicy, chunk_page_start, cp_owned
from pdkv.mapping._arrays import int_max, summarize
from pdkv.mapping.layout import BufferLayout
from pdkv.protocol import arguments
from pdkv.protocol.effects import ChunkSpec
from pdkv.protocol.ids import RoomId
from pdkv.protocol.machines._prefill_side import SenderRoom


def chunk_start(room: RoomId, start_token: int, page_size: int) -> int:
    """The chunk's first position (its first token must start a page)."""
    try:
        return chunk_page_start(start_token, page_size)
    except MappingError as exc:
        raise MappingError(f"room {room}: start_token: {exc}", room=room) from None


def check_window(
    r: SenderRoom, start: int, size: int, *, prefix: int | None, last: bool | None, first: bool
) -> None:
    """The one chunk-window rule of a room, for ``send()`` and per-layer registration: a room covers
    exactly [decode prefix, ``num_pages``). ``prefix``: positions the decode holds (None: not known
    yet). ``last``: None for a per-layer registration (whether it is the last chunk is known at
    ``send()``), which may also come before the chunk ahead of it was sent (only an overlap with what
    was queued is refused then). ``first``: no earlier chunk of the room is known, so this one must
    start at the decode's prefix."""
    room, num_pages = r.room, r.num_pages or 0
    end = start + size
    where = f"chunk at positions {start}..{end - 1} of a {num_pages}-page room"
    if prefix is not None and start < prefix:
        raise MappingError(
            f"room {room}: the {where} starts inside the decode's prefix (positions 0..{prefix - 1}, "
            f"which it already holds): start at position {prefix}",
            room=room,
        )
    if first and prefix is not None and start != prefix:
        held = f"positions 0..{prefix - 1}" if prefix else "no prefix"
        raise MappingError(
            f"room {room}: the first {where} starts past the decode's prefix (it holds {held}): "
            f"positions {prefix}..{start - 1} would never be written; start the first chunk at "
            f"decode_prefix_pages() = {prefix}",
            room=room,
        )
    following = r.next_position
    if following is not None and last is not None and start != following:
        gap = start - following
        what = (
            f"leaves positions {following}..{start - 1} unwritten"
            if gap > 0
            else f"overlaps {-gap} position(s) already queued"
        )
        raise MappingError(
            f"room {room}: chunk_pages {what} (the previous chunk ended at position {following}); {where}",
            room=room,
        )
    if following is not None and last is None and start < following:
        raise MappingError(
            f"room {room}: the {where} overlaps chunks already queued (up to {following - 1})", room=room
        )
    if end > num_pages:
        raise MappingError(f"room {room}: the {where} runs past the request's last page", room=room)
    if last and end != num_pages:
        raise MappingError(
            f"room {room}: the last chunk ends at position {end}, short of num_pages {num_pages}: "
            f"positions {end}..{num_pages - 1} would never be written; {where}",
            room=room,
        )


def check_repeats(r: SenderRoom, spec: ChunkSpec) -> None:
    """No source page twice in the chunk, nor one of an earlier chunk of the room."""
    room = r.room
    if spec.pages.size > 1:
        repeated = arguments.repeated_ids(spec.pages)
        if repeated.size:
            raise MappingError(
                f"room {room}: chunk_pages repeat page ids {repeated[:6].tolist()}: two positions "
                f"would read one page; {summarize(spec.pages, 'chunk_pages')}",
                room=room,
            )
    if r.src_pages and spec.pages.size:
        earlier = np.concatenate(r.src_pages)
        repeated = spec.pages[np.isin(spec.pages, earlier)]
        if repeated.size:
            raise MappingError(
                f"room {room}: chunk_pages repeat page ids {repeated[:6].tolist()} of an earlier "
                f"chunk; {summarize(spec.pages, 'chunk_pages')}; {summarize(earlier, 'earlier pages')}",
                room=room,
            )


def check_sources(
    room: RoomId,
    spec: ChunkSpec,
    start: int,
    *,
    layout: BufferLayout,
    policy: OwnershipPolicy | None,
    cp: int,
) -> None:
    """The chunk's pages this rank owns (CP rank ``cp``), and its state slots, inside this rank's own
    buffers."""
    if spec.pages.size:
        owned = cp_owned(spec.pages, start, cp if policy is not None else 0, policy).physical
        capacity = layout.min_kv_items
        if owned.size and int_max(owned) >= capacity:
            bad = owned[owned >= capacity]
            raise InvalidArgumentError(
                f"room {room}: chunk_pages hold page(s) {bad[:6].tolist()} (physical, on CP rank "
                f"{cp}) outside this rank's KV buffers of {capacity} pages; "
                f"{summarize(spec.pages, 'chunk_pages')}",
                room=room,
                argument="chunk_pages",
                value=int(bad[0]),
            )
    for state in spec.state:
        if not layout.select(state.kind):
            raise InvalidArgumentError(
                f"room {room}: state_indices name kind {state.kind.value}, which this rank did not register",
                room=room,
                argument="state_indices",
                value=state.kind,
            )
        slots = layout.min_items(state.kind)
        if state.indices.size and int_max(state.indices) >= slots:
            raise InvalidArgumentError(
                f"room {room}: state_indices[{state.kind.value}] slot {int(state.indices.max())} is "
                f"outside this rank's {state.kind.value} buffers of {slots} slots",
                room=room,
                argument=f"state_indices[{state.kind.value}]",
                value=int(state.indices.max()),
            )


__all__ = ["check_repeats", "check_sources", "check_window", "chunk_start"]
