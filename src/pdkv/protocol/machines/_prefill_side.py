"""What the prefill side's machines share: their states and inputs, records, step contexts, and the
services of the endpoint their effects call.

Owns: the states and inputs of the prefill's machines (a decode rank as this prefill rank knows it, a
sender room, a fence), ``DecodeRank`` (the prefill's one record of a decode rank), ``SenderRoom``
and its ``Chunk`` records, ``Fence``, the step contexts the rows' guards and effects take, and
``PrefillSide``: the few primitive services of ``pdkv.protocol.prefill.PrefillEndpoint`` that effects
use (counting, deadlines, tombstones, emitting effects, finding ranks and rooms). Must not hold a
rule: the rules are the rows of ``decode_rank``, ``room_sender`` (with the chunk, abort and fence
machines it drives). No I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

import attrs
import numpy as np

from pdkv.mapping import LayoutPolicy, OwnershipPolicy
from pdkv.mapping.layout import BufferLayout
from pdkv.protocol.config import Timeouts
from pdkv.protocol.effects import (
    ChunkSpec,
    DecodePeer,
    FailureCause,
    FenceWrite,
    PeerKey,
    PrefillEffect,
)
from pdkv.protocol.ids import Epoch, RoomId
from pdkv.protocol.machines._base import MachineEnum, StateMachine
from pdkv.protocol.messages import Origin, Register, RegisterAck, TransferMetricData, TransferRequest
from pdkv.protocol.registration import RegisterAnswer


class DecodeRankState(MachineEnum):
    NEW = "new"
    READY = "ready"
    DRAINING = "draining"
    FORGOTTEN = "forgotten"
    REJECTED = "rejected"


class DecodeRankInput(MachineEnum):
    REGISTER = "register"
    SILENCE = "silence"  # nothing heard for heartbeat_timeout
    RESTART = "restart"  # a message of a newer epoch: the incarnation we knew is gone
    DRAINED = "drained"  # the last write to its old incarnation ended
    HEARTBEAT = "heartbeat"


class SenderRoomState(MachineEnum):
    BOOTSTRAPPING = "bootstrapping"
    WAITING_FOR_INPUT = "waiting_for_input"
    TRANSFERRING = "transferring"
    COMPLETING = "completing"
    SUCCESS = "success"
    FAILED = "failed"


class SenderRoomInput(MachineEnum):
    REQUEST = "request"  # a TransferRequest from a registered decode rank
    OPEN = "open"  # the scheduler's sender.init (its arguments checked already)
    QUEUE_CHUNK = "queue_chunk"  # the scheduler's sender.send (the chunk checked already)
    CHUNK_DONE = "chunk_done"  # every write of a chunk completed
    CHUNK_FAILED = "chunk_failed"  # a write of a chunk failed (every write of it ended)
    LAYER_WRITES_STARTED = "layer_writes_started"  # a per-layer context asks to write
    LAYER_WRITES_ENDED = "layer_writes_ended"  # every write of a per-layer context ended
    FENCE_DONE = "fence_done"  # a fence write completed (one Success waited for)
    PEER_ABORT = "peer_abort"  # an Abort from a decode rank
    ABORT = "abort"  # the scheduler's sender.abort
    FAIL = "fail"  # decided by the endpoint: a deadline, a lost or restarted rank
    STATUS_RESEND_DUE = "status_resend_due"


class ChunkState(MachineEnum):
    REGISTERED = "registered"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    SKIPPED = "skipped"


class ChunkInput(MachineEnum):
    START = "start"
    COMPLETE = "complete"
    FAIL = "fail"
    SKIP = "skip"


class PrefillAbortState(MachineEnum):
    DRAINING = "draining"  # writes of the room already submitted may still land
    ACKED = "acked"  # nothing of the room is in flight: every asking rank was answered


class PrefillAbortInput(MachineEnum):
    ASKED = "asked"  # an Abort (or its resend) from a registered decode rank
    WRITES_ENDED = "writes_ended"  # a write of the room ended (maybe the last in flight)
    FENCED = "fenced"  # a fence of the room to a rank that asked completed


class FailureNoticeState(MachineEnum):
    TELLING = "telling"  # told Failed: resent (backoff) to the ranks whose Abort has not answered it
    ANSWERED = "answered"  # every decode rank told has answered with an Abort: nothing more is resent


class FailureNoticeInput(MachineEnum):
    HEARD = "heard"  # an Abort from a decode rank of the room: it knows of the failure
    RESEND_DUE = "resend_due"  # the resend interval (doubling) passed


class FenceState(MachineEnum):
    OWED = "owed"  # not written yet (or written and failed: retried at ``retry_at`` or the next Abort)
    RUNNING = "running"  # the fence write is on its way
    DONE = "done"  # completed: the engine queue to that rank drained; acks to it say ``fenced``


class FenceInput(MachineEnum):
    SUBMIT = "submit"  # Success waits for it, or its retry is due
    ACK_WANTED = "ack_wanted"  # the room's AbortAck to that rank is due
    COMPLETED = "completed"
    FAILED = "failed"


RankMachine = StateMachine[DecodeRankState, DecodeRankInput]
NoticeMachine = StateMachine[FailureNoticeState, FailureNoticeInput]
RoomMachine = StateMachine[SenderRoomState, SenderRoomInput]
ChunkRecordMachine = StateMachine[ChunkState, ChunkInput]
AbortMachine = StateMachine[PrefillAbortState, PrefillAbortInput]
FenceRecordMachine = StateMachine[FenceState, FenceInput]


class PrefillSide(Protocol):
    """The prefill endpoint's services that the rows' effects use: primitives, no rules."""

    origin: Origin
    layout: BufferLayout
    policy: OwnershipPolicy | None
    layout_policy: LayoutPolicy
    timeouts: Timeouts

    def count(self, name: str, by: int = 1) -> None: ...

    def emit(self, effect: PrefillEffect) -> None: ...

    def registered(self, key: PeerKey) -> DecodePeer | None:
        """The decode rank registered now under ``key`` (None: not registered)."""
        ...

    def room_records(self) -> Iterable[SenderRoom]: ...

    def set_deadline(self, room: SenderRoom, when: float) -> None: ...

    def refusal(self, room: RoomId) -> tuple[str, FailureCause] | None:
        """Why ``room``'s id is refused now (its tombstone), if it is."""
        ...

    def note_unopened_failed(self, room: RoomId) -> None: ...

    def schedule_status_resend(self, room: SenderRoom, now: float) -> None: ...

    def fences_of(self, room: RoomId) -> list[tuple[PeerKey, Fence]]: ...

    def schedule_fence_retry(self, room: RoomId, key: PeerKey, when: float) -> None: ...

    def answer_abort(self, room: RoomId, key: PeerKey) -> None:
        """The AbortAck of ``room`` to ``key``, or first the fence it waits for."""
        ...

    def writes_ended(self, room: RoomId, now: float) -> None:
        """The last write of ``room`` in flight ended: ranks draining it may be acknowledged."""
        ...

    def watch_drain(self, key: PeerKey) -> None:
        """``key``'s record holds rooms whose writes to a forgotten incarnation drain."""
        ...

    def forget_if_idle(self, room: SenderRoom) -> None: ...

    def layer_writes(self, room: RoomId) -> list[int]:
        """The room's per-layer contexts (by start token) whose writes may still land: those that
        started writing and have not ended (the endpoint's ``LayerBook`` holds them)."""
        ...

    def writes_in_flight(self, room: SenderRoom) -> int:
        """Chunks and per-layer contexts of ``room`` whose writes may still land."""
        ...

    def stop_layers(self, room: RoomId, reason: str) -> None:
        """Every per-layer context of ``room`` still submitting stops; those not ended yet are
        drained by the runtime (``DropLayers``)."""
        ...

    def arm_heartbeats(self, now: float) -> None: ...

    def heartbeats_done_if_alone(self) -> None: ...


