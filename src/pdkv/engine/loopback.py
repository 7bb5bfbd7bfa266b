"""In-process transfer backend: memcpy between regions registered under session ids, with fault injection.

Owns: ``LoopbackBackend``, ``LoopbackFabric`` (the registry that maps session ids to live loopback
backends: one per process by default, or an explicit one shared by the backends of a test) and
``LoopbackFaults`` (fail the Nth batch, delay batches, fail only some peers, and damage the bytes a
write landed: ``Corruption``, what a checksum must catch while the engine reports success). Must not
pretend to be faster or more forgiving than a real engine: completion is asynchronous on worker threads
(a delayed batch is really still in flight), the destination is checked against the peer's registrations
as a real peer would, and more than ``max_entries_in_flight`` entries towards one peer fail the batch,
as Mooncake's TCP lane does, so the splitting in ``pdkv.engine._threaded`` is exercised for real. Copies
run on a small pool (``worker_threads``), so delayed batches overlap as a real engine's do.

With ``announced_regions`` a sender reaches a peer only inside the regions the peer's
``engine_metadata`` listed when it reached ``add_peer`` (NIXL's rule: a region the peer registered
after its metadata went out is not writable until newer metadata arrives), so the transports' tests
see what the announcement carries, not only what the peer process has registered.

Memory safety is the caller's: the destination check and the copy are not atomic with respect to
the peer unregistering (and freeing) memory, exactly the rule every backend states (never
unregister memory a batch in flight may touch).
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import json
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ClassVar

import attrs

from pdkv.engine._threaded import PieceFailed, PieceJob, RegionSnapshot, WorkerThreadBackend
from pdkv.engine.backend import MemoryRegion
from pdkv.errors.engine import PeerMetadataError
from pdkv.mapping.blocks import TransferBlocks


def _non_negative_float(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value >= 0.0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value!r}")


def _positive_int(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{attribute.name} must be a positive int, got {value!r}")


def _serials(values: Iterable[int]) -> frozenset[int]:
    return frozenset(values)


def _peers(values: Iterable[str]) -> frozenset[str]:
    return frozenset(values)


class CorruptionKind(enum.Enum):
    FLIP = "flip"  # xor the byte at ``at`` with ``mask``
    ZERO = "zero"  # zero ``length`` bytes from ``at``
    SWAP = "swap"  # exchange ``length`` bytes at ``at`` with those at ``other``
    COPY = "copy"  # overwrite ``length`` bytes at ``at`` with those at ``other`` (a stale write)


@attrs.frozen(kw_only=True)
class Corruption:
    """Silent damage at the destination: once a piece that writes destination address ``at`` has
    landed, the bytes there change as ``kind`` says, and the batch still completes. ``other``: the
    second range of a swap (it must land in the same piece), or the source of a copy (any memory of
    this process: e.g. another room's bytes, as a late write of that room would bring)."""

    kind: CorruptionKind
    at: int
    length: int = 1
    other: int = 0
    mask: int = 0x01

    def touched_by(self, piece: TransferBlocks) -> bool:
        inside = (piece.dst <= self.at) & (self.at + self.length <= piece.dst + piece.length)
        if self.kind is CorruptionKind.SWAP:
            other = (piece.dst <= self.other) & (self.other + self.length <= piece.dst + piece.length)
            return bool(inside.any()) and bool(other.any())
        return bool(inside.any())

    def apply(self) -> None:
        if self.kind is CorruptionKind.FLIP:
            byte = ctypes.c_uint8.from_address(self.at)
            byte.value ^= self.mask
        elif self.kind is CorruptionKind.ZERO:
            ctypes.memset(self.at, 0, self.length)
        elif self.kind is CorruptionKind.SWAP:
            saved = ctypes.create_string_buffer(self.length)
            ctypes.memmove(saved, self.at, self.length)
            ctypes.memmove(self.at, self.other, self.length)
            ctypes.memmove(self.other, saved, self.length)
        else:
            ctypes.memmove(self.at, self.other, self.length)


def _corruptions(values: Iterable[Corruption]) -> tuple[Corruption, ...]:
    return tuple(values)


@attrs.frozen(kw_only=True)
class LoopbackFaults:
    """What goes wrong, by batch serial (1-based submission order of the sending backend) and peer."""

    fail_batches: frozenset[int] = attrs.field(default=frozenset(), converter=_serials)
    failing_peers: frozenset[str] = attrs.field(default=frozenset(), converter=_peers)
    delay_seconds: float = attrs.field(default=0.0, validator=_non_negative_float)
    # None: every batch is delayed (when delay_seconds > 0); otherwise only these serials.
    delay_batches: frozenset[int] | None = attrs.field(
        default=None, converter=attrs.converters.optional(_serials)
    )
    # A straggling link: every piece towards these peers waits ``slow_peer_seconds`` first.
    slow_peers: frozenset[str] = attrs.field(default=frozenset(), converter=_peers)
    slow_peer_seconds: float = attrs.field(default=0.0, validator=_non_negative_float)
    # A real engine that fails a batch may already have landed some of it: a failing batch first
    # writes the first half of its blocks, so callers are tested against partial writes.
    partial_write: bool = True
    # Bytes damaged after a successful write (every piece that covers them, while installed).
    corruptions: tuple[Corruption, ...] = attrs.field(default=(), converter=_corruptions)

    def delays(self, serial: int) -> bool:
        return self.delay_seconds > 0 and (self.delay_batches is None or serial in self.delay_batches)

    @classmethod
    def none(cls) -> LoopbackFaults:
        return cls()


@attrs.frozen(kw_only=True)
class LoopbackConfig:
    max_entries_in_flight: int = attrs.field(default=2048, validator=_positive_int)
    worker_threads: int = attrs.field(default=4, validator=_positive_int)
    faults: LoopbackFaults = LoopbackFaults()
    announced_regions: bool = False
    """Writes reach a peer only inside the regions its ``engine_metadata`` announced (``add_peer``), as
    NIXL's do; off, a peer is reached by its session id alone and checked against what it registered."""


_METADATA_TAG = b"pdkv-loopback-regions:"


class LoopbackFabric:
    """Session id -> live loopback backend. Backends reach each other only within one fabric."""

    _default: ClassVar[LoopbackFabric | None] = None
    _default_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, name: str = "local") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._members: dict[str, LoopbackBackend] = {}
        self._numbers = itertools.count(1)

    @classmethod
    def default(cls) -> LoopbackFabric:
        """The process-wide fabric used when a backend is given none."""
        with cls._default_lock:
            if cls._default is None:
                cls._default = LoopbackFabric("process")
            return cls._default

    def attach(self, backend: LoopbackBackend) -> str:
        with self._lock:
            session_id = f"loopback:{self.name}:{next(self._numbers)}"
            self._members[session_id] = backend
            return session_id

    def detach(self, session_id: str) -> None:
        with self._lock:
            self._members.pop(session_id, None)

    def lookup(self, session_id: str) -> LoopbackBackend | None:
        with self._lock:
            return self._members.get(session_id)


