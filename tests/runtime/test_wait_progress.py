"""``wait_progress``: a scheduler that waits between polls wakes when a room changed, not at its timeout."""

from __future__ import annotations

import threading
import time
from typing import Any

import attrs
import numpy as np

from pdkv.protocol.ids import RoomId
from pdkv.protocol.poll import KVPoll
from pdkv.runtime._host import EndpointHost
from pdkv.testing.synthetic import ModelSpec
from pdkv.testing.transport_pair import TransportPair
from tests.runtime.rig import wait_for

MODEL = ModelSpec(layers=2, page_size=16, state_layers=(), state_kinds=(), draft_layers=0)
LONG_S = 60.0  # a wait that ran to this would fail the test's own bound below


def test_both_schedulers_are_woken_by_the_changes_of_their_room() -> None:
    with TransportPair(model=MODEL) as pair:
        room = RoomId(3)
        prefill = pair.prefills[0]
        receiver = pair.decode.receiver(room, pair.prefill_instance)
        sender = prefill.sender(room)
        decode_polls: list[KVPoll] = []
        decode_waits: list[tuple[int, int]] = []

        def decode_scheduler() -> None:
            seen = pair.decode.progress()
            while (poll := receiver.poll()) not in (KVPoll.Success, KVPoll.Failed):
                decode_polls.append(poll)
                after = pair.decode.wait_progress(seen, LONG_S)
                decode_waits.append((seen, after))
                seen = after

        thread = threading.Thread(target=decode_scheduler)
        receiver.init(np.array([4, 5]), None)
        thread.start()
        started = time.monotonic()
        seen = prefill.progress()
        sender.init(2, None)
        while sender.poll() is not KVPoll.WaitingForInput:  # woken by the decode's TransferRequest
            after = prefill.wait_progress(seen, LONG_S)
            assert after > seen, "the wait ran to its timeout"
            seen = after
        sender.send(np.array([0, 1]), start_token=0, last=True)
        while sender.poll() is not KVPoll.Success:  # woken by the worker's report
            after = prefill.wait_progress(seen, LONG_S)
            assert after > seen, "the wait ran to its timeout"
            seen = after
        thread.join(LONG_S)
        assert not thread.is_alive()
        assert receiver.poll() is KVPoll.Success
        assert decode_waits and all(after > seen for seen, after in decode_waits)
        assert time.monotonic() - started < LONG_S / 2


def test_a_wait_with_nothing_happening_returns_the_same_count_at_its_timeout() -> None:
    with TransportPair(model=MODEL) as pair:
        seen = pair.decode.progress()
        started = time.monotonic()
        assert pair.decode.wait_progress(seen, 0.2) == seen
        assert time.monotonic() - started >= 0.19


def test_a_change_before_the_wait_is_not_missed() -> None:
    with TransportPair(model=MODEL) as pair:
        room = RoomId(4)
        seen = pair.prefills[0].progress()
        pair.prefills[0].sender(room).init(1, None)
        pair.decode.receiver(room, pair.prefill_instance).init(np.array([1]), None)
        # The TransferRequest reaches the prefill before it waits: the wait returns at once.
        wait_for(lambda: pair.prefills[0].progress() > seen)
        started = time.monotonic()
        assert pair.prefills[0].wait_progress(seen, LONG_S) > seen
        assert time.monotonic() - started < LONG_S / 2


def test_a_scheduler_blocked_in_wait_progress_is_woken_by_its_room_succeeding() -> None:
    """Woken by the transfer worker's Success (the worker reports under the deferred-notify lock),
    long before the wait's own timeout."""
    with TransportPair(model=MODEL) as pair:
        room = RoomId(9)
        prefill = pair.prefills[0]
        receiver = pair.decode.receiver(room, pair.prefill_instance)
        receiver.init(np.array([6, 7]), None)
        sender = prefill.sender(room)
        sender.init(2, None)
        wait_for(lambda: sender.poll() is KVPoll.WaitingForInput)
        woke: list[tuple[float, KVPoll]] = []

        def scheduler() -> None:
            seen = prefill.progress()
            started = time.monotonic()
            while sender.poll() is not KVPoll.Success and time.monotonic() - started < LONG_S:
                seen = prefill.wait_progress(seen, LONG_S)
            woke.append((time.monotonic() - started, sender.poll()))

        thread = threading.Thread(target=scheduler)
        thread.start()
        time.sleep(0.05)  # blocked in its wait by now
        sender.send(np.array([0, 1]), start_token=0, last=True)
        thread.join(LONG_S)
        [(elapsed, poll)] = woke
        assert poll is KVPoll.Success and elapsed < LONG_S / 4


