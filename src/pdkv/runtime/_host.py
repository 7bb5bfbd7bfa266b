"""What both transports share: one sans-IO endpoint behind one lock, driven by one control thread
(or by a scheduler thread waiting in ``wait_progress``, to which it lends receiving).

Owns: ``EndpointHost`` — the lock, the control loop (messages and deadlines into the endpoint),
the accounting of effects into ``TransportMetrics``, the handling of the effects every side emits
(log lines, rebuilding a peer's socket) — and the ``_call`` / ``_query`` helpers the scheduler
surface goes through. Each transport adds the effects of its side in ``_apply_effect``.

All room state lives in the endpoint; every access holds ``_lock`` (never a lock per room: one lock
is cheaper than a transitions LockedMachine per room, and the endpoint is fast). Effects are carried
out in the order the endpoint produced them, with the lock held, so they never interleave with
another caller's. A scheduler blocked in ``wait_progress`` is woken once the thread that made the
progress released the lock and sent what it posted (a ``_locked()`` block's end; the control
thread's ``settled`` after a batch of messages): woken earlier, its poll would find the lock held
and sleep on it again, one hand-off more on the path of a request or a status.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, Generic, Protocol, Self, TypeVar

from pdkv import config
from pdkv.engine.backend import Registration, TransferBackend
from pdkv.errors import TransportClosedError
from pdkv.mapping import BufferLayout
from pdkv.metrics import TransportMetrics
from pdkv.protocol import arguments
from pdkv.protocol.effects import DecodeEffect, Failure, ForgetPeer, Notice, NoticeLevel, PrefillEffect
from pdkv.protocol.ids import Epoch, RoomId
from pdkv.protocol.messages import Message, Origin, RankCoord
from pdkv.protocol.poll import KVPoll
from pdkv.runtime._accounting import Accounting
from pdkv.runtime._loop import ControlLoop, MessageChannel
from pdkv.runtime.json_log import MessageTrace

_T = TypeVar("_T")

WAIT_RECEIVES_ENV: Final = config.flag_var(
    "PDKV_WAIT_RECEIVES",
    "1: a scheduler waiting in wait_progress receives and handles the transport's messages itself "
    "(a status or request is seen without a hand-off from the control thread); 0: it sleeps",
)
"""The field metadata of both sides' ``wait_receives`` (``EndpointHost.wait_progress``)."""

_LEVELS = {
    NoticeLevel.DEBUG: logging.DEBUG,
    NoticeLevel.INFO: logging.INFO,
    NoticeLevel.WARNING: logging.WARNING,
}


def new_epoch() -> Epoch:
    """A fresh incarnation number: larger than any earlier one of this host's processes."""
    return Epoch(time.time_ns())


def peer_name(instance: str, rank: RankCoord) -> str:
    """How a peer is named in metrics: ``instance:tpN/cpM``."""
    return f"{instance}:{rank}"


def log_notice(logger: logging.Logger, notice: Notice) -> None:
    """An endpoint's notice as a log line (failures WARNING, hot-path success DEBUG: DESIGN section 8)."""
    logger.log(_LEVELS[notice.level], "%s", notice.text)


F_co = TypeVar("F_co", covariant=True)


class Endpoint(Protocol[F_co]):
    """The part of ``PrefillEndpoint`` / ``DecodeEndpoint`` the host drives, and the room queries
    both scheduler handles answer from; ``F_co`` is the side's effect union."""

    origin: Origin

    def receive(self, message: Message, now: float) -> Sequence[F_co]: ...

    def tick(self, now: float) -> Sequence[F_co]: ...

    def next_deadline(self) -> float | None: ...

    def poll(self, room: RoomId) -> KVPoll: ...

    def failure_record(self, room: RoomId) -> Failure | None: ...

    def abort_room(self, room: RoomId, reason: str, now: float) -> Sequence[F_co]: ...

    def rooms(self) -> list[RoomId]: ...


E = TypeVar("E", bound=Endpoint[Any])
F = TypeVar("F", PrefillEffect, DecodeEffect)
"""The side's effect union: ``_apply_effect`` dispatches it with ``match`` (and ``assert_never``)."""


