"""Which control channel the transports build: ``PDKV_CONTROL_CHANNEL`` (stream by default, zmq on
request), refused by name when it is neither; a room goes end to end on each."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from pdkv.control import ControlChannel, StreamChannel
from pdkv.errors import ConfigError
from pdkv.protocol.ids import RoomId
from pdkv.protocol.poll import KVPoll
from pdkv.runtime.channels import channel_kind, control_channel_factory
from tests.runtime.rig import Rig, wait_for
from tests.runtime.test_transports import run_room


def test_the_stream_channel_is_the_default_and_zmq_is_chosen_by_name() -> None:
    assert channel_kind({}) == "stream"
    assert channel_kind({"PDKV_CONTROL_CHANNEL": "zmq"}) == "zmq"
    with pytest.raises(ConfigError, match="PDKV_CONTROL_CHANNEL='tcp' is not one of stream, zmq"):
        channel_kind({"PDKV_CONTROL_CHANNEL": "tcp"})
    with pytest.raises(ConfigError, match="channel kind 'udp'"):
        control_channel_factory("udp")


@pytest.mark.parametrize(("kind", "cls"), [("stream", StreamChannel), ("zmq", ControlChannel)])
def test_a_room_goes_end_to_end_on_the_channel_the_variable_names(
    rig_factory: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch, kind: str, cls: type
) -> None:
    monkeypatch.setenv("PDKV_CONTROL_CHANNEL", kind)
    s = rig_factory()
    prefill = s.start()
    assert s.decode.wait_registered(prefill, timeout_s=20)
    assert isinstance(s.decode._loop.channel, cls)  # which channel the transport built
    assert all(isinstance(p._loop.channel, cls) for p in s.prefills)
    senders = run_room(s, prefill, RoomId(5), np.array([1, 2]), np.array([30, 31]), [2])
    receiver = s.decode.receiver(RoomId(5), prefill)
    wait_for(lambda: receiver.poll() is KVPoll.Success)
    assert all(x.poll() is KVPoll.Success for x in senders)
