"""The control thread of a transport: it receives on its sockets, unless it lent receiving to a waiter.

Owns: ``ControlLoop`` (receive -> endpoint, outbox -> sockets, deadlines -> ``tick``) and the
``MessageChannel`` protocol it drives (implemented by ``pdkv.control``). A scheduler thread that
would sleep until a message changes a room may receive and handle the messages itself
(``receive_until``): the loop lends it receiving and keeps running the deadlines meanwhile, so a
status or a request that arrives while the scheduler waits is handled on the thread that waits for
it, not on the loop's thread that then wakes it (one hand-off less on a room's path). The loop
takes receiving back once the borrower has stayed out of its waits for ``LEND_GRACE_S``: so a
scheduler that waits again and again keeps it without a hand-over each time, and sockets are never
left unread for longer than ``LEND_SLACK_S + LEND_GRACE_S`` while nobody waits. Messages leave through the
outbox, in the order posted; so does a peer's socket being dropped (``post_forget``): a message posted
after it goes out on a fresh socket, one posted before it on the old one (dropped with it). A thread
that posts inside ``sending()`` (the transports wrap their locked sections in it) sends what it posted
itself when the block ends, after its locks are released, if the loop is waiting then: one hand-off less
on the latency of a status or a request. When the loop is busy (it will flush soon, and what piles up
meanwhile leaves in fewer frame sets), when a flush is already under way on another thread, or outside
``sending()``, the loop is woken to send instead. Sends never block (the channel drops what a full peer
queue cannot take), so a slow or dead peer can delay no thread. Messages posted for one peer between two
flushes leave together when the channel can send several in one frame set (``SendsMany``). The loop
never dies on an exception from a handler: it logs it with the traceback and goes on (a handler bug must
not wedge every room of the rank), and one message whose handler failed never costs the other messages
received with it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, runtime_checkable

from pdkv.control.channel import ChannelStatistics
from pdkv.protocol.messages import Message

log = logging.getLogger(__name__)

_MAX_IDLE_S = 0.5  # upper bound on one wait, so a stop request is noticed promptly

LEND_GRACE_S = 0.02
"""How long receiving stays lent to a thread that left its wait (``ControlLoop.receive_until``)
before the loop takes it back: a scheduler that waits again within it keeps receiving without a
hand-over. Long enough for a scheduler's gaps between its waits (between two rooms, a few
milliseconds when the machine is busy): each take-back costs a hand-over on the next wait and makes
the messages meanwhile take the loop's thread, then a wake (``pdkv bench control --rooms 1000``
run with this constant at 2 and at 20 ms: serial p99 1.6-3.2 and 1.3-3.0 ms, medians of 6
interleaved runs 2.1 and 1.5). The price: the sockets of a scheduler that stopped waiting stay
unread for up to ``LEND_SLACK_S + LEND_GRACE_S`` (30 ms); what they bring it sees at its next poll
anyway, and an abort's ack or a heartbeat's answer is that much later at most (their deadlines are
seconds)."""

LEND_SLACK_S = 0.01
"""A borrower that leaves its wait more than this before the wait's planned end tells the loop at
once; otherwise the loop notices at that end. So no socket stays unread for longer than
``LEND_SLACK_S + LEND_GRACE_S`` while nobody waits."""


class MessageChannel(Protocol):
    """A rank's control socket set, owned by one thread (see ``pdkv.control``)."""

    @property
    def address(self) -> str: ...

    def send(self, to: str, message: Message) -> object: ...

    def wait(self, timeout_s: float | None) -> list[Message]: ...

    def wake(self) -> None: ...

    def forget(self, endpoint: str) -> object: ...

    def close(self, *, flush_s: float = 0.0) -> None: ...

    def statistics(self) -> ChannelStatistics: ...


@runtime_checkable
class SendsMany(Protocol):
    """A channel that can put several messages to one peer in one frame set (``ControlChannel``)."""

    def send_many(self, to: str, messages: Sequence[Message]) -> object: ...


ChannelFactory = Callable[[str], MessageChannel]
"""Builds a rank's control channel bound on the given host (``pdkv.runtime.channels`` by default)."""


