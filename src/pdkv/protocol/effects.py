"""Inputs and effects of the sans-IO endpoints: what the scheduler hands in, what the runtime carries out.

Owns: the frozen records exchanged between ``pdkv.protocol`` endpoints and their driver (the
runtime, or ``pdkv.testing.EndpointPair``). Must not do I/O. Effects are data: the endpoint never
sends, submits, logs or releases anything itself; the driver does, and feeds results back in.
"""

from __future__ import annotations

import enum
from typing import TypeAlias

import attrs
import numpy as np

from pdkv.mapping.layout import BufferLayout
from pdkv.mapping.layout_policy import BufferKey
from pdkv.protocol.ids import Endpoint, Epoch, InstanceId, RoomId, SessionId
from pdkv.protocol.messages import (
    IntArray,
    LandingGrant,
    Message,
    PageChecksums,
    RankCoord,
    StateIndices,
    TransferRequest,
    index_array,
    state_tuple,
)
from pdkv.protocol.poll import KVPoll

PeerKey: TypeAlias = tuple[InstanceId, RankCoord]
"""A peer rank: its instance and its coordinates (the epoch is tracked separately)."""


# ---------------------------------------------------------------- inputs


@attrs.frozen(kw_only=True)
class ChunkSpec:
    """One chunk as the scheduler hands it to ``send()``.

    ``pages`` are the chunk's logical page ids as every CP rank sees them; ``start_token`` is the
    chunk's token offset in the request (page-aligned), from which the absolute page positions
    follow. ``state`` (source state slots) rides only on the last chunk.
    """

    pages: IntArray = attrs.field(converter=index_array, eq=attrs.cmp_using(eq=np.array_equal))
    start_token: int = attrs.field(validator=attrs.validators.ge(0))
    last: bool = attrs.field(validator=attrs.validators.instance_of(bool))
    state: tuple[StateIndices, ...] = attrs.field(default=(), converter=state_tuple)

    def __attrs_post_init__(self) -> None:
        if self.state and not self.last:
            raise ValueError("state indices ride only on the last chunk")


@attrs.frozen(kw_only=True)
class Target:
    """One prefill rank a decode room receives from; a dummy target only needs its room to advance."""

    instance: InstanceId
    rank: RankCoord
    dummy: bool = False

    @property
    def key(self) -> PeerKey:
        return (self.instance, self.rank)


@attrs.frozen(kw_only=True)
class DecodePeer:
    """What a prefill rank knows of a registered decode rank."""

    instance: InstanceId
    epoch: Epoch
    rank: RankCoord
    tp_size: int
    endpoint: Endpoint
    session: SessionId
    layout: BufferLayout

    @property
    def key(self) -> PeerKey:
        return (self.instance, self.rank)


@attrs.frozen(kw_only=True)
class Destination:
    """Where one chunk's bytes go: a registered decode rank and its request for the room."""

    peer: DecodePeer
    request: TransferRequest


# ---------------------------------------------------------------- effects


@attrs.frozen(kw_only=True)
class Send:
    """Send ``message`` to the control endpoint ``to``."""

    to: Endpoint
    message: Message


@attrs.frozen(kw_only=True)
class SubmitChunk:
    """Prefill: map and write chunk ``chunk`` of ``room`` to every destination.

    The driver calls ``start_chunk`` before the first write (it may answer False: skip), then
    exactly one of ``chunk_done`` / ``chunk_failed`` after every submitted write completed.
    """

    room: RoomId
    chunk: int
    spec: ChunkSpec
    num_pages: int
    src_aux_row: int | None
    destinations: tuple[Destination, ...]


class FailureCause(enum.Enum):
    """Why a room failed, for metrics and operators (the reason text says the details)."""

    ABORTED_HERE = "aborted_here"  # this side's scheduler aborted the room
    ABORTED_BY_PEER = "aborted_by_peer"  # the other side aborted or reported failure
    TIMEOUT = "timeout"  # a deadline passed
    ENGINE = "engine"  # the transfer engine failed a write (or mapping refused the chunk)
    INVALID = "invalid"  # a request or registration broke the protocol's rules
    PEER_RESTART = "peer_restart"  # the peer came back with a new epoch
    PEER_SILENT = "peer_silent"  # the peer sent nothing for heartbeat_timeout seconds
    NO_DESTINATION = "no_destination"  # nothing to send to
    CHECKSUM = "checksum"  # the decode's pages differ from what the prefill sent (PDKV_KV_CHECKSUM)


