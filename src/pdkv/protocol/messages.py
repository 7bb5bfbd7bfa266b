"""Control messages of the pdkv protocol (DESIGN section 4): frozen, keyword-only, self-validating.

Owns: the message classes and the small value types they carry. Must not know bytes (that is
``codec``), must not do I/O. Every field is validated at construction, so a decoded message that
exists is a valid message; the codec turns a validation failure into ``RemoteProtocolError``.

Every message names its origin (instance, epoch, rank): that is how a receiver tells a restarted
peer (new epoch) from a late message of its previous life.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from typing import Any, Final, TypeAlias

import attrs
import numpy as np
import numpy.typing as npt

from pdkv.mapping._arrays import int_bounds
from pdkv.mapping.layout import BufferKind, BufferLayout
from pdkv.mapping.layout_policy import BufferKey, describe_keys
from pdkv.protocol.ids import MAX_EPOCH, MAX_ROOM_ID, Endpoint, Epoch, InstanceId, RoomId, SessionId

IntArray: TypeAlias = npt.NDArray[np.int64]
SumArray: TypeAlias = npt.NDArray[np.uint32]
"""Checksums as they travel: one uint32 per (buffer, item)."""

MAX_REASON_CHARS: Final = 4096
MAX_NAME_CHARS: Final = 256
MAX_RANKS: Final = 4096
MAX_INDEX: Final = 2**62  # page / row / slot indices are non-negative and below this
MAX_ENGINE_METADATA_BYTES: Final = 256 << 10  # a NIXL agent's metadata with its regions (a few KiB)


class Side(enum.StrEnum):
    """Which side of the transfer a rank is on (a ``str``: it compares equal to its value)."""

    PREFILL = "prefill"
    DECODE = "decode"


class Outcome(enum.Enum):
    """Final word of a prefill rank about one room."""

    SUCCESS = "success"
    FAILED = "failed"


# ---------------------------------------------------------------- validators and converters


def _int_in(lo: int, hi: int) -> Any:
    def check(_: object, attribute: attrs.Attribute[int], value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ValueError(f"{attribute.name} must be an int in [{lo}, {hi}], got {value!r}")

    return check


def _text(max_chars: int, *, allow_empty: bool = False) -> Any:
    def check(_: object, attribute: attrs.Attribute[str], value: str) -> None:
        if not isinstance(value, str):
            raise TypeError(f"{attribute.name} must be str, got {type(value).__name__}")
        if len(value) > max_chars or (not allow_empty and not value):
            raise ValueError(f"{attribute.name} must have 1..{max_chars} characters, got {len(value)}")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{attribute.name} is not valid UTF-8 text (lone surrogate)") from None

    return check


def _bytes_up_to(max_bytes: int) -> Any:
    def check(_: object, attribute: attrs.Attribute[bytes], value: bytes) -> None:
        if not isinstance(value, bytes):
            raise TypeError(f"{attribute.name} must be bytes, got {type(value).__name__}")
        if len(value) > max_bytes:
            raise ValueError(f"{attribute.name} must have at most {max_bytes} bytes, got {len(value)}")

    return check


def _finite_non_negative(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    try:
        ok = (
            not isinstance(value, bool)
            and isinstance(value, (int, float))
            and math.isfinite(value)
            and value >= 0
        )
    except OverflowError:  # an int too large for a float
        ok = False
    if not ok:
        raise ValueError(f"{attribute.name} must be a finite float >= 0, got {value!r}")


def index_array(value: object) -> IntArray:
    """Converter: any 1-D integer sequence -> read-only contiguous int64 array of valid indices."""
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(f"index arrays are 1-D, got shape {arr.shape}")
    if arr.size == 0:
        out = np.zeros(0, dtype=np.int64)
    elif arr.dtype.kind not in "iu":
        raise TypeError(f"index arrays hold integers, got dtype {arr.dtype}")
    else:
        if arr.dtype == np.uint64 and int(arr.max()) >= MAX_INDEX:
            raise ValueError("index out of range")
        out = np.ascontiguousarray(arr, dtype=np.int64)
        lo, hi = int_bounds(out)
        if lo < 0 or hi >= MAX_INDEX:
            raise ValueError(f"indices must be in [0, 2**62), got min {lo} max {hi}")
    if out is arr or out.base is arr:
        out = out.copy()
    out.flags.writeable = False
    return out


def checksum_array(value: object) -> SumArray:
    """Converter: any 1-D sequence of integers in [0, 2**32) -> read-only contiguous uint32 array."""
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(f"checksum arrays are 1-D, got shape {arr.shape}")
    if arr.size == 0:
        out = np.zeros(0, dtype=np.uint32)
    elif arr.dtype.kind not in "iu":
        raise TypeError(f"checksum arrays hold integers, got dtype {arr.dtype}")
    elif arr.dtype == np.uint32:
        out = np.ascontiguousarray(arr)
    else:
        if int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF:
            raise ValueError(f"checksums are uint32, got min {int(arr.min())} max {int(arr.max())}")
        out = np.ascontiguousarray(arr, dtype=np.uint32)
    if out is arr or out.base is arr:
        out = out.copy()
    out.flags.writeable = False
    return out


def _array_eq() -> Any:
    return attrs.cmp_using(eq=np.array_equal)


# ---------------------------------------------------------------- value types


@attrs.frozen(kw_only=True)
class RankCoord:
    """Position of a rank inside its instance (tensor-parallel and context-parallel coordinates)."""

    tp: int = attrs.field(validator=_int_in(0, MAX_RANKS - 1))
    cp: int = attrs.field(default=0, validator=_int_in(0, MAX_RANKS - 1))

    def __str__(self) -> str:
        return f"tp{self.tp}/cp{self.cp}"


@attrs.frozen(kw_only=True)
class Origin:
    """Who sent a message: instance, its incarnation, and the rank inside it."""

    instance: InstanceId = attrs.field(validator=_text(MAX_NAME_CHARS))
    epoch: Epoch = attrs.field(validator=_int_in(0, MAX_EPOCH))
    rank: RankCoord = attrs.field(validator=attrs.validators.instance_of(RankCoord))

    def __str__(self) -> str:
        return f"{self.instance}#{self.epoch}:{self.rank}"


@attrs.frozen(kw_only=True)
class RankRoute:
    """How to reach one prefill rank: control endpoint and transfer-engine session."""

    rank: RankCoord = attrs.field(validator=attrs.validators.instance_of(RankCoord))
    epoch: Epoch = attrs.field(validator=_int_in(0, MAX_EPOCH))
    endpoint: Endpoint = attrs.field(validator=_text(MAX_NAME_CHARS))
    session: SessionId = attrs.field(validator=_text(MAX_NAME_CHARS))


@attrs.frozen(kw_only=True)
class StateIndices:
    """Destination (or source) slots of one state buffer kind for one room."""

    kind: BufferKind = attrs.field(validator=attrs.validators.instance_of(BufferKind))
    indices: IntArray = attrs.field(converter=index_array, eq=_array_eq(), hash=False)

    def __attrs_post_init__(self) -> None:
        if not self.kind.is_state:
            raise ValueError(f"{self.kind.value} is not a state buffer kind")


@attrs.frozen(kw_only=True)
class TransferMetricData:
    """What a prefill rank actually wrote for a room (bytes counted, never estimated)."""

    pages: int = attrs.field(default=0, validator=_int_in(0, MAX_INDEX))
    bytes: int = attrs.field(default=0, validator=_int_in(0, 2**63 - 1))
    seconds: float = attrs.field(default=0.0, validator=_finite_non_negative)


@attrs.frozen(kw_only=True)
class StateChecksums:
    """Checksums of the state slots of one kind a prefill rank wrote: the first ``count`` of the
    decode's slots of that kind (``clip_state`` keeps the leading ones), for every buffer of the
    kind (in layout order), buffer-major: ``sums[b * count + i]`` is buffer b's slot i."""

    kind: BufferKind = attrs.field(validator=attrs.validators.instance_of(BufferKind))
    count: int = attrs.field(validator=_int_in(0, MAX_INDEX - 1))
    sums: SumArray = attrs.field(converter=checksum_array, eq=_array_eq(), hash=False)

    def __attrs_post_init__(self) -> None:
        if not self.kind.is_state:
            raise ValueError(f"{self.kind.value} is not a state buffer kind")
        if (self.count == 0) != (self.sums.size == 0) or (self.count and self.sums.size % self.count):
            raise ValueError(f"{self.sums.size} state checksums do not fill buffers of {self.count} slots")


