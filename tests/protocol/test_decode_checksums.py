"""DecodeEndpoint with checksums on (``verify_checksums``): Success waits for the verdict on the pages.

The rows under test (``machines.room_receiver``): the last required Success moves a verifying room to
VERIFYING and asks ``VerifyChecksums`` with every required rank's checksums; ``verified`` completes
it, ``corrupt`` fails it with ``FailureCause.CHECKSUM`` (counted, named in ``Failure.mismatch``) and
its pages follow the abort handshake; a room that fails while verified ignores the late verdict.
"""

from __future__ import annotations

from pdkv.protocol.config import Timeouts
from pdkv.protocol.decode import DecodeEndpoint
from pdkv.protocol.effects import (
    ChecksumMismatch,
    FailureCause,
    Notice,
    NoticeLevel,
    RoomFinished,
    Target,
    VerifyChecksums,
)
from pdkv.protocol.ids import Epoch, RoomId
from pdkv.protocol.machines import DecodeAbortState, ReceiverRoomState
from pdkv.protocol.messages import (
    Abort,
    AbortAck,
    Origin,
    Outcome,
    PageChecksums,
    RankCoord,
    RegisterAck,
    TransferStatus,
)
from pdkv.protocol.poll import KVPoll
from tests.protocol.helpers import PREFILL, ROOM, decode, sent
from tests.protocol.test_decode import connected, ranks_route

TARGET = Target(instance=PREFILL.instance, rank=PREFILL.rank)
SUMS = PageChecksums(positions=[0, 1, 2], kv=list(range(3 * 4)))


def success(origin: Origin = PREFILL, checksums: PageChecksums | None = SUMS) -> TransferStatus:
    return TransferStatus(origin=origin, room=ROOM, outcome=Outcome.SUCCESS, checksums=checksums)


def opened(d: DecodeEndpoint, *, verify: bool = True, targets: list[Target] | None = None) -> None:
    d.open_room(
        ROOM,
        targets=targets or [TARGET],
        dst_pages=[5, 6, 7],
        dst_aux_row=1,
        verify_checksums=verify,
        now=0.0,
    )


def mismatch(prefill: str | None = "p:tp0/cp0") -> ChecksumMismatch:
    return ChecksumMismatch(
        prefill=prefill,
        buffer="target kv layer 2",
        layer=2,
        position=1,
        dst_index=6,
        entries=3,
        detail="checksum mismatch in target kv layer 2 at position 1 (decode item 6) written by prefill p",
    )


def test_the_last_success_asks_for_the_check_and_waits_for_the_verdict() -> None:
    d = connected()
    opened(d)
    effects = d.receive(success(), 1.0)
    [ask] = [e for e in effects if isinstance(e, VerifyChecksums)]
    assert ask.room == ROOM and ask.dst_pages.tolist() == [5, 6, 7] and ask.dst_aux_row == 1
    assert ask.reports == (((PREFILL.instance, PREFILL.rank), SUMS),)
    assert not [e for e in effects if isinstance(e, RoomFinished)]  # not Success yet
    assert d.poll(ROOM) is KVPoll.Transferring
    assert d.room_history(ROOM)[-1] is ReceiverRoomState.VERIFYING
    assert not d.release_ready(ROOM)  # the pages are being read
    finished = d.checksums_verified(ROOM, None, 1.1)
    assert [e.poll for e in finished if isinstance(e, RoomFinished)] == [KVPoll.Success]
    assert d.poll(ROOM) is KVPoll.Success and d.release_ready(ROOM)
    stats = d.statistics()
    assert (stats.rooms_verified, stats.checksum_failures, stats.rooms_succeeded) == (1, 0, 1)


def test_without_verification_success_comes_at_once() -> None:
    d = connected()
    opened(d, verify=False)
    effects = d.receive(success(), 1.0)
    assert not [e for e in effects if isinstance(e, VerifyChecksums)]
    assert d.poll(ROOM) is KVPoll.Success
    assert d.statistics().rooms_verified == 0


def test_a_mismatch_fails_the_room_naming_the_page_and_its_pages_wait_for_the_ack() -> None:
    d = connected()
    opened(d)
    d.receive(success(), 1.0)
    effects = d.checksums_verified(ROOM, mismatch(), 1.1)
    [finished] = [e for e in effects if isinstance(e, RoomFinished)]
    assert finished.poll is KVPoll.Failed and finished.cause is FailureCause.CHECKSUM
    warnings = [e.text for e in effects if isinstance(e, Notice) and e.level is NoticeLevel.WARNING]
    assert any("target kv layer 2 at position 1" in text for text in warnings)
    [abort] = sent(effects, Abort)
    assert isinstance(abort, Abort) and "target kv layer 2" in abort.reason
    failure = d.failure_record(ROOM)
    assert failure is not None and failure.cause is FailureCause.CHECKSUM
    assert failure.mismatch == mismatch() and failure.peer == "p:tp0/cp0"
    assert d.statistics().checksum_failures == 1
    # The normal release rule: the pages come back with the prefill rank's AbortAck.
    assert not d.release_ready(ROOM)
    d.receive(AbortAck(origin=PREFILL, room=ROOM), 1.2)
    assert d.release_ready(ROOM) and d.abort_state(ROOM) is DecodeAbortState.RELEASED


def test_an_abort_while_verifying_wins_and_the_late_verdict_changes_nothing() -> None:
    d = connected()
    opened(d)
    d.receive(success(), 1.0)
    d.abort_room(ROOM, "client went away", 1.05)
    assert d.poll(ROOM) is KVPoll.Failed
    assert d.checksums_verified(ROOM, None, 1.1) == []
    assert d.checksums_verified(ROOM, mismatch(), 1.1) == []
    stats = d.statistics()
    assert d.failure_cause(ROOM) is FailureCause.ABORTED_HERE
    assert (stats.rooms_verified, stats.checksum_failures) == (0, 0)


def test_a_verification_that_never_answers_times_out() -> None:
    d = connected(Timeouts(transfer=5.0))
    opened(d)
    d.receive(success(), 1.0)
    d.tick(5.9)
    assert d.poll(ROOM) is KVPoll.Transferring
    d.tick(6.0)
    assert d.poll(ROOM) is KVPoll.Failed and d.failure_cause(ROOM) is FailureCause.TIMEOUT


def test_every_required_rank_s_checksums_are_asked_for_dummies_excluded() -> None:
    """CP 2 with a dummy TP replica: the check waits for both CP ranks and carries each rank's own
    checksums (a rank that sent none is listed as None, for the verdict to name it)."""
    d = decode()
    second = Origin(instance=PREFILL.instance, epoch=Epoch(1), rank=RankCoord(tp=0, cp=1))
    dummy = Origin(instance=PREFILL.instance, epoch=Epoch(1), rank=RankCoord(tp=1, cp=0))
    d.connect(ranks_route(PREFILL, second, dummy, tp_size=2, cp_size=2, complete=False), 0.0)
    for origin in (PREFILL, second, dummy):
        d.receive(RegisterAck(origin=origin), 0.0)
    targets = [
        TARGET,
        Target(instance=second.instance, rank=second.rank),
        Target(instance=dummy.instance, rank=dummy.rank, dummy=True),
    ]
    opened(d, targets=targets)
    assert not [e for e in d.receive(success(PREFILL), 1.0) if isinstance(e, VerifyChecksums)]
    [ask] = [e for e in d.receive(success(second, None), 1.1) if isinstance(e, VerifyChecksums)]
    assert ask.reports == (((PREFILL.instance, PREFILL.rank), SUMS), ((second.instance, second.rank), None))
    assert RoomId(ROOM) == ask.room
