"""DecodeEndpoint, input by input: registration, requests, statuses, aborts and their acks, deadlines."""

from __future__ import annotations

import pytest

from pdkv.errors import LocalProtocolError
from pdkv.protocol.config import Timeouts
from pdkv.protocol.decode import DecodeEndpoint
from pdkv.protocol.effects import (
    CutConnections,
    DecodeEffect,
    Notice,
    NoticeLevel,
    ReleaseKind,
    ReleasePages,
    Send,
    Target,
)
from pdkv.protocol.ids import Endpoint, Epoch, InstanceId, RoomId, SessionId
from pdkv.protocol.machines import DecodeAbortState, ReceiverRoomState
from pdkv.protocol.messages import (
    Abort,
    AbortAck,
    Origin,
    Outcome,
    RankCoord,
    RankRoute,
    Register,
    RegisterAck,
    RegisterReject,
    RouteTable,
    TransferMetricData,
    TransferRequest,
    TransferStatus,
)
from pdkv.protocol.poll import KVPoll
from tests.protocol.helpers import DECODE, PREFILL, ROOM, decode, layout, route, sent

TARGET = Target(instance=PREFILL.instance, rank=PREFILL.rank)


def ok(origin: Origin = PREFILL, room: RoomId = ROOM) -> TransferStatus:
    return TransferStatus(
        origin=origin, room=room, outcome=Outcome.SUCCESS, metric=TransferMetricData(pages=3, bytes=30)
    )


def failed(reason: str = "boom") -> TransferStatus:
    return TransferStatus(origin=PREFILL, room=ROOM, outcome=Outcome.FAILED, reason=reason)


def ranks_route(*ranks: Origin, tp_size: int, cp_size: int, complete: bool) -> RouteTable:
    """A route table of PREFILL's instance listing ``ranks``, each at ``inproc://<its rank>``."""
    return RouteTable(
        origin=PREFILL,
        tp_size=tp_size,
        cp_size=cp_size,
        page_size=16,
        layout_digest=layout().digest(),
        ranks=[
            RankRoute(
                rank=o.rank, epoch=o.epoch, endpoint=Endpoint(f"inproc://{o.rank}"), session=SessionId("s")
            )
            for o in ranks
        ],
        complete=complete,
    )


def connected(timeouts: Timeouts | None = None) -> DecodeEndpoint:
    d = decode(timeouts)
    d.connect(route(), 0.0)
    d.receive(RegisterAck(origin=PREFILL), 0.0)
    return d


def test_register_is_sent_and_retried_until_acked() -> None:
    d = decode(Timeouts(register_retry=2, heartbeat_interval=10, heartbeat_timeout=40))
    [reg] = sent(d.connect(route(), 0.0))
    assert isinstance(reg, Register) and reg.layout == layout()
    assert d.next_deadline() == 2.0
    assert sent(d.tick(1.9)) == []
    assert sent(d.tick(2.0)) == [reg]
    d.receive(RegisterAck(origin=PREFILL), 2.5)
    assert d.next_deadline() == 12.5  # no more retries; the first heartbeat to the registered rank
    assert sent(d.connect(route(), 3.0)) == []  # idempotent


def test_registration_is_resent_only_to_the_ranks_that_have_not_acked() -> None:
    d = decode(Timeouts(register_retry=2, heartbeat_interval=10, heartbeat_timeout=40))
    second = Origin(instance=PREFILL.instance, epoch=Epoch(1), rank=RankCoord(tp=1, cp=0))
    table = ranks_route(PREFILL, second, tp_size=2, cp_size=1, complete=True)
    assert len(sent(d.connect(table, 0.0), Register)) == 2
    d.receive(RegisterAck(origin=PREFILL), 1.0)
    assert d.next_deadline() == 2.0  # the second rank's resend
    resent = [(e.to, type(e.message)) for e in d.tick(2.0) if isinstance(e, Send)]
    assert resent == [(Endpoint(f"inproc://{second.rank}"), Register)]
    assert d.next_deadline() == 4.0
    d.receive(RegisterAck(origin=second), 3.0)
    assert d.tick(4.0) == []  # both registered: nothing more to resend
    assert d.next_deadline() == 11.0  # the first heartbeat round


