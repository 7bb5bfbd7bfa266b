"""Socket plumbing shared by the channel and the registry service.

Owns: binding a TCP endpoint and naming its address, the cross-thread ``Waker``, asking a socket
whether a message is queued (``readable``), and the rate limit on warnings about bad input. Must not
know messages or codecs.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import math
import threading
import time
import uuid
from typing import Final, cast

import zmq

from pdkv.control.errors import ControlBindError
from pdkv.errors import ConfigError

WILDCARD_HOSTS: Final = frozenset({"*", "0.0.0.0", "::", ""})
BIND_RETRY_S: Final = 1.0

# pyzmq's constants are Python enums (POLLIN an IntFlag, whose ``&`` runs in Python and builds a new
# member); ``readable`` runs once per drain, so it uses the plain ints.
_EVENTS: Final = int(zmq.EVENTS)
_POLLIN: Final = int(zmq.POLLIN)


def readable(socket: zmq.Socket[bytes]) -> bool:
    """Whether a message is queued on ``socket`` now.

    Asked before a non-blocking receive because every drain ends on an empty queue, and a receive
    says "empty" by raising ``zmq.Again``: an exception built (with its errno text) per drain.
    """
    return bool(cast(int, socket.getsockopt(_EVENTS)) & _POLLIN)  # an int option, typed int | bytes


def check_bind(host: str, port: int, advertise_host: str | None) -> None:
    """``ConfigError`` for a port out of range, or a wildcard bind (all interfaces) without the address
    peers dial: the rules of every listening socket here."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"port must be an int in [0, 65535], got {port!r}")
    if host in WILDCARD_HOSTS and advertise_host is None:
        raise ConfigError(
            f"binding to all interfaces ({host!r}) needs advertise_host, the address peers dial"
        )


def bracketed(host: str) -> str:
    """zmq and URLs write IPv6 literals in brackets."""
    try:
        is_v6 = isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address)
    except ValueError:
        is_v6 = False
    return f"[{host}]" if is_v6 else host


def bind_tcp(socket: zmq.Socket[bytes], host: str, port: int, advertise_host: str | None) -> str:
    """Bind ``socket`` on host:port (0: the OS picks a free port) and return the address peers dial.

    A wildcard bind (all interfaces) has no address a peer could dial, so it needs ``advertise_host``.
    """
    check_bind(host, port, advertise_host)
    bind_host = "*" if host in WILDCARD_HOSTS else bracketed(host)
    if ":" in host or (advertise_host is not None and ":" in advertise_host):
        socket.setsockopt(zmq.IPV6, 1)
    endpoint = f"tcp://{bind_host}:{port if port else '*'}"
    # zmq closes sockets on its I/O thread, after close() returned: a port this process just closed
    # can look taken for a moment, so "in use" is retried briefly before it is reported.
    deadline = time.monotonic() + BIND_RETRY_S
    while True:
        try:
            socket.bind(endpoint)
            break
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or not port or time.monotonic() >= deadline:
                raise ControlBindError(f"cannot bind {endpoint}: {exc}") from exc
            time.sleep(0.01)
    # LAST_ENDPOINT holds the port the OS chose; the host part is what we asked for (or an expansion
    # of the wildcard), so only the port is taken from it.
    last = socket.getsockopt_string(zmq.LAST_ENDPOINT)
    bound_port = int(last.rsplit(":", 1)[1])
    return f"tcp://{bracketed(advertise_host or host)}:{bound_port}"


class Waker:
    """Lets any thread interrupt the owner's poll: inproc PUSH (behind a lock) -> PULL (polled by the owner).

    Wakes coalesce: while one is pending, further ``wake()`` calls send nothing, so a thread that wakes
    in a loop cannot fill a queue. The owner calls ``consume()`` when ``socket`` polls readable.
    """

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        name = f"inproc://pdkv-wake-{uuid.uuid4().hex}"
        self.socket: zmq.Socket[bytes] = context.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(name)
        self._sender: zmq.Socket[bytes] = context.socket(zmq.PUSH)
        self._sender.setsockopt(zmq.LINGER, 0)
        self._sender.connect(name)
        self._lock = threading.Lock()  # zmq sockets are not thread-safe; this one is shared by wakers
        self._pending = False
        self._closed = False

    def wake(self) -> None:
        """Thread-safe; a no-op once closed (a late wake during shutdown is harmless)."""
        with self._lock:
            if self._closed or self._pending:
                return
            self._pending = True
            # Cannot fill up with one byte pending, but a wake must never raise.
            with contextlib.suppress(zmq.Again):
                self._sender.send(b"", zmq.NOBLOCK)

    def consume(self) -> None:
        """Owner thread: forget pending wakes.

        Clearing the flag and draining happen under the wakers' lock: otherwise a wake could slip in
        between (flag set again, its byte drained here), leaving the flag set with nothing to read,
        and every later ``wake()`` would be swallowed until the owner's poll timed out. A byte still
        in flight from before this call only causes one spurious (harmless) wake-up later.
        """
        with self._lock:
            self._pending = False
            while readable(self.socket):
                try:
                    self.socket.recv(zmq.NOBLOCK)
                except zmq.Again:  # not expected after readable() on the owner's thread
                    return

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._sender.close(linger=0)
        self.socket.close(linger=0)


class WarningLimiter:
    """At most ``burst`` WARNING lines per ``period_s`` about bad input: a peer sending garbage in a
    loop must not flood the log (the counters still count everything). The number suppressed is
    logged with the first warning of the next period. Used by one thread (the socket's owner)."""

    def __init__(self, logger: logging.Logger, *, burst: int = 20, period_s: float = 10.0) -> None:
        self._logger = logger
        self._burst = burst
        self._period_s = period_s
        self._window_start = -float("inf")
        self._logged = 0
        self._suppressed = 0

    def warning(self, text: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._window_start >= self._period_s:
            if self._suppressed:
                self._logger.warning("%d more warnings like the above suppressed", self._suppressed)
            self._window_start = now
            self._logged = 0
            self._suppressed = 0
        if self._logged < self._burst:
            self._logged += 1
            self._logger.warning(text, *args)
        else:
            self._suppressed += 1


def deadline_after(timeout_s: float | None) -> float | None:
    """The monotonic time ``timeout_s`` from now (None: no deadline)."""
    if timeout_s is None:
        return None
    if not 0 <= timeout_s < math.inf:
        raise ValueError(f"timeout_s must be None or a finite number >= 0, got {timeout_s!r}")
    return time.monotonic() + timeout_s


def remaining_ms(deadline: float | None) -> int | None:
    """Milliseconds to poll: rounded up, so the last sub-millisecond does not become a busy loop."""
    if deadline is None:
        return None
    return max(0, math.ceil((deadline - time.monotonic()) * 1000.0))


def expired(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline
