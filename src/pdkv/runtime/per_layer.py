"""Per-layer transfer: layer L's KV moves while layers L+1.. still compute (DESIGN section 7).

Owns: ``PerLayerTransferManager`` (one per prefill transport, ``transport.per_layer``), its
configuration, results and statistics, the submission lanes, the ready waits, and each context's
engine job and blocks. Every rule on the per-(room, chunk) contexts (dedup, the FIFO of a room's
chunks, when a context may write, finish with its deadline, cancel, the end of its writes) is the
prefill endpoint's: its ``LayerBook`` (``PrefillEndpoint.layers``) and its ``layer_*`` inputs, which
the manager calls under the transport's lock (the one lock of every endpoint input) and obeys; the
manager decides nothing about a context itself, and never maps an engine session to a decode rank.
Must not touch room state: the transport reports a finished context to its endpoint (``chunk_done``
/ ``chunk_failed``) as for any chunk; the manager only moves KV bytes and says what landed. Must not
map pages itself either: a context's blocks are ``plan_chunk``'s blocks for the same chunk and
destination, split by layer, so the bytes are those of the monolithic path by construction.

How a scheduler uses it, per chunk of a room whose sender polls WaitingForInput or Transferring:

    mode = transport.per_layer.register(room, chunk_pages, start_token=..., resident_pages=...)
    ... forward: after each layer's KV write, transport.per_layer.on_layer_end(layer, ready=event)
    sender.send(chunk_pages, start_token=..., last=...)      # finishes the context, sends nothing again

- ``register`` (scheduler thread, never waits on the network) plans the chunk for each of the room's
  destinations (several when decode TP > prefill TP: every layer then goes to each, on that decode
  rank's lane), submits the pages already resident before the forward (a cached prefix the decode
  side lacks, earlier chunks' pages re-sent) at once, and returns ``PerLayerMode.PER_LAYER``.
  Registering the same (room, chunk) again is a no-op (``DUPLICATE``). Explicit fallbacks, logged at
  DEBUG, return ``MONOLITHIC`` and leave the chunk to the monolithic path: the room has no
  destinations yet (not WaitingForInput), this rank is a dummy for it, it has several destinations
  and a layer smaller than ``fan_out_min_layer_bytes`` to one of them (the batches would cost more
  than the overlap saves), the layout is not one the manager supports, or mapping refused the chunk.
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
``layer_first_write`` (False when the room can no longer be written, and the context is then
cancelled), and once every write a context submitted has ended it reports ``layer_ended`` (with the
fences owed, keyed by the decode rank the context was registered for) and applies the effects. So
the endpoint counts a per-layer context in flight from its first write: AbortAck, the RegisterAck of
a restarted decode rank, Success and ``may_write`` wait for it; nothing is held back here. When a
room ends or completes without a context, the endpoint stops its contexts itself and asks for the
drain (``DropLayers``: ``drain``).

Locks: one, the transport's (``lock``; ``locked()`` takes it and sends what was posted once it is
released, ``apply`` carries out effects with it held): it guards the endpoint with its book and the
lanes' queues. A context's job lock serialises the calls on its ``TransferJob`` (one thread at a
time, as the executor requires): taken before the transport's lock, and never held while waiting on
its conditions.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Final, Protocol, TypeAlias, cast

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
from pdkv.protocol.effects import ChunkSpec, Destination, FenceWrite, PeerKey, PrefillEffect
from pdkv.protocol.ids import RoomId
from pdkv.protocol.layers import DEFAULT_FINISH_TIMEOUT_S, LayerBookStatistics, LayerContext, Verdict
from pdkv.protocol.machines import PerLayerState, PerLayerTrigger
from pdkv.protocol.messages import IntArray
from pdkv.runtime.chunk_plan import fence_of, plan_chunk
from pdkv.runtime.executor import JobStatus, TransferExecutor, TransferJob, TransferResult

if TYPE_CHECKING:
    from pdkv.protocol.prefill import PrefillEndpoint

log = logging.getLogger(__name__)

DEFAULT_MAX_PENDING_EVENTS: Final = 65536
# Per-layer with several destinations (decode TP > prefill TP) costs a batch per layer and destination,
# each with a fixed cost (submit, completion, status: about 0.2-0.4 ms per Mooncake TCP batch on this
# 2-core machine, `pdkv bench latency`'s phase breakdown). Measured with `PDKV_PER_LAYER_FAN_OUT_MIN_BYTES=1
# pdkv bench per-layer --decode-tp 2 --tokens ...` (61 layers, 72 KiB pages, compute per layer equal
# to transfer per layer): per-layer was slower than monolithic at 144 KiB per layer and destination
# (2.15x), either way at 288 KiB (1.47x, 0.52x), and faster from 576 KiB (0.58x, 864 KiB 0.25x,
# 1.15 MB 0.09x). Re-measured with staged MHA head slices (issue 32, 32 layers, best of 5, exclusive
# lock): MLA `--decode-tp 2` 144 KiB 1.17x, 288 KiB 0.58x, 576 KiB 0.33x, 1.15 MB 0.15x; MHA
# `--mha --tp 2 --decode-tp 4` (8 KV heads x 256 B, each layer gathered through the staging pool: one
# batch per layer and destination, as for MLA) 128 KiB 0.83x, 256 KiB 0.17x, 512 KiB 0.28x, 1 MiB
# 0.18x. Per-layer now wins from about 256 KiB in both, so the threshold is 256 KiB (was 512 KiB).
# Unstaged head slices (one entry per token) would cost far more per layer; they need the staging
# pool to go per layer at these sizes. Below the threshold the chunk goes monolithic.
DEFAULT_FAN_OUT_MIN_LAYER_BYTES: Final = 256 << 10


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
    fan_out_min_layer_bytes: int = attrs.field(
        default=DEFAULT_FAN_OUT_MIN_LAYER_BYTES,
        validator=positive_int,
        metadata=config.int_var(
            "PDKV_PER_LAYER_FAN_OUT_MIN_BYTES",
            "Per-layer with several destinations only when each layer moves at least this many bytes to each",
        ),
    )
    """With several destinations, a chunk goes per layer only when every layer moves at least this
    many bytes to every destination (else the per-batch cost outweighs the overlap: monolithic)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PerLayerConfig:
        """Defaults, overridden by ``PDKV_PER_LAYER_*`` variables that are set."""
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


