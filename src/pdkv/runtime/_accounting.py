"""Counting what the endpoints did into a transport's ``TransportMetrics`` (one place for both sides).

Owns: the mapping from protocol effects and inputs to metric counters, and the per-(room, peer)
accumulation of what was actually written. Called with the transport's lock held. What it holds is
bounded by the rooms in flight: a room's entries go when it finishes (a lookup by room, never a
scan), and a write that lands after its room finished is recorded at once, never left behind.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import assert_never

from pdkv.metrics import KVTransferMetric, TransportCounter, TransportMetrics
from pdkv.protocol.effects import (
    CutConnections,
    DropLayers,
    Effect,
    FailureCause,
    ForgetPeer,
    LeaseLanding,
    Notice,
    ReleaseKind,
    ReleasePages,
    RoomFinished,
    ScatterLanding,
    Send,
    SubmitChunk,
    SubmitFence,
    VerifyChecksums,
)
from pdkv.protocol.ids import RoomId
from pdkv.protocol.messages import Abort, AbortAck, Message, TransferMetricData, TransferStatus
from pdkv.protocol.poll import KVPoll

_ABORTED = (FailureCause.ABORTED_HERE, FailureCause.ABORTED_BY_PEER)
_RELEASE_COUNTER = {
    ReleaseKind.ACKED: TransportCounter.RELEASES_ACKED,
    ReleaseKind.CUT: TransportCounter.RELEASES_CUT,
    ReleaseKind.SETTLED: TransportCounter.RELEASES_SETTLED,
    ReleaseKind.UNSAFE: TransportCounter.UNSAFE_RELEASES,
}


class Accounting:
    """Feeds a ``TransportMetrics`` from effects, received messages and per-chunk results."""

    def __init__(self, metrics: TransportMetrics) -> None:
        self.metrics = metrics
        self._rooms: dict[RoomId, dict[str, KVTransferMetric]] = {}
        self._channel_seen: dict[TransportCounter, int] = {}

    def effects(self, effects: Sequence[Effect]) -> None:
        count = self.metrics.increment
        aborted_here: set[RoomId] = set()  # a room fails before its statuses go out (one batch)
        for e in effects:
            match e:
                case Send(message=Abort()):
                    count(TransportCounter.ABORTS_SENT)
                case Send(message=AbortAck()):
                    count(TransportCounter.ABORT_ACKS)
                case Send(message=TransferStatus(room=room)) if room in aborted_here:
                    count(TransportCounter.ABORTS_SENT)  # how a prefill tells a decode rank of its abort
                case RoomFinished():
                    if e.cause is FailureCause.ABORTED_HERE:
                        aborted_here.add(e.room)
                    if e.poll is KVPoll.Success:
                        count(TransportCounter.ROOMS_SUCCEEDED)
                    else:
                        count(TransportCounter.ROOMS_FAILED)
                        if e.cause in _ABORTED:
                            count(TransportCounter.ROOMS_ABORTED)
                        elif e.cause is FailureCause.TIMEOUT:
                            count(TransportCounter.TIMEOUTS)
                        elif e.cause is FailureCause.CHECKSUM:
                            count(TransportCounter.CHECKSUM_FAILURES)
                    self._settle(e.room, completed=e.poll is KVPoll.Success)
                case ReleasePages():
                    counter = _RELEASE_COUNTER.get(e.kind)
                    if counter is not None:
                        count(counter)
                case (
                    Send()
                    | SubmitChunk()
                    | Notice()
                    | ForgetPeer()
                    | DropLayers()
                    | SubmitFence()
                    | CutConnections()
                    | VerifyChecksums()
                    | LeaseLanding()
                    | ScatterLanding()
                ):
                    pass  # counted where they are carried out, or not at all
                case _:
                    assert_never(e)

    def received(self, message: Message) -> None:
        match message:
            case Abort():
                self.metrics.increment(TransportCounter.ABORTS_RECEIVED)
            case AbortAck():
                self.metrics.increment(TransportCounter.ABORT_ACKS)
            case _:
                pass  # the other messages are counted by the channel

    def wrote(
        self, room: RoomId, peer: str, metric: KVTransferMetric, *, room_finished: bool = False
    ) -> None:
        """One chunk's bytes to ``peer`` landed; folded into the room's total for that peer, or
        recorded at once (as not completed) when the room already finished without it."""
        self.metrics.increment(TransportCounter.CHUNKS_SENT)
        if room_finished:
            self.metrics.record_room(metric, peer, completed=False)
            return
        peers = self._rooms.setdefault(room, {})
        previous = peers.get(peer)
        peers[peer] = metric if previous is None else previous.combined_with(metric)

    def pending_rooms(self) -> int:
        """Rooms with writes counted and not yet settled (bounded by the rooms in flight)."""
        return len(self._rooms)

    def reported(self, room: RoomId, peer: str, data: TransferMetricData) -> None:
        """Decode side: a prefill rank's Success status says what it wrote for the room."""
        metric = KVTransferMetric(room=room, pages=data.pages, bytes=data.bytes, seconds=data.seconds)
        self.metrics.record_room(metric, peer, received=True)

    def _settle(self, room: RoomId, *, completed: bool) -> None:
        for peer, metric in self._rooms.pop(room, {}).items():
            self.metrics.record_room(metric, peer, completed=completed)

    def channel(self, *, malformed: int, unauthenticated: int) -> None:
        """Bring the channel's cumulative counts into the metrics (adds only the new part)."""
        for counter, total in (
            (TransportCounter.MALFORMED_MESSAGES, malformed),
            (TransportCounter.UNAUTHENTICATED_MESSAGES, unauthenticated),
        ):
            new = total - self._channel_seen.get(counter, 0)
            if new > 0:
                self.metrics.increment(counter, new)
                self._channel_seen[counter] = total
