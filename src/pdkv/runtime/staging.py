"""Staging pool: registered memory where a write's scattered source bytes are gathered before the engine
moves them as a few large blocks.

Owns: ``StagingConfig`` (capacity, piece size, when staging is worth it, the quarantine bound),
``StagingPool`` (one registered staging tensor on the sources' device, a byte allocator over it, the
copy kernel, the rules that return its memory) and ``StagingLease`` / ``StagingStatistics``. Must not
map pages (``pdkv.mapping.staging`` plans the gather and the staged blocks), talk to peers, know
rooms, or submit to the engine: the executor (``TransferJob.submit``) asks the pool whether a write
is worth staging, leases space for each piece, has it gathered, submits the staged blocks and tells
the pool how each batch ended. Transports only pass a pool to their executor; the protocol core never
sees any of this.

Why: MHA/GQA heads from a prefill rank that holds more heads than its decode rank are one strided
slice per token at the source but whole pages at the destination. Sent as they are, every (token,
head slice) is an engine entry and the engine moves them about 100x slower than the same bytes in
large blocks (``pdkv bench transfer --mha``). Gathered into staging with one copy kernel per source
region on the tensor's device (``torch.index_select``; a device-to-device copy on a GPU), a run of
pages is one block.

Rules the pool keeps:

- Bounded and registered once: one tensor of ``capacity_bytes`` on the sources' device, registered
  with the backend when the pool is built and unregistered by ``close()``. Leases are byte ranges of it
  (first fit, 256-byte aligned); a write is cut into pieces of at most ``piece_bytes`` so that any
  piece fits an empty pool.
- Back-pressure, never a failure for space: a piece that finds no room waits on the pool's condition.
  Every lease in use belongs to a batch in flight (or a piece being gathered), and a lease comes back
  when the backend ends its last batch (the pool follows each batch's verdict itself, so no job has
  to reap another's batches, nor its own while it submits elsewhere). The engine's own timeouts end
  every batch, so they bound the wait; the executor also bounds it by the job's deadline (its
  ``timeout_s``, the inflight deadline of one transfer): a piece still without space then fails its
  job TIMED_OUT, as a batch that did not finish in time would, with nothing of that piece submitted.
  Space that cannot come back soon (quarantined, below) never makes a piece wait: when the pool could
  not hold the piece even with every live lease returned, the piece is sent unstaged instead.
- Returned only when the engine can no longer read it: a lease goes back to the free space once every
  batch submitted from it ended COMPLETED (the bytes are at the peer; the pool reads the end from the
  backend's verdict on the batch, ``watch``) and its piece was sealed (no more batches will be
  submitted from it). A batch that a wait reported TIMED_OUT has not ended: its lease stays. A batch
  that ended FAILED may still be read by the engine after its status (Mooncake's status call gives up
  while its slices stay queued or running: specs/mooncake-tcp-late-writes.md), so its lease is
  quarantined for its peer and comes back only at that peer's drain point: a batch to the same peer
  submitted after the failed one completes (the fence write an AbortAck waits for is such a batch; the
  engine's per-peer queue is FIFO, so every earlier slice has been taken by then). A peer that never
  completes another batch holds its quarantined leases until ``quarantine_s`` passes; then they come
  back unproven (counted, WARNING), the pool's one unsafe release. A batch refused at submission never
  reached the engine: it holds nothing.
- The copy finishes before the engine reads: on a CUDA device the gather runs on the pool's own
  stream and the pool synchronises an event recorded after it before the staged blocks are returned
  for submission; on the CPU the copy is synchronous. The sources must hold the bytes already (as for
  an unstaged write: the engine would read them directly).

``LandingRegions.scatter`` is the other direction's copy (decode TP below prefill TP): the decode's
scatter from a landing zone into its pages (``pdkv.mapping.landing``), the same kind of kernel, run by
the decode's ``pdkv.runtime.landing.LandingPool``.

Thread-safety: one lock (a condition) guards the allocator, the leases and the counters; gathers run
outside it, each into its own lease. Any number of jobs on any threads may share one pool.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Final

import attrs
import numpy as np
import numpy.typing as npt
import torch

from pdkv import config
from pdkv.config import positive_int, positive_seconds
from pdkv.engine.backend import BatchHandle, BatchStatus, EngineVerdict, Registration, TransferBackend
from pdkv.errors import ConfigError
from pdkv.mapping import BufferLayout, TransferBlocks
from pdkv.mapping.landing import ScatterPlan
from pdkv.mapping.staging import (
    NO_REGION,
    StagedPiece,
    StagingSources,
    dst_merge_starts,
    non_empty,
    piece_bounds,
    plan_piece,
    stageable,
)

log = logging.getLogger(__name__)

ALIGNMENT: Final = 256
"""Every lease starts on a multiple of this many bytes (wide copies, GPU-friendly offsets)."""

# Defaults, from `pdkv bench transfer --mha --tp 2 --decode-tp 4` on this 2-core machine (Mooncake TCP,
# 134 MB in 262,144 head slices; specs/mapping.md section 14.5): pieces of 2, 4, 16, 32 MiB gave 0.58x,
# 0.67x, 0.65x, 0.82x the homogeneous path in one loaded sweep, 8 MiB 0.86x (then 0.82x under the
# exclusive lock, best of 3). 128 MiB holds 16 pieces: room for the executor's 4 batches in flight of
# several jobs at once. min_gain 4: whole pages, GQA replicas and fences (nothing merges) stay unstaged.
DEFAULT_CAPACITY_BYTES: Final = 128 << 20
DEFAULT_PIECE_BYTES: Final = 8 << 20
DEFAULT_MIN_GAIN: Final = 4
DEFAULT_QUARANTINE_S: Final = 1200.0
# A CPU gather runs on one thread by default: on this 2-core machine, with the engine's threads and
# other processes busy, torch's 2-thread index_select of 134 MB (8 MiB pieces, or page runs) took 50 to
# 450 ms where one thread took 10 to 56 ms (OpenMP's fork-join waits for a descheduled worker); idle,
# both took about 20 ms. See _copy_threads.
DEFAULT_COPY_THREADS: Final = 1


@attrs.frozen(kw_only=True)
class StagingConfig:
    capacity_bytes: int = attrs.field(
        default=DEFAULT_CAPACITY_BYTES,
        validator=positive_int,
        metadata=config.int_var("PDKV_STAGING_BYTES", "Staging: bytes of registered staging memory per rank"),
    )
    piece_bytes: int = attrs.field(
        default=DEFAULT_PIECE_BYTES,
        validator=positive_int,
        metadata=config.int_var(
            "PDKV_STAGING_PIECE_BYTES", "Staging: most bytes gathered at once (a write is cut into pieces)"
        ),
    )
    min_gain: int = attrs.field(
        default=DEFAULT_MIN_GAIN,
        validator=positive_int,
        metadata=config.int_var(
            "PDKV_STAGING_MIN_GAIN", "Staging: stage a write only when it needs this many times fewer entries"
        ),
    )
    copy_threads: int = attrs.field(
        default=DEFAULT_COPY_THREADS,
        validator=config.non_negative_int,
        metadata=config.int_var(
            "PDKV_STAGING_COPY_THREADS",
            "Staging: OpenMP threads of a CPU gather on its calling thread (0: leave torch's setting)",
        ),
    )
    quarantine_s: float = attrs.field(
        default=DEFAULT_QUARANTINE_S,
        validator=positive_seconds,
        metadata=config.seconds_var(
            "PDKV_STAGING_QUARANTINE_TIMEOUT",
            "Staging: a failed write's staging comes back unproven after this if its peer never drains",
        ),
    )

    def __attrs_post_init__(self) -> None:
        if self.piece_bytes > self.capacity_bytes:
            raise ConfigError(
                f"piece_bytes {self.piece_bytes} exceeds capacity_bytes {self.capacity_bytes}: a piece "
                "would never fit"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> StagingConfig:
        """Defaults, overridden by the ``PDKV_STAGING_*`` variables that are set."""
        return config.from_env(cls, env)


ENV_VARS: Final[Mapping[str, str]] = config.env_vars(StagingConfig)


@attrs.frozen(kw_only=True)
class StagingStatistics:
    capacity_bytes: int
    in_use_bytes: int  # leased to pieces whose batches are in flight (or being gathered)
    quarantined_bytes: int  # leased to failed writes, waiting for their peer's drain point
    peak_in_use_bytes: int
    staged_writes: int  # submit() calls that went through staging
    staged_pieces: int
    staged_bytes: int
    entries_saved: int  # engine entries of the staged writes minus their staged entries (before slicing)
    direct_writes: int  # submit() calls sent unstaged (not worth it, or not readable by the stager)
    direct_pieces: int  # pieces sent unstaged because quarantined space left too little room
    waits: int  # pieces that had to wait for space
    wait_seconds: float
    gather_seconds: float  # time in the copy kernel (synchronised)
    quarantined: int  # leases quarantined after a failed batch
    released_proven: int  # quarantined leases returned at their peer's drain point
    released_unproven: int  # quarantined leases returned after quarantine_s (counted, logged)


class StagingLease:
    """A byte range of the pool given to one piece; the pool's lock guards every field."""

    __slots__ = ("failed", "last_serial", "nbytes", "offset", "peer", "pending", "quarantined_at", "sealed")

    def __init__(self, offset: int, nbytes: int, peer: str) -> None:
        self.offset = offset
        self.nbytes = nbytes
        self.peer = peer
        self.pending = 0  # batches submitted from it that have not ended
        self.sealed = False  # no more batches will be submitted from it
        self.failed = False  # a batch from it ended FAILED: the engine may still read it
        self.last_serial = 0  # the backend's serial of its last submitted batch
        self.quarantined_at: float | None = None

    def __repr__(self) -> str:
        return f"StagingLease({self.offset}+{self.nbytes} -> {self.peer}, pending {self.pending})"