def test_requests_wait_for_registration_then_go_out() -> None:
    d = decode()
    d.connect(route(), 0.0)
    assert d.open_room(ROOM, targets=[TARGET], dst_pages=[5, 6, 7], dst_aux_row=1, now=0.0) == []
    assert d.poll(ROOM) is KVPoll.Bootstrapping
    [req] = sent(d.receive(RegisterAck(origin=PREFILL), 0.1), TransferRequest)
    assert isinstance(req, TransferRequest)
    assert req.dst_pages.tolist() == [5, 6, 7] and req.dst_aux_row == 1 and not req.dummy
    assert d.poll(ROOM) is KVPoll.WaitingForInput


def test_success_needs_every_required_rank() -> None:
    d = decode()
    second = Origin(instance=PREFILL.instance, epoch=Epoch(1), rank=RankCoord(tp=0, cp=1))
    dummy = Origin(instance=PREFILL.instance, epoch=Epoch(1), rank=RankCoord(tp=1, cp=0))
    d.connect(ranks_route(PREFILL, second, dummy, tp_size=2, cp_size=2, complete=False), 0.0)
    for o in (PREFILL, second, dummy):
        d.receive(RegisterAck(origin=o), 0.0)
    targets = [
        TARGET,
        Target(instance=second.instance, rank=second.rank),
        Target(instance=dummy.instance, rank=dummy.rank, dummy=True),
    ]
    effects = d.open_room(ROOM, targets=targets, dst_pages=[1, 2, 3], dst_aux_row=None, now=0.0)
    requests = [m for m in sent(effects, TransferRequest) if isinstance(m, TransferRequest)]
    assert [r.dummy for r in requests] == [False, False, True]
    assert requests[2].dst_pages.size == 0
    d.receive(ok(), 1.0)
    assert d.poll(ROOM) is KVPoll.Transferring
    d.receive(ok(), 1.1)  # duplicate changes nothing
    assert d.poll(ROOM) is KVPoll.Transferring
    d.receive(ok(dummy), 1.15)  # a dummy's success is not one of the two that count
    assert d.poll(ROOM) is KVPoll.Transferring
    d.receive(ok(second), 1.2)
    assert d.poll(ROOM) is KVPoll.Success and d.release_ready(ROOM)
    assert set(d.metric(ROOM)) == {TARGET.key, (second.instance, second.rank)}


def test_failed_status_aborts_and_pages_wait_for_ack() -> None:
    d = connected()
    d.open_room(ROOM, targets=[TARGET], dst_pages=[1, 2, 3], dst_aux_row=None, now=0.0)
    effects = d.receive(failed("engine said -1"), 1.0)
    [abort] = sent(effects, Abort)
    assert isinstance(abort, Abort) and "engine said -1" in abort.reason
    assert d.poll(ROOM) is KVPoll.Failed
    assert not d.release_ready(ROOM)
    released = d.receive(AbortAck(origin=PREFILL, room=ROOM), 2.0)
    assert released == [
        ReleasePages(room=ROOM, kind=ReleaseKind.ACKED, reason="all prefill ranks acknowledged the abort")
    ]
    assert d.abort_state(ROOM) is DecodeAbortState.RELEASED
    d.close_room(ROOM, 1.0)
    assert ROOM not in d.rooms()


