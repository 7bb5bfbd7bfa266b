"""Chunk: one prefill forward's share of a room on one prefill rank (DESIGN section 5).

REGISTERED    queued by ``send()``, not yet picked by a transfer worker
TRANSFERRING  a worker submitted its writes (they may land at any moment)
DONE          every write of the chunk completed
FAILED        the engine reported a failure (the room fails with it)
SKIPPED       the room failed or was aborted before a worker picked the chunk: nothing written,
              so nothing can land in pages the decode side may have reused
"""

from __future__ import annotations

import enum

from pdkv.protocol.machines._base import MachineSpec, StateMachine, edges
from pdkv.protocol.machines._notes import EdgeNote, EdgeNotes


class ChunkState(enum.Enum):
    REGISTERED = "registered"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    SKIPPED = "skipped"


class ChunkTrigger(enum.Enum):
    START = "start"
    COMPLETE = "complete"
    FAIL = "fail"
    SKIP = "skip"


_S = ChunkState
_T = ChunkTrigger

CHUNK = MachineSpec(
    name="Chunk",
    states=ChunkState,
    triggers=ChunkTrigger,
    initial=_S.REGISTERED,
    edges=(
        edges(_T.START, [_S.REGISTERED], _S.TRANSFERRING),
        edges(_T.COMPLETE, [_S.TRANSFERRING], _S.DONE),
        edges(_T.FAIL, [_S.TRANSFERRING], _S.FAILED),
        edges(_T.SKIP, [_S.REGISTERED], _S.SKIPPED),
    ),
)


# Guards and effects of the edges, for the diagrams only (the endpoint decides and acts).
CHUNK_NOTES = EdgeNotes(
    CHUNK,
    {
        (_T.START, _S.TRANSFERRING): EdgeNote(guard="room not failed", effects=("worker writes",)),
        (_T.COMPLETE, _S.DONE): EdgeNote(
            guard="every write completed", effects=("room Success if last and all Done",)
        ),
        (_T.FAIL, _S.FAILED): EdgeNote(
            guard="engine failure, writes ended", effects=("fail the room", "AbortAck if draining")
        ),
        (_T.SKIP, _S.SKIPPED): EdgeNote(guard="room failed before start", effects=("write nothing",)),
    },
)


class ChunkMachine(StateMachine[ChunkState, ChunkTrigger]):
    def __init__(self, label: str) -> None:
        super().__init__(CHUNK, label)