def _state_sums_tuple(value: Iterable[StateChecksums]) -> tuple[StateChecksums, ...]:
    return tuple(value)


def _strictly_increasing(_: object, attribute: attrs.Attribute[IntArray], value: IntArray) -> None:
    if value.size > 1 and not bool((np.diff(value) > 0).all()):
        raise ValueError(f"{attribute.name} must be strictly increasing")


@attrs.frozen(kw_only=True)
class PageChecksums:
    """What one prefill rank wrote for one room, as checksums (opt-in, ``PDKV_KV_CHECKSUM``).

    ``positions``: the KV page positions it wrote (strictly increasing); ``kv``: one checksum per KV
    buffer (in layout order) and position, buffer-major (``kv[b * len(positions) + i]``); ``state``:
    per state kind it wrote; ``aux``: one per aux buffer for the aux row (empty: it wrote none).
    ``pdkv.runtime.checksum`` defines the checksum and computes it on both sides; this class only
    carries it. Every field is a compact array (raw uint32 frames on the wire)."""

    positions: IntArray = attrs.field(
        converter=index_array, validator=_strictly_increasing, eq=_array_eq(), hash=False
    )
    kv: SumArray = attrs.field(converter=checksum_array, eq=_array_eq(), hash=False)
    state: tuple[StateChecksums, ...] = attrs.field(
        default=(),
        converter=_state_sums_tuple,
        validator=attrs.validators.deep_iterable(attrs.validators.instance_of(StateChecksums)),
    )
    aux: SumArray = attrs.field(
        factory=lambda: checksum_array(()), converter=checksum_array, eq=_array_eq(), hash=False
    )

    def __attrs_post_init__(self) -> None:
        n = self.positions.size
        if (n == 0 and self.kv.size) or (n and self.kv.size % n):
            raise ValueError(f"{self.kv.size} KV checksums do not fill buffers of {n} positions")
        kinds = [s.kind for s in self.state]
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"state checksums list a kind twice: {[k.value for k in kinds]}")

    @property
    def kv_buffers(self) -> int:
        """KV buffers covered (0 when no position was written)."""
        return self.kv.size // self.positions.size if self.positions.size else 0

    def kv_matrix(self) -> npt.NDArray[np.uint32]:
        """``kv`` as (buffers, positions)."""
        return self.kv.reshape(self.kv_buffers, self.positions.size)