class _OwnedLock:
    """The endpoint lock, knowing which thread holds it."""

    def __init__(self, inner: threading.Lock) -> None:
        self._inner = inner
        self.owner: int | None = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._inner.acquire(blocking, timeout)
        if got:
            self.owner = threading.get_ident()
        return got

    def release(self) -> None:
        self.owner = None
        self._inner.release()

    def locked(self) -> bool:
        return self._inner.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *_: object) -> None:
        self.release()


class _Notifications(threading.Condition):
    """``_progressed``, recording for each wake-up whether the waking thread held the endpoint lock."""

    def __init__(self, lock: _OwnedLock) -> None:
        super().__init__()
        self._endpoint_lock = lock
        self.under_lock: list[tuple[str, bool]] = []

    def notify_all(self) -> None:
        held = self._endpoint_lock.owner == threading.get_ident()
        self.under_lock.append((threading.current_thread().name, held))
        super().notify_all()


def test_a_waiting_scheduler_is_woken_once_the_endpoint_lock_is_free() -> None:
    """The control thread wakes a scheduler in ``wait_progress`` after it handled the message (the
    decode's TransferRequest on the prefill, the status on the decode), never from inside the
    handler: woken there, the scheduler's poll would find the lock held and sleep on it again. (With
    ``wait_receives`` off: on, the schedulers handle those messages themselves, test_wait_receives.)"""
    pair = TransportPair(model=MODEL)
    hosts: list[EndpointHost[Any, Any]] = [pair.prefills[0], pair.decode]
    notes: list[_Notifications] = []
    pair.prefills[0].config = attrs.evolve(pair.prefills[0].config, wait_receives=False)
    pair.decode.config = attrs.evolve(pair.decode.config, wait_receives=False)
    for host in hosts:
        lock = _OwnedLock(host._lock)
        host._lock = lock  # type: ignore[assignment]  # before start: every thread takes this one
        note = _Notifications(lock)
        host._progressed = note
        notes.append(note)
    with pair:
        room = RoomId(11)
        prefill = pair.prefills[0]
        receiver = pair.decode.receiver(room, pair.prefill_instance)
        sender = prefill.sender(room)
        sender.init(2, None)
        done: list[KVPoll] = []

        def decode_scheduler() -> None:
            seen = pair.decode.progress()
            started = time.monotonic()
            while (
                receiver.poll() not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() - started < LONG_S
            ):
                seen = pair.decode.wait_progress(seen, LONG_S)
            done.append(receiver.poll())

        def prefill_scheduler() -> None:
            seen = prefill.progress()
            started = time.monotonic()
            while sender.poll() is not KVPoll.WaitingForInput and time.monotonic() - started < LONG_S:
                seen = prefill.wait_progress(seen, LONG_S)  # woken by the TransferRequest
            done.append(sender.poll())

        schedulers = [threading.Thread(target=decode_scheduler), threading.Thread(target=prefill_scheduler)]
        for thread in schedulers:
            thread.start()
        time.sleep(0.05)  # both blocked in their waits by now
        receiver.init(np.array([2, 3]), None)
        schedulers[1].join(LONG_S)
        sender.send(np.array([0, 1]), start_token=0, last=True)
        schedulers[0].join(LONG_S)
        assert sorted(done) == [KVPoll.WaitingForInput, KVPoll.Success]
    for note in notes:
        control = [held for name, held in note.under_lock if name.startswith(("pdkv-prefill", "pdkv-decode"))]
        assert control, "the control thread woke no waiter"
        assert not any(control), note.under_lock
