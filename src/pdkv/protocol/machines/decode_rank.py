"""A decode rank, as one prefill rank knows it (DESIGN sections 5 and 7): registration, liveness, restarts.

Every rule that moves the prefill's record of a decode rank is a row below; ``PrefillEndpoint`` finds
the rank (one record per decode rank, across its incarnations) and steps it.

    NEW        first heard of (a Register on its way)
    READY      registered (``peer``): its requests are served, it gets heartbeats
    DRAINING   registered again while writes to its previous incarnation (forgotten) are in flight:
               its RegisterAck waits for them (a restarted process may reuse that memory)
    FORGOTTEN  silent for ``heartbeat_timeout``, or restarted: its live rooms failed, its messages are
               dropped until it registers again; writes to it may still drain (``draining``)
    REJECTED   its layout differs from ours (it was told how); only a new registration leaves it

Inputs: ``register`` (a Register), ``silence``, ``restart`` (a message of a newer epoch), ``drained``
(the last write to a forgotten incarnation ended), ``heartbeat``.
"""

from __future__ import annotations

from pdkv.protocol.effects import DecodePeer, FailureCause, ForgetPeer, Notice, NoticeLevel, Send
from pdkv.protocol.machines._base import MachineSpec, StateMachine, row
from pdkv.protocol.machines._prefill_side import (
    DecodeRankInput,
    DecodeRankState,
    RankStep,
    RoomStep,
    SenderRoomInput,
)
from pdkv.protocol.messages import MAX_REASON_CHARS, HeartbeatAck, RegisterAck, RegisterReject
from pdkv.protocol.registration import answer_register

_S = DecodeRankState
_I = DecodeRankInput
_REGISTERED = (_S.READY, _S.DRAINING)
_OFF = (_S.NEW, _S.FORGOTTEN, _S.REJECTED)

# ------------------------------------------------------------------------------------------ guards


def older_epoch(s: RankStep) -> bool:
    """A Register of an incarnation older than the one registered: a stale message."""
    assert s.register is not None
    return s.rank.peer is not None and s.register.origin.epoch < s.rank.peer.epoch


def registration_refused(s: RankStep) -> bool:
    """Its layout differs from ours beyond what the layout policy lets a pair leave out (kind, model,
    layer ids, bytes per item, heads; under ``degrade_draft`` the draft buffers only one side has are
    left out): its writes could not land where they belong. The answer is kept for the effects."""
    assert s.register is not None
    s.answer = answer_register(s.side.origin, s.side.layout, s.register, s.side.layout_policy)
    return not s.answer.accepted


def writes_draining(s: RankStep) -> bool:
    """Writes to a forgotten incarnation of it are still in flight."""
    return bool(s.rank.draining)


def current_epoch(s: RankStep) -> bool:
    assert s.origin is not None
    return s.rank.peer is not None and s.origin.epoch == s.rank.peer.epoch


def may_register_again(s: RankStep) -> bool:
    """A heartbeat from a rank not registered here (forgotten after silence, or this process
    restarted) that says where to answer and is not from an older incarnation than the newest one
    that registered: it is told to register again, rather than wait for its heartbeat timeout."""
    assert s.origin is not None
    newest = s.rank.newest_epoch
    return s.heartbeat_endpoint is not None and (newest is None or s.origin.epoch >= newest)


# ------------------------------------------------------------------------------------------ effects


def count_stale(s: RankStep) -> None:
    s.side.count("stale_messages")
    origin = s.register.origin if s.register is not None else s.origin
    s.side.emit(Notice(level=NoticeLevel.INFO, text=f"dropped a message from stale or unknown {origin}"))


