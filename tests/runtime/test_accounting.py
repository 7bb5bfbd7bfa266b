"""The transport's accounting of written bytes: bounded by the rooms in flight, late writes settled."""

from __future__ import annotations

from pdkv.metrics import KVTransferMetric, TransportMetrics
from pdkv.protocol.effects import FailureCause, RoomFinished
from pdkv.protocol.ids import RoomId
from pdkv.protocol.poll import KVPoll
from pdkv.runtime._accounting import Accounting


def _metric(room: int, pages: int) -> KVTransferMetric:
    return KVTransferMetric(room=RoomId(room), pages=pages, bytes=pages * 100, seconds=0.01)


def test_a_room_settles_on_finish_and_a_late_write_is_counted_at_once() -> None:
    metrics = TransportMetrics()
    accounting = Accounting(metrics)
    accounting.wrote(RoomId(1), "d:tp0", _metric(1, 2))
    accounting.wrote(RoomId(1), "d:tp1", _metric(1, 3))
    assert accounting.pending_rooms() == 1
    assert metrics.snapshot().counters.bytes_sent == 0  # counted when the room settles
    accounting.effects([RoomFinished(room=RoomId(1), poll=KVPoll.Failed, cause=FailureCause.ABORTED_HERE)])
    assert accounting.pending_rooms() == 0
    assert metrics.snapshot().counters.bytes_sent == 500
    # A chunk whose room already finished: recorded now, nothing left pending for ever.
    accounting.wrote(RoomId(1), "d:tp0", _metric(1, 1), room_finished=True)
    assert accounting.pending_rooms() == 0
    assert metrics.snapshot().counters.bytes_sent == 600


def test_pending_entries_are_bounded_by_rooms_in_flight() -> None:
    accounting = Accounting(TransportMetrics())
    for room in range(1, 1001):
        accounting.wrote(RoomId(room), "d:tp0", _metric(room, 1))
        accounting.effects([RoomFinished(room=RoomId(room), poll=KVPoll.Success)])
    assert accounting.pending_rooms() == 0
