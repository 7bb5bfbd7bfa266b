"""A real prefill/decode cluster on 127.0.0.1: one process per rank, real transports, real engine.

Owns: ``ClusterSpec`` / ``RequestPlan`` (what to run), ``Cluster`` (starts the bootstrap registry in
this process and one process per prefill rank (TP x CP) and per decode rank, feeds them requests,
collects per-room outcomes, stops everything it started, by pid, with timeouts, even on failure),
and the rank processes' simple schedulers. The integration tests and ``pdkv demo`` both run on it.

Each rank builds its buffers with ``pdkv.testing.synthetic``; prefill ranks fill them from the
content rule, run a simulated forward per chunk (``simulate_forward``: a configurable compute time
per layer; with ``forward_writes_kv`` the chunk's pages are zeroed first and each layer's KV is
written as its layer ends), and send each chunk either whole after the forward or layer by layer
during it (``per_layer``: registered with the transport's ``PerLayerTransferManager`` before the
forward, ``on_layer_end`` after each layer); decode ranks verify every successful room byte for
byte against the same rule, keep the prefix positions (already on the decode side) untouched, and
after an aborted room's safe release write a canary into its pages, checked at shutdown: a late
write would break it.

Rank consensus (``ClusterSpec.consensus``, on by default): the prefill ranks of the instance (all
TP x CP) form a gloo group; each scheduler iteration agrees on how many rooms every rank has received
and MIN-reduces the polls of those rooms in one collective, so one Failed rank fails the room on every
rank (the others abort it), and a room leaves every rank's list in the same iteration. A collective
that fails (a dead rank; gloo's timeout is ``consensus_timeout_s``) fails every room of the rank, which
then goes on alone. Decode TP ranks do not run consensus: each decode rank's room already waits for
every prefill status it needs. Faults (``pdkv.testing.faults``) are applied per rank from
``ClusterSpec.faults``; ``Cluster.kill`` and ``Cluster.restart`` stop a rank process (SIGKILL) and
start it again behind the same control address (``stable_addresses``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import logging
import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from pdkv.alloc import PagePool
from pdkv.mapping import BufferKind, ModelRole, OwnershipPolicy, PageInterleaved, chunk_page_start, cp_owned
from pdkv.protocol.config import Timeouts
from pdkv.protocol.ids import InstanceId, RoomId
from pdkv.protocol.messages import RankCoord, StateIndices
from pdkv.protocol.poll import KVPoll
from pdkv.testing.faults import (
    BackendFaults,
    ChannelFaults,
    FaultCounts,
    FaultyBackend,
    FaultyChannel,
    NetnsLayout,
    RankFaults,
    enter_netns,
    faulty_channel_factory,
    fixed_port_channel_factory,
    wrap_for_rank,
)
from pdkv.testing.synthetic import (
    Capacity,
    ModelSpec,
    RankMemory,
    canary_intact,
    simulate_forward,
    verify_room,
    write_canary,
)

IntArray = npt.NDArray[np.int64]

log = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class ClusterSpec:
    model: ModelSpec = attrs.Factory(ModelSpec)
    prefill_tp: int = 1
    prefill_cp: int = 1
    decode_tp: int = 1
    prefill_capacity: Capacity = attrs.Factory(lambda: Capacity(kv_pages=2048, state_slots=256, aux_rows=256))
    decode_capacity: Capacity = attrs.Factory(lambda: Capacity(kv_pages=4096, state_slots=256, aux_rows=256))
    timeouts: Timeouts = attrs.Factory(
        lambda: Timeouts(bootstrap=60, waiting=60, inflight=60, transfer=60, abort_ack=10)
    )
    state_slots_per_room: int = 2
    startup_timeout_s: float = 120.0
    room_timeout_s: float = 120.0
    per_layer: bool = False
    """Default transfer mode of a request (``RequestPlan.per_layer`` overrides it per request)."""
    forward_writes_kv: bool = False
    """The simulated forward zeroes the pages it computes and writes each layer's KV as it ends."""
    consensus: bool = True
    """Prefill ranks MIN-reduce their room polls over a gloo group (only with more than one rank)."""
    consensus_timeout_s: float = 30.0
    """gloo's timeout for the group (its default is 30 min: a dead rank would hang the others)."""
    faults: tuple[RankFaults, ...] = ()
    stable_addresses: bool = False
    """Prefill ranks bind their control sockets on ports chosen by the parent, so ``restart`` brings a
    rank back behind the same address."""
    engine_transfer_timeout_s: int | None = None
    """``MC_TRANSFER_TIMEOUT`` of every rank's engine (None: the engine's default, 30 s)."""
    engine_tcp_queue: int | None = None
    """``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` of every rank's engine, with pdkv's entry budget per
    peer kept at the engine's default queue (2,048): headroom for the engine. Under load (many ranks
    on few cores) a stream of small entries (MHA head slices, one per token) met "TCP lane
    queue-full" rejections with the budget equal to the queue. None: the engine's defaults."""
    netns: NetnsLayout | None = None
    """Run prefill ranks (and the registry) in one network namespace and decode ranks in another,
    joined by a veth pair, so a test can partition them (``NetnsLayout.partition``)."""

    def host(self, side: str) -> str:
        """The address ranks of ``side`` bind and advertise."""
        if self.netns is None:
            return "127.0.0.1"
        return self.netns.prefill_ip if side == "prefill" else self.netns.decode_ip

    def namespace(self, side: str) -> str | None:
        if self.netns is None:
            return None
        return self.netns.prefill_ns if side == "prefill" else self.netns.decode_ns

    @property
    def policy(self) -> OwnershipPolicy:
        return PageInterleaved(cp_size=self.prefill_cp)


