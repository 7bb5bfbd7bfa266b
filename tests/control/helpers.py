"""Builders shared by the control tests: the real codec, small real messages, polling helpers."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from pdkv.control import ControlChannel
from pdkv.control.framing import WireCodec
from pdkv.control.stream import StreamChannel
from pdkv.errors import RemoteProtocolError
from pdkv.protocol import codec
from pdkv.protocol.ids import Endpoint, Epoch, InstanceId, SessionId
from pdkv.protocol.messages import Heartbeat, Message, Origin, RankAnnounce, RankCoord, RouteQuery

CODEC: WireCodec[Message] = WireCodec(
    encode=codec.encode, decode=codec.decode, decode_error=RemoteProtocolError
)
KEY = b"k" * 32
AnyChannel = ControlChannel[Message] | StreamChannel[Message]
"""The two channels, one promise: tests that take either run against both (``channel_kind``)."""


class Pusher(Protocol):
    """A raw sender of frame sets to a channel, speaking its wire without pdkv's sending side."""

    def send_multipart(self, frames: list[bytes], /) -> object: ...


OTHER_KEY = b"o" * 32
PREFILL = InstanceId("prefill-a")
DECODE_ORIGIN = Origin(instance=InstanceId("decode-a"), epoch=Epoch(1), rank=RankCoord(tp=0))
REGISTRY_ORIGIN = Origin(instance=PREFILL, epoch=Epoch(1), rank=RankCoord(tp=0))


def heartbeat(seq: int) -> Heartbeat:
    return Heartbeat(origin=DECODE_ORIGIN, seq=seq)


def announce(
    tp: int,
    cp: int = 0,
    *,
    epoch: int = 1,
    tp_size: int = 2,
    cp_size: int = 2,
    page_size: int = 16,
    digest: str = "d1",
    instance: str = PREFILL,
    port: int | None = None,
) -> RankAnnounce:
    return RankAnnounce(
        origin=Origin(instance=InstanceId(instance), epoch=Epoch(epoch), rank=RankCoord(tp=tp, cp=cp)),
        tp_size=tp_size,
        cp_size=cp_size,
        endpoint=Endpoint(f"tcp://127.0.0.1:{port if port is not None else 20000 + 10 * cp + tp}"),
        session=SessionId(f"127.0.0.1:{17000 + 10 * cp + tp}#{epoch}"),
        page_size=page_size,
        layout_digest=digest,
    )


def route_query() -> RouteQuery:
    return RouteQuery(origin=DECODE_ORIGIN)


def receive_all(channel: AnyChannel, count: int, timeout_s: float = 5.0) -> list[Message]:
    """Exactly ``count`` messages (fewer only if the time runs out)."""
    deadline = time.monotonic() + timeout_s
    got: list[Message] = []
    while len(got) < count and time.monotonic() < deadline:
        got += channel.wait(max(0.0, deadline - time.monotonic()), max_messages=count - len(got))
    return got


def eventually(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.005)
    return condition()
