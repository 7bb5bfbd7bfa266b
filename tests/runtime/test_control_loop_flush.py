"""The control loop sends the messages posted for one peer together when its channel can."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from pdkv.protocol.ids import Epoch, InstanceId
from pdkv.protocol.messages import Heartbeat, Message, Origin, RankCoord
from pdkv.runtime._loop import ControlLoop
from tests.runtime.rig import wait_for
from tests.runtime.stub_channel import StubChannel

ORIGIN = Origin(instance=InstanceId("x"), epoch=Epoch(1), rank=RankCoord(tp=0))


class _RecordingMany(StubChannel):
    """A stub channel that can send several messages in one call, recorded as one entry."""

    def send_many(self, to: str, messages: Sequence[Message]) -> None:
        self.calls.append((to, list(messages)))


def _flushed(channel: StubChannel, posts: list[tuple[str, int]]) -> list[tuple[str, list[int]]]:
    loop = ControlLoop(channel, name="t", on_message=lambda m, now: None, on_tick=lambda now: None)
    for to, seq in posts:  # posted before the thread runs: one flush finds them all
        loop.post(to, Heartbeat(origin=ORIGIN, seq=seq))
    loop.start()
    deadline = time.monotonic() + 5
    while sum(len(m) for _, m in channel.calls) < len(posts) and time.monotonic() < deadline:
        time.sleep(0.005)
    loop.stop()
    return [(to, [m.seq for m in messages if isinstance(m, Heartbeat)]) for to, messages in channel.calls]


POSTS = [("a", 1), ("b", 2), ("a", 3), ("a", 4), ("c", 5)]


def test_messages_for_one_peer_leave_in_one_call_in_posting_order() -> None:
    calls = _flushed(_RecordingMany(), POSTS)
    assert sorted(calls) == [("a", [1, 3, 4]), ("b", [2]), ("c", [5])]


def test_a_channel_that_cannot_gets_one_send_per_message_in_posting_order() -> None:
    calls = _flushed(StubChannel(), POSTS)
    assert calls == [(to, [seq]) for to, seq in POSTS]


# ---------------------------------------------------------------- sending() on the posting thread


class _ThreadRecording(_RecordingMany):
    """Records which thread sent each call, and how many wakes the loop was sent."""

    def __init__(self) -> None:
        super().__init__()
        self.senders: list[str] = []
        self.wakes = 0

    def send(self, to: str, message: Message) -> None:
        self.senders.append(threading.current_thread().name)
        super().send(to, message)

    def send_many(self, to: str, messages: Sequence[Message]) -> None:
        self.senders.append(threading.current_thread().name)
        super().send_many(to, messages)

    def wake(self) -> None:
        self.wakes += 1


def _heartbeat(seq: int) -> Heartbeat:
    return Heartbeat(origin=ORIGIN, seq=seq)


@contextlib.contextmanager
def _running(
    channel: _ThreadRecording, on_message: Callable[[Message, float], None] = lambda m, now: None
) -> Iterator[ControlLoop]:
    """A started control loop named "loop" over ``channel``, stopped however the test ends."""
    loop = ControlLoop(channel, name="loop", on_message=on_message, on_tick=lambda now: None)
    loop.start()
    try:
        yield loop
    finally:
        loop.stop()


def test_posts_inside_sending_leave_from_the_posting_thread_at_the_end_of_the_block() -> None:
    channel = _ThreadRecording()
    with _running(channel) as loop:
        with loop.sending():
            loop.post("a", _heartbeat(1))
            with loop.sending():  # nested: the outermost block sends
                loop.post("a", _heartbeat(2))
            loop.post("b", _heartbeat(3))
            assert channel.calls == []  # nothing leaves while the block (the caller's lock) is held
        # Sent by this thread as the block ended, the two for "a" in one frame set; no wake needed.
        assert sorted(channel.calls) == sorted(
            [("a", [_heartbeat(1), _heartbeat(2)]), ("b", [_heartbeat(3)])]
        )
        assert channel.senders == [threading.current_thread().name] * 2
        assert channel.wakes == 0


def test_a_flush_under_way_elsewhere_hands_the_posts_to_the_woken_loop() -> None:
    channel = _ThreadRecording()
    with _running(channel) as loop:
        with loop._flush_lock:  # another thread is flushing: this one must not send behind its back
            with loop.sending():
                loop.post("a", _heartbeat(1))
            assert channel.calls == [] and channel.wakes == 1  # the loop was woken instead
        wait_for(lambda: bool(channel.calls), timeout=5)
        assert channel.calls == [("a", [_heartbeat(1)])]  # nothing lost
        assert channel.senders == ["loop"]


def test_posts_outside_sending_wake_the_loop_which_sends_them() -> None:
    channel = _ThreadRecording()
    with _running(channel) as loop:
        loop.post("a", _heartbeat(1))
        assert channel.wakes == 1
        wait_for(lambda: bool(channel.calls), timeout=5)
        assert channel.calls == [("a", [_heartbeat(1)])] and channel.senders == ["loop"]


def test_while_the_loop_is_busy_posts_are_left_to_it_so_they_can_share_a_frame_set() -> None:
    busy, release = threading.Event(), threading.Event()

    def on_message(message: Message, now: float) -> None:
        busy.set()
        release.wait(5)

    channel = _ThreadRecording()
    channel._batch = [_heartbeat(0)]  # one inbound message: the loop handles it, and blocks there
    with _running(channel, on_message) as loop:
        try:
            assert busy.wait(5)
            with loop.sending():
                loop.post("a", _heartbeat(1))
            with loop.sending():
                loop.post("a", _heartbeat(2))
            assert channel.calls == [] and channel.wakes == 2  # not sent behind the busy loop's back
            release.set()
            wait_for(lambda: bool(channel.calls), timeout=5)
            assert channel.calls == [("a", [_heartbeat(1), _heartbeat(2)])]  # together, by the loop
            assert channel.senders == ["loop"]
        finally:
            release.set()


# ---------------------------------------------------------------- settled(): after a batch, once


def test_settled_runs_once_per_batch_after_the_batch_and_its_replies() -> None:
    """The transports wake their schedulers in ``settled``: after every message of the batch was
    handled, what the handlers posted left and the next deadline was asked (the transports take
    their endpoint lock for it: a scheduler woken before would find it held), once for the batch."""
    channel = StubChannel([_heartbeat(1), _heartbeat(2), _heartbeat(3)])
    events: list[str] = []
    loop: ControlLoop | None = None

    def on_message(message: Message, now: float) -> None:
        assert isinstance(message, Heartbeat) and loop is not None
        events.append(f"handled {message.seq}")
        loop.post("peer", _heartbeat(10 + message.seq))

    def settled() -> None:
        events.append(f"settled after {sum(len(m) for _, m in channel.calls)} sent")

    def next_deadline() -> None:
        events.append("deadline asked")

    loop = ControlLoop(
        channel,
        name="t",
        on_message=on_message,
        on_tick=lambda now: None,
        next_deadline=next_deadline,
        settled=settled,
    )
    loop.start()
    try:
        wait_for(lambda: "handled 3" in events and events[-1].startswith("settled"))
    finally:
        loop.stop()
    first = events.index("handled 1")
    assert events[first : first + 5] == [
        "handled 1",
        "handled 2",
        "handled 3",
        "deadline asked",
        "settled after 3 sent",
    ]
