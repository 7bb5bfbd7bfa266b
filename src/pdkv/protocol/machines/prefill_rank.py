"""A prefill rank, as one decode rank knows it (DESIGN sections 5 and 7): its registration and liveness.

Every rule that moves the decode's record of a prefill rank is a row below; ``DecodeEndpoint`` finds
the rank and steps it. One record per rank and epoch: a newer epoch is a new record (the endpoint
replaces it and fails the old one's rooms), never a move of this machine.

    REGISTERING  Register sent, no answer yet (resent every ``register_retry``); our messages to it wait
    READY        registered: its messages are accepted, it gets heartbeats, rooms may ask it
    REJECTED     it refused our layout, or this rank refused its answer (the reason is kept); only a
                 new route table registers again

Inputs: ``register_ack``, ``refused`` (RegisterReject), ``not_known`` (RegisterReject with retry: it
forgot us after silence, or restarted), ``silence`` (nothing heard for ``heartbeat_timeout``),
``register_due`` (the resend timer).

A RegisterAck may name buffers its transfers leave out (draft-model buffers only one side registers,
as the prefill's layout policy allowed): under this rank's ``strict`` policy that answer is refused
here, like a RegisterReject; otherwise the record keeps the ack (rooms learn from it what they will
not receive) and a WARNING says so once for the pair (again only if what is left out changes).
"""

from __future__ import annotations

from pdkv.mapping.layout_policy import LayoutPolicy, describe_keys
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

# ------------------------------------------------------------------------------------------ guards


def left_out_refused_here(s: RankStep) -> bool:
    """The ack leaves buffers out, and this rank's layout policy is strict."""
    return s.ack is not None and s.ack.leaves_out and s.side.layout_policy is LayoutPolicy.STRICT


# ------------------------------------------------------------------------------------------ effects


def warn_left_out(s: RankStep) -> None:
    """Once per pair: the first ack that leaves buffers out (or one that leaves out other buffers than
    the record's last, e.g. after a registration again); counted as a degraded registration."""
    ack, known = s.ack, s.rank.ack
    if ack is None or not ack.leaves_out:
        return
    if known is not None and (known.prefill_left_out, known.decode_left_out) == (
        ack.prefill_left_out,
        ack.decode_left_out,
    ):
        return
    s.side.count("registrations_degraded")
    parts = []
    if ack.prefill_left_out:
        parts.append(f"it sends none of its {describe_keys(ack.prefill_left_out)} (not registered here)")
    if ack.decode_left_out:
        parts.append(
            f"it writes none of this rank's {describe_keys(ack.decode_left_out)} (not registered there)"
        )
    s.side.emit(
        Notice(
            level=NoticeLevel.WARNING,
            text=_clip(
                f"prefill rank {s.rank.name} serves this rank without draft-model buffers (a rolling "
                f"deployment?): {'; '.join(parts)}; rooms from it report draft_skipped()"
            ),
        )
    )


def keep_ack(s: RankStep) -> None:
    s.rank.ack = s.ack


def record_policy_refusal(s: RankStep) -> None:
    """This rank's strict policy refuses the degraded pair: the reason names what each side would leave
    out (the refusal is then handled as the rank's own would be)."""
    assert s.ack is not None
    s.reason = _clip(
        f"this decode's layout policy is strict and prefill rank {s.rank.name} would leave out draft "
        f"buffers: its own {describe_keys(s.ack.prefill_left_out)} (not registered here) and this "
        f"rank's {describe_keys(s.ack.decode_left_out)} (not registered there)"
    )
    s.rank.reason = s.reason


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
                room.machine.step(
                    ReceiverRoomInput.TARGETS_READY, RoomStep(side=s.side, room=room, now=s.now)
                )
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
    s.side.emit(
        Notice(level=NoticeLevel.WARNING, text=f"{s.reason}: failing its rooms and registering again")
    )


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
        row(
            _I.REGISTER_ACK,
            _S.REGISTERING,
            _S.REJECTED,
            when=left_out_refused_here,
            then=[record_policy_refusal, warn_refusal, fail_rooms_refused],
        ),
        row(
            _I.REGISTER_ACK,
            _S.REGISTERING,
            _S.READY,
            then=[warn_left_out, keep_ack, mark_heard, serve_waiting_rooms],
        ),
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
        row(
            _I.NOT_KNOWN, [_S.REGISTERING, _S.REJECTED], None
        ),  # registering already: the next Register answers
        row(
            _I.SILENCE,
            _S.READY,
            _S.REGISTERING,
            then=[forget_socket, warn_lost, fail_rooms_lost, send_register],
        ),
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
