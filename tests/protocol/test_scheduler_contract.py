"""The scheduler contract at the sans-IO endpoints: never Success with positions unwritten, typed
errors at the call with nothing changed, remote inputs that never raise, honest room lifecycles."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from pdkv.errors import InvalidArgumentError, LocalProtocolError, MappingError
from pdkv.mapping import PageInterleaved
from pdkv.mapping.layout import BufferKind
from pdkv.protocol.config import Timeouts
from pdkv.protocol.effects import ChunkSpec, FailureCause, Send, SubmitChunk, Target
from pdkv.protocol.ids import Endpoint, Epoch, RoomId
from pdkv.protocol.machines import FailureNoticeState
from pdkv.protocol.messages import (
    Abort,
    AbortAck,
    Heartbeat,
    Origin,
    Outcome,
    RankCoord,
    Register,
    RegisterAck,
    RegisterReject,
    StateIndices,
    TransferMetricData,
    TransferRequest,
    TransferStatus,
)
from pdkv.protocol.poll import KVPoll
from pdkv.protocol.prefill import PrefillEndpoint
from tests.protocol.helpers import (
    DECODE,
    DECODE_EP,
    PREFILL,
    ROOM,
    decode,
    layout,
    prefill,
    register,
    request,
    route,
    sent,
    swa_layout,
)

PAGE = 16  # the helpers' page size
SECOND = Origin(instance=DECODE.instance, epoch=DECODE.epoch, rank=RankCoord(tp=1))


def _transferring(num_pages: int = 8) -> PrefillEndpoint:
    """A prefill endpoint with ROOM open over ``num_pages`` pages and its request in."""
    p = prefill()
    p.receive(register(), 0.0)
    p.open_room(ROOM, num_pages=num_pages, aux_row=None, now=0.0)
    p.receive(request(list(range(100, 100 + num_pages))), 0.0)
    assert p.poll(ROOM) is KVPoll.WaitingForInput
    return p


def _chunk(first: int, count: int, *, last: bool, page_base: int = 0) -> ChunkSpec:
    return ChunkSpec(
        pages=np.arange(page_base + first, page_base + first + count), start_token=first * PAGE, last=last
    )


def _finish_all(p: PrefillEndpoint, effects: list[SubmitChunk]) -> None:
    for submit in effects:
        assert p.start_chunk(ROOM, submit.chunk, 1.0)
        p.chunk_done(ROOM, submit.chunk, TransferMetricData(pages=submit.spec.pages.size), 1.0)


def _submits(effects: object) -> list[SubmitChunk]:
    assert isinstance(effects, list)
    return [e for e in effects if isinstance(e, SubmitChunk)]


# ---------------------------------------------------------------- silent corruption, now refused


def test_a_gap_between_chunks_is_refused_at_the_call_and_changes_nothing() -> None:
    p = _transferring()
    first = _submits(p.queue_chunk(ROOM, _chunk(0, 3, last=False), 0.1))
    with pytest.raises(MappingError, match=r"room 42: chunk_pages leaves positions 3\.\.3 unwritten") as gap:
        p.queue_chunk(ROOM, _chunk(4, 4, last=True), 0.2)
    assert gap.value.room == ROOM and gap.value.peer is None  # the error names its room
    assert len(p.chunk_states(ROOM)) == 1  # nothing queued by the refused call
    rest = _submits(p.queue_chunk(ROOM, _chunk(3, 5, last=True), 0.3))  # the right chunk still goes
    _finish_all(p, first + rest)
    assert p.poll(ROOM) is KVPoll.Success


@pytest.mark.parametrize(
    "chunks",
    [
        [(0, 6, True)],  # 6 of 8
        [(0, 2, True)],  # 2 of 8 in one chunk
        [(0, 0, True)],  # an empty last chunk alone
        [(0, 4, False), (4, 2, True)],  # the last of several ends short
    ],
)
def test_a_last_chunk_that_ends_short_of_num_pages_is_refused(chunks: list[tuple[int, int, bool]]) -> None:
    p = _transferring(8)
    *earlier, (first, count, last) = chunks
    for f, c, lst in earlier:
        p.queue_chunk(ROOM, _chunk(f, c, last=lst), 0.1)
    with pytest.raises(
        MappingError, match=r"short of num_pages 8: positions \d+\.\.7 would never be written"
    ):
        p.queue_chunk(ROOM, _chunk(first, count, last=last), 0.2)
    assert p.poll(ROOM) is not KVPoll.Success


def test_the_same_chunk_twice_and_overlapping_chunks_are_refused() -> None:
    p = _transferring(8)
    p.queue_chunk(ROOM, _chunk(0, 4, last=False), 0.1)
    with pytest.raises(MappingError, match="overlaps 4 position"):
        p.queue_chunk(ROOM, _chunk(0, 4, last=False), 0.2)
    with pytest.raises(MappingError, match="overlaps 2 position"):
        p.queue_chunk(ROOM, _chunk(2, 6, last=True), 0.2)
    with pytest.raises(MappingError, match="runs past the request's last page"):
        p.queue_chunk(ROOM, _chunk(4, 6, last=True), 0.2)


def test_repeated_source_pages_are_refused_within_and_across_chunks() -> None:
    p = _transferring(8)
    with pytest.raises(MappingError, match=r"chunk_pages repeat page ids \[7\]"):
        p.queue_chunk(ROOM, ChunkSpec(pages=[7, 7, 1, 2], start_token=0, last=False), 0.1)
    p.queue_chunk(ROOM, ChunkSpec(pages=[7, 3, 1, 2], start_token=0, last=False), 0.1)
    with pytest.raises(MappingError, match=r"repeat page ids \[3\] of an earlier chunk"):
        p.queue_chunk(ROOM, ChunkSpec(pages=[3, 4, 5, 6], start_token=4 * PAGE, last=True), 0.2)


def test_a_first_chunk_past_the_decode_prefix_is_refused_and_changes_nothing() -> None:
    # Seams issue, item 2: the decode holds no prefix, so positions 0..2 would never be written, yet
    # this used to end in Success on both sides.
    p = _transferring(8)
    with pytest.raises(
        MappingError, match=r"first chunk .* starts past the decode's prefix .* 0\.\.2 would never"
    ):
        p.queue_chunk(ROOM, _chunk(3, 5, last=True), 0.1)
    assert p.poll(ROOM) is KVPoll.WaitingForInput and p.chunk_states(ROOM) == []
    submits = _submits(p.queue_chunk(ROOM, _chunk(0, 8, last=True), 0.2))  # the corrected call
    _finish_all(p, submits)
    assert p.poll(ROOM) is KVPoll.Success


def test_source_pages_and_state_slots_outside_this_ranks_pool_are_refused_at_the_call() -> None:
    # Seams issue, item 3: page 5000 of a 4,096-page pool used to be accepted and fail the room later
    # as an engine failure ("mapping for d:tp0/cp0 ... past the end"), blaming the decode.
    lay = swa_layout()  # 4,096 KV pages, 8 SWA slots
    p = prefill(lay=lay)
    p.receive(register(lay), 0.0)
    p.open_room(ROOM, num_pages=2, aux_row=None, now=0.0)
    p.receive(request([7, 8], state=[StateIndices(kind=BufferKind.SWA, indices=[1])]), 0.0)
    with pytest.raises(
        InvalidArgumentError, match=r"page\(s\) \[5000\] .* outside this rank's KV buffers of 4096"
    ) as bad:
        p.queue_chunk(ROOM, ChunkSpec(pages=[3, 5000], start_token=0, last=True), 0.1)
    assert bad.value.argument == "chunk_pages" and bad.value.room == ROOM
    beyond = (StateIndices(kind=BufferKind.SWA, indices=[8]),)
    with pytest.raises(InvalidArgumentError, match=r"state_indices\[swa\] slot 8 is outside .* 8 slots"):
        p.queue_chunk(ROOM, ChunkSpec(pages=[3, 4], start_token=0, last=True, state=beyond), 0.1)
    unknown = (StateIndices(kind=BufferKind.INDEX_K, indices=[0]),)
    with pytest.raises(InvalidArgumentError, match="index_k, which this rank did not register"):
        p.queue_chunk(ROOM, ChunkSpec(pages=[3, 4], start_token=0, last=True, state=unknown), 0.1)
    assert p.poll(ROOM) is KVPoll.WaitingForInput and p.chunk_states(ROOM) == []
    fine = (StateIndices(kind=BufferKind.SWA, indices=[7]),)
    assert _submits(p.queue_chunk(ROOM, ChunkSpec(pages=[3, 4], start_token=0, last=True, state=fine), 0.2))


def test_a_cp_rank_checks_the_physical_pages_it_owns() -> None:
    # Under CP shared KV, logical page L lives on rank L % cp as physical page L // cp: rank 1 of 2
    # may name logical pages up to 2 x its pool, and no more.
    origin = Origin(instance=PREFILL.instance, epoch=PREFILL.epoch, rank=RankCoord(tp=0, cp=1))
    p = PrefillEndpoint(origin=origin, layout=layout(), policy=PageInterleaved(cp_size=2))
    p.receive(register(), 0.0)
    p.open_room(ROOM, num_pages=2, aux_row=None, now=0.0)
    p.receive(request([7, 8]), 0.0)
    with pytest.raises(InvalidArgumentError, match=r"page\(s\) \[4096\] \(physical, on CP rank 1\)"):
        p.queue_chunk(ROOM, ChunkSpec(pages=[8193, 2], start_token=0, last=True), 0.1)
    assert _submits(p.queue_chunk(ROOM, ChunkSpec(pages=[8191, 8192], start_token=0, last=True), 0.1))


def test_a_cached_prefix_starts_the_first_chunk_past_zero_and_succeeds() -> None:
    p = prefill()
    p.receive(register(), 0.0)
    p.open_room(ROOM, num_pages=8, aux_row=None, now=0.0)
    held = TransferRequest(
        origin=DECODE, room=ROOM, dst_pages=list(range(100, 108)), required_dst_info_num=1, prefix_pages=3
    )
    p.receive(held, 0.0)
    assert p.decode_prefix(ROOM) == 3
    with pytest.raises(MappingError, match=r"first chunk .* past the decode's prefix"):
        p.queue_chunk(ROOM, _chunk(4, 4, last=True), 0.1)
    submits = _submits(p.queue_chunk(ROOM, _chunk(3, 2, last=False), 0.1))
    submits += _submits(p.queue_chunk(ROOM, _chunk(5, 3, last=True), 0.2))
    _finish_all(p, submits)
    assert p.poll(ROOM) is KVPoll.Success


def test_repeated_destination_pages_are_refused_at_receiver_init_and_create_nothing() -> None:
    d = decode()
    d.connect(route(), 0.0)
    target = Target(instance=PREFILL.instance, rank=PREFILL.rank)
    with pytest.raises(MappingError, match=r"room 42: dst_pages repeats ids \[9\]"):
        d.open_room(ROOM, targets=[target], dst_pages=[9, 9, 9, 9], dst_aux_row=None, now=0.0)
    assert not d.has_room(ROOM)
    assert d.poll(ROOM) is KVPoll.Bootstrapping


def test_a_request_with_repeated_destination_pages_fails_the_room() -> None:
    p = prefill()
    p.receive(register(), 0.0)
    p.open_room(ROOM, num_pages=4, aux_row=None, now=0.0)
    effects = p.receive(request([5, 6, 5, 6]), 0.1)
    [status] = sent(effects, TransferStatus)
    assert isinstance(status, TransferStatus) and status.outcome is Outcome.FAILED
    assert "repeat page ids [5, 6]" in status.reason
    assert p.poll(ROOM) is KVPoll.Failed and p.failure_cause(ROOM) is FailureCause.INVALID


# ---------------------------------------------------------------- arguments, checked first


@pytest.mark.parametrize(
    ("num_pages", "aux_row", "argument"),
    [
        ("4", None, "num_pages"),
        (4.5, None, "num_pages"),
        (True, None, "num_pages"),
        (2**70, None, "num_pages"),
        (-1, None, "num_pages"),
        (4, -1, "aux_row"),
        (4, 64, "aux_row"),  # the helpers' aux buffer has 64 rows
        (4, "0", "aux_row"),
    ],
)
def test_bad_open_room_arguments_name_argument_and_room_and_change_nothing(
    num_pages: object, aux_row: object, argument: str
) -> None:
    p = prefill()
    with pytest.raises(InvalidArgumentError, match=f"room 42: {argument}") as info:
        p.open_room(ROOM, num_pages=num_pages, aux_row=aux_row, now=0.0)  # type: ignore[arg-type]  # on purpose
    assert info.value.room == ROOM and info.value.argument == argument
    assert not p.has_room(ROOM)
    p.open_room(ROOM, num_pages=4, aux_row=1, now=0.0)  # the same room opens once corrected


# ---------------------------------------------------------------- lifecycle and remote inputs


def test_poll_before_init_answers_bootstrapping_on_both_sides() -> None:
    assert prefill().poll(ROOM) is KVPoll.Bootstrapping
    assert prefill().failure(ROOM) is None
    assert decode().poll(ROOM) is KVPoll.Bootstrapping
    assert decode().release_ready(ROOM)


def test_a_request_for_a_finished_room_is_answered_failed_and_the_room_stays_success() -> None:
    p = _transferring(2)
    _finish_all(p, _submits(p.queue_chunk(ROOM, _chunk(0, 2, last=True), 0.1)))
    assert p.poll(ROOM) is KVPoll.Success
    p.receive(register(origin=SECOND), 0.2)
    effects = p.receive(request([1, 2], origin=SECOND), 0.3)  # never raises
    [status] = sent(effects, TransferStatus)
    assert isinstance(status, TransferStatus) and status.outcome is Outcome.FAILED
    assert "already finished" in status.reason
    assert p.poll(ROOM) is KVPoll.Success
    assert p.statistics().requests_refused == 1


def test_open_of_a_room_the_decode_already_aborted_opens_failed_whatever_its_size() -> None:
    p = prefill()
    p.receive(register(), 0.0)
    p.receive(request([1, 2, 3]), 0.0)
    p.receive(Abort(origin=DECODE, room=ROOM, reason="client left"), 0.1)
    p.open_room(ROOM, num_pages=5, aux_row=None, now=0.2)  # another page count: no raise
    assert p.poll(ROOM) is KVPoll.Failed
    assert "client left" in (p.failure(ROOM) or "")


def test_requests_for_rooms_never_opened_are_freed_once_failed() -> None:
    p = prefill(Timeouts(bootstrap=10.0, inflight=10.0))
    p.receive(register(), 0.0)
    for k in range(1, 1001):
        p.receive(request([1], room=RoomId(k)), 0.0)
    assert len(p.rooms()) == 1000
    p.tick(11.0)
    assert p.rooms() == []
    assert p.statistics().unopened_rooms_freed == 1000
    # A late init sees the reason, not a fresh room.
    p.open_room(RoomId(7), num_pages=1, aux_row=None, now=12.0)
    assert p.poll(RoomId(7)) is KVPoll.Failed and "inflight timeout" in (p.failure(RoomId(7)) or "")


def test_a_room_id_reused_within_the_tombstone_window_is_said_on_both_sides_at_once() -> None:
    p = _transferring(2)
    _finish_all(p, _submits(p.queue_chunk(ROOM, _chunk(0, 2, last=True), 0.1)))
    p.close_room(ROOM, 1.0)
    # The decode asks for the id again: answered Failed at once with the reason.
    effects = p.receive(request([3, 4]), 2.0)
    [status] = sent(effects, TransferStatus)
    assert isinstance(status, TransferStatus) and status.outcome is Outcome.FAILED
    assert "room id reused" in status.reason
    d = decode()
    d.connect(route(), 0.0)
    d.receive(RegisterAck(origin=PREFILL), 0.0)
    target = Target(instance=PREFILL.instance, rank=PREFILL.rank)
    d.open_room(ROOM, targets=[target], dst_pages=[3, 4], dst_aux_row=None, now=2.0)
    d.receive(status, 2.1)
    assert d.poll(ROOM) is KVPoll.Failed and "room id reused" in (d.failure(ROOM) or "")
    # The prefill scheduler reusing it is told the same.
    p.open_room(ROOM, num_pages=2, aux_row=None, now=2.0)
    assert p.poll(ROOM) is KVPoll.Failed and "room id reused" in (p.failure(ROOM) or "")


def test_a_prefill_abort_before_the_request_answers_the_late_request_failed() -> None:
    p = prefill()
    p.receive(register(), 0.0)
    p.abort_room(ROOM, "scheduler gave up", 0.0)
    assert p.poll(ROOM) is KVPoll.Failed
    effects = p.receive(request([1, 2]), 1.0)
    [status] = sent(effects, TransferStatus)
    assert isinstance(status, TransferStatus) and "scheduler gave up" in status.reason
    assert not p.has_room(ROOM)


def test_a_decode_abort_before_init_tells_the_prefill_ranks() -> None:
    d = decode()
    d.connect(route(), 0.0)
    d.receive(RegisterAck(origin=PREFILL), 0.0)
    target = Target(instance=PREFILL.instance, rank=PREFILL.rank)
    effects = d.abort_room(ROOM, "client left", 0.1, targets=[target])
    [abort] = sent(effects, Abort)
    assert isinstance(abort, Abort) and abort.room == ROOM
    assert d.poll(ROOM) is KVPoll.Failed and d.release_ready(ROOM)
    # The prefill side refuses the room from then on.
    p = prefill()
    p.receive(register(), 0.0)
    assert sent(p.receive(abort, 0.2), AbortAck)
    p.open_room(ROOM, num_pages=2, aux_row=None, now=0.3)
    assert p.poll(ROOM) is KVPoll.Failed and "client left" in (p.failure(ROOM) or "")


def test_send_after_the_last_chunk_and_before_init_stay_local_errors() -> None:
    p = _transferring(2)
    p.queue_chunk(ROOM, _chunk(0, 2, last=True), 0.1)
    with pytest.raises(LocalProtocolError, match="after the last chunk"):
        p.queue_chunk(ROOM, _chunk(2, 0, last=True), 0.2)
    with pytest.raises(LocalProtocolError, match="before init"):
        p.queue_chunk(RoomId(9), _chunk(0, 1, last=True), 0.2)


def test_a_late_success_of_a_cleared_room_never_completes_a_room_reusing_its_id() -> None:
    d = decode()
    d.connect(route(), 0.0)
    d.receive(RegisterAck(origin=PREFILL), 0.0)
    target = Target(instance=PREFILL.instance, rank=PREFILL.rank)
    d.open_room(ROOM, targets=[target], dst_pages=[3, 4], dst_aux_row=None, now=0.0)
    success = TransferStatus(origin=PREFILL, room=ROOM, outcome=Outcome.SUCCESS)
    d.receive(success, 0.5)
    assert d.poll(ROOM) is KVPoll.Success
    d.close_room(ROOM, 1.0)
    effects = d.open_room(ROOM, targets=[target], dst_pages=[5, 6], dst_aux_row=None, now=2.0)
    assert sent(effects, TransferStatus) == [] and not any(
        type(m).__name__ == "TransferRequest" for m in sent(effects)
    )  # no prefill rank is told a destination of the reused id
    d.receive(success, 2.1)  # the old room's status, late (a duplicate on the wire)
    assert d.poll(ROOM) is KVPoll.Failed and "room id reused" in (d.failure(ROOM) or "")
    assert d.release_ready(ROOM)
    # Past the tombstone window the id is free again.
    d.close_room(ROOM, 3.0)
    d.tick(3.0 + d.timeouts.tombstone + 1)
    d.open_room(
        ROOM, targets=[target], dst_pages=[5, 6], dst_aux_row=None, now=3.0 + d.timeouts.tombstone + 2
    )
    assert d.poll(ROOM) is KVPoll.Bootstrapping  # a room again (the idle peer is being re-registered)


def test_an_abort_before_registration_completed_reaches_the_prefill_once_it_does() -> None:
    d = decode()
    d.connect(route(), 0.0)  # Register sent, not yet acknowledged
    target = Target(instance=PREFILL.instance, rank=PREFILL.rank)
    d.open_room(ROOM, targets=[target], dst_pages=[3, 4], dst_aux_row=None, now=0.1)
    assert sent(d.abort_room(ROOM, "client left", 0.2), Abort) == []  # it would be dropped now
    effects = d.receive(RegisterAck(origin=PREFILL), 0.3)
    [abort] = sent(effects, Abort)
    assert isinstance(abort, Abort) and abort.room == ROOM and "client left" in abort.reason
    assert sent(d.receive(RegisterAck(origin=PREFILL), 0.4), Abort) == []  # told once


def test_metrics_of_rooms_without_a_record_are_zero_not_errors() -> None:
    assert prefill().metric(ROOM) == TransferMetricData()
    assert decode().metric(ROOM) == {}


def test_a_failed_status_is_resent_until_the_decode_answers_with_its_abort() -> None:
    p = prefill(Timeouts(abort_resend=1.0))
    p.receive(register(), 0.0)
    p.open_room(ROOM, num_pages=2, aux_row=None, now=0.0)
    p.receive(request([5, 6]), 0.0)
    [first] = sent(p.abort_room(ROOM, "scheduler gave up", 1.0), TransferStatus)
    assert isinstance(first, TransferStatus) and first.outcome is Outcome.FAILED
    # Lost on the way: sent again at +1 s, then +2 s (doubling), until the decode's Abort comes.
    assert sent(p.tick(1.5), TransferStatus) == []
    assert sent(p.tick(2.0), TransferStatus) == [first]
    assert sent(p.tick(4.0), TransferStatus) == [first]
    p.receive(Abort(origin=DECODE, room=ROOM, reason="prefill failed"), 4.5)
    assert sent(p.tick(8.0), TransferStatus) == [] and p.next_deadline() != 8.0
    assert p.statistics().statuses_resent == 2


def test_a_failed_status_goes_again_only_to_the_ranks_whose_abort_has_not_answered_it() -> None:
    """Rules as rows: the resends are the room's FailureNotice machine (TELLING until every rank told
    answered, then ANSWERED), not flags on the room."""
    p = prefill(Timeouts(abort_resend=1.0))
    second = Origin(instance=DECODE.instance, epoch=DECODE.epoch, rank=RankCoord(tp=1))
    second_ep = Endpoint("inproc://d2")
    p.receive(register(), 0.0)
    p.receive(attrs.evolve(register(origin=second), endpoint=second_ep), 0.0)
    p.open_room(ROOM, num_pages=2, aux_row=None, now=0.0)
    p.receive(request([5, 6], required=2), 0.0)
    p.receive(request([5, 6], required=2, origin=second), 0.0)
    assert p.notice_state(ROOM) is None  # nothing told yet
    told = [e.to for e in p.abort_room(ROOM, "scheduler gave up", 1.0) if isinstance(e, Send)]
    assert sorted(told) == sorted([DECODE_EP, second_ep])
    assert p.notice_state(ROOM) is FailureNoticeState.TELLING
    p.receive(Abort(origin=DECODE, room=ROOM, reason="prefill failed"), 1.5)
    assert p.notice_state(ROOM) is FailureNoticeState.TELLING  # the second rank has not answered
    again = [e.to for e in p.tick(2.0) if isinstance(e, Send) and isinstance(e.message, TransferStatus)]
    assert again == [second_ep] and p.statistics().statuses_resent == 1
    p.receive(Abort(origin=second, room=ROOM, reason="prefill failed"), 2.5)
    assert p.notice_state(ROOM) is FailureNoticeState.ANSWERED
    assert sent(p.tick(4.0), TransferStatus) == [] and p.statistics().statuses_resent == 1


def test_answers_owed_counts_each_rank_told_until_its_abort_is_acknowledged() -> None:
    """What a closing prefill waits for: a rank told Failed owes an Abort; an Abort with a write of
    the room in flight owes its AbortAck until the write ends; a rank no longer registered owes none."""
    p = _transferring(4)
    assert p.answers_owed() == 0  # nothing failed
    [submit] = _submits(p.queue_chunk(ROOM, _chunk(0, 4, last=True), 0.1))
    assert p.start_chunk(ROOM, submit.chunk, 0.2)
    p.abort_room(ROOM, "prefill closing", 0.3)
    assert p.answers_owed() == 1  # told Failed, no Abort back
    assert sent(p.receive(Abort(origin=DECODE, room=ROOM, reason="prefill failed"), 0.4), AbortAck) == []
    assert p.answers_owed() == 1  # asked, but the chunk's write may still land: no ack yet
    [ack] = sent(p.chunk_done(ROOM, submit.chunk, TransferMetricData(pages=4), 0.5), AbortAck)
    assert isinstance(ack, AbortAck) and ack.room == ROOM
    assert p.answers_owed() == 0
    # A rank told Failed that is then lost (heartbeats silent) owes nothing more: no wait on it.
    q = _transferring(2)
    q.abort_room(ROOM, "prefill closing", 0.3)
    assert q.answers_owed() == 1
    q.tick(100.0)  # far past the heartbeat timeout: the decode rank is forgotten
    assert q.registered((DECODE.instance, DECODE.rank)) is None
    assert q.answers_owed() == 0


def test_a_prefill_that_forgot_a_decode_rank_tells_it_at_its_next_heartbeat() -> None:
    p = prefill()  # this rank never registered the decode (or forgot it)
    beat = Heartbeat(origin=DECODE, seq=3, endpoint=DECODE_EP)
    [reject] = sent(p.receive(beat, 1.0), RegisterReject)
    assert isinstance(reject, RegisterReject) and reject.retry and "register again" in reject.reason
    assert p.statistics().told_to_register == 1
    # The decode rank, READY with a live room, learns it at once: the room fails, Register goes out.
    d = decode()
    d.connect(route(), 0.0)
    d.receive(RegisterAck(origin=PREFILL), 0.0)
    target = Target(instance=PREFILL.instance, rank=PREFILL.rank)
    d.open_room(ROOM, targets=[target], dst_pages=[3, 4], dst_aux_row=None, now=0.5)
    effects = d.receive(reject, 1.1)
    assert d.poll(ROOM) is KVPoll.Failed and "no longer knows this rank" in (d.failure(ROOM) or "")
    assert sent(effects, Register) and not d.peer_ready(target)
    # A fatal refusal is different: the rank is Rejected, not re-registered.
    fatal = RegisterReject(origin=PREFILL, reason="layouts differ", retry=False)
    assert d.peer_refusal(target) is None
    d.receive(fatal, 1.2)
    assert d.peer_refusal(target) == "layouts differ"


def test_the_decode_prefix_travels_with_the_request_and_no_chunk_may_write_into_it() -> None:
    d = decode()
    d.connect(route(), 0.0)
    d.receive(RegisterAck(origin=PREFILL), 0.0)
    target = Target(instance=PREFILL.instance, rank=PREFILL.rank)
    with pytest.raises(InvalidArgumentError, match="prefix_pages"):
        d.open_room(ROOM, targets=[target], dst_pages=[1, 2], dst_aux_row=None, prefix_pages=3, now=0.0)
    effects = d.open_room(
        ROOM, targets=[target], dst_pages=[10, 11, 12, 13], dst_aux_row=None, prefix_pages=2, now=0.0
    )
    [req] = [m for m in sent(effects) if type(m).__name__ == "TransferRequest"]
    p = prefill()
    p.receive(register(), 0.0)
    p.open_room(ROOM, num_pages=4, aux_row=None, now=0.0)
    assert p.decode_prefix(ROOM) is None  # not asked yet
    p.receive(req, 0.1)
    assert p.decode_prefix(ROOM) == 2
    with pytest.raises(MappingError, match=r"starts inside the decode's prefix \(positions 0\.\.1"):
        p.queue_chunk(ROOM, _chunk(0, 4, last=True), 0.2)
    submits = _submits(p.queue_chunk(ROOM, _chunk(2, 2, last=True), 0.3))
    _finish_all(p, submits)
    assert p.poll(ROOM) is KVPoll.Success


def test_decode_ranks_that_disagree_on_their_prefix_fail_the_room() -> None:
    p = prefill()
    p.receive(register(), 0.0)
    p.receive(register(origin=SECOND), 0.0)
    p.open_room(ROOM, num_pages=4, aux_row=None, now=0.0)
    p.receive(
        TransferRequest(
            origin=DECODE, room=ROOM, dst_pages=[1, 2, 3, 4], required_dst_info_num=2, prefix_pages=1
        ),
        0.1,
    )
    p.receive(
        TransferRequest(
            origin=SECOND, room=ROOM, dst_pages=[1, 2, 3, 4], required_dst_info_num=2, prefix_pages=2
        ),
        0.1,
    )
    assert p.poll(ROOM) is KVPoll.Failed and "disagree on the prefix" in (p.failure(ROOM) or "")


def test_an_old_incarnations_heartbeat_is_not_answered_register_again() -> None:
    p = prefill()
    reborn = Origin(instance=DECODE.instance, epoch=Epoch(5), rank=DECODE.rank)
    p.receive(register(origin=reborn), 0.0)
    p.tick(40.0)  # silent since it registered (heartbeat timeout 30 s): forgotten
    assert p.statistics().peers_lost == 1
    # A delayed heartbeat of an older incarnation must not tell the address to register again (a
    # newer process may be there and Ready): only one at least as new as the latest registration.
    old = Heartbeat(origin=DECODE, seq=9, endpoint=DECODE_EP)  # epoch 1 < 5
    assert sent(p.receive(old, 41.0), RegisterReject) == []
    same = Heartbeat(origin=reborn, seq=10, endpoint=DECODE_EP)
    assert len(sent(p.receive(same, 41.0), RegisterReject)) == 1


@pytest.mark.parametrize("given", [3, 5])
def test_a_destination_list_of_another_length_than_the_room_fails_it(given: int) -> None:
    """Longer as well as shorter: a request naming 5 destination pages for a 4-page room would map
    positions the prefill never writes (a planted `<` for `!=` passed the suite)."""
    for order in ("open first", "request first"):
        p = prefill()
        p.receive(register(), 0.0)
        if order == "open first":
            p.open_room(ROOM, num_pages=4, aux_row=None, now=0.0)
        p.receive(request(list(range(10, 10 + given))), 0.1)
        if order == "request first":
            p.open_room(ROOM, num_pages=4, aux_row=None, now=0.2)
        assert p.poll(ROOM) is KVPoll.Failed, order
        assert f"gave {given} destination pages" in (p.failure(ROOM) or ""), order
