"""What ``PDKV_KV_CHECKSUM`` buys, shown with silent corruption injected by the loopback engine.

Each fault damages the decode's memory after a write landed, while the engine reports success (what
no protocol check can see): one flipped byte in one page of one layer, a zeroed page, two swapped
destination pages, a stale write of another room's bytes into a reused page. With checksums on, the
room fails with ``FailureCause.CHECKSUM`` naming the buffer, layer, position and prefill rank, the
counters and metrics say so, and the pages come back through the abort handshake. With checksums
off, the same faults end in Success and only a byte comparison (the test's) finds the damage.
Also covered: CP shared KV (each rank's pages checked against its own checksums), chunked prefill,
the per-layer path, and a decode TP of 2 (each decode rank checks the heads it holds).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

import pdkv.runtime.decode
import pdkv.runtime.prefill
from pdkv.engine import Corruption, CorruptionKind, LoopbackFaults
from pdkv.mapping import AttentionKind, BufferKind, ModelRole
from pdkv.metrics import PrometheusExporter, TransportCounter
from pdkv.protocol.effects import FailureCause
from pdkv.protocol.ids import RoomId
from pdkv.protocol.messages import StateIndices
from pdkv.protocol.poll import KVPoll
from pdkv.runtime.decode import KVReceiver
from pdkv.runtime.prefill import KVSender
from pdkv.testing.synthetic import ModelSpec, RankMemory, forward_layers, verify_room
from pdkv.testing.transport_pair import TransportPair

MODEL = ModelSpec(layers=3, page_size=4, kv_bytes_per_token=16, draft_layers=1)
KV = (ModelRole.TARGET, BufferKind.KV)
PAGES = 8


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


@pytest.fixture(params=[True, False], ids=["checksums", "no-checksums"])
def checksums(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def pair_of(checksums: bool, **kwargs: object) -> Iterator[TransportPair]:
    with TransportPair(model=kwargs.pop("model", MODEL), kv_checksum=checksums, **kwargs) as pair:  # type: ignore[arg-type]  # TransportPair's keywords
        yield pair


def address(memory: RankMemory, key: tuple[ModelRole, BufferKind, int], page: int, offset: int = 0) -> int:
    tensor = memory.tensors[key]
    return tensor.data_ptr() + page * tensor.shape[1] + offset


class Request:
    """One room through the pair's transports: decode pages ``dst`` by position, one chunk each of
    ``chunks`` pages (logical page ids 0..n-1 on the prefill)."""

    def __init__(self, pair: TransportPair, room: int, dst: np.ndarray, *, aux: int = 1) -> None:
        self.pair, self.room, self.dst, self.aux = pair, RoomId(room), dst, aux
        self.state_dst = np.array([2, 3])
        self.state_src = np.array([5, 6])
        self.receivers: list[KVReceiver] = []
        for decode in pair.decodes:
            receiver = decode.receiver(self.room, pair.prefill_instance)
            receiver.init(dst, aux, [StateIndices(kind=k, indices=self.state_dst) for k in MODEL.state_kinds])
            self.receivers.append(receiver)
        self.senders: list[KVSender] = [p.sender(self.room) for p in pair.prefills]
        for sender in self.senders:
            sender.init(dst.size, 0)
        wait_for(lambda: all(s.poll() is KVPoll.WaitingForInput for s in self.senders))

    def send(self, chunks: list[int] | None = None) -> None:
        sizes = chunks or [int(self.dst.size)]
        start = 0
        for n, size in enumerate(sizes):
            last = n == len(sizes) - 1
            state = (
                [StateIndices(kind=k, indices=self.state_src) for k in MODEL.state_kinds] if last else None
            )
            pages = np.arange(start, start + size)
            for sender in self.senders:
                sender.send(pages, start_token=start * MODEL.page_size, last=last, state_indices=state)
            start += size

    def finish(self) -> list[KVPoll]:
        wait_for(lambda: all(r.poll() in (KVPoll.Success, KVPoll.Failed) for r in self.receivers))
        return [r.poll() for r in self.receivers]

    def mismatches(self, decode: int = 0) -> int:
        """The test's own byte comparison with the prefill full layout (independent of checksums)."""
        memory = self.pair.decode_memory[decode]
        _, found = verify_room(
            memory,
            logical_ids=np.arange(self.dst.size),
            dst_pages=self.dst,
            prefix_pages=0,
            state_src={k: self.state_src for k in MODEL.state_kinds},
            state_dst={k: self.state_dst for k in MODEL.state_kinds},
            aux_src=0,
            aux_dst=self.aux,
        )
        return len(found)

    def clear(self) -> None:
        for receiver in self.receivers:
            wait_for(receiver.release_ready)
            receiver.clear()
        for sender in self.senders:
            wait_for(lambda s=sender: s.poll() in (KVPoll.Success, KVPoll.Failed))  # type: ignore[misc]
            sender.clear()


def corrupt(pair: TransportPair, *faults: Corruption, prefill: int = 0) -> None:
    pair.prefill_backends[prefill].set_faults(LoopbackFaults(corruptions=faults))


