"""Machinery shared by backends whose engine calls block: registration table, handles, peer lanes.

Owns: ``WorkerThreadBackend`` (an abstract base implementing the whole ``TransferBackend`` contract
around a few engine hooks), ``RegionTable`` (vectorised "is this range registered" check) and the
per-peer lanes that split, queue, launch and complete batches. Must not import an engine module:
subclasses bring the engine.

Threads: ``submit_write`` validates on the caller's thread, splits the batch into pieces of at most
``max_entries_in_flight`` entries and queues them on the peer's lane. Each peer has one lane with
two threads: a launcher that starts pieces in order while the peer's entry budget allows
(``_launch``, expected to return quickly) and a completer that waits for launched pieces in the same
order (``_complete``, which may block). When the lane is idle (nothing queued, no launch under way,
budget free) and has launched towards the peer before (so the engine's first-contact handshake is
behind it), the submitting thread launches the batch's first piece itself: one thread hand-off less
on the latency of a small batch. Launches stay in submission order either way: only one launch is
under way per lane at any time. The same on the other end: a thread that waits for a one-piece batch
whose piece is next in line while the completer is idle completes it itself (``wait``), when its own
timeout is at least the engine's bound on that completion (``_completion_bound_s``), so a wait never
outlasts the timeout it was given; the completer leaves a piece launched inline to its submitter for
``inline_hold_s``, as that thread is usually on its way to wait for it, and is not woken for it: its
alarm is set for the end of the hold and the submitter's claim turns it off
(``pdkv.engine._alarm``), so a piece its submitter completes costs the completer no wake-up, and one
it does not come for is taken when the hold ends. Completions stay in launch order: one at a time.
``write_outcome`` (submit and wait in one call) goes further for a batch that is one piece: on an
idle lane that has reached the peer, with the engine's bound within its timeout, the caller takes
the lane, launches and completes the piece itself and gives the lane back (``_PeerLane.reserve_here``
and ``run_here``): no hold, no alarm, no claim; pieces queued meanwhile wait behind it, in order.
One waiting thread per peer matters: Mooncake's status call spins while it waits, so one waiter per
batch in flight would burn a core each. Pieces of a batch after a failed one are not launched;
pieces already launched are still waited for, so no engine batch is ever left unwaited. Neither
thread dies on an exception: it becomes the batch's FAILED reason. Lanes are created on first use of
a peer and retire after ``lane_idle_s`` without work (a peer that went away, a decode rank that
restarted under a new session: their threads do not pile up); a later batch to the same peer starts
a new lane.
"""

from __future__ import annotations

import abc
import bisect
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from types import TracebackType
from typing import Generic, Self, TypeVar

import attrs
import numpy as np

from pdkv.engine._alarm import new_alarm
from pdkv.engine.backend import (
    BackendClosedError,
    BackendStatistics,
    BatchHandle,
    BatchOutcome,
    BatchStatus,
    EngineVerdict,
    ForeignHandleError,
    InvalidBatchError,
    MemoryRegion,
    Registration,
    RegistrationError,
    UnregisteredMemoryError,
    WaitResult,
)
from pdkv.mapping._arrays import SMALL_ARRAY, all_true
from pdkv.mapping.blocks import IntArray, TransferBlocks
from pdkv.mapping.layout import TensorLike


