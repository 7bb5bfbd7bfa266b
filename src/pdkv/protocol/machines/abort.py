"""Abort handshakes (DESIGN sections 5 and 8): one machine per side.

Decode side, one per aborted room:

    REQUESTED    Abort sent to every prefill rank of the room (resent with backoff until acked);
                 pages NOT reusable
    ACKED        every prefill rank that knew the room's destinations acknowledged: pages reusable
    QUARANTINED  abort_ack passed first (a rank silent or cut off): pages still NOT reusable, the
                 Abort still resent; left when every rank acknowledged (ACKED) or after the long
                 ``quarantine`` bound
    TIMED_OUT    the quarantine bound passed: pages released anyway, the only unsafe release,
                 counted and logged

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
    ACKED = "acked"
    QUARANTINED = "quarantined"
    TIMED_OUT = "timed_out"


class DecodeAbortTrigger(enum.Enum):
    ALL_ACKED = "all_acked"
    ACK_TIMEOUT = "ack_timeout"
    QUARANTINE_TIMEOUT = "quarantine_timeout"


class PrefillAbortState(enum.Enum):
    RECEIVED = "received"
    DRAINING = "draining"
    ACKED = "acked"


class PrefillAbortTrigger(enum.Enum):
    DRAIN = "drain"
    DRAINED = "drained"


DECODE_ABORT = MachineSpec(
    name="DecodeAbort",
    states=DecodeAbortState,
    triggers=DecodeAbortTrigger,
    initial=DecodeAbortState.REQUESTED,
    edges=(
        edges(
            DecodeAbortTrigger.ALL_ACKED,
            [DecodeAbortState.REQUESTED, DecodeAbortState.QUARANTINED],
            DecodeAbortState.ACKED,
        ),
        edges(DecodeAbortTrigger.ACK_TIMEOUT, [DecodeAbortState.REQUESTED], DecodeAbortState.QUARANTINED),
        edges(
            DecodeAbortTrigger.QUARANTINE_TIMEOUT, [DecodeAbortState.QUARANTINED], DecodeAbortState.TIMED_OUT
        ),
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
        (DecodeAbortTrigger.ALL_ACKED, DecodeAbortState.ACKED): EdgeNote(
            guard="AbortAck from every rank told the destinations (+ settle time if quarantined)",
            effects=("ReleasePages(safe)",),
        ),
        (DecodeAbortTrigger.ACK_TIMEOUT, DecodeAbortState.QUARANTINED): EdgeNote(
            guard="abort_ack passed, an ack missing", effects=("pages held", "Abort still resent")
        ),
        (DecodeAbortTrigger.QUARANTINE_TIMEOUT, DecodeAbortState.TIMED_OUT): EdgeNote(
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
