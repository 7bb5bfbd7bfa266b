"""The per-rank control channel over plain TCP: the thread that has a message writes it to the kernel.

Owns: ``StreamChannel`` (the same surface and promises as ``ControlChannel``: bind, send, receive,
wait, forget, close, statistics), its wire framing (below) and its connection upkeep thread. Must not
know messages (the codec is injected) nor retry anything the protocol re-sends.

Why a second channel: zmq moves every message through its I/O thread on both sides, so a status
crosses three threads between the worker that saw its write complete and the decode's control thread
(worker -> zmq I/O thread -> TCP -> peer's zmq I/O thread -> its owner). Here the sending thread
writes the frame set into the connection's kernel buffer and the receiving owner reads it from the
socket it polls: one crossing. On this path a message costs one ``send`` and one ``recv`` system call.

Threads. Sending, from any thread, is serialised by one lock: when the connection to the peer is up
and nothing is queued before it, the sender writes the frame set itself, non-blocking. Whatever
cannot go at once (the connection is still being made, the kernel buffer is full, the peer is down)
is queued, in order, for the channel's upkeep thread ("pdkv-stream-upkeep"), which connects,
flushes, notices a connection the peer closed and reconnects every ``_RECONNECT_S`` while messages
wait. A host name's addresses are dialled in ``getaddrinfo``'s order, the next at once when one
fails (a name that gives ::1 first for a peer that listens on IPv4 only); the interval is waited
once they all have. The upkeep thread is the only one that opens or closes an outbound socket, so
a descriptor number it polls is never reused under it. Receiving is one thread at a time, as for
``ControlChannel`` (a receive call holds the inbound sockets and the listener while it runs); ``wake()``,
``statistics()`` and ``address`` are any thread's.

Delivery: as ``ControlChannel``'s. Frame sets from one sender arrive whole and in order; a queue for
a peer that is down waits (up to ``send_hwm`` messages, then sends are dropped and counted) and goes
out when it is back; the frame set being written when a connection broke, and what the kernel had
not delivered yet, are lost with it (the protocol's acks and deadlines cover that, as with zmq).
``forget()`` drops a peer's queue and connection. ``close(flush_s=...)`` lets the upkeep thread go on
writing what is queued for that long, after ``close`` returned.

Wire (normative, with ``specs/protocol.md`` section 8). A connection starts with an 8-byte greeting
from the dialling side, ``b"PDKVS"``, stream version u16 little-endian (1), one zero byte; then frame
sets, each ``u32 n`` (1 <= n <= ``MAX_FRAMES``) followed by n times ``u32 length`` + that many bytes
(length <= ``max_frame_bytes``), all little-endian. The frames are what zmq would carry (the codec's,
an envelope's, an authentication tag). A greeting that is not this one (a zmq peer's starts with
0xFF), a frame count or length out of range closes that connection, counted as one malformed frame
set and logged (rate-limited); the frame sets before it on that connection were delivered.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import select
import socket
import struct
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Final, Generic, TypeAlias

from pdkv.config import tcp_address_problem
from pdkv.control._inbox import Inbox, Part, ReceiverClaim, SendCounts, encode_parts
from pdkv.control._sockets import (
    BIND_RETRY_S,
    WILDCARD_HOSTS,
    WarningLimiter,
    bracketed,
    check_bind,
    deadline_after,
    expired,
)
from pdkv.control.auth import Authenticator
from pdkv.control.channel import ChannelOptions, ChannelStatistics
from pdkv.control.errors import ChannelClosedError, ControlBindError
from pdkv.control.framing import M, WireCodec

log = logging.getLogger(__name__)

GREETING: Final = b"PDKVS" + struct.pack("<H", 1) + b"\x00"
MAX_FRAMES: Final = 1 << 17
_U32: Final = struct.Struct("<I")
_READ_BYTES: Final = 256 << 10  # one recv per readable connection per pass
_RECONNECT_S: Final = 0.1  # zmq's default reconnect interval
_BACKLOG: Final = 512
_IDLE_S: Final = 1.0  # the upkeep thread's longest sleep with nothing to do
_IN: Final = select.POLLIN | select.POLLPRI
_OUT: Final = select.POLLOUT
_GONE: Final = select.POLLERR | select.POLLHUP | select.POLLNVAL
_SEND_FLAGS: Final = getattr(socket, "MSG_NOSIGNAL", 0)  # EPIPE as an error, never SIGPIPE

_AddressInfo: TypeAlias = tuple[socket.AddressFamily, socket.SocketKind, int, str, Any]  # getaddrinfo's


def pack_frames(frames: Sequence[bytes]) -> bytes:
    """One frame set as it goes on the wire."""
    out = [_U32.pack(len(frames))]
    for frame in frames:
        out.append(_U32.pack(len(frame)))
        out.append(frame)
    return b"".join(out)


class StreamError(ValueError):
    """A connection's bytes are not this channel's framing (the connection is closed)."""


class FrameReader:
    """Cuts one connection's byte stream into frame sets (pure: bytes in, frame sets out)."""

    def __init__(self, max_frame_bytes: int) -> None:
        self._max = max_frame_bytes
        self._buffer = bytearray()
        self._greeted = False
        self._need = len(GREETING)  # bytes the buffer must hold before parsing is worth trying

    def feed(self, data: bytes) -> list[list[bytes]]:
        """The frame sets completed by ``data``; ``StreamError`` when the stream went wrong."""
        buffer = self._buffer
        buffer += data
        if len(buffer) < self._need:
            return []
        at = 0
        if not self._greeted:
            greeting = bytes(buffer[: len(GREETING)])
            if greeting != GREETING:
                what = "a zmq peer's" if greeting[:1] == b"\xff" else "not a pdkv stream channel's"
                raise StreamError(f"greeting {greeting!r} is {what} (expected {GREETING!r})")
            self._greeted = True
            at = len(GREETING)
        out: list[list[bytes]] = []
        end = len(buffer)
        with memoryview(buffer) as view:
            while True:
                need = _complete(view, at, end, self._max)
                if isinstance(need, int):
                    break
                frames, at = need
                out.append(frames)
        del buffer[:at]
        self._need = need - at
        return out


