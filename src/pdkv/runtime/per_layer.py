"""Per-layer transfer: layer L's KV moves while layers L+1.. still compute (DESIGN section 7).

Owns: ``PerLayerTransferManager`` (one per prefill transport, ``transport.per_layer``), its
configuration, results and statistics, and the per-(room, chunk) contexts, each driven by the
``PerLayer`` machine (``pdkv.protocol.machines.per_layer``). Must not touch room state: the
transport reports a finished context to its endpoint (``chunk_done`` / ``chunk_failed``) as for any
chunk; the manager only moves KV bytes and says what landed. Must not map pages itself either: a
context's blocks are ``plan_chunk``'s blocks for the same chunk and destination, split by layer, so
the bytes are those of the monolithic path by construction.

How a scheduler uses it, per chunk of a room whose sender polls WaitingForInput or Transferring:

    mode = transport.per_layer.register(room, chunk_pages, start_token=..., resident_pages=...)
    ... forward: after each layer's KV write, transport.per_layer.on_layer_end(layer, ready=event)
    sender.send(chunk_pages, start_token=..., last=...)      # finishes the context, sends nothing again

- ``register`` (scheduler thread, never waits on the network) plans the chunk for the room's single
  destination, submits the pages already resident before the forward (a cached prefix the decode
  side lacks, earlier chunks' pages re-sent) at once, and returns ``PerLayerMode.PER_LAYER``.
  Registering the same (room, chunk) again is a no-op (``DUPLICATE``). Explicit fallbacks, logged at
  DEBUG, return ``MONOLITHIC`` and leave the chunk to the monolithic path: the room has no
  destinations yet (not WaitingForInput), this rank is a dummy for it, it has more than one
  non-dummy destination, the layout is not one the manager supports, or mapping refused the chunk.
- ``on_layer_end`` (the forward's thread) only records the event and queues it on the submission
  lane of each destination peer (one thread per peer, started on demand and retired when idle, so
  a slow peer delays only its own rooms); the lane waits for ``ready`` (a GPU caller's event: the
  write must be complete before the engine reads the pages; an event with ``query()`` is waited for
  at most ``finish_timeout_s``) and submits that layer's blocks of every context waiting for it. Per
  room, an event goes to the oldest context that still lacks that layer (chunk N+1 may register
  while chunk N finishes).
- ``finish`` (a transfer worker, from ``send()``) takes the chunk's context, waits until every layer
  was submitted and every write completed, bounded by ``finish_timeout_s``; on timeout (a layer that
  never ended) or failure, it stops submitting, waits for the writes already submitted, and reports
  the failure for the transport to fail the room with.
- ``cancel`` (non-blocking, the transport calls it when a room fails) and ``drop`` (blocking) stop
  every context of a room, wait for its outstanding writes and discard the contexts: after ``drop``
  returns, nothing of the room is written any more. A dropped context is remembered, without its
  blocks, until ``forget`` (``sender.clear()``), so a ``send()`` racing the drop is refused instead
  of being sent whole.

What decides messages is the endpoint's: before a context's first write the manager asks
``writes_started(room, start_token)`` (the endpoint's ``layer_writes_started``: False when the room
can no longer be written, and the context is then cancelled), and once every write a context
submitted has ended it reports ``writes_ended(room, start_token)``. So the endpoint counts a
per-layer context in flight from its first write: AbortAck, the RegisterAck of a restarted decode
rank, Success and ``may_write`` wait for it; nothing is held back here.

Locks: the manager's lock guards every context's state; a context's job lock serialises the calls
on its ``TransferJob`` (one thread at a time, as the executor requires), taken before the manager's
lock and never held while waiting on the manager's conditions. The ``guard`` (the transport's lock)
is taken before the manager's lock, and the manager never calls the transport (``writes_started``,
``writes_ended``) while holding its own.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Final, Protocol, TypeAlias

import attrs
import numpy as np

from pdkv import config
from pdkv.config import positive_int, positive_seconds
from pdkv.errors import LocalProtocolError, MappingError, PdkvError, TransportClosedError
from pdkv.errors.runtime import UnknownLayerError as UnknownLayerError
from pdkv.mapping import (
    AttentionKind,
    BufferKind,
    BufferLayout,
    LayerKey,
    ModelRole,
    OwnershipPolicy,
    TransferBlocks,
)
from pdkv.protocol import arguments
from pdkv.protocol.effects import ChunkSpec, Destination, FenceWrite
from pdkv.protocol.ids import RoomId
from pdkv.protocol.machines import PerLayerMachine, PerLayerState, PerLayerTrigger
from pdkv.protocol.messages import IntArray
from pdkv.runtime.chunk_plan import fence_of, plan_chunk
from pdkv.runtime.executor import JobStatus, TransferExecutor, TransferJob, TransferResult

log = logging.getLogger(__name__)

DEFAULT_FINISH_TIMEOUT_S: Final = 60.0
DEFAULT_MAX_PENDING_EVENTS: Final = 65536


@attrs.frozen(kw_only=True)
class PerLayerConfig:
    finish_timeout_s: float = attrs.field(
        default=DEFAULT_FINISH_TIMEOUT_S,
        validator=positive_seconds,
        metadata=config.seconds_var(
            "PDKV_PER_LAYER_FINISH_TIMEOUT", "Per-layer: from send() until every layer was written"
        ),
    )
    """From ``send()`` (``finish``) until every layer was submitted and every write completed."""
    max_pending_events: int = attrs.field(default=DEFAULT_MAX_PENDING_EVENTS, validator=positive_int)
    """Layer events queued for the submission thread; one more fails its contexts (never blocks)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PerLayerConfig:
        """Defaults, overridden by ``PDKV_PER_LAYER_FINISH_TIMEOUT`` when set."""
        return config.from_env(cls, env)


