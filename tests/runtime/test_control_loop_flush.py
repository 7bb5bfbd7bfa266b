"""The control loop sends the messages posted for one peer together when its channel can."""

from __future__ import annotations

import time
from collections.abc import Sequence

from pdkv.protocol.ids import Epoch, InstanceId
from pdkv.protocol.messages import Heartbeat, Message, Origin, RankCoord
from pdkv.runtime._loop import ControlLoop
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
