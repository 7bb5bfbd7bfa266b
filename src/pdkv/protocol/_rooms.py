"""What both sans-IO endpoints keep the same way: their rooms by id with one deadline each, the
heartbeat schedule, and the scheduler's view of a failed room.

Owns: ``RoomKeeper`` (the base of ``PrefillEndpoint`` and ``DecodeEndpoint``: ``has_room``,
``rooms``, room deadlines in a lazy ``DeadlineQueue``, ``Failure`` of a room record),
``Heartbeats`` (when the next round is due, its sequence number) and ``Counts`` (an endpoint's
counters, named by the fields of its statistics class: declared once, there). Must not decide anything about a
room: the endpoints do; this only keeps records and times.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import attrs

from pdkv.errors import LocalProtocolError
from pdkv.protocol._deadlines import DeadlineQueue
from pdkv.protocol.effects import Failure, FailureCause, PeerKey
from pdkv.protocol.ids import RoomId
from pdkv.protocol.messages import Origin


class RoomRecord(Protocol):
    """The fields every endpoint's room record has."""

    room: RoomId
    deadline: float | None
    failure: str | None
    cause: FailureCause | None
    failure_peer: PeerKey | None


R = TypeVar("R", bound=RoomRecord)


def peer_text(key: PeerKey | None) -> str | None:
    """``instance:rank`` of a peer (as ``Failure.peer`` names it)."""
    return None if key is None else f"{key[0]}:{key[1]}"


class RoomKeeper(Generic[R]):
    """Rooms by id, each with at most one deadline; a subclass sets ``side`` and calls ``_keep_rooms``."""

    side: ClassVar[str]
    origin: Origin

    def _keep_rooms(self) -> None:
        self._rooms: dict[RoomId, R] = {}
        self._deadlines: DeadlineQueue[RoomId] = DeadlineQueue()

    def rooms(self) -> list[RoomId]:
        return list(self._rooms)

    def has_room(self, room: RoomId) -> bool:
        """Does this rank hold ``room`` (opened or requested, not yet closed)? O(1), unlike ``rooms()``."""
        return room in self._rooms

    def _room(self, room: RoomId) -> R:
        r = self._rooms.get(room)
        if r is None:
            raise LocalProtocolError(f"unknown room {room} on {self.side} {self.origin}")
        return r

    def _set_deadline(self, r: R, deadline: float) -> None:
        r.deadline = deadline
        self._deadlines.push(r.room, deadline)

    def _room_deadline(self, room: RoomId) -> float | None:
        """The room's live deadline (None: none, or the room is gone)."""
        r = self._rooms.get(room)
        return None if r is None else self._deadline_of(r)

    def _deadline_of(self, r: R) -> float | None:
        return r.deadline

    def _due_rooms(self, now: float) -> list[RoomId]:
        """Rooms whose deadline passed, each once, in deadline order."""
        return self._deadlines.pop_due(now, self._room_deadline)

    def _next_room_deadline(self) -> float | None:
        return self._deadlines.next_deadline(self._room_deadline)

    @staticmethod
    def _failure_of(r: R) -> Failure | None:
        """The room's failure as the scheduler reads it (None unless it failed)."""
        if r.failure is None or r.cause is None:
            return None
        return Failure(cause=r.cause, reason=r.failure, peer=peer_text(r.failure_peer))


class Heartbeats:
    """When an endpoint's next heartbeat round is due (None: no peer to greet) and its number."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.due: float | None = None
        self.seq = 0

    def arm(self, now: float) -> None:
        """A peer to greet: the next round is due one interval from now, unless one is due already."""
        if self.due is None:
            self.due = now + self.interval

    def is_due(self, now: float) -> bool:
        return self.due is not None and self.due <= now

    def next_seq(self) -> int:
        """A round starts: its sequence number."""
        self.seq += 1
        return self.seq

    def reschedule(self, now: float, *, again: bool) -> None:
        """A round ended: the next is due one interval later, if there is anyone to greet (``again``)."""
        self.due = now + self.interval if again else None

    def stop(self) -> None:
        self.due = None


class Counts:
    """An endpoint's counters: every field of its frozen statistics class that is not a level (a
    figure computed when asked, such as the rooms open now), each an int from 0. A name that is no
    field is a ``KeyError`` at once: the statistics class is the one declaration."""

    def __init__(self, statistics: type[Any], *, levels: Collection[str] = ()) -> None:
        self._values = {f.name: 0 for f in attrs.fields(statistics) if f.name not in levels}

    def add(self, name: str, by: int = 1) -> None:
        self._values[name] += by

    def __getitem__(self, name: str) -> int:
        return self._values[name]

    def values(self) -> dict[str, int]:
        return dict(self._values)


__all__ = ["Counts", "Heartbeats", "RoomKeeper", "RoomRecord", "peer_text"]