def expect_outcome(
    request: Request,
    checksums: bool,
    *,
    buffer: str,
    position: int,
    prefill: str = "prefill-0:tp0/cp0",
    decode: int = 0,
) -> None:
    """Checksums on: the room failed naming ``buffer`` at ``position``; off: Success over damaged bytes."""
    polls = request.finish()
    receiver = request.receivers[decode]
    if not checksums:
        assert polls[decode] is KVPoll.Success
        assert request.mismatches(decode) > 0  # the damage is there: nothing noticed it
        return
    assert polls[decode] is KVPoll.Failed
    failure = receiver.failure()
    assert failure is not None and failure.cause is FailureCause.CHECKSUM, failure
    assert failure.mismatch is not None
    assert (failure.mismatch.buffer, failure.mismatch.position, failure.mismatch.prefill) == (
        buffer,
        position,
        prefill,
    )
    assert failure.peer == prefill
    assert f"{buffer} at position {position}" in failure.reason
    # The normal release rules: the prefill rank acknowledges the abort, then the pages are free.
    wait_for(receiver.release_ready)
    transport = request.pair.decodes[decode]
    assert transport.statistics().endpoint.checksum_failures == 1
    assert transport.metrics.value(TransportCounter.CHECKSUM_FAILURES) == 1
    registry = CollectorRegistry()
    PrometheusExporter(transport.metrics, registry=registry)
    assert "pdkv_checksum_failures_total 1.0" in generate_latest(registry).decode()


# ---------------------------------------------------------------- the four faults, on and off


