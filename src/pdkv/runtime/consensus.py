"""Rank consensus: MIN-reduce the KVPoll of every room across a torch.distributed (gloo) group.

Owns: the collective. All rooms of one tick travel in one int32 tensor (one collective per tick,
never one per room: a gloo all-reduce costs ~0.3 ms here). Every rank must pass the same rooms in
the same order; the lengths are agreed first, so a mismatch is a clear error on every rank instead
of a hang or a silently misaligned reduction.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from pdkv.errors.runtime import ConsensusError as ConsensusError
from pdkv.protocol.poll import KVPoll


def all_reduce_polls(
    polls: Sequence[KVPoll], group: dist.ProcessGroup | None = None, *, check_lengths: bool = True
) -> list[KVPoll]:
    """Element-wise MIN of ``polls`` over every rank of ``group`` (the default group if None)."""
    if check_lengths:
        n = len(polls)
        lengths = torch.tensor([n, -n], dtype=torch.int64)
        dist.all_reduce(lengths, op=dist.ReduceOp.MIN, group=group)
        lo, hi = int(lengths[0]), -int(lengths[1])
        if lo != hi:
            raise ConsensusError(
                f"ranks polled different numbers of rooms: between {lo} and {hi} (this rank {n})"
            )
    if not polls:
        return []
    values = torch.tensor([int(p) for p in polls], dtype=torch.int32)
    dist.all_reduce(values, op=dist.ReduceOp.MIN, group=group)
    return [KVPoll(v) for v in values.tolist()]