ENV_VARS: Final[Mapping[str, str]] = config.env_vars(PerLayerConfig)


class PerLayerMode(enum.Enum):
    """What ``register`` decided for a chunk."""

    PER_LAYER = "per_layer"  # a context holds the chunk: send() finishes it
    DUPLICATE = "duplicate"  # the chunk was registered already: nothing changed
    MONOLITHIC = "monolithic"  # fallback (reason logged at DEBUG): send() sends the chunk whole


class SupportsSynchronize(Protocol):
    """A device event (``torch.cuda.Event``): ``synchronize()`` returns once the recorded work is done."""

    def synchronize(self) -> object: ...


ReadyWait: TypeAlias = Callable[[], object] | SupportsSynchronize
"""What ``on_layer_end`` waits on before submitting a layer: a callable (``threading.Event.wait``) or a
device event. CPU callers pass nothing: the write is complete when ``on_layer_end`` is called."""

LayerDestinationOf: TypeAlias = Callable[[RoomId, IntArray, int], Destination | str]
"""The endpoint's ruling on a chunk registered for per-layer transfer (called with ``guard`` held):
its one destination, or why it goes monolithic (``PrefillEndpoint.layer_destination``)."""

WritesStarted: TypeAlias = Callable[[RoomId, int], bool]
"""Before a context's first write: may the room still be written? (takes ``guard``)"""

WritesEnded: TypeAlias = Callable[[RoomId, int, FenceWrite | None], None]
"""Every write a context submitted has ended (takes ``guard``); with a fence when a write failed."""

LANE_IDLE_S: Final = 30.0  # a peer's submission lane stops after this long without work


@attrs.frozen(kw_only=True)
class LayerTransferResult:
    """What one per-layer context wrote. ``ok`` means every requested byte is in a completed write."""

    room: RoomId
    start_token: int
    ok: bool
    reason: str  # empty when ok
    engine_failure: bool  # the engine failed or timed out a write (as opposed to a missing layer or a drop)
    destination: Destination
    kv_pages: int  # KV pages (positions) of the chunk this rank writes
    bytes_written: int
    seconds: float  # registration to the end of finish
    first_submit_at: float  # clock of the first submission (registration if nothing was submitted)
    last_completion_at: float


@attrs.frozen(kw_only=True)
class PerLayerStatistics:
    """Counters of one manager since it started."""

    registered: int
    duplicates: int
    fallbacks: int
    layer_events: int
    layers_submitted: int
    finished: int
    failed: int
    dropped: int
    open_contexts: int
    lanes: int
    """Submission lanes (one per destination peer with recent work)."""


class _Owner(enum.Enum):
    FINISHER = "finisher"  # a transfer worker in finish()
    DRAINER = "drainer"  # drop() or the submission thread draining a cancelled context


@attrs.define(eq=False)
class _Context:
    room: RoomId
    start_token: int
    pages: IntArray
    destination: Destination
    job: TransferJob
    machine: PerLayerMachine
    resident: TransferBlocks
    layers: dict[LayerKey, TransferBlocks]
    expected: frozenset[LayerKey]
    kv_pages: int
    registered_at: float
    job_lock: threading.Lock = attrs.Factory(threading.Lock)
    seen: set[LayerKey] = attrs.Factory(set)  # layer events routed to this context
    submitted: set[LayerKey] = attrs.Factory(set)  # layers whose blocks were handed to the job
    cancelled: bool = False  # no further submission (room failed, finish gave up)
    cancel_reason: str = ""
    error: str | None = None  # a ready wait raised, or the event queue was full
    owner: _Owner | None = None
    first_submit_at: float | None = None
    result: TransferResult | None = None
    started: bool = False  # the endpoint counts this context's writes in flight
    end_reported: bool = False
    fence: FenceWrite | None = None  # from its first submitted block: repeated if a write failed

    @property
    def terminal(self) -> bool:
        return self.machine.is_terminal

    def missing(self) -> list[LayerKey]:
        return sorted(self.expected - self.submitted, key=lambda k: k.sort_key)


