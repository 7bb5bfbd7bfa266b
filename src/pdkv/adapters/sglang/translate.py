"""Pure translations between SGLang's per-request calls and pdkv's: chunk positions, state lists, failures.

Owns: ``ChunkCursor`` (SGLang's sender is told only the page count at ``init`` and then one page list per
chunk; the cursor gives each chunk its first position and decides which chunk is the last),
``destinations_with_prefix`` (SGLang's decode names only the pages after its cached prefix; pdkv wants one
destination per position of the whole request), ``prefix_pages_of`` (SGLang's prefix in tokens -> pages),
``state_indices_for`` (SGLang's per-state-type index lists -> pdkv ``StateIndices``) and
``describe_failure`` (pdkv's failure -> one line for SGLang's ``KVTransferError``).
Must not import SGLang or do I/O: these run in the scheduler's hot path and are tested without SGLang.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pdkv.errors import MappingError
from pdkv.mapping import BufferKind
from pdkv.protocol.messages import IntArray, StateIndices


class ChunkCursor:
    """Counts the pages of one request as SGLang sends them, chunk by chunk.

    ``num_pages`` are the pages SGLang sends (after the decode's cached prefix, when it has one);
    ``first`` is the request position of the first of them (the prefix's length in pages).
    ``advance(n)`` returns the chunk's first position (``first`` + pages already sent) and whether this
    chunk brings the pages sent to the count announced at ``init``: SGLang does not say which chunk is
    last, the sender decides. More pages than announced, or pages after the last chunk, would write past
    what the decode allocated: a ``MappingError`` naming both counts.
    """

    def __init__(self, room: int, num_pages: int, first: int = 0) -> None:
        for name, value in (("page count", num_pages), ("first position", first)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise MappingError(f"room {room}: {name} must be an int >= 0, got {value!r}")
        self.room = room
        self.num_pages = num_pages
        self.first = first
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
        start = self.first + self.sent
        self.sent += pages
        self.finished = self.sent == self.num_pages
        return start, self.finished


def prefix_pages_of(room: int, prefix_tokens: object, page_size: int) -> int:
    """SGLang's ``decode_prefix_len`` (tokens the decode already holds) in whole pages.

    SGLang's decode radix cache matches whole pages, and its prefill sends from that token on; a prefix
    ending inside a page would leave that page half written: a ``MappingError`` naming both numbers.
    """
    if prefix_tokens is None:
        return 0
    if isinstance(prefix_tokens, bool) or not isinstance(prefix_tokens, int | np.integer):
        raise MappingError(f"room {room}: decode prefix must be an int >= 0 tokens, got {prefix_tokens!r}")
    tokens = int(prefix_tokens)
    if tokens < 0:
        raise MappingError(f"room {room}: decode prefix must be an int >= 0 tokens, got {tokens}")
    if tokens % page_size:
        raise MappingError(
            f"room {room}: decode prefix of {tokens} tokens is not a whole number of {page_size}-token pages"
        )
    return tokens // page_size


def destinations_with_prefix(prefix_pages: int, pages_after: object) -> IntArray:
    """One destination page per position of the request, for pdkv, from SGLang's decode arguments.

    SGLang's decode names only the pages after its cached prefix (``pages_after``); pdkv's request covers
    every position and never writes the first ``prefix_pages`` of them. Those positions get placeholder
    ids: the smallest page ids not among ``pages_after`` (SGLang's padding page 0 first), so the list
    stays free of repeats and inside any pool that can hold the request. No prefill rank writes them.
    """
    after = np.asarray(pages_after, dtype=np.int64).reshape(-1)
    if prefix_pages == 0:
        return after
    candidates = np.arange(prefix_pages + after.size, dtype=np.int64)
    placeholders = np.setdiff1d(candidates, after, assume_unique=False)[:prefix_pages]
    return np.concatenate([placeholders, after]).astype(np.int64, copy=False)


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
