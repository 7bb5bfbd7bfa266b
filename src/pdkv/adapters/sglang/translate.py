"""Pure translations between SGLang's per-request calls and pdkv's: chunk positions, state lists, failures.

Owns: ``ChunkCursor`` (SGLang's sender is told only the page count at ``init`` and then one page list per
chunk; the cursor gives each chunk its first position and decides which chunk is the last),
``state_indices_for`` (SGLang's per-state-type index lists -> pdkv ``StateIndices``) and
``describe_failure`` (pdkv's failure -> one line for SGLang's ``KVTransferError``).
Must not import SGLang or do I/O: these run in the scheduler's hot path and are tested without SGLang.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pdkv.errors import MappingError
from pdkv.mapping import BufferKind
from pdkv.protocol.messages import StateIndices


class ChunkCursor:
    """Counts the pages of one request as SGLang sends them, chunk by chunk.

    ``advance(n)`` returns the chunk's first position (pages already sent) and whether this chunk brings
    the total to the count announced at ``init``: SGLang does not say which chunk is last, the sender
    decides. More pages than announced, or pages after the last chunk, would write past what the decode
    allocated: a ``MappingError`` naming both counts.
    """

    def __init__(self, room: int, num_pages: int) -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise MappingError(f"room {room}: page count must be an int >= 0, got {num_pages!r}")
        self.room = room
        self.num_pages = num_pages
        self.sent = 0
        self.finished = False

    def advance(self, pages: int) -> tuple[int, bool]:
        if self.finished:
            raise MappingError(
                f"room {self.room}: {pages} pages sent after the last chunk ({self.num_pages} announced)"
            )
        if self.sent + pages > self.num_pages:
            raise MappingError(
                f"room {self.room}: chunk of {pages} pages at position {self.sent} passes the "
                f"{self.num_pages} pages announced"
            )
        start = self.sent
        self.sent += pages
        self.finished = self.sent == self.num_pages
        return start, self.finished


def state_indices_for(
    kinds: Sequence[BufferKind], state_indices: Sequence[object] | None
) -> list[StateIndices] | None:
    """SGLang's ``state_indices`` (one entry per ``KVArgs.state_types`` entry, None for a type with nothing
    to send this time) as pdkv ``StateIndices``; None when SGLang gave none."""
    if not state_indices:
        return None
    if len(state_indices) != len(kinds):
        raise MappingError(f"{len(state_indices)} state index lists for {len(kinds)} state types")
    return [
        StateIndices(kind=kind, indices=np.asarray(indices, dtype=np.int64).reshape(-1))
        for kind, indices in zip(kinds, state_indices, strict=True)
        if indices is not None
    ]


def describe_failure(failure: object) -> str:
    """pdkv's failure as one line: ``cause: reason (peer)`` for a typed failure, the text otherwise."""
    if failure is None:
        return "failed (pdkv gave no reason)"
    if isinstance(failure, str):
        return failure
    cause = getattr(failure, "cause", None)
    reason = getattr(failure, "reason", None)
    peer = getattr(failure, "peer", None)
    cause_text = str(getattr(cause, "value", cause)) if cause is not None else "failed"
    text = f"{cause_text}: {reason}" if reason else cause_text
    return f"{text} (peer {peer})" if peer else text