@attrs.frozen
class RegionSnapshot:
    """Non-overlapping byte ranges ``[starts[i], ends[i])``, sorted by start: what a block array is
    checked against (this backend's registrations, or the regions a peer announced)."""

    starts: IntArray
    ends: IntArray
    _start_list: list[int] = attrs.field(init=False, repr=False, eq=False)
    _end_list: list[int] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        # The same ranges as lists, for the short block arrays of small rooms: a bisect per block
        # there costs less than numpy's fixed cost per call (``SMALL_ARRAY``).
        object.__setattr__(self, "_start_list", self.starts.tolist())
        object.__setattr__(self, "_end_list", self.ends.tolist())

    @classmethod
    def of(cls, ranges: Iterable[tuple[int, int]]) -> RegionSnapshot:
        """From (start, end) pairs, in any order (they must not overlap)."""
        ordered = sorted(ranges)
        return cls(
            starts=np.array([start for start, _ in ordered], dtype=np.int64),
            ends=np.array([end for _, end in ordered], dtype=np.int64),
        )

    def first_outside(self, addresses: IntArray, lengths: IntArray) -> int:
        """Index of the first block not inside one range (-1: all inside). Zero-length blocks touch no
        memory and are never outside."""
        if addresses.size == 0:
            return -1
        if self.starts.size == 0:
            nonzero = np.flatnonzero(lengths > 0)
            return int(nonzero[0]) if nonzero.size else -1
        if addresses.size <= SMALL_ARRAY:
            return self._first_outside_short(addresses.tolist(), lengths.tolist())
        # Ranges do not overlap, so the only candidate is the last one starting at or before addr.
        slot = np.searchsorted(self.starts, addresses, side="right") - 1
        inside = (slot >= 0) & (addresses + lengths <= self.ends[np.maximum(slot, 0)])
        if all_true(inside):  # the usual answer: no need to look at zero-length blocks
            return -1
        bad = np.flatnonzero(~inside & (lengths > 0))
        return int(bad[0]) if bad.size else -1

    def _first_outside_short(self, addresses: list[int], lengths: list[int]) -> int:
        """``first_outside`` of a few blocks, block by block (the same rule)."""
        starts, ends = self._start_list, self._end_list
        for index, (address, length) in enumerate(zip(addresses, lengths, strict=True)):
            slot = bisect.bisect_right(starts, address) - 1
            if length > 0 and (slot < 0 or address + length > ends[slot]):
                return index
        return -1


class RegionTable:
    """Non-overlapping registered regions, checked against whole block arrays at once.

    Writers (register/unregister) hold the owner's registry lock; readers take the current snapshot,
    which is replaced, never mutated, so the hot path needs no lock.
    """

    def __init__(self) -> None:
        self._by_address: dict[int, Registration] = {}
        self._snapshot = RegionSnapshot.of(())

    def __len__(self) -> int:
        return len(self._by_address)

    def registrations(self) -> list[Registration]:
        return list(self._by_address.values())

    def overlapping(self, region: MemoryRegion) -> MemoryRegion | None:
        """An existing region that shares a byte with ``region``, if any."""
        for existing in self._by_address.values():
            other = existing.region
            if other.address < region.end and region.address < other.end:
                return other
        return None

    def add(self, registration: Registration) -> None:
        self._by_address[registration.region.address] = registration
        self._rebuild()

    def remove(self, registration: Registration) -> None:
        if self._by_address.get(registration.region.address) is registration:
            del self._by_address[registration.region.address]
            self._rebuild()

    def first_outside(self, addresses: IntArray, lengths: IntArray) -> int:
        """Index of the first block not inside one registered region (-1: all inside)."""
        return self._snapshot.first_outside(addresses, lengths)

    def snapshot(self) -> RegionSnapshot:
        """The registered regions now (replaced, never mutated, on each change)."""
        return self._snapshot

    def _rebuild(self) -> None:
        self._snapshot = RegionSnapshot.of(
            (r.region.address, r.region.end) for r in self._by_address.values()
        )


class PieceFailed(Exception):
    """Raised by ``_launch`` / ``_complete``: the piece did not land, for the reason given."""


class _BatchProgress:
    """How far the pieces of one batch got; the batch ends when every piece ended or was skipped."""

    def __init__(self, handle: BatchHandle, pieces: int) -> None:
        self.handle = handle
        self.pieces = pieces
        self.ended = 0
        self.failure: str | None = None
        self.lock = threading.Lock()

    def piece_ended(self, index: int, failure: str | None) -> bool:
        """Record one piece; True when this was the batch's last one."""
        with self.lock:
            if failure is not None and self.failure is None:
                where = f" (engine submission {index + 1} of {self.pieces})" if self.pieces > 1 else ""
                self.failure = failure + where
            self.ended += 1
            return self.ended == self.pieces


@attrs.frozen(eq=False)
class PieceJob:
    """One engine submission: ``piece`` is part ``index`` (0-based) of ``count`` parts of ``handle``."""

    handle: BatchHandle
    piece: TransferBlocks
    index: int
    count: int
    progress: _BatchProgress


Token = TypeVar("Token")


