"""The transfer executor over the loopback backend: shaping, back-pressure, failures, delays, timeouts.

Expected destination images are built here with numpy slicing from the page plan, never with the
executor or the mapping code.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdkv.engine import (
    BackendStatistics,
    BatchHandle,
    BatchOutcome,
    BatchStatus,
    LoopbackBackend,
    LoopbackConfig,
    LoopbackFabric,
    LoopbackFaults,
    Registration,
    TransferBackend,
    WaitResult,
)
from pdkv.engine._threaded import PieceJob
from pdkv.errors import ConfigError
from pdkv.mapping import TransferBlocks, shape_batches
from pdkv.mapping.layout import TensorLike
from pdkv.runtime.executor import (
    ENV_VARS,
    ExecutorConfig,
    JobFinishedError,
    JobStatus,
    TransferExecutor,
)
from pdkv.testing.backend_conformance import HostBuffer
from tests.engine.test_inline_launch import BASE as GATED_BASE
from tests.engine.test_inline_launch import GatedBackend

PAGE = 1024


@attrs.define
class Layers:
    """``layers`` source and destination buffers of ``pages`` pages each, registered on two backends."""

    src: list[HostBuffer]
    dst: list[HostBuffer]
    registrations: list[Registration]

    def close(self) -> None:
        for registration in self.registrations:
            registration.close()


def make_layers(
    sender: TransferBackend, receiver: TransferBackend, layers: int, pages: int, seed: int
) -> Layers:
    rng = np.random.default_rng(seed)
    src = [HostBuffer(pages * PAGE) for _ in range(layers)]
    for buffer in src:
        buffer.array[:] = np.frombuffer(rng.bytes(pages * PAGE), dtype=np.uint8)
    dst = [HostBuffer(pages * PAGE, fill=0xEE) for _ in range(layers)]
    registrations = [sender.register(b) for b in src] + [receiver.register(b) for b in dst]
    return Layers(src, dst, registrations)


def page_plan(pages: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A destination page for every source page: runs of 1..8 pages, runs shuffled."""
    rng = np.random.default_rng(seed)
    cuts = np.cumsum(rng.integers(1, 9, size=pages))
    cuts = cuts[cuts < pages]
    runs = np.split(np.arange(pages), cuts)
    order = rng.permutation(len(runs))
    dst_pages = np.concatenate([runs[i] for i in order])
    src_pages = np.arange(pages)
    return src_pages, dst_pages


