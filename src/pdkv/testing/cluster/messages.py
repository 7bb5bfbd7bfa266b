"""What the parent and the rank processes say to each other over their pipes: typed records, never tuples.

Parent -> rank: ``RunRoom`` (a room for this rank's side), ``Stop``. Rank -> parent: ``RankReady`` (with
its control address), ``RoomResult`` (one room ended on this rank), ``RankFinal`` (its report at
shutdown), ``RankCrashed`` (the traceback of what killed it). The registry process answers
``RankReady`` too and stops at any message. Must not import transports (pickled across processes).
"""

from __future__ import annotations

from typing import TypeAlias

import attrs

from pdkv.testing.cluster.spec import RankReport, RoomOutcome, _DecodeRoom, _PrefillRoom


@attrs.frozen(kw_only=True)
class RunRoom:
    room: _PrefillRoom | _DecodeRoom


@attrs.frozen
class Stop:
    pass


@attrs.frozen(kw_only=True)
class RankReady:
    name: str
    address: str


@attrs.frozen(kw_only=True)
class RoomResult:
    outcome: RoomOutcome


@attrs.frozen(kw_only=True)
class RankFinal:
    report: RankReport


@attrs.frozen(kw_only=True)
class RankCrashed:
    traceback: str


ToRank: TypeAlias = RunRoom | Stop
FromRank: TypeAlias = RankReady | RoomResult | RankFinal | RankCrashed
