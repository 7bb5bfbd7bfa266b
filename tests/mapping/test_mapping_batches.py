"""shape_batches: every byte once, in order, within both limits; slices advance; greedy cuts."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdkv.errors import ConfigError
from pdkv.mapping import TransferBlocks, shape_batches


def _bytes_in_order(parts: list[TransferBlocks]) -> list[tuple[int, int, int]]:
    """(src byte, dst byte, buffer) for every byte the parts move, in order (test reference loop)."""
    out: list[tuple[int, int, int]] = []
    for part in parts:
        for s, d, n, b in zip(part.src, part.dst, part.length, part.buffer, strict=True):
            out.extend((int(s) + k, int(d) + k, int(b)) for k in range(int(n)))
    return out


@st.composite
def blocks_and_limits(draw: st.DrawFn) -> tuple[TransferBlocks, int, int, int]:
    count = draw(st.integers(0, 25))
    lengths = draw(st.lists(st.integers(0, 60), min_size=count, max_size=count))
    src = draw(st.lists(st.integers(0, 10**9), min_size=count, max_size=count))
    dst = draw(st.lists(st.integers(0, 10**9), min_size=count, max_size=count))
    buffers = draw(st.lists(st.integers(0, 3), min_size=count, max_size=count))
    slice_bytes = draw(st.integers(1, 70))
    max_batch_bytes = draw(st.integers(slice_bytes, 200))
    max_entries = draw(st.integers(1, 12))
    blocks = TransferBlocks(src=src, dst=dst, length=lengths, buffer=buffers)
    return blocks, max_entries, slice_bytes, max_batch_bytes


@given(blocks_and_limits())
def test_every_byte_once_in_order_and_both_limits_hold(case: tuple[TransferBlocks, int, int, int]) -> None:
    blocks, max_entries, slice_bytes, max_batch_bytes = case
    batches = shape_batches(
        blocks, max_entries=max_entries, slice_bytes=slice_bytes, max_batch_bytes=max_batch_bytes
    )
    assert _bytes_in_order(batches) == _bytes_in_order([blocks])
    for batch in batches:
        assert 1 <= len(batch) <= max_entries
        assert batch.total_bytes <= max_batch_bytes
        assert int(batch.length.min()) >= 1
        assert int(batch.length.max()) <= slice_bytes
    # greedy: a batch is closed only because the next entry would break a limit
    for batch, following in itertools.pairwise(batches):
        next_entry = int(following.length[0])
        assert len(batch) == max_entries or batch.total_bytes + next_entry > max_batch_bytes


@given(blocks_and_limits())
def test_blocks_are_sliced_only_when_longer_than_slice_bytes(
    case: tuple[TransferBlocks, int, int, int],
) -> None:
    blocks, max_entries, slice_bytes, max_batch_bytes = case
    merged = TransferBlocks.concat(
        shape_batches(
            blocks, max_entries=max_entries, slice_bytes=slice_bytes, max_batch_bytes=max_batch_bytes
        )
    )
    non_empty = blocks.length[blocks.length > 0]
    expected_entries = int(sum(-(-int(n) // slice_bytes) for n in non_empty))
    assert len(merged) == expected_entries
    if int(non_empty.max(initial=0)) <= slice_bytes:
        assert merged == blocks.take(np.flatnonzero(blocks.length > 0))


def test_hand_example_slices_advance_and_empty_blocks_drop() -> None:
    blocks = TransferBlocks(src=[0, 1000, 5000], dst=[100, 2000, 9000], length=[10, 0, 25], buffer=[0, 0, 1])
    batches = shape_batches(blocks, max_entries=2, slice_bytes=8, max_batch_bytes=16)
    assert batches == [
        TransferBlocks(src=[0, 8], dst=[100, 108], length=[8, 2], buffer=[0, 0]),
        TransferBlocks(src=[5000, 5008], dst=[9000, 9008], length=[8, 8], buffer=[1, 1]),
        TransferBlocks(src=[5016, 5024], dst=[9016, 9024], length=[8, 1], buffer=[1, 1]),
    ]


def test_byte_limit_cuts_before_entry_limit() -> None:
    blocks = TransferBlocks(
        src=[0, 10, 20, 30], dst=[0, 10, 20, 30], length=[6, 6, 6, 6], buffer=[0, 0, 0, 0]
    )
    batches = shape_batches(blocks, max_entries=100, slice_bytes=6, max_batch_bytes=13)
    assert [len(b) for b in batches] == [2, 2]
    assert [b.total_bytes for b in batches] == [12, 12]


def test_empty_input_gives_no_batches() -> None:
    assert shape_batches(TransferBlocks.empty(), max_entries=4, slice_bytes=4, max_batch_bytes=4) == []
    only_empty = TransferBlocks(src=[1, 2], dst=[3, 4], length=[0, 0], buffer=[0, 1])
    assert shape_batches(only_empty, max_entries=4, slice_bytes=4, max_batch_bytes=4) == []


@pytest.mark.parametrize(
    ("max_entries", "slice_bytes", "max_batch_bytes"),
    [(0, 4, 4), (4, 0, 4), (4, 4, 0), (4, 8, 4), (True, 4, 4), (4, 2.5, 4)],
)
def test_invalid_limits_are_config_errors(
    max_entries: object, slice_bytes: object, max_batch_bytes: object
) -> None:
    blocks = TransferBlocks(src=[0], dst=[0], length=[4], buffer=[0])
    with pytest.raises(ConfigError):
        shape_batches(
            blocks,
            max_entries=max_entries,  # type: ignore[arg-type]  # invalid values on purpose
            slice_bytes=slice_bytes,  # type: ignore[arg-type]  # invalid values on purpose
            max_batch_bytes=max_batch_bytes,  # type: ignore[arg-type]  # invalid values on purpose
        )


def test_a_list_that_fits_one_batch_is_one_batch_up_to_each_limit() -> None:
    four = TransferBlocks(src=[0, 10, 20, 30], dst=[5, 15, 25, 35], length=[3, 3, 3, 3], buffer=[0, 0, 1, 1])
    assert shape_batches(four, max_entries=4, slice_bytes=3, max_batch_bytes=12) == [four]
    assert [len(b) for b in shape_batches(four, max_entries=3, slice_bytes=3, max_batch_bytes=12)] == [3, 1]
    assert [len(b) for b in shape_batches(four, max_entries=4, slice_bytes=3, max_batch_bytes=11)] == [3, 1]
    with_empty = TransferBlocks(src=[0, 9, 10], dst=[5, 9, 15], length=[3, 0, 3], buffer=[0, 0, 0])
    only = shape_batches(with_empty, max_entries=2, slice_bytes=3, max_batch_bytes=6)
    assert only == [TransferBlocks(src=[0, 10], dst=[5, 15], length=[3, 3], buffer=[0, 0])]