def _complete(view: memoryview, at: int, end: int, limit: int) -> int | tuple[list[bytes], int]:
    """The frame set starting at ``at`` and where the next one starts, or (incomplete) how many bytes
    from the buffer's start must be there before it can be."""
    if end - at < 4:
        return at + 4
    (count,) = _U32.unpack_from(view, at)
    if not 1 <= count <= MAX_FRAMES:
        raise StreamError(f"a frame set of {count} frames (1..{MAX_FRAMES} allowed)")
    pos = at + 4
    frames: list[bytes] = []
    for _ in range(count):
        if end - pos < 4:
            return pos + 4
        size: int = _U32.unpack_from(view, pos)[0]
        if size > limit:
            raise StreamError(f"a frame of {size} bytes (at most {limit} allowed)")
        pos += 4
        if end - pos < size:
            return pos + size
        frames.append(bytes(view[pos : pos + size]))
        pos += size
    return frames, pos


def split_endpoint(endpoint: str) -> tuple[str, int] | None:
    """``tcp://host:port`` (IPv6 literals in brackets) -> (host, port), or None when malformed."""
    if tcp_address_problem(endpoint) is not None:
        return None
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return (host, int(port)) if host else None


class _Wake:
    """A pipe one thread polls and any thread writes a byte to; wakes coalesce while one is pending."""

    def __init__(self) -> None:
        self.fd, self._write_fd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write_fd, False)
        self._lock = threading.Lock()
        self._pending = False
        self._closed = False

    def wake(self) -> None:
        with self._lock:
            if self._pending or self._closed:
                return
            self._pending = True
            with contextlib.suppress(BlockingIOError):
                os.write(self._write_fd, b"w")

    def consume(self) -> None:
        """The polling thread: forget pending wakes (flag and bytes together, see ``Waker.consume``)."""
        with self._lock:
            self._pending = False
            with contextlib.suppress(BlockingIOError):
                while os.read(self.fd, 64):
                    pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._write_fd)
        os.close(self.fd)


