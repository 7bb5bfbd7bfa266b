"""PrefillEndpoint, input by input: registration, validation, chunks, aborts, tombstones, deadlines."""

from __future__ import annotations

import numpy as np
import pytest

from pdkv.errors import LocalProtocolError
from pdkv.mapping.layout import BufferKind
from pdkv.protocol.config import Timeouts
from pdkv.protocol.effects import ChunkSpec, Notice, NoticeLevel, RoomFinished, SubmitChunk
from pdkv.protocol.ids import Epoch, RoomId
from pdkv.protocol.machines import ChunkState, SenderRoomState
from pdkv.protocol.messages import (
    Abort,
    AbortAck,
    Heartbeat,
    HeartbeatAck,
    Origin,
    Outcome,
    RankCoord,
    RegisterAck,
    RegisterReject,
    StateIndices,
    TransferMetricData,
    TransferStatus,
)
from pdkv.protocol.poll import KVPoll
from tests.protocol.helpers import DECODE, ROOM, layout, prefill, register, request, sent, swa_layout

CHUNK = ChunkSpec(pages=[0, 1, 2], start_token=0, last=True)


def test_register_ack_and_reject_with_exact_difference() -> None:
    p = prefill()
    assert sent(p.receive(register(), 0.0)) == [RegisterAck(origin=p.origin)]
    other = prefill()
    effects = other.receive(register(layout(layers=3)), 0.0)
    [reject] = sent(effects, RegisterReject)
    assert isinstance(reject, RegisterReject)
    assert "target kv layer ids differ: [0, 1] vs [0, 1, 2]" in reject.reason
    assert other.statistics().registrations_rejected == 1
    # A rejected decode rank is not registered: its requests are refused.
    assert other.receive(request(), 0.0)[0].text.startswith("TransferRequest from unregistered")  # type: ignore[union-attr]  # Notice
    assert other.statistics().requests_refused == 1


def test_full_room_lifecycle_reports_actual_metric() -> None:
    p = prefill()
    p.receive(register(), 0.0)
    p.open_room(ROOM, num_pages=3, aux_row=5, now=0.0)
    assert p.poll(ROOM) is KVPoll.Bootstrapping
    assert p.receive(request(aux=2), 0.1) == []
    assert p.poll(ROOM) is KVPoll.WaitingForInput
    [submit] = p.queue_chunk(ROOM, CHUNK, 0.2)
    assert isinstance(submit, SubmitChunk)
    assert submit.src_aux_row == 5 and submit.num_pages == 3
    assert [d.request.dst_aux_row for d in submit.destinations] == [2]
    assert p.poll(ROOM) is KVPoll.Transferring
    assert p.start_chunk(ROOM, 0, 0.3)
    effects = p.chunk_done(ROOM, 0, TransferMetricData(pages=3, bytes=300, seconds=0.5), 0.4)
    [status] = sent(effects, TransferStatus)
    assert isinstance(status, TransferStatus)
    assert status.outcome is Outcome.SUCCESS and status.metric == TransferMetricData(
        pages=3, bytes=300, seconds=0.5
    )
    assert p.poll(ROOM) is KVPoll.Success
    assert p.room_history(ROOM) == [
        SenderRoomState.BOOTSTRAPPING,
        SenderRoomState.WAITING_FOR_INPUT,
        SenderRoomState.TRANSFERRING,
        SenderRoomState.SUCCESS,
    ]


def test_send_before_requests_is_a_local_error_and_double_init_too() -> None:
    p = prefill()
    p.receive(register(), 0.0)
    p.open_room(ROOM, num_pages=3, aux_row=None, now=0.0)
    with pytest.raises(
        LocalProtocolError, match=r"before the decode side asked .* until poll\(\) is WaitingForInput"
    ):
        p.queue_chunk(ROOM, CHUNK, 0.0)
    with pytest.raises(LocalProtocolError, match="already opened"):
        p.open_room(ROOM, num_pages=3, aux_row=None, now=0.0)
    with pytest.raises(LocalProtocolError, match="before init"):
        p.queue_chunk(RoomId(7), CHUNK, 0.0)