@attrs.frozen(kw_only=True)
class AbortPlan:
    side: str  # "decode" or "prefill"
    after_chunks: int = 1  # abort once this many chunks were sent (prefill) / seen sent (decode: seconds)
    after_s: float = 0.0  # decode side: seconds after init
    after_layers: int | None = None  # prefill side: abort in the middle of that chunk's forward instead


@attrs.frozen(kw_only=True)
class RequestPlan:
    room: RoomId
    tokens: int
    chunk_tokens: tuple[int, ...]
    prefix_tokens: int = 0
    abort: AbortPlan | None = None
    forward_s: float = 0.0
    layer_compute_s: float = 0.0
    """Compute time of each layer of the simulated forward (target and draft layers)."""
    per_layer: bool | None = None
    """Per-layer transfer for this request (None: the cluster's default)."""
    resident_tokens: int = 0
    """Tokens at the start of the first chunk whose KV the prefill side already holds (its own
    prefix cache): the forward does not compute them; per-layer sends them at registration."""

    def __attrs_post_init__(self) -> None:
        if sum(self.chunk_tokens) + self.prefix_tokens != self.tokens:
            raise ValueError(
                f"room {self.room}: chunks {self.chunk_tokens} + prefix {self.prefix_tokens} != {self.tokens}"
            )
        if self.resident_tokens and (self.resident_tokens > self.chunk_tokens[0]):
            raise ValueError(f"room {self.room}: {self.resident_tokens} resident tokens > first chunk")


@attrs.frozen(kw_only=True)
class _PrefillRoom:
    room: RoomId
    num_pages: int
    chunks: tuple[tuple[IntArray, int, bool], ...]  # (logical page ids, start token, last)
    state_src: tuple[tuple[BufferKind, IntArray], ...]
    aux_src: int
    abort_before_chunk: int | None
    abort_after_layers: int | None
    forward_s: float
    layer_compute_s: float
    per_layer: bool
    resident_pages: int


@attrs.frozen(kw_only=True)
class _DecodeRoom:
    room: RoomId
    num_pages: int
    prefix_pages: int
    logical_ids: IntArray
    state_src: tuple[tuple[BufferKind, IntArray], ...]
    aux_src: int
    abort_after_s: float | None


@attrs.frozen(kw_only=True)
class RoomOutcome:
    """One room on one rank."""

    room: int
    side: str
    rank: str
    poll: int
    failure: str
    seconds: float
    bytes_checked: int = 0
    mismatches: tuple[str, ...] = ()
    bytes_reported: int = 0
    released_safe: bool = True
    forward_end_at: float = 0.0
    """Prefill: ``time.monotonic()`` when the last chunk's forward ended (one clock for all processes)."""
    finished_at: float = 0.0
    """``time.monotonic()`` when this rank saw the room terminal."""
    mode: str = ""
    """Prefill: how its chunks went: ``per_layer``, ``monolithic`` or ``mixed``."""


@attrs.frozen(kw_only=True)
class RankReport:
    side: str
    rank: str
    rooms: int
    canary_violations: int
    """Decode: pages of safely released rooms that something wrote into after the release (must be 0)."""
    unsafe_releases: int
    bytes_written: int
    worker_errors: int
    unsafe_canary_violations: int = 0
    """Decode: the same for rooms released after the abort-ack timeout (the risk that release counts)."""
    malformed: int = 0
    """Inbound frame sets the rank's control channel rejected."""
    stale_messages: int = 0
    late_messages: int = 0
    peers_lost: int = 0
    peer_restarts: int = 0
    consensus_lost: str = ""
    """Why the rank's consensus group broke ("" if it never did or there was none)."""
    faults: FaultCounts = attrs.Factory(FaultCounts)
    pages_in_use: int = 0
    """Decode: KV pages, state slots and aux rows still allocated at shutdown (leaked: must be 0)."""
    quarantines: int = 0
    """Decode: rooms quarantined (no AbortAck within ``abort_ack``)."""
    quarantines_proven: int = 0
    """Decode: quarantined rooms released proven (acks after fences, then connections cut)."""
    fences: int = 0
    """Prefill: fence writes made before AbortAcks of rooms whose writes failed."""


class ClusterError(RuntimeError):
    """A rank process failed to start, died, or a room did not finish in time."""