def test_abort_is_resent_with_backoff_then_quarantined_then_released_unsafely_at_the_bound() -> None:
    d = connected(
        Timeouts(abort_ack=5, quarantine=100, abort_resend=1, heartbeat_interval=1000, heartbeat_timeout=4000)
    )
    d.open_room(ROOM, targets=[TARGET], dst_pages=[1, 2, 3], dst_aux_row=None, now=0.0)
    assert len(sent(d.abort_room(ROOM, "client left", 1.0), Abort)) == 1
    # Resent at +1, +2, +4 s after the first (doubling) while no AbortAck comes.
    assert d.next_deadline() == 2.0
    resent = [t for t in (2.0, 4.0, 8.0) if sent(d.tick(t), Abort)]
    assert resent == [2.0, 4.0, 8.0]
    assert d.statistics().aborts_resent == 3
    # The ack wait (5 s) ended at 6.0: quarantined, pages still held, figures exposed.
    assert d.abort_state(ROOM) is DecodeAbortState.QUARANTINED
    assert not d.release_ready(ROOM)
    stats = d.statistics()
    assert (stats.rooms_quarantined, stats.pages_quarantined, stats.quarantines) == (1, 3, 1)
    assert stats.unsafe_releases == 0
    effects = d.tick(101.0)  # the quarantine bound (6 + 100 s) has not passed
    assert [e for e in effects if isinstance(e, ReleasePages)] == []
    effects = d.tick(106.0)
    assert [e for e in effects if isinstance(e, ReleasePages)] == [
        ReleasePages(
            room=ROOM,
            kind=ReleaseKind.UNSAFE,
            reason=f"quarantine timeout ({PREFILL.instance}:{PREFILL.rank})",
        )
    ]
    assert d.release_ready(ROOM) and not d.release_was_safe(ROOM)
    assert d.abort_state(ROOM) is DecodeAbortState.TIMED_OUT
    assert d.statistics().unsafe_releases == 1 and d.statistics().rooms_quarantined == 0
    # A late ack changes nothing and is counted as late.
    d.receive(AbortAck(origin=PREFILL, room=ROOM), 107.0)
    assert d.statistics().late_messages == 1


def test_a_late_ack_returns_quarantined_pages_safely_after_they_settle() -> None:
    d = connected(
        Timeouts(
            abort_ack=5, quarantine=100, quarantine_settle=20, heartbeat_interval=1000, heartbeat_timeout=4000
        )
    )
    d.open_room(ROOM, targets=[TARGET], dst_pages=[1, 2], dst_aux_row=None, now=0.0)
    d.abort_room(ROOM, "client left", 1.0)
    d.tick(6.0)
    assert d.abort_state(ROOM) is DecodeAbortState.QUARANTINED
    effects = d.receive(AbortAck(origin=PREFILL, room=ROOM), 50.0)
    # Acknowledged, but a rank that was cut off may have bytes stuck in its TCP send buffer: the
    # pages settle first (quarantine_settle) and only then come back.
    assert [e for e in effects if isinstance(e, ReleasePages)] == [] and not d.release_ready(ROOM)
    assert d.next_deadline() == 50.0 + d.timeouts.quarantine_settle
    effects = d.tick(50.0 + d.timeouts.quarantine_settle)
    assert (
        ReleasePages(room=ROOM, kind=ReleaseKind.SETTLED, reason="acknowledged, then settled (not proven)")
        in effects
    )
    assert d.release_ready(ROOM) and d.release_was_safe(ROOM)
    stats = d.statistics()
    assert (stats.rooms_quarantined, stats.quarantines_released, stats.unsafe_releases) == (0, 1, 0)


def _quarantined_and_acked(cuts: bool) -> tuple[DecodeEndpoint, list[DecodeEffect]]:
    d = DecodeEndpoint(
        origin=DECODE,
        tp_size=1,
        endpoint=Endpoint("inproc://d"),
        session=SessionId("d:1"),
        layout=layout(),
        timeouts=Timeouts(
            abort_ack=5, quarantine=100, quarantine_settle=20, heartbeat_interval=1000, heartbeat_timeout=4000
        ),
        cuts_connections=cuts,
    )
    d.connect(route(), 0.0)
    d.receive(RegisterAck(origin=PREFILL), 0.0)
    d.open_room(ROOM, targets=[TARGET], dst_pages=[1, 2], dst_aux_row=None, now=0.0)
    d.abort_room(ROOM, "client left", 1.0)
    d.tick(6.0)
    assert d.abort_state(ROOM) is DecodeAbortState.QUARANTINED
    return d, d.receive(AbortAck(origin=PREFILL, room=ROOM), 50.0)