@pytest.mark.parametrize(
    ("req", "needle"),
    [
        (request([1, 2, 4096]), "destination page 4096 outside the decode KV buffers (4096 pages)"),
        (request([1, 2]), "request has 3 pages but"),
        (request(aux=64), "destination aux row 64 outside the decode aux buffers (64 rows)"),
        (
            request(state=[StateIndices(kind=BufferKind.SWA, indices=[0])]),
            "state kind swa that",
        ),
    ],
)
def test_bad_request_fails_only_that_room_with_reason(req: object, needle: str) -> None:
    p = prefill()
    p.receive(register(), 0.0)
    other = RoomId(43)
    p.open_room(other, num_pages=3, aux_row=None, now=0.0)
    p.receive(request(room=other), 0.0)
    p.open_room(ROOM, num_pages=3, aux_row=None, now=0.0)
    effects = p.receive(req, 0.0)  # type: ignore[arg-type]  # parametrized TransferRequest
    [status] = sent(effects, TransferStatus)
    assert isinstance(status, TransferStatus) and status.outcome is Outcome.FAILED
    assert needle in status.reason
    assert p.poll(ROOM) is KVPoll.Failed
    assert p.poll(other) is KVPoll.WaitingForInput


def test_state_indices_checked_against_state_buffers() -> None:
    p = prefill(lay=swa_layout())
    p.receive(register(swa_layout()), 0.0)
    p.open_room(ROOM, num_pages=3, aux_row=None, now=0.0)
    p.receive(request(state=[StateIndices(kind=BufferKind.SWA, indices=[7, 8])]), 0.0)
    assert p.failure(ROOM) == "destination swa slot 8 outside the decode buffers (8 slots)"


def test_duplicate_request_is_harmless_and_repeats_final_status() -> None:
    p = prefill()
    p.receive(register(), 0.0)
    p.open_room(ROOM, num_pages=3, aux_row=None, now=0.0)
    p.receive(request(), 0.0)
    assert p.receive(request(), 0.0) == []
    p.queue_chunk(ROOM, CHUNK, 0.0)
    p.start_chunk(ROOM, 0, 0.0)
    p.chunk_done(ROOM, 0, TransferMetricData(), 0.0)
    [again] = sent(p.receive(request(), 1.0), TransferStatus)
    assert isinstance(again, TransferStatus) and again.outcome is Outcome.SUCCESS
    conflicting = p.receive(request([3, 4, 5]), 1.0)
    assert p.poll(ROOM) is KVPoll.Success  # a terminal room is not reopened by a conflicting request
    assert [e.text for e in conflicting if isinstance(e, Notice)] == [
        f"ignored conflicting TransferRequest from {DECODE} for finished room {ROOM}"
    ]
    assert sent(conflicting) == []


def test_conflicting_request_fails_a_live_room() -> None:
    p = prefill()
    p.receive(register(), 0.0)
    p.open_room(ROOM, num_pages=3, aux_row=None, now=0.0)
    p.receive(request(required=2), 0.0)
    p.receive(request([4, 5, 6], required=2), 0.0)
    assert p.failure(ROOM) is not None and "conflicting TransferRequests" in p.failure(ROOM)  # type: ignore[operator]  # checked not None


def test_abort_waits_for_in_flight_chunk_and_skips_queued_ones() -> None:
    p = prefill()
    p.receive(register(), 0.0)
    p.open_room(ROOM, num_pages=4, aux_row=None, now=0.0)
    p.receive(request([1, 2, 3, 4]), 0.0)
    p.queue_chunk(ROOM, ChunkSpec(pages=[0, 1], start_token=0, last=False), 0.0)
    p.queue_chunk(ROOM, ChunkSpec(pages=[2, 3], start_token=32, last=True), 0.0)
    assert p.start_chunk(ROOM, 0, 0.0)
    effects = p.receive(Abort(origin=DECODE, room=ROOM, reason="client left"), 1.0)
    assert sent(effects, AbortAck) == []  # chunk 0 still in flight
    assert p.poll(ROOM) is KVPoll.Failed
    assert p.chunk_states(ROOM) == [ChunkState.TRANSFERRING, ChunkState.SKIPPED]
    assert not p.start_chunk(ROOM, 1, 1.0)
    assert p.may_write(ROOM)
    acked = p.chunk_done(ROOM, 0, TransferMetricData(), 2.0)
    assert sent(acked, AbortAck) == [AbortAck(origin=p.origin, room=ROOM)]
    assert not p.may_write(ROOM)
    # A chunk queued after the failure is Skipped at once, never submitted.
    assert p.statistics().chunks_skipped == 1