class _PeerLane(Generic[Token]):
    """The launcher and completer threads of one peer, and that peer's entry budget."""

    def __init__(self, backend: WorkerThreadBackend[Token], peer: str, budget: int) -> None:
        self._backend = backend
        self.peer = peer
        self._budget = budget
        self._used = 0
        self._queued: deque[PieceJob] = deque()
        self._launched: deque[tuple[PieceJob, Token]] = deque()
        # One lock; the launcher waits on ``_changed``, the completer on its alarm. Each is woken only
        # when it has something to do: a thread woken for nothing still takes the interpreter lock
        # from the thread that reports a batch, in the middle of its status send. The completer's
        # alarm is set for the end of a hold without waking it (``pdkv.engine._alarm``).
        lock = threading.Lock()
        self._changed = threading.Condition(lock)
        self._alarm = new_alarm(lock)
        self._stopping = False
        self._launcher_done = False
        self._launching = False  # a piece taken off the queue (or reserved inline) is being launched
        self._completing = False  # a launched piece is being completed (by the completer or a waiter)
        # A piece its submitter launched inline is left to that thread's wait for a moment: it is
        # usually on its way there (see WorkerThreadBackend.inline_hold_s). While ``_held`` is set
        # the piece is still in ``_launched``: whoever takes it (a claim, the completer) clears it.
        self._held: PieceJob | None = None
        self._held_until = 0.0
        self._contacted = False  # a launch towards this peer succeeded: inline launches are allowed
        name = f"{backend.thread_name}-{peer}"
        self._threads = (
            threading.Thread(target=self._launch_loop, name=f"{name}-launch", daemon=True),
            threading.Thread(target=self._complete_loop, name=f"{name}-complete", daemon=True),
        )
        for thread in self._threads:
            thread.start()

    def put(self, jobs: list[PieceJob], *, inline: bool = False) -> PieceJob | None:
        """Queue ``jobs``; with ``inline``, reserve the first one for the caller to launch when the
        lane is idle (returned: the caller must pass it to ``launch_reserved`` at once)."""
        with self._changed:
            idle = not self._queued and not self._launching and not self._stopping
            if inline and idle and self._contacted and self._used + len(jobs[0].piece) <= self._budget:
                self._launching = True
                self._used += len(jobs[0].piece)
                self._queued.extend(jobs[1:])
                return jobs[0]
            self._queued.extend(jobs)
            self._changed.notify_all()
            return None

    def launch_reserved(self, job: PieceJob) -> None:
        """Launch a piece ``put`` reserved, on the caller's thread."""
        self._launch_one(job, inline=True)

    def reserve_here(self, entries: int) -> bool:
        """Take the lane for one piece its caller launches and completes itself (``run_here``): only
        when it is idle (nothing queued, launching, launched or completing), has reached the peer
        before, and the budget holds ``entries``. Pieces queued meanwhile wait for it, in order."""
        with self._changed:
            if (
                self._queued
                or self._launching
                or self._launched
                or self._completing
                or self._stopping
                or not self._contacted
                or self._used + entries > self._budget
            ):
                return False
            self._launching = self._completing = True  # neither lane thread touches the lane now
            self._used += entries
            return True

    def run_here(self, job: PieceJob) -> str | None:
        """Launch and complete a piece ``reserve_here`` took the lane for, on the caller's thread; its
        failure, or None when it landed. The lane is released whatever happens."""
        try:
            try:
                token = self._backend._launch(job)
            except PieceFailed as exc:
                return str(exc)
            except Exception as exc:  # an engine bug fails the batch, not the lane
                return f"backend error while launching: {exc!r}"
            finally:
                with self._changed:
                    self._launching = False  # what was queued meanwhile may launch (after this one)
                    if self._queued:
                        self._changed.notify_all()
            return self._completion_failure(job, token)
        finally:
            with self._changed:
                self._completing = False
                self._used -= len(job.piece)
                if self._launched or self._launcher_done:  # launched meanwhile, or the end
                    self._alarm.ring()
                if self._queued:  # the launcher may be waiting for these entries
                    self._changed.notify_all()

    def idle(self) -> bool:
        """Nothing queued, launching, launched or holding budget (``_changed`` held)."""
        return (
            not self._queued
            and not self._launching
            and not self._launched
            and not self._completing
            and self._used == 0
        )

    def retire(self) -> None:
        """End both threads of an idle lane (``_changed`` held; the backend removed it from its table)."""
        self._stopping = True
        self._changed.notify_all()
        self._alarm.ring()

    @property
    def completer_wakes(self) -> int:
        """How often the completer thread woke up so far (the needless times included)."""
        with self._changed:
            return self._alarm.wakes

    def stop(self) -> None:
        """Launch and complete everything already queued, then end both threads."""
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
            self._alarm.ring()
        for thread in self._threads:
            thread.join()

    def _launch_loop(self) -> None:
        while True:
            with self._changed:
                # An inline launch under way ends first (order), even when stopping: the completer
                # must not end before that piece is in ``_launched``.
                timed_out = False
                while self._launching or (not self._queued and not self._stopping):
                    if not self._changed.wait(self._backend.lane_idle_s) and self.idle():
                        timed_out = True
                        break
                if timed_out:
                    job = None
                elif not self._queued:
                    self._launcher_done = True
                    self._alarm.ring()
                    return
                else:
                    job = self._queued[0]
                    # Pieces never exceed the budget and the completer gives entries back without
                    # needing this thread, so this wait always ends.
                    while self._used + len(job.piece) > self._budget:
                        self._changed.wait()
                    self._queued.popleft()
                    self._used += len(job.piece)
                    self._launching = True
            if job is None:
                # Idle for lane_idle_s: the backend retires the lane if it is still idle (its lock
                # comes before ``_changed``, so this is asked outside it); then the loop ends above.
                self._backend._retire_lane(self)
                continue
            self._launch_one(job)

    def _launch_one(self, job: PieceJob, *, inline: bool = False) -> None:
        """Launch a piece taken off the queue (``_launching`` set, budget taken); clears ``_launching``."""
        token: Token | None = None
        failure: str | None = None
        if job.progress.failure is None:  # else an earlier piece failed: do not send the rest
            try:
                token = self._backend._launch(job)
            except PieceFailed as exc:
                failure = str(exc)
            except Exception as exc:  # an engine bug must fail the batch, not the lane
                failure = f"backend error while launching: {exc!r}"
        with self._changed:
            self._launching = False
            if token is not None:
                self._contacted = True
                self._launched.append((job, token))
                if inline and job.count == 1:
                    earlier, self._held = self._held, job
                    self._held_until = time.monotonic() + self._backend.inline_hold_s
                    if earlier is not None:
                        self._alarm.ring()  # held no longer (one hold per lane): the completer takes it
                    else:
                        # Its submitter is usually on its way to complete it (``claim``): the completer
                        # is not woken for it, unless the hold ends first.
                        self._alarm.ring_at(self._held_until)
                else:
                    self._alarm.ring()
            if self._queued or self._stopping:  # else the launcher has nothing to do
                self._changed.notify_all()
        if token is None:
            self._ended(job, failure)

    def _complete_loop(self) -> None:
        while True:
            with self._changed:
                # A completion claimed by a waiter ends first (order), even when stopping: close()
                # must not unregister memory under it.
                while True:
                    # What happened while this thread was awake needs no alarm: it is read here.
                    if self._completing or (not self._launched and not self._launcher_done):
                        self._alarm.sleep()  # rung when there is a piece or the end
                        continue
                    if not self._launched:
                        self._alarm.close()
                        return
                    left = self._held_until - time.monotonic()
                    if self._held is self._launched[0][0] and left > 0 and not self._stopping:
                        self._alarm.sleep(until=self._held_until)  # its submitter may claim it meanwhile
                        continue
                    break
                job, token = self._launched.popleft()
                self._held = None
                self._completing = True
            self._complete_one(job, token)

    def claim(self, handle: BatchHandle) -> tuple[PieceJob, Token] | None:
        """``handle``'s piece, for the caller to complete with ``complete_claimed`` at once, when it
        is the batch's only piece, next in launch order, and the completer is idle; else None."""
        with self._changed:
            if self._completing or not self._launched:
                return None
            job, token = self._launched[0]
            if job.handle is not handle or job.count != 1:
                return None
            self._launched.popleft()
            self._held = None
            self._completing = True
            # The completer has nothing to do until this completion ends (it rings then if pieces
            # wait): the end of the hold must not wake it.
            self._alarm.disarm()
            return job, token

    def complete_claimed(self, job: PieceJob, token: Token) -> None:
        """Complete a piece ``claim`` returned, on the caller's thread."""
        self._complete_one(job, token)

    def _completion_failure(self, job: PieceJob, token: Token) -> str | None:
        """Wait for a launched piece (the backend's ``_complete``): its failure, None when it landed."""
        try:
            self._backend._complete(job, token)
        except PieceFailed as exc:
            return str(exc)
        except Exception as exc:  # an engine bug fails the batch, not the lane
            return f"backend error while completing: {exc!r}"
        return None

    def _complete_one(self, job: PieceJob, token: Token) -> None:
        """Wait for a launched piece (``_completing`` set by the taker); clears ``_completing``."""
        failure = self._completion_failure(job, token)
        with self._changed:
            self._completing = False
            if self._launched or self._launcher_done:  # what waited behind this one, or the end
                self._alarm.ring()
        self._ended(job, failure)

    def _ended(self, job: PieceJob, failure: str | None) -> None:
        with self._changed:
            self._used -= len(job.piece)
            if self._queued:  # the launcher may be waiting for these entries
                self._changed.notify_all()
        if job.progress.piece_ended(job.index, failure):
            reason = job.progress.failure
            status = BatchStatus.COMPLETED if reason is None else BatchStatus.FAILED
            self._backend._finish(job.handle, status, reason or "")


