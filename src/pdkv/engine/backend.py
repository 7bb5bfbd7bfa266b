"""The transfer-backend contract: what the runtime may ask of any engine that writes bytes into a peer.

Owns: the ``TransferBackend`` protocol, the records it speaks in (``MemoryRegion``, ``Registration``,
``BatchHandle``, ``BatchStatus``, ``BatchOutcome``, ``WaitResult``, ``BackendStatistics``) and the
engine errors (subclasses of ``pdkv.errors.TransferError``). Must not import an engine module, do I/O,
or know about rooms, pages or layouts: a backend moves byte ranges, nothing more.

Contract every backend keeps (``pdkv.testing.backend_conformance`` checks it):

- ``submit_write`` never blocks on the network. It raises only for problems it can see locally
  (backend closed, a source range outside every registration of this backend); anything the
  engine or the peer decides (unknown peer, destination not registered there, engine queue full,
  transport error) comes back as a FAILED outcome from ``wait``.
- A batch with more entries than the engine accepts at once is split by the backend, never
  rejected: ``max_entries_in_flight`` is the most entries the backend keeps in flight towards one
  peer, and it queues the rest.
- Zero-length blocks move nothing and are accepted anywhere; an empty batch completes at once.
- ``wait(handles, timeout)`` reports every handle: COMPLETED (all bytes are at the peer),
  FAILED (some bytes may have landed, none are promised) or TIMED_OUT. TIMED_OUT is not an end
  state: the batch may still be queued or in flight and may still write into the destination, so
  the caller must keep both memories registered and the destination pages unused until a later
  ``wait`` on the same handle returns COMPLETED or FAILED (or until ``close()`` returned, which
  waits for every batch). Waiting again on a finished handle returns the same outcome.
- Registration lives exactly as long as the memory: a ``Registration`` keeps the object it was made
  from alive, and ``close()`` on it (or leaving its ``with`` block, or closing the backend)
  unregisters. Closing a backend first waits for every submitted batch, then unregisters all.
- The caller must not unregister memory that a batch still in flight reads or writes.
- A FAILED write may still land later (``specs/mooncake-tcp-late-writes.md``, ``specs/nixl.md``): the
  receiving side ends that only with ``cut_connections_from`` after the writer proved its queue drained
  (a fence write).
- A peer is reachable once its ``engine_metadata`` reached ``add_peer`` (engines that need none reach a
  peer by its session id alone); a batch to a peer the backend cannot reach ends FAILED.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from concurrent.futures import Future
from types import TracebackType
from typing import Protocol

import attrs

from pdkv.errors.engine import BackendClosedError as BackendClosedError
from pdkv.errors.engine import BatchFailedError as BatchFailedError
from pdkv.errors.engine import BatchTimedOutError as BatchTimedOutError
from pdkv.errors.engine import ForeignHandleError as ForeignHandleError
from pdkv.errors.engine import InvalidBatchError as InvalidBatchError
from pdkv.errors.engine import PeerMetadataError as PeerMetadataError
from pdkv.errors.engine import RegistrationError as RegistrationError
from pdkv.errors.engine import UnregisteredMemoryError as UnregisteredMemoryError
from pdkv.mapping.blocks import TransferBlocks
from pdkv.mapping.layout import TensorLike

# ----------------------------------------------------------------------------------------- errors
# Defined in ``pdkv.errors.engine`` (every pdkv error lives under ``pdkv.errors``), importable here.

# ---------------------------------------------------------------------------------------- records


@attrs.frozen
class MemoryRegion:
    """``length`` bytes starting at ``address`` in this process."""

    address: int
    length: int

    @property
    def end(self) -> int:
        return self.address + self.length


class BatchStatus(enum.Enum):
    COMPLETED = "completed"  # every byte of the batch is at the peer
    FAILED = "failed"  # the engine or peer refused or broke the batch; some bytes may have landed
    TIMED_OUT = "timed_out"  # not finished when the wait gave up; may still be in flight


@attrs.frozen
class EngineVerdict:
    """How a batch ended inside a backend (COMPLETED or FAILED only); stored in the handle's future."""

    status: BatchStatus
    reason: str
    finished_at: float


@attrs.frozen(eq=False)
class BatchHandle:
    """One submitted batch. Compared by identity; only the backend that made it may wait on it."""

    serial: int  # 1-based submission order within the backend
    peer: str
    entries: int
    total_bytes: int
    submitted_at: float  # time.monotonic() at submission
    _owner: object = attrs.field(alias="owner", repr=False)
    _verdict: Future[EngineVerdict] = attrs.field(alias="verdict", repr=False)

    def belongs_to(self, owner: object) -> bool:
        return self._owner is owner

    @property
    def verdict_future(self) -> Future[EngineVerdict]:
        """The backend's completion of this batch (for backend implementations, not callers)."""
        return self._verdict


@attrs.frozen
class BatchOutcome:
    handle: BatchHandle
    status: BatchStatus
    reason: str  # empty when COMPLETED
    seconds: float  # submission to completion; for TIMED_OUT, submission to the end of the wait

    @property
    def ok(self) -> bool:
        return self.status is BatchStatus.COMPLETED


