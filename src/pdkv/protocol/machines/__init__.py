"""The state machines of pdkv, one module each; ``ALL_MACHINES`` is what ``pdkv diagram`` renders."""

from __future__ import annotations

from typing import Any

from pdkv.protocol.machines._base import Edge, MachineSpec, StateMachine
from pdkv.protocol.machines.abort import (
    PREFILL_ABORT,
    PrefillAbortInput,
    PrefillAbortMachine,
    PrefillAbortState,
    PrefillAbortTrigger,
)
from pdkv.protocol.machines.chunk import CHUNK, ChunkInput, ChunkMachine, ChunkState, ChunkTrigger
from pdkv.protocol.machines.decode_abort import (
    DECODE_ABORT,
    DecodeAbortInput,
    DecodeAbortMachine,
    DecodeAbortState,
    DecodeAbortTrigger,
)
from pdkv.protocol.machines.decode_rank import (
    DECODE_RANK,
    DecodeRankInput,
    DecodeRankMachine,
    DecodeRankState,
)
from pdkv.protocol.machines.fence import FENCE, FenceInput, FenceMachine, FenceState
from pdkv.protocol.machines.per_layer import PER_LAYER, PerLayerMachine, PerLayerState, PerLayerTrigger
from pdkv.protocol.machines.prefill_rank import (
    PREFILL_RANK,
    PrefillRankInput,
    PrefillRankMachine,
    PrefillRankState,
)
from pdkv.protocol.machines.room_receiver import (
    RECEIVER_ROOM,
    ReceiverRoomInput,
    ReceiverRoomMachine,
    ReceiverRoomState,
    ReceiverRoomTrigger,
)
from pdkv.protocol.machines.room_sender import (
    FAILURE_NOTICE,
    SENDER_ROOM,
    FailureNoticeInput,
    FailureNoticeMachine,
    FailureNoticeState,
    SenderRoomInput,
    SenderRoomMachine,
    SenderRoomState,
    SenderRoomTrigger,
)
from pdkv.protocol.poll import KVPoll, consensus, consensus_columns

# Heterogeneous specs: each has its own state and trigger enums.
ALL_MACHINES: tuple[MachineSpec[Any, Any], ...] = (
    SENDER_ROOM,
    FAILURE_NOTICE,
    RECEIVER_ROOM,
    CHUNK,
    DECODE_ABORT,
    PREFILL_ABORT,
    PER_LAYER,
    DECODE_RANK,
    PREFILL_RANK,
    FENCE,
)

__all__ = [
    "ALL_MACHINES",
    "CHUNK",
    "DECODE_ABORT",
    "DECODE_RANK",
    "FAILURE_NOTICE",
    "FENCE",
    "PER_LAYER",
    "PREFILL_ABORT",
    "PREFILL_RANK",
    "RECEIVER_ROOM",
    "SENDER_ROOM",
    "ChunkInput",
    "ChunkMachine",
    "ChunkState",
    "ChunkTrigger",
    "DecodeAbortInput",
    "DecodeAbortMachine",
    "DecodeAbortState",
    "DecodeAbortTrigger",
    "DecodeRankInput",
    "DecodeRankMachine",
    "DecodeRankState",
    "Edge",
    "FailureNoticeInput",
    "FailureNoticeMachine",
    "FailureNoticeState",
    "FenceInput",
    "FenceMachine",
    "FenceState",
    "KVPoll",
    "MachineSpec",
    "PerLayerMachine",
    "PerLayerState",
    "PerLayerTrigger",
    "PrefillAbortInput",
    "PrefillAbortMachine",
    "PrefillAbortState",
    "PrefillAbortTrigger",
    "PrefillRankInput",
    "PrefillRankMachine",
    "PrefillRankState",
    "ReceiverRoomInput",
    "ReceiverRoomMachine",
    "ReceiverRoomState",
    "ReceiverRoomTrigger",
    "SenderRoomInput",
    "SenderRoomMachine",
    "SenderRoomState",
    "SenderRoomTrigger",
    "StateMachine",
    "consensus",
    "consensus_columns",
]
