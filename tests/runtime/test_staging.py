"""The staging pool under the executor, over the loopback engine: what lands, when staging space comes
back (every batch ended COMPLETED; a failed one's only at its peer's drain point or after the
quarantine bound), back-pressure without failure, the deadline, and the decisions to stage or not.

The write used throughout: ``COUNT`` slices of ``SLICE`` bytes every ``STRIDE`` bytes of one source
tensor (a head slice of every token), to consecutive destination bytes (whole pages there). Expected
destination images come from numpy slicing of the source, never from the code under test.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import attrs
import numpy as np
import pytest
import torch

from pdkv.engine import LoopbackBackend, LoopbackConfig, LoopbackFabric, LoopbackFaults
from pdkv.errors import ConfigError, TransferError
from pdkv.mapping import AttentionKind, BufferKind, BufferLayout, BufferSpec, ModelRole, TransferBlocks
from pdkv.runtime.executor import ExecutorConfig, JobStatus, TransferExecutor
from pdkv.runtime.staging import StagingConfig, StagingPool, _copy_threads
from pdkv.testing.backend_conformance import HostBuffer

SLICE, STRIDE, COUNT = 16, 48, 256  # 4 KiB to move, strided by 3 at the source
PIECE = 1024  # 4 pieces of 64 slices; each piece is one staged block


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@attrs.define
class World:
    fabric: LoopbackFabric
    sender: LoopbackBackend
    receiver: LoopbackBackend
    source: torch.Tensor
    layout: BufferLayout
    destination: HostBuffer

    def blocks(self, *, count: int = COUNT, first: int = 0) -> TransferBlocks:
        i = np.arange(first, first + count, dtype=np.int64)
        return TransferBlocks(
            src=self.source.data_ptr() + i * STRIDE,
            dst=self.destination.data_ptr() + i * SLICE,
            length=np.full(count, SLICE),
            buffer=np.zeros(count, dtype=np.int64),
        )

    def expected(self, *, count: int = COUNT, first: int = 0) -> np.ndarray:
        image = np.zeros(self.destination.numel(), dtype=np.uint8)
        rows = self.source.numpy().reshape(-1, STRIDE)[first : first + count, :SLICE]
        image[first * SLICE : (first + count) * SLICE] = rows.reshape(-1)
        return image

    def pool(self, **config: int | float) -> StagingPool:
        fields = {"capacity_bytes": 4 * PIECE, "piece_bytes": PIECE, **config}
        return StagingPool(self.sender, self.layout, [self.source], StagingConfig(**fields))  # type: ignore[arg-type]


@pytest.fixture
def world() -> Iterator[World]:
    fabric = LoopbackFabric("staging")
    sender = LoopbackBackend(LoopbackConfig(worker_threads=4), fabric=fabric)
    receiver = LoopbackBackend(fabric=fabric)
    source = torch.randint(0, 256, (COUNT * STRIDE,), dtype=torch.uint8)
    layout = BufferLayout.build(
        attention=AttentionKind.MHA,
        page_size=1,
        buffers=[
            BufferSpec(
                kind=BufferKind.K,
                model=ModelRole.TARGET,
                layer_id=0,
                base_ptr=source.data_ptr(),
                length=source.numel(),
                item_bytes=STRIDE,
            )
        ],
    )
    destination = HostBuffer(2 * COUNT * SLICE)
    sender.register(source)
    receiver.register(destination)
    yield World(fabric, sender, receiver, source, layout, destination)
    sender.close()
    receiver.close()


def landed(world: World) -> np.ndarray:
    return world.destination.array.copy()


def test_a_staged_write_lands_as_few_blocks_and_every_lease_returns(world: World) -> None:
    pool = world.pool()
    result = TransferExecutor(world.sender, staging=pool).transfer(world.receiver.session_id, world.blocks())
    assert result.ok and result.bytes_written == COUNT * SLICE
    assert np.array_equal(landed(world), world.expected())
    stats = pool.statistics()
    assert (stats.staged_writes, stats.staged_pieces, stats.staged_bytes) == (1, 4, COUNT * SLICE)
    assert stats.entries_saved == COUNT - 4  # one entry per piece instead of one per slice
    assert world.sender.statistics().batches_submitted == 4  # a piece's batch, not 256 entries
    assert (stats.in_use_bytes, stats.quarantined_bytes) == (0, 0)
    assert 0 < stats.peak_in_use_bytes <= stats.capacity_bytes


def test_a_piece_waits_for_space_instead_of_failing(world: World) -> None:
    world.sender.set_faults(LoopbackFaults(delay_seconds=0.2))
    pool = world.pool(capacity_bytes=PIECE)  # room for one piece: each waits for the one before
    result = TransferExecutor(world.sender, staging=pool).transfer(world.receiver.session_id, world.blocks())
    assert result.ok
    assert np.array_equal(landed(world), world.expected())
    stats = pool.statistics()
    assert stats.waits >= 3 and stats.wait_seconds > 0.3
    assert stats.peak_in_use_bytes == PIECE and stats.in_use_bytes == 0


def test_space_held_by_another_peers_job_comes_back_without_that_job_waiting(world: World) -> None:
    # transfer_shared submits to every peer before it waits for any: the first job's batch holds the
    # whole pool while the second job asks for space on the same thread. The pool follows the batch's
    # end itself, so the second job gets the space (it would otherwise wait for its whole deadline).
    other = LoopbackBackend(fabric=world.fabric)
    second = HostBuffer(world.destination.numel())
    other.register(second)
    try:
        world.sender.set_faults(LoopbackFaults(delay_seconds=1.0, delay_batches={1}))  # job 1's batch
        pool = world.pool(capacity_bytes=PIECE)
        executor = TransferExecutor(world.sender, ExecutorConfig(timeout_s=10.0), staging=pool)
        one = world.blocks(count=64)
        two = attrs.evolve(one, dst=one.dst - world.destination.data_ptr() + second.data_ptr())
        results = executor.transfer_shared([(world.receiver.session_id, one), (other.session_id, two)])
        assert [r.status for r in results] == [JobStatus.COMPLETED] * 2
        assert np.array_equal(second.array, world.expected(count=64))
        assert pool.statistics().waits >= 1
    finally:
        other.close()


def test_no_space_before_the_deadline_times_the_job_out_with_nothing_submitted(world: World) -> None:
    pool = world.pool(capacity_bytes=PIECE)
    held = pool.acquire_nowait("elsewhere", PIECE)  # a write that never ends, as far as this job knows
    assert held is not None
    executor = TransferExecutor(world.sender, ExecutorConfig(timeout_s=0.3), staging=pool)
    result = executor.transfer(world.receiver.session_id, world.blocks())
    assert result.status is JobStatus.TIMED_OUT and "no staging space" in result.reason
    assert result.batches == 0 and result.bytes_written == 0
    pool.seal(held)  # no batch was submitted from it: sealed, it comes back at once
    assert pool.statistics().in_use_bytes == 0


def test_a_failed_batch_quarantines_its_staging_until_a_later_write_to_that_peer_completes(
    world: World,
) -> None:
    other = LoopbackBackend(fabric=world.fabric)
    other.register(second := HostBuffer(64))
    try:
        world.sender.set_faults(LoopbackFaults(fail_batches={4}))  # the last piece: no batch after it
        pool = world.pool()
        executor = TransferExecutor(world.sender, staging=pool)
        failed = executor.transfer(world.receiver.session_id, world.blocks())
        assert failed.status is JobStatus.FAILED
        stats = pool.statistics()
        assert (stats.quarantined, stats.quarantined_bytes, stats.in_use_bytes) == (1, PIECE, 0)
        world.sender.set_faults(LoopbackFaults())
        fence = TransferBlocks(src=[world.source.data_ptr()], dst=[second.data_ptr()], length=[8], buffer=[0])
        assert executor.transfer(other.session_id, fence).ok  # another peer drains nothing of this one
        assert pool.statistics().quarantined_bytes == PIECE
        fence = attrs.evolve(fence, dst=[world.destination.data_ptr()])
        assert executor.transfer(world.receiver.session_id, fence).ok  # its peer's drain point
        stats = pool.statistics()
        assert (stats.quarantined_bytes, stats.released_proven, stats.released_unproven) == (0, 1, 0)
    finally:
        other.close()


def test_quarantine_ends_unproven_after_its_bound(world: World) -> None:
    clock = FakeClock()
    world.sender.set_faults(LoopbackFaults(fail_batches={1}))
    pool = StagingPool(
        world.sender,
        world.layout,
        [world.source],
        StagingConfig(capacity_bytes=4 * PIECE, piece_bytes=PIECE, quarantine_s=10.0),
        clock=clock,
    )
    executor = TransferExecutor(world.sender, staging=pool)
    assert not executor.transfer(world.receiver.session_id, world.blocks(count=64)).ok  # one piece
    assert pool.statistics().quarantined_bytes == PIECE
    for step in (9.0, 1.0):  # an acquire sweeps the bound: not yet, then past it
        clock.now += step
        lease = pool.acquire_nowait("x", 8)
        assert lease is not None
        pool.seal(lease)
        if step == 9.0:
            assert pool.statistics().quarantined_bytes == PIECE
    stats = pool.statistics()
    assert (stats.quarantined_bytes, stats.released_unproven, stats.released_proven) == (0, 1, 0)


def test_quarantined_space_never_makes_a_piece_wait_it_goes_unstaged(world: World) -> None:
    world.sender.set_faults(LoopbackFaults(fail_batches={1}))
    pool = world.pool(capacity_bytes=PIECE)
    executor = TransferExecutor(world.sender, ExecutorConfig(timeout_s=5.0), staging=pool)
    assert not executor.transfer(world.receiver.session_id, world.blocks(count=64)).ok
    assert pool.statistics().quarantined_bytes == PIECE  # the whole pool: waiting could not help
    world.sender.set_faults(LoopbackFaults())
    world.destination.array[:] = 0
    result = executor.transfer(world.receiver.session_id, world.blocks())
    assert result.ok and np.array_equal(landed(world), world.expected())
    stats = pool.statistics()
    # The first piece went unstaged; its completion drained the peer, so the quarantined lease came
    # back (proven) and later pieces may have been staged again (waiting only for live leases).
    assert stats.direct_pieces >= 1
    assert stats.quarantined_bytes == 0 and stats.released_proven == 1


def test_writes_that_gain_nothing_go_unstaged(world: World) -> None:
    pool = world.pool()
    executor = TransferExecutor(world.sender, staging=pool)
    whole = TransferBlocks(
        src=[world.source.data_ptr()], dst=[world.destination.data_ptr()], length=[PIECE], buffer=[0]
    )
    strided_there = attrs.evolve(
        world.blocks(), dst=world.destination.data_ptr() + np.arange(COUNT) * 2 * SLICE
    )
    outside = attrs.evolve(world.blocks(count=8), buffer=np.full(8, 3))  # a buffer the pool cannot read
    for blocks in (whole, strided_there, outside):
        assert executor.transfer(world.receiver.session_id, blocks).ok
    stats = pool.statistics()
    assert (stats.staged_writes, stats.direct_writes) == (0, 3)
    assert pool.plan(world.blocks(count=3)) is None  # fewer entries than min_gain: nothing to save


def test_a_failed_copy_fails_the_job_and_returns_the_lease(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = world.pool()

    def broken(*_: object) -> TransferBlocks:
        raise RuntimeError("device lost")

    monkeypatch.setattr(pool, "gather", broken)
    result = TransferExecutor(world.sender, staging=pool).transfer(world.receiver.session_id, world.blocks())
    assert (
        result.status is JobStatus.FAILED
        and "staging copy failed: RuntimeError: device lost" in result.reason
    )
    assert result.batches == 0
    assert pool.statistics().in_use_bytes == 0


def test_a_batch_refused_at_submission_holds_no_staging(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = world.pool()

    def refuse(*_: object) -> object:
        raise TransferError("closed")

    monkeypatch.setattr(world.sender, "submit_write", refuse)
    result = TransferExecutor(world.sender, staging=pool).transfer(world.receiver.session_id, world.blocks())
    assert result.status is JobStatus.FAILED and "refused at submission" in result.reason
    stats = pool.statistics()
    assert (stats.in_use_bytes, stats.quarantined_bytes) == (0, 0)


def test_the_pool_checks_its_sources_and_config(world: World) -> None:
    with pytest.raises(ConfigError, match="1 source tensors for 2 layout buffers"):
        StagingPool(
            world.sender,
            BufferLayout.build(
                attention=AttentionKind.MHA,
                page_size=1,
                buffers=[*world.layout.buffers, attrs.evolve(world.layout.buffers[0], kind=BufferKind.V)],
            ),
            [world.source],
        )
    with pytest.raises(ConfigError, match=r"the tensor is 6144 bytes at 0x[0-9a-f]+, the layout says 12288"):
        StagingPool(world.sender, world.layout, [world.source[: COUNT * STRIDE // 2]])
    with pytest.raises(ConfigError, match="is not contiguous"):
        StagingPool(world.sender, world.layout, [world.source.view(-1, 2)[:, 0]])
    with pytest.raises(ConfigError, match="piece_bytes 2048 exceeds capacity_bytes 1024"):
        StagingConfig(capacity_bytes=1024, piece_bytes=2048)
    registrations = world.sender.statistics().registrations
    pool = StagingPool(world.sender, world.layout, [None])  # nothing readable: every write unstaged
    assert world.sender.statistics().registrations == registrations + 1  # registered once, up front
    assert pool.plan(world.blocks()) is None
    pool.close()
    assert world.sender.statistics().registrations == registrations


def test_closing_with_a_lease_out_leaves_the_memory_registered(world: World) -> None:
    registrations = world.sender.statistics().registrations
    pool = world.pool()
    lease = pool.acquire_nowait("x", 64)
    assert lease is not None
    pool.close()
    assert pool.acquire_nowait("x", 64) is None and not pool.could_fit(64)
    assert world.sender.statistics().registrations == registrations + 1  # the backend's close ends it


def test_cpu_copy_threads_are_set_on_the_calling_thread_only() -> None:
    before = torch.get_num_threads()
    seen: list[int] = []
    with _copy_threads(1):
        seen.append(torch.get_num_threads())
        other = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        other.start()
        other.join()
    assert seen == [1, before]
    assert torch.get_num_threads() == before