def _unique_state_kinds(_: object, attribute: attrs.Attribute[Any], value: tuple[StateIndices, ...]) -> None:
    for item in value:
        if not isinstance(item, StateIndices):
            raise TypeError(f"{attribute.name} holds StateIndices, got {type(item).__name__}")
    kinds = [s.kind for s in value]
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"{attribute.name} lists a state kind twice: {[k.value for k in kinds]}")


def _tuple_of(cls: type) -> Any:
    return attrs.validators.deep_iterable(attrs.validators.instance_of(cls))


def _key_tuple(value: Iterable[BufferKey]) -> tuple[BufferKey, ...]:
    return tuple(value)


def _unique_keys(_: object, attribute: attrs.Attribute[Any], value: tuple[BufferKey, ...]) -> None:
    for item in value:
        if not isinstance(item, BufferKey):
            raise TypeError(f"{attribute.name} holds BufferKey, got {type(item).__name__}")
    if len(set(value)) != len(value):
        raise ValueError(f"{attribute.name} lists a buffer twice: {describe_keys(value)}")


def _route_tuple(value: Iterable[RankRoute]) -> tuple[RankRoute, ...]:
    return tuple(value)


def state_tuple(value: Iterable[StateIndices]) -> tuple[StateIndices, ...]:
    return tuple(value)


