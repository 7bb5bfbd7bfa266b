"""Fixtures of the control tests: channels, raw sockets and registries that are always closed.

Every factory records what it made and closes it in its finalizer, also when the test failed, so no
socket or thread outlives its test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from pdkv.control import ControlChannel, RegistryService
from pdkv.control.framing import WireCodec
from pdkv.protocol.messages import Message
from tests.control.helpers import CODEC


@pytest.fixture
def codec() -> WireCodec[Message]:
    return CODEC


@pytest.fixture
def make_channel() -> Iterator[Callable[..., ControlChannel[Message]]]:
    made: list[ControlChannel[Message]] = []

    def make(**kwargs: Any) -> ControlChannel[Message]:
        channel = ControlChannel(CODEC, **kwargs)
        made.append(channel)
        return channel

    yield make
    for channel in made:
        channel.close()


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
    for socket in made:
        socket.close(linger=0)


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
