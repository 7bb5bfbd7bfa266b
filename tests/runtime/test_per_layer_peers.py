"""Per-layer transfer across several decode peers, through real transports (zmq on 127.0.0.1,
loopback bytes): one slow peer never delays another peer's rooms (a submission lane per peer), and
with fan-out each decode rank is told exactly what was written to it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pdkv.engine.loopback import LoopbackBackend, LoopbackConfig, LoopbackFaults
from pdkv.protocol.ids import InstanceId, RoomId
from pdkv.protocol.machines import PerLayerState
from pdkv.protocol.messages import RankCoord
from pdkv.protocol.poll import KVPoll
from pdkv.runtime import ExecutorConfig
from pdkv.runtime.decode import DecodeConfig, DecodeTransport
from pdkv.runtime.per_layer import PerLayerMode
from pdkv.testing.synthetic import Capacity, RankMemory, forward_layers
from tests.runtime.rig import DECODE_PAGES, SPEC, TIMEOUTS, Rig, wait_for

# Session ids of the rig's loopback fabric, in attach order: prefill 1, decode 2, the extra decode 3.
SLOW_PEER = "loopback:rig:3"


def test_a_slow_peer_never_delays_another_peers_per_layer_rooms(rig_factory: Callable[..., Rig]) -> None:
    s = rig_factory(
        faults=LoopbackFaults(slow_peers=frozenset({SLOW_PEER}), slow_peer_seconds=1.0),
        executor=ExecutorConfig(max_in_flight=1),  # a job waits for its oldest batch before the next
        loopback_workers=16,
    )
    prefill = s.start_registered()
    memory = RankMemory(SPEC, Capacity(kv_pages=DECODE_PAGES, state_slots=8, aux_rows=8))
    slow_backend = LoopbackBackend(LoopbackConfig(announced_regions=True), fabric=s.fabric)
    assert slow_backend.session_id == SLOW_PEER
    slow_decode = DecodeTransport(
        DecodeConfig(
            instance=InstanceId("slow"),
            rank=RankCoord(tp=0),
            tp_size=1,
            layout=memory.layout,
            timeouts=TIMEOUTS,
        ),
        slow_backend,
    )
    try:
        slow_decode.start()
        slow_decode.connect(s.registry.address, timeout_s=20)
        assert slow_decode.wait_registered(prefill, timeout_s=20)
        transport = s.prefills[0]
        rooms = {"slow": (RoomId(1), slow_decode), "fast": (RoomId(2), s.decode)}
        receivers = {}
        senders = {}
        for name, (room, decode) in rooms.items():
            receivers[name] = decode.receiver(room, prefill)
            receivers[name].init(np.array([10, 11]), None)
            senders[name] = transport.sender(room)
            senders[name].init(2, None)
        wait_for(lambda: all(x.poll() is KVPoll.WaitingForInput for x in senders.values()))
        pages = np.array([4, 5])
        for room, _ in rooms.values():
            assert transport.per_layer.register(room, pages, start_token=0) is PerLayerMode.PER_LAYER
        for model, layer in forward_layers(SPEC):  # one forward serves both rooms' chunks
            transport.per_layer.on_layer_end(layer, model=model)
        for sender in senders.values():
            sender.send(pages, start_token=0, last=True)
        # The fast peer's room completes while the slow one's writes (1 s a batch, one batch at a
        # time, a batch per layer) are still in flight: its layers never queue behind the slow lane.
        wait_for(lambda: receivers["fast"].poll() is KVPoll.Success, timeout=20)
        # Not one layer has landed at the slow peer yet (a single shared submission thread would
        # have made the fast room wait behind the slow room's first layers).
        assert not any(memory.view(key)[[10, 11]].any() for key in SPEC.kv_keys())
        assert receivers["slow"].poll() is not KVPoll.Success
        assert senders["slow"].poll() is KVPoll.Transferring
        assert transport.per_layer.statistics().lanes == 2
        wait_for(lambda: receivers["slow"].poll() is KVPoll.Success, timeout=60)
    finally:
        slow_decode.close()
        slow_backend.close()


def test_with_fan_out_each_decode_rank_is_told_what_was_written_to_it(
    rig_factory: Callable[..., Rig],
) -> None:
    s = rig_factory(decode_tp=2)
    prefill = s.start_registered()
    room = RoomId(3)
    receivers = [d.receiver(room, prefill) for d in s.decodes]
    for r in receivers:
        r.init(np.array([20, 21, 22, 23]), None)
    sender = s.prefills[0].sender(room)
    sender.init(4, None)
    wait_for(lambda: sender.poll() is KVPoll.WaitingForInput)
    sender.send([1, 2, 3, 4], start_token=0, last=True)
    wait_for(lambda: all(r.poll() is KVPoll.Success for r in receivers))
    kv_bytes_per_rank = 4 * SPEC.kv_item_bytes * (SPEC.layers + SPEC.draft_layers)
    for r in receivers:
        metric = r.metric()
        assert metric.pages == 4  # its own 4 pages, not the 8 the prefill wrote in all
        assert metric.bytes == kv_bytes_per_rank
    sent = s.prefills[0].statistics().metrics.counters.bytes_sent
    assert sent == sum(r.metric().bytes for r in receivers) == 2 * kv_bytes_per_rank


def test_a_cancel_during_the_last_layers_submission_drops_the_context_cleanly(
    rig_factory: Callable[..., Rig],
) -> None:
    s = rig_factory(
        faults=LoopbackFaults(slow_peers=frozenset({"loopback:rig:2"}), slow_peer_seconds=0.5),
        executor=ExecutorConfig(max_in_flight=1),  # submitting a layer waits for the previous batch
        loopback_workers=16,
    )
    prefill = s.start_registered()
    transport = s.prefills[0]
    room = RoomId(4)
    receiver = s.decode.receiver(room, prefill)
    receiver.init(np.array([30, 31]), None)
    sender = transport.sender(room)
    sender.init(2, None)
    wait_for(lambda: sender.poll() is KVPoll.WaitingForInput)
    pages = np.array([6, 7])
    assert transport.per_layer.register(room, pages, start_token=0) is PerLayerMode.PER_LAYER
    *first, last = forward_layers(SPEC)
    for model, layer in first:
        transport.per_layer.on_layer_end(layer, model=model)
    wait_for(lambda: transport.per_layer.statistics().layers_submitted == len(first))
    # The last layer's submission now waits (about 0.5 s) for the previous layer's batch: send() and
    # the abort both land inside that wait.
    transport.per_layer.on_layer_end(last[1], model=last[0])
    sender.send(pages, start_token=0, last=True)
    wait_for(lambda: transport.per_layer.states(room) == [PerLayerState.AWAITING_LAYERS])
    sender.abort("scheduler gave up")
    wait_for(receiver.release_ready, timeout=20)
    stats = transport.per_layer.statistics()
    assert (stats.dropped, stats.failed) == (1, 0)
    assert transport.statistics().worker_errors == 0
