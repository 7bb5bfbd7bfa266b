"""A failed room's abort handshake on the decode side (DESIGN sections 5 and 8): when its pages are safe.

Every rule that decides when a failed room's pages come back is a row below. Pages are reusable
only in RELEASED (proven, or after the settle time) and TIMED_OUT (the one unsafe release); each
release is counted by what proved it (``ReleaseKind``).

    REQUESTED    Abort sent to every prefill rank told the destinations (resent with backoff until
                 acked); pages NOT reusable (deadline: ``abort_ack``)
    QUARANTINED  ``abort_ack`` passed with an ack missing (a rank silent or cut off): pages still NOT
                 reusable, the Abort still resent (deadline: ``quarantine``)
    CUTTING      a quarantined room's last ack came: the connections from its ranks' hosts are being
                 cut, which ends bytes stuck in them (deadline: ``quarantine_settle``)
    SETTLING     every rank acknowledged, but an ack proves nothing about a connection: a write of
                 the room failed (the fence proved the engine queue drained, not the connection that
                 carried the failed write) or a rank restarted after it was told the destinations; or
                 this rank cannot cut (or the cut failed). Pages come back after ``quarantine_settle``
                 (a time bound, not a proof). No cut here: it would fail every other write in flight
                 on those connections (measured: each cut failed the next room's write, whose fence
                 asked for the next cut)
    RELEASED     pages reusable: ACKED (the acks alone, every write completed), CUT, or SETTLED
    TIMED_OUT    the quarantine bound passed with an ack missing: released anyway (UNSAFE), logged

Inputs: ``nothing_sent`` (no rank was told the destinations), ``abort_ack``, ``deadline``, ``cut`` /
``cut_failed`` (the driver's answer to ``CutConnections``), ``resend_due``, ``rank_ready`` (a rank
of the room registered again).
"""

from __future__ import annotations

from pdkv.protocol.effects import CutConnections, Notice, NoticeLevel, ReleaseKind, ReleasePages, Send
from pdkv.protocol.ids import SessionId
from pdkv.protocol.machines._base import MachineSpec, StateMachine, row
from pdkv.protocol.machines._decode_side import (
    AbortStep,
    DecodeAbortInput,
    DecodeAbortState,
    PrefillRankState,
    peer_order,
    peer_text,
)
from pdkv.protocol.messages import Abort

_S = DecodeAbortState
_I = DecodeAbortInput
_AWAITING = (_S.REQUESTED, _S.QUARANTINED)
_ACKED = (_S.CUTTING, _S.SETTLING)
_DONE = (_S.RELEASED, _S.TIMED_OUT)

# ------------------------------------------------------------------------------------------ guards


def acks_missing(s: AbortStep) -> bool:
    """A rank told the destinations has not acknowledged yet (this ack counted)."""
    acked = s.abort.acked | ({s.sender} if s.sender is not None else set())
    return not s.abort.must_ack <= acked


def acks_prove_it(s: AbortStep) -> bool:
    """No ack of the room followed a fence (every write completed), and no rank restarted after it
    was told the destinations: the acks alone prove nothing more can land."""
    return not s.fenced and not s.abort.unproven


def cut_possible(s: AbortStep) -> bool:
    return s.side.cuts_connections


def told_later(s: AbortStep) -> bool:
    """The rank registered again, and the room failed before it was registered: it was never told."""
    return s.sender is not None and s.sender in s.abort.tell_later


def owes_ack(s: AbortStep) -> bool:
    return s.sender is not None and s.sender in s.abort.must_ack - s.abort.acked


# ------------------------------------------------------------------------------------------ effects


def release_nothing_sent(s: AbortStep) -> None:
    _release(s, ReleaseKind.NOTHING_SENT, "no prefill rank had the destinations")


def record_ack(s: AbortStep) -> None:
    assert s.sender is not None
    s.abort.acked.add(s.sender)
    if s.fenced:
        s.abort.unproven.add(s.sender)


def release_acked(s: AbortStep) -> None:
    s.side.count("aborts_acked")
    _release(s, ReleaseKind.ACKED, "all prefill ranks acknowledged the abort")


def cut_their_hosts(s: AbortStep) -> None:
    """End every engine connection from the hosts of the room's ranks; the driver answers ``cut``."""
    s.side.set_deadline(s.room, s.now + s.side.timeouts.quarantine_settle)  # a cut that never reports
    hosts = sorted({_host_of(rank.session) for k in s.abort.must_ack if (rank := s.side.rank(k)) is not None})
    s.side.emit(CutConnections(room=s.room.room, hosts=tuple(hosts)))


