"""Receiver room: one room on one decode rank (DESIGN section 5).

Every rule that moves a receiver room is a row below; ``DecodeEndpoint`` builds the step and finds
the row. A failed room's pages are then the business of its abort handshake (``decode_abort``).

    BOOTSTRAPPING      waiting for registration with every target prefill rank (deadline: bootstrap)
    WAITING_FOR_INPUT  TransferRequests sent, no status yet (deadline: waiting)
    TRANSFERRING       some required prefill ranks reported Success, not all (deadline: transfer)
    SCATTERING         (landing zone) every required rank reported Success into the room's landing lease;
                       the runtime copies the landed heads into the pages (deadline: transfer)
    VERIFYING          (checksums on) every required rank reported Success; the runtime compares the
                       pages with the checksums they sent (deadline: transfer)
    SUCCESS            every required prefill rank reported Success (and, checksums on, the pages match)
    FAILED             status Failed, timeout, rejection, peer lost or restarted, abort, checksum mismatch

Inputs: ``targets_ready`` (every target rank registered), ``success`` / ``failed`` (a TransferStatus),
``peer_abort`` (an Abort from a prefill rank), ``abort`` (the scheduler's), ``fail`` (decided by the
endpoint: a deadline, a lost, restarted or refusing rank, no destination), ``verified`` /
``corrupt`` (the runtime's verdict on the checksums, after ``VerifyChecksums``), ``landing_granted``
(the runtime's answer to ``LeaseLanding``) and ``scattered`` / ``scatter_failed`` (its answer to
``ScatterLanding``). A room opened with ``landing`` (decode TP below prefill TP, specs/mapping.md
section 15) stays Bootstrapping, its requests unsent, until its lease is granted (back-pressure: it
never fails for space; its bootstrap deadline bounds the wait); an empty grant (a room larger than
the whole pool) sends them grant-less. Its last required Success enters Scattering, the scatter's
success moves it on to Verifying (checksums on: the pages are checked after the scatter) or
Success; the lease is released by the runtime with the room's pages (Success, or ``ReleasePages``
after every AbortAck or the quarantine). A status is only
heard from a rank that was sent the request (the others' are late, counted); only required
(non-dummy) ranks' successes count. A verifying room is live: an abort or a lost rank fails it, and
a verdict that comes after that changes nothing; a mismatch fails it with ``FailureCause.CHECKSUM``
and its pages follow the abort handshake like any failed room's. When its requests go, the room
keeps what its ranks' registrations leave out of the draft model (``draft_skipped``: the scheduler
reads it after Success); a room that succeeds so is counted (``rooms_draft_skipped``).
"""

from __future__ import annotations

import attrs

from pdkv.mapping.layout_policy import BufferKey
from pdkv.protocol.effects import (
    FailureCause,
    Notice,
    NoticeLevel,
    RoomFinished,
    ScatterLanding,
    Send,
    VerifyChecksums,
)
from pdkv.protocol.machines._base import MachineSpec, StateMachine, row
from pdkv.protocol.machines._decode_side import (
    AbortRecord,
    AbortStep,
    DecodeAbortInput,
    PrefillRankState,
    ReceiverRoomInput,
    ReceiverRoomState,
    RoomStep,
    peer_text,
)
from pdkv.protocol.machines.decode_abort import DecodeAbortMachine
from pdkv.protocol.messages import Abort, TransferMetricData, TransferRequest
from pdkv.protocol.poll import KVPoll
from pdkv.protocol.registration import DraftSkipped

_S = ReceiverRoomState
_I = ReceiverRoomInput
_LIVE = (_S.BOOTSTRAPPING, _S.WAITING_FOR_INPUT, _S.TRANSFERRING, _S.SCATTERING, _S.VERIFYING)
_ASKED = (_S.WAITING_FOR_INPUT, _S.TRANSFERRING)
_ENDED = (_S.SUCCESS, _S.FAILED)

# ------------------------------------------------------------------------------------------ guards


def not_asked(s: RoomStep) -> bool:
    """The status comes from a rank this room never sent its request to."""
    return s.sender not in s.room.armed


def from_dummy(s: RoomStep) -> bool:
    """A dummy target has nothing to report; its success is harmless but unexpected."""
    return s.sender not in s.room.required


def already_succeeded(s: RoomStep) -> bool:
    return s.sender in s.room.succeeded


def last_required(s: RoomStep) -> bool:
    """This success completes the room: every required rank has now reported Success. (Only required
    ranks are recorded, so equal sizes mean all: O(1) where comparing sets cost O(ranks) per status.)"""
    return len(s.room.succeeded) + 1 == len(s.room.required)