def refuse_registration(s: RankStep) -> None:
    """Tell it the difference; if it was registered before with another layout, its live rooms were
    validated against buffers that no longer match, so none of them may write: they fail."""
    assert s.register is not None and s.answer is not None and isinstance(s.answer.reply, RegisterReject)
    s.side.count("registrations_rejected")
    reason = s.answer.reply.reason
    if s.rank.peer is not None:
        _fail_rooms(
            s, f"decode rank {s.register.origin} re-registered with a rejected layout", FailureCause.INVALID
        )
        s.rank.peer = None
        s.side.heartbeats_done_if_alone()
    s.side.emit(Send(to=s.register.endpoint, message=s.answer.reply))
    s.side.emit(
        Notice(level=NoticeLevel.WARNING, text=f"rejected registration of {s.register.origin}: {reason}")
    )


def register_peer(s: RankStep) -> None:
    """The rank is registered with what its registration is answered (``ack``: the buffers the pair's
    transfers leave out); a pair that leaves draft buffers out is logged once, when it registers anew
    or its answer changed, not on a repeated Register."""
    msg, answer = s.register, s.answer
    assert msg is not None and answer is not None and isinstance(answer.reply, RegisterAck)
    if answer.warning is not None and (s.rank.peer is None or s.rank.ack != answer.reply):
        s.side.emit(answer.warning)
    s.rank.ack = answer.reply
    s.side.arm_heartbeats(s.now)
    s.rank.peer = DecodePeer(
        instance=msg.origin.instance,
        epoch=msg.origin.epoch,
        rank=msg.origin.rank,
        tp_size=msg.tp_size,
        endpoint=msg.endpoint,
        session=msg.session,
        layout=msg.layout,
    )
    newest = s.rank.newest_epoch
    s.rank.newest_epoch = msg.origin.epoch if newest is None else max(newest, msg.origin.epoch)


def acknowledge(s: RankStep) -> None:
    """The RegisterAck it was answered (a held one too: it names what the pair leaves out)."""
    assert s.rank.peer is not None and s.rank.ack is not None
    s.side.emit(Send(to=s.rank.peer.endpoint, message=s.rank.ack))


def hold_acknowledgement(s: RankStep) -> None:
    assert s.register is not None
    s.side.emit(
        Notice(
            level=NoticeLevel.INFO,
            text=f"registration of {s.register.origin} acknowledged once writes of rooms "
            f"{sorted(s.rank.draining)} to its previous incarnation end",
        )
    )


def forget_socket(s: RankStep) -> None:
    """Its socket is rebuilt (before any message to it in this batch): a queue to a dead or replaced
    process never drains."""
    assert s.rank.peer is not None
    s.side.emit(ForgetPeer(endpoint=s.rank.peer.endpoint, reason=s.reason))


def warn_silent(s: RankStep) -> None:
    s.side.count("peers_lost")
    s.side.emit(
        Notice(
            level=NoticeLevel.WARNING,
            text=f"{s.reason}: failing its rooms and forgetting it until it registers again",
        )
    )


def fail_rooms_silent(s: RankStep) -> None:
    """Its rooms are told Failed (best effort, on the rebuilt socket) while it is still known, so a
    rank that is alive but was unheard can abort; AbortAcks still go to it if it registers again."""
    _fail_rooms(s, s.reason, FailureCause.PEER_SILENT)


def warn_restarted(s: RankStep) -> None:
    s.side.count("peer_restarts")
    s.side.emit(Notice(level=NoticeLevel.WARNING, text=s.reason))


def fail_rooms_restarted(s: RankStep) -> None:
    """Its old incarnation's rooms can never complete, and its pages are gone: nothing is told or
    acknowledged to it (its requests are dropped)."""
    for room in list(s.side.room_records()):
        if s.rank.key in room.requests:
            if not room.terminal:
                step = RoomStep(
                    s.side, room, s.now, s.rank.key, reason=s.reason, cause=FailureCause.PEER_RESTART
                )
                step.notify = False
                room.machine.step(SenderRoomInput.FAIL, step)
            room.requests.pop(s.rank.key)