_origin = attrs.validators.instance_of(Origin)
_room = _int_in(1, MAX_ROOM_ID)

# ---------------------------------------------------------------- registry messages


@attrs.frozen(kw_only=True)
class RankAnnounce:
    """Prefill rank -> bootstrap registry: here I am, reach me there."""

    origin: Origin = attrs.field(validator=_origin)
    tp_size: int = attrs.field(validator=_int_in(1, MAX_RANKS))
    cp_size: int = attrs.field(validator=_int_in(1, MAX_RANKS))
    endpoint: Endpoint = attrs.field(validator=_text(MAX_NAME_CHARS))
    session: SessionId = attrs.field(validator=_text(MAX_NAME_CHARS))
    page_size: int = attrs.field(validator=_int_in(1, 2**20))
    layout_digest: str = attrs.field(validator=_text(64))

    def __attrs_post_init__(self) -> None:
        if self.origin.rank.tp >= self.tp_size or self.origin.rank.cp >= self.cp_size:
            raise ValueError(f"rank {self.origin.rank} outside tp_size {self.tp_size} cp_size {self.cp_size}")


@attrs.frozen(kw_only=True)
class RouteQuery:
    """Decode rank -> registry: which prefill ranks serve this instance?"""

    origin: Origin = attrs.field(validator=_origin)


@attrs.frozen(kw_only=True)
class RouteTable:
    """Registry -> decode rank. ``complete`` is False until every prefill rank has announced."""

    origin: Origin = attrs.field(validator=_origin)
    tp_size: int = attrs.field(validator=_int_in(1, MAX_RANKS))
    cp_size: int = attrs.field(validator=_int_in(1, MAX_RANKS))
    page_size: int = attrs.field(validator=_int_in(1, 2**20))
    layout_digest: str = attrs.field(validator=_text(64))
    ranks: tuple[RankRoute, ...] = attrs.field(converter=_route_tuple, validator=_tuple_of(RankRoute))
    complete: bool = attrs.field(validator=attrs.validators.instance_of(bool))

    def __attrs_post_init__(self) -> None:
        coords = [r.rank for r in self.ranks]
        if len(set(coords)) != len(coords):
            raise ValueError("route table lists a rank twice")
        if len(coords) > self.tp_size * self.cp_size:
            raise ValueError("route table lists more ranks than tp_size * cp_size")
        for c in coords:
            if c.tp >= self.tp_size or c.cp >= self.cp_size:
                raise ValueError(f"rank {c} outside tp_size {self.tp_size} cp_size {self.cp_size}")
        if self.complete and len(coords) != self.tp_size * self.cp_size:
            raise ValueError(
                f"a complete route table lists all {self.tp_size * self.cp_size} ranks, got {len(coords)}"
            )


# ---------------------------------------------------------------- registration


@attrs.frozen(kw_only=True)
class Register:
    """Decode rank -> each prefill rank it receives from: my endpoint, my session, my buffers.

    ``engine_metadata`` is what the prefill's transfer engine needs beside ``session`` to write into
    those buffers (``TransferBackend.engine_metadata``: NIXL's agent metadata; empty for Mooncake)."""

    origin: Origin = attrs.field(validator=_origin)
    tp_size: int = attrs.field(validator=_int_in(1, MAX_RANKS))
    endpoint: Endpoint = attrs.field(validator=_text(MAX_NAME_CHARS))
    session: SessionId = attrs.field(validator=_text(MAX_NAME_CHARS))
    layout: BufferLayout = attrs.field(validator=attrs.validators.instance_of(BufferLayout))
    engine_metadata: bytes = attrs.field(default=b"", validator=_bytes_up_to(MAX_ENGINE_METADATA_BYTES))

    def __attrs_post_init__(self) -> None:
        if self.origin.rank.tp >= self.tp_size:
            raise ValueError(f"rank {self.origin.rank} outside tp_size {self.tp_size}")