def test_abort_for_unknown_room_is_logged_acked_and_tombstoned() -> None:
    p = prefill()
    p.receive(register(), 0.0)
    effects = p.receive(Abort(origin=DECODE, room=ROOM, reason="x"), 0.0)
    assert sent(effects, AbortAck) == [AbortAck(origin=p.origin, room=ROOM)]
    [notice] = [e for e in effects if isinstance(e, Notice)]
    assert notice.level is NoticeLevel.WARNING and "abort for unknown room 42" in notice.text
    # The request that was overtaken by its abort is refused: nothing will be written.
    refused = p.receive(request(), 0.1)
    assert all(not isinstance(e, SubmitChunk) for e in refused)
    assert p.statistics().requests_refused == 1
    # The scheduler opening the room later sees it failed.
    p.open_room(ROOM, num_pages=3, aux_row=None, now=0.2)
    assert p.poll(ROOM) is KVPoll.Failed


def test_prefill_abort_notifies_decode_at_once() -> None:
    p = prefill()
    p.receive(register(), 0.0)
    p.open_room(ROOM, num_pages=3, aux_row=None, now=0.0)
    p.receive(request(), 0.0)
    [status] = sent(p.abort_room(ROOM, "OOM", 1.0), TransferStatus)
    assert isinstance(status, TransferStatus)
    assert status.outcome is Outcome.FAILED and "OOM" in status.reason


def test_engine_failure_fails_room_and_reports() -> None:
    p = prefill()
    p.receive(register(), 0.0)
    p.open_room(ROOM, num_pages=3, aux_row=None, now=0.0)
    p.receive(request(), 0.0)
    p.queue_chunk(ROOM, CHUNK, 0.0)
    p.start_chunk(ROOM, 0, 0.0)
    effects = p.chunk_failed(ROOM, 0, "batch 3 returned -1", 0.5)
    [status] = sent(effects, TransferStatus)
    assert isinstance(status, TransferStatus) and "batch 3 returned -1" in status.reason
    assert any(isinstance(e, RoomFinished) and e.poll is KVPoll.Failed for e in effects)


def test_a_chunk_that_fails_before_it_started_fails_the_room_at_once() -> None:
    """A transfer worker's internal error before ``start_chunk`` (nothing submitted, so nothing can
    land): the room fails now with that reason and the decode is told, instead of staying
    Transferring until its in-flight deadline."""
    p = prefill()
    p.receive(register(), 0.0)
    p.open_room(ROOM, num_pages=3, aux_row=None, now=0.0)
    p.receive(request(), 0.0)
    p.queue_chunk(ROOM, CHUNK, 0.0)
    effects = p.chunk_failed(ROOM, 0, "internal error: RuntimeError: boom", 0.5)
    [status] = sent(effects, TransferStatus)
    assert isinstance(status, TransferStatus) and status.outcome is Outcome.FAILED
    assert "internal error: RuntimeError: boom" in status.reason
    assert p.poll(ROOM) is KVPoll.Failed
    # Nothing was written: no fence is owed before the room's AbortAck.
    assert p.fences_of(ROOM) == []


@pytest.mark.parametrize("stage", ["bootstrap", "inflight-waiting", "inflight-transferring"])
def test_every_non_terminal_state_has_a_deadline(stage: str) -> None:
    t = Timeouts(bootstrap=10, inflight=20, heartbeat_interval=100, heartbeat_timeout=400)
    p = prefill(t)
    p.receive(register(), 0.0)
    p.open_room(ROOM, num_pages=3, aux_row=None, now=0.0)
    if stage != "bootstrap":
        p.receive(request(), 5.0)
    if stage == "inflight-transferring":
        p.queue_chunk(ROOM, CHUNK, 6.0)
        p.start_chunk(ROOM, 0, 6.0)
    limit = 10.0 if stage == "bootstrap" else 25.0
    assert p.next_deadline() == limit
    assert p.tick(limit - 0.001) == []
    p.tick(limit)
    assert p.poll(ROOM) is KVPoll.Failed
    assert "timeout" in (p.failure(ROOM) or "")
    # The failed room keeps only the resend of its Failed status (until the decode's Abort answers);
    # the heartbeat remains.
    assert p.next_deadline() == (limit + 1.0 if stage != "bootstrap" else 100.0)