def last_required_to_verify(s: RoomStep) -> bool:
    """This success completes a room that verifies checksums: its pages are checked before Success."""
    return s.room.verify and last_required(s)


def last_required_to_scatter(s: RoomStep) -> bool:
    """This success completes a room whose KV pages landed in its landing lease: scattered first."""
    return bool(s.room.grants) and last_required(s)


def awaiting_landing(s: RoomStep) -> bool:
    """The room's requests wait for its landing lease (back-pressure: not failed for space)."""
    return s.room.landing and s.room.grants is None


def targets_registered(s: RoomStep) -> bool:
    """Every target prefill rank is registered (READY): the requests can go once the lease is in."""
    for t in s.room.targets:
        rank = s.side.rank(t.key)
        if rank is None or rank.machine.state is not PrefillRankState.READY:
            return False
    return True


def verifies(s: RoomStep) -> bool:
    return s.room.verify


# ------------------------------------------------------------------------------------------ effects


def note_draft_skipped(s: RoomStep) -> None:
    """What the room will not receive of the draft model: the buffers each required rank's RegisterAck
    left out (dummies write nothing, so theirs do not matter)."""
    not_written: list[BufferKey] = []
    not_sent: list[BufferKey] = []
    peers: list[str] = []
    for t in s.room.targets:
        rank = s.side.rank(t.key)
        if t.dummy or rank is None or rank.ack is None or not rank.ack.leaves_out:
            continue
        not_written += rank.ack.decode_left_out
        not_sent += rank.ack.prefill_left_out
        peers.append(rank.name)
    if peers:
        s.room.draft_skipped = DraftSkipped(not_written=not_written, not_sent=not_sent, peers=peers)


def count_without_draft(s: RoomStep) -> None:
    if s.room.draft_skipped is not None:
        s.side.count("rooms_draft_skipped")


def record_grants(s: RoomStep) -> None:
    """The lease the runtime granted (empty: the room is larger than the pool, its requests go
    grant-less, counted)."""
    s.room.grants = dict(s.grants or {})
    if not s.room.grants:
        s.side.count("landing_fallbacks")


def send_requests(s: RoomStep) -> None:
    """Every required rank gets the same request, every dummy the same dummy (which says the prefix
    too: a replica's scheduler starts where the others do), built once; a rank with a landing grant
    gets the request with its grant. Then the waiting deadline."""
    r = s.room
    grants = r.grants or {}
    request = TransferRequest(
        origin=s.side.origin,
        room=r.room,
        dst_pages=r.dst_pages,
        dst_aux_row=r.dst_aux_row,
        dst_state=r.dst_state,
        required_dst_info_num=r.required_dst_info_num,
        prefix_pages=r.prefix_pages,
    )
    dummy: TransferRequest | None = None
    for t in r.targets:
        rank = s.side.rank(t.key)
        assert rank is not None  # ready, or the row would not have run
        message = request
        if t.dummy:
            if dummy is None:
                dummy = TransferRequest(
                    origin=s.side.origin,
                    room=r.room,
                    dst_pages=(),
                    required_dst_info_num=r.required_dst_info_num,
                    dummy=True,
                    prefix_pages=r.prefix_pages,
                )
            message = dummy
        elif t.key in grants:
            message = attrs.evolve(request, landing=grants[t.key])
        r.armed.add(t.key)
        s.side.emit(Send(to=rank.endpoint, message=message))
    s.side.set_deadline(r, s.now + s.side.timeouts.waiting)


def record_success(s: RoomStep) -> None:
    assert s.sender is not None
    s.room.succeeded.add(s.sender)
    s.room.metric[s.sender] = s.metric if s.metric is not None else TransferMetricData()
    if s.room.verify:
        s.room.reports[s.sender] = s.checksums


def request_verification(s: RoomStep) -> None:
    """Every required rank's writes completed: the runtime checks the pages against their checksums
    (a rank that sent none is in ``reports`` as None: the verdict names it), bounded by ``transfer``."""
    r = s.room
    s.side.set_deadline(r, s.now + s.side.timeouts.transfer)
    reports = tuple((t.key, r.reports.get(t.key)) for t in r.targets if t.key in r.required)
    left_out = []
    for key, _ in reports:
        rank = s.side.rank(key)
        if rank is not None and rank.ack is not None and rank.ack.decode_left_out:
            left_out.append((key, tuple(rank.ack.decode_left_out)))
    s.side.emit(
        VerifyChecksums(
            room=r.room,
            dst_pages=r.dst_pages,
            prefix_pages=r.prefix_pages,
            dst_state=r.dst_state,
            dst_aux_row=r.dst_aux_row,
            reports=reports,
            left_out=tuple(left_out),
        )
    )


