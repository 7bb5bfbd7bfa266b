"""Sender room: one room on one prefill rank (DESIGN section 5).

Every rule that moves a sender room lives in this table; the endpoint decides *when* to fire.

    BOOTSTRAPPING      waiting for all ``required_dst_info_num`` TransferRequests (deadline: bootstrap)
    WAITING_FOR_INPUT  destinations known; the scheduler may run the forward (deadline: inflight)
    TRANSFERRING       at least one chunk queued (deadline: inflight, counted from WAITING_FOR_INPUT)
    SUCCESS            last chunk landed at every destination, statuses sent
    FAILED             abort, engine error, no destination, bad request, timeout, peer restart
"""

from __future__ import annotations

import enum

from pdkv.protocol.machines._base import MachineSpec, StateMachine, edges
from pdkv.protocol.machines._notes import EdgeNote, EdgeNotes


class SenderRoomState(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"
    WAITING_FOR_INPUT = "waiting_for_input"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"


class SenderRoomTrigger(enum.Enum):
    ALL_REQUESTS_IN = "all_requests_in"
    QUEUE_CHUNK = "queue_chunk"
    LAST_CHUNK_DONE = "last_chunk_done"
    FAIL = "fail"


_S = SenderRoomState
_T = SenderRoomTrigger

SENDER_ROOM = MachineSpec(
    name="SenderRoom",
    states=SenderRoomState,
    triggers=SenderRoomTrigger,
    initial=_S.BOOTSTRAPPING,
    edges=(
        edges(_T.ALL_REQUESTS_IN, [_S.BOOTSTRAPPING], _S.WAITING_FOR_INPUT),
        edges(_T.QUEUE_CHUNK, [_S.WAITING_FOR_INPUT, _S.TRANSFERRING], _S.TRANSFERRING),
        edges(_T.LAST_CHUNK_DONE, [_S.TRANSFERRING], _S.SUCCESS),
        edges(_T.FAIL, [_S.BOOTSTRAPPING, _S.WAITING_FOR_INPUT, _S.TRANSFERRING], _S.FAILED),
    ),
)


# Guards and effects of the edges, for the diagrams only (the endpoint decides and acts).
SENDER_ROOM_NOTES = EdgeNotes(
    SENDER_ROOM,
    {
        (_T.ALL_REQUESTS_IN, _S.WAITING_FOR_INPUT): EdgeNote(
            guard="required_dst_info_num valid requests in", effects=("arm inflight deadline",)
        ),
        (_T.QUEUE_CHUNK, _S.TRANSFERRING): EdgeNote(
            guard="chunk keeps the page contract", effects=("SubmitChunk to every real destination",)
        ),
        (_T.LAST_CHUNK_DONE, _S.SUCCESS): EdgeNote(
            guard="last chunk queued, every chunk Done, no layer write left",
            effects=("send TransferStatus(Success) to each real destination",),
        ),
        (_T.FAIL, _S.FAILED): EdgeNote(
            guard="abort, engine error, bad request, deadline, peer lost",
            effects=("skip Registered chunks", "send TransferStatus(Failed), resent until Abort"),
        ),
    },
)


class SenderRoomMachine(StateMachine[SenderRoomState, SenderRoomTrigger]):
    def __init__(self, label: str) -> None:
        super().__init__(SENDER_ROOM, label)
