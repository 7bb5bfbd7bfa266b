"""The simulation sees the seams (seams issue): bytes that outlive a fence or a process in kernel
sockets, a cut that proves nothing, and effects applied around a dropped socket. Each planted
defect below made ``EndpointPair`` report nothing before; now each one fails a check."""

from __future__ import annotations

from typing import Any

import pytest

from pdkv.protocol.config import Timeouts
from pdkv.protocol.decode import DecodeEndpoint
from pdkv.protocol.effects import DecodeEffect, ForgetPeer, ReleaseKind, Target
from pdkv.protocol.ids import RoomId
from pdkv.protocol.messages import AbortAck, Message
from pdkv.protocol.poll import KVPoll
from pdkv.testing.endpoint_pair import EndpointPair, RoomPlan

ROOMS = range(1, 9)
FAST = Timeouts(
    bootstrap=5, waiting=5, inflight=5, transfer=5, abort_ack=2, quarantine=30, quarantine_settle=20
)


def _failing_pair(**kw: object) -> EndpointPair:
    """Odd rooms' first chunk write fails on the engine; their bytes land 5 s later unless ended."""
    pair = EndpointPair(
        transfer_time=0.05,
        timeouts=FAST,
        fail_write=lambda room, chunk, rank: room % 2 == 1 and chunk == 0,
        late_write_s=5.0,
        **kw,  # type: ignore[arg-type]  # the pair's keyword options under test
    )
    pair.connect()
    pair.run(until=0.1)
    for room in ROOMS:
        pair.add_room(RoomPlan(room=RoomId(room), num_pages=4, chunk_pages=(2, 2)))
    return pair


def _run_past_the_late_writes(pair: EndpointPair) -> None:
    pair.settle()
    pair.run(until=pair.clock.now + 30.0)


def test_a_fence_drains_the_engine_but_not_the_connection_so_the_pages_settle() -> None:
    pair = _failing_pair(cuts_connections=True)
    _run_past_the_late_writes(pair)
    # The failed writes' bytes left the engine at the fence and landed from their connections while
    # the pages settled (5 s < 20 s): no violation, none cut (a cut would fail other rooms' writes).
    assert pair.violations == [] and pair.late_writes_landed == 4 and pair.cuts_made == 0
    assert {pair.decode.release_kind(RoomId(r)) for r in ROOMS if r % 2} == {ReleaseKind.SETTLED}
    assert pair.decode.statistics().releases_settled == 4


def _quarantined_failure(**kw: object) -> EndpointPair:
    """Room 1's write fails while prefill 0 is partitioned from the decode: the status and the
    decode's Abort are lost, the room is quarantined, and after the heal its fenced ack comes."""
    pair = EndpointPair(
        transfer_time=0.05,
        timeouts=FAST,
        fail_write=lambda room, chunk, rank: True,
        late_write_s=60.0,
        **kw,  # type: ignore[arg-type]  # the pair's keyword options under test
    )
    pair.connect()
    pair.run(until=0.1)
    pair.add_room(RoomPlan(room=RoomId(1), num_pages=4, chunk_pages=(4,)))
    pair.run(until=1.0, stop=lambda: pair.writes_started > 0)
    pair.partition(0, until=pair.clock.now + 10.0)
    pair.settle()
    pair.run(until=pair.clock.now + 70.0)
    return pair


def test_a_quarantined_room_with_a_failed_write_is_cut_and_the_cut_ends_the_stuck_bytes() -> None:
    pair = _quarantined_failure(cuts_connections=True)
    assert pair.decode.statistics().quarantines == 1
    assert pair.decode.release_kind(RoomId(1)) is ReleaseKind.CUT
    assert pair.violations == [] and pair.late_writes_landed == 0 and pair.cuts_made == 1


def test_without_a_cut_the_pages_settle_and_the_settle_time_is_a_bound_not_a_proof() -> None:
    pair = _failing_pair()  # a decode that cannot cut: settled after quarantine_settle (20 s > 5 s)
    _run_past_the_late_writes(pair)
    assert pair.violations == [] and pair.late_writes_landed == 4
    assert {pair.decode.release_kind(RoomId(r)) for r in ROOMS if r % 2} == {ReleaseKind.SETTLED}
    short = EndpointPair(
        transfer_time=0.05,
        timeouts=FAST,
        fail_write=lambda room, chunk, rank: chunk == 0,
        late_write_s=25.0,  # bytes that take longer than the settle time to land
    )
    short.connect()
    short.add_room(RoomPlan(room=RoomId(1), num_pages=4, chunk_pages=(2, 2)))
    _run_past_the_late_writes(short)
    assert [v.what for v in short.violations] == ["a failed write of prefill 0 landed after release"]