def settle(s: AbortStep) -> None:
    s.side.set_deadline(s.room, s.now + s.side.timeouts.quarantine_settle)
    why = (
        "a write of the room failed or its writer restarted, so bytes may remain in a connection"
        if s.abort.unproven
        else "the room was quarantined and this rank cannot cut connections"
    )
    s.side.emit(
        Notice(
            level=NoticeLevel.INFO,
            text=f"room {s.room.room}: every prefill rank acknowledged, but {why}: pages come back after "
            f"{s.side.timeouts.quarantine_settle:g} s of settling",
            room=s.room.room,
        )
    )


def quarantine(s: AbortStep) -> None:
    """A rank is silent or cut off: its writes may still land. The pages stay held, counted."""
    s.side.count("quarantines")
    s.side.hold_quarantined(s.room)
    # Counted from when the ack wait ended, not from when this tick noticed it.
    s.side.set_deadline(s.room, (s.room.deadline or s.now) + s.side.timeouts.quarantine)
    missing = sorted(peer_text(k) for k in s.abort.must_ack - s.abort.acked)
    s.side.emit(
        Notice(
            level=NoticeLevel.WARNING,
            text=f"room {s.room.room} quarantined: no AbortAck from {missing} within "
            f"{s.side.timeouts.abort_ack:g} s; its {s.room.dst_pages.size} pages stay held until "
            f"they acknowledge (at most {s.side.timeouts.quarantine:g} s)",
            room=s.room.room,
        )
    )


def release_unsafe(s: AbortStep) -> None:
    missing = sorted(peer_text(k) for k in s.abort.must_ack - s.abort.acked)
    s.side.count("unsafe_releases")
    s.side.emit(
        Notice(
            level=NoticeLevel.WARNING,
            text=f"UNSAFE release of room {s.room.room}: no AbortAck from {missing} within the "
            f"{s.side.timeouts.quarantine:g} s quarantine",
            room=s.room.room,
        )
    )
    _release(s, ReleaseKind.UNSAFE, f"quarantine timeout ({', '.join(missing)})")


def release_settled(s: AbortStep) -> None:
    s.side.count("aborts_acked")
    s.side.emit(
        Notice(
            level=NoticeLevel.WARNING,
            text=f"room {s.room.room} released after settling: every prefill rank acknowledged its "
            f"abort {s.side.timeouts.quarantine_settle:g} s ago, without a cut of their connections "
            f"(not proven; {s.room.dst_pages.size} pages back)",
            room=s.room.room,
        )
    )
    _release(s, ReleaseKind.SETTLED, "acknowledged, then settled (not proven)")


def release_cut(s: AbortStep) -> None:
    s.side.count("aborts_acked")
    s.side.emit(
        Notice(
            level=NoticeLevel.INFO,
            text=f"room {s.room.room} released: every prefill rank acknowledged (after its fence, where a "
            f"write had failed) and its connections were cut ({s.room.dst_pages.size} pages back)",
            room=s.room.room,
        )
    )
    _release(s, ReleaseKind.CUT, "acknowledged after fences; connections cut")


def settle_after_failed_cut(s: AbortStep) -> None:
    s.side.set_deadline(s.room, s.now + s.side.timeouts.quarantine_settle)
    s.side.emit(
        Notice(
            level=NoticeLevel.WARNING,
            text=f"room {s.room.room}: connections could not be cut ({s.reason}); pages come "
            f"back after {s.side.timeouts.quarantine_settle:g} s of settling",
            room=s.room.room,
        )
    )


def resend_aborts(s: AbortStep) -> None:
    """The Abort (or its AbortAck) may have been lost: tell the ranks that have not answered again."""
    for key in sorted(s.abort.must_ack - s.abort.acked, key=peer_order):
        rank = s.side.rank(key)
        if rank is not None and rank.machine.state is PrefillRankState.READY:
            s.side.count("aborts_resent")
            s.side.emit(Send(to=rank.endpoint, message=_abort_message(s)))
    s.abort.resends += 1
    s.side.schedule_abort_resend(s.room, s.now)


