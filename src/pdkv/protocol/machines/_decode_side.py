"""What the decode side's machines share: their records, their step contexts and the services of the
endpoint their effects call.

Owns: the states and inputs of the three decode machines (a prefill rank, a receiver room, an
abort), ``PrefillRank`` (the decode's one record of a prefill rank), ``ReceiverRoom`` and its
``AbortRecord``, the step contexts the rows' guards and effects take (``RankStep``, ``RoomStep``,
``AbortStep``), and ``DecodeSide``: the few primitive services of ``pdkv.protocol.decode.DecodeEndpoint``
that effects use (counting, deadlines, emitting effects, finding ranks and rooms). Must not hold a rule:
the rules are the rows of ``prefill_rank``, ``room_receiver`` and ``decode_abort``, which each list
their states and inputs with their meaning. No I/O, no clock. Here, not in those modules, so that a
room's record can name its abort's machine and the three modules import one another in one direction.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import attrs

from pdkv.mapping.layout_policy import LayoutPolicy
from pdkv.protocol.config import Timeouts
from pdkv.protocol.effects import ChecksumMismatch, DecodeEffect, FailureCause, PeerKey, ReleaseKind, Target
from pdkv.protocol.ids import Endpoint, Epoch, RoomId, SessionId
from pdkv.protocol.machines._base import MachineEnum, StateMachine
from pdkv.protocol.messages import (
    IntArray,
    LandingGrant,
    Origin,
    PageChecksums,
    Register,
    RegisterAck,
    StateIndices,
    TransferMetricData,
)
from pdkv.protocol.registration import DraftSkipped


class PrefillRankState(MachineEnum):
    REGISTERING = "registering"
    READY = "ready"
    REJECTED = "rejected"


class PrefillRankInput(MachineEnum):
    REGISTER_ACK = "register_ack"  # RegisterAck: layouts agree (or differ in draft buffers left out)
    REFUSED = "refused"  # RegisterReject: the layouts differ
    NOT_KNOWN = "not_known"  # RegisterReject(retry): the rank forgot us, or restarted
    SILENCE = "silence"  # nothing heard for heartbeat_timeout
    REGISTER_DUE = "register_due"  # the registration resend is due


class ReceiverRoomState(MachineEnum):
    BOOTSTRAPPING = "bootstrapping"
    WAITING_FOR_INPUT = "waiting_for_input"
    TRANSFERRING = "transferring"
    SCATTERING = "scattering"
    VERIFYING = "verifying"
    SUCCESS = "success"
    FAILED = "failed"


class ReceiverRoomInput(MachineEnum):
    TARGETS_READY = "targets_ready"  # every target rank registered: the requests can go
    SUCCESS = "success"  # TransferStatus Success
    FAILED = "failed"  # TransferStatus Failed
    PEER_ABORT = "peer_abort"  # Abort from a prefill rank
    ABORT = "abort"  # the scheduler's receiver.abort
    FAIL = "fail"  # decided here: a deadline, a lost or refusing rank, no destination
    VERIFIED = "verified"  # the runtime's verdict: every page matches the prefill ranks' checksums
    CORRUPT = "corrupt"  # ... or one does not (the mismatch says where)
    LANDING_GRANTED = "landing_granted"  # the runtime leased the room's landing space (or refused: too large)
    SCATTERED = "scattered"  # the runtime copied the landed heads into the pages
    SCATTER_FAILED = "scatter_failed"  # ... or could not


class DecodeAbortState(MachineEnum):
    REQUESTED = "requested"
    QUARANTINED = "quarantined"
    CUTTING = "cutting"
    SETTLING = "settling"
    RELEASED = "released"
    TIMED_OUT = "timed_out"


class DecodeAbortInput(MachineEnum):
    NOTHING_SENT = "nothing_sent"  # no rank was told the destinations
    ABORT_ACK = "abort_ack"
    DEADLINE = "deadline"
    CUT = "cut"  # the connections from those hosts were cut, and their sockets closed
    CUT_FAILED = "cut_failed"
    RESEND_DUE = "resend_due"
    RANK_READY = "rank_ready"  # a rank that owes an ack registered again


RankMachine = StateMachine[PrefillRankState, PrefillRankInput]
RoomMachine = StateMachine[ReceiverRoomState, ReceiverRoomInput]
AbortMachine = StateMachine[DecodeAbortState, DecodeAbortInput]


class DecodeSide(Protocol):
    """The decode endpoint's services that the rows' effects use."""

    origin: Origin
    timeouts: Timeouts
    cuts_connections: bool
    register_message: Register
    layout_policy: LayoutPolicy

    def count(self, name: str, by: int = 1) -> None: ...

    def emit(self, effect: DecodeEffect) -> None: ...

    def rank(self, key: PeerKey) -> PrefillRank | None: ...

    def room_records(self) -> Iterable[ReceiverRoom]: ...

    def set_deadline(self, room: ReceiverRoom, when: float) -> None: ...

    def schedule_register(self, rank: PrefillRank, now: float) -> None: ...

    def schedule_abort_resend(self, room: ReceiverRoom, now: float) -> None: ...

    def arm_heartbeats(self, now: float) -> None: ...

    def hold_quarantined(self, room: ReceiverRoom) -> None: ...

    def drop_quarantined(self, room: ReceiverRoom) -> bool: ...


# ------------------------------------------------------------------------------------------ records


@attrs.define(eq=False)
class PrefillRank:
    """One prefill rank of one incarnation (epoch), as this decode rank knows it. A newer epoch is a
    new record: the old one's is replaced, not moved."""

    key: PeerKey
    epoch: Epoch
    endpoint: Endpoint
    session: SessionId
    machine: RankMachine
    reason: str = ""  # why it refused our registration (or why this rank refused its answer)
    register_due: float = 0.0  # when the registration is resent (while REGISTERING)
    last_heard: float = 0.0  # meaningful while READY
    ack: RegisterAck | None = None
    """Its RegisterAck as accepted (READY): what its transfers to this rank leave out on each side."""

    @property
    def left_out_count(self) -> int:
        """Buffers of both sides its transfers to this rank leave out (0 before an ack)."""
        ack = self.ack
        return 0 if ack is None else len(ack.prefill_left_out) + len(ack.decode_left_out)

    @property
    def name(self) -> str:
        return f"{self.key[0]}:{self.key[1]}"


@attrs.define(eq=False)
class AbortRecord:
    """The abort handshake of one failed room: who must acknowledge, who did, what proves them."""

    machine: AbortMachine
    must_ack: set[PeerKey]
    acked: set[PeerKey] = attrs.Factory(set)
    # Ranks whose ack proves nothing about their connections: one acked after a fence (a write of it
    # to us failed), or restarted after it was told the destinations (the old process's bytes in
    # kernel sockets outlive it, and the new one acks a room it never knew).
    unproven: set[PeerKey] = attrs.Factory(set)
    release: ReleaseKind | None = None  # how the pages came back (a record for statistics and logs)
    tell_later: set[PeerKey] = attrs.Factory(set)  # the room failed before these ranks were registered
    resend_at: float | None = None  # next Abort resend to the ranks that have not acknowledged
    resends: int = 0


@attrs.define(eq=False)
class ReceiverRoom:
    room: RoomId
    machine: RoomMachine
    targets: tuple[Target, ...]
    dst_pages: IntArray
    dst_aux_row: int | None
    dst_state: tuple[StateIndices, ...]
    required_dst_info_num: int
    deadline: float | None
    prefix_pages: int = 0  # positions this rank already holds (its prefix cache): never written
    verify: bool = False  # PDKV_KV_CHECKSUM: Success waits for the pages to match the ranks' checksums
    armed: set[PeerKey] = attrs.Factory(set)  # ranks sent the request (told the destinations)
    succeeded: set[PeerKey] = attrs.Factory(set)
    metric: dict[PeerKey, TransferMetricData] = attrs.Factory(dict)
    reports: dict[PeerKey, PageChecksums | None] = attrs.Factory(dict)  # each Success's checksums (verify)
    mismatch: ChecksumMismatch | None = None  # where the pages differ (FailureCause.CHECKSUM)
    landing: bool = False  # decode TP below prefill TP: its requests wait for a landing lease
    grants: dict[PeerKey, LandingGrant] | None = None  # the lease per target (empty: grant-less)
    failure: str | None = None
    cause: FailureCause | None = None
    failure_peer: PeerKey | None = None
    abort: AbortRecord | None = None
    draft_skipped: DraftSkipped | None = None  # fixed when its requests go (from its ranks' acks)
    # Its prefill ranks (all, and those whose Success it waits for), fixed with its targets. Derived
    # once: every status and every peer event asks, and scanning the targets each time made a room
    # cost O(ranks^2) on the decode (`pdkv bench scale`).
    target_keys: frozenset[PeerKey] = attrs.field(init=False)
    required: frozenset[PeerKey] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.target_keys = frozenset(t.key for t in self.targets)
        self.required = frozenset(t.key for t in self.targets if not t.dummy)

    @property
    def terminal(self) -> bool:
        return self.machine.is_terminal


# ------------------------------------------------------------------------------------------ steps


@attrs.define(eq=False, slots=True)
class RankStep:
    """One input to a prefill rank's record."""

    side: DecodeSide
    rank: PrefillRank
    now: float
    reason: str = ""
    ack: RegisterAck | None = None  # the RegisterAck being answered


@attrs.define(eq=False, slots=True)
class RoomStep:
    """One input to a receiver room: a status, an abort, a failure decided elsewhere."""

    side: DecodeSide
    room: ReceiverRoom
    now: float
    sender: PeerKey | None = None  # the prefill rank the input came from
    reason: str = ""
    cause: FailureCause | None = None
    metric: TransferMetricData | None = None  # a Success status's
    tell_now: PeerKey | None = None  # a silent rank being registered with again: told at once
    checksums: PageChecksums | None = None  # a Success status's
    mismatch: ChecksumMismatch | None = None  # the runtime's verdict (``corrupt``)
    grants: dict[PeerKey, LandingGrant] | None = None  # ``landing_granted``'s lease


@attrs.define(eq=False, slots=True)
class AbortStep:
    """One input to a failed room's abort handshake."""

    side: DecodeSide
    room: ReceiverRoom
    abort: AbortRecord
    now: float
    sender: PeerKey | None = None  # the rank that acknowledged, or registered again
    fenced: bool = False  # the ack follows a fence
    reason: str = ""  # why a cut failed


def peer_text(key: PeerKey) -> str:
    return f"{key[0]}:{key[1]}"


def peer_order(key: PeerKey) -> tuple[str, int, int]:
    return (key[0], key[1].tp, key[1].cp)


__all__ = [
    "AbortMachine",
    "AbortRecord",
    "AbortStep",
    "DecodeAbortInput",
    "DecodeAbortState",
    "DecodeSide",
    "PrefillRank",
    "PrefillRankInput",
    "PrefillRankState",
    "RankMachine",
    "RankStep",
    "ReceiverRoom",
    "ReceiverRoomInput",
    "ReceiverRoomState",
    "RoomMachine",
    "RoomStep",
    "peer_order",
    "peer_text",
]
