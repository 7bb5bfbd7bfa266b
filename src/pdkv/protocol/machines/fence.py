"""A fence owed to one decode rank for one room (DESIGN section 8, ``specs/protocol.md`` section 5).

A write of the room to that rank failed (or timed out): bytes of it may still be queued in the
engine, so before the room's AbortAck (or its Success, for a per-layer context no chunk finished) the
prefill writes one block of the failed write again through the same engine queue. Its completion
proves every earlier slice to that rank left the queue; every later AbortAck of the room then says
``fenced`` (its bytes may still be in a connection: the decode lets the pages settle).

    OWED     not written yet, or written and failed (retried at ``retry_at`` or at the next Abort)
    RUNNING  the fence write is on its way
    DONE     completed (kept while the room's id is a tombstone)

Inputs: ``submit`` (Success waits for it, or its retry is due), ``ack_wanted`` (the room's AbortAck to
that rank is due: it goes once the fence is done), ``completed``, ``failed``.
"""

from __future__ import annotations

from pdkv.protocol.effects import Notice, NoticeLevel, Send, SubmitFence
from pdkv.protocol.machines._base import MachineSpec, StateMachine, row
from pdkv.protocol.machines._prefill_side import FenceInput, FenceState, FenceStep, peer_text
from pdkv.protocol.messages import AbortAck

_S = FenceState
_I = FenceInput


def write_fence(s: FenceStep) -> None:
    s.side.count("fences_submitted")
    s.side.emit(SubmitFence(room=s.room, peer=s.peer, fence=s.fence.write))


def send_fenced_ack(s: FenceStep) -> None:
    """The fence drained the engine queue: the AbortAck says so (the decode still lets the pages
    settle, or cuts its connections from us: bytes may be in a connection)."""
    peer = s.side.registered(s.peer)
    if peer is not None:
        s.side.emit(Send(to=peer.endpoint, message=AbortAck(origin=s.side.origin, room=s.room, fenced=True)))


def retry_later(s: FenceStep) -> None:
    """A write on an engine connection that died (a partition, the decode's cut) fails once before
    the engine reconnects: written again ``abort_resend`` later on its own, so that it does not wait
    for the decode's doubling resend interval (or at the next Abort, if that comes first)."""
    s.side.count("fences_failed")
    s.fence.retry_at = s.now + s.side.timeouts.abort_resend
    s.side.schedule_fence_retry(s.room, s.peer, s.fence.retry_at)
    s.side.emit(
        Notice(
            level=NoticeLevel.WARNING,
            text=f"room {s.room}: fence write to {peer_text(s.peer)} failed ({s.reason}); written again "
            f"in {s.side.timeouts.abort_resend:g} s or at the next Abort, its AbortAck waits",
            room=s.room,
        )
    )


FENCE = MachineSpec(
    name="Fence",
    states=FenceState,
    triggers=FenceInput,
    initial=_S.OWED,
    edges=(
        row(_I.SUBMIT, _S.OWED, _S.RUNNING, then=[write_fence]),
        row(_I.SUBMIT, (_S.RUNNING, _S.DONE), None),  # on its way already, or done
        row(_I.ACK_WANTED, _S.OWED, _S.RUNNING, then=[write_fence]),
        row(_I.ACK_WANTED, _S.RUNNING, None),  # a resent Abort while it is on its way: acked when done
        row(_I.ACK_WANTED, _S.DONE, None, then=[send_fenced_ack]),
        row(_I.COMPLETED, _S.RUNNING, _S.DONE),
        row(_I.FAILED, _S.RUNNING, _S.OWED, then=[retry_later]),
    ),
)


class FenceMachine(StateMachine[FenceState, FenceInput]):
    def __init__(self, label: str) -> None:
        super().__init__(FENCE, label)


__all__ = ["FENCE", "FenceInput", "FenceMachine", "FenceState"]