def test_planted_a_cut_that_counts_the_sockets_leaving_the_table_as_proof() -> None:
    """Item 4: the cut returned once the destroyed sockets left the kernel's table, while their queued
    bytes were still read into memory."""
    pair = _quarantined_failure(cuts_connections=True, cut_leaves_queued_bytes=True)
    assert pair.decode.release_kind(RoomId(1)) is ReleaseKind.CUT
    assert [v.what for v in pair.violations] == ["a failed write of prefill 0 landed after release"]


def test_planted_a_fenced_ack_taken_as_proof(monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 7: an AbortAck after a fence released the pages at once, with bytes still in a connection."""
    receive = DecodeEndpoint.receive

    def forget_the_fence(self: DecodeEndpoint, message: Message, now: float) -> list[DecodeEffect]:
        if isinstance(message, AbortAck):
            message = AbortAck(origin=message.origin, room=message.room)
        return receive(self, message, now)

    monkeypatch.setattr(DecodeEndpoint, "receive", forget_the_fence)
    pair = _failing_pair(cuts_connections=True)
    _run_past_the_late_writes(pair)
    assert {v.room for v in pair.violations} == {RoomId(r) for r in ROOMS if r % 2}


def test_a_restarted_prefill_leaves_its_in_flight_bytes_in_sockets_so_the_pages_settle() -> None:
    """A prefill process that dies mid-write does not take the bytes it handed to the kernel with it.
    Its new incarnation acknowledges the aborted room (it knows nothing of it), which proves nothing
    about the old process's sockets: the pages settle (they used to come back at that ack)."""
    pair = EndpointPair(transfer_time=0.5, timeouts=FAST, late_write_s=5.0, cuts_connections=True)
    pair.connect()
    pair.run(until=0.1)
    pair.add_room(RoomPlan(room=RoomId(1), num_pages=4, chunk_pages=(4,)))
    pair.run(until=0.3, stop=lambda: pair.writes_started > 0)
    assert pair.writes_started == 1
    pair.restart_prefill(0)
    _run_past_the_late_writes(pair)
    assert pair.decode.poll(RoomId(1)) is KVPoll.Failed
    assert pair.decode.release_kind(RoomId(1)) is ReleaseKind.SETTLED
    assert pair.violations == [] and pair.late_writes_landed == 1


def test_planted_a_new_incarnations_ack_taken_as_proof(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same story with the restart forgotten: the ack releases at once, the old bytes land after."""
    restarted = DecodeEndpoint._replace

    def forget_the_old_writes(self: DecodeEndpoint, *args: Any, **kw: Any) -> None:
        restarted(self, *args, **kw)
        for room in self.room_records():
            if room.abort is not None:
                room.abort.unproven.clear()

    monkeypatch.setattr(DecodeEndpoint, "_replace", forget_the_old_writes)
    pair = EndpointPair(transfer_time=0.5, timeouts=FAST, late_write_s=5.0, cuts_connections=True)
    pair.connect()
    pair.run(until=0.1)
    pair.add_room(RoomPlan(room=RoomId(1), num_pages=4, chunk_pages=(4,)))
    pair.run(until=0.3, stop=lambda: pair.writes_started > 0)
    pair.restart_prefill(0)
    _run_past_the_late_writes(pair)
    assert pair.decode.release_kind(RoomId(1)) is ReleaseKind.ACKED
    assert [v.what for v in pair.violations] == ["a failed write of prefill 0 landed after release"]


def test_planted_a_socket_dropped_after_the_messages_for_its_new_peer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Item 8: ``ForgetPeer`` applied after the same input's messages: the Register to the restarted
    prefill rank went onto the socket that was then dropped with what it held."""
    restarted = DecodeEndpoint._replace

    def forget_last(self: DecodeEndpoint, *args: Any, **kw: Any) -> None:
        restarted(self, *args, **kw)
        mine = self._out
        self._out = [e for e in mine if not isinstance(e, ForgetPeer)] + [
            e for e in mine if isinstance(e, ForgetPeer)
        ]

    target = Target(instance=EndpointPair().prefill_instance, rank=EndpointPair().prefills[0].origin.rank)

    def registered_soon(pair: EndpointPair) -> bool:
        pair.connect()
        pair.run(until=0.1)
        pair.restart_prefill(0)
        pair.run(until=pair.clock.now + pair.timeouts.register_retry / 2)
        return pair.decode.peer_ready(target)

    assert registered_soon(EndpointPair(timeouts=FAST))
    monkeypatch.setattr(DecodeEndpoint, "_replace", forget_last)
    assert not registered_soon(EndpointPair(timeouts=FAST))