Apply: TypeAlias = Callable[[Sequence[PrefillEffect]], None]
"""The transport's ``_apply``: carries out the endpoint's effects in order (its lock held)."""

LANE_IDLE_S: Final = 30.0  # a peer's submission lane stops after this long without work


@attrs.frozen(kw_only=True)
class LayerShare:
    """What one per-layer context wrote to one destination."""

    destination: Destination
    kv_pages: int  # KV pages (positions) of the chunk this rank writes there
    bytes_written: int


@attrs.frozen(kw_only=True)
class LayerTransferResult:
    """What one per-layer context wrote. ``ok`` means every requested byte is in a completed write."""

    room: RoomId
    start_token: int
    ok: bool
    reason: str  # empty when ok
    engine_failure: bool  # the engine failed or timed out a write (as opposed to a missing layer or a drop)
    shares: tuple[LayerShare, ...]  # one per destination, in the endpoint's order
    seconds: float  # registration to the end of finish
    first_submit_at: float  # clock of the first submission (registration if nothing was submitted)
    last_completion_at: float

    @property
    def bytes_written(self) -> int:
        return sum(share.bytes_written for share in self.shares)


@attrs.frozen(kw_only=True)
class PerLayerStatistics(LayerBookStatistics):
    """Counters of one manager since it started: its book's (``layers_submitted`` counts one per
    layer and destination), and its lanes."""

    lanes: int
    """Submission lanes (one per destination peer with recent work)."""


class _Owner(enum.Enum):
    FINISHER = "finisher"  # a transfer worker in finish()
    DRAINER = "drainer"  # drop() or the submission thread draining a cancelled context


@attrs.define(eq=False)
class _Target:
    """One destination of a context: its engine job (driven by that peer's lane, then the finisher),
    its blocks, and what the job reported."""

    destination: Destination
    job: TransferJob
    resident: TransferBlocks
    layers: dict[LayerKey, TransferBlocks]
    kv_pages: int
    job_lock: threading.Lock = attrs.Factory(threading.Lock)
    result: TransferResult | None = None
    fence: FenceWrite | None = None  # from its first submitted block: repeated if a write failed