class LoopbackBackend(WorkerThreadBackend["Future[None]"]):
    """A ``TransferBackend`` that copies with ``ctypes.memmove`` inside one process."""

    def __init__(self, config: LoopbackConfig | None = None, *, fabric: LoopbackFabric | None = None) -> None:
        self.config = config or LoopbackConfig()
        super().__init__(max_entries_in_flight=self.config.max_entries_in_flight, thread_name="pdkv-loopback")
        self._fabric = fabric or LoopbackFabric.default()
        self._faults = self.config.faults
        # The "engine": copies run here, so delayed batches overlap as a real engine's would.
        self._copiers = ThreadPoolExecutor(
            self.config.worker_threads, thread_name_prefix="pdkv-loopback-copy"
        )
        self._lane_lock = threading.Lock()
        self._lane_entries: dict[str, int] = {}
        self._announced: dict[str, RegionSnapshot] = {}  # peer session -> the regions it announced
        self._session_id = self._fabric.attach(self)

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def faults(self) -> LoopbackFaults:
        return self._faults

    def set_faults(self, faults: LoopbackFaults) -> None:
        """Replace the faults; pieces not launched yet see the new ones."""
        self._faults = faults

    def destination_outside(self, batch: TransferBlocks) -> int:
        """Index of the first block whose destination is not registered here (-1: none)."""
        return self._regions.first_outside(batch.dst, batch.length)

    @property
    def engine_metadata(self) -> bytes:
        """With ``announced_regions``: the regions registered now, which a sender may write into once
        this reached its ``add_peer``; else nothing (a peer is reached by its session id)."""
        if not self.config.announced_regions:
            return b""
        snap = self._regions.snapshot()
        ranges = [[int(a), int(b)] for a, b in zip(snap.starts.tolist(), snap.ends.tolist(), strict=True)]
        return _METADATA_TAG + json.dumps(ranges).encode()

    def add_peer(self, session: str, metadata: bytes) -> None:
        """With ``announced_regions``: the regions ``session`` announced replace those it announced
        before. ``PeerMetadataError`` for metadata that is not a loopback announcement."""
        if not self.config.announced_regions:
            return
        if not metadata.startswith(_METADATA_TAG):
            raise PeerMetadataError(f"peer engine metadata of {session!r} is not a loopback region list")
        try:
            ranges = json.loads(metadata[len(_METADATA_TAG) :])
            table = RegionSnapshot.of((int(start), int(end)) for start, end in ranges)
        except (ValueError, TypeError) as exc:
            raise PeerMetadataError(f"peer engine metadata of {session!r}: {exc}") from None
        with self._lane_lock:
            self._announced[session] = table

    # ---------------------------------------------------------------------------- engine hooks

    def _engine_register(self, region: MemoryRegion) -> None:
        pass  # the region table of the base class is this engine's whole registration state

    def _engine_unregister(self, region: MemoryRegion) -> None:
        pass

    def _engine_close(self) -> None:
        self._fabric.detach(self._session_id)
        self._copiers.shutdown(wait=True)

    def _launch(self, job: PieceJob) -> Future[None]:
        faults = self._faults
        peer, piece = job.handle.peer, job.piece
        if peer in faults.failing_peers:
            raise PieceFailed(f"injected failure: peer {peer} is failing")
        target = self._fabric.lookup(peer)
        if target is None:
            raise PieceFailed(f"no loopback backend with session id {peer!r} in fabric {self._fabric.name!r}")
        if self.config.announced_regions:
            with self._lane_lock:
                announced = self._announced.get(peer)
            if announced is None:
                raise PieceFailed(
                    f"peer {peer} announced no regions (its engine metadata never reached add_peer)"
                )
            outside = announced.first_outside(piece.dst, piece.length)
            if outside >= 0:
                raise PieceFailed(
                    f"destination {int(piece.dst[outside]):#x}+{int(piece.length[outside])} is not inside a "
                    f"region {peer} announced"
                )
        with self._lane_lock:
            queued = self._lane_entries.get(peer, 0) + len(piece)
            limit = self.config.max_entries_in_flight
            if queued > limit:
                raise PieceFailed(f"lane queue full towards {peer}: {queued} entries > {limit}")
            self._lane_entries[peer] = queued
        return self._copiers.submit(_execute, job, faults, target)

    def _complete(self, job: PieceJob, token: Future[None]) -> None:
        try:
            token.result()
        finally:
            with self._lane_lock:
                self._lane_entries[job.handle.peer] -= len(job.piece)


