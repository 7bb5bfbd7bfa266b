"""One room at a time through the full transports across processes, against the raw engine on the same blocks.

``--backend nixl``: pdkv over NIXL beside pdkv over Mooncake in the same run, and the raw NIXL agent on
the same blocks (``_measure_engines``, at the end of this module), with each process's CPU idle and busy.
The rest of this docstring describes the Mooncake run.

The workload of issue 15: a 61-layer MLA model (72 KiB pages: 64 tokens x 1,152 B), requests of
``--sizes`` pages whose positions lie 70% in runs of 2-16 pages contiguous on both sides and the
rest in single pages scattered on both sides (decode pages drawn the same way, independently). A
prefill rank (this process) and a decode rank (a spawned process) run real ``PrefillTransport`` /
``DecodeTransport`` over Mooncake TCP on 127.0.0.1 with the bootstrap registry; one room at a time:
the decode side's ``receiver.init`` first (the request is in before the forward ends, as in
serving), then ``sender.send()`` of the whole request as one last chunk, timed to the prefill's
Success and to the decode's Success, each seen by a scheduler loop that polls, then waits for the
transport's progress (``wait_progress``) at most ``--poll-us`` (``--sleep-poll``: sleeps that long
instead, as a scheduler that does not wait on the transport).

In the same run, on the same block list (one block per run contiguous on both sides, per layer)
and the same registered memory of the same two processes, the raw engine (the prefill rank's own
``TransferEngine``, no pdkv code in the path):

- one batch: every block in one ``batch_transfer_sync_write`` (SGLang's approach; the engine's TCP
  queue is raised so that it stays one batch);
- best shape: the blocks cut into batches of E entries with K batches in flight
  (``batch_transfer_async_write`` + ``get_batch_transfer_status``), the fastest (E, K) of a small
  sweep per size.

The three methods run interleaved for ``--repeats`` rounds, in an order that turns each round (a
transfer right after a large one is slower); figures are the best and the median of the rounds. A
per-phase breakdown of the pdkv rooms (medians) says where the time goes: the scheduler's ``send()``
call, the chunk's wait in the work queue, planning (``plan_chunk``), executor and backend set-up
until the engine is first called, the engine (first launch to the last status returned), the
executor noticing completion, TransferStatus leaving the prefill rank (sent by the transfer worker
itself once it released the lock while the control thread waited, else by the control thread), the
status crossing to the decode rank's control thread, and the decode scheduler's poll seeing Success
(beside the last two: the prefill scheduler's poll seeing Success after the status left). The
timestamps come from a subclass of the Mooncake backend, a wrapper of its engine and of both
control channels, and a wrapper of ``plan_chunk`` in this process (instrumentation only: a few
microseconds each). ``time.monotonic`` is one clock for every process of the host. Each mark also
reads its thread's CPU clock, so the phases that begin and end on one prefill thread (``CPU_PHASES``)
get a CPU figure beside their time: a phase whose CPU is its time is work on that thread, not a
wait, and the engine phase's CPU is what the waiting thread spun.

The hand-offs of each room, ``send()`` to the decode's poll seeing Success, are counted and printed
with one room's path (``HandOffs``): the thread that ran each step (the same timeline marks, each with
its process and thread; the decode reports the thread that took the status off its channel and its
scheduler's), Mooncake's transfer threads and, with ``PDKV_CONTROL_CHANNEL=zmq``, zmq's I/O threads
by construction (the default stream channel has none: the sending thread writes to the kernel and
the receiving owner reads from it), and the acquisitions of either transport's lock that found it
held.

``--ab-workers``: each round also runs a pdkv room with ``wait_runs_chunk_bytes=0`` (``pdkv-workers``):
a transfer worker runs its chunk while the scheduler sleeps, the path before a waiting scheduler ran
a lone small chunk itself; the two in one run are the before and after of that change.

``--checksum``: each round also runs a pdkv room with ``PDKV_KV_CHECKSUM`` on both transports
(``pdkv+checksum``: the prefill computes a checksum per (buffer, page) of what it sends, the decode
checks its pages before Success), right before or after the plain room (the order turns each
round), and a ``checksum`` record gives what it adds to send -> decode Success (medians of the same
run). The first checksum room of each size is verified byte for byte too.

The first room of each size is verified byte for byte on the decode side. Memory: the largest
size's pages, per side (2.3 GB each at 512 pages).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import itertools
import math
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any, Protocol, cast

import attrs
import numpy as np
import numpy.typing as npt

from pdkv.bench._report import emit, table
from pdkv.control.channel import ChannelStatistics
from pdkv.engine import BackendKind, TransferBackend, backend_kind, make_backend
from pdkv.engine.backend import BatchHandle, BatchOutcome, WaitResult
from pdkv.engine.mooncake import (
    MooncakeBackend,
    MooncakeConfig,
    MooncakeEngineApi,
    MooncakeLogLevel,
    load_transfer_engine,
)
from pdkv.engine.nixl import NixlConfig, RawNixlWriter
from pdkv.mapping import TransferBlocks
from pdkv.protocol.ids import InstanceId, RoomId
from pdkv.protocol.messages import Message, RankCoord, TransferStatus
from pdkv.protocol.poll import KVPoll
from pdkv.testing.synthetic import Capacity, ModelSpec, RankMemory, verify_room

IntArray = npt.NDArray[np.int64]

# The one-batch method sends every block of a 512-page request (about 12,000 entries) as one engine
# batch; the engine's TCP lane queue (2,048 by default) would reject it whole, so both engines get
# the largest verified queue. pdkv's own entry budget stays at the default (see _prefill_config).
RAW_TCP_QUEUE = 16384
ENTRY_BUDGET = 2048
SHAPE_ENTRIES = (16, 64, 256, 1024, 4096)
SHAPE_IN_FLIGHT = (1, 2, 4)

PHASES = (
    "scheduler_call",
    "queue",
    "plan",
    "submit",
    "engine",
    "completion_seen",
    "status_sent",
    "prefill_poll",
    "status_received",
    "decode_poll",
)

CPU_PHASES = ("scheduler_call", "plan", "submit", "engine", "completion_seen", "status_sent")
"""The phases that begin and end on one prefill thread, whose CPU time is measured (``Timeline.cpu``):
the scheduler's ``send()``, then the transfer worker's steps (``engine``: what the thread that waits
for the engine spends meanwhile, a spinning status wait's cost)."""


# ----------------------------------------------------------------------------- the workload


def place_pages(
    pages: int, run_fraction: float, max_run: int, rng: np.random.Generator
) -> tuple[IntArray, IntArray]:
    """Pool pages per position on each side: ``run_fraction`` of positions in runs of 2..``max_run``
    (contiguous on both sides), the rest single pages; segments in independent random orders."""
    in_runs = round(pages * run_fraction)
    lengths: list[int] = []
    while sum(lengths) < in_runs:
        lengths.append(min(int(rng.integers(2, max_run + 1)), in_runs - sum(lengths)))
    lengths += [1] * (pages - sum(lengths))
    segment_lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(segment_lengths)[:-1]]).astype(np.int64)
    segment_of = np.repeat(np.arange(len(lengths)), segment_lengths)

    def layout(order: IntArray) -> IntArray:
        pool_start = np.empty(len(lengths), dtype=np.int64)
        pool_start[order] = np.concatenate([[0], np.cumsum(segment_lengths[order])[:-1]])
        result: IntArray = pool_start[segment_of] + (np.arange(pages) - starts[segment_of])
        return result

    return layout(rng.permutation(len(lengths))), layout(rng.permutation(len(lengths)))


def run_blocks(
    src_pages: IntArray,
    dst_pages: IntArray,
    src_bases: Sequence[int],
    dst_bases: Sequence[int],
    page_bytes: int,
) -> TransferBlocks:
    """One block per maximal run contiguous on both sides, layer after layer (what ``plan_chunk``
    produces for the KV of a whole request)."""
    breaks = np.flatnonzero((np.diff(src_pages) != 1) | (np.diff(dst_pages) != 1)) + 1
    starts = np.concatenate([[0], breaks]).astype(np.int64)
    lengths = np.diff(np.concatenate([starts, [src_pages.size]])) * page_bytes
    layers = len(src_bases)
    src0 = np.asarray(src_bases, dtype=np.int64)[:, None]
    dst0 = np.asarray(dst_bases, dtype=np.int64)[:, None]
    return TransferBlocks(
        src=(src0 + src_pages[starts] * page_bytes).ravel(),
        dst=(dst0 + dst_pages[starts] * page_bytes).ravel(),
        length=np.tile(lengths, layers),
        buffer=np.repeat(np.arange(layers), starts.size),
    )


# ----------------------------------------------------------------------------- instrumentation


class TimedLock:
    """The prefill transport's lock, wrapped: how long each thread group waited for it and held it
    (while ``recording``). Every room's state is behind this one lock, so its hold times bound how
    fast rooms can go through a rank, and its waits are time a thread spent behind another.
    ``contended`` counts the acquisitions that found it held (always, recording or not): each is one
    more hand-off, the thread sleeps until the holder's release wakes it."""

    def __init__(self, inner: threading.Lock) -> None:
        self._inner = inner
        self.recording = False
        self.contended = 0
        self.holds: dict[str, list[float]] = {}
        self.waits: dict[str, list[float]] = {}
        self._since = threading.local()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        asked = time.perf_counter()
        got = self._inner.acquire(False)
        if not got and blocking:
            self.contended += 1
            got = self._inner.acquire(True, timeout)
        if got:
            self._since.at = now = time.perf_counter()
            if self.recording and blocking:
                self.waits.setdefault(_lock_group(), []).append(now - asked)
        return got

    def release(self) -> None:
        held = time.perf_counter() - getattr(self._since, "at", time.perf_counter())
        self._inner.release()
        if self.recording:
            self.holds.setdefault(_lock_group(), []).append(held)

    def locked(self) -> bool:
        return self._inner.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *_: object) -> None:
        self.release()


