"""A failed write's bytes may still sit in the engine's queue: the AbortAck waits for a fence write.

Mooncake's TCP transport keeps queued slices of a batch it reported FAILED and sends them once a lane
reconnects (specs/mooncake-tcp-late-writes.md). The prefill endpoint therefore answers an Abort for a
room whose write to that decode rank failed only after a fence write to that rank completed.
"""

from __future__ import annotations

import pytest

from pdkv.protocol.effects import ChunkSpec, FenceWrite, Notice, NoticeLevel, SubmitFence
from pdkv.protocol.ids import RoomId, SessionId
from pdkv.protocol.messages import Abort, AbortAck
from pdkv.protocol.poll import KVPoll
from pdkv.protocol.prefill import PrefillEndpoint
from pdkv.testing.endpoint_pair import EndpointPair, RoomPlan
from tests.protocol.helpers import DECODE, ROOM, prefill, register, request, sent

KEY = (DECODE.instance, DECODE.rank)
FENCE = FenceWrite(session=SessionId("d:1"), src=0x1000, dst=0x2000, length=64)


def _failed_room(with_fence: bool = True) -> PrefillEndpoint:
    p = prefill()
    p.receive(register(), 0.0)
    p.open_room(ROOM, num_pages=3, aux_row=None, now=0.0)
    p.receive(request(), 0.0)
    p.queue_chunk(ROOM, ChunkSpec(pages=[0, 1, 2], start_token=0, last=True), 0.0)
    assert p.start_chunk(ROOM, 0, 0.0)
    p.chunk_failed(ROOM, 0, "engine: FAILED", 0.5, fences={KEY: FENCE} if with_fence else None)
    assert p.poll(ROOM) is KVPoll.Failed
    return p


def test_abort_of_a_room_whose_write_failed_fences_before_the_ack() -> None:
    p = _failed_room()
    effects = p.receive(Abort(origin=DECODE, room=ROOM, reason="prefill failed"), 1.0)
    assert sent(effects, AbortAck) == []
    assert [e for e in effects if isinstance(e, SubmitFence)] == [
        SubmitFence(room=ROOM, peer=KEY, fence=FENCE)
    ]
    # A resent Abort while the fence is on its way starts no second fence.
    again = p.receive(Abort(origin=DECODE, room=ROOM, reason="prefill failed"), 2.0)
    assert sent(again, AbortAck) == [] and not [e for e in again if isinstance(e, SubmitFence)]
    done = p.fence_done(ROOM, KEY, True, "", 2.5)
    # The ack says it follows a fence: the decode still cuts (or settles) before reusing the pages.
    assert sent(done, AbortAck) == [AbortAck(origin=p.origin, room=ROOM, fenced=True)]
    # Owed once: a later duplicate Abort is answered at once, and says the same.
    late = p.receive(Abort(origin=DECODE, room=ROOM, reason="prefill failed"), 3.0)
    assert sent(late, AbortAck) == [AbortAck(origin=p.origin, room=ROOM, fenced=True)]
    assert p.statistics().fences_submitted == 1


def test_a_closing_rank_waits_for_a_running_fence_not_for_the_retry_of_a_failed_one() -> None:
    """``answers_owed``: a fence on its way ends in the AbortAck (worth a closing rank's wait); one
    that failed is written again only at its retry, which a closing rank does not wait for."""
    p = _failed_room()
    assert p.answers_owed() == 1  # told Failed: the decode's Abort is still to come
    p.receive(Abort(origin=DECODE, room=ROOM, reason="prefill failed"), 1.0)
    assert p.answers_owed() == 1  # the fence is running: its completion sends the ack
    p.fence_done(ROOM, KEY, False, "link down", 1.5)
    assert p.answers_owed() == 0
    q = _failed_room()
    q.receive(Abort(origin=DECODE, room=ROOM, reason="prefill failed"), 1.0)
    assert sent(q.fence_done(ROOM, KEY, True, "", 1.5), AbortAck) != []
    assert q.answers_owed() == 0