@attrs.frozen
class WaitResult:
    """The outcome of each waited handle, in the order the handles were given."""

    outcomes: tuple[BatchOutcome, ...]

    @property
    def ok(self) -> bool:
        return all(o.status is BatchStatus.COMPLETED for o in self.outcomes)

    @property
    def failed(self) -> tuple[BatchOutcome, ...]:
        return tuple(o for o in self.outcomes if o.status is BatchStatus.FAILED)

    @property
    def timed_out(self) -> tuple[BatchOutcome, ...]:
        return tuple(o for o in self.outcomes if o.status is BatchStatus.TIMED_OUT)

    @property
    def bytes_completed(self) -> int:
        return sum(o.handle.total_bytes for o in self.outcomes if o.status is BatchStatus.COMPLETED)

    def raise_for_status(self) -> None:
        """Raise for the first outcome that is not COMPLETED (FAILED before TIMED_OUT)."""
        for outcome in self.failed:
            raise BatchFailedError(outcome)
        for outcome in self.timed_out:
            raise BatchTimedOutError(outcome)


@attrs.frozen(kw_only=True)
class BackendStatistics:
    batches_submitted: int
    batches_completed: int
    batches_failed: int
    batches_in_flight: int  # submitted and not yet finished inside the backend
    batches_unwaited: int  # submitted, and no wait has yet returned their end state (COMPLETED/FAILED)
    bytes_completed: int
    registrations: int


# ----------------------------------------------------------------------------------- registration


class RegistrationOwner(Protocol):
    def unregister(self, registration: Registration) -> None: ...


class Registration:
    """A registered region; unregisters on ``close()`` / leaving ``with``. Keeps its memory alive.

    Not a record: it has a lifecycle. ``keepalive`` is the object that owns the memory (a tensor, an
    array); holding it here guarantees the memory cannot be freed while the engine may touch it.
    """

    __slots__ = ("_closed", "_keepalive", "_owner", "region")

    def __init__(self, owner: RegistrationOwner, region: MemoryRegion, keepalive: object) -> None:
        self.region = region
        self._owner = owner
        self._keepalive: object | None = keepalive
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def belongs_to(self, owner: object) -> bool:
        return self._owner is owner

    def close(self) -> None:
        """Unregister (idempotent)."""
        if not self._closed:
            self._owner.unregister(self)

    def mark_closed(self) -> None:
        """Called by the owning backend once the engine has forgotten the region."""
        self._closed = True
        self._keepalive = None

    def __enter__(self) -> Registration:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"Registration({self.region.address:#x}+{self.region.length}, {state})"


# --------------------------------------------------------------------------------------- protocol


class TransferBackend(Protocol):
    """Writes byte ranges from this process's registered memory into a peer's registered memory."""

    @property
    def session_id(self) -> str:
        """What peers pass as ``peer`` to reach this backend (sent to them over the control plane)."""
        ...

    @property
    def max_entries_in_flight(self) -> int:
        """Most blocks kept in flight towards one peer; larger batches are split and queued."""
        ...

    @property
    def engine_metadata(self) -> bytes:
        """What a peer needs, beside ``session_id``, to write into this backend's registered memory
        (NIXL: its agent's metadata and the regions registered so far); ``b""`` for engines that need
        nothing (Mooncake, loopback). Sent to peers in the registration exchange (``Register``); read
        it after registering the memory peers will write into."""
        ...

    def add_peer(self, session: str, metadata: bytes) -> None:
        """Learn how to reach the peer ``session`` from the ``engine_metadata`` it sent (again after a
        re-registration: the newest metadata replaces the older). A no-op for engines that need none.
        Raises ``PeerMetadataError`` for metadata this engine cannot use (nothing changes then)."""
        ...

    def register(self, memory: TensorLike) -> Registration:
        """Register a tensor-like object's storage (kept alive until the registration closes)."""
        ...

    def register_range(self, address: int, length: int, *, keepalive: object = None) -> Registration:
        """Register raw memory; ``keepalive`` (optional) is held until the registration closes."""
        ...

    def unregister(self, registration: Registration) -> None:
        """Unregister (idempotent for this backend's registrations)."""
        ...

    def submit_write(self, peer: str, batch: TransferBlocks) -> BatchHandle:
        """Start writing ``batch`` (local ``src`` -> peer ``dst``); never blocks on the network.

        The batch's arrays are read until the batch finishes: do not mutate them meanwhile.
        """
        ...

    def wait(self, handles: Sequence[BatchHandle], timeout: float | None = None) -> WaitResult:
        """Wait until every handle finished or ``timeout`` seconds passed (None: no limit)."""
        ...

    def write_outcome(
        self, peer: str, batch: TransferBlocks, *, timeout: float | None = None
    ) -> BatchOutcome:
        """Submit and wait (``wait``'s ``timeout``); the outcome, whatever it is. A backend may move
        a small batch on the calling thread here, without its own threads: ``submit_write`` then
        ``wait`` is always a correct implementation. A TIMED_OUT batch may still write: wait for its
        handle before the memory is reused."""
        ...

    def write(self, peer: str, batch: TransferBlocks, *, timeout: float | None = None) -> BatchOutcome:
        """``write_outcome``; raises ``BatchFailedError`` / ``BatchTimedOutError`` unless COMPLETED."""
        ...

    def statistics(self) -> BackendStatistics: ...

    def cut_connections_from(self, host: str) -> int:
        """End every engine connection ``host`` holds to this backend, so that no byte a write from
        ``host`` sent before the call can still land here; returns how many were cut. Raises
        ``ConnectionCutUnavailableError`` (``pdkv.engine.sockets``) when that cannot be done here (nothing
        was cut). A backend whose writes cannot outlive their reported end (loopback) cuts nothing."""
        ...

    def close(self) -> None:
        """Wait for every submitted batch, unregister everything, release the engine (idempotent)."""
        ...

    def __enter__(self) -> TransferBackend: ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...