def test_a_quarantined_room_is_released_once_its_prefill_hosts_connections_are_cut() -> None:
    d, effects = _quarantined_and_acked(cuts=True)
    # The route's prefill session is "p:1": its host's engine connections are cut first.
    assert effects == [CutConnections(room=ROOM, hosts=("p",))]
    assert not d.release_ready(ROOM)
    assert d.receive(AbortAck(origin=PREFILL, room=ROOM), 50.1) == []  # a duplicate while cutting
    released = d.connections_cut(ROOM, True, "", 50.5)
    assert (
        ReleasePages(room=ROOM, kind=ReleaseKind.CUT, reason="acknowledged after fences; connections cut")
        in released
    )
    assert d.release_ready(ROOM) and d.release_was_safe(ROOM)
    stats = d.statistics()
    assert (stats.quarantines_released, stats.quarantines_proven, stats.unsafe_releases) == (1, 1, 0)


def test_a_failed_cut_falls_back_to_the_settle_time() -> None:
    d, _ = _quarantined_and_acked(cuts=True)
    [notice] = d.connections_cut(ROOM, False, "SOCK_DESTROY refused: Operation not permitted", 50.5)
    assert isinstance(notice, Notice) and "Operation not permitted" in notice.text
    assert not d.release_ready(ROOM)
    assert d.next_deadline() == 50.5 + 20
    d.tick(70.5)
    assert d.release_ready(ROOM) and d.release_was_safe(ROOM)
    assert d.statistics().quarantines_proven == 0


def test_without_cutting_the_acked_quarantine_settles() -> None:
    d, effects = _quarantined_and_acked(cuts=False)
    assert not [e for e in effects if isinstance(e, CutConnections)]
    assert d.next_deadline() == 70.0


def test_abort_before_registration_releases_at_once() -> None:
    d2 = decode()
    d2.connect(route(), 0.0)
    d2.open_room(ROOM, targets=[TARGET], dst_pages=[1], dst_aux_row=None, now=0.0)
    effects = d2.abort_room(ROOM, "early", 0.5)
    assert (
        ReleasePages(room=ROOM, kind=ReleaseKind.NOTHING_SENT, reason="no prefill rank had the destinations")
        in effects
    )
    assert sent(effects, Abort) == []  # the peer never acked registration: it cannot know the room


def test_dummy_only_room_fails_loudly() -> None:
    d = connected()
    d.open_room(
        ROOM,
        targets=[Target(instance=PREFILL.instance, rank=PREFILL.rank, dummy=True)],
        dst_pages=[1],
        dst_aux_row=None,
        now=0.0,
    )
    assert d.poll(ROOM) is KVPoll.Failed
    assert d.failure(ROOM) == "room has no transfer destination: every target prefill rank is a dummy"


def test_unknown_target_and_duplicate_room_and_early_close() -> None:
    d = connected()
    stranger = Target(instance=InstanceId("elsewhere"), rank=RankCoord(tp=0))
    d.open_room(RoomId(1), targets=[stranger], dst_pages=[1], dst_aux_row=None, now=0.0)
    assert "unknown (connect() first)" in (d.failure(RoomId(1)) or "")
    d.open_room(ROOM, targets=[TARGET], dst_pages=[1], dst_aux_row=None, now=0.0)
    with pytest.raises(LocalProtocolError, match="already opened"):
        d.open_room(ROOM, targets=[TARGET], dst_pages=[1], dst_aux_row=None, now=0.0)
    with pytest.raises(LocalProtocolError, match="before its pages were safe"):
        d.close_room(ROOM, 1.0)


