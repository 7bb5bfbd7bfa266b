"""``PrefillTransport`` and ``KVSender``: the prefill rank's side of pdkv, as a scheduler embeds it.

Owns: the threads and queues of one prefill rank around its sans-IO ``PrefillEndpoint``:

- the control thread (``ControlLoop``) owns the sockets, feeds messages and deadlines to the
  endpoint and sends what the endpoint asks;
- transfer workers take ``SubmitChunk`` effects from a bounded queue, map the chunk for each
  destination (``plan_chunk``), move the bytes (``TransferExecutor``) and report the result back;
- the scheduler's calls (``KVSender``) only take the lock, update the endpoint and enqueue: they
  never wait on the network;
- the per-layer path (``transport.per_layer``, a ``PerLayerTransferManager``): a chunk registered
  before its forward is sent layer by layer while the forward runs; the worker that picks the chunk
  up after ``send()`` finishes that context instead of sending the chunk again. The contexts are the
  endpoint's (its ``LayerBook``), in flight for it from their first write (``layer_first_write`` /
  ``layer_ended``), so AbortAck, RegisterAck and Success wait for them there. When a room fails (or
  completes without a registered chunk), the endpoint stops its contexts and the manager drains
  them (``DropLayers``).

All room state lives in the endpoint, behind one lock. Effects are carried out in the order the
endpoint produced them. A worker never dies on an exception: the chunk (and so the room) fails with
the reason, and the worker takes the next chunk.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar, assert_never

import attrs
import numpy as np

from pdkv import config
from pdkv.config import tcp_address_problem
from pdkv.control.auth import Authenticator
from pdkv.control.channel import ChannelStatistics
from pdkv.control.errors import ControlError
from pdkv.engine.backend import TransferBackend
from pdkv.errors import (
    ConfigError,
    InvalidArgumentError,
    PdkvError,
    RegistryError,
    RouteUnavailableError,
)
from pdkv.mapping import (
    DEFAULT_LAYOUT_POLICY,
    BufferLayout,
    LayoutPolicy,
    OwnershipPolicy,
    PageInterleaved,
    TransferBlocks,
    chunk_page_start,
    cp_owned,
    map_chunk,
    transfer_view,
)
from pdkv.metrics import KVTransferMetric, TransportCounter, TransportGauge, TransportMetricsSnapshot
from pdkv.protocol import arguments
from pdkv.protocol.config import Timeouts
from pdkv.protocol.effects import (
    ChunkSpec,
    Destination,
    DropLayers,
    FenceWrite,
    ForgetPeer,
    Notice,
    PeerKey,
    PrefillEffect,
    RoomFinished,
    Send,
    SubmitChunk,
    SubmitFence,
)
from pdkv.protocol.ids import Endpoint, Epoch, InstanceId, RoomId, SessionId
from pdkv.protocol.messages import (
    IntArray,
    Message,
    Origin,
    Outcome,
    RankAnnounce,
    RankCoord,
    Register,
    StateIndices,
    TransferMetricData,
    TransferStatus,
)
from pdkv.protocol.poll import KVPoll
from pdkv.protocol.prefill import PrefillEndpoint, PrefillStatistics
from pdkv.runtime._host import WAIT_RECEIVES_ENV, EndpointHost, RoomHandle, new_epoch, peer_name
from pdkv.runtime._layout_policy import LAYOUT_POLICY_ENV
from pdkv.runtime._loop import ChannelFactory
from pdkv.runtime.channels import announce_to_registry, control_channel_factory
from pdkv.runtime.checksum import (
    ChecksumBook,
    Checksummer,
    ChunkSources,
    checksums_from_env,
    chunk_checksums,
    kv_checksums,
)
from pdkv.runtime.chunk_plan import ChunkPlan, fence_of, plan_chunk
from pdkv.runtime.executor import ExecutorConfig, TransferExecutor, TransferResult
from pdkv.runtime.per_layer import (
    LayerTransferResult,
    PerLayerConfig,
    PerLayerStatistics,
    PerLayerTransferManager,
)
from pdkv.runtime.staging import StagingPool

log = logging.getLogger(__name__)

PARTITION_DUMP = config.declare(
    "PDKV_DEBUG_PARTITION_DUMP", "1: log each chunk's KV and state partition per CP rank (no other effect)"
)

_T = TypeVar("_T")

INLINE_CHECKSUM_BYTES = 32 << 20
"""With checksums on, a chunk's write of at most this many bytes is checksummed by its worker before
it is submitted (about 1.5 ms of reading here); a larger one on the checksum thread while it moves."""


def _ownership_policy(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not all(callable(getattr(value, name, None)) for name in ("owner", "physical")) or not isinstance(
        getattr(value, "cp_size", None), int
    ):
        raise ConfigError(
            f"{attribute.name} must be an OwnershipPolicy (PageInterleaved, BlockCyclic ...), "
            f"got {value!r:.60}"
        )


@attrs.frozen(kw_only=True)
class PrefillConfig:
    """One prefill rank. ``registry`` is the bootstrap registry's address (``tcp://host:port``).

    The constructor reads no environment: ``PrefillConfig.from_env(...)`` takes the ``PDKV_*``
    overrides of the timeouts, the executor, the per-layer path and the layout policy (README,
    "Environment")."""

    instance: InstanceId = attrs.field(validator=config.non_empty_text)
    rank: RankCoord = attrs.field(validator=config.instance_of(RankCoord))
    tp_size: int = attrs.field(validator=config.positive_int)
    cp_size: int = attrs.field(default=1, validator=config.positive_int)
    layout: BufferLayout = attrs.field(validator=config.instance_of(BufferLayout))
    registry: str = attrs.field(validator=config.non_empty_text)
    host: str = attrs.field(default="127.0.0.1", validator=config.non_empty_text)
    ownership: OwnershipPolicy | None = attrs.field(
        default=None, validator=attrs.validators.optional(_ownership_policy)
    )
    """CP shared-KV ownership (default: page-interleaved over ``cp_size``)."""
    timeouts: Timeouts = attrs.field(factory=Timeouts, validator=config.instance_of(Timeouts))
    executor: ExecutorConfig = attrs.field(
        factory=ExecutorConfig, validator=config.instance_of(ExecutorConfig)
    )
    per_layer: PerLayerConfig = attrs.field(
        factory=PerLayerConfig, validator=config.instance_of(PerLayerConfig)
    )
    epoch: Epoch = attrs.field(factory=new_epoch, validator=config.instance_of(int))
    workers: int = attrs.field(default=2, validator=config.positive_int)
    queue_size: int = attrs.field(default=4096, validator=config.positive_int)
    shared_chunks: int = attrs.field(default=32, validator=config.positive_int)
    """Most chunks a transfer worker takes off its queue at once: the ones already queued (never
    waited for) go to each decode rank as one shared job (1: every chunk on its own)."""
    wait_runs_chunk_bytes: int = attrs.field(
        default=8 << 20,
        validator=config.non_negative_int,
        metadata=config.int_var(
            "PDKV_WAIT_RUNS_CHUNK_BYTES",
            "Prefill: a scheduler waiting in wait_progress runs the chunk queued itself when it is the only "
            "one, no transfer worker is busy and its KV is at most this many bytes (0: never)",
        ),
    )
    """``wait_progress`` on the scheduler's thread runs the chunk queued there (plan, write, status)
    when it is the only one queued, no transfer worker is busy and its KV bytes are at most this,
    instead of sleeping while a worker wakes for it and then waking the scheduler: two thread
    hand-offs less on a room of a lightly loaded rank (under load the workers take queued chunks
    together, in shared jobs). The wait then lasts as long as that transfer, past its timeout if
    need be."""
    wait_receives: bool = attrs.field(
        default=True, validator=config.instance_of(bool), metadata=WAIT_RECEIVES_ENV
    )
    """``wait_progress`` receives on the scheduler's thread while it waits: a message that arrives
    then is handled where it is awaited, one thread hand-off less (``EndpointHost.wait_progress``)."""
    register_memory: bool = attrs.field(default=True, validator=config.instance_of(bool))
    """Register every buffer of ``layout`` with the backend (False: the caller registered them)."""
    kv_checksum: bool = attrs.field(default=False, validator=config.instance_of(bool))
    """``PDKV_KV_CHECKSUM``: every Success status carries checksums per (buffer, page) of what this
    rank wrote (``pdkv.runtime.checksum``), for the decode to verify before its Success."""
    checksum_device: str = attrs.field(default="cpu", validator=config.non_empty_text)
    """Where the registered buffers live (``cpu``, ``cuda:N``): the checksums run there."""
    layout_policy: LayoutPolicy = attrs.field(
        default=DEFAULT_LAYOUT_POLICY, validator=config.instance_of(LayoutPolicy), metadata=LAYOUT_POLICY_ENV
    )
    """What a decode rank's registration may differ in (``DEGRADE_DRAFT``, the default: draft-model
    buffers only one side registers are left out of that pair's transfers; ``STRICT``: any difference
    refuses it). Target buffers must match under either."""

    def __attrs_post_init__(self) -> None:
        if self.rank.tp >= self.tp_size or self.rank.cp >= self.cp_size:
            raise ConfigError(f"rank {self.rank} outside tp_size {self.tp_size} / cp_size {self.cp_size}")
        if self.ownership is not None and self.ownership.cp_size != self.cp_size:
            raise ConfigError(
                f"ownership policy is for cp_size {self.ownership.cp_size}, transport has {self.cp_size}"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **fields: Any) -> PrefillConfig:
        """``fields`` as for the constructor; the timeouts, executor, per-layer and layout-policy settings
        not given there come from the ``PDKV_*`` variables set in ``env`` (``os.environ`` by default)."""
        fields.setdefault("timeouts", Timeouts.from_env(env))
        fields.setdefault("executor", ExecutorConfig.from_env(env))
        fields.setdefault("per_layer", PerLayerConfig.from_env(env))
        fields.setdefault("kv_checksum", checksums_from_env(env))
        return config.from_env(cls, env, **fields)

    @property
    def policy(self) -> OwnershipPolicy:
        return self.ownership if self.ownership is not None else PageInterleaved(cp_size=self.cp_size)

    @property
    def origin(self) -> Origin:
        return Origin(instance=self.instance, epoch=self.epoch, rank=self.rank)


@attrs.frozen(kw_only=True)
class PrefillTransportStatistics:
    """Everything an operator asks of one prefill rank: protocol counters, bytes and latencies, sockets."""

    endpoint: PrefillStatistics
    metrics: TransportMetricsSnapshot
    channel: ChannelStatistics
    per_layer: PerLayerStatistics
    worker_errors: int
    queue_depth: int
    chunks_run_waiting: int = 0
    """Chunks a scheduler ran itself while it waited for progress (``wait_runs_chunk_bytes``)."""
    receive_lends: int = 0
    """Times the control thread lent receiving to a scheduler waiting in ``wait_progress``
    (``PDKV_WAIT_RECEIVES``): each hand-over, not each wait."""


@attrs.frozen
class _Written:
    """What one planned write of a chunk moved to one destination, and when."""

    kv_pages: int
    bytes: int
    seconds: float
    first_submit_at: float
    last_completion_at: float


class PrefillTransport(EndpointHost[PrefillEndpoint, PrefillEffect]):
    """One prefill rank: registers its buffers, announces itself, and serves its rooms."""

    def __init__(
        self,
        config: PrefillConfig,
        backend: TransferBackend,
        *,
        channel_factory: ChannelFactory | None = None,
        announce: Callable[[str, RankAnnounce, float], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
        staging: StagingPool | None = None,
    ) -> None:
        """``staging``: a pool over this rank's buffers, registered with ``backend``, that the executor
        gathers scattered writes into (``pdkv.runtime.staging``); the caller closes it after ``close()``."""
        self.config = config
        self.backend = backend
        factory = channel_factory if channel_factory is not None else control_channel_factory()
        super().__init__(
            PrefillEndpoint(
                origin=config.origin,
                layout=config.layout,
                timeouts=config.timeouts,
                policy=config.policy,
                layout_policy=config.layout_policy,
                layer_finish_timeout_s=config.per_layer.finish_timeout_s,
            ),
            factory(config.host),
            thread_name=f"pdkv-prefill-{config.rank}",
            logger=log,
            clock=clock,
        )
        self._executor = TransferExecutor(backend, config.executor, staging=staging)
        self._work: queue.Queue[SubmitChunk | SubmitFence | None] = queue.Queue(maxsize=config.queue_size)
        self._page_bytes = sum(b.item_bytes for b in config.layout.kv_buffers)  # one page, every KV buffer
        self._chunks_run_waiting = 0
        self._waiting_runs = 0  # chunks a waiting scheduler is running now; close() waits for them
        self._waiting_run = threading.Condition()  # guards both counts
        # Transfer workers running chunks now: a waiting scheduler leaves the queue to them.
        self._busy_workers = 0
        if announce is None:  # the zmq registry: an address it can dial, checked now, not 30 s from now
            problem = tcp_address_problem(self.config.registry)
            if problem is not None:
                raise ConfigError(f"PrefillConfig.registry {problem}")
        self._announce = announce if announce is not None else _default_announce()
        self._workers: list[threading.Thread] = []  # started by start(), new ones on a retried start
        self.per_layer = PerLayerTransferManager(
            self._executor,
            endpoint=self._endpoint,
            lock=self._lock,
            locked=self._locked,
            apply=self._apply,
            layout=config.layout,
            cp_rank=config.rank.cp,
            policy=config.policy,
            config=config.per_layer,
            clock=clock,
            name=str(config.rank),
        )
        """Per-layer transfer (DESIGN section 7): ``register``, ``on_layer_end`` per layer, ``send()``."""
        self._worker_errors = 0
        self._partition_dump = os.environ.get(PARTITION_DUMP.name) == "1"
        self._checksum_on = config.kv_checksum
        self._checksummer: Checksummer | None = None  # built with the first room that needs it
        # A chunk's checksums are computed here while the engine moves its bytes (started by the first).
        self._checksum_pool: ThreadPoolExecutor | None = None
        self.checksums = ChecksumBook()
        """With ``kv_checksum``: what each room's chunks wrote to each decode rank, as checksums,
        until its Success status carries them (``add_layer``: the per-layer path's seam)."""

    # ------------------------------------------------------------------ lifecycle

    def start(self, *, announce_timeout_s: float = 30.0) -> None:
        """Register buffers, start threads, announce this rank to the registry.

        Idempotent once it succeeded. A failed start (memory that cannot be registered, a registry
        that does not answer within ``announce_timeout_s``, a refused announcement) rolls back
        completely: threads stopped, memory unregistered; it raises and may be retried.
        """

        announce_timeout_s = arguments.seconds(
            announce_timeout_s, argument="announce_timeout_s", positive=True
        )

        def workers_and_announcement() -> None:
            self._workers = [
                threading.Thread(
                    target=self._work_loop, name=f"pdkv-transfer-{self.config.rank}-{i}", daemon=True
                )
                for i in range(self.config.workers)
            ]
            for worker in self._workers:
                worker.start()
            self._announce_now(announce_timeout_s)
            self.per_layer.start()

        layout = self.config.layout if self.config.register_memory else None
        self._start(self.backend, layout, then=workers_and_announcement, undo=self._stop_workers)

    def _before_receive(self, message: Message) -> None:
        """A decode rank's Register carries what this engine needs to write to it (NIXL's metadata):
        the backend learns it before the endpoint answers. Metadata the engine refuses is logged; each
        write to that rank then fails with the reason, and the control loop goes on."""
        if isinstance(message, Register):
            try:
                self.backend.add_peer(message.session, message.engine_metadata)
            except PdkvError as exc:
                log.warning("engine metadata of decode rank %s refused: %s", message.origin, exc)

    def _announce_now(self, timeout_s: float) -> None:
        layout = self.config.layout
        message = RankAnnounce(
            origin=self.config.origin,
            tp_size=self.config.tp_size,
            cp_size=self.config.cp_size,
            endpoint=Endpoint(self.address),
            session=SessionId(self.backend.session_id),
            page_size=layout.page_size,
            layout_digest=layout.digest(),
        )
        deadline = self._clock() + timeout_s
        while True:
            remaining = deadline - self._clock()
            try:
                self._announce(self.config.registry, message, max(0.05, min(remaining, 5.0)))
                return
            except RegistryError:
                raise  # a refusal, not silence: retrying cannot help
            except ControlError as exc:
                if deadline - self._clock() <= 0.05:
                    raise RouteUnavailableError(
                        f"prefill {self.config.rank}: registry {self.config.registry} did not take the "
                        f"announcement within {timeout_s:g} s: {exc}"
                    ) from exc
                time.sleep(min(0.1, max(0.0, deadline - self._clock())))

    def _stop_workers(self) -> None:
        """A failed start: the transfer workers it started stop (nothing was queued for them)."""
        for _ in self._workers:
            self._work.put(None)
        for worker in self._workers:
            worker.join(30)
        self._workers = []

    def close(self, *, timeout_s: float = 30.0) -> None:
        """Fail the open rooms (their decode ranks are told), stop threads once in-flight writes
        ended, answer the decode ranks' Aborts of those rooms (for up to one heartbeat interval: their
        pages come back proven, not after a quarantine), close sockets, unregister memory. Idempotent.

        Memory is unregistered only when no write can still touch it: if a transfer is still running
        after ``timeout_s`` (a stuck engine), it is reported (ERROR log, ``stuck_writes``) and the
        memory stays registered rather than raced.
        """
        timeout_s = arguments.seconds(timeout_s, argument="timeout_s")
        if not self._begin_close("prefill transport closed"):
            return
        # Contexts waiting for layers that will never come release their workers, and every
        # per-layer write ends before memory is unregistered below.
        per_layer_stopped = self.per_layer.close(timeout_s)
        for _ in self._workers:
            self._work.put(None)
        deadline = time.monotonic() + timeout_s
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        with self._waiting_run:  # a chunk another thread's wait_progress took writes to memory too
            self._waiting_run.wait_for(lambda: self._waiting_runs == 0, max(0.0, deadline - time.monotonic()))
            waiting_runs = self._waiting_runs
        if self._checksum_pool is not None:  # it reads registered memory: done before that goes
            self._checksum_pool.shutdown(wait=True)
        running = [w.name for w in self._workers if w.is_alive()]
        if waiting_runs:
            running.append("a chunk run by a waiting scheduler")
        if not running:
            # The decode ranks told of the rooms failed above answer with an Abort, and its AbortAck is
            # their proof that nothing lands in those pages any more: the control thread keeps
            # answering until none is owed. A live rank answers within a round trip; one silent for a
            # heartbeat interval is gone or stalled, and its rooms take the ack timeout, as before.
            # (Stopped at once, it left such rooms in quarantine on a live decode about half the
            # time, and a decode closing meanwhile kept its memory registered for good.)
            answer_s = min(self.config.timeouts.heartbeat_interval, max(0.0, deadline - time.monotonic()))
            self._await_endpoint(lambda endpoint: endpoint.answers_owed() == 0, answer_s)
        stuck = None
        if running or not per_layer_stopped:
            busy = ", ".join(running + ([] if per_layer_stopped else ["per-layer submission"]))
            stuck = (
                f"prefill {self.config.rank} closed with transfers still running after {timeout_s:g} s "
                f"({busy})"
            )
        self._finish_close(stuck)

    # ------------------------------------------------------------------ scheduler surface

    def sender(self, room: RoomId | int) -> KVSender:
        """The scheduler's handle on ``room`` (an int in 1..2**63-1; checked here)."""
        checked = arguments.checked_room(room)
        self._check_open("sender()")
        return KVSender(self, checked)

    def statistics(self) -> PrefillTransportStatistics:
        with self._lock:
            endpoint = self._endpoint.statistics()
        return PrefillTransportStatistics(
            endpoint=endpoint,
            metrics=self.metrics.snapshot(),
            channel=self._loop.channel.statistics(),
            per_layer=self.per_layer.statistics(),
            worker_errors=self._worker_errors,
            queue_depth=self._work.qsize(),
            chunks_run_waiting=self._chunks_run_waiting,
            receive_lends=self._loop.lends,
        )

    # ------------------------------------------------------------------ effects (lock held)

    def _after_tick(self) -> None:
        skipped = self._endpoint.draft_buffers_skipped()
        self.metrics.set_gauge(TransportGauge.DRAFT_BUFFERS_SKIPPED, skipped)

    def _apply_effect(self, effect: PrefillEffect) -> None:
        match effect:
            case Send():
                self._loop.post(effect.to, self._with_checksums(effect))
            case SubmitChunk():
                try:
                    self._work.put_nowait(effect)
                except queue.Full:
                    # Never block the caller: the chunk fails unstarted, and with it the room (decode
                    # is told).
                    reason = f"transfer queue full ({self.config.queue_size} chunks)"
                    self._apply(self._endpoint.chunk_failed(effect.room, effect.chunk, reason, self._clock()))
            case RoomFinished():
                if effect.poll is KVPoll.Success:
                    log.debug("room %s succeeded on prefill %s", effect.room, self.config.rank)
                else:
                    self.checksums.forget(effect.room)
            case DropLayers():
                self.per_layer.drain(effect.room)
            case SubmitFence():
                try:
                    self._work.put_nowait(effect)
                except queue.Full:  # the AbortAck stays owed: the decode's next resent Abort fences again
                    reason = f"transfer queue full ({self.config.queue_size} chunks)"
                    self._apply(
                        self._endpoint.fence_done(effect.room, effect.peer, False, reason, self._clock())
                    )
            case Notice():
                self._log_notice(effect)
            case ForgetPeer():
                self._forget_peer(effect)
            case _:
                assert_never(effect)

    def set_kv_checksum(self, on: bool) -> None:
        """Turn checksums on or off for rooms ``sender.init`` opens from now on (``kv_checksum``)."""
        self._checksum_on = arguments.flag(on, room=None, argument="on")

    def _summer(self, room: RoomId) -> Checksummer | None:
        """The kernel, when ``room`` has checksums (its ``sender.init`` came while they were on)."""
        if not self.checksums.enabled(room):
            return None
        if self._checksummer is None:
            self._checksummer = Checksummer.of(self.config.layout, self.config.checksum_device)
        return self._checksummer

    def _with_checksums(self, effect: Send) -> Message:
        """A Success status leaves with what the room wrote to that decode rank, as checksums."""
        message = effect.message
        if not isinstance(message, TransferStatus) or message.outcome is not Outcome.SUCCESS:
            return message
        if not self.checksums.enabled(message.room):
            return message
        try:
            sums = self.checksums.status_checksums(message.room, effect.to)
        except ValueError as exc:  # a position twice: never guessed; the decode names the missing checksums
            log.error("room %s: checksums to %s dropped: %s", message.room, effect.to, exc)
            return message
        return message if sums is None else attrs.evolve(message, checksums=sums)

    def _checksums_async(
        self, submit: SubmitChunk, destination: Destination, plan: ChunkPlan
    ) -> Future[None] | None:
        """``_note_checksums`` on the checksum thread, while the caller submits the plan's writes
        (the source pages do not change until the room ends); None when the room has no checksums.
        The caller waits for it before it reports the chunk."""
        if self._summer(submit.room) is None:
            return None
        if plan.blocks.total_bytes <= INLINE_CHECKSUM_BYTES:  # a hand-off costs more than that
            self._note_checksums(submit, destination, plan)
            return None
        with self._lock:
            if self._checksum_pool is None:
                self._checksum_pool = ThreadPoolExecutor(
                    1, thread_name_prefix=f"pdkv-checksum-{self.config.rank}"
                )
            pool = self._checksum_pool
        return pool.submit(self._note_checksums, submit, destination, plan)

    def _note_checksums(self, submit: SubmitChunk, destination: Destination, plan: ChunkPlan) -> None:
        """With ``kv_checksum``: the checksums of what ``plan`` writes (the source pages are what the
        scheduler's forward left, and do not change until the room ends)."""
        summer = self._summer(submit.room)
        if summer is None:
            return
        sources = ChunkSources(
            kv_src=plan.kv_src, kv_positions=plan.kv_positions, state=plan.state_src, aux_src=plan.aux_src
        )
        # the destination's buffers this pair transfers (draft buffers a rollout leaves out: neither)
        dst_layout = transfer_view(self.config.layout, destination.peer.layout).dst
        part = chunk_checksums(summer, sources, self.config.layout, dst_layout)
        self.checksums.add(submit.room, destination.peer.endpoint, part)

    def _note_layered_checksums(self, submit: SubmitChunk, destination: Destination) -> None:
        """A per-layer chunk's KV checksums: the rows the per-layer path recorded after each layer's
        ready event (``checksums.add_layer``), the others computed now (the forward has ended)."""
        summer = self._summer(submit.room)
        if summer is None:
            return
        dst_layout = transfer_view(self.config.layout, destination.peer.layout).dst
        mapped = map_chunk(
            submit.spec.pages,
            start_token=submit.spec.start_token,
            page_size=self.config.layout.page_size,
            dst_pages=destination.request.dst_pages,
            cp_rank=self.config.rank.cp,
            policy=self.config.policy,
        )
        n = len(dst_layout.kv_buffers)
        endpoint = destination.peer.endpoint
        rows = self.checksums.layered_missing(submit.room, endpoint, submit.spec.start_token, n)
        sums = kv_checksums(summer, self.config.layout, dst_layout, mapped.src, mapped.positions, rows=rows)
        self.checksums.finish_layers(
            submit.room, endpoint, submit.spec.start_token, mapped.positions, rows, sums, kv_buffers=n
        )

    # ------------------------------------------------------------------ transfer workers

    def _wait_receives(self) -> bool:
        return self.config.wait_receives

    def _run_while_waiting(self) -> None:
        """``wait_progress`` on the scheduler's thread, before it sleeps: the one chunk queued runs
        here when it is small (``PrefillConfig.wait_runs_chunk_bytes``), no transfer worker is
        busy, and it does not wait for a forward (a per-layer finish, which only the scheduler's own
        forward can end). The endpoint makes the thread that runs a chunk irrelevant: under the one
        lock, as a worker would."""
        limit = self.config.wait_runs_chunk_bytes
        if limit == 0 or not self._work.queue:  # (a hint read without the queue's lock; checked below)
            return
        with self._waiting_run:
            if self._closed or self._busy_workers:
                # Closing: close() may be past waiting for such runs. Under load (a worker busy) the
                # workers take what is queued together, in shared jobs: a chunk taken here alone
                # would cost an engine job of its own and this thread's time for the other rooms.
                return
            self._waiting_runs += 1
        ran = False
        try:
            work = self._work
            # queue.Queue's own lock, never held with another: a thread that queues a chunk holds the
            # transport lock (which ``per_layer.holds`` takes) while it waits for this one.
            with work.mutex:
                head = work.queue[0] if len(work.queue) == 1 else None  # alone: nothing to share a job
            if (
                not isinstance(head, SubmitChunk)
                or head.spec.pages.size * self._page_bytes * len(head.destinations) > limit
                or self.per_layer.holds(head.room)
            ):
                return
            with work.mutex:  # still the one queued (a worker may have taken it meanwhile)
                if len(work.queue) != 1 or work.queue[0] is not head:
                    return
                work.queue.popleft()
                work.not_full.notify()
            ran = True
            self._run_chunks_guarded([head])
        finally:
            with self._waiting_run:
                self._waiting_runs -= 1
                self._chunks_run_waiting += ran
                self._waiting_run.notify_all()

    def _work_loop(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            with self._waiting_run:
                self._busy_workers += 1
            try:
                stop = self._run_taken(item)
            finally:
                with self._waiting_run:
                    self._busy_workers -= 1
            if stop:
                return

    def _run_taken(self, item: SubmitChunk | SubmitFence) -> bool:
        """``item`` and what is queued behind it (``_take_queued``), in queue order; True when the stop
        marker of ``close()`` was among them."""
        items, stop = self._take_queued(item)
        chunks: list[SubmitChunk] = []
        for each in items:  # in queue order; a fence goes after the chunks queued before it
            if isinstance(each, SubmitFence):
                self._run_chunks_guarded(chunks)
                chunks = []
                self._run_fence(each)
            else:
                chunks.append(each)
        self._run_chunks_guarded(chunks)
        return stop

    def _take_queued(self, item: SubmitChunk | SubmitFence) -> tuple[list[SubmitChunk | SubmitFence], bool]:
        """``item`` and what is already queued behind it (never waited for), up to ``shared_chunks``;
        True when the stop marker of ``close()`` was among them (this worker ends after them)."""
        items = [item]
        if isinstance(item, SubmitChunk) and self.per_layer.holds(item.room):
            return items, False  # a per-layer finish may wait for its forward: nothing waits behind it
        while len(items) < self.config.shared_chunks:
            try:
                more = self._work.get_nowait()
            except queue.Empty:
                break
            if more is None:
                return items, True
            if isinstance(more, SubmitChunk) and self.per_layer.holds(more.room):
                try:  # the same reason: another worker takes it
                    self._work.put_nowait(more)
                except queue.Full:
                    items.append(more)
                break
            items.append(more)
        return items, False

    def _run_chunks_guarded(self, chunks: list[SubmitChunk]) -> None:
        if not chunks:
            return
        ended: set[int] = set()
        try:
            if len(chunks) == 1:
                self._run_chunk(chunks[0])
            else:
                self._run_chunks(chunks, ended)
        except Exception as exc:  # the rooms fail; the worker goes on
            self._worker_errors += 1
            log.exception("transfer worker: chunks of rooms %s failed unexpectedly", [c.room for c in chunks])
            for item in chunks:
                if id(item) in ended:
                    continue
                try:
                    self._finish_failed(item, f"internal error: {type(exc).__name__}: {exc}")
                except Exception:
                    log.exception(
                        "transfer worker: could not fail chunk %s of room %s", item.chunk, item.room
                    )

    def _run_fence(self, fence: SubmitFence) -> None:
        """Write the fence through the engine's queue to that decode rank; report it (AbortAck)."""
        write = fence.fence
        blocks = TransferBlocks(
            src=np.array([write.src]),
            dst=np.array([write.dst]),
            length=np.array([write.length]),
            buffer=np.zeros(1, dtype=np.int64),
        )
        self.metrics.increment(TransportCounter.FENCES)
        try:
            result = self._executor.transfer(write.session, blocks)
            ok, reason = result.ok, result.reason
        except Exception as exc:  # the ack stays owed; the worker goes on
            log.exception("fence write of room %s to %s failed unexpectedly", fence.room, write.session)
            ok, reason = False, f"internal error: {type(exc).__name__}: {exc}"
        with self._locked():
            self._apply(self._endpoint.fence_done(fence.room, fence.peer, ok, reason, self._clock()))

    def _run_chunk(self, submit: SubmitChunk) -> None:
        with self._lock:
            if not self._endpoint.start_chunk(submit.room, submit.chunk, self._clock()):
                self.metrics.increment(TransportCounter.CHUNKS_SKIPPED)
                return  # skipped: the room failed before any byte of this chunk moved
        layered = self.per_layer.finish(submit.room, submit.spec.start_token, pages=submit.spec.pages)
        if layered is not None:
            self._complete_per_layer(submit, layered)
            return
        started = self._clock()
        pages = written = 0
        per_peer: dict[PeerKey, TransferMetricData] = {}  # each decode rank is told its own share
        for destination in submit.destinations:
            if self._partition_dump:
                _dump_partition(
                    submit, destination, config=self.config, writes_extras=self.config.rank.cp == 0
                )
            wrote = self._write(submit, destination, submit.spec, writes_extras=self.config.rank.cp == 0)
            if wrote is None:
                return  # the chunk failed (reported)
            pages += wrote.kv_pages
            written += wrote.bytes
            per_peer[destination.peer.key] = TransferMetricData(
                pages=wrote.kv_pages, bytes=wrote.bytes, seconds=wrote.seconds
            )
            self._landed(submit, destination, wrote)
        metric = TransferMetricData(pages=pages, bytes=written, seconds=max(0.0, self._clock() - started))
        with self._locked():
            self._apply(
                self._endpoint.chunk_done(submit.room, submit.chunk, metric, self._clock(), per_peer=per_peer)
            )

    def _complete_per_layer(self, submit: SubmitChunk, layered: LayerTransferResult) -> None:
        """A chunk whose KV went layer by layer (to one or several decode ranks): its extras (last
        chunk) to each, then chunk_done (each rank told its own share) or chunk_failed."""
        if not layered.ok:
            if layered.engine_failure:
                self.metrics.increment(TransportCounter.ENGINE_FAILURES)
            peers = ", ".join(
                f"{s.destination.peer.instance}:{s.destination.peer.rank}" for s in layered.shares
            )
            self._finish_failed(submit, f"per-layer transfer to {peers}: {layered.reason}")
            return
        per_peer: dict[PeerKey, TransferMetricData] = {}
        pages = written = 0
        for share in layered.shares:
            destination = share.destination
            wrote_bytes = share.bytes_written
            self._note_layered_checksums(submit, destination)
            if submit.spec.last and self.config.rank.cp == 0:
                # State and aux rows ride on the last chunk, after its KV (as on the monolithic path);
                # planned for no pages, plan_chunk yields exactly those blocks.
                extras_only = attrs.evolve(submit.spec, pages=np.zeros(0, dtype=np.int64))
                extras = self._write(submit, destination, extras_only, writes_extras=True)
                if extras is None:
                    return  # the chunk failed (reported)
                wrote_bytes += extras.bytes
            if self._partition_dump:
                _dump_partition(
                    submit, destination, config=self.config, writes_extras=self.config.rank.cp == 0
                )
            now = self._clock()
            wrote = _Written(
                kv_pages=share.kv_pages,
                bytes=wrote_bytes,
                seconds=max(0.0, now - layered.first_submit_at),
                first_submit_at=layered.first_submit_at,
                last_completion_at=max(layered.first_submit_at, now),
            )
            self._landed(submit, destination, wrote)
            per_peer[destination.peer.key] = TransferMetricData(
                pages=wrote.kv_pages, bytes=wrote.bytes, seconds=wrote.seconds
            )
            pages += wrote.kv_pages
            written += wrote.bytes
        now = self._clock()
        metric = TransferMetricData(
            pages=pages, bytes=written, seconds=max(0.0, now - layered.first_submit_at)
        )
        with self._locked():
            self._apply(self._endpoint.chunk_done(submit.room, submit.chunk, metric, now, per_peer=per_peer))

    def _write(
        self, submit: SubmitChunk, destination: Destination, spec: ChunkSpec, *, writes_extras: bool
    ) -> _Written | None:
        """Plan ``spec`` of the chunk for ``destination`` and write it (both paths: the whole chunk, or
        the per-layer chunk's extras). None when it failed: mapping refused it, or the engine failed a
        write (then with the fence the AbortAck will wait for); the chunk is already reported failed."""
        plan = self._plan(submit, destination, spec, writes_extras=writes_extras)
        if plan is None:
            return None
        pending = self._checksums_async(submit, destination, plan)
        submitted = self._clock()
        try:
            if not len(plan.blocks):
                return _Written(plan.kv_pages, 0, 0.0, submitted, submitted)
            result = self._executor.transfer(destination.peer.session, plan.blocks)
        finally:
            if pending is not None:
                pending.result()  # a checksum that failed fails the chunk (the worker's guard)
        self.metrics.increment(TransportCounter.WRITES)
        self.metrics.increment(TransportCounter.WRITE_JOBS)
        if not result.ok:
            self.metrics.increment(TransportCounter.ENGINE_FAILURES)
            self._finish_failed(
                submit,
                f"to {destination.peer.session}: {result.reason}",
                fence=(destination.peer.key, fence_of(destination.peer.session, plan.blocks)),
            )
            return None
        return _Written(
            plan.kv_pages, result.bytes_written, result.seconds, submitted, max(submitted, self._clock())
        )

    def _plan(
        self, submit: SubmitChunk, destination: Destination, spec: ChunkSpec, *, writes_extras: bool
    ) -> ChunkPlan | None:
        """``spec`` of the chunk mapped for ``destination``; None when mapping refused it (reported)."""
        try:
            plan = plan_chunk(
                submit.room,
                spec,
                destination,
                src_aux_row=submit.src_aux_row,
                src_layout=self.config.layout,
                cp_rank=self.config.rank.cp,
                policy=self.config.policy,
                writes_extras=writes_extras,
            )
        except PdkvError as exc:
            self._finish_failed(
                submit, f"mapping for {destination.peer.instance}:{destination.peer.rank}: {exc}"
            )
            return None
        for note in plan.notes:
            log.warning("room %s chunk %s: %s", submit.room, submit.chunk, note)
        return plan

    # ------------------------------------------------------------------ chunks of several rooms at once

    def _run_chunks(self, chunks: list[SubmitChunk], ended: set[int]) -> None:
        """Chunks of several rooms taken off the queue together (never waited for: they were queued).

        Each is started, planned and reported on its own, as ``_run_chunk`` does; their writes go
        through one ``transfer_shared``, so the writes to one decode rank share engine batches. A
        chunk fails when one of its writes did not land whole (its fence is a block of that write);
        a batch that failed fails every chunk with bytes in it. ``ended``: ids of the chunks reported.
        """
        planned: list[tuple[SubmitChunk, float, list[tuple[Destination, ChunkPlan]]]] = []
        checksums: list[Future[None]] = []  # computed while the engine moves the chunks' bytes
        extras = self.config.rank.cp == 0
        with self._lock:  # one lock hold for all of them (and again to report them below)
            now = self._clock()
            started = [self._endpoint.start_chunk(s.room, s.chunk, now) for s in chunks]
        for submit, start in zip(chunks, started, strict=True):
            if not start:
                self.metrics.increment(TransportCounter.CHUNKS_SKIPPED)
                ended.add(id(submit))
                continue
            layered = self.per_layer.finish(submit.room, submit.spec.start_token, pages=submit.spec.pages)
            if layered is not None:
                self._complete_per_layer(submit, layered)
                ended.add(id(submit))
                continue
            began = self._clock()
            plans: list[tuple[Destination, ChunkPlan]] = []
            for destination in submit.destinations:
                if self._partition_dump:
                    _dump_partition(submit, destination, config=self.config, writes_extras=extras)
                plan = self._plan(submit, destination, submit.spec, writes_extras=extras)
                if plan is None:
                    ended.add(id(submit))  # reported failed
                    break
                if (pending := self._checksums_async(submit, destination, plan)) is not None:
                    checksums.append(pending)
                plans.append((destination, plan))
            else:
                planned.append((submit, began, plans))
        writes = [(d.peer.session, p.blocks) for _, _, plans in planned for d, p in plans if len(p.blocks)]
        submitted = self._clock()
        try:
            results = iter(self._executor.transfer_shared(writes) if writes else [])
        finally:
            for pending in checksums:
                pending.result()
        done = self._clock()
        self.metrics.increment(TransportCounter.WRITES, len(writes))
        self.metrics.increment(TransportCounter.WRITE_JOBS, len({peer for peer, _ in writes}))
        with self._locked():  # the statuses are posted together: they leave as one frame set
            for submit, began, plans in planned:
                self._report_shared(submit, began, plans, results, submitted, done)
                ended.add(id(submit))

    def _report_shared(
        self,
        submit: SubmitChunk,
        began: float,
        plans: list[tuple[Destination, ChunkPlan]],
        results: Iterator[TransferResult],
        submitted: float,
        done: float,
    ) -> None:
        """One chunk of ``_run_chunks`` (lock held): what landed, then chunk_done or chunk_failed."""
        pages = written = 0
        per_peer: dict[PeerKey, TransferMetricData] = {}
        failed: list[tuple[Destination, ChunkPlan, TransferResult]] = []
        for destination, plan in plans:
            wrote = _Written(plan.kv_pages, 0, 0.0, submitted, submitted)
            if len(plan.blocks):
                result = next(results)
                if not result.ok:
                    failed.append((destination, plan, result))
                    continue
                wrote = _Written(plan.kv_pages, result.bytes_written, result.seconds, submitted, done)
            pages += wrote.kv_pages
            written += wrote.bytes
            per_peer[destination.peer.key] = TransferMetricData(
                pages=wrote.kv_pages, bytes=wrote.bytes, seconds=wrote.seconds
            )
            self._landed_locked(submit, destination, wrote)
        now = self._clock()
        if failed:
            # Every decode rank whose write failed is owed a fence (the writes to several ranks ran
            # together, so more than one may have failed).
            self.metrics.increment(TransportCounter.ENGINE_FAILURES)
            fences = {
                d.peer.key: fence
                for d, plan, _ in failed
                if (fence := fence_of(d.peer.session, plan.blocks)) is not None
            }
            destination, _, result = failed[0]
            self._apply(
                self._endpoint.chunk_failed(
                    submit.room,
                    submit.chunk,
                    f"to {destination.peer.session}: {result.reason}",
                    now,
                    fences=fences or None,
                )
            )
            return
        metric = TransferMetricData(pages=pages, bytes=written, seconds=max(0.0, now - began))
        self._apply(self._endpoint.chunk_done(submit.room, submit.chunk, metric, now, per_peer=per_peer))

    def _landed(self, submit: SubmitChunk, destination: Destination, wrote: _Written) -> None:
        """What reached ``destination`` for the chunk, into the room's per-peer accounting."""
        with self._lock:
            self._landed_locked(submit, destination, wrote)

    def _landed_locked(self, submit: SubmitChunk, destination: Destination, wrote: _Written) -> None:
        landed = KVTransferMetric(
            room=submit.room,
            pages=wrote.kv_pages,
            bytes=wrote.bytes,
            seconds=wrote.seconds,
            first_submit_at=wrote.first_submit_at,
            last_completion_at=wrote.last_completion_at,
        )
        self._accounting.wrote(
            submit.room,
            peer_name(destination.peer.instance, destination.peer.rank),
            landed,
            room_finished=self._room_finished(submit.room),
        )

    def _room_finished(self, room: RoomId) -> bool:
        """Did ``room`` finish (lock held)? A write that lands after that is settled at once."""
        return self._endpoint.poll(room) in (KVPoll.Success, KVPoll.Failed)

    def _finish_failed(
        self, submit: SubmitChunk, reason: str, *, fence: tuple[PeerKey, FenceWrite | None] | None = None
    ) -> None:
        """Fail the chunk; ``fence``: the decode rank a write to which failed, and a block of it."""
        fences = {fence[0]: fence[1]} if fence is not None and fence[1] is not None else None
        with self._locked():
            self._apply(
                self._endpoint.chunk_failed(submit.room, submit.chunk, reason, self._clock(), fences=fences)
            )


class KVSender(RoomHandle[PrefillEndpoint, PrefillEffect]):
    """The scheduler's handle on one room of a prefill rank. Every call returns without network waits."""

    transport: PrefillTransport

    def __init__(self, transport: PrefillTransport, room: RoomId) -> None:
        super().__init__(transport, room)

    def init(self, num_pages: int, aux_row: int | None) -> None:
        """The request has ``num_pages`` pages in all; its aux row here is ``aux_row``.

        Raises ``InvalidArgumentError`` (argument, room, value) and changes nothing on a bad value.
        """
        self.transport._call(
            lambda e, now: e.open_room(self.room, num_pages=num_pages, aux_row=aux_row, now=now),
            what=f"sender.init of room {self.room}",
        )
        if self.transport._checksum_on:
            self.transport.checksums.enable(self.room)

    def send(
        self,
        chunk_pages: IntArray | Sequence[int],
        *,
        start_token: int,
        last: bool,
        state_indices: Sequence[StateIndices] | None = None,
    ) -> None:
        """Queue one chunk: its logical page ids (as every CP rank sees them) and its token offset.

        The chunk must continue the room where the previous one ended (the first may start past 0:
        a cached prefix), the last must end at ``num_pages``, and no page may repeat; otherwise
        ``MappingError`` (or ``InvalidArgumentError`` for a bad type) is raised and nothing changes.
        """
        spec = chunk_spec(self.room, chunk_pages, start_token=start_token, last=last, state=state_indices)
        self.transport._call(
            lambda e, now: e.queue_chunk(self.room, spec, now), what=f"sender.send of room {self.room}"
        )

    def metric(self) -> KVTransferMetric:
        """What this rank actually wrote for the room so far (pages, bytes, engine seconds)."""
        data = self.transport._query(lambda e: e.metric(self.room))
        return KVTransferMetric(
            room=self.room, pages=data.pages, bytes=data.bytes, seconds=max(0.0, data.seconds)
        )

    def decode_prefix_pages(self) -> int | None:
        """The first positions the decode side already holds (its prefix cache): the first chunk
        starts there. None until the decode's requests are in (poll WaitingForInput)."""
        return self.transport._query(lambda e: e.decode_prefix(self.room))

    def clear(self) -> None:
        """Forget a terminal room (its id is remembered as a tombstone for late messages)."""
        self.transport._call(lambda e, now: _close(e, self.room, now))
        self.transport.checksums.forget(self.room)


def chunk_spec(
    room: RoomId,
    chunk_pages: object,
    *,
    start_token: object,
    last: object,
    state: object = None,
) -> ChunkSpec:
    """A scheduler's chunk as a ``ChunkSpec``, every argument checked (``InvalidArgumentError`` /
    ``MappingError`` naming the room, the argument and the value)."""
    pages = arguments.page_list(chunk_pages, room=room, argument="chunk_pages")
    token = arguments.count(start_token, room=room, argument="start_token")
    is_last = arguments.flag(last, room=room, argument="last")
    states = arguments.state_list(state, room=room, argument="state_indices")
    if states and not is_last:
        raise InvalidArgumentError(
            f"room {room}: state_indices ride only on the last chunk (last=False)",
            room=room,
            argument="state_indices",
            value=state,
        )
    return ChunkSpec(pages=pages, start_token=token, last=is_last, state=states)


def _close(endpoint: PrefillEndpoint, room: RoomId, now: float) -> list[PrefillEffect]:
    endpoint.close_room(room, now)
    return []


def _dump_partition(
    submit: SubmitChunk, destination: Destination, *, config: PrefillConfig, writes_extras: bool
) -> None:
    """PDKV_DEBUG_PARTITION_DUMP=1: one line per chunk, CP rank and destination, no cap, no other
    effect: the physical pages this CP rank owns and their positions in the request (KV), and the
    state slots it writes (source -> destination, per kind), so the KV and state partitions of a
    cache hit and a miss can be diffed rank by rank."""
    spec = submit.spec
    try:
        start = chunk_page_start(spec.start_token, config.layout.page_size)
        owned = cp_owned(spec.pages, start, config.rank.cp, config.policy)
        physical, positions = owned.physical.tolist(), owned.positions.tolist()
    except PdkvError as exc:  # the dump never changes what happens: the planner reports the error
        physical, positions = [], [f"unmappable: {exc}"]
    states: list[str] = []
    if writes_extras and spec.last:
        wanted = {s.kind: s.indices for s in destination.request.dst_state}
        for s in spec.state:
            dst = wanted.get(s.kind)
            states.append(f"{s.kind.value}:{s.indices.tolist()}->{[] if dst is None else dst.tolist()}")
    log.warning(
        "partition room=%s chunk=%s cp_rank=%s rank=%s peer=%s start_token=%s last=%s "
        "kv_physical=%s kv_positions=%s kv_pages_sent=%s state=%s",
        submit.room,
        submit.chunk,
        config.rank.cp,
        config.rank,
        destination.peer.rank,
        spec.start_token,
        spec.last,
        physical,
        positions,
        len(physical),
        "[" + "; ".join(states) + "]",
    )


def _default_announce() -> Callable[[str, RankAnnounce, float], object]:
    """Announcements signed with ``PDKV_AUTH_KEY`` when set (read once, here)."""
    return functools.partial(announce_to_registry, auth=Authenticator.from_env())
