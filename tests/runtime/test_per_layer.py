"""Per-layer transfer through real transports in one process (zmq on 127.0.0.1, loopback bytes).

The forward is simulated in the test thread: each layer's KV of the chunk's pages is written into
prefill memory (zeroed before the forward) just before ``on_layer_end``, so a layer sent before its
write lands as zeros at the decode side and shows as a mismatch. Decode memory after per-layer
transfer is compared with a monolithic run of the same request, byte for byte, and with the content
rule; engine submissions are counted on the loopback backends."""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdkv.engine.loopback import LoopbackBackend, LoopbackFabric, LoopbackFaults
from pdkv.mapping import (
    AttentionKind,
    BufferKind,
    BufferLayout,
    BufferSpec,
    ModelRole,
    OwnershipPolicy,
    PageInterleaved,
    TransferBlocks,
    cp_owned,
)
from pdkv.protocol.effects import ChunkSpec, Destination, PrefillEffect
from pdkv.protocol.ids import Endpoint, Epoch, InstanceId, RoomId, SessionId
from pdkv.protocol.machines import PerLayerState
from pdkv.protocol.messages import Origin, RankCoord, Register, StateIndices, TransferRequest
from pdkv.protocol.poll import KVPoll
from pdkv.protocol.prefill import PrefillEndpoint
from pdkv.runtime.chunk_plan import plan_chunk
from pdkv.runtime.decode import KVReceiver
from pdkv.runtime.executor import ExecutorConfig, TransferExecutor
from pdkv.runtime.per_layer import (
    PerLayerMode,
    PerLayerTransferManager,
    UnknownLayerError,
    unsupported_reason,
)
from pdkv.runtime.prefill import KVSender
from pdkv.testing.synthetic import Capacity, ModelSpec, RankMemory, forward_layers, verify_room
from tests.runtime.rig import DECODE_PAGES, PREFILL_PAGES, SPEC, Rig, wait_for

MHA = ModelSpec(attention=AttentionKind.MHA, layers=2, page_size=16, kv_bytes_per_token=32, state_layers=(0,))


def started(factory: Callable[..., Rig], **kw: Any) -> Rig:
    rig = factory(**kw)
    rig.start_registered()
    return rig


class Room:
    """One request on every rank: receivers opened, senders initialised and WaitingForInput."""

    def __init__(
        self,
        rig: Rig,
        room: int,
        logical: np.ndarray,
        dst: np.ndarray,
        *,
        slots: int,
        aux: int,
        prefix_pages: int = 0,
    ) -> None:
        self.rig = rig
        self.room = RoomId(room)
        self.logical = logical
        self.dst = dst
        self.dst_slots = np.array([slots, slots + 1])
        self.src_slots = np.array([1, 6])
        self.dst_aux = aux
        self.receivers: list[KVReceiver] = []
        for d in rig.decodes:
            receiver = d.receiver(self.room, rig.prefill_instance)
            receiver.init(
                dst,
                aux,
                [StateIndices(kind=k, indices=self.dst_slots) for k in rig.spec.state_kinds],
                prefix_pages=prefix_pages,
            )
            self.receivers.append(receiver)
        self.senders: list[KVSender] = [p.sender(self.room) for p in rig.prefills]
        for sender in self.senders:
            sender.init(len(logical), 2)
        wait_for(lambda: all(s.poll() is KVPoll.WaitingForInput for s in self.senders))

    def register(self, pages: np.ndarray, start_page: int, resident: int = 0) -> list[PerLayerMode]:
        start_token = start_page * self.rig.spec.page_size
        return [
            p.per_layer.register(self.room, pages, start_token=start_token, resident_pages=resident)
            for p in self.rig.prefills
        ]

    def forward(
        self, pages: np.ndarray, *, resident: int = 0, layers: int | None = None, start: int = 0
    ) -> None:
        """Zero the forward's pages, then write and report layers ``start`` .. ``start + layers``."""
        rig = self.rig
        owned = [
            cp_owned(pages[resident:], 0, rank, rig.policy).physical for rank in range(len(rig.prefills))
        ]
        order = forward_layers(rig.spec)
        if start == 0:
            for memory, physical in zip(rig.prefill_memory, owned, strict=True):
                memory.clear_pages(physical)
        for model, layer in order[start : len(order) if layers is None else start + layers]:
            for rank, (memory, prefill) in enumerate(zip(rig.prefill_memory, rig.prefills, strict=True)):
                memory.write_layer(model, layer, owned[rank], cp_rank=rank, policy=rig.policy)
                prefill.per_layer.on_layer_end(layer, model=model)

    def send(self, pages: np.ndarray, start_page: int, *, last: bool) -> None:
        state = (
            [StateIndices(kind=k, indices=self.src_slots) for k in self.rig.spec.state_kinds]
            if last
            else None
        )
        for sender in self.senders:
            sender.send(
                pages, start_token=start_page * self.rig.spec.page_size, last=last, state_indices=state
            )

    def wait_success(self) -> None:
        wait_for(lambda: all(r.poll() is KVPoll.Success for r in self.receivers))
        wait_for(lambda: all(s.poll() is KVPoll.Success for s in self.senders))

    def verify(self, prefix_pages: int = 0) -> None:
        for memory in self.rig.decode_memory:
            checked, mismatches = verify_room(
                memory,
                logical_ids=self.logical,
                dst_pages=self.dst,
                prefix_pages=prefix_pages,
                state_src={k: self.src_slots for k in self.rig.spec.state_kinds},
                state_dst={k: self.dst_slots for k in self.rig.spec.state_kinds},
                aux_src=2,
                aux_dst=self.dst_aux,
            )
            assert mismatches == [] and checked > 0