@attrs.frozen(kw_only=True)
class RegisterAck:
    """Prefill rank -> decode rank: layouts agree (or differ only as the prefill's layout policy
    allows); rooms may name this rank from now on.

    ``prefill_left_out``: the prefill's buffers its transfers to this decode rank leave out (the decode
    registers no counterpart: draft-model buffers of a rolling deployment); ``decode_left_out``: the
    decode's buffers nothing of this prefill rank writes. Both empty when the layouts match."""

    origin: Origin = attrs.field(validator=_origin)
    prefill_left_out: tuple[BufferKey, ...] = attrs.field(
        default=(), converter=_key_tuple, validator=_unique_keys
    )
    decode_left_out: tuple[BufferKey, ...] = attrs.field(
        default=(), converter=_key_tuple, validator=_unique_keys
    )

    @property
    def leaves_out(self) -> bool:
        return bool(self.prefill_left_out or self.decode_left_out)


@attrs.frozen(kw_only=True)
class RegisterReject:
    """Prefill rank -> decode rank (or registry -> rank): registration or query refused; ``reason``
    names the exact difference. ``retry``: the refusal may go away by itself (the registry has no
    rank of the instance yet), so asking again makes sense; otherwise it is fatal (a shape or
    layout difference) and a client stops retrying."""

    origin: Origin = attrs.field(validator=_origin)
    reason: str = attrs.field(validator=_text(MAX_REASON_CHARS))
    retry: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))


# ---------------------------------------------------------------- per-room messages


@attrs.frozen(kw_only=True)
class LandingGrant:
    """The landing region a decode rank leased for one prefill TP rank and one room (decode TP below
    prefill TP, specs/mapping.md section 15): ``nbytes`` of registered memory at ``address`` holding
    ``slots`` page items per K/V buffer of the prefill rank's own head geometry, slot ``j`` for
    position ``first_position + j``. The layout inside is recomputed from the grant and the two
    registered layouts on both sides: nothing else travels."""

    address: int = attrs.field(validator=_int_in(1, 2**63 - 1))
    nbytes: int = attrs.field(validator=_int_in(1, 2**63 - 1))
    first_position: int = attrs.field(validator=_int_in(0, MAX_INDEX - 1))
    slots: int = attrs.field(validator=_int_in(1, MAX_INDEX - 1))


@attrs.frozen(kw_only=True)
class TransferRequest:
    """Decode rank -> prefill rank, one per room: where the room's bytes must land.

    ``dst_pages`` covers the whole request by position (position i -> dst_pages[i]). The decode rank
    already holds positions ``0 .. prefix_pages-1`` (its own prefix cache): the prefill writes none of
    them (its first chunk starts at ``prefix_pages`` or later). A dummy request carries no destination:
    it only lets a replica rank's room advance. ``landing``: the KV pages go whole into this landing
    region instead of into ``dst_pages`` (the decode scatters them before Success); its window is the
    request's positions from ``prefix_pages`` on. None: write into the pages (state and aux rows go
    to the decode's own buffers either way).
    """

    origin: Origin = attrs.field(validator=_origin)
    room: RoomId = attrs.field(validator=_room)
    dst_pages: IntArray = attrs.field(converter=index_array, eq=_array_eq(), hash=False)
    dst_aux_row: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_int_in(0, MAX_INDEX - 1))
    )
    dst_state: tuple[StateIndices, ...] = attrs.field(
        default=(), converter=state_tuple, validator=_unique_state_kinds
    )
    required_dst_info_num: int = attrs.field(default=1, validator=_int_in(1, MAX_RANKS))
    dummy: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    prefix_pages: int = attrs.field(default=0, validator=_int_in(0, MAX_INDEX - 1))
    landing: LandingGrant | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(LandingGrant))
    )

    def __attrs_post_init__(self) -> None:
        if self.dummy and (
            self.dst_pages.size or self.dst_aux_row is not None or self.dst_state or self.landing is not None
        ):
            raise ValueError("a dummy TransferRequest carries no destination")
        if self.landing is not None and (
            self.landing.first_position != self.prefix_pages
            or self.landing.first_position + self.landing.slots != self.dst_pages.size
        ):
            raise ValueError(
                f"the landing window {self.landing.first_position}+{self.landing.slots} is not the "
                f"request's positions {self.prefix_pages}..{self.dst_pages.size - 1}"
            )
        if self.prefix_pages > self.dst_pages.size and not self.dummy:
            raise ValueError(
                f"prefix_pages {self.prefix_pages} exceeds the request's {self.dst_pages.size} pages"
            )


