"""What the parent and the rank processes say to each other over their pipes: typed records, never tuples.

Parent -> rank: ``RunRooms`` (rooms for this rank's side, in arrival order), ``Stop``. Rank -> parent:
``RankReady`` (with its control address), ``RoomResults`` (the rooms that ended on this rank in one
pass of its scheduler loop), ``RankFinal`` (its report at shutdown), ``RankCrashed`` (the traceback of
what killed it). The registry process answers ``RankReady`` too and stops at any message. Must not
import transports (pickled across processes).

Rooms and results travel in batches, one pipe message per scheduler pass and not per room: with many
rooms in flight the per-message cost (pickling, a pipe write, a wake-up on both sides) was a sizeable
share of the CPU the control bench measures, and it is the harness's, not pdkv's.
"""

from __future__ import annotations

from typing import TypeAlias

import attrs

from pdkv.testing.cluster.spec import RankReport, RoomOutcome, _DecodeRoom, _PrefillRoom


@attrs.frozen(kw_only=True)
class RunRooms:
    rooms: tuple[_PrefillRoom | _DecodeRoom, ...]


@attrs.frozen
class Stop:
    pass


@attrs.frozen(kw_only=True)
class RankReady:
    name: str
    address: str


@attrs.frozen(kw_only=True)
class RoomResults:
    outcomes: tuple[RoomOutcome, ...]


@attrs.frozen(kw_only=True)
class RankFinal:
    report: RankReport


@attrs.frozen(kw_only=True)
class RankCrashed:
    traceback: str


ToRank: TypeAlias = RunRooms | Stop
FromRank: TypeAlias = RankReady | RoomResults | RankFinal | RankCrashed