def run_request(
    rig: Rig, room: Room, chunks: list[int], *, prefix_pages: int, resident_pages: int, per_layer: bool
) -> list[list[PerLayerMode]]:
    """Chunked prefill after a decode-side prefix; chunk 0 starts with ``resident_pages`` computed pages."""
    start = prefix_pages
    modes = []
    for n, size in enumerate(chunks):
        pages = room.logical[start : start + size]
        resident = resident_pages if n == 0 else 0
        if per_layer:
            modes.append(room.register(pages, start, resident))
        room.forward(pages, resident=resident)
        room.send(pages, start, last=n == len(chunks) - 1)
        start += size
    room.wait_success()
    return modes


def expected_bytes(spec: ModelSpec, pages_sent: int, state_slots: int) -> int:
    kv_buffers = (spec.layers + spec.draft_layers) * (1 if spec.attention is AttentionKind.MLA else 2)
    state = state_slots * spec.state_item_bytes * len(spec.state_kinds) * len(spec.state_layers)
    return pages_sent * spec.kv_item_bytes * kv_buffers + state + spec.aux_item_bytes


@pytest.mark.parametrize(
    ("spec", "cp"), [(SPEC, 1), (SPEC, 4), (MHA, 2)], ids=["mla-cp1", "mla-cp4", "mha-cp2"]
)
def test_per_layer_equals_monolithic_byte_for_byte(
    rig_factory: Callable[..., Rig], spec: ModelSpec, cp: int
) -> None:
    rig = started(rig_factory, spec=spec, cp=cp)
    rng = np.random.default_rng(cp)
    # Consecutive logical pages first (multi-page runs on every rank), then scattered ones.
    scattered = rng.choice(np.arange(8, PREFILL_PAGES * cp), size=12, replace=False)
    logical = np.concatenate([np.arange(8), scattered]).astype(np.int64)
    chunks = [5, 6, 4, 3]  # 4 chunks after a 2-page decode-side prefix (20 pages in all)
    dst_mono = np.arange(20, dtype=np.int64) + 10
    dst_layer = rng.choice(np.arange(100, DECODE_PAGES), size=20, replace=False).astype(np.int64)
    mono = Room(rig, 1, logical, dst_mono, slots=0, aux=0, prefix_pages=2)
    run_request(rig, mono, chunks, prefix_pages=2, resident_pages=0, per_layer=False)
    sent_mono = rig.bytes_sent()
    layered = Room(rig, 2, logical, dst_layer, slots=4, aux=5, prefix_pages=2)
    modes = run_request(rig, layered, chunks, prefix_pages=2, resident_pages=2, per_layer=True)
    assert all(m is PerLayerMode.PER_LAYER for chunk in modes for m in chunk)
    # Same bytes, byte for byte, as the monolithic run; and both are the content rule.
    memory = rig.decode_memory[0]
    for key in spec.kv_keys():
        assert np.array_equal(memory.view(key)[dst_layer], memory.view(key)[dst_mono]), key
    for key in spec.state_keys():
        assert np.array_equal(memory.view(key)[layered.dst_slots], memory.view(key)[mono.dst_slots]), key
    aux = (ModelRole.TARGET, BufferKind.AUX, 0)
    assert np.array_equal(memory.view(aux)[5], memory.view(aux)[0])
    mono.verify(prefix_pages=2)
    layered.verify(prefix_pages=2)
    # Every byte once: the per-layer room moved exactly what the monolithic one did.
    assert sent_mono == expected_bytes(spec, 18, 2)
    assert rig.bytes_sent() - sent_mono == sent_mono
    stats = [p.statistics().per_layer for p in rig.prefills]
    assert sum(s.finished for s in stats) == len(chunks) * cp
    assert sum(s.registered for s in stats) == len(chunks) * cp
    assert all(s.open_contexts == 0 and s.failed == 0 and s.dropped == 0 for s in stats)


