"""DecodeEndpoint with a landing room (decode TP below prefill TP, ``open_room(landing=True)``).

The rows under test (``machines.room_receiver``): the room asks ``LeaseLanding`` and its requests wait
in Bootstrapping for ``landing_granted`` (back-pressure: registered ranks alone do not send them); a
grant goes into each required rank's request, an empty one sends them grant-less; the last required
Success enters Scattering and asks ``ScatterLanding``; ``landing_scattered`` completes the room, or
moves it to Verifying with checksums on, or fails it (its pages then wait for the AbortAck as any
failed room's); a room that fails while it scatters ignores the late answer; the bootstrap deadline
bounds the wait for space; a room that fails while it waits releases at once (nothing was sent).
"""

from __future__ import annotations

from pdkv.protocol.config import Timeouts
from pdkv.protocol.decode import DecodeEndpoint
from pdkv.protocol.effects import (
    DecodeEffect,
    FailureCause,
    LeaseLanding,
    ReleaseKind,
    ReleasePages,
    RoomFinished,
    ScatterLanding,
    Target,
    VerifyChecksums,
)
from pdkv.protocol.machines import DecodeAbortState, ReceiverRoomState
from pdkv.protocol.messages import (
    AbortAck,
    LandingGrant,
    Outcome,
    RegisterAck,
    TransferRequest,
    TransferStatus,
)
from pdkv.protocol.poll import KVPoll
from tests.protocol.helpers import PREFILL, ROOM, decode, route, sent
from tests.protocol.test_decode import connected

TARGET = Target(instance=PREFILL.instance, rank=PREFILL.rank)
KEY = (PREFILL.instance, PREFILL.rank)
GRANT = LandingGrant(address=1 << 40, nbytes=3 * 1024, first_position=1, slots=3)


def opened(d: DecodeEndpoint, *, verify: bool = False) -> list[DecodeEffect]:
    return list(
        d.open_room(
            ROOM,
            targets=[TARGET],
            dst_pages=[5, 6, 7, 8],
            dst_aux_row=1,
            prefix_pages=1,
            verify_checksums=verify,
            landing=True,
            now=0.0,
        )
    )


def success() -> TransferStatus:
    return TransferStatus(origin=PREFILL, room=ROOM, outcome=Outcome.SUCCESS)


def test_requests_wait_for_the_lease_then_carry_the_grant() -> None:
    d = connected()
    effects = opened(d)
    [ask] = [e for e in effects if isinstance(e, LeaseLanding)]
    assert ask.room == ROOM and ask.prefix_pages == 1 and ask.sources == (KEY,)
    assert ask.dst_pages.tolist() == [5, 6, 7, 8]
    assert sent(effects, TransferRequest) == []  # the rank is registered, yet nothing goes
    assert d.poll(ROOM) is KVPoll.Bootstrapping
    [request] = sent(d.landing_granted(ROOM, {KEY: GRANT}, 0.1), TransferRequest)
    assert isinstance(request, TransferRequest) and request.landing == GRANT
    assert d.poll(ROOM) is KVPoll.WaitingForInput
    assert d.landing_granted(ROOM, {KEY: GRANT}, 0.2) == []  # granted once


def test_a_grant_before_registration_waits_for_the_ranks() -> None:
    d = decode()
    d.connect(route(), 0.0)
    opened(d)
    assert sent(d.landing_granted(ROOM, {KEY: GRANT}, 0.1), TransferRequest) == []
    assert d.poll(ROOM) is KVPoll.Bootstrapping
    [request] = sent(d.receive(RegisterAck(origin=PREFILL), 0.2), TransferRequest)
    assert isinstance(request, TransferRequest) and request.landing == GRANT


def test_an_empty_grant_sends_the_requests_grant_less_and_success_needs_no_scatter() -> None:
    d = connected()
    opened(d)
    [request] = sent(d.landing_granted(ROOM, {}, 0.1), TransferRequest)
    assert isinstance(request, TransferRequest) and request.landing is None
    effects = d.receive(success(), 1.0)
    assert not [e for e in effects if isinstance(e, ScatterLanding)]
    assert d.poll(ROOM) is KVPoll.Success
    assert d.statistics().landing_fallbacks == 1


