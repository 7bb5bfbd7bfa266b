"""The far end of the two-process test: a rank in a spawned process with its own channel.

Kept apart from the test module so that the spawned interpreter imports only pdkv and this file.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection

import zmq

from pdkv.control import Authenticator, ControlChannel
from pdkv.control.stream import StreamChannel
from pdkv.protocol.ids import Endpoint, Epoch, InstanceId, SessionId
from pdkv.protocol.messages import Heartbeat, HeartbeatAck, Message, Origin, RankAnnounce, RankCoord
from tests.control.helpers import CODEC

PEER_ORIGIN = Origin(instance=InstanceId("peer"), epoch=Epoch(7), rank=RankCoord(tp=0))


def echo_heartbeats(parent_address: str, key: bytes, count: int, report: Connection, kind: str) -> None:
    """Announce this process's channel (``kind``: "zmq" or "stream", the parent's) to the parent,
    then answer ``count`` heartbeats with acks."""
    auth = Authenticator(key=key)
    channel: ControlChannel[Message] | StreamChannel[Message] = (
        ControlChannel(CODEC, auth=auth) if kind == "zmq" else StreamChannel(CODEC, auth=auth)
    )
    with channel:
        channel.send(
            parent_address,
            RankAnnounce(
                origin=PEER_ORIGIN,
                tp_size=1,
                cp_size=1,
                endpoint=Endpoint(channel.address),
                session=SessionId("peer:0"),
                page_size=16,
                layout_digest="peer",
            ),
        )
        answered = 0
        deadline = time.monotonic() + 60.0
        while answered < count and time.monotonic() < deadline:
            for message in channel.wait(1.0):
                if isinstance(message, Heartbeat):
                    channel.send(parent_address, HeartbeatAck(origin=PEER_ORIGIN, seq=message.seq))
                    answered += 1
        stats = channel.statistics()
        # The last acks may still be queued: the process ends with os._exit, which would kill the
        # channel's sending thread with them (zmq's: the parent then saw 90 of 100). Close with a
        # flush and wait for it.
        channel.close(flush_s=10.0)
        if kind == "zmq":
            zmq.Context.instance().term()
        else:
            assert isinstance(channel, StreamChannel)
            channel.wait_closed(10.0)
        report.send((answered, stats.received, stats.unauthenticated, stats.malformed))