def test_close_requires_terminal_and_leaves_tombstone() -> None:
    p = prefill(Timeouts(tombstone=50, heartbeat_interval=100, heartbeat_timeout=400))
    p.receive(register(), 0.0)
    p.open_room(ROOM, num_pages=3, aux_row=None, now=0.0)
    with pytest.raises(LocalProtocolError, match="abort it first"):
        p.close_room(ROOM, 0.0)
    p.abort_room(ROOM, "done", 0.0)
    p.close_room(ROOM, 1.0)
    assert ROOM not in p.rooms()
    assert all(not isinstance(e, SubmitChunk) for e in p.receive(request(), 2.0))
    assert p.next_deadline() == 51.0
    p.tick(51.0)
    assert p.next_deadline() == 100.0  # only the heartbeat to the registered decode rank is left


def test_decode_restart_fails_its_rooms_and_old_epoch_is_dropped() -> None:
    p = prefill()
    p.receive(register(), 0.0)
    p.open_room(ROOM, num_pages=3, aux_row=None, now=0.0)
    p.receive(request(), 0.0)
    reborn = Origin(instance=DECODE.instance, epoch=Epoch(2), rank=RankCoord(tp=0))
    effects = p.receive(register(origin=reborn), 1.0)
    assert sent(effects, RegisterAck)
    assert p.poll(ROOM) is KVPoll.Failed and "restarted" in (p.failure(ROOM) or "")
    stale = p.receive(Heartbeat(origin=DECODE, seq=1), 2.0)
    assert sent(stale) == [] and p.statistics().stale_messages == 1
    assert sent(p.receive(Heartbeat(origin=reborn, seq=2), 2.0)) == [HeartbeatAck(origin=p.origin, seq=2)]


def test_dummy_rank_succeeds_without_writing_or_reporting() -> None:
    p = prefill()
    p.receive(register(), 0.0)
    p.open_room(ROOM, num_pages=3, aux_row=None, now=0.0)
    p.receive(request((), dummy=True), 0.0)
    effects = p.queue_chunk(ROOM, CHUNK, 0.0)
    assert not any(isinstance(e, SubmitChunk) for e in effects)
    assert sent(effects) == []
    assert p.poll(ROOM) is KVPoll.Success


def test_required_dst_info_num_waits_for_every_decode_rank() -> None:
    p = prefill()
    second = Origin(instance=DECODE.instance, epoch=Epoch(1), rank=RankCoord(tp=1))
    p.receive(register(), 0.0)
    p.receive(register(origin=second), 0.0)
    p.open_room(ROOM, num_pages=3, aux_row=None, now=0.0)
    p.receive(request(required=2), 0.0)
    assert p.poll(ROOM) is KVPoll.Bootstrapping
    p.receive(request(np.array([7, 8, 9]), required=2, origin=second), 0.0)
    assert p.poll(ROOM) is KVPoll.WaitingForInput
    [submit] = p.queue_chunk(ROOM, CHUNK, 0.0)
    assert isinstance(submit, SubmitChunk) and len(submit.destinations) == 2


def test_chunk_of_a_closed_room_is_skipped_by_the_worker() -> None:
    p = prefill()
    p.receive(register(), 0.0)
    p.open_room(ROOM, num_pages=3, aux_row=None, now=0.0)
    p.receive(request(), 0.0)
    [submit] = p.queue_chunk(ROOM, CHUNK, 0.0)
    assert isinstance(submit, SubmitChunk)
    p.abort_room(ROOM, "scheduler gave up", 0.1)
    p.close_room(ROOM, 0.2)
    # The worker picks the queued chunk after the room is gone: it must skip, not crash.
    assert p.start_chunk(ROOM, submit.chunk, 0.3) is False
    with pytest.raises(LocalProtocolError, match="unknown chunk 5"):
        p.open_room(RoomId(77), num_pages=1, aux_row=None, now=0.0)
        p.start_chunk(RoomId(77), 5, 0.0)
