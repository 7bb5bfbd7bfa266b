"""Batch shaping: cut a block list into batches a transfer engine accepts and moves fast.

Owns: ``shape_batches``. Pure: no I/O, no clock, no engine calls. Must not merge blocks (two blocks
that happen to be adjacent may still belong to different registrations on the peer) and must not
reorder them (the executor relies on order, e.g. KV before state before aux).

Why shape at all: an engine can reject a batch with more entries than its per-peer queue (Mooncake
TCP: about 2,048, "queue-full"), and throughput depends on block size (on TCP here 256 KiB blocks ran
about twice as fast as 4 MiB ones), so long blocks are sliced and batches are bounded in entries and
bytes. The limits are the executor's measured choice; this module only enforces them exactly.
"""

from __future__ import annotations

import numpy as np

from pdkv.errors import ConfigError
from pdkv.mapping._arrays import IntArray, all_true, int_max
from pdkv.mapping.blocks import TransferBlocks


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) <= 0:
        raise ConfigError(f"shape_batches: {name} must be a positive int, got {value!r}")
    return int(value)


def slice_blocks(blocks: TransferBlocks, slice_bytes: int) -> TransferBlocks:
    """Split every block longer than ``slice_bytes`` into consecutive slices; drop empty blocks.

    Slice k of a block starts ``k * slice_bytes`` into it (source and destination advance
    together) and all slices but the last are exactly ``slice_bytes`` long. Order is kept: the
    slices of block i come before those of block i + 1.
    """
    slice_bytes = _positive_int(slice_bytes, "slice_bytes")
    # The common cases (no empty block, nothing to slice) return the input's arrays uncopied:
    # the block lists are large and a copy per call is most of this function's cost.
    non_empty = blocks.length > 0
    kept = blocks if all_true(non_empty) else blocks.take(np.flatnonzero(non_empty))
    if len(kept) == 0 or int_max(kept.length) <= slice_bytes:
        return kept
    src, dst, length, buffer = kept.src, kept.dst, kept.length, kept.buffer
    slices_per_block = (length + (slice_bytes - 1)) // slice_bytes
    owner = np.repeat(np.arange(length.size, dtype=np.int64), slices_per_block)
    first_slice = np.cumsum(slices_per_block) - slices_per_block
    offset = (np.arange(owner.size, dtype=np.int64) - first_slice[owner]) * slice_bytes
    return TransferBlocks(
        src=src[owner] + offset,
        dst=dst[owner] + offset,
        length=np.minimum(length[owner] - offset, slice_bytes),
        buffer=buffer[owner],
    )


def batch_bounds(lengths: IntArray, *, max_entries: int, max_batch_bytes: int) -> IntArray:
    """End index (exclusive) of each batch: greedy, each batch as long as both limits allow.

    Every entry must be <= ``max_batch_bytes`` (``shape_batches`` guarantees it by slicing).
    The loop runs once per batch (a binary search on the byte prefix sums each time), never per
    block: the number of batches is total bytes / max_batch_bytes or blocks / max_entries.
    """
    count = int(lengths.size)
    ends: list[int] = []
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    inclusive = np.cumsum(lengths)
    start = 0
    while start < count:
        bytes_before = int(inclusive[start] - lengths[start])
        end_by_bytes = int(np.searchsorted(inclusive, bytes_before + max_batch_bytes, side="right"))
        end = min(end_by_bytes, start + max_entries)
        ends.append(end)
        start = end
    return np.asarray(ends, dtype=np.int64)


def shape_batches(
    blocks: TransferBlocks, *, max_entries: int, slice_bytes: int, max_batch_bytes: int
) -> list[TransferBlocks]:
    """Cut ``blocks`` into engine batches.

    - A block longer than ``slice_bytes`` becomes ceil(length / slice_bytes) slices whose
      addresses advance by ``slice_bytes`` (see ``slice_blocks``); shorter blocks pass unchanged.
      Blocks are never merged, so an entry never spans two blocks or two buffers.
    - Zero-length blocks are dropped: they move nothing and some engines reject them.
    - Batches are filled greedily in order: each holds <= ``max_entries`` entries and
      <= ``max_batch_bytes`` bytes, and a new batch starts only when the next entry would break
      a limit. Concatenating the batches gives the sliced list back, so every byte is sent once,
      in the original order.

    ``slice_bytes <= max_batch_bytes`` is required (otherwise one slice could not fit any batch);
    a violation is a ``ConfigError``. An empty (or all-empty) input gives an empty list.
    """
    max_entries = _positive_int(max_entries, "max_entries")
    slice_bytes = _positive_int(slice_bytes, "slice_bytes")
    max_batch_bytes = _positive_int(max_batch_bytes, "max_batch_bytes")
    if slice_bytes > max_batch_bytes:
        raise ConfigError(
            f"shape_batches: slice_bytes {slice_bytes} exceeds max_batch_bytes {max_batch_bytes}: "
            "a full slice would fit no batch"
        )
    sliced = slice_blocks(blocks, slice_bytes)
    if 0 < len(sliced) <= max_entries and sliced.total_bytes <= max_batch_bytes:
        return [sliced]  # one batch (every small request): the bounds below would find just that
    ends = batch_bounds(sliced.length, max_entries=max_entries, max_batch_bytes=max_batch_bytes)
    starts = np.concatenate([np.zeros(1, dtype=np.int64), ends[:-1]]) if ends.size else ends
    return [sliced.take(slice(int(s), int(e))) for s, e in zip(starts, ends, strict=True)]