# ------------------------------------------------------------------------------------------ records


@attrs.define(eq=False)
class DecodeRank:
    """One decode rank as this prefill rank knows it, across its incarnations: the registered one
    (``peer``, READY or DRAINING), when it was last heard, the newest epoch it registered with, and
    the rooms whose writes to a forgotten incarnation are still in flight."""

    key: PeerKey
    machine: RankMachine
    peer: DecodePeer | None = None
    last_heard: float = 0.0
    newest_epoch: Epoch | None = None
    draining: set[RoomId] = attrs.Factory(set)
    ack: RegisterAck | None = None  # what its registration was answered: the buffers the pair leaves out

    @property
    def name(self) -> str:
        return f"{self.key[0]}:{self.key[1]}"


@attrs.define(eq=False)
class Chunk:
    index: int
    spec: ChunkSpec
    machine: ChunkRecordMachine


@attrs.define(eq=False)
class Fence:
    """A fence owed to a decode rank before the room's AbortAck (or Success) to it; kept, DONE, while
    the room's id is a tombstone, so every later AbortAck for the room says it was fenced."""

    write: FenceWrite
    machine: FenceRecordMachine
    retry_at: float | None = None  # a failed fence is written again then, without waiting for an Abort


@attrs.define(eq=False)
class FailureNotice:
    """A failed room's Failed status to its decode ranks, until each answers with an Abort (a status
    may be lost): its machine (``room_sender.FAILURE_NOTICE``), the ranks told that have not
    answered, and when it goes again (``resend_at``, the ``resends``-th backoff)."""

    machine: NoticeMachine
    unanswered: set[PeerKey]
    resends: int = 0
    resend_at: float | None = None


