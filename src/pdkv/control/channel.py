"""The per-rank control channel: one inbound PULL socket, cached outbound PUSH sockets, a waker.

Owns: ``ControlChannel`` (bind, send, receive, wait, forget, close), its options and statistics.
Must not know messages (the codec is injected, see ``framing``), retry anything, or block its owner
on a peer: a send that would block is dropped and counted, and the protocol above re-sends what
matters (registration retries, heartbeats, deadlines).

Threads. zmq sockets are not thread-safe (concurrent use corrupts them or aborts the process), so
each socket has one user at a time. Receiving is one thread at a time: a ``recv`` or ``wait`` holds
the channel's receive claim while it runs, and another thread's receive call meanwhile gets
``ChannelOwnershipError`` (between calls any thread may receive: a transport lends receiving to a
scheduler thread that waits for progress). Sending is serialised
instead: ``send``, ``send_many`` and ``forget`` touch only the outbound sockets, under one lock, from
any thread (a lock is the full memory barrier zmq asks for when a socket changes threads), so the
thread that produced a message can send it without a hand-off to the owner; a send never blocks, so
no thread waits on a peer. Any thread may call ``wake()`` (to end the owner's ``wait``),
``statistics()`` and ``address``. ``close()`` is any thread's, except while another thread is inside
a receive call.

Delivery. ZMQ PUSH/PULL keeps the order of messages between one sender and one receiver and delivers
whole frame sets or nothing; across senders there is no order. A message queued for a peer that is
down waits (up to the send high-water mark) and goes out when the peer comes back; ``forget()`` drops
the queue, e.g. when the protocol learns the peer restarted under a new epoch.

Bad input. Frames that fail authentication or decoding are counted, logged at WARNING with the
reason (rate-limited; a PULL socket does not know who sent them) and skipped: receiving never raises
for what a peer sent.

Several messages. ``send_many`` puts several messages to one peer in one frame set (an envelope,
``pdkv.control.envelope``): one socket call and one authentication tag for all. The receiver hands
them out one by one, in order, exactly as if they had been sent apart.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Generic

import attrs
import zmq

from pdkv.control._inbox import Inbox, Part, ReceiverClaim, SendCounts, encode_parts
from pdkv.control._sockets import (
    Waker,
    WarningLimiter,
    bind_tcp,
    deadline_after,
    expired,
    readable,
    remaining_ms,
)
from pdkv.control.auth import Authenticator
from pdkv.control.errors import ChannelClosedError
from pdkv.control.framing import M, WireCodec
from pdkv.errors import ConfigError

log = logging.getLogger(__name__)


def _at_least(minimum: int) -> Any:
    def check(_: object, attribute: attrs.Attribute[int], value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{attribute.name} must be an int >= {minimum}, got {value!r}")

    return check


@attrs.frozen(kw_only=True)
class ChannelOptions:
    """Socket limits of a channel. The defaults suit control traffic (small messages, bursts of rooms)."""

    send_hwm: int = attrs.field(default=4096, validator=_at_least(1))
    """Messages queued per destination before further sends to it are dropped."""
    recv_hwm: int = attrs.field(default=16384, validator=_at_least(1))
    """Messages queued on the inbound socket before zmq stops reading from senders (they queue instead)."""
    send_timeout_ms: int = attrs.field(default=0, validator=_at_least(0))
    """SNDTIMEO of outbound sockets. Sends are non-blocking anyway; this bounds any send that is not."""
    max_frame_bytes: int = attrs.field(default=64 << 20, validator=_at_least(1))
    """Largest inbound frame; zmq disconnects a peer that sends a larger one (bounds a hostile sender's
    memory). 64 MiB holds the destination pages of a multi-million-token request."""
    max_peers: int = attrs.field(default=1024, validator=_at_least(1))
    """Outbound sockets kept; the least recently used one is closed (its queue dropped) beyond this."""
    max_batch: int = attrs.field(default=1024, validator=_at_least(1))
    """Most messages one ``wait`` returns, so a flood cannot starve the owner's other work."""


@attrs.frozen(kw_only=True)
class ChannelStatistics:
    """Counters since the channel was opened (a snapshot; read from any thread)."""

    received: int
    """Messages decoded and returned to the owner."""
    malformed: int
    """Inbound frame sets that the codec rejected."""
    unauthenticated: int
    """Inbound frame sets without a valid, fresh tag (only with an authenticator); replays included."""
    replayed: int = 0
    """Of those, copies of a frame set already accepted within the window (a captured message replayed)."""
    sent: int
    """Messages queued for sending."""
    dropped_sends: int
    """Messages not queued: the destination's queue was full or its endpoint could not be dialled."""
    peers: int
    """Outbound sockets currently cached."""
    envelopes_sent: int = 0
    """Frame sets sent that carried several messages (``send_many``); their messages count in ``sent``."""
    envelopes_received: int = 0
    """Such frame sets received; their valid messages count in ``received``."""