@attrs.frozen(kw_only=True)
class ChecksumMismatch:
    """Where a room's received bytes differ from what a prefill rank sent (``FailureCause.CHECKSUM``).

    ``prefill``: the rank whose checksums disagree (``instance:tpN/cpM``; None: a position no rank
    covered). ``buffer`` (``target kv layer 3``) and ``layer``: the first buffer that differs (None
    when the checksums themselves do not fit this rank, or a position was never covered).
    ``position``: the page's position in the request (a state slot's index in the room's list; None
    for the aux row), ``dst_index`` the decode page, slot or row there. ``entries``: how many
    (buffer, item) checksums differ in all. ``detail``: the sentence the reason and the log say."""

    prefill: str | None
    buffer: str | None
    layer: int | None
    position: int | None
    dst_index: int | None
    entries: int
    detail: str


@attrs.frozen(kw_only=True)
class Failure:
    """Why a room failed, as a scheduler reads it (``sender.failure()``, ``receiver.failure()``).

    ``peer`` names the other side's rank the failure came from or concerns (``instance:tpN/cpM``:
    the rank that aborted, reported a failure, went silent or restarted), None when the failure is
    this side's own (its scheduler aborted, a deadline passed). ``str(failure)`` is the reason."""

    cause: FailureCause
    reason: str
    peer: str | None = None
    mismatch: ChecksumMismatch | None = None
    """``FailureCause.CHECKSUM`` only: which buffer, layer, position and prefill rank differ."""

    def __str__(self) -> str:
        return self.reason


@attrs.frozen(kw_only=True)
class RoomFinished:
    """A room reached a terminal state on this rank (for logs and metrics)."""

    room: RoomId
    poll: KVPoll
    reason: str = ""
    cause: FailureCause | None = None  # None for Success


class ReleaseKind(enum.Enum):
    """What lets a failed room's pages be reused (DESIGN section 8), counted by kind."""

    NOTHING_SENT = "nothing_sent"  # no prefill rank was told the destinations: nothing can land
    ACKED = "acked"  # every rank acknowledged once every write of the room had completed: proven
    CUT = "cut"  # acks (a write had failed, fenced) and every connection from their hosts closed: proven
    SETTLED = "settled"  # acks, then ``quarantine_settle`` without a cut: a time bound, not a proof
    UNSAFE = "unsafe"  # the quarantine bound passed with an ack missing

    @property
    def proven(self) -> bool:
        return self in (ReleaseKind.NOTHING_SENT, ReleaseKind.ACKED, ReleaseKind.CUT)

    @property
    def safe(self) -> bool:
        """Every rank acknowledged (proven or settled): only UNSAFE is not."""
        return self is not ReleaseKind.UNSAFE


@attrs.frozen(kw_only=True)
class ReleasePages:
    """Decode: the room's destination pages may be reused, and by what (``kind``)."""

    room: RoomId
    kind: ReleaseKind
    reason: str = ""

    @property
    def safe(self) -> bool:
        return self.kind.safe