def test_the_last_success_scatters_before_success() -> None:
    d = connected()
    opened(d)
    d.landing_granted(ROOM, {KEY: GRANT}, 0.1)
    effects = d.receive(success(), 1.0)
    [scatter] = [e for e in effects if isinstance(e, ScatterLanding)]
    assert scatter.grants == ((KEY, GRANT),) and scatter.prefix_pages == 1
    assert not [e for e in effects if isinstance(e, RoomFinished)]
    assert d.poll(ROOM) is KVPoll.Transferring
    assert d.room_history(ROOM)[-1] is ReceiverRoomState.SCATTERING
    assert not d.release_ready(ROOM)
    finished = d.landing_scattered(ROOM, None, 1.1)
    assert [e.poll for e in finished if isinstance(e, RoomFinished)] == [KVPoll.Success]
    assert d.release_ready(ROOM) and d.statistics().rooms_landed == 1


def test_with_checksums_the_pages_are_verified_after_the_scatter() -> None:
    d = connected()
    opened(d, verify=True)
    d.landing_granted(ROOM, {KEY: GRANT}, 0.1)
    assert not [e for e in d.receive(success(), 1.0) if isinstance(e, VerifyChecksums)]
    [verify] = [e for e in d.landing_scattered(ROOM, None, 1.1) if isinstance(e, VerifyChecksums)]
    assert verify.room == ROOM and d.room_history(ROOM)[-1] is ReceiverRoomState.VERIFYING
    d.checksums_verified(ROOM, None, 1.2)
    assert d.poll(ROOM) is KVPoll.Success


def test_a_failed_scatter_fails_the_room_and_its_pages_wait_for_the_ack() -> None:
    d = connected()
    opened(d)
    d.landing_granted(ROOM, {KEY: GRANT}, 0.1)
    d.receive(success(), 1.0)
    effects = d.landing_scattered(ROOM, "device lost", 1.1)
    [finished] = [e for e in effects if isinstance(e, RoomFinished)]
    assert finished.poll is KVPoll.Failed and finished.cause is FailureCause.ENGINE
    assert "landing scatter failed: device lost" in (d.failure(ROOM) or "")
    assert not d.release_ready(ROOM)
    released = d.receive(AbortAck(origin=PREFILL, room=ROOM), 1.2)
    assert [e.kind for e in released if isinstance(e, ReleasePages)] == [ReleaseKind.ACKED]
    assert d.abort_state(ROOM) is DecodeAbortState.RELEASED


def test_an_abort_while_scattering_wins_and_the_late_answer_changes_nothing() -> None:
    d = connected()
    opened(d)
    d.landing_granted(ROOM, {KEY: GRANT}, 0.1)
    d.receive(success(), 1.0)
    d.abort_room(ROOM, "client went away", 1.05)
    assert d.landing_scattered(ROOM, None, 1.1) == []
    assert d.poll(ROOM) is KVPoll.Failed and d.failure_cause(ROOM) is FailureCause.ABORTED_HERE


def test_a_room_waiting_for_space_times_out_at_its_bootstrap_deadline_and_releases_at_once() -> None:
    d = connected(Timeouts(bootstrap=5.0))
    opened(d)
    assert d.poll(ROOM) is KVPoll.Bootstrapping
    effects = d.tick(5.0)
    assert d.poll(ROOM) is KVPoll.Failed and d.failure_cause(ROOM) is FailureCause.TIMEOUT
    # Nothing was sent: the pages (and the lease request) come back at once.
    assert [e.kind for e in effects if isinstance(e, ReleasePages)] == [ReleaseKind.NOTHING_SENT]
    assert d.landing_granted(ROOM, {KEY: GRANT}, 5.1) == []  # a lease that comes late is not taken
    assert d.release_ready(ROOM)


def test_a_room_with_nothing_to_send_asks_no_lease() -> None:
    d = connected()
    effects = d.open_room(
        ROOM, targets=[TARGET], dst_pages=[5, 6], dst_aux_row=1, prefix_pages=2, landing=True, now=0.0
    )
    assert not [e for e in effects if isinstance(e, LeaseLanding)]
    assert sent(effects, TransferRequest)