def test_duplicate_registration_is_a_noop_and_nothing_is_sent_twice(rig_factory: Callable[..., Rig]) -> None:
    rig = started(
        rig_factory,
    )
    logical = np.arange(8, dtype=np.int64) + 3
    room = Room(rig, 3, logical, np.arange(8, dtype=np.int64) + 40, slots=2, aux=1)
    first, second = logical[:5], logical[5:]
    assert room.register(first, 0) == [PerLayerMode.PER_LAYER]
    assert room.register(first, 0) == [PerLayerMode.DUPLICATE]
    room.forward(first)
    assert room.register(first, 0) == [PerLayerMode.DUPLICATE]
    room.send(first, 0, last=False)
    assert room.register(second, 5) == [PerLayerMode.PER_LAYER]
    room.forward(second)
    room.send(second, 5, last=True)
    room.wait_success()
    room.verify()
    assert rig.bytes_sent() == expected_bytes(SPEC, 8, 2)
    stats = rig.prefills[0].statistics()
    assert stats.per_layer.duplicates == 2 and stats.per_layer.registered == 2
    # One KV job per chunk plus the extras of the last chunk: no chunk went through twice.
    assert stats.metrics.counters.bytes_sent == expected_bytes(SPEC, 8, 2)


def test_finish_before_all_layers_ended_waits_for_them(rig_factory: Callable[..., Rig]) -> None:
    rig = started(
        rig_factory,
    )
    logical = np.arange(6, dtype=np.int64) + 20
    room = Room(rig, 4, logical, np.arange(6, dtype=np.int64) + 60, slots=0, aux=2)
    room.register(logical, 0)
    room.forward(logical, layers=2)
    room.send(logical, 0, last=True)  # the scheduler sends before the forward's last layers
    manager = rig.prefills[0].per_layer
    wait_for(lambda: manager.states(room.room) == [PerLayerState.AWAITING_LAYERS])
    time.sleep(0.2)
    assert room.receivers[0].poll() is not KVPoll.Success
    assert room.senders[0].poll() is KVPoll.Transferring
    room.forward(logical, start=2)
    room.wait_success()
    room.verify()
    assert manager.states(room.room) == []


def test_layer_that_never_ends_fails_the_room_after_its_writes(rig_factory: Callable[..., Rig]) -> None:
    rig = started(rig_factory, finish_timeout_s=0.3, faults=LoopbackFaults(delay_seconds=1.0))
    logical = np.arange(6, dtype=np.int64)
    room = Room(rig, 5, logical, np.arange(6, dtype=np.int64) + 30, slots=0, aux=3)
    room.register(logical, 0)
    room.forward(logical, layers=len(forward_layers(SPEC)) - 1)  # the draft layer never ends
    room.send(logical, 0, last=True)
    seen_in_flight = []
    while room.senders[0].poll() is not KVPoll.Failed:
        seen_in_flight.append(rig.batches_in_flight())
        time.sleep(0.01)
    # Writes were in flight when the finish deadline passed; all had ended when the room failed.
    assert max(seen_in_flight) > 0
    assert rig.batches_in_flight() == 0
    failure = str(room.senders[0].failure() or "")
    assert "1 of 4 layers never ended within 0.3 s (first: draft:0)" in failure
    wait_for(lambda: room.receivers[0].poll() is KVPoll.Failed)
    assert "never ended" in str(room.receivers[0].failure() or "")
    stats = rig.prefills[0].statistics().per_layer
    assert stats.failed == 1 and stats.open_contexts == 0
    wait_for(room.receivers[0].release_ready)


def test_abort_mid_forward_nothing_written_after_drop_returns(rig_factory: Callable[..., Rig]) -> None:
    rig = started(rig_factory, faults=LoopbackFaults(delay_seconds=0.3))
    logical = np.arange(8, dtype=np.int64) + 10
    dst = np.arange(8, dtype=np.int64) + 80
    room = Room(rig, 6, logical, dst, slots=0, aux=4)
    manager = rig.prefills[0].per_layer
    room.register(logical, 0)
    room.forward(logical, layers=1)
    wait_for(lambda: rig.batches_in_flight() > 0)  # layer 0 is being written
    room.senders[0].abort("scheduler aborted the request")
    assert manager.drop(room.room) in (0, 1)  # the failure path may have started draining it
    assert rig.batches_in_flight() == 0
    assert manager.states(room.room) == [PerLayerState.DROPPED]
    memory = rig.decode_memory[0]
    before = {key: memory.view(key)[dst].copy() for key in SPEC.kv_keys()}
    layer0 = (ModelRole.TARGET, BufferKind.KV, 0)
    assert before[layer0].any()  # the write that was in flight landed before drop returned
    submitted = rig.batches_submitted()
    room.forward(logical, start=1)  # the batch's forward goes on
    time.sleep(0.5)
    assert rig.batches_submitted() == submitted
    for key in SPEC.kv_keys():
        assert np.array_equal(memory.view(key)[dst], before[key]), key
    wait_for(lambda: room.receivers[0].poll() is KVPoll.Failed)
    wait_for(room.receivers[0].release_ready)
    room.senders[0].clear()
    assert manager.states(room.room) == []


def test_decode_abort_mid_forward_acknowledged_only_after_layer_writes(
    rig_factory: Callable[..., Rig],
) -> None:
    rig = started(rig_factory, faults=LoopbackFaults(delay_seconds=0.4))
    logical = np.arange(8, dtype=np.int64) + 30
    dst = np.arange(8, dtype=np.int64) + 120
    room = Room(rig, 7, logical, dst, slots=0, aux=6)
    room.register(logical, 0)
    room.forward(logical, layers=2)
    wait_for(lambda: rig.batches_in_flight() > 0)
    room.receivers[0].abort("client went away")
    in_flight_at_release = None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        in_flight = rig.batches_in_flight()
        if room.receivers[0].release_ready():
            in_flight_at_release = in_flight
            break
        time.sleep(0.002)
    assert in_flight_at_release == 0  # the AbortAck waited for the per-layer writes
    assert rig.decodes[0].statistics().unsafe_releases == 0
    wait_for(lambda: room.senders[0].poll() is KVPoll.Failed)
    submitted = rig.batches_submitted()
    room.forward(logical, start=2)
    time.sleep(0.2)
    assert rig.batches_submitted() == submitted
    assert rig.prefills[0].per_layer.statistics().dropped == 1


def test_a_layer_write_failing_after_the_decode_aborted_still_owes_its_fence(
    rig_factory: Callable[..., Rig],
) -> None:
    """Seams issue, item 5: the decode aborts while a layer batch is in flight, then that batch fails.
    The room is FAILED by then, and the runtime used to translate the context's fences from engine
    session to decode rank through the room's destinations, which a failed room no longer has: the
    AbortAck went out with no fence after a failed write (``fences_submitted == 0``)."""
    rig = started(rig_factory, faults=LoopbackFaults(delay_seconds=0.4, fail_batches={1}))
    logical = np.arange(8, dtype=np.int64) + 30
    room = Room(rig, 17, logical, np.arange(8, dtype=np.int64) + 120, slots=0, aux=6)
    room.register(logical, 0)
    room.forward(logical, layers=1)
    wait_for(lambda: rig.batches_in_flight() > 0)
    room.receivers[0].abort("client went away")
    wait_for(lambda: room.senders[0].poll() is KVPoll.Failed)
    wait_for(room.receivers[0].release_ready)
    stats = rig.prefills[0].statistics()
    assert stats.per_layer.dropped == 1
    assert stats.endpoint.fences_submitted == 1 and stats.endpoint.fences_failed == 0
    assert rig.decodes[0].statistics().unsafe_releases == 0