class _Peer:
    """One destination: its connection (if any) and the frame sets queued for it, under the send lock."""

    __slots__ = (
        "address",
        "connected",
        "counts",
        "endpoint",
        "failed",
        "queue",
        "retry_at",
        "socket",
        "untried",
        "waiting",
        "written",
    )

    def __init__(self, endpoint: str, address: tuple[str, int]) -> None:
        self.endpoint = endpoint
        self.address = address
        self.socket: socket.socket | None = None  # opened and closed by the upkeep thread only
        self.connected = False  # the dial completed (until the connection breaks)
        self.failed = False  # a sender's write found the connection broken: the upkeep thread redials
        self.queue: deque[memoryview] = deque()  # frame sets in order, the first maybe partly written
        self.counts: deque[int] = deque()  # messages in each (0: the greeting)
        self.waiting = 0  # their sum
        self.written = 0  # bytes of queue[0] already written
        self.retry_at = 0.0  # when the upkeep thread may dial again
        self.untried: list[_AddressInfo] = []  # the name's addresses after the one being dialled

    def push(self, data: memoryview, count: int) -> None:
        self.queue.append(data)
        self.counts.append(count)
        self.waiting += count

    def pop(self) -> None:
        self.queue.popleft()
        self.waiting -= self.counts.popleft()
        self.written = 0

    def clear(self) -> None:
        self.queue.clear()
        self.counts.clear()
        self.waiting = 0
        self.written = 0


