"""In-memory harness: prefill endpoints and a decode endpoint talking through a faulty link.

Owns: ``FakeClock``, ``LinkFaults`` / ``FaultyLink`` (drop, duplicate, delay, reorder, partitions),
and ``EndpointPair``, which carries the endpoints' effects out (messages over the link, chunk
writes by simulated transfer workers, a simulated scheduler that runs each room's chunks) and
checks the safety promise of DESIGN section 8 as it goes: no write of a room may start or be in
flight once the decode side released the room's pages as safe.

Liveness faults: ``partition`` cuts the control link between one prefill rank and the decode rank
(writes, the data plane, go on); ``restart_prefill`` replaces a prefill rank by a new incarnation
with a higher epoch behind the same address (the old process and its in-flight writes are gone);
``stale_messages`` / ``deliver`` replay what retired incarnations sent. ``close_settled`` plays
the schedulers' ``clear()`` so long runs keep only live rooms.

Per-layer rooms go through the real per-layer rules: a per-layer chunk registers in its prefill
endpoint's book (``layer_destinations``, ``layer_register``) when it is queued, the rank's forward
reports its layers over ``layer_time``, each routed layer becomes a write (the endpoint asked before a
context's first one: ``layer_first_write``), the chunk's ``SubmitChunk`` finishes the context
instead of writing the chunk, and contexts the endpoint stopped are drained once their writes ended
(``layer_ended``), as ``pdkv.runtime.per_layer`` does with threads.

Shipped with the library (like ``trio.testing``) so embedders can test their own integration
against the same harness. Deterministic: all randomness comes from one seeded ``random.Random``.
Messages cross the link through the real codec (encode, then decode), so every test exercises it.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Callable, Sequence
from typing import assert_never, cast

import attrs
import numpy as np

from pdkv.mapping import LayerKey, PageInterleaved
from pdkv.mapping.layout import AttentionKind, BufferKind, BufferLayout, BufferSpec, ModelRole
from pdkv.protocol import codec
from pdkv.protocol.config import Timeouts
from pdkv.protocol.decode import DecodeEndpoint
from pdkv.protocol.effects import (
    ChunkSpec,
    CutConnections,
    DropLayers,
    Effect,
    FailureCause,
    FenceWrite,
    ForgetPeer,
    LeaseLanding,
    Notice,
    PeerKey,
    ReleasePages,
    RoomFinished,
    ScatterLanding,
    Send,
    SubmitChunk,
    SubmitFence,
    Target,
    VerifyChecksums,
)
from pdkv.protocol.ids import Endpoint, Epoch, InstanceId, RoomId, SessionId
from pdkv.protocol.layers import LayerContext, Verdict
from pdkv.protocol.machines import PerLayerState, PerLayerTrigger
from pdkv.protocol.messages import (
    Message,
    Origin,
    RankCoord,
    RankRoute,
    RouteTable,
    TransferMetricData,
    TransferRequest,
)
from pdkv.protocol.poll import KVPoll
from pdkv.protocol.prefill import PrefillEndpoint


class FakeClock:
    """A clock that moves only when told to (seconds as float)."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def __call__(self) -> float:
        return self._now

    @property
    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError("a clock does not go back")
        self._now += seconds
        return self._now

    def advance_to(self, when: float) -> float:
        self._now = max(self._now, when)
        return self._now


@attrs.frozen(kw_only=True)
class LinkFaults:
    """Per-message fault probabilities of a ``FaultyLink``; delays are uniform in [0, max_delay]."""

    drop: float = attrs.field(default=0.0, validator=[attrs.validators.ge(0.0), attrs.validators.le(1.0)])
    duplicate: float = attrs.field(
        default=0.0, validator=[attrs.validators.ge(0.0), attrs.validators.le(1.0)]
    )
    max_delay: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    """Random delay per message; different delays reorder messages."""
    latency: float = attrs.field(default=0.001, validator=attrs.validators.ge(0.0))
    """Fixed one-way latency added to every message."""


@attrs.frozen(kw_only=True)
class LinkStatistics:
    posted: int
    delivered: int
    dropped: int
    duplicated: int