class FreeList:
    """Free byte ranges of a pool (the staging pool's, the landing pool's), sorted by start and never
    adjacent (first-fit allocation)."""

    def __init__(self, capacity: int) -> None:
        self.starts: list[int] = [0]
        self.sizes: list[int] = [capacity]

    def take(self, nbytes: int) -> int | None:
        for i, size in enumerate(self.sizes):  # a handful of ranges: leases are few and large
            if size >= nbytes:
                start = self.starts[i]
                if size == nbytes:
                    del self.starts[i], self.sizes[i]
                else:
                    self.starts[i] += nbytes
                    self.sizes[i] -= nbytes
                return start
        return None

    def give(self, start: int, nbytes: int) -> None:
        i = bisect.bisect_left(self.starts, start)
        self.starts.insert(i, start)
        self.sizes.insert(i, nbytes)
        if i + 1 < len(self.starts) and self.starts[i] + self.sizes[i] == self.starts[i + 1]:
            self.sizes[i] += self.sizes[i + 1]
            del self.starts[i + 1], self.sizes[i + 1]
        if i > 0 and self.starts[i - 1] + self.sizes[i - 1] == self.starts[i]:
            self.sizes[i - 1] += self.sizes[i]
            del self.starts[i], self.sizes[i]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def _widest(*values: int) -> torch.dtype:
    """The widest integer dtype whose size divides every value (lengths and byte offsets)."""
    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if all(v % size == 0 for v in values):
            return dtype
    return torch.uint8