def _lock_group() -> str:
    name = threading.current_thread().name
    if name.startswith("pdkv-transfer"):
        return "transfer worker"
    if name.startswith("pdkv-prefill"):
        return "control loop"
    return "scheduler" if name == "MainThread" else "other"


# The phase a mark of the scheduler's thread begins, for the call count (None: the count stops).
_COUNTED_AFTER: dict[str, str | None] = {
    "send_call": "scheduler_call",
    "send_returned": "queue",
    "plan_start": "plan",
    "plan_end": "submit",
    "launch": "engine",
    "engine_done": "completion_seen",
    "wait_returned": "status_sent",
    "status_sent": None,
}
CALL_ROOMS = 3
"""Rooms of each size whose calls are counted (``CallCounter``), after the timed rounds."""
CALL_ATTEMPTS = 3 * CALL_ROOMS
"""Most rooms run to count ``CALL_ROOMS`` whose every phase stayed on the scheduler's thread: one
whose status another thread sent is not counted (a control thread that flushed the outbox as the
status was posted, a worker that took the chunk first), and another room is run instead."""
COUNTED_PHASES = ("scheduler_call", "queue", "plan", "submit", "engine", "completion_seen", "status_sent")


class CallCounter:
    """How many Python function calls (and calls of C functions from Python) one thread makes in each
    phase of a room, ``send()`` to the status sent: a measure of the fixed cost that, unlike a time,
    does not move with the machine's load. The bench's own instrumentation is not counted: an event
    is left out when, walking up from the frame that makes it, a frame of this module comes before
    any other frame of pdkv (a timing wrapper's inner pdkv call is counted; its marks are not).

    ``sys.setprofile`` on the thread that calls ``start``: the phases run elsewhere (a transfer
    worker's) are not seen, and ``complete`` says whether every phase's mark came from this thread."""

    def __init__(self) -> None:
        self._thread = threading.get_ident()
        self._phase: str | None = None
        self.calls: dict[str, int] = dict.fromkeys(COUNTED_PHASES, 0)
        self._marked: set[str] = set()
        self._here = os.path.normcase(__file__)
        self._package = os.path.dirname(os.path.dirname(self._here))

    @property
    def complete(self) -> bool:
        """Every phase began with a mark made on the counted thread."""
        return set(COUNTED_PHASES) <= self._marked

    def marked(self, name: str) -> None:
        if threading.get_ident() != self._thread or name not in _COUNTED_AFTER:
            return
        self._phase = _COUNTED_AFTER[name]
        if self._phase is not None:
            self._marked.add(self._phase)

    def start(self) -> None:
        sys.setprofile(self._event)

    def stop(self) -> None:
        sys.setprofile(None)

    def _event(self, frame: Any, event: str, _: object) -> None:
        phase = self._phase
        if phase is None or event not in ("call", "c_call"):
            return
        walked: Any = frame
        for _level in range(4):
            if walked is None:
                break
            path = walked.f_code.co_filename
            if path == self._here:
                return  # the bench's instrumentation
            if path.startswith(self._package):
                break  # pdkv's own code, or what it called
            walked = walked.f_back
        self.calls[phase] += 1


def time_lock(transport: Any) -> TimedLock:
    """Put a ``TimedLock`` around ``transport``'s endpoint lock before it starts: instrumentation of
    this bench only, through the transport's private field."""
    lock = TimedLock(transport._lock)
    setattr(transport, "_lock", lock)  # noqa: B010
    return lock


def thread_id() -> str:
    """Who runs a step, for the hand-off count: this process and thread (``pid/name``)."""
    return f"{os.getpid()}/{threading.current_thread().name}"


@attrs.frozen
class _Mark:
    at: float
    """``time.monotonic`` (or the time given to ``mark``)."""
    thread: str
    """``thread_id`` of the thread that marked it."""
    cpu: float
    """That thread's ``time.thread_time`` when it marked."""


class Timeline:
    """Named timestamps (``time.monotonic``) of the room in progress, each with the thread that marked
    it (``thread_id``) and that thread's CPU time then; any thread may mark."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._marks: dict[str, list[_Mark]] = {}
        self.listener: Callable[[str], None] | None = None
        """Told each mark's name as it is made, on the marking thread (``CallCounter.marked``)."""

    def reset(self) -> None:
        with self._lock:
            self._marks = {}

    def mark(self, name: str, at: float | None = None) -> None:
        when = time.monotonic() if at is None else at
        mark = _Mark(when, thread_id(), time.thread_time())
        with self._lock:
            self._marks.setdefault(name, []).append(mark)
        if self.listener is not None:
            self.listener(name)

    def first(self, name: str) -> float | None:
        with self._lock:
            marks = self._marks.get(name)
            return marks[0].at if marks else None

    def last(self, name: str, before: float | None = None) -> float | None:
        """The latest mark ``name`` (at or before ``before`` if given)."""
        with self._lock:
            marks = [m.at for m in self._marks.get(name, ()) if before is None or m.at <= before]
            return marks[-1] if marks else None

    def cpu(self, start: str, end: str, *, first_start: bool = False, first_end: bool = False) -> float:
        """CPU seconds the thread that marked ``start`` (its last mark, or ``first_start``) spent until it
        marked ``end`` (its last, or ``first_end``); NaN when either is missing or another thread marked
        ``end``: a thread's CPU clock says nothing about a step that moved to another thread."""
        with self._lock:
            starts, ends = self._marks.get(start), self._marks.get(end)
            if not starts or not ends:
                return math.nan
            begin, finish = starts[0 if first_start else -1], ends[0 if first_end else -1]
        if begin.thread != finish.thread or finish.at < begin.at:
            return math.nan
        return max(0.0, finish.cpu - begin.cpu)

    def thread(self, name: str, *, first: bool = False) -> str | None:
        """The thread that made the last (or ``first``) mark ``name``."""
        with self._lock:
            marks = self._marks.get(name)
            return None if not marks else marks[0 if first else -1].thread


class TimedEngine:
    """A Mooncake engine that marks each batch launch and each status call's return."""

    def __init__(self, inner: MooncakeEngineApi, timeline: Timeline) -> None:
        self.inner = inner
        self._timeline = timeline

    def initialize(
        self, local_hostname: str, metadata_server: str, protocol: str, device_name: str, /
    ) -> int:
        return self.inner.initialize(local_hostname, metadata_server, protocol, device_name)

    def get_rpc_port(self) -> int:
        return self.inner.get_rpc_port()

    def register_memory(self, buffer_addr: int, capacity: int, /) -> int:
        return self.inner.register_memory(buffer_addr, capacity)

    def unregister_memory(self, buffer_addr: int, /) -> int:
        return self.inner.unregister_memory(buffer_addr)

    def batch_transfer_async_write(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        /,
    ) -> int:
        self._timeline.mark("launch")
        return self.inner.batch_transfer_async_write(target_hostname, buffers, peer_buffer_addresses, lengths)

    def get_batch_transfer_status(self, batch_ids: list[int], /) -> int:
        status = self.inner.get_batch_transfer_status(batch_ids)
        self._timeline.mark("engine_done")
        return status

    def __getattr__(self, name: str) -> Any:
        # Whatever else the backend may call (e.g. a non-blocking status check) goes to the engine;
        # a status check that says "done" is the engine's end for the breakdown too.
        attribute = getattr(self.inner, name)
        if name != "transfer_check_status":
            return attribute

        def check(batch_id: int, /) -> int:
            status = int(attribute(batch_id))
            if status != 0:
                self._timeline.mark("engine_done")
            return status

        return check


class TimedBackend(MooncakeBackend):
    """The Mooncake backend, marking when the executor submits and when its waits return."""

    def __init__(self, config: MooncakeConfig, timeline: Timeline) -> None:
        self.timeline = timeline
        engine_class = load_transfer_engine()
        self.raw_engine: RawEngine | None = None

        def make() -> MooncakeEngineApi:
            inner = cast(RawEngine, engine_class())
            self.raw_engine = inner
            return TimedEngine(inner, timeline)

        super().__init__(config, engine_class=make)

    def submit_write(self, peer: str, batch: TransferBlocks) -> BatchHandle:
        self.timeline.mark("submit")
        return super().submit_write(peer, batch)

    def wait(self, handles: Sequence[BatchHandle], timeout: float | None = None) -> WaitResult:
        result = super().wait(handles, timeout)
        self.timeline.mark("wait_returned")
        return result

    def write_outcome(
        self, peer: str, batch: TransferBlocks, *, timeout: float | None = None
    ) -> BatchOutcome:
        # A write the backend makes on this thread passes neither method above: marked here (when
        # it goes through them after all, their later marks are the ones read).
        self.timeline.mark("submit")
        outcome = super().write_outcome(peer, batch, timeout=timeout)
        self.timeline.mark("wait_returned")
        return outcome


class TimedChannel:
    """A control channel that marks TransferStatus going out and coming in (``pdkv.control`` inside)."""

    def __init__(self, inner: Any, timeline: Timeline) -> None:
        self._inner = inner
        self._timeline = timeline
        self.received_status: dict[int, tuple[float, str]] = {}
        """Room -> when its TransferStatus came out of the channel, and the thread that took it."""

    @property
    def address(self) -> str:
        return str(self._inner.address)

    def send(self, to: str, message: Message) -> object:
        if isinstance(message, TransferStatus):
            self._timeline.mark("status_sent")  # before: the peer may have it before send() returns
        return self._inner.send(to, message)

    def wait(self, timeout_s: float | None) -> list[Message]:
        messages: list[Message] = self._inner.wait(timeout_s)
        now = time.monotonic()
        for message in messages:
            if isinstance(message, TransferStatus):
                self.received_status[int(message.room)] = (now, thread_id())
        return messages

    def wake(self) -> None:
        self._inner.wake()

    def forget(self, endpoint: str) -> object:
        return self._inner.forget(endpoint)

    def close(self, *, flush_s: float = 0.0) -> None:
        self._inner.close(flush_s=flush_s)

    def statistics(self) -> ChannelStatistics:
        stats: ChannelStatistics = self._inner.statistics()
        return stats


