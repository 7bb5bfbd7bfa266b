"""Peer lifecycle: one rank of the other side, as one endpoint knows it (DESIGN section 5).

Every rule that moves a peer lives in this table; the endpoints decide *when* to fire. Both sides use
it, each a part of it: a decode rank registers with prefill ranks (Registering -> Ready, and back to
Registering when one goes silent); a prefill rank accepts decode ranks, forgets one that goes silent
or restarts, and when a forgotten rank registers again holds its RegisterAck (Draining) until every
write to its previous incarnation has ended: a restarted process may reuse that memory.

    REGISTERING  decode: Register sent, no answer yet (resent every ``register_retry``)
    READY        registered both ways: its messages are accepted, it is sent heartbeats
    REJECTED     the registration was refused (layout difference); only a new registration leaves it
    FORGOTTEN    prefill: silent for ``heartbeat_timeout`` or restarted; its rooms failed, writes to it
                 that were in flight may still be draining
    DRAINING     prefill: it registered again while such writes drain; RegisterAck waits for them

A new epoch (a restarted process) is a new peer: the old one's record is replaced, not moved.
"""

from __future__ import annotations

import enum

from pdkv.protocol.machines._base import MachineSpec, StateMachine, edges
from pdkv.protocol.machines._notes import EdgeNote, EdgeNotes


class PeerState(enum.Enum):
    REGISTERING = "registering"
    READY = "ready"
    REJECTED = "rejected"
    FORGOTTEN = "forgotten"
    DRAINING = "draining"


class PeerTrigger(enum.Enum):
    ACKNOWLEDGED = "acknowledged"  # decode: RegisterAck; prefill: Register accepted, nothing draining
    REFUSED = "refused"  # the layouts differ
    SILENCE = "silence"  # decode: heard nothing for heartbeat_timeout; registers again at once
    FORGET = "forget"  # prefill: silence or a restart; its rooms fail
    REGISTERED_WHILE_DRAINING = "registered_while_draining"  # prefill: writes to the old one in flight
    DRAINED = "drained"  # prefill: those writes ended; the held RegisterAck goes out


_S = PeerState
_T = PeerTrigger

PEER = MachineSpec(
    name="Peer",
    states=PeerState,
    triggers=PeerTrigger,
    initial=_S.REGISTERING,
    edges=(
        edges(_T.ACKNOWLEDGED, [_S.REGISTERING, _S.FORGOTTEN], _S.READY),
        edges(_T.REFUSED, [_S.REGISTERING, _S.READY, _S.REJECTED, _S.FORGOTTEN, _S.DRAINING], _S.REJECTED),
        edges(_T.SILENCE, [_S.READY], _S.REGISTERING),
        edges(_T.FORGET, [_S.READY, _S.DRAINING], _S.FORGOTTEN),
        edges(_T.REGISTERED_WHILE_DRAINING, [_S.REGISTERING, _S.FORGOTTEN], _S.DRAINING),
        edges(_T.DRAINED, [_S.DRAINING], _S.READY),
    ),
)


# Guards and effects of the edges, for the diagrams only (the endpoints decide and act).
PEER_NOTES = EdgeNotes(
    PEER,
    {
        (_T.ACKNOWLEDGED, _S.READY): EdgeNote(
            guard="layouts equal, nothing draining",
            effects=("prefill: send RegisterAck", "decode: send held requests and aborts"),
        ),
        (_T.REFUSED, _S.REJECTED): EdgeNote(
            guard="layouts differ", effects=("prefill: send RegisterReject naming the difference",)
        ),
        (_T.SILENCE, _S.REGISTERING): EdgeNote(
            guard="nothing heard for heartbeat_timeout",
            effects=("ForgetPeer", "fail its rooms", "send Register"),
        ),
        (_T.FORGET, _S.FORGOTTEN): EdgeNote(
            guard="silent for heartbeat_timeout, or a newer epoch",
            effects=("ForgetPeer", "fail its rooms (TransferStatus Failed)"),
        ),
        (_T.REGISTERED_WHILE_DRAINING, _S.DRAINING): EdgeNote(
            guard="writes to the old incarnation in flight", effects=("hold RegisterAck",)
        ),
        (_T.DRAINED, _S.READY): EdgeNote(guard="those writes ended", effects=("send RegisterAck",)),
    },
)


class PeerMachine(StateMachine[PeerState, PeerTrigger]):
    def __init__(self, label: str) -> None:
        super().__init__(PEER, label)
