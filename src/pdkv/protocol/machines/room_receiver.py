"""Receiver room: one room on one decode rank (DESIGN section 5).

Every rule that moves a receiver room lives in this table; the endpoint decides *when* to fire.

    BOOTSTRAPPING      waiting for registration with every target prefill rank (deadline: bootstrap)
    WAITING_FOR_INPUT  TransferRequests sent, no status yet (deadline: waiting)
    TRANSFERRING       some required prefill ranks reported Success, not all (deadline: transfer)
    SUCCESS            every required prefill rank reported Success
    FAILED             status Failed, timeout, rejection, peer lost or restarted, abort
"""

from __future__ import annotations

import enum

from pdkv.protocol.machines._base import MachineSpec, StateMachine, edges
from pdkv.protocol.machines._notes import EdgeNote, EdgeNotes


class ReceiverRoomState(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"
    WAITING_FOR_INPUT = "waiting_for_input"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"


class ReceiverRoomTrigger(enum.Enum):
    REQUESTS_SENT = "requests_sent"
    PROGRESS = "progress"
    ALL_SUCCEEDED = "all_succeeded"
    FAIL = "fail"


_S = ReceiverRoomState
_T = ReceiverRoomTrigger

RECEIVER_ROOM = MachineSpec(
    name="ReceiverRoom",
    states=ReceiverRoomState,
    triggers=ReceiverRoomTrigger,
    initial=_S.BOOTSTRAPPING,
    edges=(
        edges(_T.REQUESTS_SENT, [_S.BOOTSTRAPPING], _S.WAITING_FOR_INPUT),
        edges(_T.PROGRESS, [_S.WAITING_FOR_INPUT, _S.TRANSFERRING], _S.TRANSFERRING),
        edges(_T.ALL_SUCCEEDED, [_S.WAITING_FOR_INPUT, _S.TRANSFERRING], _S.SUCCESS),
        edges(_T.FAIL, [_S.BOOTSTRAPPING, _S.WAITING_FOR_INPUT, _S.TRANSFERRING], _S.FAILED),
    ),
)


# Guards and effects of the edges, for the diagrams only (the endpoint decides and acts).
RECEIVER_ROOM_NOTES = EdgeNotes(
    RECEIVER_ROOM,
    {
        (_T.REQUESTS_SENT, _S.WAITING_FOR_INPUT): EdgeNote(
            guard="every target registered",
            effects=("send TransferRequest to each target", "arm waiting deadline"),
        ),
        (_T.PROGRESS, _S.TRANSFERRING): EdgeNote(
            guard="Success from a required rank, others missing", effects=("arm transfer deadline",)
        ),
        (_T.ALL_SUCCEEDED, _S.SUCCESS): EdgeNote(guard="Success from every required rank"),
        (_T.FAIL, _S.FAILED): EdgeNote(
            guard="status Failed, abort, deadline, peer lost or restarted",
            effects=("send Abort to each ready target", "start DecodeAbort"),
        ),
    },
)


class ReceiverRoomMachine(StateMachine[ReceiverRoomState, ReceiverRoomTrigger]):
    def __init__(self, label: str) -> None:
        super().__init__(RECEIVER_ROOM, label)
