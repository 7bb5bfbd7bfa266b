"""Fault injection for real processes: a control channel and a transfer backend that misbehave on purpose.

Owns: ``ChannelFaults`` / ``FaultyChannel`` (wrap a rank's real control channel: drop, duplicate or
delay chosen outbound message types, a bounded number of times), ``BackendFaults`` /
``FaultyBackend`` (wrap a real ``TransferBackend``: fail the Nth submitted batch, or hold every
batch for a while before it reaches the engine), ``RankFaults`` (which rank gets which faults; a
``ClusterSpec`` carries them into the rank processes, so they are plain picklable records), and the
frame-level attacks (``garbage_frames``: random bytes, truncated and wrong-version frames, sent to a
rank's control socket or to the bootstrap registry through ``pdkv.control``; ``stale_heartbeat``: a
message from an incarnation that no longer exists).

Must not: change what the wrapped objects do for anything not matched by a rule (the wrappers are
transparent otherwise), or import zmq (``pdkv.control`` owns the sockets).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import random
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import TypeVar

import attrs

from pdkv.control.bootstrap import request
from pdkv.control.channel import ChannelStatistics, ControlChannel
from pdkv.control.framing import WireCodec
from pdkv.control.stream import StreamChannel
from pdkv.engine.backend import (
    BackendStatistics,
    BatchHandle,
    BatchOutcome,
    BatchStatus,
    EngineVerdict,
    Registration,
    TransferBackend,
    WaitResult,
)
from pdkv.errors import PdkvError, RemoteProtocolError
from pdkv.mapping.blocks import TransferBlocks
from pdkv.mapping.layout import TensorLike
from pdkv.protocol import codec
from pdkv.protocol.ids import Epoch, InstanceId
from pdkv.protocol.messages import Heartbeat, Message, Origin, RankCoord
from pdkv.runtime._loop import ChannelFactory, MessageChannel

T = TypeVar("T")

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------ records


@attrs.frozen(kw_only=True)
class MessageRule:
    """Matches outbound messages of type ``message`` (class name, e.g. ``"AbortAck"``), ``times`` times
    (0: every time), after skipping the first ``skip`` matches."""

    message: str
    times: int = 0
    skip: int = 0


@attrs.frozen(kw_only=True)
class ChannelFaults:
    drop: tuple[MessageRule, ...] = ()
    duplicate: tuple[MessageRule, ...] = ()
    delay: tuple[MessageRule, ...] = ()
    delay_s: float = 0.0
    """How long a message matched by ``delay`` is held before it is sent (in send order with later ones)."""

    @property
    def empty(self) -> bool:
        return not (self.drop or self.duplicate or self.delay)


@attrs.frozen(kw_only=True)
class BackendFaults:
    fail_batch: int | None = None
    """The Nth batch submitted (1-based) ends FAILED without reaching the engine."""
    fail_every: bool = False
    """With ``fail_batch``: every batch from the Nth on fails (an engine that broke for good)."""
    hold_s: float = 0.0
    """Every batch is held this long before it reaches the engine (a slow link: the bytes land late)."""

    @property
    def empty(self) -> bool:
        return self.fail_batch is None and not self.hold_s


@attrs.frozen(kw_only=True)
class RankFaults:
    """Faults of one rank: ``side`` is ``"prefill"`` or ``"decode"``; ``tp``/``cp`` name the rank."""

    side: str
    tp: int = 0
    cp: int = 0
    channel: ChannelFaults = attrs.Factory(ChannelFaults)
    backend: BackendFaults = attrs.Factory(BackendFaults)

    def applies_to(self, side: str, tp: int, cp: int) -> bool:
        return (self.side, self.tp, self.cp) == (side, tp, cp)


@attrs.frozen(kw_only=True)
class FaultCounts:
    """What a faulty wrapper did (reported by the rank at shutdown)."""

    dropped: int = 0
    duplicated: int = 0
    delayed: int = 0
    failed_batches: int = 0
    held_batches: int = 0


class FaultInjectionError(PdkvError):
    """A fault helper could not do what it was asked (e.g. a frame set could not be delivered)."""


# ------------------------------------------------------------------------------------ channel


class _RuleCounter:
    def __init__(self, rules: Sequence[MessageRule]) -> None:
        self._rules = list(rules)
        self._seen = [0] * len(self._rules)

    def match(self, message: Message) -> bool:
        name = type(message).__name__
        for i, rule in enumerate(self._rules):
            if rule.message != name:
                continue
            self._seen[i] += 1
            n = self._seen[i] - rule.skip
            if n >= 1 and (rule.times == 0 or n <= rule.times):
                return True
        return False


class FaultyChannel:
    """A ``MessageChannel`` that forwards to ``inner`` except where ``faults`` say otherwise.

    Delayed messages wait in this wrapper and go out from a later ``send`` or ``wait`` of the owner
    thread (the only thread that may touch the inner channel's sockets).
    """

    def __init__(self, inner: MessageChannel, faults: ChannelFaults) -> None:
        self._inner = inner
        self._faults = faults
        self._drop = _RuleCounter(faults.drop)
        self._duplicate = _RuleCounter(faults.duplicate)
        self._delay = _RuleCounter(faults.delay)
        self._held: list[tuple[float, str, Message]] = []
        self._lock = threading.Lock()
        self.dropped = 0
        self.duplicated = 0
        self.delayed = 0

    @property
    def address(self) -> str:
        return self._inner.address

    def counts(self) -> FaultCounts:
        return FaultCounts(dropped=self.dropped, duplicated=self.duplicated, delayed=self.delayed)

    def send(self, to: str, message: Message) -> object:
        self._release_due()
        with self._lock:
            if self._drop.match(message):
                self.dropped += 1
                log.warning("fault: dropped %s to %s", type(message).__name__, to)
                return True
            if self._delay.match(message):
                self.delayed += 1
                self._held.append((time.monotonic() + self._faults.delay_s, to, message))
                return True
            twice = self._duplicate.match(message)
        result = self._inner.send(to, message)
        if twice:
            self.duplicated += 1
            self._inner.send(to, message)
        return result

    def wait(self, timeout_s: float | None) -> list[Message]:
        self._release_due()
        if self._held:
            # Wake up in time to send what is held.
            soonest = max(0.0, min(due for due, _, _ in self._held) - time.monotonic())
            timeout_s = soonest if timeout_s is None else min(timeout_s, soonest)
        return self._inner.wait(timeout_s)

    def wake(self) -> None:
        self._inner.wake()

    def forget(self, endpoint: str) -> object:
        return self._inner.forget(endpoint)

    def close(self, *, flush_s: float = 0.0) -> None:
        self._inner.close(flush_s=flush_s)

    def statistics(self) -> ChannelStatistics:
        return self._inner.statistics()

    def _release_due(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [h for h in self._held if h[0] <= now]
            self._held = [h for h in self._held if h[0] > now]
        for _, to, message in due:
            self._inner.send(to, message)


def faulty_channel_factory(
    faults: ChannelFaults, made: list[FaultyChannel], inner: ChannelFactory | None = None
) -> ChannelFactory:
    """A channel factory whose channels are ``FaultyChannel``s over ``inner`` (default: the
    transports' own, ``control_channel_factory()``); each channel made is appended to ``made`` so its
    counts can be read later."""
    if inner is None:
        from pdkv.runtime.channels import control_channel_factory

        inner = control_channel_factory()
    base = inner

    def make(host: str) -> MessageChannel:
        channel = FaultyChannel(base(host), faults)
        made.append(channel)
        return channel

    return make


def fixed_port_channel_factory(port: int) -> ChannelFactory:
    """The transports' channel bound on ``port``: a restarted process comes back behind the same
    address."""
    from pdkv.runtime.channels import control_channel_factory

    return control_channel_factory(port=port)


# ------------------------------------------------------------------------------------ backend


class FaultyBackend:
    """A ``TransferBackend`` that forwards to ``inner`` except the batches ``faults`` pick."""

    def __init__(self, inner: TransferBackend, faults: BackendFaults) -> None:
        self._inner = inner
        self._faults = faults
        self._lock = threading.Lock()
        self._submitted = 0
        self._own: set[int] = set()  # id() of handles made here (failed without reaching the engine)
        self.failed_batches = 0
        self.held_batches = 0

    def counts(self) -> FaultCounts:
        return FaultCounts(failed_batches=self.failed_batches, held_batches=self.held_batches)

    @property
    def session_id(self) -> str:
        return self._inner.session_id

    @property
    def max_entries_in_flight(self) -> int:
        return self._inner.max_entries_in_flight

    @property
    def engine_metadata(self) -> bytes:
        return self._inner.engine_metadata

    def add_peer(self, session: str, metadata: bytes) -> None:
        self._inner.add_peer(session, metadata)

    def register(self, memory: TensorLike) -> Registration:
        return self._inner.register(memory)

    def register_range(self, address: int, length: int, *, keepalive: object = None) -> Registration:
        return self._inner.register_range(address, length, keepalive=keepalive)

    def unregister(self, registration: Registration) -> None:
        self._inner.unregister(registration)

    def submit_write(self, peer: str, batch: TransferBlocks) -> BatchHandle:
        with self._lock:
            self._submitted += 1
            n = self._submitted
        fail = self._faults.fail_batch
        if fail is not None and (n == fail or (self._faults.fail_every and n > fail)):
            self.failed_batches += 1
            verdict: Future[EngineVerdict] = Future()
            verdict.set_result(
                EngineVerdict(
                    status=BatchStatus.FAILED,
                    reason=f"injected failure of batch {n}",
                    finished_at=time.monotonic(),
                )
            )
            handle = BatchHandle(
                serial=n,
                peer=peer,
                entries=len(batch),
                total_bytes=int(batch.length.sum()),
                submitted_at=time.monotonic(),
                owner=self,
                verdict=verdict,
            )
            with self._lock:
                self._own.add(id(handle))
            return handle
        if self._faults.hold_s:
            # The worker that submits is the one that waits: holding it here is a slow engine.
            self.held_batches += 1
            time.sleep(self._faults.hold_s)
        return self._inner.submit_write(peer, batch)

    def wait(self, handles: Sequence[BatchHandle], timeout: float | None = None) -> WaitResult:
        with self._lock:
            mine = [id(h) in self._own for h in handles]
        theirs = [h for h, own in zip(handles, mine, strict=True) if not own]
        inner = iter(self._inner.wait(theirs, timeout).outcomes if theirs else ())
        outcomes = []
        for handle, own in zip(handles, mine, strict=True):
            if own:
                verdict = handle.verdict_future.result()
                seconds = max(0.0, verdict.finished_at - handle.submitted_at)
                outcomes.append(BatchOutcome(handle, verdict.status, verdict.reason, seconds))
            else:
                outcomes.append(next(inner))
        return WaitResult(tuple(outcomes))

    def write_outcome(
        self, peer: str, batch: TransferBlocks, *, timeout: float | None = None
    ) -> BatchOutcome:
        """Through this wrapper's own submit and wait, so that its faults apply."""
        return self.wait([self.submit_write(peer, batch)], timeout).outcomes[0]

    def write(self, peer: str, batch: TransferBlocks, *, timeout: float | None = None) -> BatchOutcome:
        outcome = self.write_outcome(peer, batch, timeout=timeout)
        WaitResult((outcome,)).raise_for_status()
        return outcome

    def statistics(self) -> BackendStatistics:
        return self._inner.statistics()

    def close(self) -> None:
        self._inner.close()

    def __enter__(self) -> FaultyBackend:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------ frames


def garbage_frames(seed: int = 0) -> list[list[bytes]]:
    """Frame sets no valid peer sends: random bytes, a truncated valid message, a wrong version,
    a bad magic, an empty frame, a valid header with missing frames."""
    rng = random.Random(seed)
    valid = codec.encode(
        Heartbeat(origin=Origin(instance=InstanceId("intruder"), epoch=Epoch(1), rank=RankCoord(tp=0)), seq=1)
    )
    header = valid[0]
    wrong_version = header[:4] + (codec.PROTOCOL_VERSION + 7).to_bytes(2, "little") + header[6:]
    return [
        [rng.randbytes(37)],
        [rng.randbytes(10), rng.randbytes(200)],
        [valid[0], valid[1][: len(valid[1]) // 2]],  # truncated payload
        [valid[0][:5]],  # truncated header
        [wrong_version, *valid[1:]],
        [b"XXXX" + header[4:], *valid[1:]],  # bad magic
        [b""],
        [valid[0]],  # header without its payload frame
    ]


def _raw_codec(frames: list[bytes]) -> WireCodec[object]:
    def encode(_: object) -> list[bytes]:
        return frames

    def decode(_: Sequence[bytes]) -> object:
        raise RemoteProtocolError("no reply is expected to garbage")

    return WireCodec(encode=encode, decode=decode, decode_error=RemoteProtocolError)


def _peer_channel(codec: WireCodec[T]) -> ControlChannel[T] | StreamChannel[T]:
    """A channel of the kind the ranks use (``PDKV_CONTROL_CHANNEL``), to talk to them as a peer."""
    from pdkv.runtime.channels import channel_kind

    if channel_kind() == "zmq":
        return ControlChannel(codec, host="127.0.0.1")
    return StreamChannel(codec, host="127.0.0.1")


def _close_flushed(channel: ControlChannel[T] | StreamChannel[T]) -> None:
    channel.close(flush_s=1.0)
    if isinstance(channel, StreamChannel):
        channel.wait_closed(2.0)  # zmq's context keeps flushing after close; this one is joined


def send_frames(address: str, frame_sets: Sequence[list[bytes]]) -> None:
    """Push each frame set to a rank's control socket at ``address`` (as a peer channel would)."""
    for frames in frame_sets:
        channel = _peer_channel(_raw_codec(frames))
        try:
            if not channel.send(address, object()):
                raise FaultInjectionError(f"could not queue garbage for {address}")
        finally:
            _close_flushed(channel)


def send_frames_to_registry(address: str, frame_sets: Sequence[list[bytes]]) -> None:
    """Send each frame set to the bootstrap registry as a request; no reply is expected (it counts them)."""
    for frames in frame_sets:
        # A timeout is the expected answer: the registry skips what it cannot decode.
        with contextlib.suppress(PdkvError):
            request(address, object(), codec=_raw_codec(frames), timeout_s=0.2, attempts=1)


def send_messages(address: str, messages: Sequence[Message]) -> None:
    """Send valid pdkv messages to a rank's control socket (forged or replayed ones, e.g. an old epoch)."""
    from pdkv.runtime.channels import CODEC

    channel = _peer_channel(CODEC)
    try:
        for message in messages:
            if not channel.send(address, message):
                raise FaultInjectionError(f"could not queue {type(message).__name__} for {address}")
    finally:
        _close_flushed(channel)


def stale_heartbeat(instance: str, rank: RankCoord, seq: int = 1) -> Heartbeat:
    """A heartbeat from an incarnation of ``instance`` that can no longer exist (epoch 1)."""
    return Heartbeat(origin=Origin(instance=InstanceId(instance), epoch=Epoch(1), rank=rank), seq=seq)


def wrap_for_rank(
    faults: Sequence[RankFaults], side: str, tp: int, cp: int
) -> tuple[ChannelFaults | None, BackendFaults | None]:
    """The channel and backend faults that apply to one rank (None where none do)."""
    for item in faults:
        if item.applies_to(side, tp, cp):
            return (
                None if item.channel.empty else item.channel,
                None if item.backend.empty else item.backend,
            )
    return None, None


__all__ = [
    "BackendFaults",
    "ChannelFaults",
    "FaultCounts",
    "FaultInjectionError",
    "FaultyBackend",
    "FaultyChannel",
    "MessageRule",
    "RankFaults",
    "faulty_channel_factory",
    "fixed_port_channel_factory",
    "garbage_frames",
    "send_frames",
    "send_frames_to_registry",
    "send_messages",
    "stale_heartbeat",
    "wrap_for_rank",
]


# --------------------------------------------------------------------------- network namespaces

_CLONE_NEWNET = 0x40000000


@attrs.frozen(kw_only=True)
class NetnsLayout:
    """Two network namespaces joined by a veth pair: prefill ranks (and the registry) in one, decode in
    the other. Addresses exist only inside these namespaces, which the test itself created."""

    prefill_ns: str
    prefill_ip: str
    prefill_link: str
    decode_ns: str
    decode_ip: str
    decode_link: str

    def partition(self) -> None:
        """Cut the link between the two sides (both ends down)."""
        _ip("-n", self.decode_ns, "link", "set", "dev", self.decode_link, "down")
        _ip("-n", self.prefill_ns, "link", "set", "dev", self.prefill_link, "down")

    def heal(self) -> None:
        _ip("-n", self.decode_ns, "link", "set", "dev", self.decode_link, "up")
        _ip("-n", self.prefill_ns, "link", "set", "dev", self.prefill_link, "up")


def _ip(*args: str) -> None:
    import subprocess

    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def netns_unavailable() -> str | None:
    """Why namespaces cannot be made here (not root, no ``ip``), or None when they can."""
    import os
    import shutil

    if shutil.which("ip") is None:
        return "the ip command (Debian iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    return None


@contextlib.contextmanager
def veth_namespaces(tag: str, subnet: int = 231) -> Iterator[NetnsLayout]:
    """Create two namespaces and a veth pair (10.<subnet>.<n>.1 decode, .2 prefill); remove them on exit."""
    n = random.randrange(1, 250)
    # Names unique per use: a namespace of an earlier run still being torn down never collides.
    unique = f"{tag[:6]}{random.randrange(16**4):04x}"
    layout = NetnsLayout(
        prefill_ns=f"pdkv-{unique}-p",
        prefill_ip=f"10.{subnet}.{n}.2",
        prefill_link=f"pk{unique}p",
        decode_ns=f"pdkv-{unique}-d",
        decode_ip=f"10.{subnet}.{n}.1",
        decode_link=f"pk{unique}d",
    )
    try:
        for ns in (layout.prefill_ns, layout.decode_ns):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "dev", "lo", "up")
        _ip("link", "add", layout.decode_link, "type", "veth", "peer", "name", layout.prefill_link)
        _ip("link", "set", layout.decode_link, "netns", layout.decode_ns)
        _ip("link", "set", layout.prefill_link, "netns", layout.prefill_ns)
        _ip("-n", layout.decode_ns, "addr", "add", f"{layout.decode_ip}/24", "dev", layout.decode_link)
        _ip("-n", layout.prefill_ns, "addr", "add", f"{layout.prefill_ip}/24", "dev", layout.prefill_link)
        layout.heal()
        yield layout
    finally:
        for ns in (layout.prefill_ns, layout.decode_ns):
            with contextlib.suppress(Exception):
                _ip("netns", "del", ns)  # deleting a namespace also deletes its end of the veth pair


def enter_netns(name: str) -> None:
    """Move the calling thread (call it first thing in a fresh process) into network namespace ``name``.

    Threads and sockets created afterwards (zmq's, the engine's) live there too.
    """
    import os

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into network namespace {name!r} failed: {os.strerror(errno)}")
    finally:
        os.close(fd)
    _remount_sysfs(libc)


_CLONE_NEWNS = 0x00020000
_MS_REC, _MS_SLAVE, _MNT_DETACH = 0x4000, 0x80000, 2


def _remount_sysfs(libc: ctypes.CDLL) -> None:
    """Give this process a /sys of its new network namespace, as ``ip netns exec`` does (UCX finds
    its network devices in /sys/class/net; the host's /sys lists the host's devices). Best effort: a
    process that cannot (no CAP_SYS_ADMIN) keeps the host's /sys, which only NIXL ranks miss."""
    if libc.unshare(_CLONE_NEWNS) != 0:
        return
    libc.mount(None, b"/", None, _MS_REC | _MS_SLAVE, None)  # our mounts stay ours
    libc.umount2(b"/sys", _MNT_DETACH)
    libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None)
