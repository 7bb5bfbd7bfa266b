"""PrefillTransport + DecodeTransport in one process: real zmq channels and registry on 127.0.0.1,
the loopback backend for bytes. Rooms end to end with byte checks, a rejected registration, an
out-of-range destination that fails exactly its room, and garbage on every socket."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import zmq
from prometheus_client import CollectorRegistry, generate_latest

from pdkv.engine.loopback import LoopbackFaults
from pdkv.errors import InvalidArgumentError, LayoutMismatchError
from pdkv.metrics import PrometheusExporter
from pdkv.protocol.ids import InstanceId, RoomId
from pdkv.protocol.messages import RankCoord, StateIndices
from pdkv.protocol.poll import KVPoll
from pdkv.runtime.prefill import KVSender
from pdkv.testing.faults import send_frames
from pdkv.testing.synthetic import ModelSpec, verify_room
from tests.runtime.rig import SPEC, Rig, wait_for


def run_room(
    s: Rig, prefill: InstanceId, room: RoomId, logical: np.ndarray, dst: np.ndarray, chunks: list[int]
) -> list[KVSender]:
    receiver = s.decode.receiver(room, prefill)
    slots = np.array([3, 4])
    receiver.init(dst, 5, [StateIndices(kind=k, indices=slots) for k in SPEC.state_kinds])
    senders = [p.sender(room) for p in s.prefills]
    for sender in senders:
        sender.init(len(logical), 2)
    wait_for(lambda: all(x.poll() is KVPoll.WaitingForInput for x in senders))
    start = 0
    for n, size in enumerate(chunks):
        last = n == len(chunks) - 1
        state = [StateIndices(kind=k, indices=np.array([1, 6])) for k in SPEC.state_kinds] if last else None
        for sender in senders:
            sender.send(
                logical[start : start + size],
                start_token=start * SPEC.page_size,
                last=last,
                state_indices=state,
            )
        start += size
    return senders


def test_rooms_end_to_end_cp2(rig_factory: Callable[..., Rig]) -> None:
    s = rig_factory(cp=2)
    prefill = s.start()
    assert s.decode.wait_registered(prefill, timeout_s=20)
    logical = np.array([5, 0, 7, 2, 9, 12, 3], dtype=np.int64)
    dst = np.array([40, 41, 42, 100, 7, 8, 9], dtype=np.int64)
    senders = run_room(s, prefill, RoomId(11), logical, dst, [3, 2, 2])
    receiver = s.decode.receiver(RoomId(11), prefill)
    wait_for(lambda: receiver.poll() is KVPoll.Success)
    wait_for(lambda: all(x.poll() is KVPoll.Success for x in senders))
    checked, mismatches = verify_room(
        s.decode_memory[0],
        logical_ids=logical,
        dst_pages=dst,
        prefix_pages=0,
        state_src={k: np.array([1, 6]) for k in SPEC.state_kinds},
        state_dst={k: np.array([3, 4]) for k in SPEC.state_kinds},
        aux_src=2,
        aux_dst=5,
    )
    assert mismatches == [] and checked > 0
    metric = receiver.metric()
    assert metric.pages == len(logical)  # each position once, across both CP ranks
    kv_bytes = len(logical) * SPEC.kv_item_bytes * (SPEC.layers + SPEC.draft_layers)
    extras = 2 * SPEC.state_item_bytes * len(SPEC.state_kinds) * len(SPEC.state_layers) + SPEC.aux_item_bytes
    assert metric.bytes == kv_bytes + extras
    assert receiver.release_ready()
    receiver.clear()
    for x in senders:
        x.clear()
    # Metrics: what prefill ranks wrote is what decode was told, and each prefill peer has a latency.
    sent = sum(t.statistics().metrics.counters.bytes_sent for t in s.prefills)
    assert sent == metric.bytes
    decode_stats = s.decode.statistics().metrics
    assert decode_stats.counters.rooms_succeeded == 1
    assert set(decode_stats.peer_names()) == {"p:tp0/cp0", "p:tp0/cp1"}
    registry = CollectorRegistry()
    PrometheusExporter(s.decode.metrics, registry=registry)
    text = generate_latest(registry).decode()
    assert "pdkv_rooms_succeeded_total 1.0" in text
    assert 'peer="p:tp0/cp1"' in text


def test_layout_mismatch_is_raised_by_connect_with_the_difference(rig_factory: Callable[..., Rig]) -> None:
    other = ModelSpec(layers=4, page_size=16, state_layers=(1,))
    s = rig_factory(decode_spec=other)
    for p in s.prefills:
        p.start()
    s.decode.start()
    with pytest.raises(
        LayoutMismatchError, match=r"target kv layer ids differ: \[0, 1, 2\] vs \[0, 1, 2, 3\]"
    ):
        s.decode.connect(s.registry.address, timeout_s=20)
    with pytest.raises(LayoutMismatchError, match="refused decode") as refused:
        s.decode.wait_registered(s.prefill_instance, timeout_s=1.0)
    assert refused.value.peer == f"{s.prefill_instance}:{RankCoord(tp=0, cp=0)}"  # the rank that refused
    # A room asked of that instance anyway fails with the same reason.
    receiver = s.decode.receiver(RoomId(5), s.prefill_instance)
    receiver.init(np.arange(2), None)
    wait_for(lambda: receiver.poll() is KVPoll.Failed)
    assert "target kv layer ids differ: [0, 1, 2] vs [0, 1, 2, 3]" in str(receiver.failure() or "")


def test_out_of_range_destination_is_refused_at_the_call_and_creates_nothing(
    rig_factory: Callable[..., Rig],
) -> None:
    s = rig_factory()
    prefill = s.start()
    assert s.decode.wait_registered(prefill, timeout_s=20)
    bad = s.decode.receiver(RoomId(1), prefill)
    with pytest.raises(
        InvalidArgumentError, match=r"room 1: dst_pages holds ids past the 256 registered pages"
    ):
        bad.init(np.array([0, 256]), None)  # the decode buffers hold 256 pages: 256 is outside
    assert bad.poll() is KVPoll.Bootstrapping  # nothing was created: the same room can be inited again
    good_senders = run_room(s, prefill, RoomId(1), np.array([1, 2, 3]), np.array([10, 11, 12]), [3])
    good = s.decode.receiver(RoomId(1), prefill)
    wait_for(lambda: good.poll() is KVPoll.Success)
    wait_for(lambda: all(x.poll() is KVPoll.Success for x in good_senders))


def test_garbage_on_every_socket_leaves_transports_serving(rig_factory: Callable[..., Rig]) -> None:
    s = rig_factory()
    prefill = s.start()
    assert s.decode.wait_registered(prefill, timeout_s=20)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    garbage = [
        [b"PDKV"],
        [b"\x00" * 10, b"\x81"],
        [b"PDKV\x09\x00\x07\x00\x00\x00", b"junk"],
        [b""],
        [bytes(range(256))],
    ]
    for address in (s.prefills[0].address, s.decode.address):
        send_frames(address, garbage)  # as a peer of the transports' channel kind would
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 1000)
    dealer.connect(s.registry.address)
    for frames in garbage:
        dealer.send_multipart(frames)
    dealer.close()
    senders = run_room(s, prefill, RoomId(3), np.array([4, 5]), np.array([20, 21]), [1, 1])
    receiver = s.decode.receiver(RoomId(3), prefill)
    wait_for(lambda: receiver.poll() is KVPoll.Success)
    assert all(x.poll() is KVPoll.Success for x in senders)
    for stats in (s.prefills[0].statistics(), s.decode.statistics()):
        assert stats.channel.malformed == len(garbage)
    wait_for(lambda: s.decode.statistics().metrics.counters.malformed_messages == len(garbage))
    wait_for(lambda: s.registry.statistics().malformed == len(garbage))
    assert s.decode.connect(s.registry.address, timeout_s=10) == prefill  # the registry still answers


def test_partition_dump_logs_every_chunk_and_changes_nothing_else(
    rig_factory: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PDKV_DEBUG_PARTITION_DUMP", "1")
    s = rig_factory(cp=2)
    prefill = s.start()
    assert s.decode.wait_registered(prefill, timeout_s=20)
    chunks = [1] * 40  # more lines than any sensible cap
    logical = np.arange(40, dtype=np.int64) + 3
    dst = np.arange(40, dtype=np.int64) * 2
    with caplog.at_level("WARNING", logger="pdkv.runtime.prefill"):
        senders = run_room(s, prefill, RoomId(21), logical, dst, chunks)
        receiver = s.decode.receiver(RoomId(21), prefill)
        wait_for(lambda: receiver.poll() is KVPoll.Success)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("partition room=21 ")]
    assert len(lines) == len(chunks) * 2  # every chunk on both CP ranks, no cap
    assert sum("kv_pages_sent=1" in line for line in lines) == len(chunks)  # each position owned once
    # Each CP rank names the physical pages it owns and their positions: page-interleaved over 2 ranks,
    # logical page 3 + k sits at position k on rank (3 + k) % 2 as physical page (3 + k) // 2.
    for k in range(40):
        owner = (3 + k) % 2
        wanted = f"cp_rank={owner} "
        assert any(
            wanted in line and f"kv_physical=[{(3 + k) // 2}] kv_positions=[{k}]" in line for line in lines
        ), k
    # The state partition rides on CP rank 0's last chunk: source slots -> destination slots, per kind.
    [last] = [line for line in lines if "last=True" in line and "cp_rank=0 " in line]
    for kind in SPEC.state_kinds:
        assert f"{kind.value}:[1, 6]->[3, 4]" in last
    assert all(x.poll() is KVPoll.Success for x in senders)
    _, mismatches = verify_room(
        s.decode_memory[0],
        logical_ids=logical,
        dst_pages=dst,
        prefix_pages=0,
        state_src={k: np.array([1, 6]) for k in SPEC.state_kinds},
        state_dst={k: np.array([3, 4]) for k in SPEC.state_kinds},
        aux_src=2,
        aux_dst=5,
    )
    assert mismatches == []


def test_an_engine_failure_is_fenced_before_the_abort_ack_and_the_pages_come_back(
    rig_factory: Callable[..., Rig],
) -> None:
    """The room's first batch fails: the prefill repeats a block of it as a fence write through the
    same engine before acknowledging the decode's Abort; only then are the decode's pages reusable."""
    s = rig_factory(faults=LoopbackFaults(fail_batches={1}))
    prefill = s.start()
    assert s.decode.wait_registered(prefill, timeout_s=20)
    logical = np.array([1, 2, 3], dtype=np.int64)
    dst = np.array([10, 11, 12], dtype=np.int64)
    [sender] = run_room(s, prefill, RoomId(5), logical, dst, [3])
    receiver = s.decode.receiver(RoomId(5), prefill)
    wait_for(lambda: receiver.poll() is KVPoll.Failed and receiver.release_ready())
    assert sender.poll() is KVPoll.Failed
    prefill_stats = s.prefills[0].statistics()
    assert prefill_stats.endpoint.fences_submitted == 1 and prefill_stats.endpoint.fences_failed == 0
    assert prefill_stats.metrics.counters.fences == 1
    # The fence was a write of its own (batch 2) to the decode, after the failed batch 1.
    assert s.prefill_backends[0].statistics().batches_submitted == 2
    assert receiver.release_was_safe()
