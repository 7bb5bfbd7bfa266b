"""A channel in this process talking to a channel in a spawned process (real TCP, real codec, a key)."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable

import pytest

from pdkv.control import Authenticator
from pdkv.protocol.messages import Heartbeat, HeartbeatAck, RankAnnounce
from tests.control.helpers import DECODE_ORIGIN, KEY, AnyChannel, receive_all
from tests.control.peer_process import PEER_ORIGIN, echo_heartbeats

MakeChannel = Callable[..., AnyChannel]
COUNT = 100


@pytest.mark.slow
def test_heartbeats_round_trip_with_a_channel_in_another_process(
    make_channel: MakeChannel, channel_kind: str
) -> None:
    channel = make_channel(auth=Authenticator(key=KEY))
    context = mp.get_context("spawn")
    report, child_end = context.Pipe(duplex=False)
    child = context.Process(
        target=echo_heartbeats, args=(channel.address, KEY, COUNT, child_end, channel_kind), daemon=True
    )
    child.start()
    try:
        hello = channel.recv(60.0)  # the child's interpreter has to start and import pdkv first
        assert isinstance(hello, RankAnnounce) and hello.origin == PEER_ORIGIN
        for seq in range(COUNT):
            assert channel.send(hello.endpoint, Heartbeat(origin=DECODE_ORIGIN, seq=seq))
        acks = receive_all(channel, COUNT, timeout_s=30.0)
        assert acks == [HeartbeatAck(origin=PEER_ORIGIN, seq=seq) for seq in range(COUNT)]
        assert report.poll(30.0), "the child did not report"
        answered, received, unauthenticated, malformed = report.recv()
        assert (answered, received, unauthenticated, malformed) == (COUNT, COUNT, 0, 0)
    finally:
        child.join(30.0)
        if child.is_alive():
            child.kill()
            child.join(5.0)
    assert child.exitcode == 0
    assert channel.statistics().unauthenticated == 0
