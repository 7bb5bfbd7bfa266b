"""Abort handshakes (DESIGN sections 5 and 8): one machine per side.

Decode side, one per aborted room:

    REQUESTED  Abort sent once to every prefill rank of the room; pages NOT reusable
    ACKED      every prefill rank that knew the room's destinations acknowledged: pages reusable
    TIMED_OUT  abort_ack_timeout passed first: pages released anyway, counted and logged as unsafe

Prefill side, one per aborted room:

    RECEIVED   Abort arrived; the room is failed and its queued chunks skipped
    DRAINING   waiting for writes already submitted to complete
    ACKED      nothing of the room is in flight: AbortAck sent to every decode rank that asked
"""

from __future__ import annotations

import enum

from pdkv.protocol.machines._base import MachineSpec, StateMachine, edges


class DecodeAbortState(enum.Enum):
    REQUESTED = "requested"
    ACKED = "acked"
    TIMED_OUT = "timed_out"


class DecodeAbortTrigger(enum.Enum):
    ALL_ACKED = "all_acked"
    ACK_TIMEOUT = "ack_timeout"


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
        edges(DecodeAbortTrigger.ALL_ACKED, [DecodeAbortState.REQUESTED], DecodeAbortState.ACKED),
        edges(DecodeAbortTrigger.ACK_TIMEOUT, [DecodeAbortState.REQUESTED], DecodeAbortState.TIMED_OUT),
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


class DecodeAbortMachine(StateMachine[DecodeAbortState, DecodeAbortTrigger]):
    def __init__(self, label: str) -> None:
        super().__init__(DECODE_ABORT, label)


class PrefillAbortMachine(StateMachine[PrefillAbortState, PrefillAbortTrigger]):
    def __init__(self, label: str) -> None:
        super().__init__(PREFILL_ABORT, label)
