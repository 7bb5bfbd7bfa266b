"""The bootstrap registry as a service: a ROUTER socket on its own thread, and the client's ``request``.

Owns: ``RegistryService`` (bind, start, stop, statistics) and ``request`` (one question to a
service over a DEALER socket, with bounded retries). Must not know what the registry decides: the
service calls an injected ``handle(message) -> reply | None`` (the runtime passes the pure
``pdkv.protocol.registry.RouteBook``'s), and the codec is injected as for the channel.

Service thread. The service's sockets belong to its thread from ``start()`` on. Every request is
handled inside a ``try``: bad frames are counted and logged (rate-limited), an exception from the
handler is logged with its traceback and counted, and the loop goes on. ``stop()`` wakes the
thread through an inproc socket (no polling interval) and joins it with a timeout; the thread
closes its own sockets on the way out.

Wire. A request is the message's frames (plus the tag frame with authentication) sent from a
DEALER; the ROUTER sees them behind the peer's routing id, and the reply goes back the same way.
A REQ client is not supported (it would add an empty delimiter frame, which the codec rejects).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Final, Generic

import attrs
import zmq

from pdkv.control._sockets import Waker, WarningLimiter, bind_tcp, deadline_after, expired, remaining_ms
from pdkv.control.auth import Authenticator, unix_ms
from pdkv.control.errors import (
    AuthenticationError,
    ChannelClosedError,
    ControlError,
    ControlTimeoutError,
)
from pdkv.control.framing import M, WireCodec
from pdkv.errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_MAX_FRAME_BYTES: Final = 16 << 20  # registry messages are small: route tables, announcements
_BATCH: Final = 256  # requests handled per wake-up before the stop flag is looked at again


@attrs.frozen(kw_only=True)
class RegistryStatistics:
    """Counters since the service was created (a snapshot; read from any thread)."""

    requests: int
    """Valid requests handed to the handler."""
    replies: int
    """Replies queued back to the requester."""
    malformed: int
    """Frame sets the codec rejected."""
    unauthenticated: int
    """Frame sets without a valid, fresh tag (only with an authenticator)."""
    handler_errors: int
    """Requests whose handler (or the encoding of its reply) raised; the service went on."""
    dropped_replies: int
    """Replies not queued: the requester had gone (timed out, closed) or its queue was full."""
    running: bool
    """Whether the service thread is alive."""


class RegistryService(Generic[M]):
    """A small request/reply service on ``address`` that answers each request with ``handle(request)``.

    ``handle`` runs on the service thread; returning None sends no reply (the client retries, then
    times out). Use as a context manager (starts on enter, stops on exit) or call ``start``/``stop``.
    """

    def __init__(
        self,
        codec: WireCodec[M],
        handle: Callable[[M], M | None],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        auth: Authenticator | None = None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        name: str = "pdkv-registry",
        refuse: Callable[[str], M] | None = None,
    ) -> None:
        """``refuse(reason)``: the reply to a request this service cannot read (its authentication
        failed, or it does not decode), so that the requester's timeout error can say why, e.g. that
        ``PDKV_AUTH_KEY`` differs (None: such requests go unanswered)."""
        self._codec = codec
        self._handle = handle
        self._refuse = refuse
        self._auth = auth
        self._name = name
        if isinstance(max_frame_bytes, bool) or not isinstance(max_frame_bytes, int) or max_frame_bytes < 1:
            raise ConfigError(f"max_frame_bytes must be an int >= 1, got {max_frame_bytes!r}")
        ctx: zmq.Context[zmq.Socket[bytes]] = context if context is not None else zmq.Context.instance()
        self._router: zmq.Socket[bytes] = ctx.socket(zmq.ROUTER)
        try:
            self._router.setsockopt(zmq.LINGER, 0)
            # Without this a ROUTER drops replies it cannot deliver in silence; with it the send
            # fails, and the drop is counted.
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._router.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
            self._address = bind_tcp(self._router, host, port, advertise_host)
            self._waker = Waker(ctx)
        except BaseException:
            self._router.close(linger=0)
            raise
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._sockets_closed = False
        self._warnings = WarningLimiter(log)
        self._requests = 0
        self._replies = 0
        self._malformed = 0
        self._unauthenticated = 0
        self._handler_errors = 0
        self._dropped_replies = 0

    @property
    def address(self) -> str:
        """``tcp://host:port`` that clients pass to ``request`` (known as soon as the service exists)."""
        return self._address

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def statistics(self) -> RegistryStatistics:
        return RegistryStatistics(
            requests=self._requests,
            replies=self._replies,
            malformed=self._malformed,
            unauthenticated=self._unauthenticated,
            handler_errors=self._handler_errors,
            dropped_replies=self._dropped_replies,
            running=self.running,
        )

    def start(self) -> None:
        """Start serving on a daemon thread (once)."""
        if self._thread is not None or self._stopping.is_set():
            raise ChannelClosedError(f"registry {self._address} was already started or stopped")
        self._thread = threading.Thread(target=self._serve, name=f"{self._name}@{self._address}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop serving and close the socket; True when the thread ended within ``timeout_s``.

        Idempotent. On False the thread is stuck in the handler; it closes its sockets when it returns.
        """
        self._stopping.set()
        thread = self._thread
        if thread is None:
            self._close_sockets()  # never started: nobody else owns them
            return True
        self._waker.wake()
        if thread is threading.current_thread():
            return False  # called from the handler: the loop ends after this request
        thread.join(timeout_s)
        if thread.is_alive():
            log.error("registry %s did not stop within %.1f s (handler stuck?)", self._address, timeout_s)
            return False
        return True

    def __enter__(self) -> RegistryService[M]:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<RegistryService {self._address} {'running' if self.running else 'stopped'}>"

    # ------------------------------------------------------------------ service thread

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._waker.socket, zmq.POLLIN)
        try:
            while not self._stopping.is_set():
                ready = dict(poller.poll())
                if self._waker.socket in ready:
                    self._waker.consume()
                for _ in range(_BATCH):
                    try:
                        frames = self._router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._serve_one(frames)
        except zmq.ContextTerminated:
            log.warning("registry %s stopped: its zmq context was terminated", self._address)
        except Exception:
            # Only socket failures get here (each request is handled inside its own try): say so loudly.
            log.exception("registry %s stopped on an unexpected error", self._address)
        finally:
            self._close_sockets()

    def _serve_one(self, frames: list[bytes]) -> None:
        routing_id, payload = frames[0], frames[1:]
        if self._auth is not None:
            try:
                payload = self._auth.verify(payload, unix_ms())
            except AuthenticationError as exc:
                self._unauthenticated += 1
                self._warnings.warning("registry %s rejected a request: %s", self._address, exc)
                self._answer_unreadable(routing_id, f"authentication failed at the registry: {exc}")
                return
        try:
            request = self._codec.decode(payload)
        except self._codec.decode_error as exc:
            self._malformed += 1
            self._warnings.warning("registry %s skipped a malformed request: %s", self._address, exc)
            self._answer_unreadable(routing_id, f"the registry could not read the request: {exc}")
            return
        self._requests += 1
        try:
            reply = self._handle(request)
            if reply is None:
                return
            reply_frames = self._codec.encode(reply)
        except Exception:
            self._handler_errors += 1
            log.exception("registry %s: handler failed on %s", self._address, type(request).__name__)
            return
        self._reply(routing_id, reply_frames)

    def _answer_unreadable(self, routing_id: bytes, reason: str) -> None:
        """Tell a requester whose request could not be read why (signed as every reply: a requester
        with another key, or none, cannot verify it, and that is what its error then says)."""
        if self._refuse is None:
            return
        try:
            frames = self._codec.encode(self._refuse(reason))
        except Exception:
            log.exception("registry %s: could not encode a refusal", self._address)
            return
        self._reply(routing_id, frames)

    def _reply(self, routing_id: bytes, reply_frames: list[bytes]) -> None:
        if self._auth is not None:
            reply_frames = self._auth.sign(reply_frames, unix_ms())
        try:
            self._router.send_multipart([routing_id, *reply_frames], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # EAGAIN: its queue is full; EHOSTUNREACH: the requester left
            self._dropped_replies += 1
            self._warnings.warning("registry %s dropped a reply: %s", self._address, exc)
            return
        self._replies += 1

    def _close_sockets(self) -> None:
        if self._sockets_closed:
            return
        self._sockets_closed = True
        self._waker.close()
        self._router.close(linger=0)


def request(
    address: str,
    message: M,
    *,
    codec: WireCodec[M],
    timeout_s: float,
    attempts: int = 3,
    auth: Authenticator | None = None,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
) -> M:
    """Send ``message`` to the service at ``address`` and return its reply.

    ``timeout_s`` bounds the whole call; it is split evenly among ``attempts`` sends of the same
    message (each re-signed). A reply to any attempt answers the call, so handlers must be
    idempotent for repeated requests (the registry's are). Malformed or unauthenticated replies are
    logged and ignored. Raises ``ControlTimeoutError`` when no valid reply came in time, and
    ``ControlError`` when ``address`` cannot be dialled at all.
    """
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise ConfigError(f"attempts must be an int >= 1, got {attempts!r}")
    if not 0 < timeout_s < math.inf:
        raise ConfigError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
    ctx: zmq.Context[zmq.Socket[bytes]] = context if context is not None else zmq.Context.instance()
    frames = codec.encode(message)
    socket: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    started = time.monotonic()
    ignored: list[str] = []  # replies refused (authentication, malformed): said in the timeout error
    try:
        socket.setsockopt(zmq.LINGER, 0)
        if "[" in address:
            socket.setsockopt(zmq.IPV6, 1)
        try:
            socket.connect(address)
        except zmq.ZMQError as exc:
            raise ControlError(f"cannot dial {address!r}: {exc}") from exc
        for attempt in range(1, attempts + 1):
            signed = frames if auth is None else auth.sign(frames, unix_ms())
            try:
                socket.send_multipart(signed, zmq.NOBLOCK)
            except zmq.Again:
                log.debug("request to %s: attempt %d not queued (earlier ones still wait)", address, attempt)
            deadline = deadline_after(max(0.0, started + timeout_s * attempt / attempts - time.monotonic()))
            reply = _await_reply(socket, deadline, codec, auth, address, ignored)
            if reply is not None:
                return reply
            if attempt < attempts:
                log.info("no reply from %s to attempt %d of %d; sending again", address, attempt, attempts)
    finally:
        socket.close(linger=0)
    elapsed = time.monotonic() - started
    why = ""
    if ignored:
        hint = (
            "PDKV_AUTH_KEY is set here but the peer's key differs or is unset"
            if auth is not None
            else "the peer may require PDKV_AUTH_KEY, which is not set here"
        )
        why = f"; {len(ignored)} reply(s) refused ({ignored[-1]}): {hint}"
    raise ControlTimeoutError(
        f"no reply from {address} to {type(message).__name__} after {attempts} attempt(s) in {elapsed:.2f} s"
        f"{why}",
        address=address,
        attempts=attempts,
        timeout_s=timeout_s,
    )


def _await_reply(
    socket: zmq.Socket[bytes],
    deadline: float | None,
    codec: WireCodec[M],
    auth: Authenticator | None,
    address: str,
    ignored: list[str],
) -> M | None:
    while True:
        if socket.poll(remaining_ms(deadline), zmq.POLLIN):
            frames = socket.recv_multipart()
            if auth is not None:
                try:
                    frames = auth.verify(frames, unix_ms())
                except AuthenticationError as exc:
                    log.warning("ignored a reply from %s: %s", address, exc)
                    ignored.append(f"authentication: {exc}")
                    continue
            try:
                return codec.decode(frames)
            except codec.decode_error as exc:
                log.warning("ignored a malformed reply from %s: %s", address, exc)
                ignored.append(f"malformed: {exc}")
                continue
        if expired(deadline):
            return None