def request_scatter(s: RoomStep) -> None:
    """Every required rank's writes into the landing lease completed: the runtime copies the landed
    heads into the pages, bounded by ``transfer``."""
    r = s.room
    s.side.set_deadline(r, s.now + s.side.timeouts.transfer)
    grants = r.grants or {}
    s.side.emit(
        ScatterLanding(
            room=r.room,
            dst_pages=r.dst_pages,
            prefix_pages=r.prefix_pages,
            grants=tuple((t.key, grants[t.key]) for t in r.targets if t.key in grants),
        )
    )


def count_scattered(s: RoomStep) -> None:
    s.side.count("rooms_landed")


def count_verified(s: RoomStep) -> None:
    s.side.count("rooms_verified")


def record_mismatch(s: RoomStep) -> None:
    """The pages differ from what a prefill rank sent: counted, kept for ``Failure.mismatch``."""
    assert s.mismatch is not None and s.cause is FailureCause.CHECKSUM
    s.room.mismatch = s.mismatch
    s.side.count("checksum_failures")


def arm_transfer_deadline(s: RoomStep) -> None:
    s.side.set_deadline(s.room, s.now + s.side.timeouts.transfer)


def finish_success(s: RoomStep) -> None:
    s.room.deadline = None
    s.side.count("rooms_succeeded")
    s.side.emit(RoomFinished(room=s.room.room, poll=KVPoll.Success))


def note_dummy_success(s: RoomStep) -> None:
    who = "?" if s.sender is None else peer_text(s.sender)
    s.side.emit(Notice(level=NoticeLevel.DEBUG, text=f"success from dummy target {who}", room=s.room.room))


def count_late(s: RoomStep) -> None:
    s.side.count("late_messages")
    who = "?" if s.sender is None else peer_text(s.sender)
    s.side.emit(
        Notice(
            level=NoticeLevel.DEBUG, text=f"late message from {who} for room {s.room.room}", room=s.room.room
        )
    )


def fail_room(s: RoomStep) -> None:
    """Fail the room and start its abort handshake with every prefill rank of the room: only a rank
    that was told the destinations can write (dummies never do), so those are the ones whose ack
    the pages wait for. A rank still registering is told once it acknowledges (it would drop our
    message now); a rank being registered with again after silence (``tell_now``) is told at once,
    on its rebuilt socket."""
    r = s.room
    assert s.cause is not None
    r.failure, r.cause, r.failure_peer = s.reason, s.cause, s.sender
    s.side.count("rooms_failed")
    abort = AbortRecord(
        machine=DecodeAbortMachine(f"room {r.room}"),
        must_ack={t.key for t in r.targets if not t.dummy and t.key in r.armed},
    )
    r.abort = abort
    s.side.emit(RoomFinished(room=r.room, poll=KVPoll.Failed, reason=s.reason, cause=s.cause))
    s.side.emit(
        Notice(
            level=NoticeLevel.WARNING,
            text=f"room {r.room} failed on decode {s.side.origin}: {s.reason}",
            room=r.room,
        )
    )
    for t in r.targets:
        rank = s.side.rank(t.key)
        if rank is None:
            continue
        if rank.machine.state is PrefillRankState.READY or t.key == s.tell_now:
            s.side.count("aborts_sent")
            s.side.emit(
                Send(to=rank.endpoint, message=Abort(origin=s.side.origin, room=r.room, reason=s.reason))
            )
        elif not t.dummy and rank.machine.state is PrefillRankState.REGISTERING:
            abort.tell_later.add(t.key)
    step = AbortStep(side=s.side, room=r, abort=abort, now=s.now)
    if not abort.must_ack:
        r.deadline = None
        abort.machine.step(DecodeAbortInput.NOTHING_SENT, step)
        return
    s.side.set_deadline(r, s.now + s.side.timeouts.abort_ack)
    s.side.schedule_abort_resend(r, s.now)


# ------------------------------------------------------------------------------------------ rows