def timed_channel_factory(timeline: Timeline, made: list[TimedChannel]) -> Callable[[str], TimedChannel]:
    from pdkv.runtime.channels import control_channel_factory

    base = control_channel_factory()

    def make(host: str) -> TimedChannel:
        channel = TimedChannel(base(host), timeline)
        made.append(channel)
        return channel

    return make


@contextlib.contextmanager
def timed_planning(timeline: Timeline) -> Iterator[None]:
    """Mark the start and end of every ``plan_chunk`` the prefill transport's workers call."""
    import pdkv.runtime.prefill as prefill_module

    original = prefill_module.__dict__["plan_chunk"]

    def plan_chunk(*args: Any, **kwargs: Any) -> Any:
        timeline.mark("plan_start")
        try:
            return original(*args, **kwargs)
        finally:
            timeline.mark("plan_end")

    setattr(prefill_module, "plan_chunk", plan_chunk)  # noqa: B010 (mypy: a module function)
    try:
        yield
    finally:
        setattr(prefill_module, "plan_chunk", original)  # noqa: B010


class Waits(Protocol):
    """What a transport offers a scheduler that waits between polls (``EndpointHost.wait_progress``)."""

    def progress(self) -> int: ...

    def wait_progress(self, seen: int, timeout_s: float) -> int: ...


def wait_poll(
    poll: Callable[[], KVPoll],
    wanted: tuple[KVPoll, ...],
    interval_s: float,
    timeout_s: float,
    progress: Waits | None = None,
) -> KVPoll:
    """Poll like a scheduler loop until the poll is one of ``wanted`` (or Failed); raise on timeout.
    Between polls it waits for ``progress`` (at most ``interval_s``), or sleeps ``interval_s``."""
    deadline = time.monotonic() + timeout_s
    seen = 0 if progress is None else progress.progress()
    while True:
        value = poll()
        if value in wanted or value is KVPoll.Failed:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"poll stayed {value.name} for {timeout_s:g} s")
        if progress is None:
            time.sleep(interval_s)
        else:
            seen = progress.wait_progress(seen, interval_s)


class InterpreterLoad:
    """Threads that keep this process's interpreter busy in Python, as a serving engine's scheduler
    is between its polls (batch building, sampling, detokenising): every thread of pdkv that gives up
    the interpreter lock (a socket send, an engine call, a wait) then waits for it back, up to the
    switch interval (``sys.setswitchinterval``, 5 ms by default). ``threads`` 0: no load."""

    def __init__(self, threads: int) -> None:
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._spin, name=f"pdkv-bench-load-{n}", daemon=True)
            for n in range(threads)
        ]

    def _spin(self) -> None:
        total = 0
        while not self._stop.is_set():
            for value in range(1000):  # pure Python: holds the interpreter lock until asked to switch
                total += value * value

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(5)


@contextlib.contextmanager
def switch_interval(microseconds: float | None) -> Iterator[None]:
    """This process's interpreter switch interval for the block (None: leave it), restored after."""
    previous = sys.getswitchinterval()
    if microseconds is not None:
        sys.setswitchinterval(microseconds / 1e6)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


# ----------------------------------------------------------------------------- the decode rank


@attrs.frozen(kw_only=True)
class _DecodeArgs:
    model: ModelSpec
    capacity: Capacity
    registry: str
    poll_s: float
    wake: bool
    load_threads: int
    switch_interval_us: float | None
    backend: str = "mooncake"
    ucx_tls: str | None = None


@attrs.frozen(kw_only=True)
class DecodeRoomReport:
    room: int
    poll: int
    failure: str
    init_at: float
    status_received_at: float
    success_at: float
    verified: bool | None
    checksum_verified: bool = False
    """The decode checked the room's pages against the prefill's checksums before Success."""
    status_thread: str = ""
    """The thread that took the TransferStatus off the control channel (``thread_id``)."""
    success_thread: str = ""
    """The decode scheduler's thread, whose poll saw Success."""
    lock_contended: int = 0
    """Acquisitions of the decode transport's lock that found it held, from init to Success."""


def _decode_main(args: _DecodeArgs, conn: Connection) -> None:
    try:
        with switch_interval(args.switch_interval_us):
            _decode_rank(args, conn)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


def _decode_rank(args: _DecodeArgs, conn: Connection) -> None:
    from pdkv.runtime.decode import DecodeConfig, DecodeTransport

    memory = RankMemory(args.model, args.capacity)
    backend = make_backend(args.backend, mooncake=_engine_config(), nixl=_nixl_config(args.ucx_tls))
    timeline = Timeline()
    channels: list[TimedChannel] = []
    transport = DecodeTransport(
        DecodeConfig.from_env(  # PDKV_WAIT_RECEIVES and the like, if set
            instance=InstanceId("decode-0"), rank=RankCoord(tp=0), tp_size=1, layout=memory.layout
        ),
        backend,
        channel_factory=timed_channel_factory(timeline, channels),
    )
    lock = time_lock(transport)
    load = InterpreterLoad(args.load_threads)
    try:
        transport.start()
        gc.freeze()  # as serving engines do after start-up: the start-up heap is never scanned again
        prefill = transport.connect(args.registry, timeout_s=60)
        if not transport.wait_registered(prefill, timeout_s=60):
            raise RuntimeError("the prefill rank did not acknowledge registration")
        bases = [memory.tensors[key].data_ptr() for key in args.model.kv_keys()]
        load.start()
        conn.send(("ready", backend.session_id, bases, backend.engine_metadata))
        while True:
            command = conn.recv()
            if command[0] == "stop":
                break
            _, room, dst_pages, aux_row, verify_src, checksum = command
            transport.set_kv_checksum(checksum)
            verified_before = transport.statistics().endpoint.rooms_verified
            if verify_src is not None:
                memory.clear_pages(dst_pages)
            receiver = transport.receiver(RoomId(room), prefill)
            contended = lock.contended
            init_at = time.monotonic()
            receiver.init(dst_pages, aux_row)
            waits = transport if args.wake else None
            poll = wait_poll(receiver.poll, (KVPoll.Success,), args.poll_s, 120, waits)
            success_at = time.monotonic()
            contended = lock.contended - contended
            verified: bool | None = None
            if verify_src is not None and poll is KVPoll.Success:
                _, mismatches = verify_room(
                    memory,
                    logical_ids=verify_src,
                    dst_pages=dst_pages,
                    prefix_pages=0,
                    state_src={},
                    state_dst={},
                    aux_src=aux_row,
                    aux_dst=aux_row,
                )
                verified = not mismatches
            failure = str(receiver.failure() or "")
            deadline = time.monotonic() + 60
            while poll is KVPoll.Failed and not receiver.release_ready() and time.monotonic() < deadline:
                time.sleep(args.poll_s)
            receiver.clear()
            received, status_thread = (
                channels[0].received_status.pop(room, (success_at, "")) if channels else (success_at, "")
            )
            conn.send(
                (
                    "done",
                    DecodeRoomReport(
                        checksum_verified=transport.statistics().endpoint.rooms_verified > verified_before,
                        room=room,
                        poll=int(poll),
                        failure=failure,
                        init_at=init_at,
                        status_received_at=received,
                        success_at=success_at,
                        verified=verified,
                        status_thread=status_thread,
                        success_thread=thread_id(),
                        lock_contended=contended,
                    ),
                )
            )
    finally:
        load.stop()
        transport.close()
        backend.close()


def _nixl_config(ucx_tls: str | None) -> NixlConfig:
    return NixlConfig(ucx_tls=ucx_tls or "all", ucx_net_devices="lo", log_level="ERROR")


def _engine_config() -> MooncakeConfig:
    return MooncakeConfig(
        log_level=MooncakeLogLevel.ERROR,
        tcp_max_queued_transfers_per_peer=RAW_TCP_QUEUE,
        max_entries_in_flight=ENTRY_BUDGET,
    )


# ----------------------------------------------------------------------------- the raw engine


class RawEngine(MooncakeEngineApi, Protocol):
    """The engine calls the raw methods make (``mooncake.engine.TransferEngine``)."""

    def batch_transfer_sync_write(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        /,
    ) -> int: ...


@attrs.frozen
class RawShape:
    entries: int
    in_flight: int


@attrs.frozen
class RawBlocks:
    """The block list as the engine binding takes it (Python lists, converted once, outside timing)."""

    src: list[int]
    dst: list[int]
    length: list[int]

    @classmethod
    def of(cls, blocks: TransferBlocks) -> RawBlocks:
        return cls(blocks.src.tolist(), blocks.dst.tolist(), blocks.length.tolist())

    def __len__(self) -> int:
        return len(self.src)


def raw_one_batch(engine: RawEngine, peer: str, blocks: RawBlocks) -> None:
    """Every block in one engine batch, waited for by the engine (SGLang's ``batch_transfer_sync``)."""
    status = engine.batch_transfer_sync_write(peer, blocks.src, blocks.dst, blocks.length)
    if status != 0:
        raise RuntimeError(f"raw one-batch transfer failed: status {status}")