def _openmp() -> Any:
    """The process's OpenMP runtime (torch's libgomp/libiomp), or None when its symbols are not global."""
    try:
        runtime = ctypes.CDLL(None)
        runtime.omp_set_num_threads.argtypes = [ctypes.c_int]
        runtime.omp_get_max_threads.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return runtime


_OPENMP: Final = _openmp()


@contextlib.contextmanager
def _copy_threads(threads: int) -> Iterator[None]:
    """Run torch's CPU ops of the block with ``threads`` OpenMP threads, on this thread only.

    OpenMP's team size is a per-thread setting (``omp_set_num_threads`` changes the calling thread's),
    unlike ``torch.set_num_threads``, which also sets a process-wide default and MKL's thread count.
    ``torch.get_num_threads()`` first, so that torch's lazy per-thread initialisation (which applies
    the process default) has happened and does not undo the setting; restored on the way out.
    0, or no OpenMP runtime found: torch's own setting.
    """
    if threads <= 0 or _OPENMP is None:
        yield
        return
    torch.get_num_threads()
    before = int(_OPENMP.omp_get_max_threads())
    _OPENMP.omp_set_num_threads(threads)
    try:
        yield
    finally:
        _OPENMP.omp_set_num_threads(before)


@attrs.frozen
class _Region:
    flat: torch.Tensor  # the whole storage as uint8
    address: int