@attrs.frozen(kw_only=True)
class TransferStatus:
    """Prefill rank -> decode rank: the room's last chunk landed (Success) or the room failed."""

    origin: Origin = attrs.field(validator=_origin)
    room: RoomId = attrs.field(validator=_room)
    outcome: Outcome = attrs.field(validator=attrs.validators.instance_of(Outcome))
    reason: str = attrs.field(default="", validator=_text(MAX_REASON_CHARS, allow_empty=True))
    metric: TransferMetricData = attrs.field(
        factory=TransferMetricData, validator=attrs.validators.instance_of(TransferMetricData)
    )
    checksums: PageChecksums | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(PageChecksums))
    )
    """Success only, with ``PDKV_KV_CHECKSUM``: what this rank wrote for the room, as checksums."""

    def __attrs_post_init__(self) -> None:
        if self.outcome is Outcome.FAILED and not self.reason:
            raise ValueError("a Failed status carries a reason")
        if self.outcome is Outcome.FAILED and self.checksums is not None:
            raise ValueError("a Failed status carries no checksums")


@attrs.frozen(kw_only=True)
class Abort:
    """Either side -> peer: stop this room. Decode then waits for AbortAck before reusing pages."""

    origin: Origin = attrs.field(validator=_origin)
    room: RoomId = attrs.field(validator=_room)
    reason: str = attrs.field(validator=_text(MAX_REASON_CHARS))


@attrs.frozen(kw_only=True)
class AbortAck:
    """Prefill rank -> decode rank: every write of the room already submitted has ended.

    ``fenced``: one of them failed, and this ack follows a fence write that proved the engine's queue
    to the decode rank drained; bytes of the failed write may still sit in a connection, so the decode
    cuts its connections from this rank's host (or waits ``quarantine_settle``) before it reuses the
    pages. Without it, every write completed (was applied at the destination): the ack is the proof."""

    origin: Origin = attrs.field(validator=_origin)
    room: RoomId = attrs.field(validator=_room)
    fenced: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))


# ---------------------------------------------------------------- liveness


@attrs.frozen(kw_only=True)
class Heartbeat:
    """Either side -> peer, periodically: I am alive (the epoch tells a restart). ``endpoint`` is where
    the sender listens, so a peer that no longer knows it (forgot it after silence, or restarted) can
    say so at once instead of staying silent until the sender's heartbeat timeout."""

    origin: Origin = attrs.field(validator=_origin)
    seq: int = attrs.field(validator=_int_in(0, 2**63 - 1))
    endpoint: Endpoint | None = attrs.field(
        default=None, validator=attrs.validators.optional(_text(MAX_NAME_CHARS))
    )


@attrs.frozen(kw_only=True)
class HeartbeatAck:
    """Answer to a Heartbeat, echoing its sequence number."""

    origin: Origin = attrs.field(validator=_origin)
    seq: int = attrs.field(validator=_int_in(0, 2**63 - 1))


Message: TypeAlias = (
    RankAnnounce
    | RouteQuery
    | RouteTable
    | Register
    | RegisterAck
    | RegisterReject
    | TransferRequest
    | TransferStatus
    | Abort
    | AbortAck
    | Heartbeat
    | HeartbeatAck
)

MESSAGE_TYPES: Final[tuple[type[Message], ...]] = (
    RankAnnounce,
    RouteQuery,
    RouteTable,
    Register,
    RegisterAck,
    RegisterReject,
    TransferRequest,
    TransferStatus,
    Abort,
    AbortAck,
    Heartbeat,
    HeartbeatAck,
)
