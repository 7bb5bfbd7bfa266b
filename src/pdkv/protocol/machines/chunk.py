"""Chunk: one prefill forward's share of a room on one prefill rank (DESIGN section 5).

Every rule that moves a chunk is a row below; ``PrefillEndpoint`` finds the chunk and steps it.

    REGISTERED    queued by ``send()``, not yet picked by a transfer worker
    TRANSFERRING  a worker submitted its writes (they may land at any moment)
    DONE          every write of the chunk completed
    FAILED        the engine reported a failure, or the worker failed before it started the chunk
                  (an internal error: nothing was submitted); the room fails with it
    SKIPPED       the room failed or was aborted before a worker picked the chunk: nothing written,
                  so nothing can land in pages the decode side may have reused

Inputs: ``start`` (a worker is about to write it), ``complete``, ``fail`` (the engine's answers, or
the worker's guard on an internal error, which may come before ``start``), ``skip`` (its room failed
while it waited).
"""

from __future__ import annotations

from pdkv.protocol.machines._base import MachineSpec, StateMachine, row
from pdkv.protocol.machines._prefill_side import ChunkInput, ChunkState, ChunkStep, SenderRoomState

_S = ChunkState
_I = ChunkInput


def room_failed(s: ChunkStep) -> bool:
    """Its room failed (or was aborted) while the chunk waited for a worker."""
    return s.room.machine.state is SenderRoomState.FAILED


def count_skipped(s: ChunkStep) -> None:
    s.side.count("chunks_skipped")


CHUNK = MachineSpec(
    name="Chunk",
    states=ChunkState,
    triggers=ChunkInput,
    initial=_S.REGISTERED,
    edges=(
        row(_I.START, _S.REGISTERED, _S.SKIPPED, when=room_failed, then=[count_skipped]),
        row(_I.START, _S.REGISTERED, _S.TRANSFERRING),
        row(_I.START, _S.SKIPPED, None),  # picked after it was skipped: the worker writes nothing
        row(_I.COMPLETE, _S.TRANSFERRING, _S.DONE),
        row(_I.FAIL, _S.TRANSFERRING, _S.FAILED),
        # The worker's guard, on an error before the chunk started: nothing of it was submitted.
        row(_I.FAIL, _S.REGISTERED, _S.FAILED),
        row(_I.SKIP, _S.REGISTERED, _S.SKIPPED, then=[count_skipped]),
    ),
)


class ChunkMachine(StateMachine[ChunkState, ChunkInput]):
    def __init__(self, label: str) -> None:
        super().__init__(CHUNK, label)


ChunkTrigger = ChunkInput  # the name earlier code used

__all__ = ["CHUNK", "ChunkInput", "ChunkMachine", "ChunkState", "ChunkTrigger"]