@attrs.define(eq=False)
class _Room:
    contexts: dict[int, _Context] = attrs.Factory(dict)  # by chunk start token, in registration order
    pending_drains: int = 0
    forgotten: bool = False


@attrs.frozen
class _SubmitLayer:
    contexts: tuple[_Context, ...]
    layer: LayerKey | None  # None: the pages resident before the forward
    ready: ReadyWait | None


@attrs.frozen
class _DrainRoom:
    room: RoomId


_Task: TypeAlias = _SubmitLayer | _DrainRoom | None  # None stops a lane


@attrs.define(eq=False)
class _Lane:
    """One destination peer's submission thread and its queue (guarded by the manager's lock)."""

    peer: str
    work: threading.Condition
    tasks: deque[_Task] = attrs.Factory(deque)
    thread: threading.Thread | None = None


_COLLECTING = (PerLayerState.COLLECTING, PerLayerState.AWAITING_LAYERS)


def unsupported_reason(layout: BufferLayout) -> str | None:
    """Why the per-layer path cannot serve ``layout`` (None: it can)."""
    kv = layout.kv_buffers
    if not kv:
        return "the layout has no KV buffers"
    if layout.attention is AttentionKind.MHA:
        kinds: dict[LayerKey, set[BufferKind]] = {}
        for b in kv:
            kinds.setdefault(LayerKey(model=b.model, layer_id=b.layer_id), set()).add(b.kind)
        partial = sorted(
            (k for k, v in kinds.items() if v != {BufferKind.K, BufferKind.V}), key=lambda k: k.sort_key
        )
        if partial:
            return f"MHA layers without both K and V buffers: {', '.join(map(str, partial[:4]))}"
    return None


def layer_keys(layout: BufferLayout) -> tuple[LayerKey, ...]:
    """Every (model, layer) with KV in ``layout``: what a forward reports through ``on_layer_end``."""
    keys = {LayerKey(model=b.model, layer_id=b.layer_id) for b in layout.kv_buffers}
    return tuple(sorted(keys, key=lambda k: k.sort_key))


def _wait_ready(ready: ReadyWait, timeout_s: float) -> bool:
    """Wait for a layer's write to be complete; False when an event with ``query()`` (a CUDA event)
    is still pending after ``timeout_s``. A plain callable or ``synchronize()`` is waited for as is."""
    query = getattr(ready, "query", None)
    if callable(query):
        deadline = time.monotonic() + timeout_s
        pause = 5e-5
        while not query():
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        return True
    if callable(ready):
        ready()
    else:
        ready.synchronize()
    return True


