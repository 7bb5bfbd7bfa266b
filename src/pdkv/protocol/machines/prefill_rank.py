"""A prefill rank, as one decode rank knows it (DESIGN sections 5 and 7): its registration and liveness.

Every rule that moves the decode's record of a prefill rank is a row below; ``DecodeEndpoint`` finds
the rank and steps it. One record per rank and epoch: a newer epoch is a new record (the endpoint
replaces it and fails the old one's rooms), never a move of this machine.

    REGISTERING  Register sent, no answer yet (resent every ``register_retry``); our messages to it wait
    READY        registered: its messages are accepted, it gets heartbeats, rooms may ask it
    REJECTED     it refused our layout (the reason is kept); only a new route table registers again

Inputs: ``register_ack``, ``refused`` (RegisterReject), ``not_known`` (RegisterReject with retry: it
forgot us after silence, or restarted), ``silence`` (nothing heard for ``heartbeat_timeout``),
``register_due`` (the resend timer).
"""

from __future__ import annotations

from pdkv.protocol.effects import FailureCause, ForgetPeer, Notice, NoticeLevel, PeerKey, Send
from pdkv.protocol.machines._base import MachineSpec, StateMachine, row
from pdkv.protocol.machines._decode_side import (
    AbortStep,
    DecodeAbortInput,
    PrefillRankInput,
    PrefillRankState,
    RankStep,
    ReceiverRoomInput,
    ReceiverRoomState,
    RoomStep,
)
from pdkv.protocol.messages import MAX_REASON_CHARS

_S = PrefillRankState
_I = PrefillRankInput

# ------------------------------------------------------------------------------------------ effects


def mark_heard(s: RankStep) -> None:
    s.rank.last_heard = s.now
    s.side.arm_heartbeats(s.now)


def serve_waiting_rooms(s: RankStep) -> None:
    """Its registration may complete rooms (all their ranks ready: their requests go), and owes Aborts:
    to rooms that failed before it was registered, and again to rooms whose ack from it is missing
    (the same process may still hold the room, and its ack is the only safe release)."""
    key = s.rank.key
    for room in list(s.side.room_records()):
        if key not in room.target_keys:
            continue
        if room.machine.state is ReceiverRoomState.BOOTSTRAPPING:
            if all(_ready(s, t.key) for t in room.targets):
                room.machine.step(ReceiverRoomInput.TARGETS_READY, RoomStep(side=s.side, room=room, now=s.now))
        elif room.abort is not None:
            room.abort.machine.step(
                DecodeAbortInput.RANK_READY,
                AbortStep(side=s.side, room=room, abort=room.abort, now=s.now, sender=key),
            )


def record_refusal(s: RankStep) -> None:
    s.rank.reason = s.reason


def warn_refusal(s: RankStep) -> None:
    s.side.emit(
        Notice(
            level=NoticeLevel.WARNING,
            text=f"prefill rank {s.rank.name} rejected registration: {s.reason}",
        )
    )


def fail_rooms_refused(s: RankStep) -> None:
    _fail_rooms(s, _clip(f"registration rejected by {s.rank.name}: {s.reason}"), FailureCause.INVALID)


def forget_socket(s: RankStep) -> None:
    """Its socket is rebuilt: a queue to a dead or replaced process never drains (before any message
    to it in this batch of effects)."""
    s.side.emit(ForgetPeer(endpoint=s.rank.endpoint, reason=s.reason))


def warn_lost(s: RankStep) -> None:
    s.side.count("peers_lost")
    s.side.emit(Notice(level=NoticeLevel.WARNING, text=f"{s.reason}: failing its rooms and registering again"))


def fail_rooms_lost(s: RankStep) -> None:
    """Silence is not proof that it stopped writing: its rooms fail, and their pages wait for its ack
    (the Abort goes to it at once, on the rebuilt socket, and again when it registers)."""
    _fail_rooms(s, s.reason, FailureCause.PEER_SILENT, tell_now=True)


def send_register(s: RankStep) -> None:
    s.side.emit(Send(to=s.rank.endpoint, message=s.side.register_message))
    s.side.schedule_register(s.rank, s.now)


# ------------------------------------------------------------------------------------------ rows

PREFILL_RANK = MachineSpec(
    name="PrefillRank",
    states=PrefillRankState,
    triggers=PrefillRankInput,
    initial=_S.REGISTERING,
    edges=(
        row(_I.REGISTER_ACK, _S.REGISTERING, _S.READY, then=[mark_heard, serve_waiting_rooms]),
        row(_I.REGISTER_ACK, [_S.READY, _S.REJECTED], None),  # a duplicate, or an answer after a refusal
        row(
            _I.REFUSED,
            [_S.REGISTERING, _S.READY, _S.REJECTED],
            _S.REJECTED,
            then=[record_refusal, warn_refusal, fail_rooms_refused],
        ),
        row(
            _I.NOT_KNOWN,
            _S.READY,
            _S.REGISTERING,
            then=[forget_socket, warn_lost, fail_rooms_lost, send_register],
        ),
        row(_I.NOT_KNOWN, [_S.REGISTERING, _S.REJECTED], None),  # registering already: the next Register answers
        row(_I.SILENCE, _S.READY, _S.REGISTERING, then=[forget_socket, warn_lost, fail_rooms_lost, send_register]),
        row(_I.REGISTER_DUE, _S.REGISTERING, None, then=[send_register]),
    ),
)


class PrefillRankMachine(StateMachine[PrefillRankState, PrefillRankInput]):
    def __init__(self, label: str) -> None:
        super().__init__(PREFILL_RANK, label)


# ------------------------------------------------------------------------------------------ helpers


def _ready(s: RankStep, key: PeerKey) -> bool:
    rank = s.side.rank(key)
    return rank is not None and rank.machine.state is PrefillRankState.READY


def _fail_rooms(s: RankStep, reason: str, cause: FailureCause, *, tell_now: bool = False) -> None:
    for room in list(s.side.room_records()):
        if not room.terminal and s.rank.key in room.target_keys:
            room.machine.step(
                ReceiverRoomInput.FAIL,
                RoomStep(
                    side=s.side,
                    room=room,
                    now=s.now,
                    reason=reason,
                    cause=cause,
                    sender=s.rank.key,
                    tell_now=s.rank.key if tell_now else None,
                ),
            )


def _clip(text: str) -> str:
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


__all__ = ["PREFILL_RANK", "PrefillRankInput", "PrefillRankMachine", "PrefillRankState"]