def note_draining(s: RankStep) -> None:
    """Remember the rooms with writes in flight to it as it is forgotten: a new registration is
    acknowledged only once they ended."""
    s.rank.draining.update(
        r.room for r in s.side.room_records() if s.side.writes_in_flight(r) and s.rank.key in r.requests
    )
    if s.rank.draining:
        s.side.watch_drain(s.rank.key)


def forget_peer(s: RankStep) -> None:
    s.rank.peer = None
    s.side.heartbeats_done_if_alone()


def ack_heartbeat(s: RankStep) -> None:
    assert s.rank.peer is not None
    s.side.emit(
        Send(to=s.rank.peer.endpoint, message=HeartbeatAck(origin=s.side.origin, seq=s.heartbeat_seq))
    )


def tell_to_register(s: RankStep) -> None:
    assert s.origin is not None and s.heartbeat_endpoint is not None
    s.side.count("told_to_register")
    reason = (
        f"decode rank {s.origin} is not registered at prefill {s.side.origin} "
        "(forgotten after silence, or this rank restarted): register again"
    )
    reject = RegisterReject(origin=s.side.origin, reason=_clip(reason), retry=True)
    s.side.emit(Send(to=s.heartbeat_endpoint, message=reject))  # type: ignore[arg-type]  # an Endpoint


# ------------------------------------------------------------------------------------------ rows

DECODE_RANK = MachineSpec(
    name="DecodeRank",
    states=DecodeRankState,
    triggers=DecodeRankInput,
    initial=_S.NEW,
    edges=(
        row(_I.REGISTER, tuple(DecodeRankState), None, when=older_epoch, then=[count_stale]),
        row(
            _I.REGISTER,
            tuple(DecodeRankState),
            _S.REJECTED,
            when=registration_refused,
            then=[refuse_registration],
        ),
        row(_I.REGISTER, _S.DRAINING, None, then=[register_peer]),  # the ack stays held
        row(
            _I.REGISTER,
            (*_OFF, _S.READY),
            _S.DRAINING,
            when=writes_draining,
            then=[register_peer, hold_acknowledgement],
        ),
        row(_I.REGISTER, (*_OFF, _S.READY), _S.READY, then=[register_peer, acknowledge]),  # again: re-acked
        row(
            _I.SILENCE,
            _REGISTERED,
            _S.FORGOTTEN,
            then=[forget_socket, warn_silent, fail_rooms_silent, note_draining, forget_peer],
        ),
        row(
            _I.RESTART,
            _REGISTERED,
            _S.FORGOTTEN,
            then=[note_draining, forget_socket, warn_restarted, fail_rooms_restarted, forget_peer],
        ),
        row(_I.DRAINED, _S.DRAINING, _S.READY, then=[acknowledge]),
        row(_I.DRAINED, (*_OFF, _S.READY), None),  # forgotten and drained: nothing owed
        row(_I.HEARTBEAT, _REGISTERED, None, when=current_epoch, then=[ack_heartbeat]),
        row(_I.HEARTBEAT, _OFF, None, when=may_register_again, then=[tell_to_register]),
        row(_I.HEARTBEAT, tuple(DecodeRankState), None, then=[count_stale]),  # an older incarnation's
    ),
)


class DecodeRankMachine(StateMachine[DecodeRankState, DecodeRankInput]):
    def __init__(self, label: str) -> None:
        super().__init__(DECODE_RANK, label)


# ------------------------------------------------------------------------------------------ helpers


def _fail_rooms(s: RankStep, reason: str, cause: FailureCause) -> None:
    for room in list(s.side.room_records()):
        if s.rank.key in room.requests and not room.terminal:
            room.machine.step(
                SenderRoomInput.FAIL, RoomStep(s.side, room, s.now, s.rank.key, reason=reason, cause=cause)
            )


def _clip(text: str) -> str:
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


__all__ = ["DECODE_RANK", "DecodeRankInput", "DecodeRankMachine", "DecodeRankState"]
