"""``DecodeTransport`` and ``KVReceiver``: the decode rank's side of pdkv, as a scheduler embeds it.

Owns: the control thread and the lock around one decode rank's sans-IO ``DecodeEndpoint``; the
route tables of the prefill instances it receives from; the TP fan-out of each room (which prefill
ranks it asks, which are dummies, how many statuses it waits for: ``pdkv.mapping.decode_fanout``).
The decode side moves no bytes itself: prefill ranks write into its registered buffers. Its job is
to say where (TransferRequest), to know when the bytes are complete (every required status), and
to say when pages are safe to reuse (``release_ready``: after every AbortAck, or the counted timeout).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import attrs
import numpy as np

from pdkv.control.channel import ChannelStatistics
from pdkv.engine.backend import Registration, TransferBackend
from pdkv.errors import ConfigError, PdkvError
from pdkv.mapping import BufferLayout, Topology, decode_fanout
from pdkv.metrics import TransportMetricsSnapshot
from pdkv.protocol.config import Timeouts
from pdkv.protocol.decode import DecodeEndpoint, DecodeStatistics
from pdkv.protocol.effects import (
    Effect,
    ReleasePages,
    RoomFinished,
    Send,
    SubmitChunk,
    Target,
)
from pdkv.protocol.ids import Endpoint, Epoch, InstanceId, RoomId, SessionId
from pdkv.protocol.messages import (
    IntArray,
    Origin,
    RankCoord,
    RouteQuery,
    RouteTable,
    StateIndices,
    TransferMetricData,
)
from pdkv.protocol.poll import KVPoll
from pdkv.runtime._host import EndpointHost, RoomHandle
from pdkv.runtime.prefill import ChannelFactory, _default_channel_factory, _peer_name, new_epoch

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class RouteUnavailableError(PdkvError):
    """The bootstrap registry did not answer, or its route table is incomplete or incompatible."""


@attrs.frozen(kw_only=True)
class DecodeConfig:
    """One decode rank (decode CP is 1: every decode rank holds whole requests)."""

    instance: InstanceId
    rank: RankCoord
    tp_size: int = attrs.field(validator=attrs.validators.ge(1))
    layout: BufferLayout
    host: str = "127.0.0.1"
    timeouts: Timeouts = attrs.field(factory=Timeouts.from_env)
    epoch: Epoch = attrs.field(factory=new_epoch)
    register_memory: bool = True

    def __attrs_post_init__(self) -> None:
        if self.rank.tp >= self.tp_size or self.rank.cp != 0:
            raise ConfigError(f"decode rank {self.rank} outside tp_size {self.tp_size} (decode cp must be 0)")

    @property
    def origin(self) -> Origin:
        return Origin(instance=self.instance, epoch=self.epoch, rank=self.rank)


@attrs.frozen(kw_only=True)
class DecodeTransportStatistics:
    """Protocol counters, what prefill ranks reported writing (per peer latency), and the sockets."""

    endpoint: DecodeStatistics
    metrics: TransportMetricsSnapshot
    channel: ChannelStatistics
    rooms_released: int
    unsafe_releases: int


Query = Callable[[str, RouteQuery, float], RouteTable | None]


class DecodeTransport(EndpointHost[DecodeEndpoint]):
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
        factory = channel_factory if channel_factory is not None else _default_channel_factory()
        channel = factory(config.host)
        endpoint = DecodeEndpoint(
            origin=config.origin,
            tp_size=config.tp_size,
            endpoint=Endpoint(channel.address),
            session=SessionId(backend.session_id),
            layout=config.layout,
            timeouts=config.timeouts,
        )
        super().__init__(endpoint, channel, thread_name=f"pdkv-decode-{config.rank}", logger=log, clock=clock)
        self._query_route = query if query is not None else _default_query()
        self._routes: dict[InstanceId, RouteTable] = {}
        self._registrations: list[Registration] = []
        self._released = 0
        self._unsafe = 0
        self._started = False
        self._closed = False

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        if self.config.register_memory:
            for spec in self.config.layout.buffers:
                self._registrations.append(self.backend.register_range(spec.base_ptr, spec.length))
        self._loop.start()

    def connect(self, registry: str, *, timeout_s: float = 60.0) -> InstanceId:
        """Fetch the route table of the prefill instance behind ``registry`` and register with its ranks.

        Blocks until the table is complete (every prefill rank announced) or ``timeout_s`` passed:
        call it at start-up, not on the scheduler's hot path. Returns the prefill instance id that
        ``KVReceiver.init`` names.
        """
        deadline = self._clock() + timeout_s
        query = RouteQuery(origin=self.config.origin)
        while True:
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise RouteUnavailableError(f"no complete route table from {registry} within {timeout_s:g} s")
            table = self._query_route(registry, query, min(remaining, 5.0))
            if table is not None and table.complete:
                break
            time.sleep(min(0.05, max(0.0, remaining)))
        if table.page_size != self.config.layout.page_size:
            raise RouteUnavailableError(
                f"page size differs: prefill {table.page_size}, decode {self.config.layout.page_size}"
            )
        if table.layout_digest != self.config.layout.digest():
            log.warning("layout digest of %s differs from ours; prefill ranks will say how", registry)
        instance = table.origin.instance
        with self._lock:
            self._routes[instance] = table
            self._apply(self._endpoint.connect(table, self._clock()))
        return instance

    def wait_registered(self, instance: InstanceId, *, timeout_s: float = 30.0) -> bool:
        """True once every prefill rank of ``instance`` acknowledged registration (False on timeout)."""
        deadline = self._clock() + timeout_s
        while self._clock() < deadline:
            with self._lock:
                table = self._routes[instance]
                ready = all(
                    self._endpoint.peer_ready(Target(instance=instance, rank=route.rank))
                    for route in table.ranks
                )
            if ready:
                return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.stop()
        for registration in self._registrations:
            registration.close()
        self._registrations.clear()

    def __enter__(self) -> DecodeTransport:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def receiver(self, room: RoomId, prefill: InstanceId) -> KVReceiver:
        return KVReceiver(self, room, prefill)

    def statistics(self) -> DecodeTransportStatistics:
        with self._lock:
            endpoint = self._endpoint.statistics()
        return DecodeTransportStatistics(
            endpoint=endpoint,
            metrics=self.metrics.snapshot(),
            channel=self._loop.channel.statistics(),
            rooms_released=self._released,
            unsafe_releases=self._unsafe,
        )

    def fanout_targets(self, prefill: InstanceId) -> tuple[list[Target], int]:
        """The prefill ranks a room from ``prefill`` is requested from, and their required_dst_info_num."""
        table = self._routes.get(prefill)
        if table is None:
            raise ConfigError(f"prefill instance {prefill!r} is not connected (call connect(registry) first)")
        topology = Topology(
            prefill_tp=table.tp_size,
            decode_tp=self.config.tp_size,
            prefill_cp=table.cp_size,
            attention=self.config.layout.attention,
        )
        fan = decode_fanout(topology, self.config.rank.tp)
        targets = [
            Target(instance=prefill, rank=RankCoord(tp=t.tp, cp=t.cp), dummy=t.dummy) for t in fan.targets
        ]
        # Every prefill rank of one room waits for the same number of decode requests.
        ratio = topology.ratio if topology.decode_tp > topology.prefill_tp else 1
        return targets, ratio

    # ------------------------------------------------------------------ internals

    def _apply_effect(self, effect: Effect) -> None:
        if isinstance(effect, Send):
            self._loop.post(effect.to, effect.message)
        elif isinstance(effect, ReleasePages):
            self._released += 1
            if not effect.safe:
                self._unsafe += 1
                log.warning("room %s: pages released UNSAFELY: %s", effect.room, effect.reason)
        elif isinstance(effect, RoomFinished):
            if effect.poll is KVPoll.Success:
                log.debug("room %s succeeded on decode %s", effect.room, self.config.rank)
                for (instance, rank), data in self._endpoint.metric(effect.room).items():
                    self._accounting.reported(effect.room, _peer_name(instance, rank), data)
        elif isinstance(effect, SubmitChunk):  # prefill-side effect; a decode endpoint never emits it
            raise AssertionError(f"decode endpoint emitted {effect}")


class KVReceiver(RoomHandle[DecodeEndpoint]):
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
    ) -> None:
        """Where the room's bytes go: one destination page per position, an aux row, state slots."""
        targets, required = self.transport.fanout_targets(self.prefill)
        pages = np.asarray(dst_pages)
        self.transport._call(
            lambda e, now: e.open_room(
                self.room,
                targets=targets,
                dst_pages=pages,
                dst_aux_row=aux_row,
                dst_state=state_indices,
                required_dst_info_num=required,
                now=now,
            )
        )

    def release_ready(self) -> bool:
        """True when no prefill rank can still write into this room's pages (or the ack wait timed out)."""
        return self.transport._query(lambda e: e.release_ready(self.room))

    def release_was_safe(self) -> bool:
        """False when the pages were released after the abort-ack timeout: a late write may still land."""
        return self.transport._query(lambda e: e.release_was_safe(self.room))

    def metric(self) -> TransferMetricData:
        """The room's totals as reported by its prefill ranks (pages, bytes, slowest rank's seconds)."""
        parts = self.transport._query(lambda e: e.metric(self.room))
        return TransferMetricData(
            pages=sum(m.pages for m in parts.values()),
            bytes=sum(m.bytes for m in parts.values()),
            seconds=max((m.seconds for m in parts.values()), default=0.0),
        )

    def clear(self) -> None:
        """Forget the room once ``release_ready()``; clearing earlier is a LocalProtocolError."""
        self.transport._call(lambda e, now: _close(e, self.room))


def _close(endpoint: DecodeEndpoint, room: RoomId) -> list[Effect]:
    endpoint.close_room(room)
    return []


def _default_query() -> Query:
    from pdkv.runtime.channels import query_registry

    return query_registry


__all__ = ["DecodeConfig", "DecodeTransport", "KVReceiver", "RouteUnavailableError"]