class FaultyLink:
    """Carries encoded messages between endpoints with drops, duplicates, delays and reordering."""

    def __init__(self, faults: LinkFaults, rng: random.Random) -> None:
        self.faults = faults
        self._rng = rng
        # (due, order, to, frames, sender, posted at)
        self._queue: list[tuple[float, int, Endpoint, list[bytes], Endpoint | None, float]] = []
        self._order = itertools.count()
        self._posted = self._delivered = self._dropped = self._duplicated = 0
        self.cut: set[Endpoint] = set()
        """Endpoints currently unreachable: messages to them are dropped (a partition)."""
        self.partitions: set[frozenset[Endpoint]] = set()
        """Pairs of endpoints that cannot reach each other (both ways); needs ``sender`` in ``post``."""
        self.drop_if: Callable[[Endpoint, Message], bool] | None = None
        """Targeted loss: messages for which this returns True are dropped."""

    def post(self, to: Endpoint, message: Message, now: float, *, sender: Endpoint | None = None) -> None:
        self._posted += 1
        targeted = self.drop_if is not None and self.drop_if(to, message)
        partitioned = sender is not None and frozenset((sender, to)) in self.partitions
        if targeted or partitioned or to in self.cut or self._rng.random() < self.faults.drop:
            self._dropped += 1
            return
        frames = codec.encode(message)
        copies = 2 if self._rng.random() < self.faults.duplicate else 1
        self._duplicated += copies - 1
        for _ in range(copies):
            when = now + self.faults.latency + self._rng.uniform(0.0, self.faults.max_delay)
            heapq.heappush(self._queue, (when, next(self._order), to, frames, sender, now))

    def next_delivery(self) -> float | None:
        return self._queue[0][0] if self._queue else None

    def due(self, now: float) -> list[tuple[Endpoint, Message]]:
        out: list[tuple[Endpoint, Message]] = []
        while self._queue and self._queue[0][0] <= now:
            _, _, to, frames, _sender, _posted = heapq.heappop(self._queue)
            self._delivered += 1
            out.append((to, codec.decode(frames)))
        return out

    def drop_queued(self, to: Endpoint, sender: Endpoint, now: float) -> int:
        """A socket from ``sender`` to ``to`` was dropped with what was queued on it (linger 0): what it
        posted there at ``now`` (still in the socket's queue, not yet on the wire) is lost. Returns
        how many messages."""
        kept = [q for q in self._queue if not (q[2] == to and q[4] == sender and q[5] == now)]
        lost = len(self._queue) - len(kept)
        if lost:
            self._queue = kept
            heapq.heapify(self._queue)
            self._dropped += lost
        return lost

    def statistics(self) -> LinkStatistics:
        return LinkStatistics(
            posted=self._posted, delivered=self._delivered, dropped=self._dropped, duplicated=self._duplicated
        )


@attrs.frozen(kw_only=True)
class RoomPlan:
    """What the simulated scheduler does with one room: its pages, chunk sizes and optional aborts."""

    room: RoomId
    num_pages: int
    chunk_pages: tuple[int, ...]
    abort_decode_at: float | None = None
    abort_prefill_at: float | None = None
    per_layer: bool = False
    """Each chunk goes layer by layer: registered before its forward, the forward reports the layers
    over ``layer_time`` (each then written in ``transfer_time``), and the chunk's ``send()`` at the
    forward's end finishes the context."""
    prefix_pages: int = 0
    """Positions the decode side already holds (a cached prefix): the chunks cover the rest."""

    def __attrs_post_init__(self) -> None:
        if self.prefix_pages + sum(self.chunk_pages) != self.num_pages or not self.chunk_pages:
            covered = f"prefix {self.prefix_pages} and chunks {self.chunk_pages}"
            raise ValueError(f"{covered} do not cover {self.num_pages} pages")


@attrs.define(eq=False)
class _Write:
    room: RoomId
    chunk: int
    prefill: int
    done_at: float
    fail: bool


@attrs.define(eq=False)
class _Residue:
    """Bytes of a failed write that can still land: they land at ``lands_at`` unless they are first
    removed. While ``in_engine`` they are queued in the prefill's engine, which a completed fence
    write from that rank drains (its per-peer queue is FIFO); a fence does not stop them, though:
    they are then in a connection (an orphan socket retransmitting, a decode-side socket still
    read), and only the decode's proven cut of that rank's host's connections ends them."""

    room: RoomId
    prefill: int
    lands_at: float
    in_engine: bool = True


@attrs.define(eq=False)
class _CutInFlight:
    room: RoomId
    hosts: tuple[str, ...]
    done_at: float


@attrs.define(eq=False)
class _FenceInFlight:
    room: RoomId
    peer: PeerKey
    prefill: int
    endpoint: PrefillEndpoint
    done_at: float


@attrs.define(eq=False)
class _Layers:
    """What the pair keeps beside a per-layer context: its chunk, writes in flight, a failed write."""

    chunk: int
    in_flight: int = 0
    failed: bool = False


def _layers(context: LayerContext[object]) -> _Layers:
    """What the pair keeps beside a context of an endpoint's book (the book holds it opaque)."""
    return cast(_Layers, context.work)


def context_chunk(context: LayerContext[object]) -> int:
    """The index of the chunk a per-layer context of the pair was registered for."""
    return _layers(context).chunk


@attrs.define(eq=False)
class _LayerWrite:
    """One layer of one context being written (a restart of its rank ends it)."""

    room: RoomId
    prefill: int
    endpoint: PrefillEndpoint
    context: LayerContext[object]
    done_at: float
    fail: bool


@attrs.define(eq=False)
class _LayerEvent:
    """The forward of a prefill rank reports one layer written."""

    prefill: int
    endpoint: PrefillEndpoint
    key: LayerKey
    at: float


@attrs.define(eq=False)
class _PendingSend:
    """A per-layer chunk's ``send()``, due when its forward ends."""

    prefill: int
    endpoint: PrefillEndpoint
    room: RoomId
    spec: ChunkSpec
    at: float


@attrs.define(eq=False)
class _Finisher:
    """``send()`` of a per-layer chunk: what the context's finisher does next."""

    prefill: int
    endpoint: PrefillEndpoint
    context: LayerContext[object]
    verdict: Verdict


@attrs.define(eq=False)
class _Progress:
    plan: RoomPlan
    openers: tuple[PrefillEndpoint, ...]
    """The prefill incarnations that opened the room (a restarted rank's new process never has it)."""
    next_chunk: int = 0
    decode_aborted: bool = False
    prefill_aborted: bool = False
    idle: bool = False
    """The simulated scheduler has nothing left to do for the room."""


@attrs.frozen(kw_only=True)
class SafetyViolation:
    room: RoomId
    time: float
    what: str