class NoticeLevel(enum.Enum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"


@attrs.frozen(kw_only=True)
class Notice:
    """A line for the log: something worth telling an operator (late message, unknown room ...)."""

    level: NoticeLevel
    text: str
    room: RoomId | None = None


@attrs.frozen(kw_only=True)
class ForgetPeer:
    """Drop the connection to ``endpoint`` (and whatever is queued on it); the next send builds a new one.

    Emitted, before any message for that peer in the same batch of effects, when a peer went
    silent or restarted behind the same address: a socket to a dead or replaced process may hold
    a queue that will never drain, or state of the old incarnation.
    """

    endpoint: Endpoint
    reason: str


@attrs.frozen(kw_only=True)
class DropLayers:
    """Prefill: drain the room's per-layer contexts, which the endpoint has stopped (none may start
    writing again): wait for the writes each submitted, then ``layer_ended``. Emitted when the room
    ends (Success: contexts that never wrote; Failed) or every chunk of it is Done while a context
    that no sent chunk finished (an orphan) may still write: the room's Success waits for those."""

    room: RoomId
    reason: str


@attrs.frozen(kw_only=True)
class FenceWrite:
    """One small write of a room that failed, repeated later as a fence: ``length`` bytes from the
    prefill's ``src`` address to the decode's ``dst`` address, both inside the room's own pages (the
    decode holds those pages until the room's AbortAck, so writing them again is harmless). Opaque
    to the protocol: the runtime makes it from a block of the failed batch."""

    session: SessionId  # the decode rank's engine session the room was written to
    src: int
    dst: int
    length: int


@attrs.frozen(kw_only=True)
class SubmitFence:
    """Prefill: write ``fence`` to the decode rank ``peer`` through the same engine queue as the room's
    earlier writes and report ``fence_done``. Emitted before an AbortAck for a room whose write to
    that rank failed: the engine may still hold queued slices of the failed batch (they would be sent
    on a new connection once the link heals); a completed fence write proves every earlier slice to
    that rank has left the queue, so the AbortAck waits for it."""

    room: RoomId
    peer: PeerKey
    fence: FenceWrite


@attrs.frozen(kw_only=True)
class VerifyChecksums:
    """Decode: every required prefill rank reported Success for ``room``; compute the checksums of its
    destination pages (``dst_pages`` by position, the first ``prefix_pages`` held already), state
    slots and aux row, compare them with what each rank sent (``reports``; None: a rank sent none),
    and report ``checksums_verified``. The pages are stable: every write of the room completed.
    ``left_out``: per rank whose registration leaves some of this rank's (draft-model) buffers out of
    the pair's transfers, those buffers: that rank neither writes nor checksums them."""

    room: RoomId
    dst_pages: IntArray = attrs.field(eq=attrs.cmp_using(eq=np.array_equal))
    prefix_pages: int
    dst_state: tuple[StateIndices, ...]
    dst_aux_row: int | None
    reports: tuple[tuple[PeerKey, PageChecksums | None], ...]
    left_out: tuple[tuple[PeerKey, tuple[BufferKey, ...]], ...] = ()


@attrs.frozen(kw_only=True)
class LeaseLanding:
    """Decode: lease landing space for ``room`` (decode TP below prefill TP: one region per real source
    TP rank in ``sources``, for the positions from ``prefix_pages`` to the end of ``dst_pages``) and
    answer ``landing_granted`` with a grant per source, or with none (the room is larger than the
    whole pool: its requests go grant-less). No space now: answer later, when space came back; the
    room waits in Bootstrapping meanwhile, bounded by its bootstrap deadline. Released by the room's
    ``RoomFinished`` Success or its ``ReleasePages`` (the same rules as its pages)."""

    room: RoomId
    dst_pages: IntArray = attrs.field(eq=attrs.cmp_using(eq=np.array_equal))
    prefix_pages: int
    sources: tuple[PeerKey, ...]


@attrs.frozen(kw_only=True)
class ScatterLanding:
    """Decode: every required prefill rank reported Success for ``room``, whose KV pages landed in its
    landing lease (``grants``: the region of each source); copy them into ``dst_pages`` (positions
    from ``prefix_pages`` on) on the buffers' device, synchronised, and answer ``landing_scattered``."""

    room: RoomId
    dst_pages: IntArray = attrs.field(eq=attrs.cmp_using(eq=np.array_equal))
    prefix_pages: int
    grants: tuple[tuple[PeerKey, LandingGrant], ...]


@attrs.frozen(kw_only=True)
class CutConnections:
    """Decode: end every engine connection from ``host`` (a prefill rank's engine host) and report
    ``connections_cut``; emitted before releasing a quarantined room whose ranks all acknowledged
    (after their fences), so that no byte still in an old connection can land in released pages."""

    room: RoomId
    hosts: tuple[str, ...]


PrefillEffect: TypeAlias = Send | SubmitChunk | RoomFinished | Notice | ForgetPeer | DropLayers | SubmitFence
"""What a prefill endpoint asks its driver to do."""

DecodeEffect: TypeAlias = (
    Send
    | RoomFinished
    | ReleasePages
    | Notice
    | ForgetPeer
    | CutConnections
    | VerifyChecksums
    | LeaseLanding
    | ScatterLanding
)
"""What a decode endpoint asks its driver to do."""

Effect: TypeAlias = PrefillEffect | DecodeEffect
"""Either side's (for what reads both: logs, metrics)."""
