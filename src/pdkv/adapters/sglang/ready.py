"""Chunks whose bytes (or page ids) a GPU stream is still writing: wait for them off the scheduler thread.

SGLang hands a sender two kinds of CUDA events (0.5.23, ``disaggregation/prefill.py``):

- ``sender._early_send_wait_event`` (set as an attribute before ``send``): under overlap scheduling an
  early send of the cached prefix may be issued while the previous forward still writes those pages;
  the source KV may be read only once the event completed;
- ``send(..., indices_event=...)``, only to a sender whose ``supports_host_tensor_indices`` is true: the
  page ids arrive as a pinned host tensor filled by a non-blocking copy; they are valid only once the
  event completed.

pdkv's ``KVSender.send`` takes the pages at once and its engine reads the source when it submits, so a
chunk with an event goes through ``ReadyWaiter``: one thread per prefill rank, started on first use,
that waits for the chunk's events and only then hands it to pdkv. A room keeps its order: once one of
its chunks waits, its later chunks queue behind it. Without events nothing waits and no thread starts
(the CPU case). Owns ``ReadyWaiter`` and ``wait_ready``; must not import SGLang or torch (an event is
anything with ``query()`` / ``synchronize()``, or a callable), and must not call pdkv with its own lock
held.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Final

import attrs

from pdkv.errors import InvalidArgumentError, TransportClosedError

log = logging.getLogger(__name__)

_FIRST_SLEEP_S: Final = 20e-6
_MAX_SLEEP_S: Final = 500e-6


def wait_ready(event: object, timeout_s: float) -> bool:
    """Wait until ``event`` completed; False when it did not within ``timeout_s``.

    An object with ``query()`` (CUDA events) is polled with short sleeps, so a stuck stream cannot hold
    the waiter forever; one with only ``synchronize()`` is synchronized; a callable is called.
    """
    query = getattr(event, "query", None)
    if callable(query):
        deadline = time.monotonic() + timeout_s
        sleep = _FIRST_SLEEP_S
        while not query():
            if time.monotonic() >= deadline:
                return False
            time.sleep(sleep)
            sleep = min(sleep * 2, _MAX_SLEEP_S)
        return True
    synchronize = getattr(event, "synchronize", None)
    if callable(synchronize):
        synchronize()
        return True
    if callable(event):
        event()
        return True
    raise InvalidArgumentError(
        f"not a ready event (no query(), synchronize() or call): {event!r}", argument="event", value=event
    )


@attrs.frozen(kw_only=True)
class DeferredChunk:
    """One chunk held until its events completed.

    ``send`` hands it to pdkv; ``fail(reason)`` is called instead when a wait timed out or raised, or
    ``send`` raised; ``cancelled()`` true (the room failed or was aborted meanwhile) drops it unsent.
    """

    room: int
    events: tuple[object, ...]
    send: Callable[[], None]
    fail: Callable[[str], None]
    cancelled: Callable[[], bool]


class ReadyWaiter:
    """One prefill rank's waiting thread: deferred chunks in arrival order, each sent once ready."""

    def __init__(self, timeout_s: float, *, name: str = "pdkv-sglang-ready") -> None:
        self.timeout_s = float(timeout_s)
        self._name = name
        self._queue: deque[DeferredChunk] = deque()
        self._pending: dict[int, int] = {}  # room -> chunks queued or being waited on
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def pending(self, room: int) -> bool:
        """Does ``room`` have a chunk not yet handed to pdkv? (Its next chunk must then queue too.)"""
        with self._cond:
            return self._pending.get(room, 0) > 0

    @property
    def started(self) -> bool:
        return self._thread is not None

    def submit(self, chunk: DeferredChunk) -> None:
        with self._cond:
            if self._closed:
                raise TransportClosedError(f"room {chunk.room}: send() after the SGLang manager closed")
            self._queue.append(chunk)
            self._pending[chunk.room] = self._pending.get(chunk.room, 0) + 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop after the chunk being waited on; chunks still queued are failed ("transport closing")."""
        with self._cond:
            self._closed = True
            dropped = list(self._queue)
            self._queue.clear()
            self._cond.notify()
            thread = self._thread
        for chunk in dropped:
            self._settle(chunk, "the SGLang manager closed before the chunk's GPU event completed")
        if thread is not None:
            thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                chunk = self._queue.popleft()
            self._settle(chunk, None)

    def _settle(self, chunk: DeferredChunk, refused: str | None) -> None:
        try:
            if refused is not None:
                chunk.fail(refused)
            elif not chunk.cancelled():
                reason = self._wait(chunk.events)
                if reason is not None:
                    chunk.fail(f"room {chunk.room}: {reason}")
                elif not chunk.cancelled():
                    chunk.send()
        except Exception as exc:  # a pdkv refusal or an event that raised: the room fails, the thread lives
            log.warning("room %d: deferred chunk failed: %s", chunk.room, exc)
            try:
                chunk.fail(f"room {chunk.room}: {type(exc).__name__}: {exc}")
            except Exception:
                log.exception("room %d: failing the room raised", chunk.room)
        finally:
            with self._cond:
                left = self._pending.get(chunk.room, 0) - 1
                if left > 0:
                    self._pending[chunk.room] = left
                else:
                    self._pending.pop(chunk.room, None)

    def _wait(self, events: Sequence[object]) -> str | None:
        for event in events:
            if not wait_ready(event, self.timeout_s):
                return f"GPU event not complete after {self.timeout_s:g} s"
        return None