@attrs.frozen(kw_only=True)
class ClosedRoom:
    """A room that ``close_settled`` cleared on both sides, and how it ended there."""

    room: RoomId
    decode: KVPoll
    decode_cause: FailureCause | None
    """Why the room failed on the decode side (None: it succeeded)."""
    release_safe: bool | None
    """None when the room succeeded (its pages were never at risk)."""
    prefill: tuple[KVPoll | None, ...]
    """Per CP rank, the opener incarnation's final poll (None: that rank restarted meanwhile)."""
    prefill_causes: tuple[FailureCause | None, ...] = ()
    """Per CP rank, why the room failed there (None: it succeeded, or that rank restarted)."""


class EndpointPair:
    """Prefill endpoints (one per CP rank) and one decode endpoint, wired through a ``FaultyLink``.

    ``fail_write(room, chunk, prefill_index) -> bool`` injects engine failures; ``transfer_time``
    is how long each chunk's writes take. ``violations`` lists every breach of abort safety seen.

    A failed write leaves bytes behind (as Mooncake's TCP transport does,
    ``specs/mooncake-tcp-late-writes.md``): they land ``late_write_s`` later unless they are removed
    first; landing after the room's safe release is a violation. A fence write (``SubmitFence``) from
    that rank drains its engine queue but leaves them in a connection; only a cut of the connections
    from that rank's host (``cuts_connections``: the decode cuts, ``CutConnections`` takes
    ``cut_time``) removes them, unless ``cut_leaves_queued_bytes`` models a cut that proves nothing. A
    fence fails while its rank is partitioned. ``ForgetPeer`` drops what its sender had queued for
    that endpoint and not yet delivered, as a socket closed with linger 0 does: an effect emitted in
    the wrong order around it is lost.
    """

    def __init__(
        self,
        *,
        cp_size: int = 1,
        faults: LinkFaults | None = None,
        seed: int = 0,
        timeouts: Timeouts | None = None,
        transfer_time: float = 0.01,
        fail_write: Callable[[RoomId, int, int], bool] | None = None,
        layout: BufferLayout | None = None,
        clock: FakeClock | None = None,
        notice_limit: int | None = None,
        late_write_s: float = 60.0,
        cuts_connections: bool = False,
        cut_leaves_queued_bytes: bool = False,
        cut_time: float = 0.01,
    ) -> None:
        self.clock = clock if clock is not None else FakeClock()
        self.rng = random.Random(seed)
        self.link = FaultyLink(faults if faults is not None else LinkFaults(), self.rng)
        self.timeouts = timeouts if timeouts is not None else Timeouts()
        self.transfer_time = transfer_time
        self.fail_write = fail_write
        self.layout = layout if layout is not None else default_layout()
        self.prefill_instance = InstanceId("prefill-0")
        self.decode_instance = InstanceId("decode-0")
        self.prefills = [
            PrefillEndpoint(
                origin=Origin(instance=self.prefill_instance, epoch=Epoch(1), rank=RankCoord(tp=0, cp=cp)),
                layout=self.layout,
                timeouts=self.timeouts,
                policy=PageInterleaved(cp_size=cp_size),
                layer_finish_timeout_s=self.timeouts.transfer,
            )
            for cp in range(cp_size)
        ]
        self._decode_session = SessionId("decode-0:0")
        self.decode = DecodeEndpoint(
            origin=Origin(instance=self.decode_instance, epoch=Epoch(1), rank=RankCoord(tp=0)),
            tp_size=1,
            endpoint=Endpoint("inproc://decode-0"),
            session=self._decode_session,
            layout=self.layout,
            timeouts=self.timeouts,
            cuts_connections=cuts_connections,
        )
        self.cut_leaves_queued_bytes = cut_leaves_queued_bytes
        """Model a cut that reports success while bytes queued in the destroyed sockets are still read
        (the defect of a cut that counted the sockets' leaving the kernel table as proof)."""
        self._cuts: list[_CutInFlight] = []
        self.verifications: list[VerifyChecksums] = []
        """The decode's ``VerifyChecksums`` requests (rooms opened with ``verify_checksums``), for the
        test to answer with ``decode_endpoint.checksums_verified``."""
        self.cut_time = cut_time
        self.cuts_made = 0
        self._prefill_address = {Endpoint(f"inproc://prefill-{cp}"): cp for cp in range(cp_size)}
        self.prefill_endpoints = list(self._prefill_address)
        """Control address of each CP rank (kept by a restarted rank)."""
        self._writes: list[_Write] = []
        self._layer_writes: list[_LayerWrite] = []
        self._layer_events: list[_LayerEvent] = []
        self._finishers: dict[int, _Finisher] = {}  # id(context) -> its send()
        self._pending_sends: list[_PendingSend] = []
        self._layer_keys = tuple(
            sorted({LayerKey(model=b.model, layer_id=b.layer_id) for b in self.layout.kv_buffers}, key=str)
        )
        self.late_write_s = late_write_s
        self._decode_key: PeerKey = (self.decode_instance, self.decode.origin.rank)
        self._residues: list[_Residue] = []
        self._fences: list[_FenceInFlight] = []
        self.fences_completed = 0
        self.late_writes_landed = 0
        self.layer_time = 3 * transfer_time
        """How long a per-layer context writes (longer than a chunk write: the forward overlaps)."""
        self._progress: dict[RoomId, _Progress] = {}
        self._scheduled: list[tuple[float, RoomId]] = []  # heap of the scheduler's abort times
        self._released_safe: dict[RoomId, float] = {}
        self.violations: list[SafetyViolation] = []
        self.notices: list[Notice] = []
        """Notices in order, the first ``notice_limit`` of them (all when None)."""
        self._notice_limit = notice_limit
        self.notices_seen = 0
        self.finished: dict[tuple[str, RoomId], RoomFinished] = {}
        self.releases: dict[RoomId, ReleasePages] = {}
        self.forgotten: list[tuple[str, ForgetPeer]] = []
        """Every ``ForgetPeer`` effect, with who emitted it."""
        self.writes_started = 0
        """Chunk writes and per-layer layer writes started (a layer written to several ranks counts once)."""
        self.retired: list[PrefillEndpoint] = []
        """Prefill incarnations replaced by ``restart_prefill``, oldest first (a long run may clear it)."""
        self._sent: list[deque[tuple[Endpoint, Message]]] = [deque(maxlen=64) for _ in range(cp_size)]
        self._stale: deque[tuple[Endpoint, Message]] = deque(maxlen=256)
        self._requests: deque[tuple[Endpoint, TransferRequest]] = deque(maxlen=256)
        self._partition_until: dict[int, float | None] = {}

    # ------------------------------------------------------------------ set-up

    def route_table(self) -> RouteTable:
        return RouteTable(
            origin=Origin(instance=self.prefill_instance, epoch=Epoch(1), rank=RankCoord(tp=0)),
            tp_size=1,
            cp_size=len(self.prefills),
            page_size=self.layout.page_size,
            layout_digest=self.layout.digest(),
            ranks=[
                RankRoute(
                    rank=p.origin.rank,
                    epoch=p.origin.epoch,
                    endpoint=address,
                    session=SessionId(f"prefill-{cp}:0"),
                )
                for address, cp in self._prefill_address.items()
                for p in [self.prefills[cp]]
            ],
            complete=True,
        )

    def connect(self) -> None:
        self._apply("decode", self.decode.connect(self.route_table(), self.clock.now))

    def targets(self) -> list[Target]:
        return [Target(instance=self.prefill_instance, rank=p.origin.rank) for p in self.prefills]

    def add_room(self, plan: RoomPlan, *, decode_first: bool = True) -> None:
        """Open the room on both sides (in either order) and let the simulated scheduler run it."""
        now = self.clock.now
        self._progress[plan.room] = _Progress(plan=plan, openers=tuple(self.prefills))
        for at in (plan.abort_decode_at, plan.abort_prefill_at):
            if at is not None:
                heapq.heappush(self._scheduled, (at, plan.room))
        capacity = min(b.num_items for b in self.layout.kv_buffers)
        dst = np.arange(plan.num_pages, dtype=np.int64) + (plan.room * 37) % max(1, capacity - plan.num_pages)

        def open_decode() -> None:
            self._apply(
                "decode",
                self.decode.open_room(
                    plan.room,
                    targets=self.targets(),
                    dst_pages=dst,
                    dst_aux_row=plan.room % 8,
                    prefix_pages=plan.prefix_pages,
                    now=now,
                ),
            )

        def open_prefill() -> None:
            for i, p in enumerate(self.prefills):
                self._apply(
                    f"prefill{i}", p.open_room(plan.room, num_pages=plan.num_pages, aux_row=0, now=now)
                )

        for step in (open_decode, open_prefill) if decode_first else (open_prefill, open_decode):
            step()

    # ------------------------------------------------------------------ running

    def next_event(self) -> float | None:
        times = [self.link.next_delivery(), self.decode.next_deadline()]
        times += [p.next_deadline() for p in self.prefills]
        times += [w.done_at for w in self._writes]
        times += [w.done_at for w in self._layer_writes] + [e.at for e in self._layer_events]
        times += [x.at for x in self._pending_sends]
        times += [f.context.finish_deadline for f in self._finishers.values() if f.verdict is Verdict.WAIT]
        times += [f.done_at for f in self._fences] + [x.lands_at for x in self._residues]
        times += [c.done_at for c in self._cuts]
        times += [t for t in self._partition_until.values() if t is not None]
        while self._scheduled and self._scheduled[0][0] <= self.clock.now:
            heapq.heappop(self._scheduled)  # already acted on by the step at or after that time
        if self._scheduled:
            times.append(self._scheduled[0][0])
        return min((t for t in times if t is not None), default=None)

    def step(self) -> None:
        """Deliver what is due, finish due writes, fire due timers, let the scheduler act."""
        now = self.clock.now
        for cp, until in list(self._partition_until.items()):
            if until is not None and until <= now:
                self.heal(cp)
        for to, message in self.link.due(now):
            if to == self.decode_endpoint:
                self._apply("decode", self.decode.receive(message, now))
            else:
                cp = self._prefill_address[to]
                self._apply(f"prefill{cp}", self.prefills[cp].receive(message, now))
        for w in [w for w in self._writes if w.done_at <= now]:
            self._writes.remove(w)
            p = self.prefills[w.prefill]
            if w.fail:
                self._residues.append(
                    _Residue(room=w.room, prefill=w.prefill, lands_at=now + self.late_write_s)
                )
                fence = FenceWrite(session=self._decode_session, src=0, dst=0, length=1)
                self._apply(
                    f"prefill{w.prefill}",
                    p.chunk_failed(
                        w.room, w.chunk, "injected engine failure", now, fences={self._decode_key: fence}
                    ),
                )
            else:
                metric = TransferMetricData(pages=1, bytes=4096, seconds=self.transfer_time)
                self._apply(f"prefill{w.prefill}", p.chunk_done(w.room, w.chunk, metric, now))
        for event in [e for e in self._layer_events if e.at <= now]:
            self._layer_events.remove(event)
            if self.prefills[event.prefill] is event.endpoint:
                for context in self.prefills[event.prefill].layers.layer_ready(event.key):
                    self._write_layer(event.prefill, context, event.key, now)
        for lw in [w for w in self._layer_writes if w.done_at <= now]:
            self._layer_writes.remove(lw)
            _layers(lw.context).in_flight -= 1
            if lw.fail:
                _layers(lw.context).failed = True
                self._residues.append(
                    _Residue(room=lw.room, prefill=lw.prefill, lands_at=now + self.late_write_s)
                )
        self._end_layer_contexts(now)
        for pending in [x for x in self._pending_sends if x.at <= now]:
            self._pending_sends.remove(pending)
            p = pending.endpoint
            if self.prefills[pending.prefill] is p and p.poll(pending.room) >= KVPoll.WaitingForInput:
                self._apply(f"prefill{pending.prefill}", p.queue_chunk(pending.room, pending.spec, now))
        for f in [f for f in self._fences if f.done_at <= now]:
            self._fences.remove(f)
            ok = f.prefill not in self._partition_until
            if ok:  # FIFO: every earlier queued byte of that rank left its engine, into a connection
                self.fences_completed += 1
                for x in self._residues:
                    if x.prefill == f.prefill:
                        x.in_engine = False
            if self.prefills[f.prefill] is f.endpoint:
                reason = "" if ok else "partitioned"
                self._apply(f"prefill{f.prefill}", f.endpoint.fence_done(f.room, f.peer, ok, reason, now))
        for cut in [c for c in self._cuts if c.done_at <= now]:
            self._cuts.remove(cut)
            self.cuts_made += 1
            if not self.cut_leaves_queued_bytes:  # every connection from those hosts is closed
                self._residues = [
                    x for x in self._residues if x.in_engine or self._prefill_host(x.prefill) not in cut.hosts
                ]
            self._apply("decode", self.decode.connections_cut(cut.room, True, "", now))
        for x in [x for x in self._residues if x.lands_at <= now]:
            self._residues.remove(x)
            self.late_writes_landed += 1
            if x.room in self._released_safe:
                self.violations.append(
                    SafetyViolation(
                        room=x.room,
                        time=now,
                        what=f"a failed write of prefill {x.prefill} landed after release",
                    )
                )
        self._apply("decode", self.decode.tick(now))
        for i, p in enumerate(self.prefills):
            self._apply(f"prefill{i}", p.tick(now))
        self._schedule(now)

    def run(self, *, until: float, stop: Callable[[], bool] | None = None) -> None:
        """Advance event by event until ``until`` (clock time) or until ``stop()`` is true."""
        self.step()
        while stop is None or not stop():
            nxt = self.next_event()
            if nxt is None or nxt > until:
                self.clock.advance_to(until)
                self.step()
                return
            self.clock.advance_to(nxt)
            self.step()

    def settle(self, *, limit: float = 10_000.0) -> None:
        """Run until every room is terminal on both sides and every abort resolved (or ``limit``)."""
        self.run(until=self.clock.now + limit, stop=self.all_settled)

    def all_settled(self) -> bool:
        return (
            all(self.room_settled(room) for room in self._progress)
            and not self._writes
            and not self._layer_writes
            and not self._layer_events
            and not self._finishers
            and not self._pending_sends
            and not self._fences
        )

    def room_settled(self, room: RoomId) -> bool:
        """Terminal on every live endpoint that holds it, nothing in flight, decode pages released."""
        if self.decode.has_room(room) and not self.decode.release_ready(room):
            return False
        for p in self.prefills:
            if p.has_room(room) and (
                p.poll(room) not in (KVPoll.Success, KVPoll.Failed) or p.in_flight(room)
            ):
                return False
        return True

    def openers(self, room: RoomId) -> tuple[PrefillEndpoint, ...]:
        """The prefill incarnations (one per CP rank) that opened ``room``."""
        return self._progress[room].openers

    def open_rooms(self) -> list[RoomId]:
        """Rooms added and not yet closed by ``close_settled``."""
        return list(self._progress)

    def close_settled(self) -> list[ClosedRoom]:
        """Clear every settled room on both sides, as the schedulers' ``clear()`` would; forget it here."""
        closed: list[ClosedRoom] = []
        now = self.clock.now
        for room in [r for r in self._progress if self.room_settled(r)]:
            prog = self._progress.pop(room)
            decode_poll = self.decode.poll(room) if self.decode.has_room(room) else KVPoll.Failed
            release = self.releases.pop(room, None)
            prefill_polls: list[KVPoll | None] = []
            prefill_causes: list[FailureCause | None] = []
            for i, opener in enumerate(prog.openers):
                live = self.prefills[i] is opener
                prefill_polls.append(opener.poll(room) if live and opener.has_room(room) else None)
                prefill_finished = self.finished.pop((f"prefill{i}", room), None)
                prefill_causes.append(None if prefill_finished is None else prefill_finished.cause)
            for p in self.prefills:
                p.close_room(room, now)  # the scheduler's clear(): its per-layer contexts go too
            if self.decode.has_room(room):
                self.decode.close_room(room, now)
            decode_finished = self.finished.pop(("decode", room), None)
            self._released_safe.pop(room, None)
            closed.append(
                ClosedRoom(
                    room=room,
                    decode=decode_poll,
                    decode_cause=None if decode_finished is None else decode_finished.cause,
                    release_safe=None if release is None else release.safe,
                    prefill=tuple(prefill_polls),
                    prefill_causes=tuple(prefill_causes),
                )
            )
        return closed

    # ------------------------------------------------------------------ liveness faults

    def partition(self, cp: int, *, until: float | None = None) -> None:
        """Cut the control link between prefill rank ``cp`` and the decode rank (both ways) until
        ``heal(cp)`` or clock time ``until``. Messages already on the wire still arrive."""
        self.link.partitions.add(frozenset((self.prefill_endpoints[cp], self.decode_endpoint)))
        self._partition_until[cp] = until

    def heal(self, cp: int) -> None:
        self.link.partitions.discard(frozenset((self.prefill_endpoints[cp], self.decode_endpoint)))
        self._partition_until.pop(cp, None)

    def restart_prefill(self, cp: int, *, announce: bool = True) -> PrefillEndpoint:
        """Replace prefill rank ``cp`` by a new process (epoch + 1) behind the same address.

        The old process is gone with its rooms and in-flight writes. With ``announce`` the decode
        side learns the new epoch at once from a fresh route table (as from the registry);
        without it, only from the new process's answers or the old one's silence.
        """
        now = self.clock.now
        old = self.prefills[cp]
        new = PrefillEndpoint(
            origin=attrs.evolve(old.origin, epoch=Epoch(old.origin.epoch + 1)),
            layout=self.layout,
            timeouts=self.timeouts,
            policy=old.policy,
            layer_finish_timeout_s=self.timeouts.transfer,
        )
        self.retired.append(old)
        self.prefills[cp] = new
        # Writes of the old process in flight die with it in its engine, but what it had handed to
        # the kernel is in sockets the kernel keeps sending (a process exit does not take in-flight
        # bytes with it): they can still land, until the decode cuts that host's connections.
        for room in {w.room for w in self._writes if w.prefill == cp} | {
            w.room for w in self._layer_writes if w.prefill == cp
        }:
            self._residues.append(
                _Residue(room=room, prefill=cp, lands_at=now + self.late_write_s, in_engine=False)
            )
        self._writes = [w for w in self._writes if w.prefill != cp]
        self._layer_writes = [w for w in self._layer_writes if w.prefill != cp]
        self._layer_events = [e for e in self._layer_events if e.prefill != cp]
        self._finishers = {k: f for k, f in self._finishers.items() if f.prefill != cp}
        self._pending_sends = [x for x in self._pending_sends if x.prefill != cp]
        # Its engine's queue dies with the process; bytes already in kernel sockets stay.
        self._residues = [x for x in self._residues if x.prefill != cp or not x.in_engine]
        self._fences = [f for f in self._fences if f.prefill != cp]
        self._stale.extend(self._sent[cp])
        self._sent[cp].clear()
        if announce:
            self._apply("decode", self.decode.connect(self.route_table(), now))
        return new

    def requests_sent(self) -> list[tuple[Endpoint, TransferRequest]]:
        """The decode rank's latest TransferRequests, with their destination (to replay late)."""
        return list(self._requests)

    def stale_messages(self) -> list[tuple[Endpoint, Message]]:
        """Messages that retired incarnations sent (the latest few of each), with their destination."""
        return list(self._stale)

    def deliver(self, to: Endpoint, message: Message) -> list[Effect]:
        """Hand ``message`` to the endpoint at ``to`` now, bypassing the link (a replay, a forgery);
        its effects are carried out as usual and returned."""
        now = self.clock.now
        effects: list[Effect]
        if to == self.decode_endpoint:
            who, effects = "decode", list(self.decode.receive(message, now))
        else:
            cp = self._prefill_address[to]
            who, effects = f"prefill{cp}", list(self.prefills[cp].receive(message, now))
        self._apply(who, effects)
        return effects

    @staticmethod
    def _prefill_host(cp: int) -> str:
        """The engine host of CP rank ``cp`` (its session is ``prefill-<cp>:0``)."""
        return f"prefill-{cp}"

    @property
    def decode_endpoint(self) -> Endpoint:
        return Endpoint("inproc://decode-0")

    # ------------------------------------------------------------------ effects

    def _apply(self, who: str, effects: Sequence[Effect]) -> None:
        """Carry out ``effects`` in the order the endpoint ``who`` emitted them, as the runtime does."""
        now = self.clock.now
        sender = (
            self.decode_endpoint
            if who == "decode"
            else self.prefill_endpoints[int(who.removeprefix("prefill"))]
        )
        for e in effects:
            match e:
                case Send():
                    if who == "decode":
                        if isinstance(e.message, TransferRequest):
                            self._requests.append((e.to, e.message))
                    else:
                        self._sent[int(who.removeprefix("prefill"))].append((e.to, e.message))
                    self.link.post(e.to, e.message, now, sender=sender)
                case SubmitChunk():
                    self._start_write(int(who.removeprefix("prefill")), e, now)
                case RoomFinished():
                    self.finished[(who, e.room)] = e
                case ReleasePages():
                    self._on_release(e, now)
                case ForgetPeer():
                    self.forgotten.append((who, e))
                    self.link.drop_queued(e.endpoint, sender, now)
                case DropLayers():
                    pass  # the endpoint stopped them; _end_layer_contexts drains them
                case SubmitFence():
                    cp = int(who.removeprefix("prefill"))
                    fence = _FenceInFlight(
                        room=e.room,
                        peer=e.peer,
                        prefill=cp,
                        endpoint=self.prefills[cp],
                        done_at=now + self.transfer_time,
                    )
                    self._fences.append(fence)
                case CutConnections():
                    self._cuts.append(_CutInFlight(room=e.room, hosts=e.hosts, done_at=now + self.cut_time))
                case VerifyChecksums():
                    self.verifications.append(e)  # answered by the test (decode.checksums_verified)
                case LeaseLanding() | ScatterLanding():
                    pass  # the pair opens no landing rooms (the transports' tests cover them)
                case Notice():
                    self.notices_seen += 1
                    if self._notice_limit is None or len(self.notices) < self._notice_limit:
                        self.notices.append(e)
                case _:
                    assert_never(e)

    def _start_write(self, prefill: int, e: SubmitChunk, now: float) -> None:
        if not self.prefills[prefill].start_chunk(e.room, e.chunk, now):
            return
        context = self.prefills[prefill].layers.context(e.room, e.spec.start_token)
        if context is not None:  # a per-layer chunk: send() finishes its context
            verdict = self.prefills[prefill].layers.begin_finish(context, np.asarray(e.spec.pages), now)
            if verdict is Verdict.DROPPED:
                reason = f"dropped before send(): {context.stop_reason}"
                self._apply(
                    f"prefill{prefill}", self.prefills[prefill].chunk_failed(e.room, e.chunk, reason, now)
                )
            else:
                self._finishers[id(context)] = _Finisher(
                    prefill=prefill, endpoint=self.prefills[prefill], context=context, verdict=verdict
                )
                self._end_layer_contexts(now)
            return
        self.writes_started += 1
        if e.room in self._released_safe:
            self.violations.append(
                SafetyViolation(room=e.room, time=now, what=f"chunk {e.chunk} started after safe release")
            )
        fail = self.fail_write is not None and self.fail_write(e.room, e.chunk, prefill)
        self._writes.append(
            _Write(room=e.room, chunk=e.chunk, prefill=prefill, done_at=now + self.transfer_time, fail=fail)
        )

    def _on_release(self, e: ReleasePages, now: float) -> None:
        self.releases[e.room] = e
        if not e.safe:
            return
        self._released_safe[e.room] = now
        # Ground truth, independent of what the endpoints believe: a layer write still running.
        for lw in self._layer_writes:
            if lw.room == e.room:
                self.violations.append(
                    SafetyViolation(
                        room=e.room, time=now, what=f"released while prefill {lw.prefill} writes layers"
                    )
                )
        for i, p in enumerate(self.prefills):
            if p.may_write(e.room):
                self.violations.append(
                    SafetyViolation(room=e.room, time=now, what=f"released while prefill {i} may write")
                )

    def _schedule(self, now: float) -> None:
        """The simulated prefill scheduler: one chunk per room per step once bootstrapped, plus aborts.

        It drives each room on the incarnations that opened it; a rank that restarted lost the
        request, which the rank consensus (MIN) sees as Failed.
        """
        for room, prog in self._progress.items():
            if prog.idle:
                continue
            plan = prog.plan
            if plan.abort_decode_at is not None and not prog.decode_aborted and now >= plan.abort_decode_at:
                prog.decode_aborted = True
                if self.decode.has_room(room):
                    self._apply("decode", self.decode.abort_room(room, "client went away", now))
            live = [(i, p) for i, p in enumerate(prog.openers) if self.prefills[i] is p and p.has_room(room)]
            if (
                plan.abort_prefill_at is not None
                and not prog.prefill_aborted
                and now >= plan.abort_prefill_at
            ):
                prog.prefill_aborted = True
                for i, p in live:
                    self._apply(f"prefill{i}", p.abort_room(room, "prefill scheduler aborted", now))
            pending_aborts = (plan.abort_decode_at is not None and not prog.decode_aborted) or (
                plan.abort_prefill_at is not None and not prog.prefill_aborted
            )
            polls = [p.poll(room) for _, p in live]
            if len(live) < len(prog.openers) or min(polls) is KVPoll.Failed:
                # Rank consensus (MIN): one failed (or lost) rank fails the room on every rank.
                for i, p in live:
                    self._apply(f"prefill{i}", p.abort_room(room, "another CP rank failed the room", now))
                prog.idle = not pending_aborts
                continue
            forwarding = any(x.room == room for x in self._pending_sends)  # a per-layer chunk's forward
            if (
                prog.next_chunk < len(plan.chunk_pages)
                and min(polls) >= KVPoll.WaitingForInput
                and not forwarding
            ):
                self._queue_next_chunk(prog, now)
            done = prog.next_chunk == len(plan.chunk_pages) and all(
                p.poll(room) is KVPoll.Success for _, p in live
            )
            prog.idle = done and not pending_aborts

    def _queue_next_chunk(self, prog: _Progress, now: float) -> None:
        plan = prog.plan
        index = prog.next_chunk
        start = plan.prefix_pages + sum(plan.chunk_pages[:index])
        spec = ChunkSpec(
            pages=np.arange(start, start + plan.chunk_pages[index], dtype=np.int64),
            start_token=start * self.layout.page_size,
            last=index == len(plan.chunk_pages) - 1,
        )
        prog.next_chunk += 1
        for i, p in enumerate(prog.openers):
            if plan.per_layer and self.prefills[i] is p:
                # Registered before its forward; send() once the forward ends (layer_time later).
                self._register_layers(i, plan.room, spec, index, now)
                self._pending_sends.append(
                    _PendingSend(prefill=i, endpoint=p, room=plan.room, spec=spec, at=now + self.layer_time)
                )
                continue
            self._apply(f"prefill{i}", p.queue_chunk(plan.room, spec, now))

    # ------------------------------------------------------------------ per-layer contexts

    def _register_layers(self, prefill: int, room: RoomId, spec: ChunkSpec, chunk: int, now: float) -> None:
        """Register the chunk for per-layer transfer (if the endpoint rules so) and run its forward:
        the rank reports its layers one by one over ``layer_time``."""
        p = self.prefills[prefill]
        pages = np.asarray(spec.pages, dtype=np.int64)
        ruling = p.layer_destinations(room, pages, spec.start_token)
        if isinstance(ruling, str):
            return
        context = p.layer_register(
            room,
            spec.start_token,
            pages=pages,
            destinations=ruling,
            expected=frozenset(self._layer_keys),
            work=_Layers(chunk=chunk),
            now=now,
        )
        assert isinstance(context, LayerContext), context  # ruled under the same "lock" just above
        step = self.layer_time / len(self._layer_keys)
        for k, key in enumerate(self._layer_keys):
            self._layer_events.append(
                _LayerEvent(prefill=prefill, endpoint=p, key=key, at=now + (k + 1) * step)
            )

    def _write_layer(self, prefill: int, context: LayerContext[object], key: LayerKey, now: float) -> None:
        """A layer routed to ``context``: the endpoint is asked before its first write, then each of
        its destinations gets the layer (written ``transfer_time`` later, failing if injected)."""
        p = self.prefills[prefill]
        if not p.layer_first_write(context, now):
            return
        self.writes_started += 1
        if context.room in self._released_safe:
            self.violations.append(
                SafetyViolation(room=context.room, time=now, what="layer writes started after safe release")
            )
        fail = self.fail_write is not None and self.fail_write(context.room, _layers(context).chunk, prefill)
        for peer in context.peers:
            p.layers.submitted(context, key, peer)
            _layers(context).in_flight += 1
            self._layer_writes.append(
                _LayerWrite(
                    room=context.room,
                    prefill=prefill,
                    endpoint=p,
                    context=context,
                    done_at=now + self.transfer_time,
                    fail=fail,
                )
            )

    def _end_layer_contexts(self, now: float) -> None:
        """Contexts whose writes all ended: a finisher's ends the chunk, a stopped one is drained."""
        for prefill, p in enumerate(self.prefills):
            book = p.layers
            for context in [c for c in book.all_contexts() if not c.terminal]:
                finisher = self._finishers.get(id(context))
                if finisher is not None:
                    if finisher.verdict is Verdict.WAIT:
                        finisher.verdict = book.finish_check(context, now, job_failed=_layers(context).failed)
                    if finisher.verdict is Verdict.WAIT or _layers(context).in_flight:
                        continue
                    del self._finishers[id(context)]
                    if finisher.verdict is Verdict.COMPLETE and not _layers(context).failed:
                        trigger = PerLayerTrigger.COMPLETE
                    else:
                        trigger = (
                            PerLayerTrigger.DROP
                            if finisher.verdict is Verdict.DRAIN_DROP
                            else PerLayerTrigger.FAIL
                        )
                elif (
                    context.state in (PerLayerState.CANCELLING, PerLayerState.FAILING)
                    and not _layers(context).in_flight
                ):
                    trigger = PerLayerTrigger.DROP
                else:
                    continue
                self._context_ended(prefill, p, context, trigger, finisher, now)

    def _context_ended(
        self,
        prefill: int,
        p: PrefillEndpoint,
        context: LayerContext[object],
        trigger: PerLayerTrigger,
        finisher: _Finisher | None,
        now: float,
    ) -> None:
        who = f"prefill{prefill}"
        fences = None
        if _layers(context).failed:
            fences = {self._decode_key: FenceWrite(session=self._decode_session, src=0, dst=0, length=1)}
        self._apply(who, p.layer_ended(context, trigger, now, fences=fences))
        if finisher is None:
            return
        if trigger is PerLayerTrigger.COMPLETE:
            metric = TransferMetricData(pages=1, bytes=4096, seconds=self.transfer_time)
            self._apply(who, p.chunk_done(context.room, _layers(context).chunk, metric, now))
        else:
            reason = "injected engine failure" if _layers(context).failed else context.stop_reason
            self._apply(who, p.chunk_failed(context.room, _layers(context).chunk, reason or "failed", now))


def default_layout(*, layers: int = 2, pages: int = 4096, page_size: int = 16) -> BufferLayout:
    """A small MLA layout with an aux buffer: enough for protocol tests (addresses are fictitious)."""
    item = page_size * 64
    buffers = [
        BufferSpec(
            kind=BufferKind.KV,
            model=ModelRole.TARGET,
            layer_id=layer,
            base_ptr=0x10_0000_0000 + layer * pages * item,
            length=pages * item,
            item_bytes=item,
        )
        for layer in range(layers)
    ]
    buffers.append(
        BufferSpec(
            kind=BufferKind.AUX,
            model=ModelRole.TARGET,
            layer_id=0,
            base_ptr=0x20_0000_0000,
            length=64 * 64,
            item_bytes=64,
        )
    )
    return BufferLayout.build(attention=AttentionKind.MLA, page_size=page_size, buffers=buffers)
