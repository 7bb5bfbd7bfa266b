"""Fixtures of the control tests: channels, raw sockets and registries that are always closed.

Every factory records what it made and closes it in its finalizer, also when the test failed, so no
socket or thread outlives its test.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from pdkv.control import ControlChannel, RegistryService
from pdkv.control.framing import WireCodec
from pdkv.control.stream import GREETING, StreamChannel, pack_frames
from pdkv.protocol.messages import Message
from tests.control.helpers import CODEC, AnyChannel, Pusher


class _StreamPusher:
    """The stream channel's wire written by hand over a plain TCP connection."""

    def __init__(self, address: str) -> None:
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        self.socket = socket.create_connection((host, int(port)), timeout=5.0)
        self.socket.sendall(GREETING)

    def send_multipart(self, frames: list[bytes]) -> None:
        self.socket.sendall(pack_frames(frames))


@pytest.fixture
def codec() -> WireCodec[Message]:
    return CODEC


@pytest.fixture(params=["zmq", "stream"])
def channel_kind(request: pytest.FixtureRequest) -> str:
    """Both channels keep one promise: the tests that take a channel run against each."""
    kind: str = request.param
    return kind


@pytest.fixture
def make_channel(channel_kind: str) -> Iterator[Callable[..., AnyChannel]]:
    made: list[AnyChannel] = []

    def make(**kwargs: Any) -> AnyChannel:
        channel: AnyChannel = (
            ControlChannel(CODEC, **kwargs) if channel_kind == "zmq" else StreamChannel(CODEC, **kwargs)
        )
        made.append(channel)
        return channel

    yield make
    for channel in made:
        channel.close()


@pytest.fixture
def push_to(channel_kind: str) -> Iterator[Callable[[str], Pusher]]:
    """A raw sender to a channel of the kind under test (a zmq PUSH socket, or the stream's bytes by
    hand): the way a hostile or buggy peer talks, bypassing the sending side's checks."""
    pushers: list[zmq.Socket[bytes]] = []
    streams: list[_StreamPusher] = []

    def make(address: str) -> Pusher:
        if channel_kind == "stream":
            stream = _StreamPusher(address)
            streams.append(stream)
            return stream
        push: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        pushers.append(push)
        push.connect(address)
        return push

    yield make
    for push in pushers:
        push.close(linger=0)
    for stream in streams:
        stream.socket.close()


@pytest.fixture
def raw_socket() -> Iterator[Callable[[int, str], zmq.Socket[bytes]]]:
    """A plain zmq socket of the given type connected to an address: the way a hostile peer talks."""
    made: list[zmq.Socket[bytes]] = []

    def make(kind: int, address: str) -> zmq.Socket[bytes]:
        socket: zmq.Socket[bytes] = zmq.Context.instance().socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        made.append(socket)
        socket.connect(address)
        return socket

    yield make
    for raw in made:
        raw.close(linger=0)


@pytest.fixture
def make_registry() -> Iterator[Callable[..., RegistryService[Message]]]:
    made: list[RegistryService[Message]] = []

    def make(handle: Callable[[Message], Message | None], **kwargs: Any) -> RegistryService[Message]:
        service = RegistryService(CODEC, handle, **kwargs)
        made.append(service)
        service.start()
        return service

    yield make
    stuck = [service for service in made if not service.stop(timeout_s=5.0)]
    assert not stuck, f"registry threads did not stop: {stuck}"