@pytest.mark.parametrize("threads", [False, True], ids=["inline", "checksum-threads"])
def test_one_flipped_byte_in_one_page_of_one_layer(
    checksums: bool, threads: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``threads``: the rooms count as large, so the prefill computes its checksums on its checksum
    thread while the engine writes, and the decode checks on its verifier thread."""
    if threads:
        monkeypatch.setattr(pdkv.runtime.prefill, "INLINE_CHECKSUM_BYTES", 0)
        monkeypatch.setattr(pdkv.runtime.decode, "INLINE_VERIFY_BYTES", 0)
    for pair in pair_of(checksums):
        dst = np.arange(20, 20 + PAGES)
        request = Request(pair, 1, dst)
        key = (*KV, 1)
        corrupt(
            pair,
            Corruption(kind=CorruptionKind.FLIP, at=address(pair.decode_memory[0], key, int(dst[3]), 17)),
        )
        request.send()
        expect_outcome(request, checksums, buffer="target kv layer 1", position=3)
        if threads and checksums:
            names = {t.name for t in threading.enumerate()}
            assert any(n.startswith("pdkv-verify-") for n in names), names
            assert any(n.startswith("pdkv-checksum-") for n in names), names


def test_a_zeroed_page(checksums: bool) -> None:
    for pair in pair_of(checksums):
        dst = np.arange(40, 40 + PAGES)[::-1].copy()
        request = Request(pair, 2, dst)
        key = (ModelRole.DRAFT, BufferKind.KV, 0)
        page = address(pair.decode_memory[0], key, int(dst[5]))
        corrupt(
            pair, Corruption(kind=CorruptionKind.ZERO, at=page, length=pair.decode_memory[0].kv_item_bytes)
        )
        request.send()
        expect_outcome(request, checksums, buffer="draft kv layer 0", position=5)


def test_two_swapped_destination_pages(checksums: bool) -> None:
    for pair in pair_of(checksums):
        dst = np.array([7, 3, 11, 12, 13, 2, 30, 31])
        request = Request(pair, 3, dst)
        memory, key = pair.decode_memory[0], (*KV, 2)
        length = memory.kv_item_bytes
        swap = Corruption(
            kind=CorruptionKind.SWAP,
            at=address(memory, key, int(dst[2])),
            other=address(memory, key, int(dst[6])),
            length=length,
        )
        corrupt(pair, swap)
        request.send()
        expect_outcome(request, checksums, buffer="target kv layer 2", position=2)


def test_a_stale_write_into_a_reused_page(checksums: bool) -> None:
    """Room 4 lands in decode pages 50..57 and is cleared; room 5 reuses page 54 at position 1, and
    a late write of room 4's position 4 (its bytes, from the prefill's page 4) lands over it."""
    for pair in pair_of(checksums):
        first = Request(pair, 4, np.arange(50, 50 + PAGES))
        first.send()
        assert first.finish() == [KVPoll.Success]
        first.clear()
        dst = np.array([60, 54, 61, 62, 63, 64, 65, 66])
        second = Request(pair, 5, dst)
        key = (*KV, 0)
        stale = Corruption(
            kind=CorruptionKind.COPY,
            at=address(pair.decode_memory[0], key, 54),
            other=address(pair.prefill_memory[0], key, 4),  # what room 4's write of position 4 carried
            length=pair.decode_memory[0].kv_item_bytes,
        )
        corrupt(pair, stale)
        second.send()
        expect_outcome(second, checksums, buffer="target kv layer 0", position=1)


def test_an_undamaged_room_is_verified_and_succeeds() -> None:
    for pair in pair_of(True):
        request = Request(pair, 6, np.arange(70, 70 + PAGES))
        request.send([3, 5])
        assert request.finish() == [KVPoll.Success]
        assert request.mismatches() == 0
        assert pair.decode.statistics().endpoint.rooms_verified == 1
        assert pair.decode.metrics.value(TransportCounter.ROOMS_VERIFIED) == 1
        assert pair.decode.metrics.value(TransportCounter.CHECKSUM_FAILURES) == 0


# ---------------------------------------------------------------- CP, chunks, per-layer, decode TP


def test_cp_shared_kv_each_rank_s_pages_are_checked_against_its_own_checksums() -> None:
    """CP 2 (page-interleaved: odd positions on CP rank 1): damage at position 5 names CP rank 1."""
    for pair in pair_of(True, cp=2):
        dst = np.arange(80, 80 + PAGES)
        request = Request(pair, 7, dst)
        key = (*KV, 1)
        corrupt(
            pair,
            Corruption(kind=CorruptionKind.FLIP, at=address(pair.decode_memory[0], key, int(dst[5]), 3)),
            prefill=1,
        )
        request.send()
        expect_outcome(request, True, buffer="target kv layer 1", position=5, prefill="prefill-0:tp0/cp1")


def test_chunked_prefill_damage_in_a_later_chunk_is_named() -> None:
    for pair in pair_of(True):
        dst = np.arange(90, 90 + PAGES)
        request = Request(pair, 8, dst)
        key = (*KV, 2)
        corrupt(
            pair,
            Corruption(
                kind=CorruptionKind.FLIP, at=address(pair.decode_memory[0], key, int(dst[6]), 0), mask=0x80
            ),
        )
        request.send([2, 3, 3])
        expect_outcome(request, True, buffer="target kv layer 2", position=6)


def test_the_per_layer_path_is_checked_too(checksums: bool) -> None:
    for pair in pair_of(checksums):
        dst = np.arange(100, 100 + PAGES)
        request = Request(pair, 9, dst)
        prefill, memory = pair.prefills[0], pair.prefill_memory[0]
        pages = np.arange(PAGES)
        prefill.per_layer.register(request.room, pages, start_token=0)
        key = (*KV, 1)
        corrupt(
            pair, Corruption(kind=CorruptionKind.FLIP, at=address(pair.decode_memory[0], key, int(dst[0]), 9))
        )
        memory.clear_pages(pages)
        for model, layer in forward_layers(MODEL):
            memory.write_layer(model, layer, pages, cp_rank=0, policy=pair.policy)
            prefill.per_layer.on_layer_end(layer, model=model)
        request.send()
        expect_outcome(request, checksums, buffer="target kv layer 1", position=0)
        assert prefill.statistics().per_layer.registered == 1


def test_decode_tp_2_each_decode_rank_checks_its_own_heads() -> None:
    """MHA with 4 KV heads, decode TP 2: damage in decode rank 1's K page fails its room only."""
    model = ModelSpec(
        attention=AttentionKind.MHA,
        layers=2,
        page_size=4,
        kv_heads=4,
        kv_bytes_per_token=4 * 8,
        draft_layers=0,
    )
    for pair in pair_of(True, model=model, decode_tp=2):
        dst = np.arange(10, 10 + PAGES)
        request = Request(pair, 10, dst)
        key = (ModelRole.TARGET, BufferKind.K, 1)
        corrupt(
            pair, Corruption(kind=CorruptionKind.FLIP, at=address(pair.decode_memory[1], key, int(dst[4]), 2))
        )
        request.send()
        polls = request.finish()
        assert polls[0] is KVPoll.Success and request.mismatches(0) == 0
        failure = request.receivers[1].failure()
        assert polls[1] is KVPoll.Failed and failure is not None and failure.mismatch is not None
        assert (failure.mismatch.buffer, failure.mismatch.position) == ("target k layer 1", 4)


# ---------------------------------------------------------------- one side on, the other off


def test_a_decode_that_verifies_fails_rooms_from_a_prefill_that_sends_no_checksums() -> None:
    """Opt-in per transport, and strict: a verifying decode never reports an unverified Success."""
    for pair in pair_of(False, decode_checksum=True):
        request = Request(pair, 11, np.arange(110, 110 + PAGES))
        request.send()
        assert request.finish() == [KVPoll.Failed]
        failure = request.receivers[0].failure()
        assert failure is not None and failure.cause is FailureCause.CHECKSUM
        assert "prefill prefill-0:tp0/cp0 sent no checksums" in failure.reason
        assert request.mismatches() == 0  # the bytes were fine: the room failed for want of proof


def test_a_decode_that_does_not_verify_ignores_the_checksums() -> None:
    for pair in pair_of(True, decode_checksum=False):
        request = Request(pair, 12, np.arange(120, 120 + PAGES))
        request.send()
        assert request.finish() == [KVPoll.Success]
        assert pair.decode.statistics().endpoint.rooms_verified == 0