RECEIVER_ROOM = MachineSpec(
    name="ReceiverRoom",
    states=ReceiverRoomState,
    triggers=ReceiverRoomInput,
    initial=_S.BOOTSTRAPPING,
    edges=(
        row(_I.TARGETS_READY, _S.BOOTSTRAPPING, None, when=awaiting_landing),  # waits for its lease
        row(
            _I.TARGETS_READY, _S.BOOTSTRAPPING, _S.WAITING_FOR_INPUT, then=[note_draft_skipped, send_requests]
        ),
        row(
            _I.LANDING_GRANTED,
            _S.BOOTSTRAPPING,
            _S.WAITING_FOR_INPUT,
            when=targets_registered,
            then=[record_grants, note_draft_skipped, send_requests],
        ),
        row(_I.LANDING_GRANTED, _S.BOOTSTRAPPING, None, then=[record_grants]),  # ranks still registering
        row(_I.LANDING_GRANTED, _S.FAILED, None),  # failed while it waited: the runtime releases it
        row(_I.SUCCESS, _ENDED, None, then=[count_late]),
        row(_I.SUCCESS, _S.BOOTSTRAPPING, None, then=[count_late]),  # nobody was asked yet
        row(_I.SUCCESS, _ASKED, None, when=not_asked, then=[count_late]),
        row(_I.SUCCESS, _ASKED, None, when=from_dummy, then=[note_dummy_success]),
        row(_I.SUCCESS, _ASKED, None, when=already_succeeded),
        row(
            _I.SUCCESS,
            _ASKED,
            _S.SCATTERING,
            when=last_required_to_scatter,
            then=[record_success, request_scatter],
        ),
        row(
            _I.SUCCESS,
            _ASKED,
            _S.VERIFYING,
            when=last_required_to_verify,
            then=[record_success, request_verification],
        ),
        row(
            _I.SUCCESS,
            _ASKED,
            _S.SUCCESS,
            when=last_required,
            then=[record_success, finish_success, count_without_draft],
        ),
        row(_I.SUCCESS, _S.WAITING_FOR_INPUT, _S.TRANSFERRING, then=[record_success, arm_transfer_deadline]),
        row(_I.SUCCESS, _S.TRANSFERRING, None, then=[record_success]),
        row(_I.SUCCESS, (_S.SCATTERING, _S.VERIFYING), None, then=[count_late]),  # every rank reported
        row(_I.FAILED, _ENDED, None, then=[count_late]),
        row(_I.FAILED, _LIVE, None, when=not_asked, then=[count_late]),
        row(_I.FAILED, _LIVE, _S.FAILED, then=[fail_room]),
        row(_I.PEER_ABORT, _ENDED, None, then=[count_late]),
        row(_I.PEER_ABORT, _LIVE, _S.FAILED, then=[fail_room]),
        row(_I.ABORT, _ENDED, None),  # aborting a finished room changes nothing
        row(_I.ABORT, _LIVE, _S.FAILED, then=[fail_room]),
        row(_I.FAIL, _ENDED, None),
        row(_I.FAIL, _LIVE, _S.FAILED, then=[fail_room]),
        row(
            _I.VERIFIED, _S.VERIFYING, _S.SUCCESS, then=[count_verified, finish_success, count_without_draft]
        ),
        row(_I.VERIFIED, _S.FAILED, None),  # the room failed while it was checked (an abort)
        row(_I.CORRUPT, _S.VERIFYING, _S.FAILED, then=[record_mismatch, fail_room]),
        row(_I.CORRUPT, _S.FAILED, None),
        row(
            _I.SCATTERED,
            _S.SCATTERING,
            _S.VERIFYING,
            when=verifies,
            then=[count_scattered, request_verification],
        ),
        row(
            _I.SCATTERED,
            _S.SCATTERING,
            _S.SUCCESS,
            then=[count_scattered, finish_success, count_without_draft],
        ),
        row(_I.SCATTERED, _S.FAILED, None),  # the room failed while it was scattered (an abort)
        row(_I.SCATTER_FAILED, _S.SCATTERING, _S.FAILED, then=[fail_room]),
        row(_I.SCATTER_FAILED, _S.FAILED, None),
    ),
)


class ReceiverRoomMachine(StateMachine[ReceiverRoomState, ReceiverRoomInput]):
    def __init__(self, label: str) -> None:
        super().__init__(RECEIVER_ROOM, label)


ReceiverRoomTrigger = ReceiverRoomInput  # the name earlier code used

__all__ = [
    "RECEIVER_ROOM",
    "ReceiverRoomInput",
    "ReceiverRoomMachine",
    "ReceiverRoomState",
    "ReceiverRoomTrigger",
]
