"""Per-layer context: one (room, chunk) sent layer by layer while the prefill forward runs (DESIGN section 7).

Every rule that moves a per-layer context lives in this table; ``pdkv.runtime.per_layer`` decides
*when* to fire. A context is registered before the chunk's forward; pages already resident are
submitted at once, then each layer's pages as the model reports the layer's KV written. ``send()``
for the chunk then finishes the context instead of sending the chunk again.

    COLLECTING        registered; layers are submitted as the forward reports them
    LAYERS_SUBMITTED  every layer submitted; waiting for ``send()`` to finish the chunk
    AWAITING_LAYERS   ``send()`` came before the forward's last layer: the finisher waits (bounded)
    COMPLETING        every layer submitted and ``send()`` came: waiting for the engine's completions
    DONE              every write of the chunk completed
    FAILED            a write failed, or the finish deadline passed first; writes already submitted
                      were awaited before the context reached this state
    DROPPED           the room failed or was aborted; writes already submitted were awaited and the
                      context was discarded (nothing more is written for it)

A COMPLETING context cannot be dropped: its writes are all submitted, so the finisher waits for
them and ends DONE or FAILED; the room's abort acknowledgement waits for that chunk as for any
chunk in flight.
"""

from __future__ import annotations

import enum

from pdkv.protocol.machines._base import MachineSpec, StateMachine, edges
from pdkv.protocol.machines._notes import EdgeNote, EdgeNotes


class PerLayerState(enum.Enum):
    COLLECTING = "collecting"
    LAYERS_SUBMITTED = "layers_submitted"
    AWAITING_LAYERS = "awaiting_layers"
    COMPLETING = "completing"
    DONE = "done"
    FAILED = "failed"
    DROPPED = "dropped"


class PerLayerTrigger(enum.Enum):
    ALL_LAYERS_SUBMITTED = "all_layers_submitted"
    FINISH = "finish"
    COMPLETE = "complete"
    FAIL = "fail"
    DROP = "drop"


_S = PerLayerState
_T = PerLayerTrigger

PER_LAYER = MachineSpec(
    name="PerLayer",
    states=PerLayerState,
    triggers=PerLayerTrigger,
    initial=_S.COLLECTING,
    edges=(
        edges(_T.ALL_LAYERS_SUBMITTED, [_S.COLLECTING], _S.LAYERS_SUBMITTED),
        edges(_T.ALL_LAYERS_SUBMITTED, [_S.AWAITING_LAYERS], _S.COMPLETING),
        edges(_T.FINISH, [_S.COLLECTING], _S.AWAITING_LAYERS),
        edges(_T.FINISH, [_S.LAYERS_SUBMITTED], _S.COMPLETING),
        edges(_T.COMPLETE, [_S.COMPLETING], _S.DONE),
        edges(_T.FAIL, [_S.AWAITING_LAYERS, _S.COMPLETING], _S.FAILED),
        edges(_T.DROP, [_S.COLLECTING, _S.LAYERS_SUBMITTED, _S.AWAITING_LAYERS], _S.DROPPED),
    ),
)


# Guards and effects of the edges, for the diagrams only (pdkv.runtime.per_layer decides and acts).
PER_LAYER_NOTES = EdgeNotes(
    PER_LAYER,
    {
        (_T.ALL_LAYERS_SUBMITTED, _S.LAYERS_SUBMITTED): EdgeNote(guard="last layer submitted before send()"),
        (_T.ALL_LAYERS_SUBMITTED, _S.COMPLETING): EdgeNote(
            guard="last layer submitted after send()", effects=("wake the finisher",)
        ),
        (_T.FINISH, _S.AWAITING_LAYERS): EdgeNote(
            guard="send() before the last layer", effects=("finisher waits, bounded",)
        ),
        (_T.FINISH, _S.COMPLETING): EdgeNote(guard="send() after every layer"),
        (_T.COMPLETE, _S.DONE): EdgeNote(guard="every write completed", effects=("chunk_done",)),
        (_T.FAIL, _S.FAILED): EdgeNote(
            guard="a write failed or finish deadline", effects=("await submitted writes", "chunk_failed")
        ),
        (_T.DROP, _S.DROPPED): EdgeNote(
            guard="room failed or aborted", effects=("await submitted writes", "layer_writes_ended")
        ),
    },
)


class PerLayerMachine(StateMachine[PerLayerState, PerLayerTrigger]):
    def __init__(self, label: str) -> None:
        super().__init__(PER_LAYER, label)
