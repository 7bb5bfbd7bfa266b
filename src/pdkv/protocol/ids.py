"""Identifier types of the protocol (NewType over int/str, free at run time, distinct for mypy).

Owns: the id types and their range checks. Must not do I/O.
"""

from __future__ import annotations

from typing import Final, NewType

RoomId = NewType("RoomId", int)
"""One request's transfer, chosen by the router, 63-bit unsigned (0 is reserved: never a real room)."""

InstanceId = NewType("InstanceId", str)
"""One prefill or decode server (all its ranks share it)."""

Epoch = NewType("Epoch", int)
"""Incarnation of an instance: a process restart behind the same address gets a new epoch."""

RankIndex = NewType("RankIndex", int)
"""Flat index of a rank inside its instance (see ``RankCoord.index``)."""

Endpoint = NewType("Endpoint", str)
"""A control endpoint address, e.g. ``tcp://127.0.0.1:5555``."""

SessionId = NewType("SessionId", str)
"""The transfer-engine session a peer must address (Mooncake: ``host:rpc_port``)."""

MAX_ROOM_ID: Final = 2**63 - 1
MAX_EPOCH: Final = 2**63 - 1


def room_id(value: int) -> RoomId:
    """Checked constructor: rooms are 1 .. 2**63-1."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_ROOM_ID:
        raise ValueError(f"room id must be an int in 1..2**63-1, got {value!r}")
    return RoomId(value)