class StreamChannel(Generic[M]):
    """One rank's control endpoint over plain TCP; ``ControlChannel``'s surface and promises.

    ``StreamChannel(codec, host="127.0.0.1", port=0)`` binds at once (port 0: a free port chosen by the
    OS); ``address`` is the ``tcp://host:port`` peers dial. ``options.send_timeout_ms`` has no use here
    (no send ever blocks); the other options mean what they mean for ``ControlChannel``.
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
    ) -> None:
        self._codec = codec
        self._auth = auth
        self._options = options if options is not None else ChannelOptions()
        self._listener, self._address = _listen(host, port, advertise_host)
        self._wake = _Wake()
        self._poll = select.poll()
        self._poll.register(self._listener.fileno(), _IN)
        self._poll.register(self._wake.fd, _IN)
        self._inbound: dict[int, tuple[socket.socket, FrameReader]] = {}
        self._claim = ReceiverClaim(self._address)
        self._inbox: Inbox[M] = Inbox(codec, auth, self._address)
        self._send_lock = threading.Lock()  # peers, their sockets' writes, the send counters
        self._peers: OrderedDict[str, _Peer] = OrderedDict()
        self._retired: list[socket.socket] = []  # outbound sockets for the upkeep thread to close
        self._upkeep_wake = _Wake()
        self._upkeep: threading.Thread | None = None
        self._flush_until: float | None = None  # set by close(): the upkeep thread's last moment
        self._closed = False
        self._send_warnings = WarningLimiter(log)
        self._sends = SendCounts()

    # ------------------------------------------------------------------ any thread

    @property
    def address(self) -> str:
        return self._address

    @property
    def closed(self) -> bool:
        return self._closed

    def wake(self) -> None:
        """End the receiving thread's current (or next) ``wait`` early. Thread-safe; a no-op after close."""
        self._wake.wake()

    def statistics(self) -> ChannelStatistics:
        return ChannelStatistics(**self._inbox.counters(self._sends, len(self._peers)))

    # ------------------------------------------------------------------ sending (any thread)

    def send(self, to: str, message: M) -> bool:
        """Queue ``message`` for ``to``; False (counted, logged) when it was dropped. Never blocks:
        a full queue for ``to`` or a malformed endpoint drops the message. True means written or
        queued here, not delivered. An encoding error is the caller's bug and propagates."""
        return self.send_many(to, [message])

    def send_many(self, to: str, messages: Sequence[M]) -> bool:
        """Queue ``messages`` for ``to`` in one frame set (in order); False (counted) when dropped."""
        self._check_open()
        parts = encode_parts(self._codec, self._auth, messages)  # outside the lock
        ok = True
        with self._send_lock:
            if self._closed:
                raise ChannelClosedError(f"channel {self._address} is closed")
            for part in parts:
                ok = self._send_part(to, part) and ok
        return ok

    def forget(self, endpoint: str) -> bool:
        """Drop the connection to ``endpoint`` and its queue; False if there was none."""
        self._check_open()
        with self._send_lock:
            peer = self._peers.pop(endpoint, None)
            if peer is None:
                return False
            self._retire(peer)
        self._upkeep_wake.wake()
        return True

    # ------------------------------------------------------------------ receiving (one thread at a time)

    def recv(self, timeout_s: float | None) -> M | None:
        """The next valid message, waiting up to ``timeout_s`` (None: forever; 0: what is queued).
        ``wake()`` does not end ``recv``; use ``wait`` when other threads must interrupt."""
        self._check_open()
        with self._claim:
            return self._recv(timeout_s)

    def _recv(self, timeout_s: float | None) -> M | None:
        deadline = deadline_after(timeout_s)
        pending = self._inbox.pending
        while True:
            if pending:
                return pending.popleft()
            self._pump(deadline, stop_on_wake=False)
            if not pending and expired(deadline):
                return None

    def wait(self, timeout_s: float | None, *, max_messages: int | None = None) -> list[M]:
        """Block until a message arrives, ``wake()`` is called or ``timeout_s`` passes; return what is
        queued (at most ``max_messages``, default ``options.max_batch``): ``ControlChannel.wait``'s
        promise, a pending wake included."""
        self._check_open()
        with self._claim:
            return self._wait(timeout_s, max_messages)

    def _wait(self, timeout_s: float | None, max_messages: int | None) -> list[M]:
        limit = self._options.max_batch if max_messages is None else max_messages
        if limit < 1:
            raise ValueError(f"max_messages must be >= 1, got {limit}")
        deadline = deadline_after(timeout_s)
        inbox = self._inbox
        while True:
            if inbox.pending:
                return inbox.take(limit)
            woke = self._pump(deadline, stop_on_wake=True)
            if woke or inbox.pending:
                return inbox.take(limit)
            if expired(deadline):
                return []

    def close(self, *, flush_s: float = 0.0) -> None:
        """Close the channel; idempotent; never blocks. Any thread, except while another is inside
        a receive call. ``flush_s`` > 0: the upkeep thread goes on writing what is queued for peers
        for that long (a rank that shuts down after its last statuses should pass a second or so)."""
        if self._closed:
            return
        self._claim.check_close()
        if not 0 <= flush_s < math.inf:
            raise ValueError(f"flush_s must be a finite number >= 0, got {flush_s!r}")
        with self._send_lock:  # a send under way on another thread ends first; later ones raise
            self._closed = True
            self._flush_until = time.monotonic() + flush_s
            upkeep = self._upkeep
            if upkeep is None:  # nothing was ever sent: no outbound socket exists
                self._peers.clear()
        if upkeep is not None:
            self._upkeep_wake.wake()  # it flushes (or not), closes every outbound socket and ends
        else:
            self._upkeep_wake.close()
        for sock, _ in self._inbound.values():
            sock.close()
        self._inbound.clear()
        self._listener.close()
        self._wake.close()

    def wait_closed(self, timeout_s: float | None) -> bool:
        """After ``close``: wait until the upkeep thread has written what ``flush_s`` allowed and closed
        every outbound connection (a process about to exit calls it, or the flush dies with it), at
        most ``timeout_s`` (None: as long as that takes; refused as ``recv``'s is when not a finite
        number >= 0). True when it has; at once when nothing was ever sent."""
        deadline = deadline_after(timeout_s)
        if not self._closed:
            raise ChannelClosedError(f"channel {self._address} is open: close it first")
        upkeep = self._upkeep
        if upkeep is not None:
            upkeep.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            return not upkeep.is_alive()
        return True

    def __enter__(self) -> StreamChannel[M]:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<StreamChannel {self._address} {state}, {len(self._peers)} peers>"

    # ------------------------------------------------------------------ sending internals

    def _check_open(self) -> None:
        if self._closed:
            raise ChannelClosedError(f"channel {self._address} is closed")

    def _send_part(self, to: str, part: Part) -> bool:
        """Write one frame set to ``to`` or queue it (``_send_lock`` held)."""
        peer = self._peer(to)
        if peer is None:
            self._sends.dropped += part.count
            return False
        if peer.waiting + part.count > self._options.send_hwm:
            self._sends.dropped += part.count
            self._send_warnings.warning(
                "dropped %d message(s) (%s) to %s: its send queue is full", part.count, part.what, to
            )
            return False
        data = memoryview(pack_frames(part.frames))
        self._sends.queued(part)
        sock = peer.socket
        if not peer.queue and peer.connected and not peer.failed and sock is not None:
            try:
                done = sock.send(data, _SEND_FLAGS)
            except BlockingIOError:
                done = 0
            except OSError:  # nothing of it went out; the upkeep thread redials, the frame set waits
                done = 0
                peer.failed = True
            if done == len(data):
                return True
            peer.push(data, part.count)
            peer.written = done
            self._upkeep_wake.wake()
            return True
        peer.push(data, part.count)
        self._upkeep_wake.wake()  # coalesced while the upkeep thread has not run
        return True

    def _peer(self, endpoint: str) -> _Peer | None:
        peer = self._peers.get(endpoint)
        if peer is not None:
            self._peers.move_to_end(endpoint)
            return peer
        address = split_endpoint(endpoint)
        if address is None:
            self._send_warnings.warning("cannot dial control endpoint %r: not tcp://host:port", endpoint)
            return None
        peer = _Peer(endpoint, address)
        self._peers[endpoint] = peer
        if len(self._peers) > self._options.max_peers:
            evicted, old = self._peers.popitem(last=False)
            self._retire(old)
            log.info("closed the least recently used control connection, to %s (peer limit)", evicted)
        if self._upkeep is None:
            self._upkeep = threading.Thread(target=self._upkeep_loop, name="pdkv-stream-upkeep", daemon=True)
            self._upkeep.start()
        return peer

    def _retire(self, peer: _Peer) -> None:
        """Hand ``peer``'s socket to the upkeep thread to close; its queue goes (``_send_lock`` held)."""
        if peer.socket is not None:
            self._retired.append(peer.socket)
            peer.socket = None
        peer.connected = False
        peer.clear()

    # ------------------------------------------------------------------ the upkeep thread

    def _upkeep_loop(self) -> None:
        poller = _Interest(self._upkeep_wake.fd)
        try:
            while True:
                with self._send_lock:
                    plan = self._tend(poller)
                if plan is None:
                    return
                timeout_s, due = plan
                if due:  # name lookups and socket set-up outside the lock; then tend again
                    opened = [(peer, *_dial(peer.address, peer.untried)) for peer in due]
                    with self._send_lock:
                        for peer, result, untried in opened:
                            self._attach(peer, result, untried)
                    continue
                events = poller.poll(timeout_s)
                with self._send_lock:
                    for fd, mask in events:
                        if fd == self._upkeep_wake.fd:
                            self._upkeep_wake.consume()
                            continue
                        owner = poller.owners.get(fd)
                        if owner is not None and owner.socket is not None:
                            self._serve(owner, mask)
        except Exception:  # a bug here must not pass silently: what is queued would wait forever
            log.exception("the upkeep thread of control channel %s failed", self._address)
        finally:
            with self._send_lock:
                for peer in self._peers.values():
                    self._retire(peer)
                self._peers.clear()
                retired, self._retired = self._retired, []
                self._upkeep = None  # a later send (if the channel is open) starts another
            for sock in retired:
                sock.close()
            if self._closed:
                self._upkeep_wake.close()

    def _tend(self, poller: _Interest) -> tuple[float, list[_Peer]] | None:
        """Close what was retired, drop connections found broken, say whom to dial and what to poll;
        None when the thread should end (closed, and flushed or out of time). ``_send_lock`` held."""
        now = time.monotonic()
        timeout_s = _IDLE_S
        if self._closed:
            assert self._flush_until is not None
            left = self._flush_until - now
            if left <= 0 or not any(peer.queue for peer in self._peers.values()):
                return None
            timeout_s = left
        due: list[_Peer] = []
        wanted: dict[int, tuple[int, _Peer]] = {}
        for peer in self._peers.values():
            if peer.failed:
                self._broken(peer, "a write found it broken")
            if peer.socket is None:
                if not peer.waiting:
                    continue  # dial when there is something to say
                if now < peer.retry_at:
                    timeout_s = min(timeout_s, peer.retry_at - now)
                else:
                    due.append(peer)
                continue
            events = _IN | _OUT if peer.queue or not peer.connected else _IN
            wanted[peer.socket.fileno()] = (events, peer)
        poller.set(wanted)
        for sock in self._retired:  # closed only once out of the poll set: no descriptor reused in it
            poller.forget(sock.fileno())
            sock.close()
        self._retired.clear()
        return timeout_s, due

    def _attach(self, peer: _Peer, result: socket.socket | OSError, untried: list[_AddressInfo]) -> None:
        """Install a dialled socket on ``peer`` (``_send_lock`` held); the greeting goes first.
        ``untried``: the addresses to dial next should this connect fail."""
        peer.untried = untried
        if isinstance(result, OSError):
            peer.retry_at = time.monotonic() + _RECONNECT_S
            self._send_warnings.warning("cannot dial control endpoint %r: %s", peer.endpoint, result)
            return
        if self._peers.get(peer.endpoint) is not peer or peer.socket is not None:
            result.close()  # forgotten (or evicted) while it was being dialled
            return
        peer.socket = result
        peer.connected = False
        peer.failed = False
        peer.written = 0
        peer.queue.appendleft(memoryview(GREETING))
        peer.counts.appendleft(0)

    def _serve(self, peer: _Peer, mask: int) -> None:
        """React to ``poll``'s events on ``peer``'s socket (``_send_lock`` held)."""
        sock = peer.socket
        assert sock is not None
        if not peer.connected:
            if mask & _GONE or sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0:
                self._broken(peer, "could not connect")
                if peer.untried:  # the name's next address now; the interval once every one failed
                    peer.retry_at = time.monotonic()
                return
            if not mask & _OUT:
                return
            peer.connected = True
            peer.untried = []  # a redial after this connection breaks looks the name up again
        elif mask & (_IN | _GONE):
            try:
                data = sock.recv(4096)
            except BlockingIOError:
                data = None
            except OSError as exc:
                self._broken(peer, str(exc))
                return
            if data is not None:  # b"": the peer closed; bytes: a peer that talks back is not one
                self._broken(peer, "the peer closed it" if not data else "the peer sent bytes")
                return
        self._flush(peer)

    def _flush(self, peer: _Peer) -> None:
        sock = peer.socket
        assert sock is not None
        while peer.queue:
            head = peer.queue[0]
            try:
                done = sock.send(head[peer.written :], _SEND_FLAGS)
            except BlockingIOError:
                return
            except OSError as exc:
                self._broken(peer, str(exc))
                return
            peer.written += done
            if peer.written < len(head):
                return
            peer.pop()

    def _broken(self, peer: _Peer, why: str) -> None:
        """Drop ``peer``'s connection and dial again after ``_RECONNECT_S``: a frame set partly written
        is lost with the connection; the whole ones after it wait (``_send_lock`` held)."""
        if peer.written:
            peer.pop()
        while peer.counts and peer.counts[0] == 0:  # a greeting not (all) written: the next dial's
            peer.pop()
        if peer.socket is not None:
            self._retired.append(peer.socket)
            peer.socket = None
        peer.connected = False
        peer.failed = False
        peer.retry_at = time.monotonic() + _RECONNECT_S
        log.debug("control connection to %s dropped (%s); %d messages wait", peer.endpoint, why, peer.waiting)

    # ------------------------------------------------------------------ receiving internals

    def _pump(self, deadline: float | None, *, stop_on_wake: bool) -> bool:
        """Wait for input until ``deadline`` and read what came; True when a wake ended it."""
        if deadline is None:
            timeout_ms: int | None = None
        else:
            timeout_ms = max(0, math.ceil((deadline - time.monotonic()) * 1000.0))
        woke = False
        for fd, mask in self._poll.poll(timeout_ms):
            if fd == self._wake.fd:
                self._wake.consume()
                woke = stop_on_wake
            elif fd == self._listener.fileno():
                self._accept()
            else:
                self._read(fd, mask)
        return woke

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of descriptors: the listener stays, the peer retries
                self._inbox.warnings.warning("control channel %s cannot accept: %s", self._address, exc)
                return
            sock.setblocking(False)
            self._inbound[sock.fileno()] = (sock, FrameReader(self._options.max_frame_bytes))
            self._poll.register(sock.fileno(), _IN)

    def _read(self, fd: int, mask: int) -> None:
        entry = self._inbound.get(fd)
        if entry is None:
            return
        sock, reader = entry
        if len(self._inbox.pending) >= self._options.recv_hwm:
            return  # the owner has enough to do; the kernel holds the rest (and slows the sender)
        try:
            data = sock.recv(_READ_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop_inbound(fd)
            return
        try:
            frame_sets = reader.feed(data)
        except StreamError as exc:
            self._inbox.malformed += 1
            self._inbox.warnings.warning("control channel %s closed a connection: %s", self._address, exc)
            self._drop_inbound(fd)
            return
        for frames in frame_sets:
            self._inbox.accept(frames)

    def _drop_inbound(self, fd: int) -> None:
        sock, _ = self._inbound.pop(fd)
        self._poll.unregister(fd)
        sock.close()


class _Interest:
    """The upkeep thread's ``poll`` set: its waker, and each peer socket with the events wanted."""

    def __init__(self, wake_fd: int) -> None:
        self._poll = select.poll()
        self._poll.register(wake_fd, _IN)
        self._events: dict[int, int] = {}
        self.owners: dict[int, _Peer] = {}

    def set(self, wanted: dict[int, tuple[int, _Peer]]) -> None:
        for fd in [fd for fd in self._events if fd not in wanted]:
            self.forget(fd)
        for fd, (events, peer) in wanted.items():
            known = self._events.get(fd)
            if known is None:
                self._poll.register(fd, events)
            elif known != events:
                self._poll.modify(fd, events)
            self._events[fd] = events
            self.owners[fd] = peer

    def forget(self, fd: int) -> None:
        if self._events.pop(fd, None) is not None:
            self._poll.unregister(fd)
        self.owners.pop(fd, None)

    def poll(self, timeout_s: float) -> list[tuple[int, int]]:
        return self._poll.poll(math.ceil(max(0.0, timeout_s) * 1000.0))


def _dial(
    address: tuple[str, int], untried: Sequence[_AddressInfo]
) -> tuple[socket.socket | OSError, list[_AddressInfo]]:
    """A non-blocking socket connecting to the first of ``untried`` that the connect call takes (the
    name's addresses, looked up here when none are left), and the addresses after that one; or the
    last address's error and none left. Never blocks: a refusal that comes later shows in ``poll``."""
    host, port = address
    candidates = list(untried)
    if not candidates:
        try:
            candidates = list(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as exc:
            return exc, []
    failure = OSError(errno.EADDRNOTAVAIL, f"{host} resolves to no address")
    while candidates:
        family, kind, proto, _, sockaddr = candidates.pop(0)
        result = _connect(family, kind, proto, sockaddr)
        if isinstance(result, socket.socket):
            return result, candidates
        failure = result
    return failure, []


def _connect(family: int, kind: int, proto: int, sockaddr: Any) -> socket.socket | OSError:
    """A non-blocking socket whose connect to ``sockaddr`` is under way (or done), or why not."""
    try:
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        return exc
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        code = sock.connect_ex(sockaddr)
    except OSError as exc:
        sock.close()
        return exc
    if code not in (0, errno.EINPROGRESS, errno.EAGAIN):
        sock.close()
        return OSError(code, os.strerror(code))
    return sock


def _listen(host: str, port: int, advertise_host: str | None) -> tuple[socket.socket, str]:
    """A listening socket on host:port (0: the OS picks) and the address peers dial."""
    check_bind(host, port, advertise_host)
    v6 = ":" in host
    bind_host = ("::" if v6 else "0.0.0.0") if host in WILDCARD_HOSTS else host
    sock = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        deadline = time.monotonic() + BIND_RETRY_S
        while True:
            try:
                sock.bind((bind_host, port))
                break
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE or not port or time.monotonic() >= deadline:
                    where = f"tcp://{bracketed(bind_host)}:{port}"
                    raise ControlBindError(f"cannot bind {where}: {exc}") from exc
                time.sleep(0.01)
        sock.listen(_BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    bound_port = sock.getsockname()[1]
    return sock, f"tcp://{bracketed(advertise_host or host)}:{bound_port}"