class PerLayerTransferManager:
    """Per-layer contexts of one prefill rank (see the module docstring for the calling pattern)."""

    def __init__(
        self,
        executor: TransferExecutor,
        *,
        layout: BufferLayout,
        layer_destination: LayerDestinationOf,
        writes_started: WritesStarted | None = None,
        writes_ended: WritesEnded | None = None,
        cp_rank: int = 0,
        policy: OwnershipPolicy | None = None,
        guard: AbstractContextManager[object] | None = None,
        config: PerLayerConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        name: str = "",
    ) -> None:
        self._executor = executor
        self._layout = layout
        self._layer_destination = layer_destination
        self._writes_started: WritesStarted = writes_started or (lambda room, start_token: True)
        self._writes_ended: WritesEnded = writes_ended or (lambda room, start_token, fence: None)
        self._cp_rank = cp_rank
        self._policy = policy
        self._guard: AbstractContextManager[object] = guard if guard is not None else threading.Lock()
        self.config = config if config is not None else PerLayerConfig()
        self._clock = clock
        self._name = name
        self._unsupported = unsupported_reason(layout)
        self._keys = layer_keys(layout)
        self._known_keys = frozenset(self._keys)
        # Local buffer index -> index of its layer in self._keys (-1: not a KV buffer).
        group = {k: i for i, k in enumerate(self._keys)}
        self._group_of_buffer = np.asarray(
            [
                group[LayerKey(model=b.model, layer_id=b.layer_id)] if b.kind.is_kv else -1
                for b in layout.buffers
            ],
            dtype=np.int64,
        )
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # context states (finish, drop wait on it)
        self._lanes: dict[str, _Lane] = {}  # destination peer session -> its submission lane
        self._pending_events = 0
        self._rooms: dict[RoomId, _Room] = {}
        self._started = False
        self._closed = False
        self._registered = self._duplicates = self._fallbacks = 0
        self._layer_events = self._layers_submitted = 0
        self._finished = self._failed = self._dropped = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Lanes start on demand (one per destination peer); this only opens the manager."""
        with self._lock:
            self._started = True

    def close(self, timeout_s: float = 30.0) -> bool:
        """Drop every context (waiting for its writes) and stop the submission thread (idempotent).
        False when the thread is still running after ``timeout_s`` (a write may still be in flight)."""
        with self._lock:
            already = self._closed
            self._closed = True
            rooms = list(self._rooms)
        if not already:
            for room in rooms:
                self.drop(room, "transport closing")
        with self._lock:
            lanes = list(self._lanes.values())
            for lane in lanes:
                lane.tasks.append(None)
                lane.work.notify()
        deadline = time.monotonic() + timeout_s
        stuck = []
        for lane in lanes:
            if lane.thread is not None and lane.thread is not threading.current_thread():
                lane.thread.join(max(0.0, deadline - time.monotonic()))
                if lane.thread.is_alive():
                    stuck.append(lane.peer)
        if stuck:
            log.warning("per-layer lanes %s of %s did not stop within %.1f s", stuck, self._name, timeout_s)
            return False
        return True

    def is_closed(self) -> bool:
        return self._closed

    def __enter__(self) -> PerLayerTransferManager:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ------------------------------------------------------------------ scheduler surface

    @property
    def layers(self) -> tuple[LayerKey, ...]:
        """The (model, layer) keys a forward must report, target layers then draft layers."""
        return self._keys

    def register(
        self,
        room: RoomId,
        chunk_pages: IntArray | Sequence[int],
        *,
        start_token: int,
        resident_pages: int = 0,
    ) -> PerLayerMode:
        """Before a chunk's forward: take the chunk for per-layer transfer, or say why not.

        ``chunk_pages`` and ``start_token`` are exactly what ``send()`` will be given for the chunk;
        its first ``resident_pages`` pages already hold their KV (the forward does not write them)
        and are submitted now. Never waits on the network.
        """
        if self._closed:
            raise TransportClosedError(f"per_layer.register of room {room}: the transport is closed")
        # A copy (the caller may reuse its array), checked: no duplicate may reach the engine.
        pages = arguments.page_list(chunk_pages, room=room, argument="chunk_pages")
        start_token = arguments.count(start_token, room=room, argument="start_token")
        resident_pages = arguments.count(resident_pages, room=room, argument="resident_pages")
        if not 0 <= resident_pages <= pages.size:
            raise MappingError(f"room {room}: resident_pages {resident_pages} outside 0..{pages.size}")
        with self._lock:
            if self._is_registered(room, start_token):
                self._duplicates += 1
                return PerLayerMode.DUPLICATE
        if self.is_closed():
            return self._fallback(room, start_token, "the manager is closed")
        if self._unsupported is not None:
            return self._fallback(room, start_token, self._unsupported)
        with self._guard:
            ruling = self._layer_destination(room, pages, start_token)  # MappingError: refused
        if isinstance(ruling, str):
            return self._fallback(room, start_token, ruling)
        destination = ruling
        try:
            resident, layers, kv_pages = self._plan(room, pages, start_token, resident_pages, destination)
        except PdkvError as exc:
            return self._fallback(room, start_token, f"mapping refused the chunk: {exc}")
        with self._guard:
            # The room may have failed (and been cancelled) while we planned: only a room that still
            # has the same destination gets a context, atomically with the transport's failure path.
            if self._layer_destination(room, pages, start_token) != destination:
                return self._fallback(room, start_token, "the room changed while the chunk was planned")
            with self._lock:
                if self._is_registered(room, start_token):
                    self._duplicates += 1
                    return PerLayerMode.DUPLICATE
                if self.is_closed():  # close() may have dropped every room while we planned
                    self._fallbacks += 1
                    return PerLayerMode.MONOLITHIC
                now = self._clock()
                context = _Context(
                    room=room,
                    start_token=start_token,
                    pages=pages,
                    destination=destination,
                    job=self._executor.start(destination.peer.session),
                    machine=PerLayerMachine(f"room {room} chunk@{start_token}"),
                    resident=resident,
                    layers=layers,
                    expected=self._known_keys,
                    kv_pages=kv_pages,
                    registered_at=now,
                )
                self._rooms.setdefault(room, _Room()).contexts[start_token] = context
                self._registered += 1
                if len(resident):
                    self._enqueue(_SubmitLayer((context,), None, None))
        log.debug(
            "room %s chunk@%d: per-layer (%d KV pages, %d resident)",
            room,
            start_token,
            kv_pages,
            resident_pages,
        )
        return PerLayerMode.PER_LAYER

    def on_layer_end(
        self, layer_id: int, ready: ReadyWait | None = None, *, model: ModelRole = ModelRole.TARGET
    ) -> None:
        """The forward wrote layer ``layer_id``'s KV (of ``model``); ``ready`` completes that write.

        Only records and queues the event (never blocks the forward): the submission thread waits
        for ``ready`` and submits the layer for every context still waiting for it.
        """
        key = LayerKey(model=model, layer_id=layer_id)
        if self._unsupported is None and key not in self._known_keys:
            known = ", ".join(map(str, self._keys[:8])) + (" ..." if len(self._keys) > 8 else "")
            raise UnknownLayerError(f"layer {key} has no KV buffer in this rank's layout (layers: {known})")
        with self._lock:
            self._layer_events += 1
            targets: list[_Context] = []
            for r in self._rooms.values():
                for context in r.contexts.values():
                    if (
                        context.machine.state in _COLLECTING
                        and not context.cancelled
                        and key not in context.seen
                    ):
                        context.seen.add(key)
                        targets.append(context)
                        break  # per room, the oldest context still lacking the layer
            if targets:
                self._enqueue(_SubmitLayer(tuple(targets), key, ready))

    # ------------------------------------------------------------------ transport surface

    def finish(
        self, room: RoomId, start_token: int, *, pages: IntArray | None = None
    ) -> LayerTransferResult | None:
        """``send()`` of a chunk: None if no context holds it (send it whole); else wait and report.

        Waits until every layer was submitted and every write completed, at most
        ``finish_timeout_s``. On timeout, failure or a drop it stops submitting and waits for every
        write already submitted before it returns, so a failed result never leaves writes behind.
        ``pages``: the chunk as sent, checked against the registration.
        """
        deadline = self._clock() + self.config.finish_timeout_s
        with self._lock:
            r = self._rooms.get(room)
            context = None if r is None else r.contexts.get(start_token)
            if context is None:
                return None
            while context.owner is _Owner.DRAINER:
                self._changed.wait()
            if context.owner is _Owner.FINISHER:
                raise LocalProtocolError(f"room {room} chunk@{start_token}: finished twice")
            if context.machine.state is PerLayerState.DROPPED:
                self._remove(context)
                return self._result(context, f"dropped before send(): {context.cancel_reason}")
            context.owner = _Owner.FINISHER
            context.machine.fire(PerLayerTrigger.FINISH)
            problem = None
            if pages is not None and not np.array_equal(np.asarray(pages, dtype=np.int64), context.pages):
                problem = (
                    f"send() gave {np.asarray(pages).size} pages that differ from the {context.pages.size} "
                    "registered for this chunk"
                )
            while problem is None and context.machine.state is PerLayerState.AWAITING_LAYERS:
                if context.cancelled:
                    break
                if context.error is not None:
                    problem = context.error
                    break
                if context.job.failed:
                    problem = "a write failed while the forward ran"
                    break
                remaining = deadline - self._clock()
                if remaining <= 0:
                    missing = context.missing()
                    problem = (
                        f"{len(missing)} of {len(context.expected)} layers never ended within "
                        f"{self.config.finish_timeout_s:g} s (first: {', '.join(map(str, missing[:4]))})"
                    )
                    break
                self._changed.wait(remaining)
            if context.machine.state is PerLayerState.COMPLETING and problem is None:
                stopped = None
            else:
                # Stop the submission thread for this context before waiting for what it submitted.
                context.cancelled = True
                stopped = problem if problem is not None else f"room failed: {context.cancel_reason}"
        try:
            if stopped is not None:
                with context.job_lock:
                    drained = context.job.drain()
                trigger = PerLayerTrigger.DROP if problem is None else PerLayerTrigger.FAIL
                return self._end(context, trigger, drained, stopped)
            with context.job_lock:
                outcome = context.job.finish(timeout=max(0.0, deadline - self._clock()))
                if outcome.batches_in_flight:
                    outcome = context.job.drain()  # never report while a write may still land
        except Exception as exc:  # a bug below us: the context still ends, so nobody waits forever
            self._end(context, PerLayerTrigger.FAIL, None, f"internal error: {type(exc).__name__}: {exc}")
            raise
        if outcome.ok:
            return self._end(context, PerLayerTrigger.COMPLETE, outcome, "")
        return self._end(context, PerLayerTrigger.FAIL, outcome, outcome.reason)

    def cancel(self, room: RoomId, reason: str) -> bool:
        """The room failed (or completed without these chunks): stop its contexts now, drop them once
        their writes ended (non-blocking; each context that wrote reports ``writes_ended`` then).
        True when something was outstanding."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                return False
            for context in r.contexts.values():
                if not context.terminal and not context.cancelled:
                    context.cancelled = True
                    context.cancel_reason = reason
            self._changed.notify_all()
            if not self._outstanding(r):
                return False
            peers = {c.destination.peer.session for c in r.contexts.values()}
            r.pending_drains += len(peers)
            for peer in sorted(peers):
                self._lane_enqueue(peer, _DrainRoom(room))
            return True

    def drop(self, room: RoomId, reason: str = "dropped") -> int:
        """Stop every context of ``room``, wait for its outstanding writes, discard it; returns the
        number of contexts dropped. After it returns nothing of the room is written any more."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                return 0
            for context in r.contexts.values():
                if not context.terminal and not context.cancelled:
                    context.cancelled = True
                    context.cancel_reason = reason
            self._changed.notify_all()
        dropped = self._drain_unclaimed(room)
        with self._lock:
            # Contexts a finisher or another drainer holds end on their own (drained first).
            while (r := self._rooms.get(room)) is not None and any(
                c.owner is not None and not c.terminal for c in r.contexts.values()
            ):
                self._changed.wait()
        return dropped

    def forget(self, room: RoomId) -> None:
        """The scheduler cleared the room: discard its finished contexts (the rest go once drained)."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                return
            r.forgotten = True
            for context in [c for c in r.contexts.values() if c.terminal and c.owner is None]:
                self._remove(context)

    def states(self, room: RoomId) -> list[PerLayerState]:
        """The room's contexts' states, in registration order (for tests and debugging)."""
        with self._lock:
            r = self._rooms.get(room)
            return [] if r is None else [c.machine.state for c in r.contexts.values()]

    def statistics(self) -> PerLayerStatistics:
        with self._lock:
            return PerLayerStatistics(
                registered=self._registered,
                duplicates=self._duplicates,
                fallbacks=self._fallbacks,
                layer_events=self._layer_events,
                layers_submitted=self._layers_submitted,
                finished=self._finished,
                failed=self._failed,
                dropped=self._dropped,
                open_contexts=sum(
                    1 for r in self._rooms.values() for c in r.contexts.values() if not c.terminal
                ),
                lanes=len(self._lanes),
            )

    # ------------------------------------------------------------------ planning

    def _plan(
        self, room: RoomId, pages: IntArray, start_token: int, resident_pages: int, destination: Destination
    ) -> tuple[TransferBlocks, dict[LayerKey, TransferBlocks], int]:
        """``plan_chunk``'s KV blocks for the resident pages and for the forward's pages, by layer."""
        forward_start = start_token + resident_pages * self._layout.page_size
        resident = self._plan_pages(room, pages[:resident_pages], start_token, destination)
        computed = self._plan_pages(room, pages[resident_pages:], forward_start, destination)
        blocks = computed.blocks
        group = self._group_of_buffer[blocks.buffer]
        if (group < 0).any() or (self._group_of_buffer[resident.blocks.buffer] < 0).any():
            raise MappingError("the plan of a non-last chunk has non-KV blocks; per-layer sends only KV")
        order = np.argsort(group, kind="stable")  # stable: each layer keeps plan_chunk's block order
        bounds = np.searchsorted(group[order], np.arange(len(self._keys) + 1))
        layers = {
            key: blocks.take(order[int(bounds[i]) : int(bounds[i + 1])]) for i, key in enumerate(self._keys)
        }
        return resident.blocks, layers, resident.kv_pages + computed.kv_pages

    def _plan_pages(
        self, room: RoomId, pages: IntArray, start_token: int, destination: Destination
    ) -> _Planned:
        # A non-last chunk without extras: exactly the KV blocks send() would produce for these pages.
        plan = plan_chunk(
            room,
            ChunkSpec(pages=pages, start_token=start_token, last=False),
            destination,
            src_aux_row=None,
            src_layout=self._layout,
            cp_rank=self._cp_rank,
            policy=self._policy,
            writes_extras=False,
        )
        return _Planned(blocks=plan.blocks, kv_pages=plan.kv_pages)

    # ------------------------------------------------------------------ submission lanes

    def _run_lane(self, lane: _Lane) -> None:
        while True:
            with self._lock:
                while not lane.tasks:
                    if not lane.work.wait(LANE_IDLE_S) and not lane.tasks:
                        # Idle: retire (a later task for this peer starts a new lane).
                        if self._lanes.get(lane.peer) is lane:
                            del self._lanes[lane.peer]
                        return
                task = lane.tasks.popleft()
                if isinstance(task, _SubmitLayer):
                    self._pending_events -= 1
            if task is None:
                return
            try:
                if isinstance(task, _DrainRoom):
                    self._drain_task(task.room)
                else:
                    self._submit(task)
            except Exception as exc:  # the contexts fail; the lane goes on
                log.exception("per-layer lane %s/%s: %s failed", self._name, lane.peer, type(task).__name__)
                if isinstance(task, _SubmitLayer):
                    with self._lock:
                        for context in task.contexts:
                            context.error = context.error or f"internal error: {type(exc).__name__}: {exc}"
                        self._changed.notify_all()

    def _submit(self, task: _SubmitLayer) -> None:
        if task.ready is not None:
            try:
                complete = _wait_ready(task.ready, self.config.finish_timeout_s)
                problem = None if complete else f"not complete within {self.config.finish_timeout_s:g} s"
            except Exception as exc:
                problem = f"failed: {exc}"
            if problem is not None:
                with self._lock:
                    for context in task.contexts:
                        context.error = (
                            context.error or f"waiting for layer {task.layer} to be written {problem}"
                        )
                    self._changed.notify_all()
                return
        for context in task.contexts:
            with context.job_lock:
                with self._lock:
                    live = not context.cancelled and context.error is None and not context.terminal
                    first = live and not context.started
                if first:
                    # The endpoint counts the context in flight before any byte of it can land.
                    allowed = self._writes_started(context.room, context.start_token)
                    with self._lock:
                        if allowed:
                            context.started = True
                            context.first_submit_at = self._clock()
                        else:
                            context.cancelled = True
                            context.cancel_reason = (
                                context.cancel_reason or "the room can no longer be written"
                            )
                            live = False
                if live:
                    blocks = context.resident if task.layer is None else context.layers[task.layer]
                    if context.fence is None:
                        context.fence = fence_of(context.destination.peer.session, blocks)
                    context.job.submit(blocks)  # may wait while the job is full: this peer's lane only
            with self._lock:
                if live and task.layer is not None:
                    context.submitted.add(task.layer)
                    self._layers_submitted += 1
                    if (
                        context.submitted >= context.expected
                        and context.machine.state in _COLLECTING
                        and not context.cancelled  # a finisher that saw the cancel drops it
                    ):
                        context.machine.fire(PerLayerTrigger.ALL_LAYERS_SUBMITTED)
                self._changed.notify_all()

    def _drain_task(self, room: RoomId) -> None:
        self._drain_unclaimed(room)
        with self._lock:
            r = self._rooms.get(room)
            if r is not None:
                r.pending_drains -= 1
                self._maybe_forget_room(room, r)

    def _drain_unclaimed(self, room: RoomId) -> int:
        """Drain and drop the room's live contexts nobody holds; returns how many."""
        with self._lock:
            r = self._rooms.get(room)
            mine = [] if r is None else [c for c in r.contexts.values() if c.owner is None and not c.terminal]
            for context in mine:
                context.owner = _Owner.DRAINER
                context.cancelled = True
        for context in mine:
            drained: TransferResult | None = None
            try:
                with context.job_lock:
                    drained = context.job.drain()
            except Exception:  # a bug below us; nobody may wait forever for this context
                log.exception("per-layer: draining room %s chunk@%d failed", room, context.start_token)
            with self._lock:
                context.result = drained
                context.owner = None
                context.machine.fire(PerLayerTrigger.DROP)
                self._dropped += 1
                _release_blocks(context)
                r = self._rooms.get(room)
                if r is not None and r.forgotten:
                    self._remove(context)
                self._changed.notify_all()
                report = self._take_end_report(context)
            if report:
                self._writes_ended(context.room, context.start_token, _fence(context))
            log.debug(
                "room %s chunk@%d: per-layer context dropped (%s)",
                room,
                context.start_token,
                context.cancel_reason,
            )
        return len(mine)

    # ------------------------------------------------------------------ internals (lock held unless noted)

    def _enqueue(self, task: _SubmitLayer) -> None:
        """Queue a layer (or resident pages) on the lane of each context's destination peer."""
        if self._pending_events >= self.config.max_pending_events:
            for context in task.contexts:
                context.error = context.error or (
                    f"layer event queue full ({self.config.max_pending_events} events pending)"
                )
            self._changed.notify_all()
            return
        by_peer: dict[str, list[_Context]] = {}
        for context in task.contexts:
            by_peer.setdefault(context.destination.peer.session, []).append(context)
        for peer, contexts in by_peer.items():
            self._pending_events += 1
            self._lane_enqueue(peer, _SubmitLayer(tuple(contexts), task.layer, task.ready))

    def _lane_enqueue(self, peer: str, task: _Task) -> None:
        lane = self._lanes.get(peer)
        if lane is None or lane.thread is None or not lane.thread.is_alive():
            lane = _Lane(peer=peer, work=threading.Condition(self._lock))
            lane.thread = threading.Thread(
                target=self._run_lane, args=(lane,), name=f"pdkv-per-layer-{self._name}-{peer}", daemon=True
            )
            self._lanes[peer] = lane
            lane.tasks.append(task)
            lane.thread.start()
            return
        lane.tasks.append(task)
        lane.work.notify()

    def _is_registered(self, room: RoomId, start_token: int) -> bool:
        r = self._rooms.get(room)
        return r is not None and start_token in r.contexts

    def _outstanding(self, r: _Room) -> bool:
        return r.pending_drains > 0 or any(c.owner is None and not c.terminal for c in r.contexts.values())

    def _fallback(self, room: RoomId, start_token: int, reason: str) -> PerLayerMode:
        with self._lock:
            self._fallbacks += 1
        log.debug("room %s chunk@%d: monolithic path: %s", room, start_token, reason)
        return PerLayerMode.MONOLITHIC

    def _end(
        self, context: _Context, trigger: PerLayerTrigger, outcome: TransferResult | None, reason: str
    ) -> LayerTransferResult:
        """A finisher is done with ``context``: final state, counters, result (takes the lock)."""
        with self._lock:
            context.result = outcome
            context.machine.fire(trigger)
            context.owner = None
            if trigger is PerLayerTrigger.COMPLETE:
                self._finished += 1
            elif trigger is PerLayerTrigger.FAIL:
                self._failed += 1
            else:
                self._dropped += 1
            self._remove(context)
            self._changed.notify_all()
            result = self._result(context, reason)
            report = self._take_end_report(context)
        if report:
            self._writes_ended(context.room, context.start_token, _fence(context))
        return result

    def _take_end_report(self, context: _Context) -> bool:
        """Lock held, ``context`` terminal and drained: report its end to the endpoint once."""
        if not context.started or context.end_reported:
            return False
        context.end_reported = True
        return True

    def _result(self, context: _Context, reason: str) -> LayerTransferResult:
        outcome = context.result
        now = self._clock()
        ok = context.machine.state is PerLayerState.DONE and outcome is not None and outcome.ok
        engine_failure = outcome is not None and outcome.status is not JobStatus.COMPLETED
        return LayerTransferResult(
            room=context.room,
            start_token=context.start_token,
            ok=ok,
            reason="" if ok else (reason or (outcome.reason if outcome is not None else "failed")),
            engine_failure=engine_failure,
            destination=context.destination,
            kv_pages=context.kv_pages,
            bytes_written=0 if outcome is None else outcome.bytes_written,
            seconds=max(0.0, now - context.registered_at),
            first_submit_at=context.first_submit_at
            if context.first_submit_at is not None
            else context.registered_at,
            last_completion_at=now,
        )

    def _remove(self, context: _Context) -> None:
        r = self._rooms.get(context.room)
        if r is None:
            return
        if r.contexts.get(context.start_token) is context:
            del r.contexts[context.start_token]
        self._maybe_forget_room(context.room, r)

    def _maybe_forget_room(self, room: RoomId, r: _Room) -> None:
        if not r.contexts and r.pending_drains == 0 and self._rooms.get(room) is r:
            del self._rooms[room]


@attrs.frozen(kw_only=True)
class _Planned:
    blocks: TransferBlocks
    kv_pages: int


def _release_blocks(context: _Context) -> None:
    """A dropped context keeps its record (``finish`` must learn it was dropped) but not its blocks."""
    context.resident = TransferBlocks.empty()
    context.layers = {}


__all__ = [
    "ENV_VARS",
    "LayerTransferResult",
    "PerLayerConfig",
    "PerLayerMode",
    "PerLayerStatistics",
    "PerLayerTransferManager",
    "ReadyWait",
    "SupportsSynchronize",
    "UnknownLayerError",
    "layer_keys",
    "unsupported_reason",
]


def _fence(context: _Context) -> FenceWrite | None:
    """The fence owed for a context whose writes ended: only when one of them did not complete."""
    outcome = context.result
    if outcome is not None and outcome.status is JobStatus.COMPLETED:
        return None
    return context.fence