def test_rejection_fails_rooms_with_the_reason() -> None:
    d = decode()
    d.connect(route(), 0.0)
    d.open_room(ROOM, targets=[TARGET], dst_pages=[1], dst_aux_row=None, now=0.0)
    d.receive(RegisterReject(origin=PREFILL, reason="target kv layer ids differ: [0, 1] vs [0, 1, 2]"), 0.1)
    assert d.poll(ROOM) is KVPoll.Failed
    assert "[0, 1] vs [0, 1, 2]" in (d.failure(ROOM) or "")
    d.open_room(RoomId(2), targets=[TARGET], dst_pages=[1], dst_aux_row=None, now=0.2)
    assert "rejected registration" in (d.failure(RoomId(2)) or "")


@pytest.mark.parametrize(
    ("state", "limit"),
    [
        (ReceiverRoomState.BOOTSTRAPPING, 10.0),
        (ReceiverRoomState.WAITING_FOR_INPUT, 20.0),
        (ReceiverRoomState.TRANSFERRING, 30.0),
    ],
)
def test_every_non_terminal_state_has_a_deadline(state: ReceiverRoomState, limit: float) -> None:
    d = decode(Timeouts(bootstrap=10, waiting=20, transfer=30, register_retry=1000))
    d.connect(route(), 0.0)
    second = Origin(instance=PREFILL.instance, epoch=Epoch(1), rank=RankCoord(tp=0, cp=1))
    table = RouteTable(
        origin=PREFILL,
        tp_size=1,
        cp_size=2,
        page_size=16,
        layout_digest="x",
        ranks=[
            *route().ranks,
            RankRoute(
                rank=second.rank, epoch=second.epoch, endpoint=Endpoint("inproc://p2"), session=SessionId("s")
            ),
        ],
        complete=True,
    )
    d.connect(table, 0.0)
    targets = [TARGET, Target(instance=second.instance, rank=second.rank)]
    d.open_room(ROOM, targets=targets, dst_pages=[1], dst_aux_row=None, now=0.0)
    if state is not ReceiverRoomState.BOOTSTRAPPING:
        d.receive(RegisterAck(origin=PREFILL), 0.0)
        d.receive(RegisterAck(origin=second), 0.0)
    if state is ReceiverRoomState.TRANSFERRING:
        d.receive(ok(), 0.0)
    assert d.room_history(ROOM)[-1] is state
    d.tick(limit - 0.01)
    assert d.poll(ROOM) is not KVPoll.Failed
    d.tick(limit)
    assert d.poll(ROOM) is KVPoll.Failed
    assert "timeout" in (d.failure(ROOM) or "")


def test_status_for_unknown_room_is_late_not_fatal() -> None:
    d = connected()
    d.receive(ok(room=RoomId(999)), 0.0)
    assert d.statistics().late_messages == 1


def test_abort_for_unknown_room_is_logged_with_its_id() -> None:
    d = connected()
    effects = d.receive(Abort(origin=PREFILL, room=RoomId(999), reason="prefill OOM"), 0.0)
    [notice] = [e for e in effects if isinstance(e, Notice)]
    assert notice.level is NoticeLevel.WARNING and notice.room == RoomId(999)
    assert "abort for unknown room 999" in notice.text and "prefill OOM" in notice.text
    assert sent(effects) == []
    assert d.statistics().aborts_unknown_room == 1 and d.statistics().late_messages == 0
    # An abort for a room that is known but already finished is merely late.
    d.open_room(ROOM, targets=[TARGET], dst_pages=[1], dst_aux_row=None, now=0.0)
    d.receive(ok(), 0.1)
    d.receive(Abort(origin=PREFILL, room=ROOM, reason="x"), 0.2)
    assert d.statistics().late_messages == 1 and d.statistics().aborts_unknown_room == 1


def _aborted(cuts: bool) -> DecodeEndpoint:
    d = DecodeEndpoint(
        origin=DECODE,
        tp_size=1,
        endpoint=Endpoint("inproc://d"),
        session=SessionId("d:1"),
        layout=layout(),
        timeouts=Timeouts(abort_ack=5, quarantine_settle=20, heartbeat_interval=1000, heartbeat_timeout=4000),
        cuts_connections=cuts,
    )
    d.connect(route(), 0.0)
    d.receive(RegisterAck(origin=PREFILL), 0.0)
    d.open_room(ROOM, targets=[TARGET], dst_pages=[1, 2], dst_aux_row=None, now=0.0)
    d.abort_room(ROOM, "client left", 1.0)
    return d


