"""Liveness, input by input: heartbeats, silent peers, restarts behind the same address, old epochs.

Both endpoints are driven directly (no link) with explicit ``now``; heartbeats run every 1 s and a
peer is lost after 3 s of silence unless a test says otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import pytest

from pdkv.errors import ConfigError
from pdkv.protocol.config import ENV_VARS, Timeouts
from pdkv.protocol.decode import DecodeEndpoint
from pdkv.protocol.effects import (
    ChunkSpec,
    Effect,
    FailureCause,
    ForgetPeer,
    Notice,
    NoticeLevel,
    ReleaseKind,
    ReleasePages,
    RoomFinished,
    Send,
    SubmitChunk,
    Target,
)
from pdkv.protocol.ids import Endpoint, Epoch, RoomId
from pdkv.protocol.machines import DecodeAbortState
from pdkv.protocol.messages import (
    Abort,
    AbortAck,
    Heartbeat,
    HeartbeatAck,
    Origin,
    Outcome,
    RankCoord,
    Register,
    RegisterAck,
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
    PREFILL_EP,
    ROOM,
    decode,
    layout,
    prefill,
    register,
    request,
    route,
    sent,
)

BEATS = Timeouts(heartbeat_interval=1, heartbeat_timeout=3, abort_ack=10, register_retry=0.5)
TARGET = Target(instance=PREFILL.instance, rank=PREFILL.rank)
DECODE_2 = attrs.evolve(DECODE, epoch=Epoch(2))
PREFILL_2 = attrs.evolve(PREFILL, epoch=Epoch(2))
CHUNK = ChunkSpec(pages=[0, 1, 2], start_token=0, last=True)


def sends_to(effects: Sequence[Effect]) -> list[tuple[str, type]]:
    return [(e.to, type(e.message)) for e in effects if isinstance(e, Send)]


def finished(effects: Sequence[Effect]) -> list[RoomFinished]:
    return [e for e in effects if isinstance(e, RoomFinished)]


def forgets(effects: Sequence[Effect]) -> list[ForgetPeer]:
    return [e for e in effects if isinstance(e, ForgetPeer)]


def forget_comes_first(effects: Sequence[Effect], endpoint: str) -> bool:
    """The socket is rebuilt before anything else goes to that endpoint in the same batch."""
    kinds = [
        "forget" if isinstance(e, ForgetPeer) and e.endpoint == endpoint else "send"
        for e in effects
        if (isinstance(e, ForgetPeer) and e.endpoint == endpoint)
        or (isinstance(e, Send) and e.to == endpoint)
    ]
    return bool(kinds) and kinds[0] == "forget" and kinds.count("forget") == 1


# ---------------------------------------------------------------- configuration


def test_heartbeat_defaults_and_their_environment_variables() -> None:
    t = Timeouts()
    assert (t.heartbeat_interval, t.heartbeat_timeout) == (5.0, 30.0)
    assert ENV_VARS["heartbeat_interval"] == "PDKV_HEARTBEAT_INTERVAL"
    assert ENV_VARS["heartbeat_timeout"] == "PDKV_HEARTBEAT_TIMEOUT"
    assert ENV_VARS["abort_ack"] == "PDKV_ABORT_ACK_TIMEOUT"  # the others keep their names
    env = {"PDKV_HEARTBEAT_INTERVAL": "2", "PDKV_HEARTBEAT_TIMEOUT": "9"}
    assert Timeouts.from_env(env) == Timeouts(heartbeat_interval=2, heartbeat_timeout=9)


@pytest.mark.parametrize("field", [f.name for f in attrs.fields(Timeouts)])
def test_every_deadline_is_overridable_from_the_environment(field: str) -> None:
    # 20 s fits every field next to the defaults (heartbeat interval 5 < timeout 30).
    t = Timeouts.from_env({ENV_VARS[field]: "20"})
    assert getattr(t, field) == 20.0
    others = {f.name for f in attrs.fields(Timeouts)} - {field}
    assert all(getattr(t, o) == getattr(Timeouts(), o) for o in others)


def test_heartbeat_timeout_must_exceed_the_interval() -> None:
    with pytest.raises(
        ConfigError, match=r"heartbeat_timeout \(5 s\) must exceed heartbeat_interval \(5 s\)"
    ):
        Timeouts(heartbeat_timeout=5)
    with pytest.raises(ConfigError, match="PDKV_HEARTBEAT_INTERVAL='often'"):
        Timeouts.from_env({"PDKV_HEARTBEAT_INTERVAL": "often"})


# ---------------------------------------------------------------- prefill side


def registered_prefill() -> PrefillEndpoint:
    p = prefill(BEATS)
    assert p.next_deadline() is None  # no decode rank yet: nothing to greet
    p.receive(register(), 0.0)
    return p


def test_prefill_greets_every_registered_decode_rank_each_interval() -> None:
    p = registered_prefill()
    second = Origin(instance=DECODE.instance, epoch=Epoch(1), rank=RankCoord(tp=1))
    p.receive(attrs.evolve(register(origin=second), endpoint=Endpoint("inproc://d1")), 0.2)
    assert p.next_deadline() == 1.0
    beats = sent(p.tick(1.0), Heartbeat)
    assert beats == [Heartbeat(origin=p.origin, seq=1)] * 2
    assert sends_to(p.tick(1.0)) == []  # one round per interval
    p.receive(HeartbeatAck(origin=DECODE, seq=1), 1.1)
    p.receive(HeartbeatAck(origin=second, seq=1), 1.1)
    assert [m.seq for m in sent(p.tick(2.0), Heartbeat) if isinstance(m, Heartbeat)] == [2, 2]
    # A decode rank's own heartbeat is answered, echoing its sequence number.
    assert sent(p.receive(Heartbeat(origin=DECODE, seq=77), 2.5)) == [HeartbeatAck(origin=p.origin, seq=77)]


def test_prefill_forgets_a_silent_decode_rank_and_fails_its_rooms() -> None:
    p = registered_prefill()
    p.open_room(ROOM, num_pages=3, aux_row=None, now=0.0)
    p.receive(request(), 0.0)
    p.receive(TransferRequest(origin=DECODE, room=RoomId(7), dst_pages=[4], required_dst_info_num=1), 0.5)
    p.open_room(RoomId(7), num_pages=1, aux_row=None, now=0.5)
    [submit] = p.queue_chunk(RoomId(7), ChunkSpec(pages=[0], start_token=0, last=True), 0.5)
    assert isinstance(submit, SubmitChunk) and p.start_chunk(RoomId(7), 0, 0.5)
    p.chunk_done(RoomId(7), 0, TransferMetricData(pages=1), 0.6)  # room 7 succeeded before the silence
    # Any message is a sign of life: a HeartbeatAck at 2.5 carries the rank past the rounds at 3, 4 and 5.
    p.receive(HeartbeatAck(origin=DECODE, seq=2), 2.5)
    for now in (3.0, 4.0, 5.0):
        assert forgets(p.tick(now)) == [] and p.poll(ROOM) is KVPoll.WaitingForInput
    effects = p.tick(6.0)  # silent since 2.5: 3.5 s >= 3 s
    assert forgets(effects) == [
        ForgetPeer(endpoint=DECODE_EP, reason=f"decode rank {DECODE.instance}:{DECODE.rank} silent for 3.5 s")
    ]
    assert forget_comes_first(effects, DECODE_EP)
    [fin] = finished(effects)
    assert fin.room == ROOM and fin.cause is FailureCause.PEER_SILENT and "silent for 3.5 s" in fin.reason
    [status] = sent(effects, TransferStatus)  # best effort: it may be alive and merely unheard
    assert isinstance(status, TransferStatus) and status.outcome is Outcome.FAILED
    assert p.poll(RoomId(7)) is KVPoll.Success  # a finished room is not touched
    assert sent(effects, Heartbeat) == [] and p.next_deadline() is None  # nobody left to greet
    assert p.statistics().peers_lost == 1 and p.statistics().peers_registered == 0
    # Forgotten: its heartbeats go unanswered (so it notices), its requests are refused.
    assert sent(p.receive(Heartbeat(origin=DECODE, seq=9), 6.1)) == []
    assert sent(p.receive(request(room=RoomId(8)), 6.1)) == [] and p.statistics().requests_refused == 1
    # It registers again (same epoch): acknowledged, and its abort of the failed room is acked.
    assert sent(p.receive(register(), 7.0)) == [RegisterAck(origin=p.origin)]
    assert sent(p.receive(Abort(origin=DECODE, room=ROOM, reason="silent"), 7.1)) == [
        AbortAck(origin=p.origin, room=ROOM)
    ]


def test_prefill_acks_only_after_in_flight_writes_to_a_silent_rank_end() -> None:
    p = registered_prefill()
    p.open_room(ROOM, num_pages=3, aux_row=None, now=0.0)
    p.receive(request(), 0.0)
    p.queue_chunk(ROOM, CHUNK, 0.0)
    assert p.start_chunk(ROOM, 0, 0.0)
    p.tick(1.0)
    p.tick(2.0)
    p.tick(3.0)  # silent since 0: lost
    assert p.poll(ROOM) is KVPoll.Failed and p.may_write(ROOM)
    # Back with the same epoch while the write is still in flight: no RegisterAck yet.
    effects = p.receive(register(), 3.5)
    assert sent(effects) == [] and any(isinstance(e, Notice) and f"rooms [{ROOM}]" in e.text for e in effects)
    assert sent(p.receive(register(), 4.0)) == []  # its retry is not acked either
    assert sent(p.receive(Abort(origin=DECODE, room=ROOM, reason="x"), 4.1)) == []  # still draining
    done = p.chunk_done(ROOM, 0, TransferMetricData(pages=3), 4.5)
    assert sent(done) == [AbortAck(origin=p.origin, room=ROOM), RegisterAck(origin=p.origin)]


def test_decode_restart_seen_in_any_message_fails_its_rooms_and_forgets_it() -> None:
    p = registered_prefill()
    p.open_room(ROOM, num_pages=3, aux_row=None, now=0.0)
    p.receive(request(), 0.0)
    p.queue_chunk(ROOM, CHUNK, 0.0)
    assert p.start_chunk(ROOM, 0, 0.0)
    effects = p.receive(Heartbeat(origin=DECODE_2, seq=1), 0.5)
    assert forgets(effects) and forget_comes_first(effects, DECODE_EP)
    assert sent(effects) == []  # the new incarnation is not registered: not answered
    [fin] = finished(effects)
    assert fin.cause is FailureCause.PEER_RESTART and "epoch 1 -> 2" in fin.reason
    assert p.statistics().peer_restarts == 1 and p.statistics().peers_registered == 0
    # The new incarnation registers while a write to the old one is in flight: acked once it ends.
    assert sent(p.receive(register(origin=DECODE_2), 0.6)) == []
    assert sent(p.chunk_done(ROOM, 0, TransferMetricData(pages=3), 0.7)) == [RegisterAck(origin=p.origin)]
    # Old-epoch messages are dropped, whatever they are.
    before = p.statistics()
    for old in (
        Heartbeat(origin=DECODE, seq=5),
        HeartbeatAck(origin=DECODE, seq=5),
        Abort(origin=DECODE, room=ROOM, reason="late"),
        register(),
    ):
        assert sent(p.receive(old, 1.0)) == []
    assert sent(p.receive(request(room=RoomId(5)), 1.0)) == []
    after = p.statistics()
    assert after.stale_messages - before.stale_messages == 4
    assert after.requests_refused - before.requests_refused == 1
    assert RoomId(5) not in p.rooms() and after.peers_registered == 1


def test_rejected_re_registration_fails_the_ranks_rooms_instead_of_crashing_later() -> None:
    p = registered_prefill()
    p.open_room(ROOM, num_pages=3, aux_row=None, now=0.0)
    p.receive(request(), 0.0)
    effects = p.receive(register(layout(layers=3)), 0.5)
    [fin] = finished(effects)
    assert fin.cause is FailureCause.INVALID and "rejected layout" in fin.reason
    # The scheduler's next send() finds the room failed: skipped, nothing submitted, no KeyError.
    assert p.queue_chunk(ROOM, CHUNK, 0.6) == []
    assert p.chunk_states(ROOM)[-1].name == "SKIPPED"


# ---------------------------------------------------------------- decode side


def ready_decode(timeouts: Timeouts = BEATS) -> DecodeEndpoint:
    d = decode(timeouts)
    d.connect(route(), 0.0)
    assert sent(d.tick(0.0), Heartbeat) == []  # not registered yet: Register retries, no heartbeat
    d.receive(RegisterAck(origin=PREFILL), 0.0)
    return d


def test_decode_greets_registered_prefill_ranks_and_answers_theirs() -> None:
    d = ready_decode()
    assert d.next_deadline() == 1.0
    assert sends_to(d.tick(1.0)) == [(PREFILL_EP, Heartbeat)]
    assert sent(d.receive(Heartbeat(origin=PREFILL, seq=4), 1.2)) == [HeartbeatAck(origin=DECODE, seq=4)]
    assert sent(d.receive(HeartbeatAck(origin=PREFILL, seq=1), 1.2)) == []


def test_decode_silent_prefill_fails_rooms_but_pages_wait_for_its_ack() -> None:
    d = ready_decode()
    d.open_room(ROOM, targets=[TARGET], dst_pages=[1, 2, 3], dst_aux_row=None, now=0.0)
    d.receive(
        TransferStatus(origin=PREFILL, room=RoomId(99), outcome=Outcome.SUCCESS), 1.5
    )  # late, but alive
    for now in (1.0, 2.0, 3.0, 4.0):
        assert d.poll(ROOM) is KVPoll.WaitingForInput and forgets(d.tick(now)) == []
    effects = d.tick(5.0)  # silent since 1.5
    assert forgets(effects) == [
        ForgetPeer(
            endpoint=PREFILL_EP, reason=f"prefill rank {PREFILL.instance}:{PREFILL.rank} silent for 3.5 s"
        )
    ]
    assert forget_comes_first(effects, PREFILL_EP)
    assert sends_to(effects) == [(PREFILL_EP, Abort), (PREFILL_EP, Register)]
    [fin] = finished(effects)
    assert fin.cause is FailureCause.PEER_SILENT
    # Silence proves nothing about writes: the pages are not released.
    assert d.poll(ROOM) is KVPoll.Failed and not d.release_ready(ROOM)
    assert d.statistics().peers_lost == 1 and not d.peer_ready(TARGET)
    assert sent(d.tick(5.5), Register)  # retried until it answers
    # It answers again (same epoch): the Abort is sent again, and its ack releases the pages safely.
    assert sent(d.receive(RegisterAck(origin=PREFILL), 6.0)) == [
        Abort(origin=DECODE, room=ROOM, reason=fin.reason)
    ]
    released = d.receive(AbortAck(origin=PREFILL, room=ROOM), 6.1)
    assert [e for e in released if isinstance(e, ReleasePages)] == [
        ReleasePages(room=ROOM, kind=ReleaseKind.ACKED, reason="all prefill ranks acknowledged the abort")
    ]


def test_decode_silent_prefill_that_never_returns_is_quarantined_then_released_at_the_bound() -> None:
    d = ready_decode()
    d.open_room(ROOM, targets=[TARGET], dst_pages=[1, 2, 3], dst_aux_row=None, now=0.0)
    for now in (1.0, 2.0, 3.0):
        d.tick(now)
    assert d.poll(ROOM) is KVPoll.Failed and not d.release_ready(ROOM)
    assert d.next_deadline() == 3.5  # the Register retry; the abort-ack deadline is at 13
    for now in (3.5, 4.0, 8.0, 12.9):
        d.tick(now)
    assert not d.release_ready(ROOM)
    # Past the ack wait the pages are quarantined, not released: the rank may still be writing.
    assert [e for e in d.tick(13.0) if isinstance(e, ReleasePages)] == []
    assert d.abort_state(ROOM) is DecodeAbortState.QUARANTINED and not d.release_ready(ROOM)
    assert d.statistics().pages_quarantined == 3
    bound = 13.0 + d.timeouts.quarantine
    assert [e for e in d.tick(bound - 1) if isinstance(e, ReleasePages)] == []
    [release] = [e for e in d.tick(bound) if isinstance(e, ReleasePages)]
    assert not release.safe and d.statistics().unsafe_releases == 1
    assert d.abort_state(ROOM) is DecodeAbortState.TIMED_OUT


def test_decode_prefill_restart_fails_rooms_and_the_new_incarnation_acks_the_abort() -> None:
    d = ready_decode()
    d.open_room(ROOM, targets=[TARGET], dst_pages=[1], dst_aux_row=None, now=0.0)
    effects = d.receive(Heartbeat(origin=PREFILL_2, seq=1), 1.0)
    assert d.poll(ROOM) is KVPoll.Failed and "restarted (epoch 1 -> 2)" in (d.failure(ROOM) or "")
    assert [f.cause for f in finished(effects)] == [FailureCause.PEER_RESTART]
    assert forget_comes_first(effects, PREFILL_EP)
    # Registered with again at once; no Abort yet (it would be dropped as from an unknown rank).
    assert sends_to(effects) == [(PREFILL_EP, Register)]
    assert d.peer_epoch(TARGET) == Epoch(2) and d.statistics().peer_restarts == 1
    # A request may have reached the new process at that address: only its ack releases the pages.
    assert not d.release_ready(ROOM)
    assert sent(d.receive(RegisterAck(origin=PREFILL_2), 1.1)) == [
        Abort(origin=DECODE, room=ROOM, reason=d.failure(ROOM) or "")
    ]
    d.receive(AbortAck(origin=PREFILL_2, room=ROOM), 1.2)
    # The new process knows nothing of the old one's writes, whose bytes may still sit in the sockets
    # it left: its ack is no proof. This rank cannot cut, so the pages settle first.
    assert not d.release_ready(ROOM) and d.abort_state(ROOM) is DecodeAbortState.SETTLING
    # New rooms go to the new incarnation.
    effects = d.open_room(RoomId(2), targets=[TARGET], dst_pages=[2], dst_aux_row=None, now=1.3)
    assert sends_to(effects) == [(PREFILL_EP, TransferRequest)]
    d.tick(1.2 + d.timeouts.quarantine_settle)
    assert d.release_ready(ROOM) and d.release_kind(ROOM) is ReleaseKind.SETTLED


def test_decode_restart_found_through_silence_then_register_ack_of_the_new_epoch() -> None:
    d = ready_decode()
    d.open_room(ROOM, targets=[TARGET], dst_pages=[1], dst_aux_row=None, now=0.0)
    for now in (1.0, 2.0, 3.0):
        d.tick(now)  # the old process died silently; the new one does not know us
    assert d.statistics().peers_lost == 1 and not d.release_ready(ROOM)
    # Our Register reaches the new process, which answers with its new epoch.
    effects = d.receive(RegisterAck(origin=PREFILL_2), 3.2)
    assert d.peer_ready(TARGET) and d.peer_epoch(TARGET) == Epoch(2)
    # The ack answers our Register: no new Register, just the Abort for the new incarnation.
    assert forget_comes_first(effects, PREFILL_EP)
    assert sent(effects) == [Abort(origin=DECODE, room=ROOM, reason=d.failure(ROOM) or "")]
    d.receive(AbortAck(origin=PREFILL_2, room=ROOM), 3.3)
    assert not d.release_ready(ROOM)  # settles first, as above
    d.tick(3.3 + d.timeouts.quarantine_settle)
    assert d.release_ready(ROOM) and d.release_kind(ROOM) is ReleaseKind.SETTLED


def test_decode_drops_every_old_epoch_message_after_a_restart() -> None:
    d = ready_decode()
    d.open_room(ROOM, targets=[TARGET], dst_pages=[1], dst_aux_row=None, now=0.0)
    d.receive(RegisterAck(origin=PREFILL_2), 0.5)  # restart, and registered with the new incarnation
    d.receive(AbortAck(origin=PREFILL_2, room=ROOM), 0.6)
    before = d.statistics()
    for old in (
        TransferStatus(origin=PREFILL, room=ROOM, outcome=Outcome.SUCCESS),
        AbortAck(origin=PREFILL, room=ROOM),
        Abort(origin=PREFILL, room=RoomId(3), reason="old"),
        Heartbeat(origin=PREFILL, seq=3),
        HeartbeatAck(origin=PREFILL, seq=3),
        RegisterAck(origin=PREFILL),
    ):
        effects = d.receive(old, 1.0)
        assert all(isinstance(e, Notice) and e.level is NoticeLevel.INFO for e in effects)
    assert d.statistics().stale_messages - before.stale_messages == 6
    assert d.peer_epoch(TARGET) == Epoch(2) and d.peer_ready(TARGET)


def test_a_route_table_with_a_new_epoch_rebuilds_the_socket_and_registers() -> None:
    d = ready_decode()
    table = route()
    table = attrs.evolve(table, ranks=[attrs.evolve(table.ranks[0], epoch=Epoch(2))])
    effects = d.connect(table, 1.0)
    assert forget_comes_first(effects, PREFILL_EP)
    assert sends_to(effects) == [(PREFILL_EP, Register)] and d.peer_epoch(TARGET) == Epoch(2)


def test_decode_room_without_any_target_fails_loudly() -> None:
    d = ready_decode()
    effects = d.open_room(ROOM, targets=[], dst_pages=[1], dst_aux_row=None, now=0.0)
    [fin] = finished(effects)
    assert fin.cause is FailureCause.NO_DESTINATION
    assert fin.reason == "room has no transfer destination: no target prefill rank was given"
    assert any(isinstance(e, Notice) and e.level is NoticeLevel.WARNING and e.room == ROOM for e in effects)
    assert d.release_ready(ROOM)


def test_register_message_of_helpers_is_what_the_prefill_registers() -> None:
    # Guard for the helpers above: the decode endpoint's own Register is accepted by a prefill.
    d = decode(BEATS)
    [reg] = sent(d.connect(route(), 0.0))
    assert isinstance(reg, Register)
    assert sent(prefill(BEATS).receive(reg, 0.0)) == [RegisterAck(origin=PREFILL)]


# ---------------------------------------------------------------- deadlines that coincide


def test_decode_equal_bootstrap_and_waiting_deadlines_fail_once_and_wait_for_the_ack() -> None:
    # open_room with registered targets sets the bootstrap and then the waiting deadline at the same
    # instant: with equal timeouts both entries fall due together. Acting twice would release the
    # just-failed room's pages at once, unsafely, without waiting abort_ack.
    d = ready_decode(
        Timeouts(bootstrap=4, waiting=4, abort_ack=2, heartbeat_interval=100, heartbeat_timeout=400)
    )
    d.open_room(ROOM, targets=[TARGET], dst_pages=[1], dst_aux_row=None, now=0.0)
    effects = d.tick(4.0)
    assert [f.cause for f in finished(effects)] == [FailureCause.TIMEOUT]
    assert [e for e in effects if isinstance(e, ReleasePages)] == []
    assert d.statistics().unsafe_releases == 0
    assert d.next_deadline() == 5.0  # the first Abort resend (abort_resend 1 s); the ack wait ends at 6


def test_prefill_equal_bootstrap_and_inflight_deadlines_fail_once() -> None:
    # The request creates the room and completes it at the same instant: both deadlines at 4.
    p = prefill(Timeouts(bootstrap=4, inflight=4, heartbeat_interval=100, heartbeat_timeout=400))
    p.receive(register(), 0.0)
    p.receive(request(), 0.0)
    p.open_room(ROOM, num_pages=3, aux_row=None, now=0.0)
    effects = p.tick(4.0)
    assert [f.cause for f in finished(effects)] == [FailureCause.TIMEOUT]
    assert p.statistics().rooms_failed == 1