def test_a_layer_write_that_times_out_owes_its_fence_before_the_abort_ack(
    rig_factory: Callable[..., Rig],
) -> None:
    """Not only a failed write: a job that ran out of its time budget (its batch finished late) may
    have left slices in the engine, so the AbortAck waits for a fence to that rank."""
    rig = started(
        rig_factory,
        faults=LoopbackFaults(delay_seconds=0.8, delay_batches={1}),
        executor=ExecutorConfig(timeout_s=0.3),
        finish_timeout_s=0.3,
    )
    logical = np.arange(6, dtype=np.int64) + 20
    room = Room(rig, 18, logical, np.arange(6, dtype=np.int64) + 140, slots=0, aux=5)
    room.register(logical, 0)
    room.forward(logical)
    room.send(logical, 0, last=True)
    wait_for(lambda: room.receivers[0].poll() is KVPoll.Failed)
    wait_for(room.receivers[0].release_ready)
    stats = rig.prefills[0].statistics()
    assert "not finished in time" in str(room.senders[0].failure() or "")
    assert stats.endpoint.fences_submitted == 1 and stats.endpoint.fences_failed == 0
    assert rig.decodes[0].statistics().unsafe_releases == 0


def test_ready_event_is_awaited_before_the_layer_is_submitted(rig_factory: Callable[..., Rig]) -> None:
    rig = started(
        rig_factory,
    )
    logical = np.arange(6, dtype=np.int64) + 40
    room = Room(rig, 8, logical, np.arange(6, dtype=np.int64) + 150, slots=0, aux=7)
    room.register(logical, 0)
    memory, manager = rig.prefill_memory[0], rig.prefills[0].per_layer
    memory.clear_pages(logical)
    layers = forward_layers(SPEC)
    events = [threading.Event() for _ in layers]

    class DeviceEvent:
        def __init__(self, event: threading.Event) -> None:
            self.event = event

        def synchronize(self) -> None:
            self.event.wait()

    # An asynchronous "GPU": the layer is reported first, its write completes later.
    for i, (model, layer) in enumerate(layers):
        manager.on_layer_end(layer, DeviceEvent(events[i]) if i % 2 else events[i].wait, model=model)
    time.sleep(0.1)
    assert rig.batches_submitted() == 0  # nothing read before its write completed
    for i, (model, layer) in enumerate(layers):
        memory.write_layer(model, layer, logical, cp_rank=0, policy=rig.policy)
        events[i].set()
    room.send(logical, 0, last=True)
    room.wait_success()
    room.verify()


def test_fallbacks_are_explicit(rig_factory: Callable[..., Rig], caplog: pytest.LogCaptureFixture) -> None:
    rig = started(rig_factory, decode_tp=2)
    manager = rig.prefills[0].per_layer
    logical = np.arange(4, dtype=np.int64)
    with caplog.at_level(logging.DEBUG, logger="pdkv.runtime.per_layer"):
        assert manager.register(RoomId(40), logical, start_token=0) is PerLayerMode.MONOLITHIC  # unknown room
        room = Room(rig, 9, logical, np.arange(4, dtype=np.int64) + 200, slots=0, aux=0)
        assert room.register(logical, 0) == [PerLayerMode.MONOLITHIC]  # two decode ranks, small layers
    messages = [r.getMessage() for r in caplog.records]
    assert any("room 40 chunk@0: monolithic path: the room has no destinations yet" in m for m in messages)
    layer_bytes = len(logical) * rig.spec.kv_item_bytes  # one layer of the 4-page chunk
    assert any(
        f"room 9 chunk@0: monolithic path: 2 destinations and a layer of {layer_bytes} bytes to one of "
        "them: under 262144 bytes per layer and destination" in m
        for m in messages
    )
    room.forward(logical)  # layer events with no context: nothing happens
    room.send(logical, 0, last=True)
    room.wait_success()
    room.verify()
    assert manager.statistics().fallbacks == 2
    with pytest.raises(UnknownLayerError, match="layer target:7 has no KV buffer"):
        manager.on_layer_end(7)


