"""``KVPoll``: what a sender or receiver reports to the scheduler, and the rank consensus over it.

Owns: the IntEnum (SGLang's values, so a MIN all-reduce is the consensus: one Failed rank fails the
room on every rank, and a room advances only when its least advanced rank has) and the single-process
reduction. The torch.distributed reduction lives in ``pdkv.runtime.consensus`` (it does I/O).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence


class KVPoll(enum.IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


def consensus(polls: Iterable[KVPoll]) -> KVPoll:
    """MIN over the ranks' polls of one room. No ranks at all is a caller bug."""
    values = list(polls)
    if not values:
        raise ValueError("consensus over no polls")
    return KVPoll(min(values))


def consensus_columns(per_rank: Sequence[Sequence[KVPoll]]) -> list[KVPoll]:
    """Element-wise MIN over several ranks' poll lists (all rooms of a tick at once).

    Every rank must list the same rooms in the same order: a length difference is an error,
    never silently truncated.
    """
    if not per_rank:
        raise ValueError("consensus over no ranks")
    width = len(per_rank[0])
    for i, row in enumerate(per_rank):
        if len(row) != width:
            raise ValueError(f"rank {i} polled {len(row)} rooms, rank 0 polled {width}")
    return [KVPoll(min(column)) for column in zip(*per_rank, strict=True)]
