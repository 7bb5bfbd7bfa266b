"""The prefill side's abort handshake (DESIGN sections 5 and 8); the decode side's is ``decode_abort``.

One per aborted room:

    RECEIVED   Abort arrived; the room is failed and its queued chunks skipped
    DRAINING   waiting for writes already submitted to complete
    ACKED      nothing of the room is in flight: AbortAck sent to every decode rank that asked
"""

from __future__ import annotations

import enum

from pdkv.protocol.machines._base import MachineSpec, StateMachine, edges
from pdkv.protocol.machines._notes import EdgeNote, EdgeNotes


class PrefillAbortState(enum.Enum):
    RECEIVED = "received"
    DRAINING = "draining"
    ACKED = "acked"


class PrefillAbortTrigger(enum.Enum):
    DRAIN = "drain"
    DRAINED = "drained"


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


class PrefillAbortMachine(StateMachine[PrefillAbortState, PrefillAbortTrigger]):
    def __init__(self, label: str) -> None:
        super().__init__(PREFILL_ABORT, label)