class StagingPool:
    """Registered staging memory for one prefill rank's executor (see the module docstring)."""

    def __init__(
        self,
        backend: TransferBackend,
        layout: BufferLayout,
        sources: Sequence[torch.Tensor | None],
        config: StagingConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``sources[i]``: the tensor behind ``layout.buffers[i]`` (None: never staged). Validated
        (``ConfigError`` naming the buffer), then the staging tensor is allocated on the sources' device
        and registered with ``backend``; nothing is left registered if that fails."""
        self.config = config or StagingConfig()
        self._clock = clock
        self._backend = backend
        if len(sources) != len(layout.buffers):
            raise ConfigError(f"{len(sources)} source tensors for {len(layout.buffers)} layout buffers")
        self._regions, self.sources, device = _regions(layout, sources)
        self.device = device
        # Zeroed, not just allocated: the pages are touched (faulted in) here, once, rather than by the
        # first gathers (a fresh 8 MiB piece cost several times its copy on the CPU here).
        self._tensor = torch.zeros(self.config.capacity_bytes, dtype=torch.uint8, device=device)
        self.address = int(self._tensor.data_ptr())
        self._stream: Any = None
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]  # unannotated in torch
        self._registration: Registration | None = backend.register(self._tensor)
        self._cond = threading.Condition()
        self._free = FreeList(self.config.capacity_bytes)
        self._in_use = 0
        self._quarantine: list[StagingLease] = []
        self._closed = False
        self._counts: dict[str, int] = dict.fromkeys(
            (
                "peak",
                "staged_writes",
                "staged_pieces",
                "staged_bytes",
                "entries_saved",
                "direct_writes",
                "direct_pieces",
                "waits",
                "quarantined",
                "released_proven",
                "released_unproven",
            ),
            0,
        )
        self._wait_s = 0.0
        self._gather_s = 0.0

    # ------------------------------------------------------------------------------ planning

    def plan(self, blocks: TransferBlocks) -> Iterator[StagedPiece] | None:
        """The pieces of ``blocks`` when staging them is worth it, else None (send them unstaged).

        Worth it: the blocks need at least ``min_gain`` times fewer engine entries once staged
        (``dst_merge_starts``), every block lies in a buffer the pool can read, and none is longer
        than a piece. A fence or a write of whole pages never qualifies (nothing merges). The pieces
        are planned one at a time as the iterator is advanced, so planning piece k + 1 overlaps the
        engine moving piece k.
        """
        kept = non_empty(blocks)
        entries = len(kept)
        if self._closed or entries < self.config.min_gain:
            return self._direct()
        staged = int(dst_merge_starts(kept).sum())
        if staged * self.config.min_gain > entries or not stageable(kept, self.sources):
            return self._direct()
        if int(kept.length.max()) > self.config.piece_bytes:
            return self._direct()
        ends = piece_bounds(kept, self.config.piece_bytes)
        with self._cond:
            self._counts["staged_writes"] += 1
            self._counts["staged_pieces"] += int(ends.size)
            self._counts["staged_bytes"] += kept.total_bytes
        return self._pieces(kept, ends)

    def _pieces(self, kept: TransferBlocks, ends: npt.NDArray[np.int64]) -> Iterator[StagedPiece]:
        start = 0
        for end in ends.tolist():
            piece = plan_piece(kept.take(slice(start, end)), self.sources)
            with self._cond:
                self._counts["entries_saved"] += (end - start) - len(piece.blocks)
            yield piece
            start = end

    def _direct(self) -> Iterator[StagedPiece] | None:
        """Count an unstaged write; None (what ``plan`` answers for it)."""
        with self._cond:
            self._counts["direct_writes"] += 1
        return None

    # ------------------------------------------------------------------------------ leases

    def acquire_nowait(self, peer: str, nbytes: int) -> StagingLease | None:
        """A lease of ``nbytes`` (rounded up to the alignment) for a piece to ``peer``, or None now."""
        size = _aligned(nbytes)
        with self._cond:
            self._expire_quarantine()
            if self._closed:
                return None
            start = self._free.take(size)
            if start is None:
                return None
            self._in_use += size
            self._counts["peak"] = max(self._counts["peak"], self._in_use)
            return StagingLease(start, size, peer)

    def could_fit(self, nbytes: int) -> bool:
        """Whether ``nbytes`` would fit once every lease that is not quarantined came back: False means
        waiting cannot help soon (quarantined space), and the piece goes unstaged."""
        size = _aligned(nbytes)
        with self._cond:
            if self._closed:
                return False
            edges = sorted((q.offset, q.offset + q.nbytes) for q in self._quarantine)
            cursor = 0
            for start, end in [*edges, (self.config.capacity_bytes, self.config.capacity_bytes)]:
                if start - cursor >= size:
                    return True
                cursor = max(cursor, end)
            return False

    def wait_for_space(self, timeout: float, *, first: bool = True) -> None:
        """Block until a lease comes back, the pool closes, or ``timeout`` seconds passed. ``first``: the
        piece's first wait (``waits`` counts pieces that waited, ``wait_seconds`` all the time)."""
        started = self._clock()
        with self._cond:
            self._counts["waits"] += first
            if not self._closed:
                self._cond.wait(max(0.0, timeout))
            self._wait_s += max(0.0, self._clock() - started)

    def count_direct_piece(self) -> None:
        """The executor sent a piece unstaged (``could_fit`` said no)."""
        with self._cond:
            self._counts["direct_pieces"] += 1

    def watch(self, handle: BatchHandle, lease: StagingLease | None) -> None:
        """Follow a batch the executor submitted: ``lease`` (None: an unstaged batch) is the staging it
        reads. The pool learns the batch's end from the backend itself (the handle's verdict), not from
        whoever waits on it: a lease comes back the moment the engine is done with it, even while the
        job that submitted it is busy submitting to another peer. A COMPLETED batch is also its peer's
        drain point for quarantined leases submitted before it."""
        if lease is not None:
            with self._cond:
                lease.pending += 1
                lease.last_serial = max(lease.last_serial, handle.serial)
        # Runs on the thread that ends the batch, or here at once if it already ended.
        handle.verdict_future.add_done_callback(functools.partial(self._batch_ended, handle, lease))

    def _batch_ended(
        self, handle: BatchHandle, lease: StagingLease | None, verdict: Future[EngineVerdict]
    ) -> None:
        try:
            completed = verdict.result().status is BatchStatus.COMPLETED
        except BaseException:  # a broken verdict proves nothing: treated as a failure
            completed = False
        with self._cond:
            if lease is not None:
                lease.pending -= 1
                lease.failed |= not completed
                self._settle(lease)
            if completed and self._quarantine:
                self._drained(handle.peer, handle.serial)

    def seal(self, lease: StagingLease) -> None:
        """No more batches will be submitted from ``lease``; it returns once its batches ended."""
        with self._cond:
            lease.sealed = True
            self._settle(lease)

    def _drained(self, peer: str, serial: int) -> None:
        """Lock held: a batch to ``peer`` with submission serial ``serial`` COMPLETED; every lease
        quarantined for ``peer`` whose batches were all submitted before it comes back (proven)."""
        back = [q for q in self._quarantine if q.peer == peer and q.last_serial < serial]
        for lease in back:
            self._quarantine.remove(lease)
            self._counts["released_proven"] += 1
            self._give_back(lease)

    def _settle(self, lease: StagingLease) -> None:
        """Lock held: return or quarantine a lease whose every batch ended and which is sealed."""
        if not lease.sealed or lease.pending or lease.quarantined_at is not None:
            return
        if not lease.failed:
            self._in_use -= lease.nbytes
            self._give_back(lease)
            return
        lease.quarantined_at = self._clock()
        self._in_use -= lease.nbytes
        self._quarantine.append(lease)
        self._counts["quarantined"] += 1
        log.warning(
            "staging: %d bytes quarantined after a failed write to %s (back when a later write to it "
            "completes, or unproven after %g s)",
            lease.nbytes,
            lease.peer,
            self.config.quarantine_s,
        )

    def _give_back(self, lease: StagingLease) -> None:
        self._free.give(lease.offset, lease.nbytes)
        self._cond.notify_all()

    def _expire_quarantine(self) -> None:
        if not self._quarantine:
            return
        now = self._clock()
        expired = [
            q
            for q in self._quarantine
            if q.quarantined_at is not None and now - q.quarantined_at >= self.config.quarantine_s
        ]
        for lease in expired:
            self._quarantine.remove(lease)
            self._counts["released_unproven"] += 1
            log.warning(
                "staging: %d bytes of a failed write to %s released unproven after %g s (the peer "
                "completed no later write)",
                lease.nbytes,
                lease.peer,
                self.config.quarantine_s,
            )
            self._give_back(lease)

    # ------------------------------------------------------------------------------ the copy

    def gather(self, piece: StagedPiece, lease: StagingLease) -> TransferBlocks:
        """Copy ``piece``'s source bytes into ``lease`` (one ``index_select`` per group, on the
        sources' device) and return its staged blocks at the lease's address. Returns only once the
        copy is complete (a CUDA copy is synchronised through an event)."""
        plan = piece.gather
        started = self._clock()
        with self._on_stream(), _copy_threads(self.config.copy_threads if self._stream is None else 0):
            for k in range(len(plan)):  # one copy per group: few per piece
                element = int(plan.element_bytes[k])
                count = int(plan.count[k])
                out_at = lease.offset + int(plan.out_offset[k])
                region = self._regions[int(plan.region[k])]
                rows = int(region.flat.numel()) // element
                dtype = _widest(element, out_at, region.address)
                width = element // torch.empty(0, dtype=dtype).element_size()
                source = region.flat[: rows * element].view(dtype).view(rows, width)
                out = self._tensor[out_at : out_at + count * element].view(dtype).view(count, width)
                first = int(plan.first[k])
                index = torch.from_numpy(plan.index[first : first + count])
                if self.device.type != "cpu":
                    index = index.to(self.device)
                torch.index_select(source, 0, index, out=out)
        took = self._clock() - started
        with self._cond:
            self._gather_s += max(0.0, took)
        return piece.at(self.address + lease.offset)

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        if self._stream is None:
            yield
            return
        with torch.cuda.stream(self._stream):
            yield
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
        done.record(self._stream)
        done.synchronize()  # the engine reads staging right after: the copy must have finished

    # ------------------------------------------------------------------------------ lifecycle

    def statistics(self) -> StagingStatistics:
        with self._cond:
            c = self._counts
            return StagingStatistics(
                capacity_bytes=self.config.capacity_bytes,
                in_use_bytes=self._in_use,
                quarantined_bytes=sum(q.nbytes for q in self._quarantine),
                peak_in_use_bytes=c["peak"],
                staged_writes=c["staged_writes"],
                staged_pieces=c["staged_pieces"],
                staged_bytes=c["staged_bytes"],
                entries_saved=c["entries_saved"],
                direct_writes=c["direct_writes"],
                direct_pieces=c["direct_pieces"],
                waits=c["waits"],
                wait_seconds=self._wait_s,
                gather_seconds=self._gather_s,
                quarantined=c["quarantined"],
                released_proven=c["released_proven"],
                released_unproven=c["released_unproven"],
            )

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Refuse new leases, wake every waiter, and unregister the staging memory when no lease is out.

        With leases still in use or quarantined (a write still in flight, or a failed one whose peer
        never drained) the memory stays registered and alive: the backend's own ``close()`` waits for
        every batch and then unregisters it. Idempotent.
        """
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            busy = self._in_use + sum(q.nbytes for q in self._quarantine)
        if busy:
            log.warning(
                "staging pool closed with %d bytes still leased or quarantined: left registered until "
                "the backend closes",
                busy,
            )
            return
        if self._registration is not None:
            self._registration.close()
            self._registration = None

    def __enter__(self) -> StagingPool:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _regions(
    layout: BufferLayout, sources: Sequence[torch.Tensor | None]
) -> tuple[list[_Region], StagingSources, torch.device]:
    """Group the source tensors by storage (one region each), checking each against its buffer."""
    regions: list[_Region] = []
    by_storage: dict[int, int] = {}
    buffer_region: list[int] = []
    devices: set[torch.device] = set()
    for i, (spec, tensor) in enumerate(zip(layout.buffers, sources, strict=True)):
        if tensor is None:
            buffer_region.append(NO_REGION)
            continue
        name = f"source of buffer #{i} ({spec.model.value} {spec.kind.value} layer {spec.layer_id})"
        if not tensor.is_contiguous():
            raise ConfigError(f"{name} is not contiguous")
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.data_ptr() != spec.base_ptr or nbytes != spec.length:
            raise ConfigError(
                f"{name}: the tensor is {nbytes} bytes at {tensor.data_ptr():#x}, the layout says "
                f"{spec.length} bytes at {spec.base_ptr:#x}"
            )
        devices.add(tensor.device)
        storage = tensor.untyped_storage()
        key = int(storage.data_ptr())
        if key not in by_storage:
            flat = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(
                storage, 0, (storage.nbytes(),), (1,)
            )
            by_storage[key] = len(regions)
            regions.append(_Region(flat=flat, address=key))
        buffer_region.append(by_storage[key])
    if len(devices) > 1:
        raise ConfigError(
            f"staging sources live on several devices {sorted(map(str, devices))}: one pool per device"
        )
    device = devices.pop() if devices else torch.device("cpu")
    sources_table = StagingSources(
        buffer_region=buffer_region,
        buffer_start=[b.base_ptr for b in layout.buffers],
        buffer_end=[b.base_ptr + b.length for b in layout.buffers],
        region_start=[r.address for r in regions],
        region_bytes=[int(r.flat.numel()) for r in regions],
    )
    return regions, sources_table, device


# ---------------------------------------------------------------------------------- landing scatter
# The decode-side half of the landing zone (decode TP below prefill TP: pdkv.mapping.landing). Not
# wired into the transports yet: specs/mapping.md section 15 is the design the protocol core follows.


class LandingRegions:
    """The decode's buffers as scatter targets: ``tensors[i]`` behind ``layout.buffers[i]`` (None: never
    a target), grouped by storage like a pool's sources; ``sources`` is the table ``plan_scatter`` takes."""

    def __init__(self, layout: BufferLayout, tensors: Sequence[torch.Tensor | None]) -> None:
        if len(tensors) != len(layout.buffers):
            raise ConfigError(f"{len(tensors)} tensors for {len(layout.buffers)} layout buffers")
        self._regions, self.sources, self.device = _regions(layout, tensors)

    def scatter(
        self, plan: ScatterPlan, landing: torch.Tensor, *, copy_threads: int = DEFAULT_COPY_THREADS
    ) -> None:
        """Copy ``plan``'s landing bytes into the decode's pages: one ``index_copy_`` per group, on the
        buffers' device. ``landing``: a contiguous tensor (any dtype) holding every landing address of
        the plan. Returns once the copies are complete (a CUDA copy is synchronised through an event):
        the decode may report Success right after."""
        base = int(landing.data_ptr())
        flat = landing.view(-1).view(torch.uint8)
        stream: Any = None
        if self.device.type == "cuda":
            stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]  # unannotated in torch
        context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with context, _copy_threads(copy_threads if stream is None else 0):
            for k in range(len(plan)):  # one copy per group
                element = int(plan.element_bytes[k])
                count = int(plan.count[k])
                at = int(plan.landing_address[k]) - base
                if at < 0 or at + count * element > flat.numel():
                    raise ConfigError(
                        f"scatter group {k}: landing bytes [{at}, {at + count * element}) are outside the "
                        f"{flat.numel()}-byte landing tensor"
                    )
                region = self._regions[int(plan.region[k])]
                rows = int(region.flat.numel()) // element
                dtype = _widest(element, at + base, region.address)
                width = element // torch.empty(0, dtype=dtype).element_size()
                target = region.flat[: rows * element].view(dtype).view(rows, width)
                values = flat[at : at + count * element].view(dtype).view(count, width)
                first = int(plan.first[k])
                index = torch.from_numpy(plan.index[first : first + count])
                if self.device.type != "cpu":
                    index = index.to(self.device)
                target.index_copy_(0, index, values)
        if stream is not None:
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
            done.record(stream)
            done.synchronize()