def _execute(job: PieceJob, faults: LoopbackFaults, target: LoopbackBackend) -> None:
    """The peer's side of one piece: (delay), check the destination, (fail), copy."""
    serial, piece = job.handle.serial, job.piece
    if job.index == 0 and faults.delays(serial):
        time.sleep(faults.delay_seconds)
    if job.handle.peer in faults.slow_peers:
        time.sleep(faults.slow_peer_seconds)
    outside = target.destination_outside(piece)
    if outside >= 0:
        raise PieceFailed(
            f"destination {int(piece.dst[outside]):#x}+{int(piece.length[outside])} "
            f"(block {outside} of {len(piece)}) is not inside a region registered at {target.session_id}"
        )
    if serial in faults.fail_batches:
        if faults.partial_write and job.index == 0:
            _copy(piece.take(slice(0, len(piece) // 2)))
        raise PieceFailed(f"injected failure of batch {serial}")
    _copy(piece)
    for corruption in faults.corruptions:
        if corruption.touched_by(piece):
            corruption.apply()


def _copy(blocks: TransferBlocks) -> None:
    # ctypes releases the GIL around memmove, so copies overlap with the caller's Python work.
    triples = zip(blocks.src.tolist(), blocks.dst.tolist(), blocks.length.tolist(), strict=True)
    for src, dst, length in triples:
        ctypes.memmove(dst, src, length)