class EndpointHost(Generic[E, F]):
    """The lock, control loop and accounting around one endpoint (see the module docstring)."""

    def __init__(
        self,
        endpoint: E,
        channel: MessageChannel,
        *,
        thread_name: str,
        logger: logging.Logger,
        clock: Callable[[], float],
    ) -> None:
        self._endpoint = endpoint
        self._clock = clock
        self._lock = threading.Lock()
        self._progress = 0  # see progress(); grows under _lock
        self._progress_waiters = 0  # under _progressed's own lock
        self._progressed = threading.Condition()
        self._local = threading.local()  # .deferring / .owed: a _locked() block notifies at its end
        self._log = logger
        self.metrics = TransportMetrics()
        """Counters and per-peer latency (``pdkv.metrics.PrometheusExporter(transport.metrics)``)."""
        self._accounting = Accounting(self.metrics)
        self._closed = False
        self._started = False
        self._registrations: list[Registration] = []
        self.stuck_writes = False
        """True when ``close()`` gave up waiting for writes to end: memory was left registered (reported)."""
        self._loop = ControlLoop(
            channel,
            name=thread_name,
            on_message=self._on_message,
            on_tick=self._on_tick,
            next_deadline=self._after_messages,
            settled=self._settled,
            clock=clock,
        )
        self._trace = MessageTrace(endpoint, lambda: self._loop.channel.address)  # PDKV_LOG_JSON
        self._locked_block = _LockedBlock(self)

    @property
    def address(self) -> str:
        """This rank's control endpoint (``tcp://host:port``)."""
        return self._loop.channel.address

    # ------------------------------------------------------------------ lifecycle (both sides)

    def _start(
        self,
        backend: TransferBackend,
        layout: BufferLayout | None,
        *,
        then: Callable[[], None] = lambda: None,
        undo: Callable[[], None] = lambda: None,
    ) -> None:
        """``start()`` of either side: register ``layout``'s buffers (None: the caller did), start the
        control thread, run ``then`` (the side's own threads, its announcement). Idempotent once it
        succeeded; on any failure ``undo`` runs, the thread stops and the memory is unregistered, so a
        failed start leaves nothing behind and may be retried."""
        self._check_open("start()")
        if self._started:
            return
        try:
            if layout is not None:
                for spec in layout.buffers:
                    self._registrations.append(backend.register_range(spec.base_ptr, spec.length))
            self._loop.start()
            then()
        except BaseException:
            undo()
            self._loop.stop(close_channel=False)
            self._unregister()
            raise
        self._started = True

    def _begin_close(self, reason: str) -> bool:
        """``close()`` of either side, first step: False when it already ran; otherwise fails every
        open room (its peers are told) and returns True."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
        with self._progressed:  # a scheduler blocked in wait_progress() learns of it now
            self._progressed.notify_all()
        self._loop.channel.wake()  # and one receiving in it (_receive_while_waiting)
        failed = self._fail_open_rooms(reason)
        if failed:
            self._log.info("%s: failed %d open room(s)", reason, failed)
        return True

    def _await_endpoint(self, done: Callable[[E], bool], seconds: float) -> bool:
        """``close()`` of either side, between its two steps: whether ``done(endpoint)`` holds, polled
        while the control thread runs (its messages are what move the endpoint on), for at most
        ``seconds``."""
        until = self._clock() + seconds
        while self._loop.alive and self._clock() < until:
            with self._lock:
                if done(self._endpoint):
                    return True
            time.sleep(0.002)
        with self._lock:
            return done(self._endpoint)

    def _finish_close(self, stuck: str | None) -> None:
        """``close()`` of either side, last step: stop the control thread and unregister the memory,
        unless ``stuck`` says why a write may still land (then the memory stays, ERROR log)."""
        self._loop.stop()
        if stuck is not None:
            self.stuck_writes = True
            self._log.error("%s: memory stays registered so no late write lands in it", stuck)
            return
        self._unregister()

    def _unregister(self) -> None:
        for registration in self._registrations:
            registration.close()
        self._registrations.clear()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ any thread

    def progress(self) -> int:
        """A counter that grows whenever a room of this transport may have changed its poll for a
        reason other than the scheduler's own calls: a message handled, a chunk's transfer reported,
        a deadline passed. Read it before polling the rooms, then ``wait_progress`` with it."""
        return self._progress

    def wait_progress(self, seen: int, timeout_s: float) -> int:
        """Block until ``progress()`` has passed ``seen`` or ``timeout_s`` elapsed; return ``progress()``.
        ``TransportClosedError`` after ``close()`` (also when the close comes while it waits).

        For a scheduler loop that would otherwise sleep between polls: it wakes as soon as something
        changed, never later than ``timeout_s``, except that a lightly loaded prefill transport first
        runs the one small chunk queued on the calling thread (``PrefillConfig.wait_runs_chunk_bytes``)
        and returns once its status left, and that a batch of messages this thread is handling when
        the time is up is handled to its end. Nothing is missed between reading ``seen`` and this
        call: a change meanwhile makes it return at once.

        With ``wait_receives`` (the config's, ``PDKV_WAIT_RECEIVES``; on by default) the calling
        thread receives and handles the transport's messages itself while it waits, instead of
        sleeping until the control thread has handled one and woken it (``ControlLoop.receive_until``):
        a status or request that arrives during the wait is seen without a hand-off."""
        timeout_s = arguments.seconds(timeout_s, argument="timeout_s")
        self._check_open("wait_progress()")
        if timeout_s > 0 and self._progress == seen:
            self._run_while_waiting()  # what a background thread would otherwise be woken for
            if self._progress == seen and self._receive_while_waiting(seen, timeout_s):
                self._check_open("wait_progress()")
                return self._progress
        with self._progressed:
            # Counted before the count is read: a notifier that did not see this waiter grew the
            # count before it was read here (the notifier grows it, then reads the waiters).
            self._progress_waiters += 1
            try:
                if timeout_s > 0:
                    self._progressed.wait_for(lambda: self._progress != seen or self._closed, timeout_s)
            finally:
                self._progress_waiters -= 1
        self._check_open("wait_progress()")  # closed while it waited: woken by close(), told so
        return self._progress

    def _locked(self) -> _LockedBlock:
        """The endpoint lock; the messages posted while it is held are sent by this thread once it is
        released (``ControlLoop.sending``): no hand-off to the control thread. A scheduler waiting
        for progress is woken after that send, not before: woken first, it would take the
        interpreter from this thread in the middle of sending (a status would wait for the poll)."""
        return self._locked_block

    def _call(self, fn: Callable[[E, float], Sequence[F]], *, what: str | None = None) -> None:
        """Run a scheduler input under the lock; ``what`` names a call refused once the transport closed."""
        with self._locked():
            if what is not None and self._closed:
                raise TransportClosedError(f"{what}: the transport is closed")
            self._apply(fn(self._endpoint, self._clock()), progressed=False)

    def _run_while_waiting(self) -> None:
        """``wait_progress``'s thread, before it sleeps and outside every lock: a side may do here
        work it would otherwise wake a background thread for (nothing by default)."""

    def _wait_receives(self) -> bool:
        """Whether ``wait_progress`` receives on the calling thread (the side's config says)."""
        return False

    def _receive_while_waiting(self, seen: int, timeout_s: float) -> bool:
        """``wait_progress``'s thread: receive and handle messages here until progress passes
        ``seen`` or the time is up; False when it did not (off, or receiving is not to be had now:
        the caller sleeps as before). What it handles wakes the other waiters as the control thread's
        batches do (``_settled``)."""
        if not self._wait_receives():
            return False
        local = self._local
        outer = getattr(local, "deferring", False)
        local.deferring = True  # as on the control thread: the loop's _settled wakes the others
        try:
            return self._loop.receive_until(lambda: self._progress != seen or self._closed, timeout_s)
        finally:
            local.deferring = outer
            if not outer and getattr(local, "owed", False):
                local.owed = False
                self._notify_progress()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise TransportClosedError(f"{what}: the transport is closed")

    def _fail_open_rooms(self, reason: str) -> int:
        """Close-time: fail every room that is not terminal and tell its peers (their messages are
        queued now and flushed before the sockets close). Returns how many rooms were failed."""
        failed = 0
        with self._lock:
            now = self._clock()
            for room in self._endpoint.rooms():
                if self._endpoint.poll(room) in (KVPoll.Success, KVPoll.Failed):
                    continue
                self._apply(self._endpoint.abort_room(room, reason, now))
                failed += 1
        return failed

    def _query(self, fn: Callable[[E], _T]) -> _T:
        with self._lock:
            return fn(self._endpoint)

    # ------------------------------------------------------------------ control thread

    def _before_receive(self, message: Message) -> None:
        """Control thread, before the endpoint sees ``message``, outside the lock (a side's engine may
        need what a message carries: the prefill hands a Register's engine metadata to its backend)."""

    def _on_message(self, message: Message, now: float) -> None:
        self._before_receive(message)
        self._local.deferring = True  # the control thread wakes waiters once settled (_settled)
        with self._lock:
            self._accounting.received(message)
            self._trace.received(message)
            self._apply(self._endpoint.receive(message, now))
            self._progressed_locked()  # even with no effect: a request may have made a room ready

    def _on_tick(self, now: float) -> float | None:
        channel = self._loop.channel.statistics()
        self._local.deferring = True  # as in _on_message
        with self._lock:
            self._accounting.channel(malformed=channel.malformed, unauthenticated=channel.unauthenticated)
            self._apply(self._endpoint.tick(now))
            self._after_tick()
            return self._endpoint.next_deadline()

    def _settled(self) -> None:
        """Control thread, after a batch of messages or a tick, its messages sent and no lock held: the
        schedulers waiting in ``wait_progress`` are woken now, once for the whole batch. Woken from
        inside a handler they would find the endpoint lock held (each handler holds it) and sleep
        on it again until the handler ended."""
        local = self._local
        if getattr(local, "owed", False):
            local.owed = False
            self._notify_progress()

    def _after_messages(self) -> float | None:
        """After a batch of messages (control thread): the next deadline; the counters and gauges of
        a tick wait for the next one."""
        with self._lock:
            return self._endpoint.next_deadline()

    # ------------------------------------------------------------------ effects (lock held)

    def _apply(self, effects: Sequence[F], *, progressed: bool = True) -> None:
        """Carry out ``effects`` in the order the endpoint emitted them (lock held); unless
        ``progressed`` is False (the scheduler's own calls), any effect counts as progress for
        ``wait_progress``."""
        if effects and progressed:
            self._progressed_locked()
        self._trace.effects(effects)
        self._accounting.effects(effects)
        for effect in effects:
            self._apply_effect(effect)

    def _log_notice(self, notice: Notice) -> None:
        log_notice(self._log, notice)

    def _forget_peer(self, effect: ForgetPeer) -> None:
        """In the outbox, in the order emitted: a message emitted after it (a RegisterAck, an Abort)
        leaves on the new socket, never on the old one that is dropped."""
        self._log.warning("rebuilding the connection to %s: %s", effect.endpoint, effect.reason)
        self._loop.post_forget(effect.endpoint)

    def _progressed_locked(self) -> None:
        self._progress += 1
        if getattr(self._local, "deferring", False):
            self._local.owed = True  # at the end of the _locked() block
        else:
            self._notify_progress()

    def _notify_progress(self) -> None:
        if self._progress_waiters:  # read after the count grew; see wait_progress
            with self._progressed:
                self._progressed.notify_all()
        self._loop.wake_borrower()  # a waiter receiving in its wait sleeps in the channel, not above

    def _apply_effect(self, effect: F) -> None:
        """One effect of the side's union, lock held (each side matches every member)."""
        raise NotImplementedError

    def _after_tick(self) -> None:
        """Lock held, on the control thread after each tick: refresh what is measured as a level."""


class _LockedBlock:
    """``EndpointHost._locked()``: one object per host, its per-entry state in the entering thread's
    locals, so the block that every step of the core runs in costs four calls, not a generator's ten."""

    __slots__ = ("_host",)

    def __init__(self, host: EndpointHost[Any, Any]) -> None:
        self._host = host

    def __enter__(self) -> None:
        host = self._host
        local = host._local  # never nested: the endpoint lock is not reentrant
        local.outer = getattr(local, "deferring", False)  # the control thread: it notifies when settled
        local.deferring = True
        local.nested_send = host._loop.begin_sending()
        try:
            host._lock.acquire()
        except BaseException:  # interrupted while it waited for the lock: as if never entered
            host._loop.end_sending(local.nested_send)
            local.deferring = local.outer
            raise

    def __exit__(self, *_: object) -> None:
        host = self._host
        local = host._local
        host._lock.release()
        try:
            host._loop.end_sending(local.nested_send)
        finally:
            outer = local.deferring = local.outer
            if not outer and getattr(local, "owed", False):
                local.owed = False
                host._notify_progress()


class RoomHandle(Generic[E, F]):
    """What ``KVSender`` and ``KVReceiver`` share: one room of one transport (no call waits on I/O)."""

    transport: EndpointHost[E, F]

    def __init__(self, transport: EndpointHost[E, F], room: RoomId) -> None:
        self.transport = transport
        self.room = room

    def poll(self) -> KVPoll:
        poll: KVPoll = self.transport._query(lambda e: e.poll(self.room))
        return poll

    def abort(self, reason: str) -> None:
        self.transport._call(lambda e, now: e.abort_room(self.room, reason, now))

    def failure(self) -> Failure | None:
        """Why the room failed (cause, reason, the peer when there is one); None unless it failed.
        ``str(failure)`` is the reason text."""
        failure: Failure | None = self.transport._query(lambda e: e.failure_record(self.room))
        return failure
