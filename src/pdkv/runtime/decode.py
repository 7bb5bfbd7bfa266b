"""``DecodeTransport`` and ``KVReceiver``: the decode rank's side of pdkv, as a scheduler embeds it.

Owns: the control thread and the lock around one decode rank's sans-IO ``DecodeEndpoint``; the
route tables of the prefill instances it receives from; the TP fan-out of each room (which prefill
ranks it asks, which are dummies, how many statuses it waits for: ``pdkv.mapping.decode_fanout``).
The decode side moves no bytes itself: prefill ranks write into its registered buffers. Its job is
to say where (TransferRequest), to know when the bytes are complete (every required status), and
to say when pages are safe to reuse (``release_ready``: after every AbortAck, or the counted timeout).
With ``kv_checksum`` (``PDKV_KV_CHECKSUM``) it also checks the bytes before Success: the endpoint
asks (``VerifyChecksums``), a verifier thread computes the checksums of the room's pages on their
device (``pdkv.runtime.checksum``) off the control thread and the lock, and feeds the verdict back.
With decode TP below the prefill's (MHA/GQA heads from several prefill ranks per decode rank) it leases
each room's landing space from its ``LandingPool`` at ``receiver.init`` (the room waits in
Bootstrapping for space), and scatters the landed page items into the room's pages before Success
(``pdkv.runtime.landing``; specs/mapping.md section 15).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, assert_never

import attrs

from pdkv import config
from pdkv.config import tcp_address_problem
from pdkv.control.auth import Authenticator
from pdkv.control.channel import ChannelStatistics
from pdkv.control.errors import ControlError
from pdkv.engine.backend import TransferBackend
from pdkv.errors import (
    ConfigError,
    InvalidArgumentError,
    LayoutMismatchError,
    PdkvError,
    RouteUnavailableError,
)
from pdkv.mapping import (
    DEFAULT_LAYOUT_POLICY,
    BufferLayout,
    LayoutPolicy,
    Topology,
    decode_fanout,
    head_range,
    layout_kv_heads,
)
from pdkv.mapping.landing import landing_wanted
from pdkv.metrics import KVTransferMetric, TransportCounter, TransportGauge, TransportMetricsSnapshot
from pdkv.protocol import arguments
from pdkv.protocol.config import Timeouts
from pdkv.protocol.decode import DecodeEndpoint, DecodeStatistics
from pdkv.protocol.effects import (
    ChecksumMismatch,
    CutConnections,
    DecodeEffect,
    ForgetPeer,
    LeaseLanding,
    Notice,
    PeerKey,
    ReleaseKind,
    ReleasePages,
    RoomFinished,
    ScatterLanding,
    Send,
    Target,
    VerifyChecksums,
)
from pdkv.protocol.ids import Endpoint, Epoch, InstanceId, RoomId, SessionId
from pdkv.protocol.messages import (
    IntArray,
    LandingGrant,
    Origin,
    RankCoord,
    RouteQuery,
    RouteTable,
    StateIndices,
)
from pdkv.protocol.poll import KVPoll
from pdkv.protocol.registration import DraftSkipped
from pdkv.runtime._cuts import HostCutter
from pdkv.runtime._host import WAIT_RECEIVES_ENV, EndpointHost, RoomHandle, new_epoch, peer_name
from pdkv.runtime._layout_policy import LAYOUT_POLICY_ENV
from pdkv.runtime._loop import ChannelFactory
from pdkv.runtime.channels import control_channel_factory, query_registry
from pdkv.runtime.checksum import Checksummer, RoomPages, checksums_from_env, verify_room
from pdkv.runtime.landing import LandingConfig, LandingPool

log = logging.getLogger(__name__)

_T = TypeVar("_T")

INLINE_VERIFY_BYTES = 32 << 20
"""A room with at most this many KV bytes is checked on the thread that saw its last Success status
(about 1.5 ms of reading here); larger ones on the verifier thread."""


@attrs.frozen(kw_only=True)
class DecodeConfig:
    """One decode rank (decode CP is 1: every decode rank holds whole requests).

    The constructor reads no environment: ``DecodeConfig.from_env(...)`` takes the ``PDKV_*``
    overrides of the timeouts and the layout policy (README, "Environment")."""

    instance: InstanceId = attrs.field(validator=config.non_empty_text)
    rank: RankCoord = attrs.field(validator=config.instance_of(RankCoord))
    tp_size: int = attrs.field(validator=config.positive_int)
    layout: BufferLayout = attrs.field(validator=config.instance_of(BufferLayout))
    host: str = attrs.field(default="127.0.0.1", validator=config.non_empty_text)
    timeouts: Timeouts = attrs.field(factory=Timeouts, validator=config.instance_of(Timeouts))
    epoch: Epoch = attrs.field(factory=new_epoch, validator=config.instance_of(int))
    wait_receives: bool = attrs.field(
        default=True, validator=config.instance_of(bool), metadata=WAIT_RECEIVES_ENV
    )
    """``wait_progress`` receives on the scheduler's thread while it waits: a message that arrives
    then is handled where it is awaited, one thread hand-off less (``EndpointHost.wait_progress``)."""
    register_memory: bool = attrs.field(default=True, validator=config.instance_of(bool))
    kv_checksum: bool = attrs.field(default=False, validator=config.instance_of(bool))
    """``PDKV_KV_CHECKSUM``: before a room's Success, check its pages against the checksums every
    prefill rank sent (a mismatch fails the room, ``FailureCause.CHECKSUM``, naming the page)."""
    checksum_device: str = attrs.field(default="cpu", validator=config.non_empty_text)
    """Where the registered buffers live (``cpu``, ``cuda:N``): the checksums run there."""
    layout_policy: LayoutPolicy = attrs.field(
        default=DEFAULT_LAYOUT_POLICY, validator=config.instance_of(LayoutPolicy), metadata=LAYOUT_POLICY_ENV
    )
    """Whether a prefill rank may serve this rank with draft-model buffers left out (``DEGRADE_DRAFT``,
    the default: a rolling deployment keeps serving, rooms report ``draft_skipped()``) or not
    (``STRICT``: such a registration is refused). Target buffers must match under either."""
    landing: LandingConfig = attrs.field(factory=LandingConfig, validator=config.instance_of(LandingConfig))
    """The landing pool (``PDKV_LANDING_BYTES``) for prefill instances of a larger TP: allocated and
    registered by ``connect()`` to a prefill instance whose rooms land in it (``checksum_device``: where
    it lives)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **fields: Any) -> DecodeConfig:
        """``fields`` as for the constructor; the timeouts, ``kv_checksum`` and the layout policy, when
        not given, come from the ``PDKV_*`` variables set in ``env`` (``os.environ`` by default)."""
        fields.setdefault("timeouts", Timeouts.from_env(env))
        fields.setdefault("kv_checksum", checksums_from_env(env))
        fields.setdefault("landing", LandingConfig.from_env(env))
        return config.from_env(cls, env, **fields)

    def __attrs_post_init__(self) -> None:
        if self.rank.tp >= self.tp_size or self.rank.cp != 0:
            raise ConfigError(f"decode rank {self.rank} outside tp_size {self.tp_size} (decode cp must be 0)")

    @property
    def origin(self) -> Origin:
        return Origin(instance=self.instance, epoch=self.epoch, rank=self.rank)