def raw_shaped(engine: MooncakeEngineApi, peer: str, blocks: RawBlocks, shape: RawShape) -> None:
    """Batches of ``shape.entries`` blocks, ``shape.in_flight`` at a time, oldest waited first."""
    pending: deque[int] = deque()
    for start in range(0, len(blocks), shape.entries):
        if len(pending) == shape.in_flight:
            _raw_wait(engine, [pending.popleft()])
        end = start + shape.entries
        batch = engine.batch_transfer_async_write(
            peer, blocks.src[start:end], blocks.dst[start:end], blocks.length[start:end]
        )
        if batch <= 0:
            raise RuntimeError(f"raw shaped transfer refused: batch id {batch}")
        pending.append(batch)
    if pending:
        _raw_wait(engine, list(pending))


def _raw_wait(engine: MooncakeEngineApi, batches: list[int]) -> None:
    status = engine.get_batch_transfer_status(batches)
    if status != 0:
        raise RuntimeError(f"raw shaped transfer failed: status {status}")


def shapes_for(entries: int) -> list[RawShape]:
    """The sweep: entries per batch (those below the block count, then all) x batches in flight."""
    sizes = [e for e in SHAPE_ENTRIES if e < entries] + [entries]
    return [RawShape(e, k) for e in sizes for k in SHAPE_IN_FLIGHT if k == 1 or e < entries]


def pick_shape(engine: MooncakeEngineApi, peer: str, blocks: RawBlocks, tries: int) -> tuple[RawShape, float]:
    """The fastest shape of the sweep (best of ``tries`` runs each) and its time."""
    best: tuple[RawShape, float] | None = None
    for shape in shapes_for(len(blocks)):
        run = functools.partial(raw_shaped, engine, peer, blocks, shape)
        seconds = min(_timed(run) for _ in range(tries))
        if best is None or seconds < best[1]:
            best = (shape, seconds)
    assert best is not None
    return best