class ControlLoop:
    """Runs ``on_message`` for each received message and ``on_tick`` at the endpoint's deadlines.

    ``on_tick(now)`` returns the next deadline (monotonic seconds) or None. ``next_deadline()``, when
    given, is asked after each batch of messages instead of a whole tick (a message may have set an
    earlier deadline; the tick runs when it is due): the loop is back in its wait sooner.
    ``settled()``, when given, runs on the loop's thread once a batch of messages (or a tick) has
    been handled and what it posted sent, with no lock of the handlers held: where the transports
    wake their waiting schedulers (woken inside a handler, a scheduler would find the endpoint
    lock held and sleep again until the handler released it: two hand-offs instead of one).
    """

    def __init__(
        self,
        channel: MessageChannel,
        *,
        name: str,
        on_message: Callable[[Message, float], None],
        on_tick: Callable[[float], float | None],
        next_deadline: Callable[[], float | None] | None = None,
        settled: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.channel = channel
        self._settled = settled
        self._on_message = on_message
        self._on_tick = on_tick
        self._next_deadline = next_deadline
        self._clock = clock
        self._outbox: deque[tuple[str, Message | None]] = deque()  # None: drop the socket to it
        self._sends_many = channel if isinstance(channel, SendsMany) else None
        self._stop = threading.Event()
        self._name = name
        self._thread: threading.Thread | None = None
        self._flush_lock = threading.Lock()  # one flush at a time, so the outbox's order is kept
        self._waiting = False  # the loop is in its channel wait (read without a lock: a hint)
        self._local = threading.local()  # .deferring: this thread sends its posts itself (sending())
        # Receiving lent to a waiting thread (receive_until). _receiving is held by whichever thread
        # is in the channel's wait; the rest is under _lend.
        self._receiving = threading.Lock()
        self._lend = threading.Condition()
        self._borrower: threading.Thread | None = None
        self._borrower_inside = False
        self._borrower_until = 0.0  # the end of the borrower's current wait (time.monotonic)
        self._borrower_left_at = 0.0
        self.lends = 0
        """Times receiving was lent to a waiting thread (each hand-over, not each wait)."""
        self.handler_errors = 0
        self.flush_errors = 0
        """Flushes that failed on a posting thread (logged with the traceback; the loop's own count as
        ``handler_errors``)."""

    def start(self) -> None:
        """Start the thread (again, after ``stop(close_channel=False)``: a rolled-back start)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def post(self, to: str, message: Message) -> None:
        """Queue ``message`` for ``to`` (any thread). Inside ``sending()`` this thread sends it when the
        block ends; otherwise the loop is woken to send it."""
        self._outbox.append((to, message))
        if not getattr(self._local, "deferring", False):
            self._wake_flusher()

    def post_forget(self, to: str) -> None:
        """Drop the socket to ``to`` (and what is queued on it) at this point of the outbox: what was
        posted for ``to`` before is dropped with it, what is posted after goes out on a new socket."""
        self._outbox.append((to, None))
        if not getattr(self._local, "deferring", False):
            self._wake_flusher()

    def _wake_flusher(self) -> None:
        """Have the loop's thread (or a borrower in its wait) send what was posted."""
        self.channel.wake()
        if self._borrower is not None:  # the loop's thread sleeps on _lend, not in the channel
            with self._lend:
                self._lend.notify()

    @contextlib.contextmanager
    def sending(self) -> Iterator[None]:
        """Messages this thread posts inside the block leave when it ends: sent by this thread if the
        loop is waiting then, else by the loop, woken for it. Wrap it around a lock: ``with
        loop.sending(), lock:`` releases the lock before sending. Nested blocks send at the outermost."""
        nested = self.begin_sending()
        try:
            yield
        finally:
            self.end_sending(nested)

    def begin_sending(self) -> bool:
        """``sending()``'s start, for a caller that builds its own block around it (the transports'
        endpoint lock, on every step): True when this thread is inside such a block already."""
        local = self._local
        if getattr(local, "deferring", False):
            return True
        local.deferring = True
        return False

    def end_sending(self, nested: bool) -> None:
        """``sending()``'s end: ``nested`` is what ``begin_sending`` returned."""
        if not nested:
            self._local.deferring = False
            self._flush_or_wake()

    def _flush_or_wake(self) -> None:
        if not self._outbox:
            return
        # Only while the loop waits, or has lent receiving (then its thread sleeps and the borrower
        # flushes after its batches only): a busy loop flushes soon anyway, and what piles up
        # meanwhile leaves together (several messages to one peer in one frame set), which costs
        # both sides less than a send per message. A flush under way elsewhere may have taken its
        # messages before ours were queued: then the loop sends them too (a wake that comes while it
        # is busy ends its next wait at once).
        if not (self._waiting or self._borrower is not None) or not self._flush_lock.acquire(blocking=False):
            self._wake_flusher()
            return
        try:
            self._flush_locked()
        except Exception:
            self.flush_errors += 1
            log.exception(
                "control loop %s: sending from %s failed", self._name, threading.current_thread().name
            )
        finally:
            self._flush_lock.release()

    def stop(self, timeout_s: float = 5.0, *, close_channel: bool = True) -> None:
        """Stop the thread and (unless ``close_channel`` is False) close the channel; idempotent.
        Queued messages are flushed first."""
        self._stop.set()
        self.channel.wake()
        with self._lend:
            self._lend.notify_all()
        thread = self._thread
        if thread is not None and thread.is_alive() and threading.current_thread() is not thread:
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("control thread %s did not stop within %.1f s", self._name, timeout_s)
                return
        # A borrower sees the stop when its wait ends (woken above): the channel closes after that.
        if not self._receiving.acquire(timeout=timeout_s):
            log.warning("a thread receiving on %s did not stop within %.1f s", self._name, timeout_s)
            return
        self._receiving.release()
        if close_channel:
            # Give the last messages (a final status, an AbortAck) a moment to leave before the sockets go.
            self.channel.close(flush_s=1.0)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        self._local.deferring = True  # this thread flushes explicitly below: its posts need no wake
        next_deadline: float | None = None
        while not self._stop.is_set():
            now = self._clock()
            try:
                if next_deadline is None or next_deadline <= now:
                    next_deadline = self._on_tick(now)
                self._flush()
                self._settle()  # a tick's changes, before the wait
                timeout = (
                    _MAX_IDLE_S if next_deadline is None else max(0.0, min(_MAX_IDLE_S, next_deadline - now))
                )
                if self._lent(timeout):
                    # A borrower received meanwhile: its messages may have set an earlier deadline.
                    if self._next_deadline is not None:
                        next_deadline = _earlier(next_deadline, self._next_deadline())
                    continue
                with self._receiving:
                    if self._borrower is not None:
                        continue  # lent between the check and here: the borrower receives
                    messages = self._receive(timeout)
                # A message may have created an earlier deadline: recompute next round.
                if self._next_deadline is None:
                    next_deadline = self._on_tick(self._clock())
                elif messages:
                    next_deadline = _earlier(next_deadline, self._next_deadline())
                self._flush()
                # The batch's changes, once its replies left and this thread is done with the
                # handlers' lock (next_deadline takes it): the woken scheduler finds it free.
                self._settle()
            except Exception:
                self.handler_errors += 1
                log.exception("control loop %s: handler failed; continuing", self._name)
                next_deadline = None
                time.sleep(0.01)  # never spin hot on a persistent failure
        try:
            self._flush()
        except Exception:
            log.exception("control loop %s: final flush failed", self._name)

    def _receive(self, timeout_s: float) -> list[Message]:
        """One wait on the channel and the handling of what came (``_receiving`` held)."""
        self._waiting = True
        try:
            messages = self.channel.wait(timeout_s)
        finally:
            self._waiting = False
        # What other threads posted (the wake that ended the wait) leaves first: a status or
        # AbortAck does not wait for the inbound batch and a tick to be handled.
        self._flush()
        for message in messages:
            self._handle(message)
        self._flush()
        return messages

    def _lent(self, timeout_s: float) -> bool:
        """The loop's thread: while receiving is lent, sleep (at most ``timeout_s``, the next
        deadline's distance) and say True; take it back once the borrower has stayed out of its
        waits for ``LEND_GRACE_S`` (then, or when nothing is lent, False: receive)."""
        with self._lend:
            if self._borrower is None:
                return False
            now = time.monotonic()
            if self._borrower_inside:  # it says when it leaves before its wait's end
                self._lend.wait(min(timeout_s, max(0.0, self._borrower_until - now) + LEND_GRACE_S))
                return True
            out_for = now - self._borrower_left_at
            if out_for >= LEND_GRACE_S or not self._borrower.is_alive():
                self._borrower = None
                return False
            self._lend.wait(min(timeout_s, LEND_GRACE_S - out_for))
            return True

    def receive_until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """On the calling thread, receive and handle messages as the loop's thread would, until
        ``done()`` is true, ``timeout_s`` has passed or the loop stops. False, having done nothing,
        when receiving cannot be lent now (the loop is not running, this is its thread, or another
        thread has it): the caller waits as it would have. The loop keeps running the deadlines;
        receiving goes back to it ``LEND_GRACE_S`` after this thread's last such call ended.
        Handling a batch of messages may take this call past ``timeout_s``."""
        me = threading.current_thread()
        thread = self._thread
        if thread is None or me is thread or self._stop.is_set() or not thread.is_alive():
            return False
        with self._lend:
            if self._borrower is not None and self._borrower is not me:
                return False
            take_over = self._borrower is None
            deadline = time.monotonic() + timeout_s
            self._borrower = me
            self._borrower_inside = True
            self._borrower_until = deadline
        try:
            if take_over:
                self.lends += 1
                self.channel.wake()  # the loop leaves its wait, finds receiving lent, sleeps
            if not self._receiving.acquire(timeout=timeout_s):
                return True  # the loop did not hand over in time (busy with a batch): the time is up
            local = self._local
            outer = getattr(local, "deferring", False)
            local.deferring = True  # posts leave in this thread's flushes, as on the loop's thread
            try:
                while not done() and not self._stop.is_set():
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._receive(remaining)
                    self._settle()
            except Exception:  # as on the loop's thread: logged, and the caller's wait goes on
                self.handler_errors += 1
                log.exception("control loop %s: receiving on %s failed", self._name, me.name)
            finally:
                local.deferring = outer
                self._receiving.release()
        finally:
            with self._lend:
                self._borrower_inside = False
                self._borrower_left_at = left_at = time.monotonic()
                if self._borrower_until - left_at > LEND_SLACK_S:
                    # The loop sleeps until the wait's planned end: the grace starts now instead. A
                    # wait left nearly on time is not worth waking it (that wake would compete with
                    # this thread, which has just got what it waited for).
                    self._lend.notify()
        return True

    def wake_borrower(self) -> None:
        """End the wait of a thread receiving in ``receive_until`` (not the calling one), so it checks
        its ``done()`` now: another thread made the progress it waits for (a transfer worker's
        status, a verifier's verdict). Read without the lock: the borrower marks itself inside
        before it checks ``done()``, and a wake that comes before its channel wait ends that wait."""
        if self._borrower_inside and self._borrower is not threading.current_thread():
            self.channel.wake()

    def _settle(self) -> None:
        if self._settled is not None:
            self._settled()

    def _handle(self, message: Message) -> None:
        """One received message; a failing handler costs that message only, not the batch."""
        try:
            self._on_message(message, self._clock())
        except Exception:
            self.handler_errors += 1
            log.exception(
                "control loop %s: handling %s from %s failed; continuing",
                self._name,
                type(message).__name__,
                getattr(message, "origin", "?"),
            )

    def _flush(self) -> None:
        if self._outbox:
            with self._flush_lock:
                self._flush_locked()

    def _flush_locked(self) -> None:
        """Send what was posted (``_flush_lock`` held), and drop the sockets asked for, in order. With a
        channel that can, the messages posted for one peer between two drops leave in one frame set
        (in posting order; one message goes alone as before)."""
        by_peer: dict[str, list[Message]] = {}
        while self._outbox:
            to, message = self._outbox.popleft()
            if message is None:
                self._send_grouped(by_peer)  # everything posted before the drop goes first
                by_peer = {}
                self.channel.forget(to)
            elif self._sends_many is None:
                self.channel.send(to, message)
            else:
                by_peer.setdefault(to, []).append(message)
        self._send_grouped(by_peer)

    def _send_grouped(self, by_peer: dict[str, list[Message]]) -> None:
        for to, messages in by_peer.items():
            if len(messages) == 1 or self._sends_many is None:
                for message in messages:
                    self.channel.send(to, message)
            else:
                self._sends_many.send_many(to, messages)


def _earlier(planned: float | None, due: float | None) -> float | None:
    if due is not None and (planned is None or due < planned):
        return due
    return planned
