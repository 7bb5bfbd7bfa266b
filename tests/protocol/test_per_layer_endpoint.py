"""Per-layer writes inside the prefill endpoint: a context counts as in flight from its first write,
so AbortAck, the RegisterAck of a restarted decode rank, Success and ``may_write`` all wait for it;
each decode rank is told the bytes written to it, not the room's total."""

from __future__ import annotations

import numpy as np
import pytest

from pdkv.errors import InvalidArgumentError, MappingError
from pdkv.mapping import LayerKey, ModelRole
from pdkv.protocol.config import Timeouts
from pdkv.protocol.effects import (
    ChunkSpec,
    DropLayers,
    FenceWrite,
    PeerKey,
    PrefillEffect,
    SubmitChunk,
    SubmitFence,
)
from pdkv.protocol.ids import Epoch, RoomId, SessionId
from pdkv.protocol.layers import LayerContext, Verdict
from pdkv.protocol.machines import PerLayerState, PerLayerTrigger
from pdkv.protocol.machines._prefill_side import SenderRoom
from pdkv.protocol.messages import (
    Abort,
    AbortAck,
    Origin,
    Outcome,
    RankCoord,
    RegisterAck,
    TransferMetricData,
    TransferStatus,
)
from pdkv.protocol.poll import KVPoll
from pdkv.protocol.prefill import PrefillEndpoint
from pdkv.testing.endpoint_pair import EndpointPair, RoomPlan
from tests.protocol.helpers import DECODE, PREFILL, ROOM, layout, prefill, register, request, sent

PAGE = 16
LAYER = LayerKey(model=ModelRole.TARGET, layer_id=0)