class WorkerThreadBackend(abc.ABC, Generic[Token]):
    """A ``TransferBackend`` around an engine whose calls block; subclasses supply the engine hooks."""

    def __init__(
        self,
        *,
        max_entries_in_flight: int,
        thread_name: str,
        clock: Callable[[], float] = time.monotonic,
        lane_idle_s: float = 60.0,
    ) -> None:
        if max_entries_in_flight <= 0:
            raise ValueError(f"max_entries_in_flight must be positive, got {max_entries_in_flight}")
        self._max_entries = max_entries_in_flight
        self.thread_name = thread_name  # prefix of its lane threads
        self._clock = clock
        self._lock = threading.Lock()  # lanes, batches, counters, closed flag
        self._registry_lock = threading.Lock()  # registrations (engine registration may be slow)
        self._regions = RegionTable()
        self._lanes: dict[str, _PeerLane[Token]] = {}
        self.lane_idle_s = lane_idle_s
        """A peer's lane retires (its two threads end) after this long without work."""
        self.inline_hold_s = 0.0005
        """How long the completer leaves a one-piece batch launched inline to its submitter, which
        usually waits for it next and then completes it itself (``wait``): past this, the completer
        takes it (a submitter that does other work first loses no more than this). The completer
        sleeps through the hold; it wakes at its end only if the batch is still there."""
        self._closed = False
        self._serial = 0
        self._unwaited: dict[int, BatchHandle] = {}
        self._in_flight = 0
        self._completed = 0
        self._failed = 0
        self._bytes_completed = 0

    # ------------------------------------------------------------------ hooks for the engine

    @property
    @abc.abstractmethod
    def session_id(self) -> str: ...

    @abc.abstractmethod
    def _engine_register(self, region: MemoryRegion) -> None:
        """Make ``region`` known to the engine; raise ``RegistrationError`` if it refuses."""

    @abc.abstractmethod
    def _engine_unregister(self, region: MemoryRegion) -> None:
        """Forget ``region``; raise ``RegistrationError`` if the engine refuses."""

    @abc.abstractmethod
    def _launch(self, job: PieceJob) -> Token:
        """Start one piece (lane launcher thread); raise ``PieceFailed`` if the engine refuses it."""

    @abc.abstractmethod
    def _complete(self, job: PieceJob, token: Token) -> None:
        """Wait until a launched piece ended (lane completer thread); ``PieceFailed`` if it failed."""

    def _inline_launch_allowed(self, piece: TransferBlocks) -> bool:
        """Whether the submitting thread may launch ``piece`` itself (an engine whose launch does the
        whole copy, as NIXL's cma transport does, allows it only for small pieces: ``submit_write``
        never waits for a long transfer)."""
        return True

    def _completes_within(self, total_bytes: int, timeout: float | None) -> bool:
        """Whether a waiter with ``timeout`` may complete a batch of ``total_bytes`` itself: the
        engine's bound on it (``_completion_bound_s``) fits, a negative or NaN timeout taken as 0 as
        ``wait`` takes it (so never)."""
        if timeout is None:
            return True
        bound = self._completion_bound_s(total_bytes)
        return bound is not None and bound <= max(0.0, timeout)

    def _completion_bound_s(self, total_bytes: int) -> float | None:
        """The longest ``_complete`` can block for a batch of ``total_bytes`` (the engine's own
        timeout), or None when nothing bounds it: then no waiter with a timeout completes a piece
        itself."""
        return None

    @abc.abstractmethod
    def _engine_close(self) -> None:
        """Release the engine; called once, after every batch ended and every region was unregistered."""

    # ------------------------------------------------------------------------- registration

    @property
    def max_entries_in_flight(self) -> int:
        return self._max_entries

    def register(self, memory: TensorLike) -> Registration:
        is_contiguous = getattr(memory, "is_contiguous", None)
        if callable(is_contiguous) and not is_contiguous():
            raise RegistrationError("cannot register a non-contiguous tensor: its bytes are not one range")
        length = memory.numel() * memory.element_size()
        return self.register_range(memory.data_ptr(), length, keepalive=memory)

    def register_range(self, address: int, length: int, *, keepalive: object = None) -> Registration:
        if address <= 0 or length <= 0:
            raise RegistrationError(f"cannot register address {address:#x} length {length}: both must be > 0")
        region = MemoryRegion(address, length)
        with self._registry_lock:
            if self._closed:
                raise BackendClosedError(f"backend {self.session_id} is closed")
            clash = self._regions.overlapping(region)
            if clash is not None:
                raise RegistrationError(
                    f"region {address:#x}+{length} overlaps the registered region "
                    f"{clash.address:#x}+{clash.length}"
                )
            self._engine_register(region)
            registration = Registration(self, region, keepalive)
            self._regions.add(registration)
        return registration

    def unregister(self, registration: Registration) -> None:
        if not registration.belongs_to(self):
            raise ForeignHandleError(f"{registration!r} was not made by backend {self.session_id}")
        with self._registry_lock:
            self._unregister_locked(registration)

    def _unregister_locked(self, registration: Registration) -> None:
        if registration.closed:
            return
        # Out of the table first: from now on no new batch can name this memory as its source.
        self._regions.remove(registration)
        try:
            self._engine_unregister(registration.region)
        finally:
            registration.mark_closed()

    # ------------------------------------------------------------------------------ batches

    def _check_batch(self, peer: str, batch: TransferBlocks) -> None:
        """The caller's mistakes, refused before anything is submitted."""
        if not isinstance(peer, str) or not peer:
            raise InvalidBatchError(f"peer must be a non-empty session id, got {peer!r}")
        outside = self._regions.first_outside(batch.src, batch.length)
        if outside >= 0:
            address, length = int(batch.src[outside]), int(batch.length[outside])
            raise UnregisteredMemoryError(
                f"block {outside} of {len(batch)}: source {address:#x}+{length} is not inside any region "
                f"registered with backend {self.session_id} ({len(self._regions)} registered)",
                block=outside,
                address=address,
                length=length,
            )

    def write_outcome(
        self, peer: str, batch: TransferBlocks, *, timeout: float | None = None
    ) -> BatchOutcome:
        """Submit ``batch`` and wait for it, on this thread when it can be (``_write_here``), else as
        ``submit_write`` then ``wait``; its outcome, whatever it is."""
        self._check_batch(peer, batch)
        here = self._write_here(peer, batch, timeout)
        if here is not None:
            return here
        return self.wait([self._submit(peer, batch)], timeout).outcomes[0]

    def write(self, peer: str, batch: TransferBlocks, *, timeout: float | None = None) -> BatchOutcome:
        outcome = self.write_outcome(peer, batch, timeout=timeout)
        WaitResult((outcome,)).raise_for_status()
        return outcome

    def _write_here(self, peer: str, batch: TransferBlocks, timeout: float | None) -> BatchOutcome | None:
        """``write_outcome`` with neither lane thread: the caller launches and completes the batch
        itself, no hold, no alarm, no hand-over of the piece (``_PeerLane.run_here``). Only for one
        engine submission of non-empty blocks that the calling thread may launch, to a peer whose lane
        is idle and has reached it before, when the engine's bound on the completion fits
        ``timeout`` (a write never outlasts its timeout). None, with nothing submitted, otherwise
        (``_check_batch`` passed)."""
        entries = len(batch)
        if not 0 < entries <= self._max_entries:
            return None
        if not all_true(batch.length) or not self._inline_launch_allowed(batch):
            return None
        if not self._completes_within(batch.total_bytes, timeout):
            return None
        with self._lock:
            if self._closed:
                raise BackendClosedError(f"backend {self.session_id} is closed")
            lane = self._lanes.get(peer)
            # Inside the lock, as in submit_write: close() cannot stop the lane before it is taken.
            if lane is None or not lane.reserve_here(entries):
                return None
            handle = self._new_handle(peer, batch, Future())
        failure = lane.run_here(PieceJob(handle, batch, 0, 1, _BatchProgress(handle, 1)))
        status = BatchStatus.COMPLETED if failure is None else BatchStatus.FAILED
        self._finish(handle, status, failure or "")
        finished_at = handle.verdict_future.result().finished_at
        return BatchOutcome(handle, status, failure or "", finished_at - handle.submitted_at)

    def submit_write(self, peer: str, batch: TransferBlocks) -> BatchHandle:
        self._check_batch(peer, batch)
        return self._submit(peer, batch)

    def _submit(self, peer: str, batch: TransferBlocks) -> BatchHandle:
        """``submit_write`` once ``_check_batch`` passed."""
        moving = batch
        # TransferBlocks lengths are never negative, so "all non-zero" (one reduction, no temporary
        # array) is "all positive".
        if len(batch) and not all_true(batch.length):
            moving = batch.take(np.flatnonzero(batch.length > 0))
        if len(moving) <= self._max_entries:
            pieces = [moving] if len(moving) else []  # one engine submission: no copy of the lists
        else:
            pieces = [
                moving.take(slice(start, start + self._max_entries))
                for start in range(0, len(moving), self._max_entries)
            ]
        verdict: Future[EngineVerdict] = Future()
        reserved: tuple[_PeerLane[Token], PieceJob] | None = None
        with self._lock:
            if self._closed:
                raise BackendClosedError(f"backend {self.session_id} is closed")
            handle = self._new_handle(peer, batch, verdict)
            self._unwaited[handle.serial] = handle
            if pieces:
                # Inside the lock so that close() cannot stop the lanes between the check and here.
                lane = self._lanes.get(peer)
                if lane is None:
                    lane = self._lanes[peer] = _PeerLane(self, peer, self._max_entries)
                progress = _BatchProgress(handle, len(pieces))
                first = lane.put(
                    [PieceJob(handle, piece, i, len(pieces), progress) for i, piece in enumerate(pieces)],
                    inline=self._inline_launch_allowed(pieces[0]),
                )
                if first is not None:
                    reserved = (lane, first)
        if not pieces:
            self._finish(handle, BatchStatus.COMPLETED, "")
        elif reserved is not None:
            # Outside the backend lock (completers take it to finish batches); close() waits for
            # this launch because the lane's launcher does not end while one is under way.
            reserved[0].launch_reserved(reserved[1])
        return handle

    def _new_handle(self, peer: str, batch: TransferBlocks, verdict: Future[EngineVerdict]) -> BatchHandle:
        """The next batch's handle, counted in flight (``_lock`` held)."""
        self._serial += 1
        self._in_flight += 1
        return BatchHandle(
            serial=self._serial,
            peer=peer,
            entries=len(batch),
            total_bytes=batch.total_bytes,
            submitted_at=self._clock(),
            owner=self,
            verdict=verdict,
        )

    def _finish(self, handle: BatchHandle, status: BatchStatus, reason: str) -> None:
        # Counters first, then the future: whoever wakes on the future sees consistent statistics.
        with self._lock:
            self._in_flight -= 1
            if status is BatchStatus.COMPLETED:
                self._completed += 1
                self._bytes_completed += handle.total_bytes
            else:
                self._failed += 1
        handle.verdict_future.set_result(EngineVerdict(status, reason, self._clock()))

    def wait(self, handles: Sequence[BatchHandle], timeout: float | None = None) -> WaitResult:
        for handle in handles:
            if not handle.belongs_to(self):
                raise ForeignHandleError(
                    f"batch {handle.serial} was not submitted to backend {self.session_id}"
                )
        if timeout is not None:
            timeout = max(0.0, timeout)
        if len(handles) == 1 and timeout != 0.0:
            self._complete_inline(handles[0], timeout)
        futures = [h.verdict_future for h in handles]
        if not all(f.done() for f in futures):  # (usual for one small batch: completed just above)
            wait_futures(futures, timeout=timeout)
        now = self._clock()
        outcomes: list[BatchOutcome] = []
        collected: list[int] = []
        for handle in handles:
            future = handle.verdict_future
            if future.done():
                verdict = future.result()
                seconds = verdict.finished_at - handle.submitted_at
                outcomes.append(BatchOutcome(handle, verdict.status, verdict.reason, seconds))
                collected.append(handle.serial)
            else:
                outcomes.append(
                    BatchOutcome(
                        handle,
                        BatchStatus.TIMED_OUT,
                        f"not finished after waiting {timeout:.3g} s; it may still be in flight",
                        now - handle.submitted_at,
                    )
                )
        with self._lock:
            for serial in collected:
                self._unwaited.pop(serial, None)
        return WaitResult(tuple(outcomes))

    def _complete_inline(self, handle: BatchHandle, timeout: float | None) -> None:
        """Complete ``handle``'s piece on this thread when its lane lets us (``_PeerLane.claim``) and
        the engine's bound on it fits in ``timeout``: one thread hand-off less on a small batch."""
        if handle.verdict_future.done() or not self._completes_within(handle.total_bytes, timeout):
            return
        with self._lock:
            lane = self._lanes.get(handle.peer)
        claimed = lane.claim(handle) if lane is not None else None
        if claimed is not None and lane is not None:
            lane.complete_claimed(*claimed)

    def _retire_lane(self, lane: _PeerLane[Token]) -> None:
        """A lane's launcher found it idle: drop it from the table and end its threads, unless a
        batch came in meanwhile (submissions hold ``_lock`` while they queue on a lane)."""
        with self._lock, lane._changed:
            if lane.idle() and not lane._stopping and self._lanes.get(lane.peer) is lane:
                del self._lanes[lane.peer]
                lane.retire()

    def lanes(self) -> int:
        """Peer lanes alive now (each two threads)."""
        with self._lock:
            return len(self._lanes)

    @property
    def engine_metadata(self) -> bytes:
        """Nothing by default: a peer reaches this backend by its session id alone."""
        return b""

    def add_peer(self, session: str, metadata: bytes) -> None:
        """Nothing to learn by default (engines that reach a peer by its session id alone)."""

    def cut_connections_from(self, host: str) -> int:
        """Nothing to cut by default: a backend whose writes end when reported (loopback copies in this
        process) has no connection whose bytes could land later. Engines with sockets override it."""
        return 0

    def statistics(self) -> BackendStatistics:
        with self._lock:
            return BackendStatistics(
                batches_submitted=self._serial,
                batches_completed=self._completed,
                batches_failed=self._failed,
                batches_in_flight=self._in_flight,
                batches_unwaited=len(self._unwaited),
                bytes_completed=self._bytes_completed,
                registrations=len(self._regions),
            )

    # ------------------------------------------------------------------------------ closing

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # Every submitted batch ends before any memory is unregistered: unregistering under an
        # in-flight write would let the engine touch memory the caller may already reuse.
        for lane in self._lanes.values():
            lane.stop()
        errors: list[str] = []
        with self._registry_lock:
            for registration in self._regions.registrations():
                try:
                    self._unregister_locked(registration)
                except RegistrationError as exc:
                    errors.append(str(exc))
        self._engine_close()
        if errors:
            raise RegistrationError(
                f"closing {self.session_id}: {len(errors)} unregistrations failed: {errors}"
            )

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