def _timed(run: Callable[[], None]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


# ----------------------------------------------------------------------------- the bench

ENGINE_THREADS = "mooncake transfer threads"
ZMQ_SENDER = "zmq I/O thread (prefill)"
ZMQ_RECEIVER = "zmq I/O thread (decode)"


@attrs.frozen(kw_only=True)
class HandOffs:
    """The hand-offs between threads and processes on the path of one room, counted from the threads
    that ran each step (``Timeline`` marks, the decode's report), with the native threads in between
    by construction: Mooncake moves the bytes on its own transfer threads (launch -> its threads ->
    the status call that returns), and a zmq channel sends and receives on each context's I/O thread
    (the sender's thread -> its I/O thread -> over TCP to the peer's I/O thread -> the receiving
    thread); a stream channel's sender writes to the kernel and the receiving thread reads from it.
    An acquisition of a transport lock that found it held is one more (the thread sleeps until the
    holder's release wakes it)."""

    path: tuple[tuple[str, str], ...]
    """(step, thread) from ``send()`` to the decode scheduler seeing Success, native threads included."""
    to_decode: int
    """Changes of thread along ``path``."""
    to_prefill: int
    """Changes of thread from ``send()`` to the status sent, then to the prefill scheduler's poll."""
    native: int
    """Of ``to_decode``: into and out of the engine's and zmq's threads (by construction)."""
    prefill_lock_waits: int
    decode_lock_waits: int

    @property
    def total(self) -> int:
        """``to_decode`` plus the lock waits of both sides: the hand-offs of a 1-page room."""
        return self.to_decode + self.prefill_lock_waits + self.decode_lock_waits


def _changes(threads: Sequence[str]) -> int:
    return sum(a != b for a, b in itertools.pairwise(threads))


def hand_offs(
    timeline: Timeline,
    decode: DecodeRoomReport,
    *,
    prefill_scheduler: str,
    prefill_contended: int,
    channel: str = "stream",
) -> HandOffs | None:
    """The room's ``HandOffs`` from its marks; None when a step was not marked (an untimed engine).
    ``channel``: the control channel's kind (zmq's adds its two I/O threads to the path)."""
    zmq_threads = channel == "zmq"
    steps = (
        ("send()", timeline.thread("send_call")),
        ("plan", timeline.thread("plan_start", first=True)),
        ("engine launch", timeline.thread("launch", first=True)),
        ("bytes moved", ENGINE_THREADS),
        ("engine status returned", timeline.thread("engine_done")),
        ("executor wait returned", timeline.thread("wait_returned")),
        ("status sent", timeline.thread("status_sent")),
        *((("status on the wire", ZMQ_SENDER), ("status off the wire", ZMQ_RECEIVER)) if zmq_threads else ()),
        ("status received", decode.status_thread or None),
        ("decode poll sees Success", decode.success_thread or None),
    )
    path = tuple((step, who) for step, who in steps if who is not None)
    if len(path) != len(steps):
        return None
    threads = [who for _, who in path]
    sent = [step for step, _ in path].index("status sent") + 1
    native = {ENGINE_THREADS, ZMQ_SENDER, ZMQ_RECEIVER}
    return HandOffs(
        path=path,
        to_decode=_changes(threads),
        to_prefill=_changes([*threads[:sent], prefill_scheduler]),
        native=sum(a != b and (a in native or b in native) for a, b in itertools.pairwise(threads)),
        prefill_lock_waits=prefill_contended,
        decode_lock_waits=decode.lock_contended,
    )


@attrs.frozen(kw_only=True)
class RoomTiming:
    """One pdkv room: the totals and the phases (seconds)."""

    to_prefill_success: float
    to_decode_success: float
    phases: dict[str, float]
    verified: bool | None
    phase_cpu: dict[str, float] = attrs.field(factory=dict)
    """CPU seconds of the ``CPU_PHASES`` on their prefill thread (NaN where a phase changed thread)."""
    checksum_verified: bool = False
    hand_offs: HandOffs | None = None
    """The thread and process hand-offs of this room (None: a backend whose engine is not timed)."""


@attrs.define
class SizeRuns:
    pages: int
    blocks: TransferBlocks
    raw: RawBlocks
    src_pages: IntArray
    dst_pages: IntArray
    shape: RawShape = RawShape(1, 1)
    rooms: dict[str, list[RoomTiming]] = attrs.Factory(dict)
    one_batch: list[float] = attrs.Factory(list)
    best_shape: list[float] = attrs.Factory(list)
    calls: list[CallCounter] = attrs.Factory(list)
    """The counted rooms (``CallCounter``), run after the timed ones."""


class Progress:
    """One status line on stderr, rewritten in place on a terminal, a line per step otherwise."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()

    def show(self, text: str) -> None:
        if self.tty:
            print(f"\r  {text:<78}", end="", file=sys.stderr, flush=True)
        else:
            print(f"  {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr, flush=True)


def _phases(
    timeline: Timeline,
    sent_at: float,
    returned_at: float,
    prefill_success_at: float,
    decode: DecodeRoomReport,
) -> dict[str, float]:
    """Each phase of one room (seconds). ``prefill_poll`` (the status sent -> the prefill scheduler
    sees Success) runs beside the two after it, which end on the decode side."""

    def gap(start: float | None, end: float | None) -> float:
        return max(0.0, end - start) if start is not None and end is not None else float("nan")

    return {
        "scheduler_call": returned_at - sent_at,
        "queue": gap(returned_at, timeline.first("plan_start")),
        "plan": gap(timeline.first("plan_start"), timeline.last("plan_end")),
        "submit": gap(timeline.last("plan_end"), timeline.first("launch")),
        "engine": gap(timeline.first("launch"), timeline.last("engine_done")),
        "completion_seen": gap(timeline.last("engine_done"), timeline.last("wait_returned")),
        "status_sent": gap(timeline.last("wait_returned"), timeline.last("status_sent")),
        "prefill_poll": gap(timeline.last("status_sent"), prefill_success_at),
        "status_received": gap(timeline.last("status_sent"), decode.status_received_at),
        "decode_poll": gap(decode.status_received_at, decode.success_at),
    }


def _phase_cpu(timeline: Timeline) -> dict[str, float]:
    """The thread CPU seconds of each of ``CPU_PHASES`` in one room, marked as ``_phases`` marks
    them; NaN for a phase whose end another thread marked (a launch by the lane's own launcher)."""
    return {
        "scheduler_call": timeline.cpu("send_call", "send_returned"),
        "plan": timeline.cpu("plan_start", "plan_end", first_start=True),
        "submit": timeline.cpu("plan_end", "launch", first_end=True),
        "engine": timeline.cpu("launch", "engine_done", first_start=True),
        "completion_seen": timeline.cpu("engine_done", "wait_returned"),
        "status_sent": timeline.cpu("wait_returned", "status_sent"),
    }


def _stats(values: Sequence[float]) -> dict[str, float]:
    finite = [v for v in values if v == v]
    if not finite:
        return {"min": float("nan"), "median": float("nan"), "mean": float("nan")}
    return {"min": min(finite), "median": statistics.median(finite), "mean": statistics.fmean(finite)}


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="pdkv bench latency", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", default="1,16,128,512", help="request sizes in pages (comma-separated)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds of the three methods")
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--bytes-per-token", type=int, default=1152)
    parser.add_argument("--run-fraction", type=float, default=0.7)
    parser.add_argument("--max-run", type=int, default=16)
    parser.add_argument(
        "--sweep-tries", type=int, default=2, help="runs per shape in the raw sweep (best kept)"
    )
    parser.add_argument(
        "--poll-us",
        type=float,
        default=None,
        help="the schedulers' longest wait between two polls (default: 5,000 waiting for progress, "
        "100 with --sleep-poll)",
    )
    parser.add_argument(
        "--sleep-poll",
        action="store_true",
        help="the schedulers sleep --poll-us between polls instead of waiting for the transport's progress",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-verify", action="store_true", help="skip the byte check of each size's first room"
    )
    parser.add_argument(
        "--ab-pacing",
        action="store_true",
        help="also run each pdkv room with the backend's status waits unpaced (spinning from launch)",
    )
    parser.add_argument(
        "--ab-workers",
        action="store_true",
        help="also run each pdkv room with PDKV_WAIT_RUNS_CHUNK_BYTES=0 (pdkv-workers: a transfer "
        "worker runs the chunk while the scheduler sleeps, as before the waiting scheduler ran it)",
    )
    parser.add_argument(
        "--load-threads",
        type=int,
        default=0,
        help="threads per process kept busy in Python from the decode rank's start on, as a serving "
        "engine's scheduler is (default 0)",
    )
    parser.add_argument(
        "--switch-interval-us",
        type=float,
        default=None,
        help="both processes' interpreter switch interval (sys.setswitchinterval; default: Python's 5,000)",
    )
    parser.add_argument(
        "--checksum",
        action="store_true",
        help="also run each pdkv room with PDKV_KV_CHECKSUM on both transports, and report what it adds",
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny run for tests: 4 layers, sizes 1 and 4, 2 rounds"
    )
    parser.add_argument(
        "--backend",
        choices=("mooncake", "nixl"),
        default=None,
        help="nixl: pdkv over NIXL beside pdkv over Mooncake and the raw NIXL agent, in one run "
        "(default: PDKV_BACKEND, else mooncake)",
    )
    parser.add_argument("--ucx-tls", default="all", help="--backend nixl: UCX_TLS (all: cma + tcp here; tcp)")
    parser.add_argument(
        "--cpu-seconds", type=float, default=3.0, help="--backend nixl: length of each CPU measurement"
    )
    args = parser.parse_args(list(argv))
    if args.quick:
        args.layers, args.sizes, args.repeats, args.sweep_tries = 4, "1,4", 2, 1
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if not sizes or min(sizes) < 1 or args.repeats < 1:
        parser.error("--sizes must list positive page counts and --repeats must be >= 1")
    if args.load_threads < 0 or (args.switch_interval_us is not None and args.switch_interval_us <= 0):
        parser.error("--load-threads must be >= 0 and --switch-interval-us > 0")
    with switch_interval(args.switch_interval_us):
        if backend_kind(args.backend) is BackendKind.NIXL:
            return _measure_engines(args, sizes)
        return _measure(args, sizes)


@attrs.frozen(kw_only=True)
class _DecodeOptions:
    """How the decode rank's scheduler waits between polls, and its interpreter's load and switching."""

    poll_s: float = 0.005
    wake: bool = True
    load_threads: int = 0
    switch_interval_us: float | None = None


@attrs.frozen(kw_only=True)
class RankPair:
    """A started prefill transport over Mooncake in this process and a decode rank registered with it
    in a spawned one (``_decode_main``: it runs the rooms ``_pdkv_room`` sends it)."""

    memory: RankMemory
    backend: TimedBackend
    transport: Any
    """The ``PrefillTransport`` (imported where it is started, as the rest of this module does)."""
    lock: TimedLock
    conn: Connection
    child: Any
    peer: str
    """The decode rank's engine session, for raw writes to it."""
    dst_bases: list[int]
    """The decode rank's KV buffer addresses, in ``ModelSpec.kv_keys`` order."""

    @property
    def raw_engine(self) -> RawEngine:
        """This process's own Mooncake engine, with the prefill memory registered: no pdkv code."""
        engine = self.backend.raw_engine
        assert engine is not None, "the backend makes its engine when the transport starts"
        return engine


@contextlib.contextmanager
def rank_pair(
    model: ModelSpec,
    capacity: Capacity,
    timeline: Timeline,
    decode: _DecodeOptions,
    progress: Progress,
) -> Iterator[RankPair]:
    """The two ranks of this bench, up and registered; on exit the decode rank is told to stop (killed
    if it does not within 30 s), and the registry and both transports are closed."""
    from pdkv.runtime.channels import start_registry
    from pdkv.runtime.prefill import PrefillConfig, PrefillTransport

    memory = RankMemory(model, capacity)
    memory.fill_prefill(cp_rank=0, policy=_policy())
    registry = start_registry(instance=InstanceId("prefill-0"), tp_size=1, cp_size=1)
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    child: Any = None
    try:
        backend = TimedBackend(_engine_config(), timeline)
        prefill_channels: list[TimedChannel] = []
        transport = PrefillTransport(
            PrefillConfig.from_env(  # PDKV_WAIT_RECEIVES and the like, if set
                instance=InstanceId("prefill-0"),
                rank=RankCoord(tp=0),
                tp_size=1,
                layout=memory.layout,
                registry=registry.address,
            ),
            backend,
            channel_factory=timed_channel_factory(timeline, prefill_channels),
        )
        lock = time_lock(transport)
        with backend, transport:
            gc.freeze()  # as serving engines do after start-up (the decode process does the same)
            progress.show("starting the decode rank process ...")
            child = ctx.Process(
                target=_decode_main,
                args=(
                    _DecodeArgs(
                        model=model,
                        capacity=capacity,
                        registry=registry.address,
                        poll_s=decode.poll_s,
                        wake=decode.wake,
                        load_threads=decode.load_threads,
                        switch_interval_us=decode.switch_interval_us,
                    ),
                    child_conn,
                ),
                name="pdkv-bench-decode",
                daemon=True,
            )
            child.start()
            child_conn.close()
            _, peer, dst_bases, _ = _receive(parent_conn, child, 180)
            yield RankPair(
                memory=memory,
                backend=backend,
                transport=transport,
                lock=lock,
                conn=parent_conn,
                child=child,
                peer=peer,
                dst_bases=dst_bases,
            )
            parent_conn.send(("stop",))
            child.join(30)
    finally:
        if child is not None and child.is_alive():
            child.kill()
            child.join(5)
        parent_conn.close()
        registry.stop()


def engine_batches(
    model: ModelSpec, *, rounds: int, idle_s: float | None = None, progress: Progress | None = None
) -> tuple[list[float], list[float]]:
    """Seconds of the raw engine's one batch (``raw_one_batch``: every block, waited for by the engine,
    as SGLang sends) of one page in every KV buffer of ``model``, ``rounds`` times one after another,
    from this process to a spawned decode rank over Mooncake TCP: the engine's own floor under a
    one-page room (the room's aux row aside). The first batch is a warm-up and is not counted.

    With ``idle_s``, then ``rounds`` more batches, each after ``idle_s`` of sleep (second list; empty
    without): the engine at a serial scheduler's pace, whose own threads have gone to sleep between
    two rooms. Back to back they are still awake: on this machine a launch then costs about 9 µs of
    CPU; after 0.8-2 ms idle, 33-37 µs, and tens of µs more before the bytes move (the wake-ups of
    the engine's threads)."""
    shown = progress or Progress()
    with rank_pair(
        model, Capacity(kv_pages=4, state_slots=1, aux_rows=4), Timeline(), _DecodeOptions(), shown
    ) as pair:
        src_bases = [pair.memory.tensors[key].data_ptr() for key in model.kv_keys()]
        one_page = np.array([1], dtype=np.int64)
        blocks = RawBlocks.of(run_blocks(one_page, one_page, src_bases, pair.dst_bases, model.kv_item_bytes))
        run = functools.partial(raw_one_batch, pair.raw_engine, pair.peer, blocks)
        run()
        seconds = [_timed(run) for _ in range(rounds)]
        paced: list[float] = []
        if idle_s is not None:
            for _ in range(rounds):
                time.sleep(idle_s)
                paced.append(_timed(run))
    if progress is None:
        shown.close()
    return seconds, paced


def _workload(args: argparse.Namespace, sizes: list[int]) -> tuple[ModelSpec, Capacity]:
    """The MLA model the arguments describe, and memory for the largest size's pages per side."""
    model = ModelSpec.kv_only(
        layers=args.layers,
        page_size=args.page_size,
        kv_bytes_per_token=args.bytes_per_token,
    )
    return model, Capacity(kv_pages=max(sizes), state_slots=1, aux_rows=4)


def _measure(args: argparse.Namespace, sizes: list[int]) -> int:
    wake = not args.sleep_poll
    poll_s = (args.poll_us if args.poll_us is not None else (5000.0 if wake else 100.0)) / 1e6
    model, capacity = _workload(args, sizes)
    page_bytes = model.kv_item_bytes
    # (name, paced status waits, checksums, the waiting scheduler may run a chunk)
    variants = [("pdkv", True, False, True)] + ([("pdkv-spin", False, False, True)] if args.ab_pacing else [])
    if args.ab_workers:
        variants.append(("pdkv-workers", True, False, False))
    if args.checksum:
        variants.append(("pdkv+checksum", True, True, True))
    progress = Progress()
    rng = np.random.default_rng(args.seed)
    runs: list[SizeRuns] = []
    verified = True
    failures: list[str] = []

    progress.show(f"filling {max(sizes)} pages x {args.layers} layers of prefill memory ...")
    timeline = Timeline()
    load = InterpreterLoad(args.load_threads)
    decode = _DecodeOptions(
        poll_s=poll_s, wake=wake, load_threads=args.load_threads, switch_interval_us=args.switch_interval_us
    )
    try:
        with rank_pair(model, capacity, timeline, decode, progress) as pair, timed_planning(timeline):
            memory, backend, transport, lock = pair.memory, pair.backend, pair.transport, pair.lock
            wait_runs = transport.config.wait_runs_chunk_bytes  # PrefillConfig's default
            parent_conn, child, peer, dst_bases = pair.conn, pair.child, pair.peer, pair.dst_bases
            load.start()
            src_bases = [memory.tensors[key].data_ptr() for key in model.kv_keys()]
            raw_engine = pair.raw_engine
            for pages in sizes:
                src_pages, dst_pages = place_pages(pages, args.run_fraction, args.max_run, rng)
                blocks = run_blocks(src_pages, dst_pages, src_bases, dst_bases, page_bytes)
                runs.append(SizeRuns(pages, blocks, RawBlocks.of(blocks), src_pages, dst_pages))
            for size in runs:
                progress.show(f"{size.pages} pages: sweeping raw shapes of {len(size.raw)} blocks ...")
                raw_one_batch(raw_engine, peer, size.raw)  # warm-up
                size.shape, _ = pick_shape(raw_engine, peer, size.raw, args.sweep_tries)
            room = 1
            for round_index in range(args.repeats):
                for size in runs:
                    progress.show(f"round {round_index + 1}/{args.repeats}: {size.pages} pages")

                    def pdkv_rooms(size: SizeRuns = size, turn: int = round_index) -> None:
                        nonlocal room, verified
                        # The order of the variants turns each round too (a room after a large one is slower).
                        order = variants if turn % 2 == 0 else variants[::-1]
                        for variant, paced, checksum, waiting_runs in order:
                            backend.config = attrs.evolve(backend.config, pace_status_waits=paced)
                            transport.set_kv_checksum(checksum)
                            transport.config = attrs.evolve(
                                transport.config, wait_runs_chunk_bytes=wait_runs if waiting_runs else 0
                            )
                            checked = variant in ("pdkv", "pdkv+checksum")
                            verify = turn == 0 and checked and not args.no_verify
                            lock.recording = True
                            timing = _pdkv_room(
                                transport,
                                parent_conn,
                                child,
                                timeline,
                                size,
                                room,
                                poll_s,
                                verify=verify,
                                wake=wake,
                                checksum=checksum,
                            )
                            lock.recording = False
                            room += 1
                            if timing is None:
                                failures.append(f"{variant} room of {size.pages} pages failed")
                                continue
                            if timing.verified is False or timing.checksum_verified is not checksum:
                                verified = False
                            size.rooms.setdefault(variant, []).append(timing)

                    def one_batch(size: SizeRuns = size) -> None:
                        size.one_batch.append(
                            _timed(functools.partial(raw_one_batch, raw_engine, peer, size.raw))
                        )

                    def best_shape(size: SizeRuns = size) -> None:
                        size.best_shape.append(
                            _timed(functools.partial(raw_shaped, raw_engine, peer, size.raw, size.shape))
                        )

                    # The order turns each round: a transfer right after a large one was measured
                    # slower here (a 1-page pdkv room after the 16-page raw runs: 5.4 ms, 4.2 ms
                    # after the 1-page ones), so no method may always follow the same one.
                    methods = [pdkv_rooms, one_batch, best_shape]
                    turn = round_index % len(methods)
                    for method in methods[turn:] + methods[:turn]:
                        method()
            # The counted rooms: the "pdkv" variant, after the timed ones (a profile hook slows them).
            backend.config = attrs.evolve(backend.config, pace_status_waits=True)
            transport.set_kv_checksum(False)
            transport.config = attrs.evolve(transport.config, wait_runs_chunk_bytes=wait_runs)
            for size in runs:
                for attempt in range(CALL_ATTEMPTS):
                    complete = sum(c.complete for c in size.calls)
                    if complete >= CALL_ROOMS or (attempt >= CALL_ROOMS and not complete):
                        break  # enough rooms counted, or this size's chunks run on a worker
                    progress.show(f"{size.pages} pages: counting the calls of a room ...")
                    counter = CallCounter()
                    timeline.listener = counter.marked
                    counter.start()
                    try:
                        timing = _pdkv_room(
                            transport,
                            parent_conn,
                            child,
                            timeline,
                            size,
                            room,
                            poll_s,
                            verify=False,
                            wake=wake,
                        )
                    finally:
                        counter.stop()
                        timeline.listener = None
                    room += 1
                    if timing is None:
                        failures.append(f"counted room of {size.pages} pages failed")
                    else:
                        size.calls.append(counter)
            progress.close()
    finally:
        load.stop()
    _report_lock(lock, sum(len(r) for size in runs for r in size.rooms.values()))
    return _report(args, runs, page_bytes, verified, failures)


def _report_lock(lock: TimedLock, rooms: int) -> None:
    """The prefill lock's holds and waits per thread group over the pdkv rooms (microseconds)."""
    rows: list[list[object]] = []
    for group in sorted(lock.holds):
        holds = np.array(lock.holds[group]) * 1e6
        waits = np.array(lock.waits.get(group, [0.0])) * 1e6
        record = {
            "holds_per_room": len(holds) / max(1, rooms),
            "hold_us_p50": float(np.percentile(holds, 50)),
            "hold_us_p99": float(np.percentile(holds, 99)),
            "hold_us_max": float(holds.max()),
            "held_us_per_room": float(holds.sum()) / max(1, rooms),
            "wait_us_p50": float(np.percentile(waits, 50)),
            "wait_us_max": float(waits.max()),
        }
        emit({"bench": "latency", "kind": "prefill_lock", "thread_group": group, **record})
        rows.append([group, *record.values()])
    table(
        f"prefill transport lock over the {rooms} pdkv rooms (µs): how often each thread group took it, "
        "how long it held it, how long it waited for it",
        [
            "thread group",
            "holds/room",
            "hold p50",
            "hold p99",
            "hold max",
            "held/room",
            "wait p50",
            "wait max",
        ],
        rows,
    )


def _policy() -> Any:
    from pdkv.mapping import PageInterleaved

    return PageInterleaved(cp_size=1)


def _receive(conn: Connection, child: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while not conn.poll(0.2):
        if not child.is_alive():
            raise RuntimeError(f"the decode rank process died (exit code {child.exitcode})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the decode rank did not answer within {timeout_s:g} s")
    message = conn.recv()
    if message[0] == "error":
        raise RuntimeError(f"the decode rank failed:\n{message[1]}")
    return message


def _pdkv_room(
    transport: Any,
    conn: Connection,
    child: Any,
    timeline: Timeline,
    size: SizeRuns,
    room: int,
    poll_s: float,
    *,
    verify: bool,
    wake: bool,
    checksum: bool = False,
) -> RoomTiming | None:
    """One room through both transports; None if it failed."""
    from pdkv.runtime.channels import channel_kind

    aux_row = room % 4
    conn.send(("room", room, size.dst_pages, aux_row, size.src_pages if verify else None, checksum))
    sender = transport.sender(RoomId(room))
    sender.init(size.pages, aux_row)
    waits = transport if wake else None
    wait_poll(sender.poll, (KVPoll.WaitingForInput, KVPoll.Transferring), poll_s, 60, waits)
    lock = getattr(transport, "_lock", None)
    contended = lock.contended if isinstance(lock, TimedLock) else 0
    timeline.reset()
    sent_at = time.monotonic()
    timeline.mark("send_call", sent_at)
    sender.send(size.src_pages, start_token=0, last=True)
    returned_at = time.monotonic()
    timeline.mark("send_returned", returned_at)
    poll = wait_poll(sender.poll, (KVPoll.Success,), poll_s, 120, waits)
    prefill_success_at = time.monotonic()
    contended = (lock.contended if isinstance(lock, TimedLock) else 0) - contended
    decode: DecodeRoomReport = _receive(conn, child, 120)[1]
    sender.clear()
    if poll is not KVPoll.Success or decode.poll != int(KVPoll.Success):
        print(
            f"  room {room}: prefill {poll.name}, decode {KVPoll(decode.poll).name}: "
            f"{sender.failure() or decode.failure}",
            file=sys.stderr,
        )
        return None
    return RoomTiming(
        to_prefill_success=prefill_success_at - sent_at,
        to_decode_success=decode.success_at - sent_at,
        phases=_phases(timeline, sent_at, returned_at, prefill_success_at, decode),
        phase_cpu=_phase_cpu(timeline),
        verified=decode.verified,
        checksum_verified=decode.checksum_verified,
        hand_offs=hand_offs(
            timeline,
            decode,
            prefill_scheduler=thread_id(),
            prefill_contended=contended,
            channel=channel_kind(),
        ),
    )


def _report(
    args: argparse.Namespace, runs: list[SizeRuns], page_bytes: int, verified: bool, failures: list[str]
) -> int:
    rows: list[list[object]] = []
    phase_rows: list[list[object]] = []
    for size in runs:
        one = _stats(size.one_batch)
        best = _stats(size.best_shape)
        nbytes = size.pages * args.layers * page_bytes
        for variant, rooms in size.rooms.items():
            prefill = _stats([r.to_prefill_success for r in rooms])
            decode = _stats([r.to_decode_success for r in rooms])
            phase_stats = {name: _stats([r.phases[name] for r in rooms]) for name in PHASES}
            phases = {name: stats["median"] for name, stats in phase_stats.items()}
            phase_means = {name: stats["mean"] for name, stats in phase_stats.items()}
            # Medians over the rooms where the phase stayed on one thread; absent when it never did.
            phase_cpu = {
                name: cpu
                for name in CPU_PHASES
                if not math.isnan(cpu := _stats([r.phase_cpu.get(name, math.nan) for r in rooms])["median"])
            }
            record = {
                "bench": "latency",
                "kind": "size",
                "variant": variant,
                "pages": size.pages,
                "layers": args.layers,
                "bytes": nbytes,
                "blocks": len(size.raw),
                "rounds": len(rooms),
                "scheduler_wait": "sleep" if args.sleep_poll else "progress",
                "load_threads": args.load_threads,
                "switch_interval_us": sys.getswitchinterval() * 1e6,
                "seconds": {
                    "pdkv_prefill_success": prefill,
                    "pdkv_decode_success": decode,
                    "raw_one_batch": one,
                    "raw_best_shape": best,
                },
                "raw_best_shape": {"entries": size.shape.entries, "in_flight": size.shape.in_flight},
                "pdkv_vs_one_batch": one["median"] / prefill["median"],
                "pdkv_vs_best_shape": best["median"] / prefill["median"],
                "fixed_cost_over_best_ms": (prefill["median"] - best["median"]) * 1e3,
                "phases_ms": {name: value * 1e3 for name, value in phases.items()},
                "phase_means_ms": {name: value * 1e3 for name, value in phase_means.items()},
                "phase_cpu_ms": {name: value * 1e3 for name, value in phase_cpu.items()},
            }
            emit(record)
            rows.append(
                [
                    size.pages,
                    variant,
                    f"{nbytes / 1e6:.1f} MB",
                    len(size.raw),
                    prefill["median"] * 1e3,
                    prefill["min"] * 1e3,
                    decode["median"] * 1e3,
                    one["median"] * 1e3,
                    best["median"] * 1e3,
                    f"{size.shape.entries}x{size.shape.in_flight}",
                    record["pdkv_vs_one_batch"],
                    record["pdkv_vs_best_shape"],
                ]
            )
            phase_rows.append([size.pages, variant, "p50"] + [phases[name] * 1e3 for name in PHASES])
            phase_rows.append([size.pages, variant, "mean"] + [phase_means[name] * 1e3 for name in PHASES])
            phase_rows.append(
                [size.pages, variant, "cpu p50"]
                + [phase_cpu[name] * 1e3 if name in phase_cpu else "-" for name in PHASES]
            )
    table(
        f"pdkv bench latency: one room at a time, {args.layers} MLA layers, pages of {page_bytes} B, "
        f"{args.repeats} rounds, schedulers {'sleep' if args.sleep_poll else 'wait for progress'} between "
        f"polls, {args.load_threads} busy Python threads per process, switch interval "
        f"{sys.getswitchinterval() * 1e6:g} us (ms; ratios = raw median / pdkv prefill median)",
        [
            "pages",
            "method",
            "bytes",
            "blocks",
            "->P p50",
            "->P min",
            "->D p50",
            "1 batch p50",
            "best p50",
            "best ExK",
            "vs 1 batch",
            "vs best",
        ],
        rows,
    )
    checksum_rows: list[list[object]] = []
    for size in runs:
        plain, checked = size.rooms.get("pdkv"), size.rooms.get("pdkv+checksum")
        if not plain or not checked:
            continue
        p_med = _stats([r.to_decode_success for r in plain])["median"]
        c_med = _stats([r.to_decode_success for r in checked])["median"]
        pp_med = _stats([r.to_prefill_success for r in plain])["median"]
        cp_med = _stats([r.to_prefill_success for r in checked])["median"]
        nbytes = size.pages * args.layers * page_bytes
        record = {
            "bench": "latency",
            "kind": "checksum",
            "pages": size.pages,
            "bytes": nbytes,
            "rounds": min(len(plain), len(checked)),
            "decode_success_ms": {"plain": p_med * 1e3, "checksum": c_med * 1e3},
            "prefill_success_ms": {"plain": pp_med * 1e3, "checksum": cp_med * 1e3},
            "checksum_adds": c_med / p_med - 1.0,
            "checksum_adds_to_prefill_success": cp_med / pp_med - 1.0,
        }
        emit(record)
        adds = f"{100 * (c_med / p_med - 1):+.1f}%"
        checksum_rows.append(
            [size.pages, f"{nbytes / 1e6:.1f} MB", p_med * 1e3, c_med * 1e3, adds, pp_med * 1e3, cp_med * 1e3]
        )
    if checksum_rows:
        table(
            "PDKV_KV_CHECKSUM: send() -> decode Success with and without (medians of this run, ms)",
            ["pages", "bytes", "->D plain", "->D checksum", "adds", "->P plain", "->P checksum"],
            checksum_rows,
        )
    table(
        "per-phase medians and means of the pdkv rooms (ms): send() -> ... -> decode poll sees Success "
        "(a mean well above its median: a phase that is slow in some rooms only, e.g. a wait for the "
        "interpreter lock); cpu p50: the CPU time of the one prefill thread that ran the phase (a cpu "
        "figure near its p50: the phase is Python work, not a wait; engine: the waiting thread's spin)",
        ["pages", "method", "", *PHASES],
        phase_rows,
    )
    _report_hand_offs(runs)
    _report_calls(runs)
    emit({"bench": "latency", "kind": "summary", "verified": verified, "failures": failures})
    return 0 if verified and not failures else 1


def _report_calls(runs: list[SizeRuns]) -> None:
    """The Python calls of the counted rooms per phase (medians), where every phase ran on the
    scheduler's thread (a chunk above ``wait_runs_chunk_bytes`` runs on a worker: not counted)."""
    rows: list[list[object]] = []
    for size in runs:
        counted = [c for c in size.calls if c.complete]
        if not counted:
            if size.calls:
                rows.append([size.pages, 0, "-", *("-" for _ in COUNTED_PHASES)])
            continue
        phases = {name: statistics.median_low([c.calls[name] for c in counted]) for name in COUNTED_PHASES}
        total = statistics.median_low([sum(c.calls.values()) for c in counted])
        emit(
            {
                "bench": "latency",
                "kind": "calls",
                "variant": "pdkv",
                "pages": size.pages,
                "rooms": len(counted),
                "calls_per_room": total,
                "phase_calls": phases,
            }
        )
        rows.append([size.pages, len(counted), total, *phases.values()])
    if rows:
        table(
            "Python calls per pdkv room on the prefill scheduler's thread, send() -> status sent "
            "(function calls and calls of C functions, the bench's own marks not counted; medians of "
            f"{CALL_ROOMS} rooms after the timed ones; '-': the chunk ran on a transfer worker)",
            ["pages", "rooms", "calls", *COUNTED_PHASES],
            rows,
        )


def _report_hand_offs(runs: list[SizeRuns]) -> None:
    """The hand-offs of each size's rooms (medians), and the path of one room with the median total."""
    from pdkv.runtime.channels import channel_kind

    rows: list[list[object]] = []
    paths: list[str] = []
    for size in runs:
        for variant, rooms in size.rooms.items():
            counted = [r.hand_offs for r in rooms if r.hand_offs is not None]
            if not counted:
                continue
            total = statistics.median_low([h.total for h in counted])
            shown = next(h for h in counted if h.total == total)
            record: dict[str, Any] = {
                "bench": "latency",
                "kind": "hand_offs",
                "pages": size.pages,
                "variant": variant,
                "channel": channel_kind(),
                "rooms": len(counted),
                "total_p50": total,
                "total_min": min(h.total for h in counted),
                "total_max": max(h.total for h in counted),
                "totals": {
                    str(n): [h.total for h in counted].count(n) for n in sorted({h.total for h in counted})
                },
                "to_decode_p50": statistics.median_low([h.to_decode for h in counted]),
                "native_p50": statistics.median_low([h.native for h in counted]),
                "to_prefill_p50": statistics.median_low([h.to_prefill for h in counted]),
                "prefill_lock_waits_mean": statistics.fmean(h.prefill_lock_waits for h in counted),
                "decode_lock_waits_mean": statistics.fmean(h.decode_lock_waits for h in counted),
                "path": [list(step) for step in shown.path],
            }
            emit(record)
            rows.append(
                [
                    size.pages,
                    variant,
                    total,
                    f"{record['total_min']}-{record['total_max']}",
                    record["to_decode_p50"],
                    record["native_p50"],
                    record["to_prefill_p50"],
                    record["prefill_lock_waits_mean"],
                    record["decode_lock_waits_mean"],
                ]
            )
            steps = " -> ".join(f"{step} [{who}]" for step, who in shown.path)
            paths.append(f"  {size.pages} pages, {variant}: {steps}")
    if not rows:
        return
    table(
        "thread and process hand-offs per room, send() -> decode poll sees Success (medians; counted "
        "from the threads that ran each step, the engine's (and a zmq channel's) own threads by "
        "construction, plus the acquisitions that found a transport lock held)",
        [
            "pages",
            "method",
            "total",
            "range",
            "->D thread changes",
            "of which native",
            "->P thread changes",
            "P lock waits",
            "D lock waits",
        ],
        rows,
    )
    print("\n".join(["a room's path (step [pid/thread]):", *paths]), file=sys.stderr, flush=True)


# ------------------------------------------------------------------ --backend nixl: engines side by side


@attrs.define
class _Engine:
    """One engine's pair of ranks: a prefill transport here, a decode rank process, and its blocks."""

    kind: str
    label: str
    backend: TransferBackend
    transport: Any
    registry: Any
    child: Any
    conn: Connection
    peer: str = ""
    metadata: bytes = b""
    dst_bases: list[int] = attrs.Factory(list)
    blocks: dict[int, TransferBlocks] = attrs.Factory(dict)
    rooms: dict[int, list[RoomTiming]] = attrs.Factory(dict)


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_share(pids: Sequence[int], seconds: float, during: Callable[[], None] | None = None) -> list[float]:
    """Each process's CPU over the window, in % of one core (``during`` runs meanwhile, else a sleep)."""
    before = [_process_cpu_s(pid) for pid in pids]
    started = time.monotonic()
    if during is None:
        time.sleep(seconds)
    else:
        during()
    wall = time.monotonic() - started
    return [100.0 * (_process_cpu_s(pid) - b) / wall for pid, b in zip(pids, before, strict=True)]


def _start_engine(
    kind: str, label: str, args: argparse.Namespace, model: ModelSpec, capacity: Capacity, memory: RankMemory
) -> _Engine:
    from pdkv.runtime.channels import start_registry
    from pdkv.runtime.prefill import PrefillConfig, PrefillTransport

    ucx_tls = args.ucx_tls if kind == "nixl" else None
    instance = InstanceId(f"prefill-{label}")
    registry = start_registry(instance=instance, tp_size=1, cp_size=1)
    backend = make_backend(kind, mooncake=_engine_config(), nixl=_nixl_config(ucx_tls))
    transport = PrefillTransport(
        PrefillConfig(
            instance=instance,
            rank=RankCoord(tp=0),
            tp_size=1,
            layout=memory.layout,
            registry=registry.address,
        ),
        backend,
    )
    transport.start()
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    child = ctx.Process(
        target=_decode_main,
        args=(
            _DecodeArgs(
                model=model,
                capacity=capacity,
                registry=registry.address,
                poll_s=5e-3,
                wake=True,
                load_threads=args.load_threads,
                switch_interval_us=args.switch_interval_us,
                backend=kind,
                ucx_tls=ucx_tls,
            ),
            child_conn,
        ),
        name=f"pdkv-bench-decode-{label}",
        daemon=True,
    )
    child.start()
    child_conn.close()
    engine = _Engine(kind, label, backend, transport, registry, child, parent_conn)
    _, engine.peer, engine.dst_bases, engine.metadata = _receive(parent_conn, child, 180)
    return engine


def _stop_engine(engine: _Engine) -> None:
    with contextlib.suppress(Exception):
        engine.conn.send(("stop",))
    engine.child.join(30)
    if engine.child.is_alive():
        engine.child.kill()
        engine.child.join(5)
    engine.conn.close()
    engine.transport.close()
    engine.backend.close()
    engine.registry.stop()


def _measure_engines(args: argparse.Namespace, sizes: list[int]) -> int:
    """``--backend nixl``: pdkv rooms over NIXL and over Mooncake in the same run (a prefill transport
    per engine in this process on the same prefill memory, a decode rank process per engine), beside
    the raw NIXL agent moving the same blocks into the NIXL decode rank's pages; then each process's
    CPU, idle and while rooms run back to back."""
    model, capacity = _workload(args, sizes)
    page_bytes = model.kv_item_bytes
    progress = Progress()
    rng = np.random.default_rng(args.seed)
    progress.show(f"filling {max(sizes)} pages x {args.layers} layers of prefill memory ...")
    memory = RankMemory(model, capacity)
    memory.fill_prefill(cp_rank=0, policy=_policy())
    src_bases = [memory.tensors[key].data_ptr() for key in model.kv_keys()]
    layer_bytes = capacity.kv_pages * page_bytes
    placements = {pages: place_pages(pages, args.run_fraction, args.max_run, rng) for pages in sizes}
    engines: list[_Engine] = []
    raw: RawNixlWriter | None = None
    verified = True
    failures: list[str] = []
    cpu: dict[str, dict[str, float]] = {}
    raw_times: dict[int, list[float]] = {pages: [] for pages in sizes}
    room = 1
    load = InterpreterLoad(args.load_threads)
    try:
        for kind, label in (("nixl", f"nixl-{args.ucx_tls}"), ("mooncake", "mooncake")):
            progress.show(f"starting the {label} decode rank ...")
            engines.append(_start_engine(kind, label, args, model, capacity, memory))
            if kind == "nixl":
                time.sleep(0.5)  # start-up settles before the idle window
                progress.show(f"{label}: {args.cpu_seconds:g} s idle ...")
                prefill_idle, decode_idle = _cpu_share([os.getpid(), engines[-1].child.pid], args.cpu_seconds)
                cpu[label] = {"prefill_idle": prefill_idle, "decode_idle": decode_idle}
        load.start()
        nixl = engines[0]
        raw = RawNixlWriter(_nixl_config(args.ucx_tls), [(base, layer_bytes) for base in src_bases])
        raw_peer = raw.connect(nixl.metadata)
        for engine in engines:
            for pages, (src_pages, dst_pages) in placements.items():
                engine.blocks[pages] = run_blocks(
                    src_pages, dst_pages, src_bases, engine.dst_bases, page_bytes
                )
        for pages in sizes:
            raw.write(raw_peer, nixl.blocks[pages])  # warm-up: connection, first touch
        timeline = Timeline()
        for round_index in range(args.repeats):
            for pages in sizes:
                progress.show(f"round {round_index + 1}/{args.repeats}: {pages} pages")
                src_pages, dst_pages = placements[pages]
                size = SizeRuns(pages, nixl.blocks[pages], RawBlocks([], [], []), src_pages, dst_pages)

                def pdkv_room(engine: _Engine, size: SizeRuns = size, first: bool = round_index == 0) -> None:
                    nonlocal room, verified
                    verify = first and not args.no_verify
                    timing = _pdkv_room(
                        engine.transport,
                        engine.conn,
                        engine.child,
                        timeline,
                        size,
                        room,
                        5e-3,
                        verify=verify,
                        wake=True,
                    )
                    room += 1
                    if timing is None:
                        failures.append(f"{engine.label} room of {size.pages} pages failed")
                        return
                    verified &= timing.verified is not False
                    engine.rooms.setdefault(size.pages, []).append(timing)

                def raw_write(pages: int = pages) -> None:
                    assert raw is not None
                    raw_times[pages].append(
                        _timed(functools.partial(raw.write, raw_peer, nixl.blocks[pages]))
                    )

                methods: list[Callable[[], None]] = [
                    functools.partial(pdkv_room, engines[0]),
                    functools.partial(pdkv_room, engines[1]),
                    raw_write,
                ]
                turn = round_index % len(methods)
                for method in methods[turn:] + methods[:turn]:
                    method()
        for engine in engines:
            # Under load: 1-page rooms back to back for the window, this engine alone.
            src_pages, dst_pages = placements[min(sizes)]
            size = SizeRuns(
                min(sizes), engine.blocks[min(sizes)], RawBlocks([], [], []), src_pages, dst_pages
            )
            count = 0

            def busy(engine: _Engine = engine, size: SizeRuns = size) -> None:
                nonlocal room, count
                deadline = time.monotonic() + args.cpu_seconds
                while time.monotonic() < deadline:
                    _pdkv_room(
                        engine.transport,
                        engine.conn,
                        engine.child,
                        timeline,
                        size,
                        room,
                        5e-3,
                        verify=False,
                        wake=True,
                    )
                    room += 1
                    count += 1

            progress.show(
                f"{engine.label}: {min(sizes)}-page rooms back to back for {args.cpu_seconds:g} s ..."
            )
            prefill_busy, decode_busy = _cpu_share([os.getpid(), engine.child.pid], 0.0, busy)
            cpu.setdefault(engine.label, {}).update(
                {
                    "prefill_busy": prefill_busy,
                    "decode_busy": decode_busy,
                    "busy_rooms_per_s": count / args.cpu_seconds,
                }
            )
        progress.close()
    finally:
        load.stop()
        if raw is not None:
            raw.close()
        for engine in engines:
            _stop_engine(engine)
    return _report_engines(args, sizes, engines, raw_times, cpu, page_bytes, verified, failures)


def _report_engines(
    args: argparse.Namespace,
    sizes: list[int],
    engines: list[_Engine],
    raw_times: dict[int, list[float]],
    cpu: dict[str, dict[str, float]],
    page_bytes: int,
    verified: bool,
    failures: list[str],
) -> int:
    nixl, mooncake = engines
    rows: list[list[object]] = []
    for pages in sizes:
        n = _stats([r.to_prefill_success for r in nixl.rooms.get(pages, [])])
        nd = _stats([r.to_decode_success for r in nixl.rooms.get(pages, [])])
        m = _stats([r.to_prefill_success for r in mooncake.rooms.get(pages, [])])
        raw = _stats(raw_times[pages])
        record = {
            "bench": "latency",
            "kind": "engines",
            "pages": pages,
            "layers": args.layers,
            "bytes": pages * args.layers * page_bytes,
            "blocks": len(nixl.blocks[pages]),
            "ucx_tls": args.ucx_tls,
            "rounds": len(nixl.rooms.get(pages, [])),
            "seconds": {
                "pdkv_nixl_prefill_success": n,
                "pdkv_nixl_decode_success": nd,
                "pdkv_mooncake_prefill_success": m,
                "raw_nixl_agent": raw,
            },
            "nixl_vs_mooncake": m["median"] / n["median"],
            "pdkv_vs_raw_agent": raw["median"] / n["median"],
        }
        emit(record)
        rows.append(
            [
                pages,
                f"{record['bytes'] / 1e6:.1f} MB",
                record["blocks"],
                n["median"] * 1e3,
                n["min"] * 1e3,
                nd["median"] * 1e3,
                m["median"] * 1e3,
                raw["median"] * 1e3,
                record["nixl_vs_mooncake"],
                record["pdkv_vs_raw_agent"],
            ]
        )
    table(
        f"pdkv bench latency --backend nixl (UCX_TLS={args.ucx_tls}): one room at a time, {args.layers} MLA "
        f"layers, pages of {page_bytes} B, {args.repeats} interleaved rounds (ms; send -> prefill Success; "
        "ratios of medians)",
        [
            "pages",
            "bytes",
            "blocks",
            "NIXL p50",
            "NIXL min",
            "NIXL ->D p50",
            "Mooncake p50",
            "raw agent p50",
            "Mooncake/NIXL",
            "raw/NIXL",
        ],
        rows,
    )
    cpu_rows = []
    for label, figures in cpu.items():
        emit({"bench": "latency", "kind": "cpu", "engine": label, **figures})
        cpu_rows.append(
            [
                label,
                figures.get("prefill_idle", float("nan")),
                figures.get("decode_idle", float("nan")),
                figures["prefill_busy"],
                figures["decode_busy"],
                figures["busy_rooms_per_s"],
            ]
        )
    table(
        f"CPU per process, % of one core ({args.cpu_seconds:g} s each; idle: nothing to do after start-up; "
        f"busy: {min(sizes)}-page rooms back to back, this engine alone; the prefill process holds both "
        "engines' transports, the Mooncake one idle meanwhile)",
        ["engine", "prefill idle", "decode idle", "prefill busy", "decode busy", "rooms/s"],
        cpu_rows,
    )
    emit({"bench": "latency", "kind": "summary", "verified": verified, "failures": failures})
    return 0 if verified and not failures else 1