def tell_late_rank(s: AbortStep) -> None:
    """Registered after the room failed: told now, so a prefill scheduler that opened the room learns
    of the abort instead of a deadline."""
    assert s.sender is not None
    s.abort.tell_later.discard(s.sender)
    _tell(s)


def tell_rank_again(s: AbortStep) -> None:
    """Registered again after silence: the same process may still hold the room, and its ack is the
    only safe way to release the pages; the first Abort may have been lost."""
    _tell(s)


def count_late_ack(s: AbortStep) -> None:
    s.side.count("late_messages")
    who = "?" if s.sender is None else peer_text(s.sender)
    s.side.emit(
        Notice(
            level=NoticeLevel.DEBUG, text=f"late AbortAck from {who} for room {s.room.room}", room=s.room.room
        )
    )


# ------------------------------------------------------------------------------------------ rows

DECODE_ABORT = MachineSpec(
    name="DecodeAbort",
    states=DecodeAbortState,
    triggers=DecodeAbortInput,
    initial=_S.REQUESTED,
    edges=(
        row(_I.NOTHING_SENT, _S.REQUESTED, _S.RELEASED, then=[release_nothing_sent]),
        row(_I.ABORT_ACK, _AWAITING, None, when=acks_missing, then=[record_ack]),
        row(_I.ABORT_ACK, _S.REQUESTED, _S.RELEASED, when=acks_prove_it, then=[record_ack, release_acked]),
        row(_I.ABORT_ACK, _S.QUARANTINED, _S.CUTTING, when=cut_possible, then=[record_ack, cut_their_hosts]),
        row(_I.ABORT_ACK, _AWAITING, _S.SETTLING, then=[record_ack, settle]),
        row(_I.ABORT_ACK, _ACKED, None),  # a duplicate while the connections are cut or the pages settle
        row(_I.ABORT_ACK, _DONE, None, then=[count_late_ack]),
        row(_I.DEADLINE, _S.REQUESTED, _S.QUARANTINED, then=[quarantine]),
        row(_I.DEADLINE, _S.QUARANTINED, _S.TIMED_OUT, then=[release_unsafe]),
        row(_I.DEADLINE, _ACKED, _S.RELEASED, then=[release_settled]),
        row(_I.CUT, _S.CUTTING, _S.RELEASED, then=[release_cut]),
        row(_I.CUT_FAILED, _S.CUTTING, _S.SETTLING, then=[settle_after_failed_cut]),
        row(_I.RESEND_DUE, _AWAITING, None, then=[resend_aborts]),
        row(_I.RANK_READY, tuple(DecodeAbortState), None, when=told_later, then=[tell_late_rank]),
        row(_I.RANK_READY, _AWAITING, None, when=owes_ack, then=[tell_rank_again]),
        row(_I.RANK_READY, tuple(DecodeAbortState), None),
    ),
)


class DecodeAbortMachine(StateMachine[DecodeAbortState, DecodeAbortInput]):
    def __init__(self, label: str) -> None:
        super().__init__(DECODE_ABORT, label)


DecodeAbortTrigger = DecodeAbortInput  # the name earlier code used


# ------------------------------------------------------------------------------------------ helpers


def _release(s: AbortStep, kind: ReleaseKind, reason: str) -> None:
    if s.side.drop_quarantined(s.room) and kind.safe:
        s.side.count("quarantines_released")
        if kind is ReleaseKind.CUT:
            s.side.count("quarantines_proven")
    if kind is not ReleaseKind.UNSAFE:  # counted as unsafe_releases
        s.side.count(f"releases_{kind.value}")
    s.abort.release = kind
    s.room.deadline = None
    s.side.emit(ReleasePages(room=s.room.room, kind=kind, reason=reason))


def _abort_message(s: AbortStep) -> Abort:
    return Abort(origin=s.side.origin, room=s.room.room, reason=s.room.failure or "failed")


def _tell(s: AbortStep) -> None:
    assert s.sender is not None
    rank = s.side.rank(s.sender)
    if rank is not None:
        s.side.count("aborts_sent")
        s.side.emit(Send(to=rank.endpoint, message=_abort_message(s)))


def _host_of(session: SessionId) -> str:
    """The host of an engine session ``host:port`` (``[v6]:port`` too)."""
    host = session.rsplit(":", 1)[0] if ":" in session else session
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


__all__ = ["DECODE_ABORT", "DecodeAbortInput", "DecodeAbortMachine", "DecodeAbortState", "DecodeAbortTrigger"]