def _context(p: PrefillEndpoint, start_token: int, pages: int, now: float) -> LayerContext[object]:
    """A per-layer context of ROOM for ``pages`` pages at ``start_token``, ruled and registered by
    the endpoint (one layer expected), not writing yet."""
    src = np.arange(start_token // PAGE, start_token // PAGE + pages, dtype=np.int64)
    ruling = p.layer_destinations(ROOM, src, start_token)
    assert not isinstance(ruling, str), ruling
    context = p.layer_register(
        ROOM, start_token, pages=src, destinations=ruling, expected=frozenset({LAYER}), work=None, now=now
    )
    assert isinstance(context, LayerContext), context
    return context


def _started(p: PrefillEndpoint, start_token: int, pages: int, now: float) -> LayerContext[object]:
    """As ``_context``, and its first write consented: it counts as in flight from now on."""
    context = _context(p, start_token, pages, now)
    assert p.layer_first_write(context, now)
    return context


def _ended(
    p: PrefillEndpoint,
    context: LayerContext[object],
    now: float,
    *,
    fences: dict[PeerKey, FenceWrite] | None = None,
) -> list[PrefillEffect]:
    """Every write of ``context`` ended: a stopped one is dropped, a live one had its layer submitted
    to every destination and finished by send() (COMPLETE), as the runtime's finisher does."""
    if context.state in (PerLayerState.CANCELLING, PerLayerState.FAILING):
        return p.layer_ended(context, PerLayerTrigger.DROP, now, fences=fences)
    for peer in context.peers:
        p.layers.submitted(context, LAYER, peer)
    assert p.layers.begin_finish(context, context.pages, now) is Verdict.COMPLETE
    return p.layer_ended(context, PerLayerTrigger.COMPLETE, now, fences=fences)


def _writing(pages: int = 2) -> tuple[PrefillEndpoint, LayerContext[object]]:
    """ROOM open and requested, with the per-layer context of its first chunk writing."""
    p = prefill()
    p.receive(register(), 0.0)
    p.open_room(ROOM, num_pages=pages, aux_row=None, now=0.0)
    p.receive(request(list(range(5, 5 + pages))), 0.0)
    return p, _started(p, 0, 1, 0.1)


def test_a_restarted_decode_rank_gets_its_register_ack_only_after_layer_writes_ended() -> None:
    p, context = _writing()
    assert p.in_flight(ROOM) == 1 and p.may_write(ROOM)
    reborn = Origin(instance=DECODE.instance, epoch=Epoch(2), rank=DECODE.rank)
    effects = p.receive(register(origin=reborn), 1.0)
    assert sent(effects, RegisterAck) == []  # its old incarnation's memory may still be written
    assert p.poll(ROOM) is KVPoll.Failed
    assert context.state is PerLayerState.CANCELLING  # the failed room stopped it: drained next
    assert [e for e in effects if isinstance(e, DropLayers)] == [
        DropLayers(room=ROOM, reason=p.failure(ROOM) or "")
    ]
    effects = _ended(p, context, 2.0)
    assert sent(effects, RegisterAck) == [RegisterAck(origin=p.origin)]


def test_abort_ack_waits_for_the_layer_writes_of_the_room() -> None:
    p, context = _writing()
    later = _context(p, PAGE, 1, 0.5)  # registered, not writing yet
    effects = p.receive(Abort(origin=DECODE, room=ROOM, reason="client left"), 1.0)
    assert sent(effects, AbortAck) == [] and p.may_write(ROOM)
    assert not p.layer_first_write(later, 1.1)  # a failed room starts no new context
    assert later.state is PerLayerState.CANCELLING and p.in_flight(ROOM) == 1
    assert p.layer_ended(later, PerLayerTrigger.DROP, 1.2) == []  # it never wrote: nothing to tell
    effects = _ended(p, context, 2.0)
    assert sent(effects, AbortAck) == [AbortAck(origin=p.origin, room=ROOM)]
    assert not p.may_write(ROOM)


def test_success_waits_for_a_context_whose_chunk_was_never_sent() -> None:
    p, own = _writing(2)
    orphan = _started(p, PAGE, 1, 0.2)  # an orphan: chunk@16 is never sent
    [submit] = p.queue_chunk(ROOM, ChunkSpec(pages=[0, 1], start_token=0, last=True), 0.3)
    assert isinstance(submit, SubmitChunk)
    assert p.start_chunk(ROOM, 0, 0.4)
    assert _ended(p, own, 0.45) == []  # the sent chunk's own context
    effects = p.chunk_done(ROOM, 0, TransferMetricData(pages=2, bytes=200), 0.5)
    assert sent(effects, TransferStatus) == []
    assert [e for e in effects if isinstance(e, DropLayers)] == [
        DropLayers(room=ROOM, reason="room complete; per-layer chunk(s) @[16] were never sent")
    ]
    assert p.poll(ROOM) is KVPoll.Transferring and p.may_write(ROOM)
    assert orphan.state is PerLayerState.CANCELLING
    effects = _ended(p, orphan, 0.6)
    [status] = sent(effects, TransferStatus)
    assert isinstance(status, TransferStatus) and status.outcome is Outcome.SUCCESS
    assert p.poll(ROOM) is KVPoll.Success and not p.may_write(ROOM)


def test_each_decode_rank_is_told_only_what_was_written_to_it() -> None:
    p = prefill()
    second = Origin(instance=DECODE.instance, epoch=DECODE.epoch, rank=RankCoord(tp=1))
    p.receive(register(), 0.0)
    p.receive(register(origin=second), 0.0)
    p.open_room(ROOM, num_pages=4, aux_row=None, now=0.0)
    p.receive(request([1, 2, 3, 4], required=2), 0.0)
    p.receive(request([1, 2, 3, 4], required=2, origin=second), 0.0)
    [submit] = p.queue_chunk(ROOM, ChunkSpec(pages=[0, 1, 2, 3], start_token=0, last=True), 0.1)
    assert isinstance(submit, SubmitChunk) and len(submit.destinations) == 2
    p.start_chunk(ROOM, 0, 0.2)
    shares = {
        (DECODE.instance, DECODE.rank): TransferMetricData(pages=4, bytes=400, seconds=0.1),
        (second.instance, second.rank): TransferMetricData(pages=4, bytes=440, seconds=0.2),
    }
    total = TransferMetricData(pages=8, bytes=840, seconds=0.2)
    effects = p.chunk_done(ROOM, 0, total, 0.3, per_peer=shares)
    statuses = [m for m in sent(effects, TransferStatus) if isinstance(m, TransferStatus)]
    assert sorted(m.metric.bytes for m in statuses) == [400, 440]  # not 840 each
    assert [m.metric.pages for m in statuses] == [4, 4]


def _aborted_per_layer_room(pair: EndpointPair) -> None:
    pair.connect()
    pair.run(until=0.5)
    plan = RoomPlan(room=RoomId(9), num_pages=4, chunk_pages=(2, 2), abort_decode_at=0.6, per_layer=True)
    pair.add_room(plan)
    pair.settle()


def test_the_pair_checker_sees_per_layer_writes_and_the_real_endpoint_waits_for_them() -> None:
    pair = EndpointPair(timeouts=Timeouts(abort_ack=5), transfer_time=0.05)
    _aborted_per_layer_room(pair)
    assert pair.violations == []
    assert pair.decode.release_ready(RoomId(9)) and pair.decode.release_was_safe(RoomId(9))


def test_a_planted_bug_acking_before_the_layers_drained_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def forgetful(self: PrefillEndpoint, room: SenderRoom) -> int:
        return room.chunks_in_flight  # the bug: a context's writes are not counted in flight

    monkeypatch.setattr(PrefillEndpoint, "writes_in_flight", forgetful)
    pair = EndpointPair(timeouts=Timeouts(abort_ack=5), transfer_time=0.05)
    _aborted_per_layer_room(pair)
    assert pair.violations, "an AbortAck sent while layer writes ran must show as a violation"
    assert "writes layers" in pair.violations[0].what


def test_the_endpoint_rules_which_chunks_go_per_layer() -> None:
    p = prefill()
    p.receive(register(), 0.0)
    p.open_room(ROOM, num_pages=4, aux_row=None, now=0.0)
    pages = np.array([7, 8])
    assert "no destinations yet" in str(p.layer_destinations(ROOM, pages, 0))
    p.receive(request([10, 11, 12, 13]), 0.1)
    ruling = p.layer_destinations(ROOM, pages, 0)
    assert not isinstance(ruling, str) and [d.peer.key for d in ruling] == [(DECODE.instance, DECODE.rank)]
    _context(p, 0, 2, 0.15)  # the room's first context, at the decode's prefix
    with pytest.raises(MappingError, match="runs past the request's last page"):
        p.layer_destinations(ROOM, np.array([1, 2, 3]), 2 * PAGE)
    p.queue_chunk(ROOM, ChunkSpec(pages=[7, 8], start_token=0, last=False), 0.2)
    with pytest.raises(MappingError, match="overlaps chunks already queued"):
        p.layer_destinations(ROOM, np.array([1, 2]), PAGE)
    assert not isinstance(p.layer_destinations(ROOM, np.array([1, 2]), 2 * PAGE), str)


def test_a_first_per_layer_chunk_must_start_at_the_decode_prefix() -> None:
    # Seams issue, item 2, at registration: the first context of a room starting past the decode's
    # prefix would leave those positions unwritten; a later context (the forward of chunk N+1 may
    # register before chunk N was sent) may start further on.
    p = prefill()
    p.receive(register(), 0.0)
    p.open_room(ROOM, num_pages=8, aux_row=None, now=0.0)
    p.receive(request(list(range(10, 18))), 0.1)
    with pytest.raises(MappingError, match=r"first chunk .* past the decode's prefix .* 0\.\.3 would never"):
        p.layer_destinations(ROOM, np.arange(4, 8), 4 * PAGE)
    _context(p, 0, 4, 0.2)  # the room's first context starts at the prefix
    assert not isinstance(p.layer_destinations(ROOM, np.arange(4, 8), 4 * PAGE), str)


def test_a_dummy_rank_goes_monolithic_and_several_destinations_are_each_named() -> None:
    dummy = prefill()
    dummy.receive(register(), 0.0)
    dummy.open_room(ROOM, num_pages=2, aux_row=None, now=0.0)
    dummy.receive(request((), dummy=True), 0.1)
    assert "dummy" in str(dummy.layer_destinations(ROOM, np.array([1, 2]), 0))
    fan = prefill()
    second = Origin(instance=DECODE.instance, epoch=DECODE.epoch, rank=RankCoord(tp=1))
    fan.receive(register(), 0.0)
    fan.receive(register(origin=second), 0.0)
    fan.open_room(ROOM, num_pages=2, aux_row=None, now=0.0)
    fan.receive(request([1, 2], required=2), 0.1)
    fan.receive(request([1, 2], required=2, origin=second), 0.1)
    ruling = fan.layer_destinations(ROOM, np.array([1, 2]), 0)
    assert not isinstance(ruling, str)
    assert [d.peer.key for d in ruling] == [
        (DECODE.instance, DECODE.rank),
        (DECODE.instance, RankCoord(tp=1)),
    ]


def test_the_pairs_per_layer_rooms_go_through_the_layer_book_and_its_writes_are_seen() -> None:
    """A per-layer room of two chunks in the pair: each chunk registers before its forward, each
    layer is written when the forward reports it, send() finishes the context, the room succeeds."""
    pair = EndpointPair(transfer_time=0.05)
    pair.connect()
    pair.run(until=0.5)
    pair.add_room(RoomPlan(room=RoomId(4), num_pages=4, chunk_pages=(2, 2), per_layer=True))
    pair.settle()
    assert pair.violations == []
    assert pair.decode.poll(RoomId(4)) is KVPoll.Success
    assert pair.prefills[0].poll(RoomId(4)) is KVPoll.Success
    stats = pair.prefills[0].layers.statistics()
    layers = len(pair.layout.kv_buffers)
    assert (stats.registered, stats.finished, stats.failed, stats.dropped) == (2, 2, 0, 0)
    assert stats.layers_submitted == 2 * layers
    assert pair.writes_started == 2 * layers  # layer writes only: no chunk was written whole


def test_success_waits_for_the_fence_of_an_orphan_context_whose_write_failed() -> None:
    """Seams issue, item 6: every chunk is done while a per-layer context that no sent chunk finished
    (an orphan) still writes; its write then fails. Bytes of that write may still be queued in the
    engine, so the room used to report Success with a fence still owed. Success now waits for it."""
    p = prefill()
    p.receive(register(), 0.0)
    p.open_room(ROOM, num_pages=2, aux_row=None, now=0.0)
    p.receive(request([5, 6]), 0.0)
    own = _context(p, 0, 1, 0.05)  # the first chunk's context, which never writes
    orphan = _started(p, PAGE, 1, 0.1)  # registered for a chunk at position 1, never sent
    queued = p.queue_chunk(ROOM, ChunkSpec(pages=[3, 4], start_token=0, last=True), 0.2)
    [submit] = [e for e in queued if isinstance(e, SubmitChunk)]
    assert p.start_chunk(ROOM, submit.chunk, 0.3)
    effects = p.chunk_done(ROOM, submit.chunk, TransferMetricData(pages=2), 0.4)
    assert any(isinstance(e, DropLayers) for e in effects) and p.poll(ROOM) is KVPoll.Transferring
    assert own.state is orphan.state is PerLayerState.CANCELLING
    key = (DECODE.instance, DECODE.rank)
    fence = FenceWrite(session=SessionId("d:1"), src=0x1000, dst=0x2000, length=64)
    effects = _ended(p, orphan, 0.5, fences={key: fence})
    owed = SubmitFence(room=ROOM, peer=key, fence=fence)
    assert [e for e in effects if isinstance(e, SubmitFence)] == [owed]
    assert p.poll(ROOM) is KVPoll.Transferring and sent(effects, TransferStatus) == []
    effects = p.fence_done(ROOM, key, False, "link down", 0.6)  # a failed fence is retried, no Success
    assert p.poll(ROOM) is KVPoll.Transferring and sent(effects, TransferStatus) == []
    retry = p.next_deadline()
    assert retry is not None
    effects = p.tick(retry)
    assert [e for e in effects if isinstance(e, SubmitFence)] == [owed]
    effects = p.fence_done(ROOM, key, True, "", retry + 0.1)
    assert p.poll(ROOM) is KVPoll.Success
    [status] = sent(effects, TransferStatus)
    assert isinstance(status, TransferStatus) and status.outcome is Outcome.SUCCESS
    assert sent(effects, AbortAck) == []  # the decode never aborted: no AbortAck for it


def test_a_fence_success_waited_for_sends_no_abort_ack_once_the_room_failed_here() -> None:
    """Rules as rows: a fence written for Success (every chunk done, an orphan context's write had
    failed) that completes after the prefill's scheduler aborted the room used to send the decode an
    AbortAck it never asked for, before the decode had even heard of the failure. The fence now
    answers only a rank that asked (the abort handshake's ``fenced`` row), and the room stays
    Failed with the scheduler's reason."""
    p = prefill()
    p.receive(register(), 0.0)
    p.open_room(ROOM, num_pages=2, aux_row=None, now=0.0)
    p.receive(request([5, 6]), 0.0)
    own = _context(p, 0, 1, 0.05)
    orphan = _started(p, PAGE, 1, 0.1)
    [submit] = [
        e
        for e in p.queue_chunk(ROOM, ChunkSpec(pages=[3, 4], start_token=0, last=True), 0.2)
        if isinstance(e, SubmitChunk)
    ]
    assert p.start_chunk(ROOM, submit.chunk, 0.3)
    p.chunk_done(ROOM, submit.chunk, TransferMetricData(pages=2), 0.4)
    key = (DECODE.instance, DECODE.rank)
    fence = FenceWrite(session=SessionId("d:1"), src=0x1000, dst=0x2000, length=64)
    effects = _ended(p, orphan, 0.5, fences={key: fence})
    assert [e for e in effects if isinstance(e, SubmitFence)] == [
        SubmitFence(room=ROOM, peer=key, fence=fence)
    ]
    assert p.room_history(ROOM)[-1].name == "COMPLETING"
    assert not p.layer_first_write(own, 0.55)  # no context writes once every chunk is done
    assert own.state is PerLayerState.CANCELLING
    p.abort_room(ROOM, "operator", 0.6)
    effects = p.fence_done(ROOM, key, True, "", 0.7)
    assert sent(effects, AbortAck) == [] and p.poll(ROOM) is KVPoll.Failed
    # The decode's Abort (it was told Failed) is answered, and says the fence drained the queue.
    effects = p.receive(Abort(origin=DECODE, room=ROOM, reason="told failed"), 0.8)
    assert sent(effects, AbortAck) == [AbortAck(origin=p.origin, room=ROOM, fenced=True)]


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "60"])
def test_a_per_layer_finish_timeout_it_cannot_honour_is_refused_by_name(bad: object) -> None:
    """A NaN or infinite finish deadline never passes and 0 fails every context at send(): refused at
    construction, naming the argument, before the endpoint holds any state."""
    with pytest.raises(InvalidArgumentError, match="layer_finish_timeout_s"):
        PrefillEndpoint(origin=PREFILL, layout=layout(), layer_finish_timeout_s=bad)  # type: ignore[arg-type]  # the bad values are the point