def plan_requests(
    spec: ClusterSpec,
    plans: Sequence[RequestPlan],
    pool: PagePool,
) -> tuple[list[_PrefillRoom], list[_DecodeRoom], list[IntArray]]:
    """Logical page ids (from the prefill instance's CP-aware pool) and per-side room descriptions."""
    page = spec.model.page_size
    prefill_rooms, decode_rooms, allocations = [], [], []
    for i, plan in enumerate(plans):
        num_pages = -(-plan.tokens // page)
        if plan.prefix_tokens % page or plan.resident_tokens % page:
            raise ValueError(f"room {plan.room}: cached prefixes must be page-aligned")
        logical = pool.allocate(num_pages)
        allocations.append(logical)
        chunks = []
        token = plan.prefix_tokens
        for n, size in enumerate(plan.chunk_tokens):
            last = n == len(plan.chunk_tokens) - 1
            end = token + size
            if not last and end % page:
                raise ValueError(f"room {plan.room}: non-last chunk must end on a page boundary")
            first_page = chunk_page_start(token, page)
            end_page = num_pages if last else end // page
            chunks.append((logical[first_page:end_page], token, last))
            token = end
        k = spec.state_slots_per_room
        slots = (np.arange(k, dtype=np.int64) + i * k) % spec.prefill_capacity.state_slots
        state_src = tuple((kind, slots) for kind in spec.model.state_kinds)
        aux_src = i % spec.prefill_capacity.aux_rows
        abort = plan.abort
        prefill_rooms.append(
            _PrefillRoom(
                room=plan.room,
                num_pages=num_pages,
                chunks=tuple(chunks),
                state_src=state_src,
                aux_src=aux_src,
                abort_before_chunk=abort.after_chunks
                if abort is not None and abort.side == "prefill"
                else None,
                abort_after_layers=None if abort is None or abort.side != "prefill" else abort.after_layers,
                forward_s=plan.forward_s,
                layer_compute_s=plan.layer_compute_s,
                per_layer=spec.per_layer if plan.per_layer is None else plan.per_layer,
                resident_pages=plan.resident_tokens // page,
            )
        )
        decode_rooms.append(
            _DecodeRoom(
                room=plan.room,
                num_pages=num_pages,
                prefix_pages=plan.prefix_tokens // page,
                logical_ids=logical,
                state_src=state_src,
                aux_src=aux_src,
                abort_after_s=abort.after_s if abort is not None and abort.side == "decode" else None,
            )
        )
    return prefill_rooms, decode_rooms, allocations


# ---------------------------------------------------------------------------- rank processes


@attrs.frozen(kw_only=True)
class _RankArgs:
    side: str
    tp: int
    cp: int
    spec: ClusterSpec
    registry: str
    log_level: int
    log_dir: str | None
    consensus_address: str | None = None
    control_port: int = 0


def _rank_main(args: _RankArgs, conn: Connection) -> None:
    namespace = args.spec.namespace(args.side)
    if namespace is not None:
        enter_netns(namespace)  # first: every socket and thread of this process lives there
    if args.log_dir is not None:
        # Everything this process writes to stderr (Python logging, the engine's glog) goes to a file.
        path = os.path.join(args.log_dir, f"{args.side}-tp{args.tp}-cp{args.cp}.log")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` dumps every stack
    logging.basicConfig(
        level=args.log_level,
        format=f"%(asctime)s {args.side}{args.tp}.{args.cp} %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.side == "prefill":
            _prefill_rank(args, conn)
        else:
            _decode_rank(args, conn)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


def _make_backend(faults: BackendFaults | None, host: str, spec: ClusterSpec) -> Any:
    from pdkv.engine.mooncake import TCP_DEFAULT_QUEUED_TRANSFERS_PER_PEER, MooncakeBackend, MooncakeConfig

    queue = spec.engine_tcp_queue
    backend = MooncakeBackend(
        MooncakeConfig(
            local_hostname=host,
            transfer_timeout_s=spec.engine_transfer_timeout_s,
            tcp_max_queued_transfers_per_peer=queue,
            max_entries_in_flight=None
            if queue is None
            else min(queue, TCP_DEFAULT_QUEUED_TRANSFERS_PER_PEER),
        )
    )
    return backend if faults is None else FaultyBackend(backend, faults)


def _channel_factory(args: _RankArgs, faults: ChannelFaults | None, made: list[FaultyChannel]) -> Any:
    base = fixed_port_channel_factory(args.control_port) if args.control_port else None
    if faults is None:
        return base
    return faulty_channel_factory(faults, made, base)


def _fault_counts(backend: Any, channels: list[FaultyChannel]) -> FaultCounts:
    counts = backend.counts() if isinstance(backend, FaultyBackend) else FaultCounts()
    for channel in channels:
        c = channel.counts()
        counts = attrs.evolve(
            counts,
            dropped=counts.dropped + c.dropped,
            duplicated=counts.duplicated + c.duplicated,
            delayed=counts.delayed + c.delayed,
        )
    return counts


class _RankConsensus:
    """The prefill ranks' gloo group: agree on the rooms every rank holds, then MIN-reduce their polls."""

    def __init__(self, address: str, rank: int, world: int, timeout_s: float) -> None:
        import datetime

        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=address,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        self.lost = ""

    def agree(self, arrived: int, done: bool) -> tuple[int, bool]:
        """(rooms every rank has received, whether every rank is stopping with nothing left)."""
        import torch
        import torch.distributed as dist

        values = torch.tensor([arrived, int(done)], dtype=torch.int64)
        dist.all_reduce(values, op=dist.ReduceOp.MIN)
        return int(values[0]), bool(values[1])

    def reduce(self, polls: list[KVPoll]) -> list[KVPoll]:
        from pdkv.runtime.consensus import all_reduce_polls

        # The lengths were agreed by ``agree`` in this iteration: no second length check.
        return all_reduce_polls(polls, check_lengths=False)

    def close(self) -> None:
        import torch.distributed as dist

        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _prefill_rank(args: _RankArgs, conn: Connection) -> None:
    from pdkv.runtime.prefill import PrefillConfig, PrefillTransport

    spec = args.spec
    memory = RankMemory(spec.model, spec.prefill_capacity, tp_size=spec.prefill_tp, tp_rank=args.tp)
    memory.fill_prefill(cp_rank=args.cp, policy=spec.policy)
    channel_faults, backend_faults = wrap_for_rank(spec.faults, "prefill", args.tp, args.cp)
    backend = _make_backend(backend_faults, spec.host("prefill"), spec)
    channels: list[FaultyChannel] = []
    config = PrefillConfig(
        instance=InstanceId("prefill-0"),
        rank=RankCoord(tp=args.tp, cp=args.cp),
        tp_size=spec.prefill_tp,
        cp_size=spec.prefill_cp,
        layout=memory.layout,
        registry=args.registry,
        host=spec.host("prefill"),
        timeouts=spec.timeouts,
    )
    transport = PrefillTransport(
        config, backend, channel_factory=_channel_factory(args, channel_faults, channels)
    )
    name = f"prefill tp{args.tp}/cp{args.cp}"
    consensus: _RankConsensus | None = None
    try:
        transport.start()
        gc.freeze()  # as serving engines do after start-up: the start-up heap is never scanned again
        if args.consensus_address is not None:
            consensus = _RankConsensus(
                args.consensus_address,
                rank=args.tp * spec.prefill_cp + args.cp,
                world=spec.prefill_tp * spec.prefill_cp,
                timeout_s=spec.consensus_timeout_s,
            )
        conn.send(("ready", name, transport.address))
        active: dict[int, tuple[_PrefillRoom, Any, _Progress]] = {}
        order: list[int] = []  # rooms in arrival order (the same on every rank) not yet retired by consensus
        agreed: dict[int, KVPoll] = {}  # the consensus of retired rooms still finishing here
        stopping = False
        while True:
            while conn.poll(0 if active else 0.05):
                command = conn.recv()
                if command[0] == "stop":
                    stopping = True
                    break
                room: _PrefillRoom = command[1]
                sender = transport.sender(room.room)
                sender.init(room.num_pages, room.aux_src)
                active[room.room] = (room, sender, _Progress(started=time.monotonic()))
                order.append(room.room)
            grouped = consensus is not None and not consensus.lost
            if not grouped:
                order.clear()
                if stopping and not active:
                    break
            for key in list(active):
                room, sender, progress = active[key]
                poll = sender.poll()
                ready = poll in (KVPoll.WaitingForInput, KVPoll.Transferring)
                if ready and progress.next_chunk < len(room.chunks):
                    _prefill_chunk(args, memory, transport, room, sender, progress)
                elif poll in (KVPoll.Success, KVPoll.Failed) and (not grouped or key in agreed):
                    final = min(poll, agreed.pop(key, poll))
                    failure = str(sender.failure() or "")
                    if final is KVPoll.Failed and not failure:
                        failure = "rank consensus: another prefill rank failed the room"
                    metric = sender.metric()
                    modes = progress.modes
                    conn.send(
                        (
                            "result",
                            RoomOutcome(
                                room=room.room,
                                side="prefill",
                                rank=name,
                                poll=int(final),
                                failure=failure,
                                seconds=time.monotonic() - progress.started,
                                bytes_reported=metric.bytes,
                                forward_end_at=progress.forward_end_at,
                                finished_at=time.monotonic(),
                                mode=modes.pop() if len(modes) == 1 else ("mixed" if modes else ""),
                            ),
                        )
                    )
                    sender.clear()
                    del active[key]
            if consensus is not None and grouped:
                if _consensus_round(consensus, name, active, order, agreed, done=stopping and not active):
                    break
            elif active:
                time.sleep(0.0005)
        stats = transport.statistics()
        conn.send(
            (
                "final",
                RankReport(
                    side="prefill",
                    rank=name,
                    rooms=stats.endpoint.rooms_succeeded + stats.endpoint.rooms_failed,
                    canary_violations=0,
                    unsafe_releases=0,
                    bytes_written=stats.metrics.counters.bytes_sent,
                    worker_errors=stats.worker_errors,
                    malformed=stats.channel.malformed,
                    stale_messages=stats.endpoint.stale_messages,
                    peers_lost=stats.endpoint.peers_lost,
                    peer_restarts=stats.endpoint.peer_restarts,
                    fences=stats.endpoint.fences_submitted,
                    consensus_lost=consensus.lost if consensus is not None else "",
                    faults=_fault_counts(backend, channels),
                ),
            )
        )
    finally:
        if consensus is not None:
            consensus.close()
        transport.close()
        backend.close()


def _consensus_round(
    consensus: _RankConsensus,
    name: str,
    active: dict[int, tuple[_PrefillRoom, Any, _Progress]],
    order: list[int],
    agreed: dict[int, KVPoll],
    *,
    done: bool,
) -> bool:
    """One iteration's collectives; True when every rank is stopping with nothing left (leave the loop).

    Rooms whose consensus is terminal leave ``order`` on every rank in this same iteration (so the
    lists stay aligned); a rank whose own poll is not terminal yet aborts the room: another rank failed.
    """
    try:
        arrived, all_done = consensus.agree(len(order), done)
        if all_done:
            return True
        window = order[:arrived]
        local = [active[key][1].poll() for key in window]
        reduced = consensus.reduce(local) if window else []
    except Exception as exc:  # a dead rank or a broken group: every room of this rank fails
        consensus.lost = f"{type(exc).__name__}: {exc}"
        log.warning("%s: rank consensus lost (%s); failing every room of this rank", name, consensus.lost)
        for key in order:
            sender = active[key][1]
            if sender.poll() not in (KVPoll.Success, KVPoll.Failed):
                sender.abort(f"rank consensus lost: {consensus.lost}")
        order.clear()
        return False
    retired = set()
    for key, mine, together in zip(window, local, reduced, strict=True):
        if together not in (KVPoll.Success, KVPoll.Failed):
            continue
        retired.add(key)
        agreed[key] = together
        if mine not in (KVPoll.Success, KVPoll.Failed):
            active[key][1].abort("rank consensus: another prefill rank failed the room")
    if retired:
        order[:] = [key for key in order if key not in retired]
    return False


@attrs.define(eq=False)
class _Progress:
    """A prefill rank's scheduler state for one room."""

    started: float
    next_chunk: int = 0
    forward_end_at: float = 0.0
    modes: set[str] = attrs.Factory(set)


def _prefill_chunk(
    args: _RankArgs, memory: RankMemory, transport: Any, room: _PrefillRoom, sender: Any, progress: _Progress
) -> None:
    """One chunk: (register it for per-layer transfer,) run its forward, send it (or abort as planned)."""
    spec = args.spec
    index = progress.next_chunk
    progress.next_chunk += 1
    planned_abort = room.abort_before_chunk == index and args.cp == 0 and args.tp == 0
    if planned_abort and room.abort_after_layers is None:
        sender.abort("planned prefill-side abort")
        progress.next_chunk = len(room.chunks)
        return
    pages, start_token, last = room.chunks[index]
    resident = room.resident_pages if index == 0 else 0
    manager = transport.per_layer
    if room.per_layer:
        mode = manager.register(room.room, pages, start_token=start_token, resident_pages=resident)
        progress.modes.add(mode.value if mode.value != "duplicate" else "per_layer")
    else:
        progress.modes.add("monolithic")
    computed = cp_owned(pages[resident:], 0, args.cp, spec.policy).physical
    if spec.forward_writes_kv:
        memory.clear_pages(computed)
    ended = [0]
    abort_at = room.abort_after_layers if planned_abort else None

    def layer_end(model: ModelRole, layer: int) -> None:
        if spec.forward_writes_kv:
            memory.write_layer(model, layer, computed, cp_rank=args.cp, policy=spec.policy)
        if room.per_layer:
            manager.on_layer_end(layer, model=model)
        ended[0] += 1
        if abort_at is not None and ended[0] == abort_at:
            sender.abort("planned prefill-side abort in the middle of the forward")

    simulate_forward(spec.model, layer_compute_s=room.layer_compute_s, on_layer_end=layer_end)
    if room.forward_s:
        time.sleep(room.forward_s)
    progress.forward_end_at = time.monotonic()
    if abort_at is not None:
        progress.next_chunk = len(room.chunks)
        return
    state = [StateIndices(kind=kind, indices=slots) for kind, slots in room.state_src] if last else None
    sender.send(pages, start_token=start_token, last=last, state_indices=state)


def _decode_rank(args: _RankArgs, conn: Connection) -> None:
    from pdkv.runtime.decode import DecodeConfig, DecodeTransport

    spec = args.spec
    cap = spec.decode_capacity
    memory = RankMemory(spec.model, cap, tp_size=spec.decode_tp, tp_rank=args.tp)
    channel_faults, backend_faults = wrap_for_rank(spec.faults, "decode", args.tp, args.cp)
    backend = _make_backend(backend_faults, spec.host("decode"), spec)
    channels: list[FaultyChannel] = []
    config = DecodeConfig(
        instance=InstanceId("decode-0"),
        rank=RankCoord(tp=args.tp),
        tp_size=spec.decode_tp,
        layout=memory.layout,
        host=spec.host("decode"),
        timeouts=spec.timeouts,
    )
    transport = DecodeTransport(
        config,
        backend,
        channel_factory=_channel_factory(attrs.evolve(args, control_port=0), channel_faults, channels),
    )
    name = f"decode tp{args.tp}"
    pages = PagePool(pages_per_lane=cap.kv_pages, tier="decode-device")
    state_slots = PagePool(pages_per_lane=cap.state_slots, tier="decode-state")
    aux_rows = PagePool(pages_per_lane=cap.aux_rows, tier="decode-aux")
    quarantined: list[tuple[IntArray, bool]] = []  # pages of failed rooms, released safely or not
    canary_violations = unsafe_canary_violations = 0
    try:
        transport.start()
        gc.freeze()  # as serving engines do after start-up: the start-up heap is never scanned again
        prefill = transport.connect(args.registry, timeout_s=spec.startup_timeout_s)
        if not transport.wait_registered(prefill, timeout_s=spec.startup_timeout_s):
            raise ClusterError("prefill ranks did not acknowledge registration")
        conn.send(("ready", name, transport.address))
        active: dict[int, tuple[_DecodeRoom, Any, IntArray, IntArray, IntArray, float]] = {}
        stopping = False
        while not stopping or active:
            while conn.poll(0 if active else 0.05):
                command = conn.recv()
                if command[0] == "stop":
                    stopping = True
                    break
                room: _DecodeRoom = command[1]
                dst = pages.allocate(room.num_pages)
                for buffer_key in spec.model.kv_keys():
                    memory.view(buffer_key)[dst] = 0  # reused pages: start from "untouched"
                slots = state_slots.allocate(spec.state_slots_per_room)
                aux = aux_rows.allocate(1)
                receiver = transport.receiver(room.room, prefill)
                receiver.init(
                    dst,
                    int(aux[0]),
                    [StateIndices(kind=kind, indices=slots) for kind in spec.model.state_kinds],
                )
                active[room.room] = (room, receiver, dst, slots, aux, time.monotonic())
            for key in list(active):
                room, receiver, dst, slots, aux, started = active[key]
                poll = receiver.poll()
                observed = time.monotonic()
                elapsed = observed - started
                if poll not in (KVPoll.Success, KVPoll.Failed):
                    if room.abort_after_s is not None and elapsed >= room.abort_after_s:
                        receiver.abort("planned decode-side abort")
                    continue
                if poll is KVPoll.Failed and not receiver.release_ready():
                    continue
                checked, bad = 0, []
                if poll is KVPoll.Success:
                    checked, mismatches = verify_room(
                        memory,
                        logical_ids=room.logical_ids,
                        dst_pages=dst,
                        prefix_pages=room.prefix_pages,
                        state_src=dict(room.state_src),
                        state_dst={kind: slots for kind in spec.model.state_kinds},
                        aux_src=room.aux_src,
                        aux_dst=int(aux[0]),
                    )
                    bad = [
                        f"{m.what} {m.index}" + (" (expected untouched)" if m.expected_zero else "")
                        for m in mismatches
                    ]
                    pages.free(dst)
                else:
                    write_canary(memory, dst)
                    quarantined.append((dst, receiver.release_was_safe()))
                state_slots.free(slots)
                aux_rows.free(aux)
                metric = receiver.metric()
                conn.send(
                    (
                        "result",
                        RoomOutcome(
                            room=room.room,
                            side="decode",
                            rank=name,
                            poll=int(poll),
                            failure=str(receiver.failure() or ""),
                            seconds=elapsed,
                            bytes_checked=checked,
                            mismatches=tuple(bad),
                            bytes_reported=metric.bytes,
                            finished_at=observed,
                        ),
                    )
                )
                receiver.clear()
                del active[key]
            if active:
                time.sleep(0.0005)
        time.sleep(0.2)  # a late write, if any, would land now
        for dst, safe in quarantined:
            if not canary_intact(memory, dst):
                if safe:
                    canary_violations += 1
                else:
                    unsafe_canary_violations += 1
            pages.free(dst)
        stats = transport.statistics()
        conn.send(
            (
                "final",
                RankReport(
                    side="decode",
                    rank=name,
                    rooms=stats.endpoint.rooms_succeeded + stats.endpoint.rooms_failed,
                    canary_violations=canary_violations,
                    unsafe_canary_violations=unsafe_canary_violations,
                    unsafe_releases=stats.unsafe_releases,
                    bytes_written=0,
                    worker_errors=0,
                    malformed=stats.channel.malformed,
                    stale_messages=stats.endpoint.stale_messages,
                    late_messages=stats.endpoint.late_messages,
                    peers_lost=stats.endpoint.peers_lost,
                    peer_restarts=stats.endpoint.peer_restarts,
                    quarantines=stats.endpoint.quarantines,
                    quarantines_proven=stats.endpoint.quarantines_proven,
                    faults=_fault_counts(backend, channels),
                    pages_in_use=(pages.total_pages - pages.free_pages)
                    + (state_slots.total_pages - state_slots.free_pages)
                    + (aux_rows.total_pages - aux_rows.free_pages),
                ),
            )
        )
    finally:
        transport.close()
        backend.close()


# ---------------------------------------------------------------------------- the parent


@attrs.define(eq=False)
class _RankProcess:
    side: str
    tp: int
    cp: int
    name: str
    proc: Any
    conn: Connection
    address: str = ""
    control_port: int = 0
    killed: bool = False


@attrs.frozen(kw_only=True)
class TimedAction:
    """``action(cluster)`` once ``after_s`` seconds of ``Cluster.run`` have passed (e.g. kill a rank)."""

    after_s: float
    action: Callable[[Cluster], None]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the gloo group and stable addresses)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _registry_main(spec: ClusterSpec, conn: Connection) -> None:
    """The bootstrap registry in its own process, inside the prefill namespace."""
    from pdkv.runtime.channels import start_registry

    namespace = spec.namespace("prefill")
    if namespace is not None:
        enter_netns(namespace)
    service = start_registry(
        instance=InstanceId("prefill-0"),
        tp_size=spec.prefill_tp,
        cp_size=spec.prefill_cp,
        host=spec.host("prefill"),
    )
    try:
        conn.send(("ready", service.address))
        conn.recv()  # any message (or EOF) means stop
    except EOFError:
        pass
    finally:
        service.stop()


class _RegistryProcess:
    """A registry living in another process (namespaced clusters); ``address`` and ``stop`` as in-process."""

    def __init__(self, ctx: Any, spec: ClusterSpec, deadline: float) -> None:
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_registry_main, args=(spec, child), name="pdkv-registry", daemon=True)
        self._proc.start()
        child.close()
        while not self._conn.poll(0.2):
            if time.monotonic() > deadline or not self._proc.is_alive():
                self.stop()
                raise ClusterError("the registry process did not start")
        self.address: str = self._conn.recv()[1]

    def statistics(self) -> Any:
        raise ClusterError("registry statistics are not available from a registry in another namespace")

    def stop(self) -> None:
        with contextlib.suppress(OSError, BrokenPipeError):
            self._conn.send(("stop",))
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()


class Cluster:
    """Starts the registry and every rank; ``run`` feeds requests; ``close`` stops all it started."""

    def __init__(
        self, spec: ClusterSpec, *, log_level: int = logging.WARNING, log_dir: str | None = None
    ) -> None:
        """``log_dir``: each rank's stderr (logs, engine output) goes to a file there instead of ours."""
        self.spec = spec
        self.log_level = log_level
        self.log_dir = log_dir
        self._ctx = mp.get_context("spawn")
        self._ranks: list[_RankProcess] = []
        self._registry: Any = None
        self._consensus_address: str | None = None
        self.reports: list[RankReport] = []
        self._pending: dict[int, set[str]] = {}

    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    @property
    def prefill_conns(self) -> list[Connection]:
        return [r.conn for r in self._ranks if r.side == "prefill" and not r.killed]

    @property
    def decode_conns(self) -> list[Connection]:
        return [r.conn for r in self._ranks if r.side == "decode" and not r.killed]

    @property
    def registry_address(self) -> str:
        return str(self._registry.address)

    def registry_statistics(self) -> Any:
        """The bootstrap registry's counters (``RegistryStatistics``)."""
        return self._registry.statistics()

    def address(self, side: str, tp: int = 0, cp: int = 0) -> str:
        """The control address of a rank (``tcp://host:port``)."""
        return self._rank(side, tp, cp).address

    def pid(self, side: str, tp: int = 0, cp: int = 0) -> int:
        return int(self._rank(side, tp, cp).proc.pid)

    def _rank(self, side: str, tp: int, cp: int) -> _RankProcess:
        for r in self._ranks:
            if (r.side, r.tp, r.cp) == (side, tp, cp):
                return r
        raise ClusterError(f"no {side} rank tp{tp}/cp{cp}")

    def start(self) -> None:
        from pdkv.runtime.channels import start_registry

        spec = self.spec
        if spec.netns is None:
            self._registry = start_registry(
                instance=InstanceId("prefill-0"), tp_size=spec.prefill_tp, cp_size=spec.prefill_cp
            )
        else:
            self._registry = _RegistryProcess(self._ctx, spec, time.monotonic() + spec.startup_timeout_s)
        if spec.consensus and spec.prefill_tp * spec.prefill_cp > 1:
            self._consensus_address = f"tcp://127.0.0.1:{free_port()}"
        ranks = [("prefill", tp, cp) for tp in range(spec.prefill_tp) for cp in range(spec.prefill_cp)]
        ranks += [("decode", tp, 0) for tp in range(spec.decode_tp)]
        for side, tp, cp in ranks:
            port = free_port() if side == "prefill" and spec.stable_addresses else 0
            self._ranks.append(self._spawn(side, tp, cp, port))
        deadline = time.monotonic() + spec.startup_timeout_s
        for rank in self._ranks:
            self._await_ready(rank, deadline)

    def _spawn(self, side: str, tp: int, cp: int, port: int) -> _RankProcess:
        parent, child = self._ctx.Pipe()
        args = _RankArgs(
            side=side,
            tp=tp,
            cp=cp,
            spec=self.spec,
            registry=self._registry.address,
            log_level=self.log_level,
            log_dir=self.log_dir,
            consensus_address=self._consensus_address if side == "prefill" else None,
            control_port=port,
        )
        proc = self._ctx.Process(
            target=_rank_main, args=(args, child), name=f"pdkv-{side}{tp}.{cp}", daemon=True
        )
        proc.start()
        child.close()
        name = f"prefill tp{tp}/cp{cp}" if side == "prefill" else f"decode tp{tp}"
        return _RankProcess(side=side, tp=tp, cp=cp, name=name, proc=proc, conn=parent, control_port=port)

    def _await_ready(self, rank: _RankProcess, deadline: float) -> None:
        message = self._recv(rank.conn, rank.proc, deadline)
        if message[0] != "ready":
            raise ClusterError(f"{rank.side} rank failed to start:\n{message[1]}")
        rank.address = str(message[2])

    def kill(self, side: str, tp: int = 0, cp: int = 0) -> None:
        """SIGKILL one rank process (no goodbye to anyone); its unfinished rooms are no longer awaited."""
        rank = self._rank(side, tp, cp)
        rank.killed = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank.proc.pid, signal.SIGKILL)
        rank.proc.join(10)
        for room in list(self._pending):
            self._pending[room].discard(rank.name)
            if not self._pending[room]:
                del self._pending[room]

    def restart(self, side: str, tp: int = 0, cp: int = 0) -> None:
        """Kill a rank and start it again (a new epoch) behind the same control address; new rooms go
        to the new incarnation. Needs ``stable_addresses`` for a prefill rank, and no consensus group
        (a gloo group cannot take a rank back)."""
        rank = self._rank(side, tp, cp)
        if side == "prefill" and not rank.control_port:
            raise ClusterError("restart behind the same address needs ClusterSpec(stable_addresses=True)")
        if side == "prefill" and self._consensus_address is not None:
            raise ClusterError("a rank of a consensus group cannot be restarted")
        if not rank.killed:
            self.kill(side, tp, cp)
        rank.conn.close()
        fresh = self._spawn(side, tp, cp, rank.control_port)
        self._ranks[self._ranks.index(rank)] = fresh
        self._await_ready(fresh, time.monotonic() + self.spec.startup_timeout_s)

    def run(
        self,
        plans: Sequence[RequestPlan],
        *,
        max_active: int = 8,
        progress: Callable[[RoomOutcome], None] | None = None,
        actions: Sequence[TimedAction] = (),
    ) -> list[RoomOutcome]:
        """Run every request; returns one outcome per room and live rank (prefill and decode).

        ``actions`` run from this loop at their times (a killed rank's rooms are no longer awaited)."""
        spec = self.spec
        pool = PagePool(pages_per_lane=spec.prefill_capacity.kv_pages, policy=spec.policy, tier="prefill")
        prefill_rooms, decode_rooms, _ = plan_requests(spec, plans, pool)
        outcomes: list[RoomOutcome] = []
        self._pending = {}
        results: queue.SimpleQueue[RoomOutcome] = queue.SimpleQueue()
        todo = sorted(actions, key=lambda a: a.after_s)
        next_room = 0
        started = time.monotonic()
        deadline = started + spec.room_timeout_s + spec.room_timeout_s * len(plans) / max(1, max_active)
        while next_room < len(plans) or self._pending or todo:
            while todo and time.monotonic() - started >= todo[0].after_s:
                todo.pop(0).action(self)
            while next_room < len(plans) and len(self._pending) < max_active:
                live = [r for r in self._ranks if not r.killed]
                for r in live:
                    r.conn.send(
                        ("room", prefill_rooms[next_room] if r.side == "prefill" else decode_rooms[next_room])
                    )
                self._pending[int(plans[next_room].room)] = {r.name for r in live}
                next_room += 1
            self._collect(results, deadline)
            while not results.empty():
                outcome = results.get()
                outcomes.append(outcome)
                if progress is not None:
                    progress(outcome)
                waiting = self._pending.get(outcome.room)
                if waiting is not None:
                    waiting.discard(outcome.rank)
                    if not waiting:
                        del self._pending[outcome.room]
        return outcomes

    def _collect(self, results: queue.SimpleQueue[RoomOutcome], deadline: float) -> None:
        from multiprocessing.connection import wait

        live = [r for r in self._ranks if not r.killed]
        ready = wait([r.conn for r in live], timeout=0.1)
        for conn in ready:
            assert isinstance(conn, Connection)
            try:
                message = conn.recv()
            except (EOFError, OSError):
                continue  # a rank that died; reported below
            if message[0] == "result":
                results.put(message[1])
            elif message[0] == "error":
                raise ClusterError(f"a rank failed:\n{message[1]}")
        if time.monotonic() > deadline:
            raise ClusterError(f"rooms did not finish in time: {sorted(self._pending)}")
        for r in live:
            if not r.proc.is_alive():
                raise ClusterError(f"{r.side} rank process {r.proc.name} died (exit code {r.proc.exitcode})")

    def close(self) -> list[RankReport]:
        """Stop every rank (gracefully, then by force) and the registry; returns the ranks' final reports."""
        deadline = time.monotonic() + 30
        for r in self._ranks:
            if r.proc.is_alive():
                with contextlib.suppress(BrokenPipeError, OSError):
                    r.conn.send(("stop",))
        for r in self._ranks:
            try:
                while r.proc.is_alive() or r.conn.poll(0):
                    if not r.conn.poll(max(0.0, min(1.0, deadline - time.monotonic()))):
                        if time.monotonic() > deadline:
                            break
                        continue
                    message = r.conn.recv()
                    if message[0] == "final":
                        self.reports.append(message[1])
                        break
            except (EOFError, OSError):
                pass
        for r in self._ranks:
            r.proc.join(max(0.1, deadline - time.monotonic()))
            if r.proc.is_alive():
                r.proc.terminate()
                r.proc.join(5)
            if r.proc.is_alive():
                r.proc.kill()
                r.proc.join(5)
            r.conn.close()
        self._ranks.clear()
        if self._registry is not None:
            self._registry.stop()
            self._registry = None
        return self.reports

    def _recv(self, conn: Connection, proc: Any, deadline: float) -> tuple[Any, ...]:
        while time.monotonic() < deadline:
            if conn.poll(0.2):
                message: tuple[Any, ...] = conn.recv()
                return message
            if not proc.is_alive():
                raise ClusterError(
                    f"rank process {proc.name} died during start-up (exit code {proc.exitcode})"
                )
        raise ClusterError(f"rank process {proc.name} did not start within {self.spec.startup_timeout_s:g} s")


__all__ = [
    "AbortPlan",
    "Cluster",
    "ClusterError",
    "ClusterSpec",
    "RankReport",
    "RequestPlan",
    "RoomOutcome",
    "TimedAction",
    "free_port",
]
