"""``wait_receives``: a scheduler waiting in ``wait_progress`` handles the messages it waits for on its
own thread (the control thread lends it receiving), and receiving goes back to the control thread
once nobody waits (#31: one thread hand-off less on the path of a request and of a status)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import pytest

from pdkv.errors import TransportClosedError
from pdkv.protocol.ids import RoomId
from pdkv.protocol.messages import Message, TransferRequest, TransferStatus
from pdkv.protocol.poll import KVPoll
from pdkv.runtime._host import EndpointHost
from pdkv.runtime._loop import LEND_GRACE_S, LEND_SLACK_S, ControlLoop
from pdkv.runtime.decode import KVReceiver
from pdkv.runtime.prefill import KVSender
from pdkv.testing.synthetic import ModelSpec
from pdkv.testing.transport_pair import TransportPair
from tests.runtime.rig import wait_for
from tests.runtime.stub_channel import StubChannel

MODEL = ModelSpec(layers=2, page_size=16, state_layers=(), state_kinds=(), draft_layers=0)
LONG_S = 60.0


def _record_handlers(host: EndpointHost[Any, Any]) -> list[tuple[str, str]]:
    """(message type, thread) of each message the host's endpoint receives, in order."""
    handled: list[tuple[str, str]] = []
    receive: Callable[[Message, float], Sequence[object]] = host._endpoint.receive

    def recording(message: Message, now: float) -> Sequence[object]:
        handled.append((type(message).__name__, threading.current_thread().name))
        return receive(message, now)

    setattr(host._endpoint, "receive", recording)  # noqa: B010  # instrumentation of this test
    return handled


def _threads_of(handled: list[tuple[str, str]], kind: type) -> set[str]:
    return {thread for name, thread in handled if name == kind.__name__}


