"""Effects leave in the order the endpoint emitted them (seams issue, item 8).

A decode rank that restarted behind the same address registers again: the prefill endpoint answers
with ``ForgetPeer`` (drop the socket to the old incarnation, and whatever is queued on it) and then
the ``RegisterAck`` for the new one. The runtime used to send the ack on the old socket and close that
socket afterwards with linger 0, so the ack could be dropped; the same held for an Abort or a
Register produced by the same input.
"""

from __future__ import annotations

import threading

from pdkv.control.channel import ChannelStatistics
from pdkv.engine.loopback import LoopbackBackend, LoopbackFabric
from pdkv.protocol.ids import Epoch
from pdkv.protocol.messages import Message, Origin
from pdkv.runtime.prefill import PrefillConfig, PrefillTransport
from tests.protocol.helpers import DECODE, DECODE_EP, PREFILL, layout, register
from tests.runtime.rig import wait_for


class _Recording:
    """A channel that hands over one batch, then records every send and forget in one list."""

    address = "inproc://prefill"

    def __init__(self, batch: list[Message]) -> None:
        self._batch = batch
        self.calls: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def send(self, to: str, message: Message) -> bool:
        with self._lock:
            self.calls.append(("send " + type(message).__name__, to))
        return True

    def send_many(self, to: str, messages: list[Message]) -> bool:
        for message in messages:
            self.send(to, message)
        return True

    def forget(self, endpoint: str) -> bool:
        with self._lock:
            self.calls.append(("forget", endpoint))
        return True

    def wait(self, timeout_s: float | None) -> list[Message]:
        batch, self._batch = self._batch, []
        if not batch:
            threading.Event().wait(min(timeout_s or 0.01, 0.01))
        return batch

    def wake(self) -> None:
        pass

    def close(self, *, flush_s: float = 0.0) -> None:
        pass

    def statistics(self) -> ChannelStatistics:
        return ChannelStatistics(received=0, malformed=0, unauthenticated=0, sent=0, dropped_sends=0, peers=0)


def test_a_socket_is_dropped_before_the_messages_emitted_after_it_are_sent() -> None:
    reborn = Origin(instance=DECODE.instance, epoch=Epoch(DECODE.epoch + 1), rank=DECODE.rank)
    channel = _Recording([register(), register(origin=reborn)])
    backend = LoopbackBackend(fabric=LoopbackFabric("order"))
    config = PrefillConfig(
        instance=PREFILL.instance,
        rank=PREFILL.rank,
        tp_size=1,
        layout=layout(),
        registry="tcp://127.0.0.1:1",
        register_memory=False,
    )
    transport = PrefillTransport(
        config, backend, channel_factory=lambda host: channel, announce=lambda *args: None
    )
    transport.start()
    try:
        wait_for(lambda: sum(1 for call in channel.calls if call[0] == "send RegisterAck") == 2)
        with channel._lock:
            calls = [call for call in channel.calls if call[1] == DECODE_EP]
        assert calls == [
            ("send RegisterAck", DECODE_EP),
            ("forget", DECODE_EP),
            ("send RegisterAck", DECODE_EP),
        ]
    finally:
        transport.close(timeout_s=5)
        backend.close()
