"""ChunkCursor, state_indices_for and describe_failure: the per-request translations (no SGLang needed)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from pdkv.adapters.sglang.translate import (
    ChunkCursor,
    describe_failure,
    destinations_with_prefix,
    prefix_pages_of,
    state_indices_for,
)
from pdkv.errors import MappingError
from pdkv.mapping import BufferKind


def test_cursor_gives_positions_and_marks_the_chunk_that_completes_the_count() -> None:
    cursor = ChunkCursor(room=7, num_pages=16)
    assert cursor.advance(5) == (0, False)
    assert cursor.advance(0) == (5, False)  # an empty middle chunk moves nothing
    assert cursor.advance(11) == (5, True)
    assert cursor.finished and cursor.sent == 16


def test_single_chunk_room_is_last_at_once() -> None:
    assert ChunkCursor(room=1, num_pages=1).advance(1) == (0, True)


def test_more_pages_than_announced_is_refused_with_both_counts() -> None:
    cursor = ChunkCursor(room=9, num_pages=4)
    cursor.advance(3)
    with pytest.raises(MappingError, match=r"room 9: chunk of 2 pages at position 3 passes the 4 pages"):
        cursor.advance(2)
    assert cursor.sent == 3  # a refused chunk is not counted


def test_pages_after_the_last_chunk_are_refused() -> None:
    cursor = ChunkCursor(room=3, num_pages=2)
    cursor.advance(2)
    with pytest.raises(MappingError, match="after the last chunk"):
        cursor.advance(1)


def test_cursor_after_a_decode_prefix_starts_there_and_counts_only_the_pages_sent() -> None:
    cursor = ChunkCursor(room=5, num_pages=6, first=3)  # decode holds positions 0..2
    assert cursor.advance(2) == (3, False)
    assert cursor.advance(4) == (5, True)
    assert cursor.sent == 6
    with pytest.raises(MappingError, match="after the last chunk"):
        cursor.advance(1)


def test_prefix_tokens_become_whole_pages() -> None:
    assert prefix_pages_of(1, None, 64) == 0
    assert prefix_pages_of(1, 0, 64) == 0
    assert prefix_pages_of(1, 192, 64) == 3
    assert prefix_pages_of(1, np.int64(128), 64) == 2
    with pytest.raises(MappingError, match="room 4: decode prefix of 100 tokens is not a whole number of 64"):
        prefix_pages_of(4, 100, 64)
    with pytest.raises(MappingError, match="int >= 0"):
        prefix_pages_of(4, -64, 64)


def test_prefix_positions_get_distinct_placeholders_outside_the_real_destinations() -> None:
    after = np.array([0, 7, 2, 9], dtype=np.int32)  # SGLang's pages after the prefix
    full = destinations_with_prefix(3, after)
    assert full.tolist() == [1, 3, 4, 0, 7, 2, 9]  # placeholders: smallest ids not among `after`
    assert full.dtype == np.int64
    assert destinations_with_prefix(0, after).tolist() == [0, 7, 2, 9]
    # however dense the real pages, the placeholders never repeat nor exceed prefix + pages - 1
    dense = np.arange(5)
    assert destinations_with_prefix(2, dense).tolist() == [5, 6, 0, 1, 2, 3, 4]
    assert destinations_with_prefix(2, []).tolist() == [0, 1]


@pytest.mark.parametrize("bad", [-1, True, 2.0])
def test_page_count_must_be_a_non_negative_int(bad: object) -> None:
    with pytest.raises(MappingError):
        ChunkCursor(room=1, num_pages=bad)  # type: ignore[arg-type]


def test_state_lists_follow_the_state_types_and_skip_none() -> None:
    kinds = [BufferKind.INDEX_K, BufferKind.SWA]
    out = state_indices_for(kinds, [np.array([3, 4, 5], dtype=np.int32), None])
    assert out is not None and len(out) == 1
    assert out[0].kind is BufferKind.INDEX_K
    assert out[0].indices.tolist() == [3, 4, 5]
    both = state_indices_for(kinds, [[1], [[2, 3]]])
    assert both is not None and [s.indices.tolist() for s in both] == [[1], [2, 3]]
    assert state_indices_for(kinds, None) is None
    assert state_indices_for(kinds, []) is None


def test_state_lists_must_match_the_state_types() -> None:
    with pytest.raises(MappingError, match="1 state index lists for 2 state types"):
        state_indices_for([BufferKind.INDEX_K, BufferKind.SWA], [[1]])


def test_failures_read_as_one_line() -> None:
    assert describe_failure("timed out") == "timed out"
    assert describe_failure(None) == "failed (pdkv gave no reason)"
    typed = SimpleNamespace(
        cause=SimpleNamespace(value="aborted_by_peer"), reason="client left", peer="d0:tp0"
    )
    assert describe_failure(typed) == "aborted_by_peer: client left (peer d0:tp0)"
    assert describe_failure(SimpleNamespace(cause=None, reason=None, peer=None)) == "failed"