class ControlChannel(Generic[M]):
    """One rank's control endpoint: ``send(to, message)`` anywhere, ``recv``/``wait`` for what arrives.

    ``ControlChannel(codec, host="127.0.0.1", port=0)`` binds at once (port 0: a free port chosen by
    the OS); ``address`` is then the ``tcp://host:port`` that peers dial. A context manager closes it.
    """

    def __init__(
        self,
        codec: WireCodec[M],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        auth: Authenticator | None = None,
        options: ChannelOptions | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self._codec = codec
        self._auth = auth
        self._options = options if options is not None else ChannelOptions()
        self._context: zmq.Context[zmq.Socket[bytes]] = (
            context if context is not None else zmq.Context.instance()
        )
        self._inbound: zmq.Socket[bytes] = self._context.socket(zmq.PULL)
        try:
            self._inbound.setsockopt(zmq.LINGER, 0)
            self._inbound.setsockopt(zmq.RCVHWM, self._options.recv_hwm)
            self._inbound.setsockopt(zmq.MAXMSGSIZE, self._options.max_frame_bytes)
            self._address = bind_tcp(self._inbound, host, port, advertise_host)
            self._waker = Waker(self._context)
        except BaseException:
            self._inbound.close(linger=0)
            raise
        self._poller = zmq.Poller()
        self._poller.register(self._inbound, zmq.POLLIN)
        self._poller.register(self._waker.socket, zmq.POLLIN)
        self._outbound: OrderedDict[str, zmq.Socket[bytes]] = OrderedDict()
        self._claim = ReceiverClaim(self._address)
        self._inbox: Inbox[M] = Inbox(codec, auth, self._address)
        self._send_lock = threading.Lock()  # the outbound sockets, their cache and the send counters
        self._closed = False
        self._send_warnings = WarningLimiter(log)  # the sending side's, under _send_lock
        self._sends = SendCounts()

    # ------------------------------------------------------------------ any thread

    @property
    def address(self) -> str:
        """``tcp://host:port`` of the inbound socket, as peers should dial it."""
        return self._address

    @property
    def closed(self) -> bool:
        return self._closed

    def wake(self) -> None:
        """End the receiving thread's current (or next) ``wait`` early. Thread-safe; a no-op after close."""
        self._waker.wake()

    def statistics(self) -> ChannelStatistics:
        return ChannelStatistics(**self._inbox.counters(self._sends, len(self._outbound)))

    # ------------------------------------------------------------------ sending (any thread)

    def send(self, to: str, message: M) -> bool:
        """Queue ``message`` for the channel at ``to``; False (counted, logged) when it was dropped.

        Never blocks: a full queue for ``to`` or an endpoint zmq cannot dial drops the message.
        True means queued here, not delivered: delivery is the protocol's business (acks, deadlines).
        An encoding error is the caller's bug and propagates. Any thread (serialised by a lock).
        """
        return self.send_many(to, [message])

    def send_many(self, to: str, messages: Sequence[M]) -> bool:
        """Queue ``messages`` for ``to`` in one frame set (in order); False (counted) when dropped.

        The same promise as ``send`` for each message; one message goes as ``send`` sends it.
        """
        self._check_open()
        parts = encode_parts(self._codec, self._auth, messages)  # outside the lock
        ok = True
        with self._send_lock:
            for part in parts:
                ok = self._send_part(to, part) and ok
        return ok

    def _send_part(self, to: str, part: Part) -> bool:
        """One frame set onto ``to``'s socket (``_send_lock`` held)."""
        if self._closed:
            raise ChannelClosedError(f"channel {self._address} is closed")
        socket = self._outbound_socket(to)
        if socket is None:
            self._sends.dropped += part.count
            return False
        try:
            socket.send_multipart(part.frames, zmq.NOBLOCK)
        except zmq.Again:
            self._sends.dropped += part.count
            if part.count == 1:
                self._send_warnings.warning("dropped a %s to %s: its send queue is full", part.what, to)
            else:
                self._send_warnings.warning(
                    "dropped %d messages to %s: its send queue is full", part.count, to
                )
            return False
        self._sends.queued(part)
        return True

    def forget(self, endpoint: str) -> bool:
        """Close the outbound socket to ``endpoint`` and drop its queue; False if there was none."""
        self._check_open()
        with self._send_lock:
            socket = self._outbound.pop(endpoint, None)
        if socket is None:
            return False
        socket.close(linger=0)
        return True

    # ------------------------------------------------------------------ receiving (one thread at a time)

    def recv(self, timeout_s: float | None) -> M | None:
        """The next valid message, waiting up to ``timeout_s`` (None: forever; 0: only what is queued).

        Bad input is counted and skipped while the time lasts. ``wake()`` does not end ``recv``; use
        ``wait`` when other threads must be able to interrupt.
        """
        self._check_open()
        with self._claim:
            return self._recv(timeout_s)

    def _recv(self, timeout_s: float | None) -> M | None:
        deadline = deadline_after(timeout_s)
        pending = self._inbox.pending
        while True:
            if pending:
                return pending.popleft()
            frames = self._next_frames()
            if frames is not None:
                self._inbox.accept(frames)
                continue
            if expired(deadline):
                return None
            self._inbound.poll(remaining_ms(deadline), zmq.POLLIN)

    def wait(self, timeout_s: float | None, *, max_messages: int | None = None) -> list[M]:
        """Block until a message arrives, ``wake()`` is called or ``timeout_s`` passes; return what is queued.

        Returns the valid messages queued by then (at most ``max_messages``, default
        ``options.max_batch``; the rest stay for the next call), which is ``[]`` after a wake with
        nothing queued or after the timeout. Bad input alone does not end the wait early (that would
        let a garbage sender spin the owner). A wake that comes while messages are returned stays
        pending and ends the next ``wait`` at once.
        """
        self._check_open()
        with self._claim:
            return self._wait(timeout_s, max_messages)

    def _wait(self, timeout_s: float | None, max_messages: int | None) -> list[M]:
        limit = self._options.max_batch if max_messages is None else max_messages
        if limit < 1:
            raise ValueError(f"max_messages must be >= 1, got {limit}")
        deadline = deadline_after(timeout_s)
        while True:
            messages = self._drain(limit)
            if messages:
                return messages
            ready = dict(self._poller.poll(remaining_ms(deadline)))
            if self._waker.socket in ready:
                self._waker.consume()
                return self._drain(limit)
            if self._inbound not in ready and expired(deadline):
                return []

    def close(self, *, flush_s: float = 0.0) -> None:
        """Close every socket; idempotent. Any thread, except while another is inside a receive call.

        By default whatever is still queued for a peer is dropped. ``flush_s`` > 0 lets zmq's I/O
        thread keep sending it for that long after ``close`` returned (``close`` itself never
        blocks): a rank that shuts down after its last statuses and acks should pass a second or so.
        """
        if self._closed:
            return
        self._claim.check_close()
        if not 0 <= flush_s < math.inf:
            raise ValueError(f"flush_s must be a finite number >= 0, got {flush_s!r}")
        with self._send_lock:  # a send under way on another thread ends first; later ones raise
            self._closed = True
            for socket in self._outbound.values():
                socket.close(linger=round(flush_s * 1000))
            self._outbound.clear()
        self._poller.unregister(self._inbound)
        self._poller.unregister(self._waker.socket)
        self._waker.close()
        self._inbound.close(linger=0)

    def __enter__(self) -> ControlChannel[M]:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<ControlChannel {self._address} {state}, {len(self._outbound)} peers>"

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise ChannelClosedError(f"channel {self._address} is closed")

    def _next_frames(self) -> list[bytes] | None:
        """One frame set off the inbound socket, or None when none is queued."""
        if not readable(self._inbound):
            return None
        try:
            return self._inbound.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:  # not expected after readable() on the owner's thread; harmless if it comes
            return None

    def _drain(self, limit: int) -> list[M]:
        """Up to ``limit`` valid messages from what is queued now, without blocking (an envelope's
        messages beyond the limit wait in the inbox for the next call)."""
        inbox = self._inbox
        while len(inbox.pending) < limit:
            frames = self._next_frames()
            if frames is None:
                break
            inbox.accept(frames)
        return inbox.take(limit)

    def _outbound_socket(self, endpoint: str) -> zmq.Socket[bytes] | None:
        socket = self._outbound.get(endpoint)
        if socket is not None:
            self._outbound.move_to_end(endpoint)
            return socket
        socket = self._context.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, self._options.send_hwm)
        socket.setsockopt(zmq.SNDTIMEO, self._options.send_timeout_ms)
        if ":" in endpoint.removeprefix("tcp://").rsplit(":", 1)[0]:
            socket.setsockopt(zmq.IPV6, 1)  # an IPv6 literal such as tcp://[::1]:5555
        try:
            socket.connect(endpoint)
        except zmq.ZMQError as exc:
            # The endpoint usually came from a peer's message: a bad one is the peer's problem and
            # must not take the owner's loop down.
            socket.close(linger=0)
            self._send_warnings.warning("cannot dial control endpoint %r: %s", endpoint, exc)
            return None
        self._outbound[endpoint] = socket
        if len(self._outbound) > self._options.max_peers:
            evicted, old = self._outbound.popitem(last=False)
            old.close(linger=0)
            log.info("closed the least recently used control socket, to %s (peer limit)", evicted)
        return socket
