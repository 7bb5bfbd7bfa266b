"""Transfer executor: moves the blocks of one chunk (or of one layer at a time) through a backend.

Owns: ``TransferExecutor``, ``TransferJob`` (one logical transfer to one peer, fed in one or many
``submit`` calls), ``ExecutorConfig`` with the measured shaping defaults, and ``TransferResult``.
Must not map pages (that is ``pdkv.mapping``), touch room state, or talk to the peer's control plane:
it turns blocks into engine batches, keeps a bounded number of them in flight, and reports exactly
what landed.

Rules it keeps:

- Shaping: ``pdkv.mapping.shape_batches`` with the configured slice size, entries per batch and bytes
  per batch (entries also capped by the backend's ``max_entries_in_flight``).
- Back-pressure: at most ``max_in_flight`` batches of a job are outstanding. ``submit`` reaps
  finished batches and, when the job is full, blocks on the oldest one: the job's in-flight list is
  the bounded queue, and a producer faster than the engine waits instead of growing it.
- Failure: the first batch that fails (or is refused at submission, or whose wait runs out of time)
  stops the job submitting; later ``submit`` calls are counted as requested but not sent. ``finish``
  then waits for every batch already submitted before it reports, so no submitted batch is left
  unwaited and no success is reported for a partial write (``ok`` means every requested byte is in
  a COMPLETED batch).
- Timeouts: a job has a budget (``timeout_s``) from ``start`` to the end of ``finish``; running out
  makes it TIMED_OUT for good. If ``finish`` returns TIMED_OUT with ``batches_in_flight > 0``, those
  batches may still write into the peer: the caller must not release the source or let the peer
  reuse the destination until ``drain()`` returned (it waits for the backend to end every batch; the
  engine's own timeouts bound it). ``transfer()`` and leaving a job's ``with`` block drain for you.
- Shared transfers (``transfer_shared``): the writes of several rooms ready at the same time go to
  each peer as one job, so small rooms share engine batches (one submission and one status wait
  for many rooms). Each write still gets its own result, exact to the engine batch: it is
  COMPLETED only when every one of its bytes is in a COMPLETED batch before the first batch that
  failed or timed out; a write with bytes in that batch (or after it) fails, as does every other
  write in that batch; ``bytes_written`` counts exactly the bytes in COMPLETED batches. Jobs
  towards different peers run at the same time; nothing is waited for that was not already given
  (no timer holds a lone write back).
- One batch (``transfer`` of blocks that shape into a single engine batch, unstaged): written with
  the backend's ``write_outcome``, which may move it on the calling thread without handing it to
  the backend's own threads (a small chunk's whole write: one call in, one outcome out).
- Per-layer use: ``job = executor.start(peer)``, ``job.submit(layer_blocks)`` as each layer becomes
  ready, ``job.finish()`` once after the last layer. ``submit`` blocks only while the job is full;
  a caller that must never block (a forward thread) hands layers to a transfer worker instead.
- Staging (an executor built with a ``StagingPool``, ``pdkv.runtime.staging``): ``submit`` asks the
  pool whether the blocks are worth staging (many small blocks whose destinations are contiguous:
  MHA/GQA head slices towards a decode rank of a higher TP). If so, each piece leases staging space
  (waiting for it as the pool's docstring says: never failing for it before the job's deadline), is
  gathered there with one copy per source region, and its few staged blocks are shaped and submitted
  like any others; the lease goes back, or into quarantine, as its batches end. Results, byte
  accounting, ``landed`` offsets and fences are those of the unstaged blocks: a piece keeps its
  blocks' bytes in order, so nothing above the executor can tell a staged write from a direct one.

A job is driven by one thread at a time. The backend does the real work on its own threads.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Final

import attrs

from pdkv import config
from pdkv.config import positive_int, positive_seconds
from pdkv.engine.backend import BatchHandle, BatchOutcome, BatchStatus, TransferBackend
from pdkv.errors import ConfigError, TransferError
from pdkv.errors.runtime import JobFinishedError as JobFinishedError
from pdkv.mapping import TransferBlocks, shape_batches
from pdkv.mapping.staging import StagedPiece
from pdkv.runtime.staging import StagingLease, StagingPool

log = logging.getLogger(__name__)

# Shaping defaults, chosen by measurement: `python -m pdkv bench engine` (256 MiB per run, best of 3,
# two processes, Mooncake 0.3.13 TCP on 127.0.0.1, 2-core machine). 256 KiB slices were the fastest
# at every batch size (about 2.7 GB/s; 64 KiB about 1.7, 1-4 MiB 2.2-2.6). On a contiguous range,
# entries per batch and batches in flight moved the figure by less than the run-to-run noise; on the
# scattered 32K-token MLA request of `python -m pdkv bench transfer` (10,614 runs of 72 KiB-2.3 MiB)
# fewer, larger batches won: in one process pair, shapes rotated over 8 rounds, 2,048 entries with
# 512 MiB per batch took a median 0.98 s with 4 batches in flight and with 2, where 512 entries with
# 128 MiB took 1.08-1.18 s (with Mooncake's default and a raised TCP queue alike). 128 MiB had capped
# batches at about 900 entries, so 1,024 and 2,048 entries measured the same until the byte limit
# rose. The likely cost is per batch (a status wait and a lane hand-off on the cores the engine's TCP
# threads also need); it is a hypothesis, not a measured phase. 4 in flight, not 2: per-layer
# transfer submits one batch per layer into one job, and a lower limit holds a finished layer's write
# back until an earlier layer's batch completes. With the default TCP lane queue (2,048 entries) the
# later batches wait in the backend's lane and start as the first completes. Re-measure for RDMA.
DEFAULT_SLICE_BYTES: Final = 256 << 10
DEFAULT_MAX_ENTRIES: Final = 2048
DEFAULT_MAX_BATCH_BYTES: Final = 512 << 20
DEFAULT_MAX_IN_FLIGHT: Final = 4
DEFAULT_TIMEOUT_S: Final = 300.0


@attrs.frozen(kw_only=True)
class ExecutorConfig:
    slice_bytes: int = attrs.field(
        default=DEFAULT_SLICE_BYTES,
        validator=positive_int,
        metadata=config.int_var(
            "PDKV_EXECUTOR_SLICE_BYTES", "Executor: bytes per engine entry (longer blocks are sliced)"
        ),
    )
    max_entries: int = attrs.field(
        default=DEFAULT_MAX_ENTRIES,
        validator=positive_int,
        metadata=config.int_var("PDKV_EXECUTOR_MAX_ENTRIES", "Executor: entries per engine batch"),
    )
    max_batch_bytes: int = attrs.field(
        default=DEFAULT_MAX_BATCH_BYTES,
        validator=positive_int,
        metadata=config.int_var("PDKV_EXECUTOR_MAX_BATCH_BYTES", "Executor: bytes per engine batch"),
    )
    max_in_flight: int = attrs.field(
        default=DEFAULT_MAX_IN_FLIGHT,
        validator=positive_int,
        metadata=config.int_var("PDKV_EXECUTOR_MAX_IN_FLIGHT", "Executor: batches in flight per transfer"),
    )
    timeout_s: float = attrs.field(
        default=DEFAULT_TIMEOUT_S,
        validator=positive_seconds,
        metadata=config.seconds_var("PDKV_EXECUTOR_TIMEOUT", "Executor: bound on one chunk's transfer"),
    )

    def __attrs_post_init__(self) -> None:
        if self.slice_bytes > self.max_batch_bytes:
            raise ConfigError(
                f"slice_bytes {self.slice_bytes} exceeds max_batch_bytes {self.max_batch_bytes}: "
                "a full slice would fit no batch"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ExecutorConfig:
        """Defaults, overridden by the ``PDKV_EXECUTOR_*`` variables in ``ENV_VARS`` that are set."""
        return config.from_env(cls, env)


ENV_VARS: Final[Mapping[str, str]] = config.env_vars(ExecutorConfig)


class JobStatus(enum.Enum):
    COMPLETED = "completed"  # every requested byte is in a COMPLETED batch
    FAILED = "failed"  # a batch failed or was refused; nothing after it was sent
    TIMED_OUT = "timed_out"  # the budget ran out; see batches_in_flight


@attrs.frozen(kw_only=True)
class TransferResult:
    status: JobStatus
    peer: str
    bytes_requested: int  # every byte given to submit(), including what was never sent
    bytes_written: int  # bytes of batches the backend reported COMPLETED
    batches: int  # batches submitted to the backend
    batches_in_flight: int  # submitted and not finished: > 0 only with TIMED_OUT (may still write)
    seconds: float  # start() to the end of this finish()
    failed_batch: int | None  # 0-based submission index of the first batch that failed or timed out
    reason: str  # empty when COMPLETED
    shared_by: int = 1  # writes (rooms' chunks) whose blocks went in the same job (transfer_shared)

    @property
    def ok(self) -> bool:
        return self.status is JobStatus.COMPLETED


@attrs.frozen
class _Submitted:
    index: int
    handle: BatchHandle


@attrs.frozen
class _Failure:
    index: int
    status: JobStatus
    reason: str


class TransferJob:
    """One transfer of blocks to one peer: ``submit`` any number of times, then ``finish`` once."""

    def __init__(
        self,
        backend: TransferBackend,
        peer: str,
        config: ExecutorConfig,
        *,
        timeout_s: float,
        clock: Callable[[], float],
        staging: StagingPool | None = None,
    ) -> None:
        self._backend = backend
        self._staging = staging
        self.peer = peer
        self._config = config
        self._max_entries = min(config.max_entries, backend.max_entries_in_flight)
        self._clock = clock
        self._started_at = clock()
        self._deadline = self._started_at + timeout_s
        self._in_flight: deque[_Submitted] = deque()
        self._batch_bytes: list[int] = []  # bytes of each submitted batch, by submission index
        self._completed: list[bool] = []  # whether each submitted batch COMPLETED
        self._batches = 0
        self._bytes_requested = 0
        self._bytes_written = 0
        self._failure: _Failure | None = None
        self._finish_called = False

    @property
    def failed(self) -> bool:
        """True once a batch failed, was refused, or timed out (the job sends nothing more)."""
        return self._failure is not None

    def _stopped(self) -> bool:
        """``failed``, as a call: mypy narrows a property it has seen checked, and the calls between
        two checks (waits, submissions) can fail the job."""
        return self._failure is not None

    @property
    def batches_in_flight(self) -> int:
        return len(self._in_flight)

    def submit(self, blocks: TransferBlocks) -> None:
        """Shape ``blocks`` and submit them, blocking only while ``max_in_flight`` batches are out (and,
        for a staged write, while a piece waits for staging space)."""
        if self._finish_called:
            raise JobFinishedError(f"transfer to {self.peer} already finished; start a new job")
        pool = self._staging
        self._submit_planned(blocks, pool.plan(blocks) if pool is not None else None)

    def _submit_planned(
        self,
        blocks: TransferBlocks,
        pieces: Iterator[StagedPiece] | None,
        shaped: list[TransferBlocks] | None = None,
    ) -> None:
        """``submit`` with the staging pool's plan of ``blocks`` made (None: unstaged), and for
        unstaged blocks perhaps their shaping too (``shaped``)."""
        self._bytes_requested += blocks.total_bytes
        if self._failure is not None:
            return  # the job failed: sending more would only write into pages nobody will read
        pool = self._staging
        if pool is None or pieces is None:
            self._submit_blocks(blocks, None, shaped)
            return
        for piece in pieces:
            if self._stopped():
                return
            lease = self._lease_for(pool, piece)
            if lease is None:
                if self._stopped():
                    return  # no space before the deadline: the job is TIMED_OUT
                pool.count_direct_piece()  # quarantined space leaves too little room: send it as it is
                self._submit_blocks(piece.source, None)
                continue
            try:
                staged = pool.gather(piece, lease)
            except Exception as exc:  # nothing of the piece was submitted: the lease comes back at once
                pool.seal(lease)
                self._fail(
                    self._batches, JobStatus.FAILED, f"staging copy failed: {type(exc).__name__}: {exc}"
                )
                return
            try:
                self._submit_blocks(staged, lease)
            finally:
                pool.seal(lease)

    def _lease_for(self, pool: StagingPool, piece: StagedPiece) -> StagingLease | None:
        """Staging space for ``piece``: waits while space held by batches in flight can come back.

        Leases come back as their batches end (the pool follows every batch itself), so this waits on
        the pool's condition in short waits that re-check, reaping this job's finished batches between
        them. Bounded by the job's deadline: past it the job fails TIMED_OUT and None is returned. None
        with the job not failed: the pool could not hold the piece even with every live lease back
        (quarantined space, or the pool closed), so the piece goes unstaged.
        """
        waited = False
        while True:
            lease = pool.acquire_nowait(self.peer, piece.nbytes)
            if lease is not None:
                return lease
            if not pool.could_fit(piece.nbytes):
                return None
            self._reap_finished()
            if self._stopped():
                return None
            remaining = self._deadline - self._clock()
            if remaining <= 0:
                self._fail(
                    self._batches,
                    JobStatus.TIMED_OUT,
                    f"no staging space for a {piece.nbytes}-byte piece within the transfer deadline",
                )
                return None
            pool.wait_for_space(min(remaining, 0.1), first=not waited)
            waited = True

    def _submit_blocks(
        self, blocks: TransferBlocks, lease: StagingLease | None, shaped: list[TransferBlocks] | None = None
    ) -> None:
        batches = self._shape(blocks) if shaped is None else shaped
        for batch in batches:
            self._reap_finished()
            # self.failed, not self._failure: the calls above change it (mypy would narrow the field).
            while not self.failed and len(self._in_flight) >= self._config.max_in_flight:
                self._wait_oldest()
            if self.failed:
                return
            try:
                handle = self._backend.submit_write(self.peer, batch)
            except TransferError as exc:
                self._fail(self._batches, JobStatus.FAILED, f"refused at submission: {exc}")
                return  # never reached the engine: it holds no staging
            self._in_flight.append(self._accepted(handle, lease))

    def _accepted(self, handle: BatchHandle, lease: StagingLease | None) -> _Submitted:
        """Count a batch the backend took as the job's next (the staging pool watches it: its lease's
        end, or for an unstaged batch its peer's drain point)."""
        if self._staging is not None:
            self._staging.watch(handle, lease)
        submitted = _Submitted(self._batches, handle)
        self._batch_bytes.append(handle.total_bytes)
        self._completed.append(False)
        self._batches += 1
        return submitted

    def _shape(self, blocks: TransferBlocks) -> list[TransferBlocks]:
        return shape_batches(
            blocks,
            max_entries=self._max_entries,
            slice_bytes=self._config.slice_bytes,
            max_batch_bytes=self._config.max_batch_bytes,
        )

    def write_all(self, blocks: TransferBlocks) -> TransferResult:
        """``submit(blocks)`` then ``finish()`` for a job given nothing before: blocks that shape into
        one engine batch (and are not staged) go through the backend's ``write_outcome``, the rest
        as ``submit`` and ``finish`` do. The result is the same either way."""
        if self._finish_called:
            raise JobFinishedError(f"transfer to {self.peer} already finished; start a new job")
        pool = self._staging
        pieces = pool.plan(blocks) if pool is not None else None
        direct = pieces is None and not self._batches and self._failure is None
        batches = self._shape(blocks) if direct else []
        if len(batches) != 1:
            self._submit_planned(blocks, pieces, batches if direct else None)
            return self.finish()
        self._finish_called = True
        self._bytes_requested += blocks.total_bytes
        remaining = max(0.0, self._deadline - self._clock())
        try:
            outcome = self._backend.write_outcome(self.peer, batches[0], timeout=remaining)
        except TransferError as exc:
            self._fail(0, JobStatus.FAILED, f"refused at submission: {exc}")
            return self._result()
        self._in_flight.append(self._accepted(outcome.handle, None))
        self._settle_in_flight((outcome,))  # a TIMED_OUT one stays in flight: drain() waits for it
        return self._result()

    def finish(self, timeout: float | None = None) -> TransferResult:
        """Wait for every submitted batch within the job budget (and ``timeout`` if given); report.

        A batch still unfinished when the time is up makes the job TIMED_OUT for good; the result
        counts it in ``batches_in_flight`` and the caller must ``drain()`` before reusing memory.
        """
        self._finish_called = True
        remaining = self._deadline - self._clock()
        if timeout is not None:
            remaining = min(remaining, timeout)
        self._wait_in_flight(max(0.0, remaining))
        return self._result()

    def landed(self, start: int, end: int) -> int:
        """Bytes ``start`` to ``end`` of everything submitted (in ``submit`` order, as offsets into
        the concatenated blocks) that are in a COMPLETED batch. Batches keep the blocks' order and
        cover a prefix of them (nothing is sent after a failure), so this is exact."""
        landed = 0
        offset = 0
        for size, completed in zip(self._batch_bytes, self._completed, strict=True):
            if offset >= end:
                break
            if completed:
                landed += max(0, min(end, offset + size) - max(start, offset))
            offset += size
        return landed

    def landed_before(self, batch: int | None) -> int | float:
        """Offset of submitted batch ``batch`` in the concatenated blocks (None: no limit)."""
        return math.inf if batch is None else sum(self._batch_bytes[:batch])

    def drain(self) -> TransferResult:
        """Wait without a limit of our own until no batch is in flight (the engine's timeouts bound it)."""
        self._finish_called = True
        while self._in_flight:
            self._wait_in_flight(None)
        return self._result()

    # ------------------------------------------------------------------------------ internals

    def _wait_in_flight(self, timeout: float | None) -> None:
        if not self._in_flight:
            return
        self._settle_in_flight(self._backend.wait([s.handle for s in self._in_flight], timeout).outcomes)

    def _settle_in_flight(self, outcomes: Sequence[BatchOutcome]) -> None:
        """Record the batches in flight that ended (``outcomes``: theirs, in order); the job is
        TIMED_OUT for good if any did not, and those stay in flight."""
        still_out: deque[_Submitted] = deque()
        for submitted, outcome in zip(self._in_flight, outcomes, strict=True):
            if outcome.status is BatchStatus.TIMED_OUT:
                still_out.append(submitted)
            else:
                self._record(submitted, outcome)
        self._in_flight = still_out
        if still_out:
            self._fail(
                still_out[0].index,
                JobStatus.TIMED_OUT,
                f"not finished in time: {len(still_out)} batches",
            )

    def _reap_finished(self) -> None:
        while self._in_flight:
            head = self._in_flight[0]
            outcome = self._backend.wait([head.handle], 0.0).outcomes[0]
            if outcome.status is BatchStatus.TIMED_OUT:
                return
            self._in_flight.popleft()
            self._record(head, outcome)

    def _wait_oldest(self) -> None:
        head = self._in_flight[0]
        remaining = max(0.0, self._deadline - self._clock())
        outcome = self._backend.wait([head.handle], remaining).outcomes[0]
        if outcome.status is BatchStatus.TIMED_OUT:
            # It stays in flight: finish()/drain() must still wait for it before memory is reused.
            self._fail(head.index, JobStatus.TIMED_OUT, "not finished in time (waiting for room to submit)")
            return
        self._in_flight.popleft()
        self._record(head, outcome)

    def _record(self, submitted: _Submitted, outcome: BatchOutcome) -> None:
        """A batch ended (COMPLETED or FAILED, never TIMED_OUT: that one stays in flight)."""
        index = submitted.index
        completed = outcome.status is BatchStatus.COMPLETED
        if completed:
            self._bytes_written += outcome.handle.total_bytes
            self._completed[index] = True
        else:
            self._fail(index, JobStatus.FAILED, outcome.reason)

    def _fail(self, index: int, status: JobStatus, reason: str) -> None:
        if self._failure is None:
            self._failure = _Failure(index, status, reason)
            log.warning("transfer to %s: batch %d %s: %s", self.peer, index, status.value, reason)

    def _result(self) -> TransferResult:
        seconds = self._clock() - self._started_at
        failure = self._failure
        if failure is None:
            status, reason = JobStatus.COMPLETED, ""
        else:
            status, reason = failure.status, failure.reason
        if self._in_flight:
            reason = f"{reason}; {len(self._in_flight)} batches still in flight and may still write"
        if status is JobStatus.COMPLETED and self._bytes_written != self._bytes_requested:
            # Unreachable by construction; refuse to call a partial write a success regardless.
            status = JobStatus.FAILED
            reason = f"only {self._bytes_written} of {self._bytes_requested} bytes confirmed"
        result = TransferResult(
            status=status,
            peer=self.peer,
            bytes_requested=self._bytes_requested,
            bytes_written=self._bytes_written,
            batches=self._batches,
            batches_in_flight=len(self._in_flight),
            seconds=seconds,
            failed_batch=None if failure is None else failure.index,
            reason=reason,
        )
        if result.ok:
            log.debug(
                "transfer to %s: %d B in %d batches, %.4f s",
                self.peer,
                result.bytes_written,
                result.batches,
                seconds,
            )
        return result

    def __enter__(self) -> TransferJob:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # However the block is left, no batch of this job stays unwaited.
        if self._in_flight:
            self.drain()


