"""ReadyWaiter and wait_ready: chunks with a GPU event wait off the caller's thread (no SGLang, no GPU).

Events here are stand-ins with CUDA's ``query()`` / ``synchronize()``, completed by the test.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from pdkv.adapters.sglang.ready import DeferredChunk, ReadyWaiter, wait_ready
from pdkv.errors import InvalidArgumentError, TransportClosedError


class Event:
    """Completes when the test calls ``complete()``; records the threads that asked."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.asked_from: set[int] = set()

    def query(self) -> bool:
        self.asked_from.add(threading.get_ident())
        return self.done.is_set()

    def complete(self) -> None:
        self.done.set()


class Log:
    def __init__(self) -> None:
        self.sent: list[str] = []
        self.failed: list[str] = []
        self.threads: set[int] = set()
        self.idle = threading.Event()

    def chunk(
        self,
        room: int,
        name: str,
        *events: object,
        cancelled: Callable[[], bool] = lambda: False,
        raises: Exception | None = None,
    ) -> DeferredChunk:
        def send() -> None:
            self.threads.add(threading.get_ident())
            if raises is not None:
                raise raises
            self.sent.append(name)

        return DeferredChunk(
            room=room, events=events, send=send, fail=self.failed.append, cancelled=cancelled
        )


def settle(waiter: ReadyWaiter, *rooms: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(waiter.pending(r) for r in rooms):
        assert time.monotonic() < deadline, "deferred chunks did not settle"
        time.sleep(0.005)


def test_wait_ready_polls_query_and_gives_up_at_the_timeout() -> None:
    event = Event()
    t0 = time.monotonic()
    assert wait_ready(event, timeout_s=0.05) is False
    assert time.monotonic() - t0 >= 0.05
    event.complete()
    assert wait_ready(event, timeout_s=0.05) is True


def test_wait_ready_accepts_synchronize_only_and_callables() -> None:
    calls: list[str] = []

    class SyncOnly:
        def synchronize(self) -> None:
            calls.append("sync")

    assert wait_ready(SyncOnly(), 1.0) and wait_ready(lambda: calls.append("call"), 1.0)
    assert calls == ["sync", "call"]
    with pytest.raises(InvalidArgumentError, match="not a ready event"):
        wait_ready(object(), 1.0)


def test_no_thread_until_a_chunk_waits() -> None:
    waiter = ReadyWaiter(5.0)
    assert not waiter.started and not waiter.pending(1)
    waiter.close()
    assert not waiter.started


def test_a_chunk_goes_only_after_its_event_and_off_the_submitting_thread() -> None:
    waiter = ReadyWaiter(5.0)
    log = Log()
    event = Event()
    waiter.submit(log.chunk(1, "a", event))
    waiter.submit(log.chunk(1, "b"))  # no event of its own: queued behind "a" (same room)
    time.sleep(0.1)
    assert log.sent == [] and waiter.pending(1)
    assert event.asked_from and threading.get_ident() not in event.asked_from
    event.complete()
    settle(waiter, 1)
    assert log.sent == ["a", "b"] and log.failed == []
    assert threading.get_ident() not in log.threads
    waiter.close()


def test_a_cancelled_room_is_dropped_unsent_and_unfailed() -> None:
    waiter = ReadyWaiter(5.0)
    log = Log()
    event = Event()
    aborted = threading.Event()
    waiter.submit(log.chunk(2, "x", event, cancelled=aborted.is_set))
    aborted.set()
    event.complete()
    settle(waiter, 2)
    assert log.sent == [] and log.failed == []
    waiter.close()


def test_an_event_that_never_completes_fails_the_room_and_the_thread_lives_on() -> None:
    waiter = ReadyWaiter(0.05)
    log = Log()
    waiter.submit(log.chunk(3, "stuck", Event()))
    waiter.submit(log.chunk(4, "refused", raises=ValueError("page 9 out of range")))
    waiter.submit(log.chunk(5, "fine"))
    settle(waiter, 3, 4, 5)
    assert log.failed == [
        "room 3: GPU event not complete after 0.05 s",
        "room 4: ValueError: page 9 out of range",
    ]
    assert log.sent == ["fine"]
    waiter.close()


def test_close_fails_what_is_still_queued() -> None:
    waiter = ReadyWaiter(5.0)
    log = Log()
    first = Event()
    waiter.submit(log.chunk(6, "waiting", first))
    waiter.submit(log.chunk(7, "queued"))
    time.sleep(0.05)
    closer = threading.Thread(target=waiter.close)
    closer.start()
    time.sleep(0.05)
    first.complete()
    closer.join(5)
    assert log.failed == ["the SGLang manager closed before the chunk's GPU event completed"]
    assert log.sent == ["waiting"]
    with pytest.raises(TransportClosedError, match=r"room 8: send\(\) after the SGLang manager closed"):
        waiter.submit(log.chunk(8, "late"))
