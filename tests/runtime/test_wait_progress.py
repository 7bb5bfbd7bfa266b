"""``wait_progress``: a scheduler that waits between polls wakes when a room changed, not at its timeout."""

from __future__ import annotations

import threading
import time

import numpy as np

from pdkv.protocol.ids import RoomId
from pdkv.protocol.poll import KVPoll
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
