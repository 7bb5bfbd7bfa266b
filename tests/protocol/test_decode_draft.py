"""DecodeEndpoint and a RegisterAck that leaves draft buffers out: the record keeps it, one WARNING per
pair, rooms report ``draft_skipped``, the level and the counters; a strict decode refuses it."""

from __future__ import annotations

import pytest

from pdkv.errors import InvalidArgumentError
from pdkv.mapping import BufferKey, BufferKind, LayoutPolicy, ModelRole
from pdkv.protocol.config import Timeouts
from pdkv.protocol.decode import DecodeEndpoint
from pdkv.protocol.effects import DecodeEffect, Notice, NoticeLevel, Target
from pdkv.protocol.ids import Epoch, SessionId
from pdkv.protocol.messages import (
    Origin,
    Outcome,
    RankCoord,
    RegisterAck,
    RegisterReject,
    TransferMetricData,
    TransferRequest,
    TransferStatus,
)
from pdkv.protocol.poll import KVPoll
from pdkv.protocol.registration import DraftSkipped
from tests.protocol.helpers import DECODE, DECODE_EP, PREFILL, ROOM, layout, route, sent
from tests.protocol.test_decode import ranks_route

TARGET = Target(instance=PREFILL.instance, rank=PREFILL.rank)
DRAFT_IK = BufferKey(model=ModelRole.DRAFT, kind=BufferKind.INDEX_K, layer_id=0)
DRAFT_KV = BufferKey(model=ModelRole.DRAFT, kind=BufferKind.KV, layer_id=1)
DEGRADED = RegisterAck(origin=PREFILL, prefill_left_out=[DRAFT_IK], decode_left_out=[DRAFT_KV])


def endpoint(policy: LayoutPolicy = LayoutPolicy.DEGRADE_DRAFT) -> DecodeEndpoint:
    return DecodeEndpoint(
        origin=DECODE,
        tp_size=1,
        endpoint=DECODE_EP,
        session=SessionId("d:1"),
        layout=layout(),
        timeouts=Timeouts(heartbeat_interval=5, heartbeat_timeout=20),
        layout_policy=policy,
    )


def warnings(effects: list[DecodeEffect]) -> list[str]:
    """The WARNINGs about draft buffers left out."""
    return [
        e.text
        for e in effects
        if isinstance(e, Notice) and e.level is NoticeLevel.WARNING and "draft-model buffers" in e.text
    ]


def success(origin: Origin = PREFILL) -> TransferStatus:
    return TransferStatus(
        origin=origin, room=ROOM, outcome=Outcome.SUCCESS, metric=TransferMetricData(pages=1, bytes=8)
    )


def test_a_degraded_ack_registers_and_rooms_report_what_they_miss() -> None:
    d = endpoint()
    d.connect(route(), 0.0)
    effects = d.receive(DEGRADED, 0.1)
    [warning] = warnings(effects)
    assert "p:tp0/cp0 serves this rank without draft-model buffers" in warning
    assert "it sends none of its [draft index_k layer 0] (not registered here)" in warning
    assert "it writes none of this rank's [draft kv layer 1] (not registered there)" in warning
    assert d.peer_ready(TARGET)
    assert d.statistics().registrations_degraded == 1
    assert d.statistics().draft_buffers_skipped == 2
    opened = d.open_room(ROOM, targets=[TARGET], dst_pages=[1, 2], dst_aux_row=0, now=0.2)
    [request] = sent(opened, TransferRequest)
    assert isinstance(request, TransferRequest) and request.room == ROOM  # asked as any room
    skipped = d.draft_skipped(ROOM)
    assert skipped == DraftSkipped(not_written=[DRAFT_KV], not_sent=[DRAFT_IK], peers=["p:tp0/cp0"])
    assert str(skipped) == (
        "draft state not transferred: not written here [draft kv layer 1], not sent by p:tp0/cp0 "
        "[draft index_k layer 0]"
    )
    d.receive(success(), 0.3)
    assert d.poll(ROOM) is KVPoll.Success
    assert d.draft_skipped(ROOM) == skipped  # the scheduler reads it after Success
    assert d.statistics().rooms_draft_skipped == 1


