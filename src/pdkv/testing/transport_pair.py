"""``TransportPair``: real prefill and decode transports in one process, no ports, no sleeps.

Owns: ``MemoryHub`` (an in-memory stand-in for the control sockets: every message still goes through
the wire codec, so what a scheduler test sends is what would cross a socket), its ``MemoryChannel``,
an in-memory bootstrap registry (the same ``RouteBook`` the real one serves), and ``TransportPair``,
which wires prefill CP ranks and decode TP ranks of one model through them and a loopback engine.

What an embedder tests its scheduler against (trio's ``testing`` pattern): the transports, endpoints,
executor and per-layer path are the production ones; only the sockets and the engine are in memory.
Must not be used to measure speed, and must not be imported by the library itself.

    with TransportPair() as pair:
        prefill = pair.prefill_instance
        receiver = pair.decode.receiver(room, prefill)
        receiver.init(dst_pages, aux_row)
        sender = pair.prefills[0].sender(room)
        sender.init(len(pages), aux_row)
        ... poll both until WaitingForInput / Success, as a scheduler does
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from types import TracebackType

from pdkv.control.bootstrap import RegistryService
from pdkv.control.channel import ChannelStatistics
from pdkv.engine.loopback import LoopbackBackend, LoopbackConfig, LoopbackFabric
from pdkv.errors import RegistryError, RemoteProtocolError
from pdkv.mapping import DEFAULT_LAYOUT_POLICY, LayoutPolicy, PageInterleaved
from pdkv.protocol import codec
from pdkv.protocol.config import Timeouts
from pdkv.protocol.ids import Epoch, InstanceId
from pdkv.protocol.messages import (
    Message,
    Origin,
    RankAnnounce,
    RankCoord,
    RegisterReject,
    RouteQuery,
    RouteTable,
)
from pdkv.protocol.registry import RouteBook
from pdkv.runtime._host import new_epoch
from pdkv.runtime._loop import MessageChannel
from pdkv.runtime.channels import start_registry
from pdkv.runtime.decode import DecodeConfig, DecodeTransport
from pdkv.runtime.executor import ExecutorConfig
from pdkv.runtime.landing import LandingConfig
from pdkv.runtime.per_layer import PerLayerConfig
from pdkv.runtime.prefill import PrefillConfig, PrefillTransport
from pdkv.runtime.staging import StagingConfig, StagingPool
from pdkv.testing.faults import ChannelFaults, FaultyChannel, faulty_channel_factory
from pdkv.testing.synthetic import Capacity, ModelSpec, RankMemory

PAIR_TIMEOUTS = Timeouts(
    bootstrap=20, waiting=20, inflight=20, transfer=20, abort_ack=5, register_retry=0.2, quarantine_settle=0.5
)
"""Deadlines short enough for tests that wait on failure paths (the protocol's defaults are minutes)."""


class MemoryHub:
    """Addresses -> inboxes. ``channel(host)`` makes a channel with a fresh ``mem://`` address."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inboxes: dict[str, _Inbox] = {}
        self._next = 0

    def channel(self, host: str = "memory") -> MemoryChannel:
        with self._lock:
            self._next += 1
            address = f"mem://{host}/{self._next}"
            inbox = _Inbox()
            self._inboxes[address] = inbox
        return MemoryChannel(self, address, inbox)

    def deliver(self, to: str, frames: list[bytes]) -> bool:
        with self._lock:
            inbox = self._inboxes.get(to)
        if inbox is None:
            return False
        inbox.put(frames)
        return True

    def remove(self, address: str) -> None:
        with self._lock:
            self._inboxes.pop(address, None)


class _Inbox:
    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._frames: deque[list[bytes]] = deque()
        self._woken = False

    def put(self, frames: list[bytes]) -> None:
        with self._ready:
            self._frames.append(frames)
            self._ready.notify()

    def wake(self) -> None:
        with self._ready:
            self._woken = True
            self._ready.notify()

    def take(self, timeout_s: float | None) -> list[list[bytes]]:
        with self._ready:
            if not self._frames and not self._woken:
                self._ready.wait(timeout_s)
            self._woken = False
            taken = list(self._frames)
            self._frames.clear()
            return taken


class MemoryChannel:
    """A ``MessageChannel`` over a ``MemoryHub``: encodes on send, decodes on receive (the real codec)."""

    def __init__(self, hub: MemoryHub, address: str, inbox: _Inbox) -> None:
        self._hub = hub
        self._address = address
        self._inbox = inbox
        self._received = self._malformed = self._sent = self._dropped = 0
        self._peers: set[str] = set()

    @property
    def address(self) -> str:
        return self._address

    def send(self, to: str, message: Message) -> bool:
        delivered = self._hub.deliver(to, codec.encode(message))
        if delivered:
            self._sent += 1
            self._peers.add(to)
        else:
            self._dropped += 1
        return delivered

    def wait(self, timeout_s: float | None) -> list[Message]:
        messages: list[Message] = []
        for frames in self._inbox.take(timeout_s):
            try:
                messages.append(codec.decode(frames))
            except RemoteProtocolError:  # counted, as a socket's channel does; never raised to the loop
                self._malformed += 1
        self._received += len(messages)
        return messages

    def wake(self) -> None:
        self._inbox.wake()

    def forget(self, endpoint: str) -> bool:
        self._peers.discard(endpoint)
        return True

    def close(self, *, flush_s: float = 0.0) -> None:
        self._hub.remove(self._address)

    def statistics(self) -> ChannelStatistics:
        return ChannelStatistics(
            received=self._received,
            malformed=self._malformed,
            unauthenticated=0,
            sent=self._sent,
            dropped_sends=self._dropped,
            peers=len(self._peers),
        )


class MemoryRegistry:
    """The bootstrap registry of one prefill instance, called directly (no socket)."""

    def __init__(self, instance: InstanceId, *, tp_size: int, cp_size: int) -> None:
        self.address = f"mem-registry://{instance}"
        self._lock = threading.Lock()
        self._book = RouteBook(
            Origin(instance=instance, epoch=Epoch(new_epoch()), rank=RankCoord(tp=0)),
            tp_size=tp_size,
            cp_size=cp_size,
        )

    def announce(self, address: str, message: RankAnnounce, timeout_s: float) -> RouteTable:
        with self._lock:
            reply = self._book.handle(message)
        if not isinstance(reply, RouteTable):
            reason = reply.reason if isinstance(reply, RegisterReject) else type(reply).__name__
            raise RegistryError(f"registry {address} refused {message.origin}: {reason}")
        return reply

    def query(self, address: str, message: RouteQuery, timeout_s: float) -> RouteTable | None:
        with self._lock:
            reply = self._book.handle(message)
        if isinstance(reply, RouteTable):
            return reply
        if isinstance(reply, RegisterReject) and reply.retry:
            return None
        reason = reply.reason if isinstance(reply, RegisterReject) else type(reply).__name__
        raise RegistryError(f"registry {address} refused the query: {reason}")


class TransportPair:
    """Prefill CP ranks and decode TP ranks of one model, wired in memory; ``start()`` registers them.

    ``sockets=True`` wires them instead through real control sockets (zmq on 127.0.0.1, free ports) and
    a real bootstrap registry thread, for tests of the socket layer itself (the bytes still go through
    the loopback engine). ``decode_model`` gives the decode ranks another model (a layout mismatch, or,
    when only the draft model's buffers differ, a rolling deployment that ``prefill_policy`` and
    ``decode_policy``, the two sides' layout policies, decide on).

    ``staging``: every prefill rank's executor gathers head slices through a ``StagingPool`` of that shape
    (``staging`` lists the pools). With a model that describes KV heads, each decode rank holds its TP share
    of the heads (the one prefill TP rank holds them all), so ``decode_tp`` > 1 slices every page.

    ``prefill_tp``: prefill TP ranks (each with ``cp`` CP ranks; ``prefills`` lists them TP-major); with a
    model that describes KV heads each holds its TP share. ``landing``: the decode ranks' landing pools
    (decode TP below prefill TP).

    ``kv_checksum``: both sides compute and verify checksums per (buffer, page) (``PDKV_KV_CHECKSUM``);
    ``decode_checksum`` sets the decode ranks' switch apart (None: the same).

    ``decode_channel_faults``: the decode ranks' control channels drop, duplicate or hold back the
    messages they send as told (``pdkv.testing.faults.ChannelFaults``); ``decode_channels`` lists them,
    with their counts.

    ``prefill_memory`` / ``decode_memory`` hold each rank's tensors (``RankMemory``: the prefill side is
    filled with a recognisable pattern, ``pdkv.testing.synthetic.verify_room`` checks a room's bytes).
    Closing (or leaving the ``with`` block) closes decode ranks first, then prefill ranks, then engines.
    """

    def __init__(
        self,
        *,
        model: ModelSpec | None = None,
        cp: int = 1,
        decode_tp: int = 1,
        prefill_tp: int = 1,
        landing: LandingConfig | None = None,
        prefill_capacity: Capacity | None = None,
        decode_capacity: Capacity | None = None,
        timeouts: Timeouts = PAIR_TIMEOUTS,
        executor: ExecutorConfig | None = None,
        per_layer: PerLayerConfig | None = None,
        loopback: LoopbackConfig | None = None,
        decode_model: ModelSpec | None = None,
        prefill_instance: str = "prefill-0",
        decode_instance: str = "decode-0",
        sockets: bool = False,
        fabric: str = "pair",
        kv_checksum: bool = False,
        decode_checksum: bool | None = None,
        staging: StagingConfig | None = None,
        prefill_policy: LayoutPolicy = DEFAULT_LAYOUT_POLICY,
        decode_policy: LayoutPolicy = DEFAULT_LAYOUT_POLICY,
        decode_channel_faults: ChannelFaults | None = None,
    ) -> None:
        self.model = model if model is not None else ModelSpec(layers=3, page_size=16)
        self.prefill_instance = InstanceId(prefill_instance)
        self.decode_instance = InstanceId(decode_instance)
        self.hub = MemoryHub()
        self.fabric = LoopbackFabric(fabric)
        self.policy = PageInterleaved(cp_size=cp)
        self._registry_service: RegistryService[Message] | None = None
        factory: Callable[[str], MessageChannel] | None
        announce: Callable[[str, RankAnnounce, float], object] | None
        query: Callable[[str, RouteQuery, float], RouteTable | None] | None
        if sockets:
            self._registry_service = start_registry(
                instance=self.prefill_instance, tp_size=prefill_tp, cp_size=cp
            )
            self.registry_address = self._registry_service.address
            factory = announce = query = None  # the transports' defaults: zmq and the registry protocol
        else:
            registry = MemoryRegistry(self.prefill_instance, tp_size=prefill_tp, cp_size=cp)
            self.registry_address = registry.address
            factory, announce, query = self.hub.channel, registry.announce, registry.query
        # Writes reach a decode rank only inside the regions its Register announced (unless told
        # otherwise), so a region registered too late shows here as over NIXL.
        engine = loopback if loopback is not None else LoopbackConfig(announced_regions=True)
        self.prefill_memory: list[RankMemory] = []
        self.staging: list[StagingPool] = []  # one per prefill rank when ``staging`` is given
        self.prefill_backends: list[LoopbackBackend] = []
        self.prefills: list[PrefillTransport] = []
        heads = self.model.kv_heads is not None
        for ptp, rank in ((t, c) for t in range(prefill_tp) for c in range(cp)):
            memory = RankMemory(
                self.model,
                prefill_capacity or Capacity(kv_pages=64, state_slots=8, aux_rows=8),
                # heads described: each prefill TP rank holds its share of them
                tp_size=prefill_tp if heads else 1,
                tp_rank=ptp if heads else 0,
            )
            memory.fill_prefill(cp_rank=rank, policy=self.policy)
            backend = LoopbackBackend(engine, fabric=self.fabric)
            config = PrefillConfig(
                instance=self.prefill_instance,
                rank=RankCoord(tp=ptp, cp=rank),
                tp_size=prefill_tp,
                cp_size=cp,
                layout=memory.layout,
                registry=self.registry_address,
                timeouts=timeouts,
                executor=executor or ExecutorConfig(),
                per_layer=per_layer or PerLayerConfig(),
                kv_checksum=kv_checksum,
                layout_policy=prefill_policy,
            )
            self.prefill_memory.append(memory)
            self.prefill_backends.append(backend)
            pool = None
            if staging is not None:
                sources = [memory.tensors[(b.model, b.kind, b.layer_id)] for b in memory.layout.buffers]
                pool = StagingPool(backend, memory.layout, sources, staging)
                self.staging.append(pool)
            self.prefills.append(
                PrefillTransport(config, backend, channel_factory=factory, announce=announce, staging=pool)
            )
        self.decode_channels: list[FaultyChannel] = []  # the decode ranks' channels, with their counts
        decode_factory = (
            None
            if decode_channel_faults is None
            else faulty_channel_factory(decode_channel_faults, self.decode_channels, factory)
        )
        self.decode_memory: list[RankMemory] = []
        self.decode_backends: list[LoopbackBackend] = []
        self.decodes: list[DecodeTransport] = []
        for tp in range(decode_tp):
            decode_spec = decode_model or self.model
            memory = RankMemory(
                decode_spec,
                decode_capacity or Capacity(kv_pages=256, state_slots=8, aux_rows=8),
                # heads described: each decode rank holds its TP share of them (the prefill rank all)
                tp_size=decode_tp if decode_spec.kv_heads is not None else 1,
                tp_rank=tp if decode_spec.kv_heads is not None else 0,
            )
            # The decode's engine announces its regions in its Register, as NIXL's does.
            backend = LoopbackBackend(
                LoopbackConfig(announced_regions=engine.announced_regions), fabric=self.fabric
            )
            config_d = DecodeConfig(
                instance=self.decode_instance,
                rank=RankCoord(tp=tp),
                tp_size=decode_tp,
                layout=memory.layout,
                timeouts=timeouts,
                kv_checksum=kv_checksum if decode_checksum is None else decode_checksum,
                layout_policy=decode_policy,
                landing=landing or LandingConfig(),
            )
            self.decode_memory.append(memory)
            self.decode_backends.append(backend)
            self.decodes.append(
                DecodeTransport(config_d, backend, channel_factory=decode_factory or factory, query=query)
            )

    @property
    def decode(self) -> DecodeTransport:
        """The first decode rank (the only one unless ``decode_tp`` > 1)."""
        return self.decodes[0]

    def start(self, *, timeout_s: float = 20.0, wait_registered: bool = True) -> InstanceId:
        """Start every transport, connect the decode ranks and (``wait_registered``) wait until the
        prefill ranks acknowledged their registration; returns the prefill instance to name in
        ``receiver()``."""
        for p in self.prefills:
            p.start()
        for d in self.decodes:
            d.start()
            d.connect(self.registry_address, timeout_s=timeout_s)
        if not wait_registered:
            return self.prefill_instance
        for d in self.decodes:
            if not d.wait_registered(self.prefill_instance, timeout_s=timeout_s):
                raise RegistryError(
                    f"prefill ranks did not acknowledge decode {d.config.rank} in {timeout_s:g} s"
                )
        return self.prefill_instance

    def close(self) -> None:
        for d in self.decodes:
            d.close()
        for p in self.prefills:
            p.close()
        for pool in self.staging:
            pool.close()
        for b in [*self.prefill_backends, *self.decode_backends]:
            b.close()
        if self._registry_service is not None:
            self._registry_service.stop()

    def __enter__(self) -> TransportPair:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


__all__ = ["PAIR_TIMEOUTS", "MemoryChannel", "MemoryHub", "MemoryRegistry", "TransportPair"]