@pytest.mark.parametrize("channel", ["memory", "stream", "zmq"])
@pytest.mark.parametrize("wait_receives", [True, False], ids=["receiving", "sleeping"])
def test_the_waiting_schedulers_handle_the_request_and_the_status(
    channel: str, wait_receives: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On, the prefill's TransferRequest is handled by the prefill scheduler that waits for
    WaitingForInput and the status by the decode scheduler that waits for Success; off (the
    control), both by the control threads, which then wake the schedulers. Over each channel kind
    (zmq sockets change threads between receive calls: the claim's lock is their memory barrier)."""
    if channel != "memory":
        monkeypatch.setenv("PDKV_CONTROL_CHANNEL", channel)
    pair = TransportPair(model=MODEL, sockets=channel != "memory")
    prefill, decode = pair.prefills[0], pair.decode
    prefill.config = attrs.evolve(prefill.config, wait_receives=wait_receives)
    decode.config = attrs.evolve(decode.config, wait_receives=wait_receives)
    prefill_handled, decode_handled = _record_handlers(prefill), _record_handlers(decode)
    with pair:
        room = RoomId(5)
        receiver = decode.receiver(room, pair.prefill_instance)
        sender = prefill.sender(room)
        sender.init(2, None)
        done: list[KVPoll] = []

        def decode_scheduler() -> None:
            seen = decode.progress()
            started = time.monotonic()
            while (
                receiver.poll() not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() - started < LONG_S
            ):
                seen = decode.wait_progress(seen, LONG_S)
            done.append(receiver.poll())

        def prefill_scheduler() -> None:
            seen = prefill.progress()
            started = time.monotonic()
            while sender.poll() is not KVPoll.WaitingForInput and time.monotonic() - started < LONG_S:
                seen = prefill.wait_progress(seen, LONG_S)
            done.append(sender.poll())

        schedulers = [
            threading.Thread(target=decode_scheduler, name="decode-scheduler"),
            threading.Thread(target=prefill_scheduler, name="prefill-scheduler"),
        ]
        for thread in schedulers:
            thread.start()
        time.sleep(0.05)  # both in their waits by now
        receiver.init(np.array([2, 3]), None)
        schedulers[1].join(LONG_S)
        sender.send(np.array([0, 1]), start_token=0, last=True)
        schedulers[0].join(LONG_S)
        assert sorted(done) == [KVPoll.WaitingForInput, KVPoll.Success]
        lends = (prefill.statistics().receive_lends, decode.statistics().receive_lends)
    requests, statuses = (
        _threads_of(prefill_handled, TransferRequest),
        _threads_of(decode_handled, TransferStatus),
    )
    if wait_receives:
        assert requests == {"prefill-scheduler"} and statuses == {"decode-scheduler"}
        assert lends[0] >= 1 and lends[1] >= 1
    else:
        assert requests == {"pdkv-prefill-tp0/cp0"} and statuses == {"pdkv-decode-tp0/cp0"}
        assert lends == (0, 0)


def test_receiving_goes_back_to_the_control_thread_once_nobody_waits() -> None:
    """A scheduler that waited once and then only polls: the next room's messages are handled by the
    control thread (no socket stays unread while nobody waits), and the room succeeds."""
    with TransportPair(model=MODEL) as pair:
        prefill, decode = pair.prefills[0], pair.decode
        handled = _record_handlers(decode)
        decode.wait_progress(decode.progress(), 0.01)  # this thread borrows receiving, then leaves
        assert decode._loop.lends == 1
        time.sleep(LEND_SLACK_S + 10 * LEND_GRACE_S)
        room = RoomId(6)
        receiver = decode.receiver(room, pair.prefill_instance)
        sender = prefill.sender(room)
        sender.init(2, None)
        receiver.init(np.array([2, 3]), None)
        wait_for(lambda: sender.poll() is KVPoll.WaitingForInput, LONG_S)
        sender.send(np.array([0, 1]), start_token=0, last=True)
        wait_for(lambda: receiver.poll() is KVPoll.Success, LONG_S)  # polled, never waited
    assert _threads_of(handled, TransferStatus) == {"pdkv-decode-tp0/cp0"}


@pytest.mark.parametrize("channel", ["memory", "stream", "zmq"])
def test_close_ends_a_wait_that_receives(channel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A scheduler receiving in ``wait_progress`` learns of ``close()`` at once (TransportClosedError),
    and the close does not wait for its long timeout."""
    if channel != "memory":
        monkeypatch.setenv("PDKV_CONTROL_CHANNEL", channel)
    pair = TransportPair(model=MODEL, sockets=channel != "memory")
    errors: list[BaseException] = []
    with pair:
        decode = pair.decode
        inside = threading.Event()

        def scheduler() -> None:
            inside.set()
            try:
                decode.wait_progress(decode.progress(), LONG_S)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=scheduler)
        thread.start()
        assert inside.wait(5.0)
        wait_for(lambda: decode._loop.lends == 1, 10.0)
        started = time.monotonic()
        decode.close()
        thread.join(LONG_S)
        assert not thread.is_alive()
        assert time.monotonic() - started < LONG_S / 4
    assert len(errors) == 1 and isinstance(errors[0], TransportClosedError)


def _requested_while_receiving(pair: TransportPair, room: RoomId) -> tuple[KVSender, KVReceiver, int]:
    """``room`` opened on both sides, the prefill's poll brought to WaitingForInput by waits on this
    thread (so this thread holds the prefill's receiving); returns the two handles and the progress seen."""
    prefill, decode = pair.prefills[0], pair.decode
    receiver = decode.receiver(room, pair.prefill_instance)
    sender = prefill.sender(room)
    sender.init(2, None)
    receiver.init(np.array([2, 3]), None)
    seen = prefill.progress()
    while sender.poll() is not KVPoll.WaitingForInput:
        seen = prefill.wait_progress(seen, LONG_S)
    return sender, receiver, seen


def test_a_status_leaves_from_the_worker_while_receiving_is_lent() -> None:
    """The prefill scheduler borrowed receiving and then stopped waiting: the status a transfer worker
    posts is sent by that worker at once, not left for the control thread, which sleeps while it has
    lent receiving (it was, before the worker's flush took the lent case: ``status sent`` moved to
    the control thread in ``pdkv bench latency``)."""
    with TransportPair(model=MODEL) as pair:
        prefill = pair.prefills[0]
        prefill.config = attrs.evolve(prefill.config, wait_runs_chunk_bytes=0)  # a worker runs it
        channel = prefill._loop.channel
        send = channel.send
        senders: list[tuple[str, str]] = []

        def recording(to: str, message: Message) -> object:
            senders.append((type(message).__name__, threading.current_thread().name))
            return send(to, message)

        setattr(channel, "send", recording)  # noqa: B010  # instrumentation of this test
        sender, receiver, _ = _requested_while_receiving(pair, RoomId(7))
        assert prefill._loop.lends >= 1
        sender.send(np.array([0, 1]), start_token=0, last=True)
        wait_for(lambda: receiver.poll() is KVPoll.Success, LONG_S)  # polled, never waited
    statuses = {thread for name, thread in senders if name == TransferStatus.__name__}
    assert len(statuses) == 1 and statuses.pop().startswith("pdkv-transfer-"), senders


def test_the_loop_runs_the_deadlines_while_a_waiter_receives() -> None:
    """Receiving lent for a long wait: the endpoint's deadlines still run on time, on the loop's own
    thread (a borrower only receives)."""
    ticks: list[tuple[float, str]] = []

    def on_tick(now: float) -> float:
        ticks.append((now, threading.current_thread().name))
        return now + 0.02

    loop = ControlLoop(StubChannel(), name="loop", on_message=lambda m, now: None, on_tick=on_tick)
    loop.start()
    try:
        wait_for(lambda: len(ticks) >= 1, 10.0)
        started = time.monotonic()
        assert loop.receive_until(lambda: False, 0.5)
        assert time.monotonic() - started >= 0.45
        during = [name for at, name in ticks if started <= at <= started + 0.5]
        assert len(during) >= 5 and set(during) == {"loop"}
        assert loop.lends == 1
    finally:
        loop.stop()
    assert not loop.receive_until(lambda: False, 0.1)  # stopped: nothing lent, the caller sleeps


def test_a_waiter_that_receives_is_woken_by_a_transfer_worker() -> None:
    """Progress another thread makes (a transfer worker's status: the waiting scheduler does not run
    the chunk here) ends a wait that receives at once, not at its timeout: the waiter sleeps in the
    channel's wait, where the condition's notify does not reach (it did not, before
    ``ControlLoop.wake_borrower``: this wait ran its whole timeout)."""
    with TransportPair(model=MODEL) as pair:
        prefill = pair.prefills[0]
        prefill.config = attrs.evolve(prefill.config, wait_runs_chunk_bytes=0)  # a worker runs it
        sender, _, seen = _requested_while_receiving(pair, RoomId(8))
        sender.send(np.array([0, 1]), start_token=0, last=True)
        started = time.monotonic()
        while sender.poll() is not KVPoll.Success and time.monotonic() - started < LONG_S:
            seen = prefill.wait_progress(seen, LONG_S)
        assert sender.poll() is KVPoll.Success
        # Woken, it returns in milliseconds; unwoken, only the pair's next periodic message (5 s
        # here) or the timeout ended it.
        assert time.monotonic() - started < 2.5, "the wait slept past the worker's status"
        assert prefill._loop.lends >= 1


def test_a_scheduler_back_in_its_wait_within_the_grace_keeps_receiving() -> None:
    """A scheduler out of its waits for a few milliseconds (between two rooms) finds receiving still
    lent when it waits again: no hand-over back and forth (``receive_lends`` counts hand-overs).
    5 ms: a gap the previous 2 ms grace turned into a take-back and a new hand-over."""
    gap_s = 0.005
    assert gap_s < LEND_GRACE_S / 2
    with TransportPair(model=MODEL) as pair:
        decode = pair.decode
        for _attempt in range(5):  # a gap the machine stretched past the grace proves nothing: again
            decode.wait_progress(decode.progress(), 0.001)
            lends = decode.statistics().receive_lends
            assert lends >= 1  # receiving was lent (else no hand-over could be counted at all)
            left = time.monotonic()
            time.sleep(gap_s)
            decode.wait_progress(decode.progress(), 0.001)
            if time.monotonic() - left < LEND_GRACE_S / 2:
                break
            time.sleep(LEND_SLACK_S + 2 * LEND_GRACE_S)  # let the loop take receiving back first
        assert decode.statistics().receive_lends == lends