@pytest.mark.parametrize("cuts", [True, False])
def test_an_ack_after_a_failed_write_is_no_proof_so_the_pages_settle_and_say_so(cuts: bool) -> None:
    """Seams issue, item 7: a prefill whose write to us failed acknowledges after a fence, which proves
    its engine queue drained, not that no byte sits in an old connection (the measured late landing
    was 19-30 s after a heal). Within abort_ack, such an ack used to release the pages at once, as if
    proven. They settle now, counted as unproven, also where this rank could cut: a cut fails every
    other write in flight on those connections."""
    d = _aborted(cuts=cuts)
    effects = d.receive(AbortAck(origin=PREFILL, room=ROOM, fenced=True), 2.0)
    assert not [e for e in effects if isinstance(e, (ReleasePages, CutConnections))]
    assert d.abort_state(ROOM) is DecodeAbortState.SETTLING and d.next_deadline() == 22.0
    assert not d.release_ready(ROOM)
    assert not [e for e in d.tick(21.9) if isinstance(e, ReleasePages)]
    [release] = [e for e in d.tick(22.0) if isinstance(e, ReleasePages)]
    assert release.kind is ReleaseKind.SETTLED and not release.kind.proven and release.safe
    assert d.release_kind(ROOM) is ReleaseKind.SETTLED
    stats = d.statistics()
    assert (stats.releases_settled, stats.releases_acked, stats.releases_cut) == (1, 0, 0)


def test_an_ack_without_a_failed_write_is_the_proof() -> None:
    d = _aborted(cuts=True)
    [release] = d.receive(AbortAck(origin=PREFILL, room=ROOM), 2.0)
    assert isinstance(release, ReleasePages) and release.kind is ReleaseKind.ACKED
    assert d.statistics().releases_acked == 1


def test_a_cut_names_the_host_of_every_rank_of_a_quarantined_room() -> None:
    """A quarantined room written by two prefill ranks on two hosts: its cut must end the connections
    from both hosts (a planted cut of the last acking rank's host only passed the suite)."""
    d = DecodeEndpoint(
        origin=DECODE,
        tp_size=1,
        endpoint=Endpoint("inproc://d"),
        session=SessionId("d:1"),
        layout=layout(),
        timeouts=Timeouts(abort_ack=5, quarantine=100, heartbeat_interval=1000, heartbeat_timeout=4000),
        cuts_connections=True,
    )
    ranks = [RankCoord(tp=0, cp=cp) for cp in (0, 1)]
    table = RouteTable(
        origin=PREFILL,
        tp_size=1,
        cp_size=2,
        page_size=16,
        layout_digest=layout().digest(),
        ranks=[
            RankRoute(
                rank=rank,
                epoch=PREFILL.epoch,
                endpoint=Endpoint(f"inproc://p{rank.cp}"),
                session=SessionId(f"host-{rank.cp}:7"),
            )
            for rank in ranks
        ],
        complete=True,
    )
    d.connect(table, 0.0)
    origins = [Origin(instance=PREFILL.instance, epoch=PREFILL.epoch, rank=rank) for rank in ranks]
    for origin in origins:
        d.receive(RegisterAck(origin=origin), 0.0)
    targets = [Target(instance=PREFILL.instance, rank=rank) for rank in ranks]
    d.open_room(ROOM, targets=targets, dst_pages=[1, 2], dst_aux_row=None, now=0.0)
    d.abort_room(ROOM, "client left", 1.0)
    d.tick(6.0)
    assert d.abort_state(ROOM) is DecodeAbortState.QUARANTINED
    assert d.receive(AbortAck(origin=origins[1], room=ROOM), 7.0) == []
    effects = d.receive(AbortAck(origin=origins[0], room=ROOM), 8.0)
    assert effects == [CutConnections(room=ROOM, hosts=("host-0", "host-1"))]