@attrs.define(eq=False)
class SenderRoom:
    room: RoomId
    machine: RoomMachine
    deadline: float | None
    opened: bool = False  # the scheduler called sender.init (a room may be requested before)
    num_pages: int | None = None
    aux_row: int | None = None
    requests: dict[PeerKey, TransferRequest] = attrs.Factory(dict)
    chunks: list[Chunk] = attrs.Factory(list)
    last_queued: bool = False
    next_position: int | None = None  # where the next chunk must start (None before the first)
    src_pages: list[np.ndarray] = attrs.Factory(list)  # every queued chunk's pages, for duplicates
    failure: str | None = None
    cause: FailureCause | None = None
    failure_peer: PeerKey | None = None
    pages: int = 0
    bytes: int = 0
    seconds: float = 0.0
    abort: AbortMachine | None = None  # the abort handshake, from the first Abort of a decode rank
    ack_to: set[PeerKey] = attrs.Factory(set)  # decode ranks whose Abort asks for an AbortAck
    closed: bool = False  # the scheduler cleared it: forgotten once nothing of it can land
    peer_metric: dict[PeerKey, TransferMetricData] = attrs.Factory(dict)  # what each decode rank got
    notice: FailureNotice | None = None  # the Failed status told to its decode ranks, until answered

    @property
    def terminal(self) -> bool:
        return self.machine.is_terminal

    @property
    def chunks_in_flight(self) -> int:
        """Chunks whose writes may still land (the endpoint adds the per-layer contexts that write:
        ``PrefillSide.writes_in_flight``)."""
        return sum(1 for c in self.chunks if c.machine.state is ChunkState.TRANSFERRING)

    @property
    def real_requests(self) -> list[TransferRequest]:
        return [r for r in self.requests.values() if not r.dummy]


# ------------------------------------------------------------------------------------------ steps


@attrs.define(eq=False, slots=True)
class RankStep:
    """One input to a decode rank's record."""

    side: PrefillSide
    rank: DecodeRank
    now: float
    register: Register | None = None  # a REGISTER input's message
    origin: Origin | None = None  # the sender of a HEARTBEAT, or the new incarnation of a RESTART
    heartbeat_seq: int = 0
    heartbeat_endpoint: str | None = None
    reason: str = ""
    answer: RegisterAnswer | None = None  # a REGISTER's answer under the layout policy (set by its guard)


@attrs.define(eq=False, slots=True)
class RoomStep:
    """One input to a sender room."""

    side: PrefillSide
    room: SenderRoom
    now: float
    sender: PeerKey | None = None  # the decode rank the input came from or concerns
    request: TransferRequest | None = None
    reason: str = ""
    cause: FailureCause | None = None
    notify: bool = True  # a failure is told to the room's decode ranks (not when one of them caused it)
    spec: ChunkSpec | None = None  # QUEUE_CHUNK's chunk
    start: int = 0  # its first position
    num_pages: int | None = None  # OPEN: the scheduler's request size
    aux_row: int | None = None  # OPEN: its aux row on this side
    chunk: int = -1  # CHUNK_DONE / CHUNK_FAILED: which
    metric: TransferMetricData | None = None
    per_peer: Mapping[PeerKey, TransferMetricData] | None = None
    start_token: int = -1  # LAYER_WRITES_STARTED / LAYER_WRITES_ENDED: which context
    consented: bool = False  # LAYER_WRITES_STARTED: the row let the context write
    problem: str | None = None  # what a guard found (why a request is invalid), for the effects


@attrs.define(eq=False, slots=True)
class ChunkStep:
    """One input to a chunk of a room."""

    side: PrefillSide
    room: SenderRoom
    chunk: Chunk
    now: float


@attrs.define(eq=False, slots=True)
class AbortStep:
    """One input to a room's abort handshake."""

    side: PrefillSide
    room: SenderRoom
    now: float
    sender: PeerKey | None = None  # the decode rank that asked, or whose fence completed


@attrs.define(eq=False, slots=True)
class FenceStep:
    side: PrefillSide
    fence: Fence
    room: RoomId
    peer: PeerKey
    now: float
    reason: str = ""


def peer_text(key: PeerKey) -> str:
    return f"{key[0]}:{key[1]}"


def peer_order(key: PeerKey) -> tuple[str, int, int]:
    return (key[0], key[1].tp, key[1].cp)


__all__ = [
    "AbortMachine",
    "AbortStep",
    "Chunk",
    "ChunkInput",
    "ChunkRecordMachine",
    "ChunkState",
    "ChunkStep",
    "DecodeRank",
    "DecodeRankInput",
    "DecodeRankState",
    "FailureNotice",
    "FailureNoticeInput",
    "FailureNoticeState",
    "Fence",
    "FenceInput",
    "FenceRecordMachine",
    "FenceState",
    "FenceStep",
    "NoticeMachine",
    "PrefillAbortInput",
    "PrefillAbortState",
    "PrefillSide",
    "RankMachine",
    "RankStep",
    "RoomMachine",
    "RoomStep",
    "SenderRoom",
    "SenderRoomInput",
    "SenderRoomState",
    "peer_order",
    "peer_text",
]
