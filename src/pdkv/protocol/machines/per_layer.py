"""Per-layer context: one (room, chunk) sent layer by layer while the prefill forward runs (DESIGN section 7).

Every rule that moves a per-layer context lives in this table; ``pdkv.protocol.layers`` fires it from
its inputs (registration, layer events, submissions, ``send()``, cancel, the end of the writes) and
``pdkv.runtime.per_layer`` only carries the writes out. A context is registered before the chunk's
forward; pages already resident are submitted at once, then each layer's pages as the model reports
the layer's KV written. ``send()`` for the chunk then finishes the context instead of sending the
chunk again.

    COLLECTING        registered; layers are submitted as the forward reports them
    LAYERS_SUBMITTED  every layer submitted; waiting for ``send()`` to finish the chunk
    AWAITING_LAYERS   ``send()`` came before the forward's last layer: the finisher waits (bounded)
    COMPLETING        every layer submitted and ``send()`` came: waiting for the engine's completions
    CANCELLING        the room failed or was aborted: nothing more is submitted; dropped once the
                      writes already submitted ended
    FAILING           a layer cannot be written (its ready wait failed or timed out, the event queue
                      was full, a write failed, the finish deadline passed, ``send()`` gave other
                      pages): nothing more is submitted; failed once the submitted writes ended
    DONE              every write of the chunk completed
    FAILED            a write failed, or the context broke (FAILING); no write of it can land any more
    DROPPED           cancelled (or broken and never sent); no write of it can land any more

A COMPLETING context cannot be cancelled: its writes are all submitted, so the finisher waits for
them and ends DONE or FAILED; the room's abort acknowledgement waits for that chunk as for any
chunk in flight. No terminal state is entered while a write of the context can still land.
"""

from __future__ import annotations

from pdkv.protocol.machines._base import MachineEnum, MachineSpec, StateMachine, edges
from pdkv.protocol.machines._notes import EdgeNote, EdgeNotes


class PerLayerState(MachineEnum):
    COLLECTING = "collecting"
    LAYERS_SUBMITTED = "layers_submitted"
    AWAITING_LAYERS = "awaiting_layers"
    COMPLETING = "completing"
    CANCELLING = "cancelling"
    FAILING = "failing"
    DONE = "done"
    FAILED = "failed"
    DROPPED = "dropped"


class PerLayerTrigger(MachineEnum):
    ALL_LAYERS_SUBMITTED = "all_layers_submitted"
    FINISH = "finish"
    COMPLETE = "complete"
    CANCEL = "cancel"
    BREAK = "break"
    FAIL = "fail"
    DROP = "drop"


_S = PerLayerState
_T = PerLayerTrigger

SUBMITTING = (_S.COLLECTING, _S.LAYERS_SUBMITTED, _S.AWAITING_LAYERS)
"""States in which the context's layers are still submitted (cancel and break stop that)."""

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
        edges(_T.CANCEL, SUBMITTING, _S.CANCELLING),
        edges(_T.BREAK, SUBMITTING, _S.FAILING),
        edges(_T.FAIL, [_S.FAILING, _S.COMPLETING], _S.FAILED),
        edges(_T.DROP, [_S.CANCELLING, _S.FAILING], _S.DROPPED),
    ),
)


# Guards and effects of the edges, for the diagrams only (pdkv.protocol.layers decides, the runtime acts).
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
        (_T.CANCEL, _S.CANCELLING): EdgeNote(
            guard="room failed, aborted or complete without it", effects=("drain on the peer's lane",)
        ),
        (_T.BREAK, _S.FAILING): EdgeNote(
            guard="ready wait failed, queue full, write failed, finish deadline, other pages",
            effects=("stop submitting",),
        ),
        (_T.FAIL, _S.FAILED): EdgeNote(
            guard="submitted writes ended (one failed, or broken)", effects=("chunk_failed",)
        ),
        (_T.DROP, _S.DROPPED): EdgeNote(
            guard="submitted writes ended, no send() holds it", effects=("layer_ended",)
        ),
    },
)


class PerLayerMachine(StateMachine[PerLayerState, PerLayerTrigger]):
    def __init__(self, label: str) -> None:
        super().__init__(PER_LAYER, label)