def test_a_failed_fence_keeps_the_ack_owed_until_a_later_abort_fences_again() -> None:
    p = _failed_room()
    p.receive(Abort(origin=DECODE, room=ROOM, reason="x"), 1.0)
    failed = p.fence_done(ROOM, KEY, False, "link down", 1.5)
    assert sent(failed, AbortAck) == []
    [notice] = [e for e in failed if isinstance(e, Notice)]
    assert notice.level is NoticeLevel.WARNING and "link down" in notice.text
    retry = p.receive(Abort(origin=DECODE, room=ROOM, reason="x"), 1.6)  # before its own retry
    assert [e for e in retry if isinstance(e, SubmitFence)] == [SubmitFence(room=ROOM, peer=KEY, fence=FENCE)]
    assert sent(p.fence_done(ROOM, KEY, True, "", 1.7), AbortAck) == [
        AbortAck(origin=p.origin, room=ROOM, fenced=True)
    ]
    stats = p.statistics()
    assert (stats.fences_submitted, stats.fences_failed) == (2, 1)
    assert not [e for e in p.tick(10.0) if isinstance(e, SubmitFence)]  # acknowledged: no retry


def test_a_failed_fence_is_written_again_without_waiting_for_the_next_abort() -> None:
    """The first write on an engine connection that died fails before the engine reconnects: the
    prefill writes the fence again ``abort_resend`` later on its own; the decode's resend interval
    doubles and may be far away."""
    p = _failed_room()
    p.receive(Abort(origin=DECODE, room=ROOM, reason="x"), 1.0)
    p.fence_done(ROOM, KEY, False, "lane reset by the decode's cut", 1.5)
    resend = p.timeouts.abort_resend
    assert p.next_deadline() == pytest.approx(1.5 + resend)
    assert not [e for e in p.tick(1.5 + resend / 2) if isinstance(e, SubmitFence)]
    retry = p.tick(1.5 + resend)
    assert [e for e in retry if isinstance(e, SubmitFence)] == [SubmitFence(room=ROOM, peer=KEY, fence=FENCE)]
    assert sent(p.fence_done(ROOM, KEY, True, "", 2.0 + resend), AbortAck) == [
        AbortAck(origin=p.origin, room=ROOM, fenced=True)
    ]
    assert (p.statistics().fences_submitted, p.statistics().fences_failed) == (2, 1)


def test_the_fence_outlives_the_room_clear_in_its_tombstone_time() -> None:
    p = _failed_room()
    p.close_room(ROOM, 1.0)  # the scheduler saw Failed and cleared the room; the Abort is late
    effects = p.receive(Abort(origin=DECODE, room=ROOM, reason="x"), 30.0)
    assert sent(effects, AbortAck) == []
    assert [e for e in effects if isinstance(e, SubmitFence)] == [
        SubmitFence(room=ROOM, peer=KEY, fence=FENCE)
    ]
    assert sent(p.fence_done(ROOM, KEY, True, "", 30.5), AbortAck) == [
        AbortAck(origin=p.origin, room=ROOM, fenced=True)
    ]


def test_a_room_without_failed_writes_is_acked_at_once() -> None:
    p = _failed_room(with_fence=False)
    effects = p.receive(Abort(origin=DECODE, room=ROOM, reason="x"), 1.0)
    assert sent(effects, AbortAck) == [AbortAck(origin=p.origin, room=ROOM)]
    assert not [e for e in effects if isinstance(e, SubmitFence)]


def _pair_with_failing_writes() -> EndpointPair:
    pair = EndpointPair(
        transfer_time=0.05,
        fail_write=lambda room, chunk, rank: room % 2 == 1 and chunk == 0,
        late_write_s=5.0,
    )
    pair.connect()
    pair.run(until=0.1)
    for room in range(1, 9):
        pair.add_room(RoomPlan(room=RoomId(room), num_pages=4, chunk_pages=(2, 2)))
    return pair


def test_pair_fences_every_failed_write_before_its_release() -> None:
    pair = _pair_with_failing_writes()
    pair.settle()
    assert pair.violations == []
    assert pair.fences_completed >= 1
    assert [r for r in range(1, 9) if pair.decode.poll(RoomId(r)) is KVPoll.Failed] == [1, 3, 5, 7]


def test_pair_catches_an_ack_that_skips_the_fence(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug: the endpoint forgets the fences it is given; the late bytes land after release."""
    monkeypatch.setattr(PrefillEndpoint, "_owe_fences", lambda self, room, fences: None)
    pair = _pair_with_failing_writes()
    pair.settle()
    pair.run(until=pair.clock.now + 10.0)  # let the queued bytes of the failed writes land
    assert pair.late_writes_landed == 4
    assert {v.room for v in pair.violations} == {RoomId(1), RoomId(3), RoomId(5), RoomId(7)}
    assert all("landed after release" in v.what for v in pair.violations)