def test_the_warning_is_once_per_pair() -> None:
    d = endpoint()
    d.connect(route(), 0.0)
    assert len(warnings(d.receive(DEGRADED, 0.1))) == 1
    assert warnings(d.receive(DEGRADED, 0.2)) == []  # a duplicate ack
    # It forgets us and we register again: the same answer is no news.
    d.receive(RegisterReject(origin=PREFILL, reason="forgotten", retry=True), 1.0)
    assert d.peer_ready(TARGET) is False
    assert warnings(d.receive(DEGRADED, 1.1)) == []
    assert d.statistics().registrations_degraded == 1
    # A restart with another layout is another pair record: told again.
    reborn = Origin(instance=PREFILL.instance, epoch=Epoch(2), rank=PREFILL.rank)
    again = RegisterAck(origin=reborn, prefill_left_out=[DRAFT_IK])
    assert len(warnings(d.receive(again, 2.0))) == 1
    assert d.statistics().draft_buffers_skipped == 1


def test_a_matching_ack_reports_nothing_skipped() -> None:
    d = endpoint()
    d.connect(route(), 0.0)
    assert warnings(d.receive(RegisterAck(origin=PREFILL), 0.1)) == []
    d.open_room(ROOM, targets=[TARGET], dst_pages=[1], dst_aux_row=None, now=0.2)
    d.receive(success(), 0.3)
    assert d.poll(ROOM) is KVPoll.Success and d.draft_skipped(ROOM) is None
    stats = d.statistics()
    assert (stats.rooms_draft_skipped, stats.draft_buffers_skipped, stats.registrations_degraded) == (0, 0, 0)


def test_a_strict_decode_refuses_a_degraded_ack_naming_both_lists() -> None:
    d = endpoint(LayoutPolicy.STRICT)
    d.connect(route(), 0.0)
    d.open_room(ROOM, targets=[TARGET], dst_pages=[1], dst_aux_row=None, now=0.0)
    effects = d.receive(DEGRADED, 0.1)
    assert sent(effects, TransferRequest) == []  # nothing asked of it
    reason = d.peer_refusal(TARGET)
    assert reason == (
        "this decode's layout policy is strict and prefill rank p:tp0/cp0 would leave out draft buffers: "
        "its own [draft index_k layer 0] (not registered here) and this rank's [draft kv layer 1] "
        "(not registered there)"
    )
    assert d.poll(ROOM) is KVPoll.Failed and reason in (d.failure(ROOM) or "")
    assert d.statistics().draft_buffers_skipped == 0  # not registered: nothing is skipped
    assert not d.peer_ready(TARGET)  # REJECTED: peer_refusal answers only there
    # A plain ack of a strict decode registers as ever.
    d2 = endpoint(LayoutPolicy.STRICT)
    d2.connect(route(), 0.0)
    d2.receive(RegisterAck(origin=PREFILL), 0.1)
    assert d2.peer_ready(TARGET)


def test_dummy_targets_leave_nothing_out() -> None:
    """A dummy rank writes nothing, so what its registration leaves out is not the room's loss."""
    d = endpoint()
    second = Origin(instance=PREFILL.instance, epoch=Epoch(1), rank=RankCoord(tp=1))
    d.connect(ranks_route(PREFILL, second, tp_size=2, cp_size=1, complete=True), 0.0)
    d.receive(RegisterAck(origin=PREFILL), 0.1)
    d.receive(RegisterAck(origin=second, prefill_left_out=[DRAFT_IK]), 0.1)
    dummy = Target(instance=second.instance, rank=second.rank, dummy=True)
    d.open_room(ROOM, targets=[TARGET, dummy], dst_pages=[1], dst_aux_row=None, now=0.2)
    assert d.draft_skipped(ROOM) is None


def test_layout_policy_must_be_a_policy() -> None:
    with pytest.raises(InvalidArgumentError, match="layout_policy must be a LayoutPolicy") as caught:
        DecodeEndpoint(
            origin=DECODE,
            tp_size=1,
            endpoint=DECODE_EP,
            session=SessionId("d:1"),
            layout=layout(),
            layout_policy="strict",  # type: ignore[arg-type]  # the wrong type on purpose
        )
    assert caught.value.argument == "layout_policy"