def test_with_several_decode_ranks_each_layer_goes_to_every_one_byte_for_byte(
    rig_factory: Callable[..., Rig],
) -> None:
    """Decode TP 2 under prefill TP 1 (MLA: both decode ranks hold the whole KV): once the layers are
    big enough to pay, the chunk goes per layer to both, each layer on each decode rank's lane, and
    each decode rank is told what was written to it."""
    rig = started(rig_factory, decode_tp=2, fan_out_min_layer_bytes=1)
    manager = rig.prefills[0].per_layer
    logical = np.arange(3, 9, dtype=np.int64)
    room = Room(rig, 11, logical, np.arange(6, dtype=np.int64) + 100, slots=2, aux=1)
    assert room.register(logical[:4], 0) == [PerLayerMode.PER_LAYER]
    room.forward(logical[:4])
    room.send(logical[:4], 0, last=False)
    assert room.register(logical[4:], 4) == [PerLayerMode.PER_LAYER]
    room.forward(logical[4:])
    room.send(logical[4:], 4, last=True)
    room.wait_success()
    room.verify()
    layers = len(forward_layers(rig.spec))
    stats = manager.statistics()
    assert (stats.registered, stats.fallbacks, stats.finished) == (2, 0, 2)
    assert stats.layers_submitted == 2 * 2 * layers  # two chunks, each layer to both decode ranks
    shares = [r.metric() for r in room.receivers]
    assert [m.pages for m in shares] == [6, 6]
    assert shares[0].bytes == shares[1].bytes > 0
    assert rig.prefills[0].statistics().metrics.counters.bytes_sent == shares[0].bytes + shares[1].bytes


def test_a_fanned_out_layer_failing_on_one_decode_rank_fences_that_rank_only(
    rig_factory: Callable[..., Rig],
) -> None:
    """The first batch (one layer, to one of the two decode ranks) fails: the chunk fails after both
    ranks' writes ended, the room fails on every rank, and one fence (before the AbortAck) goes to
    the rank whose write failed, none to the other; both ranks' pages come back safely."""
    rig = started(
        rig_factory, decode_tp=2, fan_out_min_layer_bytes=1, faults=LoopbackFaults(fail_batches={1})
    )
    logical = np.arange(3, 7, dtype=np.int64)
    room = Room(rig, 12, logical, np.arange(4, dtype=np.int64) + 100, slots=2, aux=1)
    assert room.register(logical, 0) == [PerLayerMode.PER_LAYER]
    room.forward(logical)
    room.send(logical, 0, last=True)
    wait_for(lambda: all(r.poll() is KVPoll.Failed and r.release_ready() for r in room.receivers))
    assert all(r.release_was_safe() for r in room.receivers)
    assert room.senders[0].poll() is KVPoll.Failed
    stats = rig.prefills[0].statistics()
    assert stats.per_layer.failed == 1
    assert stats.endpoint.fences_submitted == 1 and stats.endpoint.fences_failed == 0


def test_unsupported_layouts_are_named() -> None:
    def spec(kind: BufferKind, layer: int, base: int) -> BufferSpec:
        return BufferSpec(
            kind=kind, model=ModelRole.TARGET, layer_id=layer, base_ptr=base, length=64, item_bytes=64
        )

    k_only = BufferLayout.build(
        attention=AttentionKind.MHA,
        page_size=16,
        buffers=[spec(BufferKind.K, 0, 0), spec(BufferKind.V, 0, 64), spec(BufferKind.K, 1, 128)],
    )
    assert unsupported_reason(k_only) == "MHA layers without both K and V buffers: target:1"
    no_kv = BufferLayout.build(
        attention=AttentionKind.MLA, page_size=16, buffers=[spec(BufferKind.AUX, 0, 0)]
    )
    assert unsupported_reason(no_kv) == "the layout has no KV buffers"
    assert (
        unsupported_reason(RankMemory(SPEC, Capacity(kv_pages=2, state_slots=1, aux_rows=1)).layout) is None
    )


# ------------------------------------------------------------------ the manager alone, property-tested

DECODE_ORIGIN = Origin(instance=InstanceId("d"), epoch=Epoch(1), rank=RankCoord(tp=0))


def _apply(blocks: TransferBlocks) -> None:
    for src, dst, n in zip(blocks.src.tolist(), blocks.dst.tolist(), blocks.length.tolist(), strict=True):
        ctypes.memmove(dst, src, n)


