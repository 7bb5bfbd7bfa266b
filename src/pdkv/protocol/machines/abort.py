"""The prefill side's abort handshake (DESIGN sections 5 and 8); the decode side's is ``decode_abort``.

One per room a decode rank aborted (created by its first Abort; the room failed with it):

    DRAINING   writes of the room already submitted may still land: no AbortAck yet
    ACKED      nothing of the room is in flight: every decode rank that asked was answered (an
               AbortAck, or first the fence it waits for when a write of the room to it failed)

Inputs: ``asked`` (an Abort, or its resend, from a registered decode rank), ``writes_ended`` (a write of
the room ended), ``fenced`` (the fence to a rank that asked completed: its AbortAck can go).
"""

from __future__ import annotations

from pdkv.protocol.machines._base import MachineSpec, StateMachine, row
from pdkv.protocol.machines._prefill_side import AbortStep, PrefillAbortInput, PrefillAbortState, peer_order

_S = PrefillAbortState
_I = PrefillAbortInput


def writes_in_flight(s: AbortStep) -> bool:
    """A write of the room may still land (a chunk transferring, a per-layer context writing)."""
    return s.side.writes_in_flight(s.room) > 0


def asked_by_sender(s: AbortStep) -> bool:
    return s.sender in s.room.ack_to


def note_asker(s: AbortStep) -> None:
    assert s.sender is not None
    s.room.ack_to.add(s.sender)


def answer_asker(s: AbortStep) -> None:
    assert s.sender is not None
    s.side.answer_abort(s.room.room, s.sender)


def answer_every_asker(s: AbortStep) -> None:
    for key in sorted(s.room.ack_to, key=peer_order):
        s.side.answer_abort(s.room.room, key)


def forget_if_idle(s: AbortStep) -> None:
    s.side.forget_if_idle(s.room)


PREFILL_ABORT = MachineSpec(
    name="PrefillAbort",
    states=PrefillAbortState,
    triggers=PrefillAbortInput,
    initial=_S.DRAINING,
    edges=(
        row(_I.ASKED, _S.DRAINING, None, when=writes_in_flight, then=[note_asker]),
        row(_I.ASKED, _S.DRAINING, _S.ACKED, then=[note_asker, answer_every_asker]),
        row(_I.ASKED, _S.ACKED, None, then=[note_asker, answer_asker]),  # a resent Abort: answered again
        row(_I.WRITES_ENDED, _S.DRAINING, None, when=writes_in_flight),
        row(_I.WRITES_ENDED, _S.DRAINING, _S.ACKED, then=[answer_every_asker, forget_if_idle]),
        row(_I.WRITES_ENDED, _S.ACKED, None),
        row(_I.FENCED, _S.DRAINING, None),  # the ack goes when the writes end (fenced by then)
        row(_I.FENCED, _S.ACKED, None, when=asked_by_sender, then=[answer_asker]),
        row(_I.FENCED, _S.ACKED, None),  # a fence Success waited for, before the room failed
    ),
)


class PrefillAbortMachine(StateMachine[PrefillAbortState, PrefillAbortInput]):
    def __init__(self, label: str) -> None:
        super().__init__(PREFILL_ABORT, label)


PrefillAbortTrigger = PrefillAbortInput  # the name earlier code used

__all__ = [
    "PREFILL_ABORT",
    "PrefillAbortInput",
    "PrefillAbortMachine",
    "PrefillAbortState",
    "PrefillAbortTrigger",
]