def layer_blocks(layers: Layers, layer: int, src_pages: np.ndarray, dst_pages: np.ndarray) -> TransferBlocks:
    """One block per maximal run contiguous on both sides (so blocks are several pages long)."""
    breaks = np.flatnonzero((np.diff(src_pages) != 1) | (np.diff(dst_pages) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    lengths = np.diff(np.concatenate([starts, [src_pages.size]]))
    return TransferBlocks(
        src=layers.src[layer].data_ptr() + src_pages[starts] * PAGE,
        dst=layers.dst[layer].data_ptr() + dst_pages[starts] * PAGE,
        length=lengths * PAGE,
        buffer=np.full(starts.size, layer),
    )


def all_blocks(layers: Layers, src_pages: np.ndarray, dst_pages: np.ndarray) -> TransferBlocks:
    return TransferBlocks.concat(
        [layer_blocks(layers, i, src_pages, dst_pages) for i in range(len(layers.src))]
    )


def assert_landed(layers: Layers, src_pages: np.ndarray, dst_pages: np.ndarray) -> None:
    for layer, (src, dst) in enumerate(zip(layers.src, layers.dst, strict=True)):
        expected = np.full_like(dst.array, 0xEE).reshape(-1, PAGE)
        expected[dst_pages] = src.array.reshape(-1, PAGE)[src_pages]
        got = dst.array.reshape(-1, PAGE)
        wrong = np.flatnonzero(~np.all(got == expected, axis=1))
        assert wrong.size == 0, f"layer {layer}: {wrong.size} destination pages differ, first {wrong[:5]}"


class RecordingBackend:
    """Delegates to a backend and records what the executor did: entries per batch, batches outstanding."""

    def __init__(self, inner: LoopbackBackend) -> None:
        self.inner = inner
        self.entries: list[int] = []
        self.outstanding: set[int] = set()
        self.max_outstanding = 0

    @property
    def session_id(self) -> str:
        return self.inner.session_id

    @property
    def max_entries_in_flight(self) -> int:
        return self.inner.max_entries_in_flight

    @property
    def engine_metadata(self) -> bytes:
        return self.inner.engine_metadata

    def add_peer(self, session: str, metadata: bytes) -> None:
        self.inner.add_peer(session, metadata)

    def register(self, memory: TensorLike) -> Registration:
        return self.inner.register(memory)

    def register_range(self, address: int, length: int, *, keepalive: object = None) -> Registration:
        return self.inner.register_range(address, length, keepalive=keepalive)

    def unregister(self, registration: Registration) -> None:
        self.inner.unregister(registration)

    def submit_write(self, peer: str, batch: TransferBlocks) -> BatchHandle:
        handle = self.inner.submit_write(peer, batch)
        self.entries.append(len(batch))
        self.outstanding.add(handle.serial)
        self.max_outstanding = max(self.max_outstanding, len(self.outstanding))
        return handle

    def cut_connections_from(self, host: str) -> int:
        return self.inner.cut_connections_from(host)

    def wait(self, handles: Sequence[BatchHandle], timeout: float | None = None) -> WaitResult:
        result = self.inner.wait(handles, timeout)
        for outcome in result.outcomes:
            if outcome.status is not BatchStatus.TIMED_OUT:
                self.outstanding.discard(outcome.handle.serial)
        return result

    def write_outcome(
        self, peer: str, batch: TransferBlocks, *, timeout: float | None = None
    ) -> BatchOutcome:
        """Through this wrapper's submit and wait, so that each batch is recorded."""
        return self.wait([self.submit_write(peer, batch)], timeout).outcomes[0]

    def write(self, peer: str, batch: TransferBlocks, *, timeout: float | None = None) -> BatchOutcome:
        return self.inner.write(peer, batch, timeout=timeout)

    def statistics(self) -> BackendStatistics:
        return self.inner.statistics()

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> RecordingBackend:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@attrs.frozen
class Rig:
    sender: RecordingBackend
    receiver: LoopbackBackend
    layers: Layers
    src_pages: np.ndarray
    dst_pages: np.ndarray

    @property
    def loopback(self) -> LoopbackBackend:
        return self.sender.inner


RigFactory = Callable[..., Rig]


@pytest.fixture
def rig_factory() -> Iterator[RigFactory]:
    opened: list[Rig] = []

    def build(
        *,
        layers: int = 4,
        pages: int = 64,
        faults: LoopbackFaults | None = None,
        max_entries_in_flight: int = 2048,
    ) -> Rig:
        fabric = LoopbackFabric("executor-test")
        config = LoopbackConfig(
            faults=faults or LoopbackFaults(), max_entries_in_flight=max_entries_in_flight
        )
        sender = RecordingBackend(LoopbackBackend(config, fabric=fabric))
        receiver = LoopbackBackend(fabric=fabric)
        src_pages, dst_pages = page_plan(pages, seed=pages + layers)
        rig = Rig(
            sender, receiver, make_layers(sender, receiver, layers, pages, seed=layers), src_pages, dst_pages
        )
        opened.append(rig)
        return rig

    yield build
    for rig in opened:
        rig.sender.close()
        rig.receiver.close()


SMALL = ExecutorConfig(slice_bytes=4 * PAGE, max_entries=16, max_batch_bytes=32 * PAGE, max_in_flight=3)


def test_monolithic_transfer_lands_every_byte(rig_factory: RigFactory) -> None:
    rig = rig_factory()
    blocks = all_blocks(rig.layers, rig.src_pages, rig.dst_pages)
    result = TransferExecutor(rig.sender, SMALL).transfer(rig.receiver.session_id, blocks)
    assert result.ok and result.status is JobStatus.COMPLETED, result.reason
    assert result.bytes_written == result.bytes_requested == 4 * 64 * PAGE
    assert result.failed_batch is None and result.batches_in_flight == 0
    assert result.batches == len(rig.sender.entries) == rig.loopback.statistics().batches_completed
    # Slicing: every block of more than 4 pages became several entries.
    sliced_entries = int(np.sum(-(-blocks.length // (4 * PAGE))))
    assert sum(rig.sender.entries) == sliced_entries
    assert max(rig.sender.entries) <= 16
    assert_landed(rig.layers, rig.src_pages, rig.dst_pages)
    stats = rig.loopback.statistics()
    assert stats.batches_in_flight == 0 and stats.batches_unwaited == 0


def test_per_layer_submission_then_one_wait(rig_factory: RigFactory) -> None:
    rig = rig_factory(faults=LoopbackFaults(delay_seconds=0.005))
    executor = TransferExecutor(rig.sender, SMALL)
    with executor.start(rig.receiver.session_id) as job:
        for layer in range(4):
            job.submit(layer_blocks(rig.layers, layer, rig.src_pages, rig.dst_pages))
            assert not job.failed
        result = job.finish()
    assert result.ok, result.reason
    assert result.bytes_written == 4 * 64 * PAGE
    assert_landed(rig.layers, rig.src_pages, rig.dst_pages)
    assert rig.loopback.statistics().batches_unwaited == 0


def test_in_flight_batches_are_bounded(rig_factory: RigFactory) -> None:
    rig = rig_factory(faults=LoopbackFaults(delay_seconds=0.01))
    config = attrs.evolve(SMALL, max_in_flight=2)
    result = TransferExecutor(rig.sender, config).transfer(
        rig.receiver.session_id, all_blocks(rig.layers, rig.src_pages, rig.dst_pages)
    )
    assert result.ok, result.reason
    assert result.batches > 4
    # Back-pressure held: the bound was reached (the producer was faster) and never passed.
    assert rig.sender.max_outstanding == 2


def test_entries_capped_by_backend_budget(rig_factory: RigFactory) -> None:
    rig = rig_factory(max_entries_in_flight=5)
    config = attrs.evolve(SMALL, max_entries=512, max_batch_bytes=1 << 30)
    result = TransferExecutor(rig.sender, config).transfer(
        rig.receiver.session_id, all_blocks(rig.layers, rig.src_pages, rig.dst_pages)
    )
    assert result.ok, result.reason
    assert max(rig.sender.entries) == 5


def test_failure_mid_chunk_waits_for_submitted_and_names_batch(rig_factory: RigFactory) -> None:
    # Batch serial 4 (index 3) fails after a delay while later batches are already in flight.
    rig = rig_factory(faults=LoopbackFaults(fail_batches={4}, delay_seconds=0.02))
    blocks = all_blocks(rig.layers, rig.src_pages, rig.dst_pages)
    result = TransferExecutor(rig.sender, SMALL).transfer(rig.receiver.session_id, blocks)
    stats = rig.loopback.statistics()
    assert result.status is JobStatus.FAILED and not result.ok
    assert result.failed_batch == 3
    assert "injected failure of batch 4" in result.reason
    # Nothing left behind: every submitted batch ended and was waited before the report.
    assert stats.batches_in_flight == 0 and stats.batches_unwaited == 0
    assert result.batches_in_flight == 0
    # It stopped submitting: at most max_in_flight batches went out after the failing one.
    assert 4 <= result.batches <= 3 + SMALL.max_in_flight
    all_batches = shape_batches(blocks, max_entries=16, slice_bytes=4 * PAGE, max_batch_bytes=32 * PAGE)
    assert result.batches < len(all_batches)
    assert result.bytes_written < result.bytes_requested == blocks.total_bytes
    assert result.bytes_written == stats.bytes_completed


def test_refused_submission_fails_the_job_after_waiting(rig_factory: RigFactory) -> None:
    rig = rig_factory(faults=LoopbackFaults(delay_seconds=0.01))
    stray = HostBuffer(PAGE)  # never registered: the sender refuses it as a source
    executor = TransferExecutor(rig.sender, SMALL)
    job = executor.start(rig.receiver.session_id)
    job.submit(layer_blocks(rig.layers, 0, rig.src_pages, rig.dst_pages))
    first_layer_batches = len(rig.sender.entries)
    job.submit(
        TransferBlocks(src=[stray.data_ptr()], dst=[rig.layers.dst[1].data_ptr()], length=[PAGE], buffer=[1])
    )
    assert job.failed
    job.submit(layer_blocks(rig.layers, 2, rig.src_pages, rig.dst_pages))  # counted, not sent
    result = job.finish()
    assert result.status is JobStatus.FAILED
    assert "refused at submission" in result.reason and "not inside any region" in result.reason
    assert result.failed_batch == first_layer_batches == result.batches
    assert len(rig.sender.entries) == first_layer_batches
    assert result.bytes_requested == 2 * 64 * PAGE + PAGE
    assert result.bytes_written == 64 * PAGE
    assert rig.loopback.statistics().batches_unwaited == 0


def test_finish_timeout_reports_in_flight_then_drain(rig_factory: RigFactory) -> None:
    rig = rig_factory(faults=LoopbackFaults(delay_seconds=0.3))
    config = attrs.evolve(SMALL, max_in_flight=64)
    job = TransferExecutor(rig.sender, config).start(rig.receiver.session_id, timeout_s=0.05)
    job.submit(layer_blocks(rig.layers, 0, rig.src_pages, rig.dst_pages))
    early = job.finish()
    assert early.status is JobStatus.TIMED_OUT and not early.ok
    assert early.batches_in_flight > 0 and early.failed_batch == 0
    assert "may still write" in early.reason
    drained = job.drain()
    assert drained.status is JobStatus.TIMED_OUT  # the budget was missed, whatever came later
    assert drained.batches_in_flight == 0
    assert drained.bytes_written == 64 * PAGE  # every batch did complete, late
    assert rig.loopback.statistics().batches_unwaited == 0
    src, dst = rig.layers.src[0].array.reshape(-1, PAGE), rig.layers.dst[0].array.reshape(-1, PAGE)
    assert np.array_equal(dst[rig.dst_pages], src[rig.src_pages])


def test_transfer_never_returns_with_batches_in_flight(rig_factory: RigFactory) -> None:
    rig = rig_factory(faults=LoopbackFaults(delay_seconds=0.2))
    config = attrs.evolve(SMALL, max_in_flight=1)
    blocks = all_blocks(rig.layers, rig.src_pages, rig.dst_pages)
    result = TransferExecutor(rig.sender, config).transfer(rig.receiver.session_id, blocks, timeout_s=0.05)
    assert result.status is JobStatus.TIMED_OUT
    # Back-pressure wait ran out on the first batch: nothing more was sent, and it was drained.
    assert result.batches == 1 and result.failed_batch == 0
    assert result.batches_in_flight == 0
    assert rig.loopback.statistics().batches_in_flight == 0


def test_context_manager_drains_on_exception(rig_factory: RigFactory) -> None:
    rig = rig_factory(faults=LoopbackFaults(delay_seconds=0.05))
    executor = TransferExecutor(rig.sender, SMALL)
    with (
        pytest.raises(RuntimeError, match="scheduler crashed"),
        executor.start(rig.receiver.session_id) as job,
    ):
        job.submit(layer_blocks(rig.layers, 0, rig.src_pages, rig.dst_pages))
        assert rig.loopback.statistics().batches_in_flight > 0
        raise RuntimeError("scheduler crashed")
    stats = rig.loopback.statistics()
    assert stats.batches_in_flight == 0 and stats.batches_unwaited == 0


def test_submit_after_finish_is_an_error(rig_factory: RigFactory) -> None:
    rig = rig_factory()
    job = TransferExecutor(rig.sender, SMALL).start(rig.receiver.session_id)
    assert job.finish().ok  # nothing submitted: trivially complete, zero bytes
    with pytest.raises(JobFinishedError):
        job.submit(layer_blocks(rig.layers, 0, rig.src_pages, rig.dst_pages))


@settings(max_examples=25)
@given(
    max_in_flight=st.integers(1, 4),
    delayed=st.sets(st.integers(1, 40), max_size=12),
    failing=st.none() | st.integers(1, 40),
)
def test_delays_never_yield_early_success(max_in_flight: int, delayed: set[int], failing: int | None) -> None:
    fabric = LoopbackFabric("property")
    faults = LoopbackFaults(
        delay_seconds=0.003,
        delay_batches=frozenset(delayed),
        fail_batches=frozenset() if failing is None else {failing},
    )
    with (
        LoopbackBackend(LoopbackConfig(faults=faults), fabric=fabric) as sender,
        LoopbackBackend(fabric=fabric) as receiver,
    ):
        layers = make_layers(sender, receiver, layers=2, pages=48, seed=7)
        src_pages, dst_pages = page_plan(48, seed=11)
        blocks = all_blocks(layers, src_pages, dst_pages)
        config = ExecutorConfig(
            slice_bytes=2 * PAGE, max_entries=4, max_batch_bytes=8 * PAGE, max_in_flight=max_in_flight
        )
        result = TransferExecutor(sender, config).transfer(receiver.session_id, blocks)
        stats = sender.statistics()
        assert stats.batches_in_flight == 0 and stats.batches_unwaited == 0
        if failing is None or failing > result.batches:
            assert result.ok, result.reason
            assert_landed(layers, src_pages, dst_pages)  # success means every byte is already there
        else:
            assert not result.ok and result.failed_batch == failing - 1
            assert result.bytes_written < blocks.total_bytes
        layers.close()


# ----------------------------------------------------------------------------------------- config


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ConfigError, match="slice_bytes"):
        ExecutorConfig(slice_bytes=2 << 20, max_batch_bytes=1 << 20)
    with pytest.raises(ConfigError, match="max_in_flight"):
        ExecutorConfig(max_in_flight=0)
    with pytest.raises(ConfigError, match="timeout_s"):
        ExecutorConfig(timeout_s=float("nan"))


def test_config_from_env() -> None:
    env = {ENV_VARS["slice_bytes"]: "65536", ENV_VARS["max_in_flight"]: "7", ENV_VARS["timeout_s"]: "2.5"}
    config = ExecutorConfig.from_env(env)
    assert (config.slice_bytes, config.max_in_flight, config.timeout_s) == (65536, 7, 2.5)
    assert config.max_entries == ExecutorConfig().max_entries
    with pytest.raises(ConfigError, match="PDKV_EXECUTOR_MAX_ENTRIES"):
        ExecutorConfig.from_env({ENV_VARS["max_entries"]: "many"})


# ---------------------------------------------------------------- shared transfers (several rooms)


def page_writes(
    layers: Layers, src_pages: np.ndarray, dst_pages: np.ndarray, rooms: int
) -> list[TransferBlocks]:
    """The plan's pages cut into ``rooms`` consecutive groups, each group every layer's blocks: one
    write per room, as the prefill gives ``transfer_shared`` one write per room's chunk."""
    groups = np.array_split(np.arange(src_pages.size), rooms)
    return [all_blocks(layers, src_pages[g], dst_pages[g]) for g in groups]


def test_shared_writes_go_as_one_batch_and_each_reports_its_own_bytes(rig_factory: RigFactory) -> None:
    rig = rig_factory(layers=2, pages=12)
    writes = page_writes(rig.layers, rig.src_pages, rig.dst_pages, rooms=3)
    config = ExecutorConfig(slice_bytes=64 * PAGE, max_entries=512, max_batch_bytes=1 << 20)
    peer = rig.receiver.session_id
    results = TransferExecutor(rig.sender, config).transfer_shared([(peer, w) for w in writes])
    assert len(rig.sender.entries) == 1  # one engine submission for the three rooms
    assert [r.status for r in results] == [JobStatus.COMPLETED] * 3
    assert [r.bytes_written for r in results] == [r.bytes_requested for r in results]
    assert [r.bytes_requested for r in results] == [w.total_bytes for w in writes]
    assert sum(r.bytes_written for r in results) == 2 * 12 * PAGE
    assert {r.shared_by for r in results} == {3}
    assert_landed(rig.layers, rig.src_pages, rig.dst_pages)
    stats = rig.loopback.statistics()
    assert stats.batches_in_flight == 0 and stats.batches_unwaited == 0


def test_a_failed_shared_batch_fails_exactly_the_writes_with_bytes_in_it(rig_factory: RigFactory) -> None:
    # Batch serial 2 fails; one batch in flight at a time, so nothing is sent after it.
    rig = rig_factory(layers=2, pages=64, faults=LoopbackFaults(fail_batches={2}, partial_write=False))
    writes = page_writes(rig.layers, rig.src_pages, rig.dst_pages, rooms=16)
    config = attrs.evolve(SMALL, max_in_flight=1)
    peer = rig.receiver.session_id
    results = TransferExecutor(rig.sender, config).transfer_shared([(peer, w) for w in writes])
    first = shape_batches(
        TransferBlocks.concat(writes), max_entries=16, slice_bytes=4 * PAGE, max_batch_bytes=32 * PAGE
    )[0].total_bytes
    assert len(rig.sender.entries) == 2  # the completed batch and the failed one; no more
    offset = 0
    for i, (write, result) in enumerate(zip(writes, results, strict=True)):
        size = write.total_bytes
        expected = min(size, max(0, first - offset))
        offset += size
        assert result.bytes_written == expected, i
        assert result.ok == (expected == size), i
        assert result.bytes_requested == size
        if not result.ok:
            assert result.status is JobStatus.FAILED
            assert "injected failure of batch 2" in result.reason and "shared by 16" in result.reason
    assert any(r.ok for r in results) and not all(r.ok for r in results)
    assert sum(r.bytes_written for r in results) == first == rig.loopback.statistics().bytes_completed
    stats = rig.loopback.statistics()
    assert stats.batches_in_flight == 0 and stats.batches_unwaited == 0


def test_shared_writes_to_two_peers_keep_their_order_and_peers() -> None:
    fabric = LoopbackFabric("executor-shared")
    with (
        LoopbackBackend(fabric=fabric) as sender,
        LoopbackBackend(fabric=fabric) as first,
        LoopbackBackend(fabric=fabric) as second,
    ):
        src_pages, dst_pages = page_plan(16, seed=3)
        to_first = make_layers(sender, first, layers=1, pages=16, seed=1)
        to_second = make_layers(sender, second, layers=1, pages=16, seed=2)
        a = page_writes(to_first, src_pages, dst_pages, rooms=2)
        b = page_writes(to_second, src_pages, dst_pages, rooms=2)
        writes = [
            (first.session_id, a[0]),
            (second.session_id, b[0]),
            (first.session_id, a[1]),
            (second.session_id, b[1]),
        ]
        results = TransferExecutor(sender).transfer_shared(writes)
        assert [r.peer for r in results] == [first.session_id, second.session_id] * 2
        assert all(r.ok and r.shared_by == 2 for r in results)
        assert [r.bytes_written for r in results] == [w.total_bytes for _, w in writes]
        assert sender.statistics().batches_submitted == 2  # one per peer
        assert_landed(to_first, src_pages, dst_pages)
        assert_landed(to_second, src_pages, dst_pages)
        to_first.close()
        to_second.close()


def test_writes_in_a_timed_out_batch_fail_even_if_it_lands_later(rig_factory: RigFactory) -> None:
    # Batch serial 2 outlasts the budget and lands while it is drained; one batch in flight at a time.
    rig = rig_factory(layers=2, pages=64, faults=LoopbackFaults(delay_seconds=0.4, delay_batches={2}))
    writes = page_writes(rig.layers, rig.src_pages, rig.dst_pages, rooms=16)
    config = attrs.evolve(SMALL, max_in_flight=1)
    peer = rig.receiver.session_id
    results = TransferExecutor(rig.sender, config).transfer_shared([(peer, w) for w in writes], timeout_s=0.1)
    shaped = shape_batches(
        TransferBlocks.concat(writes), max_entries=16, slice_bytes=4 * PAGE, max_batch_bytes=32 * PAGE
    )
    first, second = shaped[0].total_bytes, shaped[1].total_bytes
    assert len(rig.sender.entries) == 2  # nothing was sent after the slow batch
    offset = 0
    for i, (write, result) in enumerate(zip(writes, results, strict=True)):
        size = write.total_bytes
        landed = min(size, max(0, first + second - offset))  # both batches completed in the end
        in_first = offset + size <= first
        offset += size
        assert result.bytes_written == landed, i
        assert result.ok == in_first, i
        if not in_first:
            assert result.status is JobStatus.TIMED_OUT and "not finished in time" in result.reason
    stats = rig.loopback.statistics()
    assert stats.bytes_completed == first + second
    assert stats.batches_in_flight == 0 and stats.batches_unwaited == 0


# ------------------------------------------------------- one batch, written on the caller's thread


def gated_batch(entries: int = 1) -> TransferBlocks:
    """``entries`` blocks of 8 B inside the gated backend's registered range."""
    offsets = np.arange(entries, dtype=np.int64) * 8
    return TransferBlocks(
        src=GATED_BASE + offsets, dst=offsets, length=np.full(entries, 8), buffer=np.zeros(entries)
    )


def _gated(bound_s: float | None = 5.0, refuse: frozenset[int] = frozenset()) -> GatedBackend:
    """A backend whose completions wait for the test (``tests.engine.test_inline_launch``), the lane
    to "peer" reached once (so that a caller may launch on it)."""
    backend = GatedBackend(bound_s=bound_s, refuse=refuse)
    backend.register_range(GATED_BASE, 4096)
    first = backend.submit_write("peer", gated_batch())
    backend.release.release()
    assert backend.wait([first], 10).ok
    return backend


def test_a_one_batch_transfer_is_written_and_waited_on_the_callers_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend = _gated()
    lane = backend._lanes["peer"]
    ran_here: list[int] = []
    run_here = lane.run_here

    def spied(job: PieceJob) -> str | None:
        ran_here.append(job.handle.serial)
        return run_here(job)

    monkeypatch.setattr(lane, "run_here", spied)
    backend.release.release()
    result = TransferExecutor(backend).transfer("peer", gated_batch(3))
    main = threading.current_thread().name
    assert result.ok and (result.batches, result.bytes_written, result.bytes_requested) == (1, 24, 24)
    assert ran_here == [2]  # one call into the backend: no hold, no claim, no lane thread
    assert backend.launches[-1] == (2, main) and backend.completions[-1] == (2, main)
    backend.close()


def test_a_one_batch_transfer_that_fails_on_the_callers_thread_reports_it() -> None:
    backend = _gated(refuse=frozenset({2}))
    result = TransferExecutor(backend).transfer("peer", gated_batch(3))
    assert result.status is JobStatus.FAILED and "refused" in result.reason
    assert (result.batches, result.failed_batch, result.bytes_written) == (1, 0, 0)
    assert result.batches_in_flight == 0
    backend.close()


def test_a_one_batch_transfer_past_its_budget_is_timed_out_and_drained_before_it_returns() -> None:
    """The engine's bound (5 s) is over the job's budget: the lane's threads write it, the wait runs
    out, and transfer() still waits for the batch before it says TIMED_OUT (memory stays untouched
    by a write the caller no longer expects)."""
    backend = _gated()
    released: list[float] = []

    def release_later() -> None:
        time.sleep(0.4)
        released.append(time.monotonic())
        backend.release.release()

    releaser = threading.Thread(target=release_later)
    releaser.start()
    result = TransferExecutor(backend, ExecutorConfig(timeout_s=0.1)).transfer("peer", gated_batch())
    returned = time.monotonic()
    releaser.join(10)
    assert result.status is JobStatus.TIMED_OUT and result.batches_in_flight == 0
    assert "not finished in time" in result.reason and released and released[0] <= returned
    backend.close()


def test_a_transfer_that_shapes_into_several_batches_keeps_the_job_path() -> None:
    backend = _gated()
    for _ in range(2):
        backend.release.release()
    result = TransferExecutor(backend, ExecutorConfig(max_entries=2)).transfer("peer", gated_batch(3))
    assert result.ok and result.batches == 2 and result.bytes_written == 24
    assert [serial for serial, _ in backend.launches] == [1, 2, 3]
    backend.close()