@settings(max_examples=15)
@given(
    cp=st.sampled_from([1, 2, 3]),
    pages=st.integers(1, 24),
    start_page=st.integers(0, 6),
    resident=st.integers(0, 24),
    seed=st.integers(0, 2**16),
)
def test_layers_and_resident_pages_are_exactly_the_monolithic_plan(
    cp: int, pages: int, start_page: int, resident: int, seed: int
) -> None:
    """For any chunk, CP rank and resident prefix, what the manager writes equals plan_chunk's KV."""
    resident = min(resident, pages)
    policy: OwnershipPolicy = PageInterleaved(cp_size=cp)
    rng = np.random.default_rng(seed)
    total = start_page + pages
    logical = rng.choice(32 * cp, size=total, replace=False).astype(np.int64)
    dst_pages = rng.choice(DECODE_PAGES, size=total, replace=False).astype(np.int64)
    fabric = LoopbackFabric("per-layer-property")
    for rank in range(cp):
        source = RankMemory(SPEC, Capacity(kv_pages=32, state_slots=2, aux_rows=1))
        source.fill_prefill(cp_rank=rank, policy=policy)
        expected = RankMemory(SPEC, Capacity(kv_pages=DECODE_PAGES, state_slots=2, aux_rows=1))
        got = RankMemory(SPEC, Capacity(kv_pages=DECODE_PAGES, state_slots=2, aux_rows=1))
        with LoopbackBackend(fabric=fabric) as sender, LoopbackBackend(fabric=fabric) as receiver:
            for buffer in got.layout.buffers:
                receiver.register_range(buffer.base_ptr, buffer.length)
            for buffer in source.layout.buffers:
                sender.register_range(buffer.base_ptr, buffer.length)
            # A real endpoint rules the chunk: the decode rank registered, the room requested with
            # the decode holding the first start_page positions (so the chunk starts there).
            endpoint = PrefillEndpoint(
                origin=Origin(instance=InstanceId("p"), epoch=Epoch(1), rank=RankCoord(tp=0, cp=rank)),
                layout=source.layout,
                policy=policy,
            )
            session = SessionId(receiver.session_id)
            register = Register(
                origin=DECODE_ORIGIN, tp_size=1, endpoint=Endpoint("e"), session=session, layout=got.layout
            )
            endpoint.receive(register, 0.0)
            endpoint.open_room(RoomId(1), num_pages=total, aux_row=None, now=0.0)
            request = TransferRequest(
                origin=DECODE_ORIGIN, room=RoomId(1), dst_pages=dst_pages, prefix_pages=start_page
            )
            endpoint.receive(request, 0.0)
            [destination] = endpoint.destinations(RoomId(1)) or ()
            assert destination.peer.session == session
            chunk = logical[start_page:]
            # The reference: the monolithic plan of the same chunk for the expected memory's layout.
            reference = plan_chunk(
                RoomId(1),
                ChunkSpec(pages=chunk, start_token=start_page * 16, last=False),
                attrs_evolve_layout(destination, expected.layout),
                src_aux_row=None,
                src_layout=source.layout,
                cp_rank=rank,
                policy=policy,
                writes_extras=False,
            )
            _apply(reference.blocks)
            lock = threading.Lock()
            effects: list[PrefillEffect] = []
            with PerLayerTransferManager(
                TransferExecutor(sender),
                endpoint=endpoint,
                lock=lock,
                locked=lambda: lock,  # noqa: B023 (called inside this iteration only)
                apply=effects.extend,
                layout=source.layout,
                cp_rank=rank,
                policy=policy,
            ) as manager:
                mode = manager.register(
                    RoomId(1), chunk, start_token=start_page * 16, resident_pages=resident
                )
                assert mode is PerLayerMode.PER_LAYER
                for model, layer in reversed(forward_layers(SPEC)):  # any order of layer events
                    manager.on_layer_end(layer, model=model)
                result = manager.finish(RoomId(1), start_page * 16, pages=chunk)
            assert result is not None and result.ok, result
            assert [share.kv_pages for share in result.shares] == [reference.kv_pages]
            assert result.bytes_written == reference.blocks.total_bytes
        for key in SPEC.kv_keys():
            assert np.array_equal(got.view(key), expected.view(key)), (rank, key)


def attrs_evolve_layout(destination: Destination, layout: BufferLayout) -> Destination:
    return attrs.evolve(destination, peer=attrs.evolve(destination.peer, layout=layout))