class TransferExecutor:
    """Starts ``TransferJob``s on one backend with one shaping configuration."""

    def __init__(
        self,
        backend: TransferBackend,
        config: ExecutorConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        staging: StagingPool | None = None,
    ) -> None:
        """``staging``: a pool registered with ``backend`` whose sources are this rank's buffers; writes
        worth staging then go through it (see the module docstring)."""
        self.backend = backend
        self.config = config or ExecutorConfig()
        self._clock = clock
        self.staging = staging

    def start(self, peer: str, *, timeout_s: float | None = None) -> TransferJob:
        """A new job towards ``peer``; its budget runs from now (``timeout_s`` or the config's)."""
        budget = self.config.timeout_s if timeout_s is None else timeout_s
        return TransferJob(
            self.backend, peer, self.config, timeout_s=budget, clock=self._clock, staging=self.staging
        )

    def transfer(
        self, peer: str, blocks: TransferBlocks, *, timeout_s: float | None = None
    ) -> TransferResult:
        """The monolithic path: submit every block, wait for all, report."""
        job = self.start(peer, timeout_s=timeout_s)
        with job:
            result = job.write_all(blocks)
            # Never hand back a result while batches may still write: the caller would free memory.
            return job.drain() if result.batches_in_flight else result

    def transfer_shared(
        self, writes: Sequence[tuple[str, TransferBlocks]], *, timeout_s: float | None = None
    ) -> list[TransferResult]:
        """Several writes (peer, blocks) as one job per peer; one result per write, in order.

        The blocks of the writes to one peer are concatenated in order and shaped together, so
        small writes share engine batches. A write's result is COMPLETED only if all its bytes are
        in COMPLETED batches before the job's first failed or timed-out batch (``bytes_written``
        counts exactly the bytes in COMPLETED batches); otherwise it has its job's status and
        reason. Every job has ended (drained) when this returns.
        """
        by_peer: dict[str, list[int]] = {}
        for i, (peer, _) in enumerate(writes):
            by_peer.setdefault(peer, []).append(i)
        jobs: list[tuple[TransferJob, list[int]]] = []
        results: list[TransferResult | None] = [None] * len(writes)
        try:
            for peer, indices in by_peer.items():
                job = self.start(peer, timeout_s=timeout_s)
                jobs.append((job, indices))
                parts = [writes[i][1] for i in indices]
                job.submit(parts[0] if len(parts) == 1 else TransferBlocks.concat(parts))
            for job, indices in jobs:
                shared = job.finish()
                if shared.batches_in_flight:
                    shared = job.drain()
                # Bytes from the first failed (or timed-out) batch on fail their writes, even those
                # that landed later: the batch failed for all of them, as the job did for transfer().
                cut = job.landed_before(shared.failed_batch)
                offset = 0
                for i in indices:
                    size = writes[i][1].total_bytes
                    landed = job.landed(offset, offset + size)
                    offset += size
                    if landed == size and offset <= cut:
                        status, reason = JobStatus.COMPLETED, ""
                    else:
                        status = JobStatus.FAILED if shared.ok else shared.status
                        reason = shared.reason or f"only {landed} of {size} bytes confirmed"
                        if len(indices) > 1:
                            reason = f"{reason} (engine batch shared by {len(indices)} writes)"
                    results[i] = attrs.evolve(
                        shared,
                        status=status,
                        bytes_requested=size,
                        bytes_written=landed,
                        batches_in_flight=0,
                        failed_batch=None if status is JobStatus.COMPLETED else shared.failed_batch,
                        reason=reason,
                        shared_by=len(indices),
                    )
        finally:
            for job, _ in jobs:  # an exception must not leave a batch unwaited
                if job.batches_in_flight:
                    job.drain()
        return [r for r in results if r is not None]