@attrs.frozen
class _Granted:
    """A room's landing lease (``{}``: grant-less), for ``landing_granted`` after the effects' batch."""

    room: RoomId
    grants: Mapping[PeerKey, LandingGrant]


@attrs.frozen
class _Scattered:
    """A room's landed heads were copied into its pages (``error``: the copy failed), for
    ``landing_scattered`` after the effects' batch."""

    room: RoomId
    error: str | None


@attrs.frozen(kw_only=True)
class DecodeTransportStatistics:
    """Protocol counters, what prefill ranks reported writing (per peer latency), and the sockets."""

    endpoint: DecodeStatistics
    metrics: TransportMetricsSnapshot
    channel: ChannelStatistics
    failed_rooms_released: int
    """Failed rooms whose pages came back (by kind: ``endpoint.releases_*``; a room that succeeded
    needs no release)."""
    unsafe_releases: int
    receive_lends: int = 0
    """Times the control thread lent receiving to a scheduler waiting in ``wait_progress``
    (``PDKV_WAIT_RECEIVES``): each hand-over, not each wait."""


Query = Callable[[str, RouteQuery, float], RouteTable | None]


class DecodeTransport(EndpointHost[DecodeEndpoint, DecodeEffect]):
    """One decode rank: registers its buffers and receives rooms from prefill instances."""

    def __init__(
        self,
        config: DecodeConfig,
        backend: TransferBackend,
        *,
        channel_factory: ChannelFactory | None = None,
        query: Query | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.backend = backend
        factory = channel_factory if channel_factory is not None else control_channel_factory()
        channel = factory(config.host)
        endpoint = DecodeEndpoint(
            origin=config.origin,
            tp_size=config.tp_size,
            endpoint=Endpoint(channel.address),
            session=SessionId(backend.session_id),
            layout=config.layout,
            timeouts=config.timeouts,
            cuts_connections=True,  # a backend that cannot cut says so, and the room settles instead
            layout_policy=config.layout_policy,
        )
        super().__init__(endpoint, channel, thread_name=f"pdkv-decode-{config.rank}", logger=log, clock=clock)
        self._query_route = query if query is not None else _default_query()
        self._zmq_registry = query is None  # registry addresses are tcp://host:port (checked at connect)
        self._routes: dict[InstanceId, RouteTable] = {}
        # fanout_targets per prefill instance, with the route table it was derived from: every room
        # from one instance targets the same ranks (recomputed when connect() replaces the table).
        self._fanouts: dict[InstanceId, tuple[RouteTable, tuple[Target, ...], int]] = {}
        self._released = 0
        self._unsafe = 0
        self._seen: dict[TransportCounter, int] = {}  # endpoint counter totals already in metrics
        self._cutter = HostCutter(
            backend.cut_connections_from, self._cut_done, name=f"pdkv-cut-{config.rank}"
        )
        self._checksum_on = config.kv_checksum
        self._checksummer: Checksummer | None = None  # built by the first room to verify
        self._verifications: queue.Queue[VerifyChecksums | None] = queue.Queue(maxsize=4096)
        self._verifier: threading.Thread | None = None  # started by the first large room to verify
        self._verdicts: list[tuple[RoomId, ChecksumMismatch | None]] = []  # checked inline, not yet applied
        self._kv_bytes_per_page = sum(b.item_bytes for b in config.layout.kv_buffers)
        self.landing = LandingPool(
            backend, config.layout, config.rank.tp, config.landing, device=config.checksum_device
        )
        self._topologies: dict[InstanceId, tuple[Topology, bool]] = {}  # per prefill instance: landing?
        self._landed: list[_Granted | _Scattered] = []  # landing answers, applied after the batch

    def start(self) -> None:
        """Register buffers and start the control thread. Idempotent once it succeeded; a failed start
        (memory that cannot be registered) rolls back what it registered and may be retried."""
        self._start(
            self.backend,
            self.config.layout if self.config.register_memory else None,
            then=self._publish_engine_metadata,
        )

    def _publish_engine_metadata(self) -> None:
        """Once the buffers are registered, Register carries what the prefill's engine needs to write
        into them (NIXL: the agent's metadata and regions; nothing for Mooncake)."""
        metadata = self.backend.engine_metadata
        with self._lock:
            self._endpoint.set_engine_metadata(metadata)

    def connect(self, registry: str, *, timeout_s: float = 60.0) -> InstanceId:
        """Fetch the route table of the prefill instance behind ``registry`` and register with its ranks.

        Blocks until the table is complete (every prefill rank announced) or ``timeout_s`` passed,
        retrying a registry that does not answer until then: call it at start-up, not on the
        scheduler's hot path. Returns the prefill instance id that ``KVReceiver.init`` names.

        Raises ``RouteUnavailableError`` (with the last cause) when no complete table came in time,
        and ``LayoutMismatchError`` with the difference when the prefill ranks' layout differs from
        ours (they say how when they refuse the registration; that answer is waited for here).
        """
        self._check_open("connect()")
        timeout_s = arguments.seconds(timeout_s, argument="timeout_s")
        problem = tcp_address_problem(registry) if self._zmq_registry else None
        if problem is not None:
            raise InvalidArgumentError(f"connect(): registry {problem}", argument="registry", value=registry)
        deadline = self._clock() + timeout_s
        query = RouteQuery(origin=self.config.origin)
        cause = "no rank of the instance announced yet"
        while True:
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise RouteUnavailableError(
                    f"no complete route table from {registry} within {timeout_s:g} s: {cause}", peer=registry
                )
            try:
                table = self._query_route(registry, query, max(0.05, min(remaining, 5.0)))
            except ControlError as exc:
                table, cause = None, str(exc)
            if table is not None and table.complete:
                break
            if table is not None:
                cause = f"{len(table.ranks)} of {table.tp_size * table.cp_size} prefill ranks announced"
            time.sleep(min(0.05, max(0.0, deadline - self._clock())))
        if table.page_size != self.config.layout.page_size:
            raise LayoutMismatchError(
                f"page size differs: prefill {table.page_size}, decode {self.config.layout.page_size}",
                peer=registry,
            )
        instance = table.origin.instance
        with self._lock:
            self._check_open("connect()")
            self._routes[instance] = table
            self._prepare_landing(instance)
            self._apply(self._endpoint.connect(table, self._clock()))
        if table.layout_digest != self.config.layout.digest():
            # The digest says only "different"; the prefill ranks' refusal says how, or their acks
            # name the draft buffers left out (each pair warned of that already).
            self.wait_registered(instance, timeout_s=max(0.0, deadline - self._clock()))
            with self._lock:
                acks = [self._endpoint.peer_ack(Target(instance=instance, rank=r.rank)) for r in table.ranks]
            if not any(ack is not None and ack.leaves_out for ack in acks):
                log.warning(
                    "layout digest of %s differs from ours, yet its ranks accepted the layout", registry
                )
        return instance

    def wait_registered(self, instance: InstanceId, *, timeout_s: float = 30.0) -> bool:
        """True once every prefill rank of ``instance`` acknowledged registration (False on timeout).

        Raises ``LayoutMismatchError`` with the prefill rank's reason as soon as one refused, and
        ``TransportClosedError`` once the transport is closed (its registrations are gone).
        """
        timeout_s = arguments.seconds(timeout_s, argument="timeout_s")
        deadline = self._clock() + timeout_s
        while True:
            self._check_open("wait_registered()")
            with self._lock:
                table = self._routes.get(instance)
                if table is None:
                    raise ConfigError(f"prefill instance {instance!r} is not connected (connect() first)")
                targets = [Target(instance=instance, rank=route.rank) for route in table.ranks]
                refused = [
                    (t, reason) for t in targets if (reason := self._endpoint.peer_refusal(t)) is not None
                ]
                ready = all(self._endpoint.peer_ready(t) for t in targets)
            if refused:
                target, reason = refused[0]
                raise LayoutMismatchError(
                    f"prefill rank {instance}:{target.rank} refused decode {self.config.rank}: {reason}",
                    peer=peer_name(instance, target.rank),
                )
            if ready:
                return True
            if self._clock() >= deadline:
                return False
            time.sleep(0.005)

    def close(self, *, timeout_s: float | None = None) -> None:
        """Fail the open rooms (their prefill ranks are told), wait up to ``timeout_s`` (default: the
        abort-ack timeout) for every room's pages to be safe, then close sockets and unregister memory.
        Idempotent.

        A room whose prefill ranks did not acknowledge in time may still receive writes: then the
        memory stays registered (``stuck_writes``, an ERROR log) instead of being released under them.
        """
        if timeout_s is not None:
            timeout_s = arguments.seconds(timeout_s, argument="timeout_s")
        if not self._begin_close("decode transport closed"):
            return
        wait = self.config.timeouts.abort_ack if timeout_s is None else timeout_s
        self._await_endpoint(lambda endpoint: all(map(endpoint.release_ready, endpoint.rooms())), wait)
        with self._lock:
            unsafe = [r for r in self._endpoint.rooms() if not self._endpoint.release_ready(r)]
        stuck = None
        if unsafe:
            stuck = (
                f"decode {self.config.rank} closed with {len(unsafe)} room(s) whose prefill ranks did not "
                f"acknowledge within {wait:g} s (e.g. {unsafe[:5]})"
            )
        self._stop_verifier()  # it reads the registered memory: it ends before that is unregistered
        if not unsafe:
            self.landing.close()
        self._finish_close(stuck)

    def receiver(self, room: RoomId | int, prefill: InstanceId) -> KVReceiver:
        """The scheduler's handle on ``room`` (an int in 1..2**63-1; checked here) from ``prefill``."""
        checked = arguments.checked_room(room)
        self._check_open("receiver()")
        return KVReceiver(self, checked, prefill)

    def statistics(self) -> DecodeTransportStatistics:
        with self._lock:
            endpoint = self._endpoint.statistics()
        return DecodeTransportStatistics(
            endpoint=endpoint,
            metrics=self.metrics.snapshot(),
            channel=self._loop.channel.statistics(),
            failed_rooms_released=self._released,
            unsafe_releases=self._unsafe,
            receive_lends=self._loop.lends,
        )

    def fanout_targets(self, prefill: InstanceId) -> tuple[tuple[Target, ...], int]:
        """The prefill ranks a room from ``prefill`` is requested from, and their required_dst_info_num."""
        table = self._routes.get(prefill)
        if table is None:
            raise ConfigError(f"prefill instance {prefill!r} is not connected (call connect(registry) first)")
        known = self._fanouts.get(prefill)
        if known is not None and known[0] is table:
            return known[1], known[2]
        topology = Topology(
            prefill_tp=table.tp_size,
            decode_tp=self.config.tp_size,
            prefill_cp=table.cp_size,
            attention=self.config.layout.attention,
            # MHA/GQA layouts that describe heads carry the model's KV head count, which decides the
            # dummies when the TP sizes differ (both instances run the same model).
            kv_heads=layout_kv_heads(self.config.layout),
        )
        fan = decode_fanout(topology, self.config.rank.tp)
        targets = tuple(
            Target(instance=prefill, rank=RankCoord(tp=t.tp, cp=t.cp), dummy=t.dummy) for t in fan.targets
        )
        # Every prefill rank of one room waits for the same number of decode requests.
        ratio = topology.ratio if topology.decode_tp > topology.prefill_tp else 1
        self._fanouts[prefill] = (table, targets, ratio)
        wanted = self.config.landing.capacity_bytes > 0 and landing_wanted(
            self.config.layout, topology, self.config.rank.tp
        )
        self._topologies[prefill] = (topology, wanted)
        return targets, ratio

    def _prepare_landing(self, prefill: InstanceId) -> None:
        """Lock held, before the Register messages go out: when rooms from ``prefill`` land in this
        rank's landing pool, register the pool now and republish the engine metadata, so the metadata
        those messages carry covers it (a NIXL prefill rank writes only into regions listed there)."""
        if self.uses_landing(prefill) and self.landing.prepare():
            self._endpoint.set_engine_metadata(self.backend.engine_metadata)

    def uses_landing(self, prefill: InstanceId) -> bool:
        """Whether rooms from ``prefill`` land in this rank's landing pool (decode TP below prefill TP,
        heads from several prefill ranks per page)."""
        self.fanout_targets(prefill)
        return self._topologies[prefill][1]

    # ------------------------------------------------------------------ internals

    def _wait_receives(self) -> bool:
        return self.config.wait_receives

    def _after_tick(self) -> None:
        rooms, pages, quarantines, released, proven = self._endpoint.quarantine_figures()
        self.metrics.set_gauge(TransportGauge.ROOMS_QUARANTINED, rooms)
        self.metrics.set_gauge(TransportGauge.PAGES_QUARANTINED, pages)
        skipped = self._endpoint.draft_buffers_skipped()
        self.metrics.set_gauge(TransportGauge.DRAFT_BUFFERS_SKIPPED, skipped)
        landing = self.landing.statistics()
        self.metrics.set_gauge(TransportGauge.LANDING_BYTES_IN_USE, landing.in_use_bytes)
        self.metrics.set_gauge(TransportGauge.ROOMS_WAITING_FOR_LANDING, landing.waiting)
        for counter, total in (
            (TransportCounter.QUARANTINES, quarantines),
            (TransportCounter.QUARANTINES_RELEASED, released),
            (TransportCounter.QUARANTINES_PROVEN, proven),
        ):
            new = total - self._seen.get(counter, 0)
            if new > 0:
                self.metrics.increment(counter, new)
                self._seen[counter] = total

    def _apply_effect(self, effect: DecodeEffect) -> None:
        match effect:
            case Send():
                self._loop.post(effect.to, effect.message)
            case ReleasePages():
                self._release_landing(effect.room)
                self._released += 1
                if not effect.safe:
                    self._unsafe += 1
                    log.warning("room %s: pages released UNSAFELY: %s", effect.room, effect.reason)
            case RoomFinished():
                if effect.poll is KVPoll.Success:
                    self._release_landing(effect.room)
                    log.debug("room %s succeeded on decode %s", effect.room, self.config.rank)
                    for (instance, rank), data in self._endpoint.metric(effect.room).items():
                        self._accounting.reported(effect.room, peer_name(instance, rank), data)
                    skipped = self._endpoint.draft_skipped(effect.room)
                    if skipped is not None:
                        self.metrics.increment(TransportCounter.ROOMS_DRAFT_SKIPPED)
                        log.debug("room %s: %s", effect.room, skipped)
            case CutConnections():
                # Off the lock: a cut waits until this process closed the destroyed sockets.
                self._cutter.request(effect)
            case VerifyChecksums():
                self._request_verification(effect)
            case LeaseLanding():
                self._lease(effect)
            case ScatterLanding():
                self._scatter(effect)
            case Notice():
                self._log_notice(effect)
            case ForgetPeer():
                self._forget_peer(effect)
            case _:
                assert_never(effect)

    # ------------------------------------------------------------------ checksums

    def set_kv_checksum(self, on: bool) -> None:
        """Turn the check on or off for rooms ``receiver.init`` opens from now on (``kv_checksum``)."""
        self._checksum_on = arguments.flag(on, room=None, argument="on")

    def _apply(self, effects: Sequence[DecodeEffect], *, progressed: bool = True) -> None:
        """The endpoint's effects in order, then the verdicts of rooms checked inline among them
        (each verdict's own effects after every effect of the batch that asked for it)."""
        super()._apply(effects, progressed=progressed)
        while self._verdicts or self._landed:
            if self._landed:
                match self._landed.pop(0):
                    case _Granted(room=room, grants=grants):
                        super()._apply(self._endpoint.landing_granted(room, grants, self._clock()))
                    case _Scattered(room=room, error=error):
                        super()._apply(self._endpoint.landing_scattered(room, error, self._clock()))
                continue
            room, mismatch = self._verdicts.pop(0)
            super()._apply(self._endpoint.checksums_verified(room, mismatch, self._clock()))

    # ------------------------------------------------------------------ the landing zone

    def _lease(self, effect: LeaseLanding) -> None:
        """Lock held: lease the room's landing space now, or queue it (the room waits in Bootstrapping)."""
        instance = effect.sources[0][0] if effect.sources else None
        known = self._topologies.get(instance) if instance is not None else None
        if known is None:
            self._landed.append(_Granted(effect.room, {}))  # nothing to lay out: grant-less
            return
        try:
            grants = self.landing.request(effect, known[0])
        except PdkvError as exc:  # a layout the pool cannot serve: the room goes grant-less, logged
            log.warning(
                "room %s: no landing lease (%s: %s): sent grant-less", effect.room, type(exc).__name__, exc
            )
            grants = {}
        except Exception:  # a bug below: never wedge the room (it goes grant-less), but say it loudly
            log.exception("room %s: leasing landing space failed unexpectedly: sent grant-less", effect.room)
            grants = {}
        if grants is not None:
            self._landed.append(_Granted(effect.room, grants))
        else:
            log.debug("room %s waits for landing space on decode %s", effect.room, self.config.rank)

    def _release_landing(self, room: RoomId) -> None:
        """Lock held: the room's pages are released, and with them its lease; waiting rooms served."""
        if not self.landing.holds(room):
            return
        for served, grants in self.landing.release(room):
            self._landed.append(_Granted(served, grants))

    def _scatter(self, effect: ScatterLanding) -> None:
        """Lock held: copy the landed heads into the room's pages (on the buffers' device, synchronised)."""
        error: str | None = None
        try:
            self.landing.scatter(effect)
        except Exception as exc:
            log.exception("room %s: landing scatter failed", effect.room)
            error = f"{type(exc).__name__}: {exc}"
        else:
            self.metrics.increment(TransportCounter.ROOMS_LANDED)
        self._landed.append(_Scattered(effect.room, error))

    def _request_verification(self, effect: VerifyChecksums) -> None:
        """Lock held: a small room is checked here, at once (a hand-off to another thread costs more
        than reading a few MB); a large one goes to the verifier thread (tens of milliseconds of
        reading that must not hold the lock or the control thread); with its queue full, here too."""
        if effect.dst_pages.size * self._kv_bytes_per_page <= INLINE_VERIFY_BYTES:
            self._verdicts.append((effect.room, self._verify(effect)))
            return
        if self._verifier is None:
            self._verifier = threading.Thread(
                target=self._verify_loop, name=f"pdkv-verify-{self.config.rank}", daemon=True
            )
            self._verifier.start()
        try:
            self._verifications.put_nowait(effect)
        except queue.Full:
            self._verdicts.append((effect.room, self._verify(effect)))

    def _verify_loop(self) -> None:
        while True:
            effect = self._verifications.get()
            if effect is None:
                return
            mismatch = self._verify(effect)
            with self._locked():
                self._apply(self._endpoint.checksums_verified(effect.room, mismatch, self._clock()))

    def _verify(self, effect: VerifyChecksums) -> ChecksumMismatch | None:
        """The verdict on one room; a verifier that fails says so as a mismatch (the room fails)."""
        try:
            if self._checksummer is None:
                self._checksummer = Checksummer.of(self.config.layout, self.config.checksum_device)
            summer = self._checksummer
            started = time.perf_counter()
            pages = RoomPages(
                dst_pages=effect.dst_pages,
                prefix_pages=effect.prefix_pages,
                dst_state=effect.dst_state,
                dst_aux_row=effect.dst_aux_row,
            )
            mismatch = verify_room(
                summer,
                pages,
                dict(effect.reports),
                prefill_heads=self._prefill_heads,
                left_out=dict(effect.left_out),
            )
            log.debug(
                "room %s: checksums of %d pages verified in %.2f ms",
                effect.room,
                effect.dst_pages.size,
                (time.perf_counter() - started) * 1e3,
            )
        except Exception as exc:
            log.exception("room %s: checksum verification failed", effect.room)
            mismatch = ChecksumMismatch(
                prefill=None,
                buffer=None,
                layer=None,
                position=None,
                dst_index=None,
                entries=0,
                detail=f"checksum verification failed: {type(exc).__name__}: {exc}",
            )
        if mismatch is None:
            self.metrics.increment(TransportCounter.ROOMS_VERIFIED)
        return mismatch

    def _prefill_heads(self, key: PeerKey) -> tuple[int, int] | None:
        """The model KV heads prefill rank ``key`` holds (None: the layout describes no heads)."""
        heads = layout_kv_heads(self.config.layout)
        table = self._routes.get(key[0])
        if heads is None or table is None:
            return None
        held = head_range(heads, table.tp_size, key[1].tp)
        return held.start, held.stop

    def _stop_verifier(self) -> None:
        if self._verifier is None:
            return
        self._verifications.put(None)
        self._verifier.join(30)

    def _cut_done(self, effect: CutConnections, ok: bool, reason: str) -> None:
        """The cutter ended the connections a quarantined room waited for (or could not)."""
        with self._lock:
            self._apply(self._endpoint.connections_cut(effect.room, ok, reason, self._clock()))


class KVReceiver(RoomHandle[DecodeEndpoint, DecodeEffect]):
    """The scheduler's handle on one room of a decode rank. Every call returns without network waits."""

    transport: DecodeTransport

    def __init__(self, transport: DecodeTransport, room: RoomId, prefill: InstanceId) -> None:
        super().__init__(transport, room)
        self.prefill = prefill

    def init(
        self,
        dst_pages: IntArray | Sequence[int],
        aux_row: int | None,
        state_indices: Sequence[StateIndices] = (),
        *,
        prefix_pages: int = 0,
    ) -> None:
        """Where the room's bytes go: one destination page per position, an aux row, state slots.
        ``prefix_pages``: the first positions this rank already holds (its prefix cache); the
        prefill side starts after them and never writes them.

        Every argument is checked against this rank's buffers first (``InvalidArgumentError``,
        ``MappingError`` for repeated pages) and a bad call creates nothing.
        """
        self.transport._check_open(f"receiver.init of room {self.room}")
        targets, required = self.transport.fanout_targets(self.prefill)
        landing = self.transport.uses_landing(self.prefill)
        self.transport._call(
            lambda e, now: e.open_room(
                self.room,
                targets=targets,
                dst_pages=dst_pages,
                dst_aux_row=aux_row,
                dst_state=state_indices,
                required_dst_info_num=required,
                prefix_pages=prefix_pages,
                verify_checksums=self.transport._checksum_on,
                landing=landing,
                now=now,
            ),
            what=f"receiver.init of room {self.room}",
        )

    def abort(self, reason: str) -> None:
        """Fail the room and tell its prefill ranks (also before ``init()``: they refuse it then)."""
        try:
            targets, _ = self.transport.fanout_targets(self.prefill)
        except ConfigError:
            targets = ()  # not connected: no prefill rank can know the room
        self.transport._call(lambda e, now: e.abort_room(self.room, reason, now, targets=targets))

    def release_ready(self) -> bool:
        """True when no prefill rank can still write into this room's pages (or the ack wait timed out)."""
        return self.transport._query(lambda e: e.release_ready(self.room))

    def release_was_safe(self) -> bool:
        """False when the pages were released after the abort-ack timeout: a late write may still land."""
        return self.transport._query(lambda e: e.release_was_safe(self.room))

    def release_kind(self) -> ReleaseKind | None:
        """What let a failed room's pages come back (``ReleaseKind``: ACKED and CUT are proven,
        SETTLED a time bound, UNSAFE the quarantine bound); None while held, and for a room that
        succeeded (its pages were never at risk)."""
        return self.transport._query(lambda e: e.release_kind(self.room))

    def draft_skipped(self) -> DraftSkipped | None:
        """What of the draft model this room does not receive, or None when nothing is left out.

        Not None when this rank and the room's prefill ranks register different draft-model buffers
        (a rolling deployment under ``LayoutPolicy.DEGRADE_DRAFT``): the target model's bytes all
        arrive, but the draft buffers it names (``not_written``) hold nothing of this request, so the
        scheduler should decode this room without speculation. Known from WaitingForInput on (the
        ranks' registrations decide it), and read after Success."""
        return self.transport._query(lambda e: e.draft_skipped(self.room))

    def metric(self) -> KVTransferMetric:
        """The room's totals as reported by its prefill ranks (pages, bytes, slowest rank's seconds)."""
        parts = self.transport._query(lambda e: e.metric(self.room))
        return KVTransferMetric(
            room=self.room,
            pages=sum(m.pages for m in parts.values()),
            bytes=sum(m.bytes for m in parts.values()),
            seconds=max(0.0, max((m.seconds for m in parts.values()), default=0.0)),
        )

    def clear(self) -> None:
        """Forget the room once ``release_ready()``; clearing earlier is a LocalProtocolError."""
        self.transport._call(lambda e, now: _close(e, self.room, now))


def _close(endpoint: DecodeEndpoint, room: RoomId, now: float) -> list[DecodeEffect]:
    endpoint.close_room(room, now)
    return []


def _default_query() -> Query:
    """Registry queries signed with ``PDKV_AUTH_KEY`` when set (read once, here: not per retry)."""
    return functools.partial(query_registry, auth=Authenticator.from_env())


__all__ = ["DecodeConfig", "DecodeTransport", "KVReceiver", "RouteUnavailableError"]
