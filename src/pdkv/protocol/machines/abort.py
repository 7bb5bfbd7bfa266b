"""Abort handshakes (DESIGN sections 5 and 8): one machine per side.

Decode side, one per aborted room. Its pages are reusable only in RELEASED (proven, or after the
settle time) and TIMED_OUT (the one unsafe release):

    REQUESTED    Abort sent to every prefill rank told the destinations (resent with backoff until
                 acked); pages NOT reusable
    QUARANTINED  abort_ack passed first (a rank silent or cut off): pages still NOT reusable, the
                 Abort still resent; left when every rank acknowledged, or after ``quarantine``
    CUTTING      a quarantined room (a rank was silent or cut off) is now acknowledged by every rank:
                 the connections from their hosts are being cut, which ends bytes stuck in them
    SETTLING     every rank acknowledged, but an ack proves nothing about a connection: a write of
                 the room failed (its fence proved the engine queue drained, not the connections), or
                 a rank restarted after it was told the destinations; or this rank cannot cut (or
                 the cut failed): pages come back after ``quarantine_settle`` (a time bound, not a
                 proof). A cut is not made here: it would fail every other write in flight on those
                 connections (measured: each cut failed the next room's write, whose fence led to the
                 next cut)
    RELEASED     pages reusable: proven by the acks alone (every write of the room completed), or by
                 the acks and the cut; or settled
    TIMED_OUT    the quarantine bound passed with an ack missing: pages released anyway, the only
                 unsafe release, counted and logged

Prefill side, one per aborted room:

    RECEIVED   Abort arrived; the room is failed and its queued chunks skipped
    DRAINING   waiting for writes already submitted to complete
    ACKED      nothing of the room is in flight: AbortAck sent to every decode rank that asked
"""

from __future__ import annotations

import enum

from pdkv.protocol.machines._base import MachineSpec, StateMachine, edges
from pdkv.protocol.machines._notes import EdgeNote, EdgeNotes


class DecodeAbortState(enum.Enum):
    REQUESTED = "requested"
    QUARANTINED = "quarantined"
    CUTTING = "cutting"
    SETTLING = "settling"
    RELEASED = "released"
    TIMED_OUT = "timed_out"


class DecodeAbortTrigger(enum.Enum):
    ALL_ACKED = "all_acked"  # every rank acknowledged and no write of the room failed
    ACKED_UNPROVEN = "acked_unproven"  # every rank acknowledged, but a write failed or its writer restarted
    ACKED_AFTER_QUARANTINE = "acked_after_quarantine"  # a quarantined room's last ack, on a rank that cuts
    CUT = "cut"  # the connections from those hosts were cut
    CUT_FAILED = "cut_failed"
    SETTLED = "settled"  # quarantine_settle passed since the acks (or since the cut began)
    ACK_TIMEOUT = "ack_timeout"
    QUARANTINE_TIMEOUT = "quarantine_timeout"


class PrefillAbortState(enum.Enum):
    RECEIVED = "received"
    DRAINING = "draining"
    ACKED = "acked"


class PrefillAbortTrigger(enum.Enum):
    DRAIN = "drain"
    DRAINED = "drained"


_DA = DecodeAbortState
_DAT = DecodeAbortTrigger
_AWAITING = (_DA.REQUESTED, _DA.QUARANTINED)

DECODE_ABORT = MachineSpec(
    name="DecodeAbort",
    states=DecodeAbortState,
    triggers=DecodeAbortTrigger,
    initial=_DA.REQUESTED,
    edges=(
        edges(_DAT.ALL_ACKED, [_DA.REQUESTED], _DA.RELEASED),
        edges(_DAT.ACKED_UNPROVEN, _AWAITING, _DA.SETTLING),
        edges(_DAT.ACKED_AFTER_QUARANTINE, [_DA.QUARANTINED], _DA.CUTTING),
        edges(_DAT.CUT, [_DA.CUTTING], _DA.RELEASED),
        edges(_DAT.CUT_FAILED, [_DA.CUTTING], _DA.SETTLING),
        edges(_DAT.SETTLED, [_DA.CUTTING, _DA.SETTLING], _DA.RELEASED),
        edges(_DAT.ACK_TIMEOUT, [_DA.REQUESTED], _DA.QUARANTINED),
        edges(_DAT.QUARANTINE_TIMEOUT, [_DA.QUARANTINED], _DA.TIMED_OUT),
    ),
)

PREFILL_ABORT = MachineSpec(
    name="PrefillAbort",
    states=PrefillAbortState,
    triggers=PrefillAbortTrigger,
    initial=PrefillAbortState.RECEIVED,
    edges=(
        edges(PrefillAbortTrigger.DRAIN, [PrefillAbortState.RECEIVED], PrefillAbortState.DRAINING),
        edges(PrefillAbortTrigger.DRAINED, [PrefillAbortState.DRAINING], PrefillAbortState.ACKED),
    ),
)


# Guards and effects of the edges, for the diagrams only (the endpoints decide and act).
DECODE_ABORT_NOTES = EdgeNotes(
    DECODE_ABORT,
    {
        (_DAT.ALL_ACKED, _DA.RELEASED): EdgeNote(
            guard="AbortAck from every rank told the destinations, none after a failed write or restart",
            effects=("ReleasePages(acked)",),
        ),
        (_DAT.ACKED_UNPROVEN, _DA.SETTLING): EdgeNote(
            guard="every rank acked; one after a fence or a restart, or quarantined and no cut here",
            effects=("wait quarantine_settle",),
        ),
        (_DAT.ACKED_AFTER_QUARANTINE, _DA.CUTTING): EdgeNote(
            guard="a quarantined room's last ack; this rank can cut", effects=("CutConnections(their hosts)",)
        ),
        (_DAT.CUT, _DA.RELEASED): EdgeNote(
            guard="every connection from those hosts closed", effects=("ReleasePages(cut)",)
        ),
        (_DAT.CUT_FAILED, _DA.SETTLING): EdgeNote(guard="the cut failed", effects=("wait quarantine_settle",)),
        (_DAT.SETTLED, _DA.RELEASED): EdgeNote(
            guard="quarantine_settle passed", effects=("ReleasePages(settled, unproven)",)
        ),
        (_DAT.ACK_TIMEOUT, _DA.QUARANTINED): EdgeNote(
            guard="abort_ack passed, an ack missing", effects=("pages held", "Abort still resent")
        ),
        (_DAT.QUARANTINE_TIMEOUT, _DA.TIMED_OUT): EdgeNote(
            guard="quarantine passed", effects=("ReleasePages(unsafe), counted and logged",)
        ),
    },
)

PREFILL_ABORT_NOTES = EdgeNotes(
    PREFILL_ABORT,
    {
        (PrefillAbortTrigger.DRAIN, PrefillAbortState.DRAINING): EdgeNote(
            guard="Abort from a registered decode rank", effects=("fail the room", "skip queued chunks")
        ),
        (PrefillAbortTrigger.DRAINED, PrefillAbortState.ACKED): EdgeNote(
            guard="no write of the room in flight", effects=("send AbortAck to every asking rank",)
        ),
    },
)


class DecodeAbortMachine(StateMachine[DecodeAbortState, DecodeAbortTrigger]):
    def __init__(self, label: str) -> None:
        super().__init__(DECODE_ABORT, label)


class PrefillAbortMachine(StateMachine[PrefillAbortState, PrefillAbortTrigger]):
    def __init__(self, label: str) -> None:
        super().__init__(PREFILL_ABORT, label)