@attrs.define(eq=False)
class _Work:
    """What the manager keeps beside a context of the book: a target per destination session (in the
    endpoint's order) and which thread holds the context's jobs."""

    targets: dict[str, _Target]
    owner: _Owner | None = None

    def job_failed(self) -> bool:
        return any(t.job.failed for t in self.targets.values())


_Context: TypeAlias = LayerContext[object]


def _work(context: _Context) -> _Work:
    """What the manager keeps beside a context of the endpoint's book (the book holds it opaque)."""
    return cast(_Work, context.work)


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
        endpoint: PrefillEndpoint,
        lock: threading.Lock,
        locked: Callable[[], AbstractContextManager[object]],
        apply: Apply,
        layout: BufferLayout,
        cp_rank: int = 0,
        policy: OwnershipPolicy | None = None,
        config: PerLayerConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        name: str = "",
    ) -> None:
        """``endpoint``: the prefill endpoint whose book holds the contexts; ``lock``: the lock every
        input of it takes (the transport's), ``locked()`` the same taken so that the messages posted
        meanwhile leave when it is released, ``apply`` what carries out its effects (lock held)."""
        self._executor = executor
        self._endpoint = endpoint
        self._book = endpoint.layers
        self._locked = locked
        self._apply = apply
        self._layout = layout
        self._cp_rank = cp_rank
        self._policy = policy
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
        self._lock = lock
        self._changed = threading.Condition(lock)  # context states (finish, drop wait on it)
        self._lanes: dict[str, _Lane] = {}  # destination peer session -> its submission lane
        self._pending_events = 0
        self._started = False
        self._closed = False

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
            rooms = self._book.rooms()
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
        room: RoomId | int,
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
        room = arguments.checked_room(room)  # what sender() takes: a RoomId or an int
        if self._closed:
            raise TransportClosedError(f"per_layer.register of room {room}: the transport is closed")
        # A copy (the caller may reuse its array), checked: no duplicate may reach the engine.
        pages = arguments.page_list(chunk_pages, room=room, argument="chunk_pages")
        start_token = arguments.count(start_token, room=room, argument="start_token")
        resident_pages = arguments.count(resident_pages, room=room, argument="resident_pages")
        if not 0 <= resident_pages <= pages.size:
            raise MappingError(f"room {room}: resident_pages {resident_pages} outside 0..{pages.size}")
        with self._lock:
            if self._book.is_registered(room, start_token):
                self._book.duplicate()
                return PerLayerMode.DUPLICATE
        if self.is_closed():
            return self._fallback(room, start_token, "the manager is closed")
        if self._unsupported is not None:
            return self._fallback(room, start_token, self._unsupported)
        with self._lock:
            ruling = self._endpoint.layer_destinations(room, pages, start_token)  # MappingError: refused
        if isinstance(ruling, str):
            return self._fallback(room, start_token, ruling)
        destinations = ruling
        try:
            planned = [self._plan(room, pages, start_token, resident_pages, d) for d in destinations]
        except PdkvError as exc:
            return self._fallback(room, start_token, f"mapping refused the chunk: {exc}")
        if len(destinations) > 1:
            smallest = min(int(b.length.sum()) for p in planned for b in p.layers.values())
            if smallest < self.config.fan_out_min_layer_bytes:
                return self._fallback(
                    room,
                    start_token,
                    f"{len(destinations)} destinations and a layer of {smallest} bytes to one of them: under "
                    f"{self.config.fan_out_min_layer_bytes} bytes per layer and destination, a batch per "
                    "layer and destination costs more than overlapping the forward saves",
                )
        with self._lock:
            if self.is_closed():  # close() may have dropped every room while we planned
                self._book.fallback()
                return PerLayerMode.MONOLITHIC
            work = _Work(
                targets={
                    d.peer.session: _Target(
                        destination=d,
                        job=self._executor.start(d.peer.session),
                        resident=plan.resident,
                        layers=plan.layers,
                        kv_pages=plan.kv_pages,
                    )
                    for d, plan in zip(destinations, planned, strict=True)
                }
            )
            # The room may have failed (and its contexts stopped) while we planned: only a room that
            # still has the same destinations gets a context, atomically with its failure path.
            context = self._endpoint.layer_register(
                room,
                start_token,
                pages=pages,
                destinations=destinations,
                expected=self._known_keys,
                work=work,
                now=self._clock(),
            )
            if context is None:
                return PerLayerMode.DUPLICATE
            if isinstance(context, str):
                self._book.fallback()
                log.debug("room %s chunk@%d: monolithic path: %s", room, start_token, context)
                return PerLayerMode.MONOLITHIC
            if any(len(t.resident) for t in work.targets.values()):
                self._enqueue(_SubmitLayer((context,), None, None))
        kv_pages = planned[0].kv_pages
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

        Only records and queues the event (never blocks the forward): the peer's submission lane waits
        for ``ready`` and submits the layer for every context the book routed it to.
        """
        if self._closed:
            raise TransportClosedError(f"per_layer.on_layer_end of layer {layer_id}: the transport is closed")
        key = LayerKey(model=model, layer_id=layer_id)
        if self._unsupported is None and key not in self._known_keys:
            known = ", ".join(map(str, self._keys[:8])) + (" ..." if len(self._keys) > 8 else "")
            raise UnknownLayerError(f"layer {key} has no KV buffer in this rank's layout (layers: {known})")
        with self._lock:
            targets = self._book.layer_ready(key)
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
        sent = None if pages is None else np.asarray(pages, dtype=np.int64)
        with self._lock:
            context = self._book.context(room, start_token)
            if context is None:
                return None
            while _work(context).owner is _Owner.DRAINER:
                self._changed.wait()
            if _work(context).owner is _Owner.FINISHER:
                raise LocalProtocolError(f"room {room} chunk@{start_token}: finished twice")
            verdict = self._book.begin_finish(context, sent, self._clock())
            if verdict is Verdict.DROPPED:
                return self._result(context, f"dropped before send(): {context.stop_reason}")
            _work(context).owner = _Owner.FINISHER
            while verdict is Verdict.WAIT:
                assert context.finish_deadline is not None  # begin_finish set it
                self._changed.wait(max(0.0, context.finish_deadline - self._clock()))
                verdict = self._book.finish_check(
                    context, self._clock(), job_failed=_work(context).job_failed()
                )
            self._changed.notify_all()  # a context that broke here stops its lane's submissions
        targets = list(_work(context).targets.values())
        try:
            if verdict is not Verdict.COMPLETE:
                for target in targets:
                    with target.job_lock:
                        target.result = target.job.drain()
                if verdict is Verdict.DRAIN_DROP:
                    return self._end(context, PerLayerTrigger.DROP, f"room failed: {context.stop_reason}")
                return self._end(context, PerLayerTrigger.FAIL, context.stop_reason)
            for target in targets:  # every job's writes are all submitted: they complete in parallel
                with target.job_lock:
                    remaining = max(0.0, (context.finish_deadline or 0.0) - self._clock())
                    outcome = target.job.finish(timeout=remaining)
                    if outcome.batches_in_flight:
                        outcome = target.job.drain()  # never report while a write may still land
                    target.result = outcome
        except Exception as exc:  # a bug below us: the context still ends, so nobody waits forever
            self._end(context, PerLayerTrigger.FAIL, f"internal error: {type(exc).__name__}: {exc}")
            raise
        failed = [t.result for t in targets if t.result is None or not t.result.ok]
        if not failed:
            return self._end(context, PerLayerTrigger.COMPLETE, "")
        first = failed[0]
        return self._end(context, PerLayerTrigger.FAIL, first.reason if first is not None else "failed")

    def drain(self, room: RoomId) -> bool:
        """The endpoint stopped the room's contexts (``DropLayers``; the transport's lock held): drain
        those nobody holds on their lanes and drop them once their writes ended (non-blocking; each
        context that wrote reports ``layer_ended`` then). True when something was outstanding."""
        live = [c for c in self._book.contexts(room) if not c.terminal]
        self._changed.notify_all()
        unclaimed = any(_work(c).owner is None for c in live)
        if not unclaimed and self._book.pending_drains(room) == 0:
            return False
        peers = {peer for c in self._book.contexts(room) for peer in c.peers}
        self._book.drain_queued(room, len(peers))
        for peer in sorted(peers):
            self._lane_enqueue(peer, _DrainRoom(room))
        return True

    def drop(self, room: RoomId, reason: str = "dropped") -> int:
        """Stop every context of ``room``, wait for its outstanding writes, discard it; returns the
        number of contexts dropped. After it returns nothing of the room is written any more."""
        with self._lock:
            if not self._book.contexts(room):
                return 0
            self._book.cancel(room, reason)
            self._changed.notify_all()
        dropped = self._drain_unclaimed(room, reason)
        with self._lock:
            # Contexts a finisher or another drainer holds end on their own (drained first).
            while any(_work(c).owner is not None and not c.terminal for c in self._book.contexts(room)):
                self._changed.wait()
        return dropped

    def holds(self, room: RoomId) -> bool:
        """Does a per-layer context of ``room`` exist (its chunks' ``send()`` may wait for a forward)?"""
        with self._lock:
            return bool(self._book.contexts(room))

    def states(self, room: RoomId) -> list[PerLayerState]:
        """The room's contexts' states, in registration order (for tests and debugging)."""
        with self._lock:
            return [c.state for c in self._book.contexts(room)]

    def statistics(self) -> PerLayerStatistics:
        with self._lock:
            book = self._book.statistics()
            return PerLayerStatistics(
                **attrs.asdict(book),
                lanes=len(self._lanes),
            )

    # ------------------------------------------------------------------ planning

    def _plan(
        self, room: RoomId, pages: IntArray, start_token: int, resident_pages: int, destination: Destination
    ) -> _LayerPlan:
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
        return _LayerPlan(
            resident=resident.blocks, layers=layers, kv_pages=resident.kv_pages + computed.kv_pages
        )

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
                    self._submit(task, lane.peer)
            except Exception as exc:  # the contexts fail; the lane goes on
                log.exception("per-layer lane %s/%s: %s failed", self._name, lane.peer, type(task).__name__)
                if isinstance(task, _SubmitLayer):
                    with self._lock:
                        for context in task.contexts:
                            self._book.broken(context, f"internal error: {type(exc).__name__}: {exc}")
                        self._changed.notify_all()

    def _submit(self, task: _SubmitLayer, peer: str) -> None:
        if task.ready is not None:
            try:
                complete = _wait_ready(task.ready, self.config.finish_timeout_s)
                problem = None if complete else f"not complete within {self.config.finish_timeout_s:g} s"
            except Exception as exc:
                problem = f"failed: {exc}"
            if problem is not None:
                with self._lock:
                    for context in task.contexts:
                        self._book.broken(context, f"waiting for layer {task.layer} to be written {problem}")
                    self._changed.notify_all()
                return
        for context in task.contexts:
            target = _work(context).targets[peer]
            with target.job_lock:
                with self._lock:
                    # The endpoint counts the context in flight before any byte of it can land.
                    live = self._endpoint.layer_first_write(context, self._clock())
                if live:
                    blocks = target.resident if task.layer is None else target.layers[task.layer]
                    if target.fence is None:
                        target.fence = fence_of(target.destination.peer.session, blocks)
                    target.job.submit(blocks)  # may wait while the job is full: this peer's lane only
            with self._lock:
                if live:
                    self._book.submitted(context, task.layer, peer)
                self._changed.notify_all()

    def _drain_task(self, room: RoomId) -> None:
        self._drain_unclaimed(room, "room failed")
        with self._lock:
            self._book.drain_ran(room)

    def _drain_unclaimed(self, room: RoomId, reason: str) -> int:
        """Drain and drop the room's live contexts nobody holds; returns how many."""
        with self._lock:
            self._book.cancel(room, reason)  # any registered since the cancel stops too
            mine = [c for c in self._book.contexts(room) if _work(c).owner is None and not c.terminal]
            for context in mine:
                _work(context).owner = _Owner.DRAINER
        for context in mine:
            for target in _work(context).targets.values():
                try:
                    with target.job_lock:
                        target.result = target.job.drain()
                except Exception:  # a bug below us; nobody may wait forever for this context
                    log.exception("per-layer: draining room %s chunk@%d failed", room, context.start_token)
            with self._locked():
                _work(context).owner = None
                self._report_end(context, PerLayerTrigger.DROP)
                for target in _work(context).targets.values():
                    _release_blocks(target)
                self._changed.notify_all()
            log.debug(
                "room %s chunk@%d: per-layer context dropped (%s)",
                room,
                context.start_token,
                context.stop_reason,
            )
        return len(mine)

    # ------------------------------------------------------------------ internals (lock held unless noted)

    def _enqueue(self, task: _SubmitLayer) -> None:
        """Queue a layer (or resident pages) on the lane of each context's destination peer."""
        if self._pending_events >= self.config.max_pending_events:
            for context in task.contexts:
                self._book.broken(
                    context, f"layer event queue full ({self.config.max_pending_events} events pending)"
                )
            self._changed.notify_all()
            return
        by_peer: dict[str, list[_Context]] = {}
        for context in task.contexts:
            for peer in context.peers:
                by_peer.setdefault(peer, []).append(context)
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

    def _fallback(self, room: RoomId, start_token: int, reason: str) -> PerLayerMode:
        with self._lock:
            self._book.fallback()
        log.debug("room %s chunk@%d: monolithic path: %s", room, start_token, reason)
        return PerLayerMode.MONOLITHIC

    def _end(self, context: _Context, trigger: PerLayerTrigger, reason: str) -> LayerTransferResult:
        """A finisher is done with ``context``: its writes ended (takes the lock)."""
        with self._locked():
            self._report_end(context, trigger)
            _work(context).owner = None
            self._changed.notify_all()
            return self._result(context, reason)

    def _report_end(self, context: _Context, trigger: PerLayerTrigger) -> None:
        """Every write of ``context`` ended: the endpoint hears it (it may release an AbortAck, a
        RegisterAck or the room's Success) with the fences owed where a write did not complete."""
        fences = _fences(_work(context))
        self._apply(self._endpoint.layer_ended(context, trigger, self._clock(), fences=fences or None))

    def _result(self, context: _Context, reason: str) -> LayerTransferResult:
        targets = _work(context).targets.values()
        outcomes = [t.result for t in targets]
        now = self._clock()
        ok = context.state is PerLayerState.DONE and all(o is not None and o.ok for o in outcomes)
        engine_failure = any(o is not None and o.status is not JobStatus.COMPLETED for o in outcomes)
        return LayerTransferResult(
            room=context.room,
            start_token=context.start_token,
            ok=ok,
            reason="" if ok else (reason or "failed"),
            engine_failure=engine_failure,
            shares=tuple(
                LayerShare(
                    destination=t.destination,
                    kv_pages=t.kv_pages,
                    bytes_written=0 if t.result is None else t.result.bytes_written,
                )
                for t in targets
            ),
            seconds=max(0.0, now - context.registered_at),
            first_submit_at=context.first_submit_at
            if context.first_submit_at is not None
            else context.registered_at,
            last_completion_at=now,
        )


@attrs.frozen(kw_only=True)
class _Planned:
    blocks: TransferBlocks
    kv_pages: int


@attrs.frozen(kw_only=True)
class _LayerPlan:
    """A chunk's KV blocks for one destination: resident before the forward, and by layer."""

    resident: TransferBlocks
    layers: dict[LayerKey, TransferBlocks]
    kv_pages: int


def _release_blocks(target: _Target) -> None:
    """A dropped context keeps its record (``finish`` must learn it was dropped) but not its blocks."""
    target.resident = TransferBlocks.empty()
    target.layers = {}


__all__ = [
    "ENV_VARS",
    "LayerShare",
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


def _fences(work: _Work) -> dict[PeerKey, FenceWrite]:
    """The fences owed for a context whose writes ended: one per decode rank where a write did not
    complete (and something was submitted), keyed by the rank the context was registered for: the
    room may have failed and the rank may be gone since, and the fence is owed all the same."""
    return {
        t.destination.peer.key: t.fence
        for t in work.targets.values()
        if t.fence is not None and (t.result is None or t.result.status is not JobStatus.COMPLETED)
    }
