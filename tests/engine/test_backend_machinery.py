"""The shared backend machinery (region table, splitting, waits, statistics), driven through loopback."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pdkv.engine import (
    BatchFailedError,
    BatchStatus,
    BatchTimedOutError,
    ForeignHandleError,
    InvalidBatchError,
    LoopbackBackend,
    LoopbackConfig,
    LoopbackFabric,
    LoopbackFaults,
    MemoryRegion,
    RegistrationError,
    UnregisteredMemoryError,
)
from pdkv.engine._threaded import PieceJob, RegionTable
from pdkv.engine.backend import Registration
from pdkv.errors import TransferError
from pdkv.mapping import TransferBlocks
from pdkv.testing.backend_conformance import HostBuffer


class _Owner:
    def unregister(self, registration: Registration) -> None:
        registration.mark_closed()


@given(
    regions=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 20)), max_size=6),
    blocks=st.lists(st.tuples(st.integers(0, 1500), st.integers(0, 40)), min_size=1, max_size=80),
)
def test_region_table_matches_a_byte_by_byte_check(
    regions: list[tuple[int, int]], blocks: list[tuple[int, int]]
) -> None:
    """Both ways of checking: block by block up to ``SMALL_ARRAY`` blocks, numpy over more."""
    table = RegionTable()
    covered: set[int] = set()
    owner = _Owner()
    for slot, length in regions:
        region = MemoryRegion(slot * 25, length)  # slots 25 B apart, lengths <= 20: never overlapping
        if table.overlapping(region) is None:
            table.add(Registration(owner, region, None))
            covered.update(range(region.address, region.end))
    addresses = np.array([a for a, _ in blocks], dtype=np.int64)
    lengths = np.array([n for _, n in blocks], dtype=np.int64)
    # Reference: a block is inside when one region holds all its bytes (regions here never touch).
    expected = -1
    for index, (address, length) in enumerate(blocks):
        if length == 0:
            continue
        inside = any(
            r.address <= address and address + length <= r.end
            for r in (reg.region for reg in table.registrations())
        )
        if not inside:
            expected = index
            break
    assert table.first_outside(addresses, lengths) == expected


@pytest.mark.parametrize("copies", [1, 40], ids=["short", "numpy"])
def test_region_table_edges_of_a_region(copies: int) -> None:
    """A block that ends at a region's end is inside, one byte more is not, nor one a byte before its
    start; a zero-length block is never outside (both paths: up to ``SMALL_ARRAY`` blocks and over)."""
    table = RegionTable()
    table.add(Registration(_Owner(), MemoryRegion(1000, 100), None))
    table.add(Registration(_Owner(), MemoryRegion(1200, 100), None))
    inside = [(1000, 100), (1099, 1), (1200, 100), (5000, 0), (0, 0)]
    for bad in [(1099, 2), (999, 1), (1100, 1), (1150, 60), (1299, 2)]:
        blocks = inside * copies + [bad] + inside
        addresses = np.array([a for a, _ in blocks], dtype=np.int64)
        lengths = np.array([n for _, n in blocks], dtype=np.int64)
        assert table.first_outside(addresses, lengths) == len(inside) * copies, bad
    everything = np.array([a for a, _ in inside * copies]), np.array([n for _, n in inside * copies])
    assert table.first_outside(*everything) == -1


def test_region_table_reports_overlap() -> None:
    table = RegionTable()
    table.add(Registration(_Owner(), MemoryRegion(1000, 100), None))
    assert table.overlapping(MemoryRegion(1099, 10)) == MemoryRegion(1000, 100)
    assert table.overlapping(MemoryRegion(1100, 10)) is None
    assert table.overlapping(MemoryRegion(990, 10)) is None


@pytest.fixture
def fabric() -> LoopbackFabric:
    return LoopbackFabric("machinery")


@pytest.fixture
def pair(fabric: LoopbackFabric) -> Iterator[tuple[LoopbackBackend, LoopbackBackend]]:
    with LoopbackBackend(fabric=fabric) as sender, LoopbackBackend(fabric=fabric) as receiver:
        yield sender, receiver


def _one_block(src: HostBuffer, dst: HostBuffer, length: int, dst_offset: int = 0) -> TransferBlocks:
    return TransferBlocks(
        src=[src.data_ptr()], dst=[dst.data_ptr() + dst_offset], length=[length], buffer=[0]
    )


def test_register_torch_tensor_keeps_it_alive(pair: tuple[LoopbackBackend, LoopbackBackend]) -> None:
    sender, receiver = pair
    tensor = torch.arange(256, dtype=torch.int32)
    registration = sender.register(tensor)
    assert registration.region == MemoryRegion(tensor.data_ptr(), 1024)
    address = tensor.data_ptr()
    del tensor  # the registration still holds it: the memory stays valid for the engine
    dst = HostBuffer(1024)
    with receiver.register(dst):
        sender.write(
            receiver.session_id,
            TransferBlocks(src=[address], dst=[dst.data_ptr()], length=[1024], buffer=[0]),
        )
        assert np.array_equal(dst.array.view(np.int32), np.arange(256, dtype=np.int32))
    registration.close()


def test_register_refuses_non_contiguous_and_empty(pair: tuple[LoopbackBackend, LoopbackBackend]) -> None:
    sender, _ = pair
    with pytest.raises(RegistrationError, match="non-contiguous"):
        sender.register(torch.zeros(8, 8)[:, 0])
    with pytest.raises(RegistrationError, match="> 0"):
        sender.register_range(0x1000, 0)


def test_registration_of_another_backend_is_refused(pair: tuple[LoopbackBackend, LoopbackBackend]) -> None:
    sender, receiver = pair
    buffer = HostBuffer(64)
    with receiver.register(buffer) as registration, pytest.raises(ForeignHandleError):
        sender.unregister(registration)


def test_submit_checks_peer_and_handles(pair: tuple[LoopbackBackend, LoopbackBackend]) -> None:
    sender, receiver = pair
    with pytest.raises(InvalidBatchError):
        sender.submit_write("", TransferBlocks.empty())
    handle = receiver.submit_write(sender.session_id, TransferBlocks.empty())
    with pytest.raises(ForeignHandleError):
        sender.wait([handle])
    assert receiver.wait([handle]).ok


def test_split_pieces_respect_the_budget_and_land(fabric: LoopbackFabric) -> None:
    # The loopback lane refuses more than max_entries_in_flight entries per peer, so a batch of
    # 3.5 budgets only completes if the backend split it and queued the parts.
    config = LoopbackConfig(max_entries_in_flight=10, worker_threads=3)
    with LoopbackBackend(config, fabric=fabric) as sender, LoopbackBackend(fabric=fabric) as receiver:
        src, dst = HostBuffer(35 * 8), HostBuffer(35 * 8)
        src.array[:] = np.arange(35 * 8) % 251
        with sender.register(src), receiver.register(dst):
            offsets = np.arange(35, dtype=np.int64) * 8
            batch = TransferBlocks(
                src=src.data_ptr() + offsets,
                dst=dst.data_ptr() + offsets[::-1],
                length=np.full(35, 8),
                buffer=np.zeros(35),
            )
            handles = [sender.submit_write(receiver.session_id, batch) for _ in range(3)]
            assert sender.wait(handles, 10).ok
        assert np.array_equal(dst.array.reshape(35, 8), src.array.reshape(35, 8)[::-1])


def test_wait_results_and_statistics(fabric: LoopbackFabric) -> None:
    faults = LoopbackFaults(fail_batches={2}, delay_seconds=1.0, delay_batches={3}, partial_write=False)
    with (
        LoopbackBackend(LoopbackConfig(faults=faults), fabric=fabric) as sender,
        LoopbackBackend(fabric=fabric) as receiver,
    ):
        src, dst = HostBuffer(4096, fill=9), HostBuffer(4096)
        with sender.register(src), receiver.register(dst):
            handles = [
                sender.submit_write(
                    receiver.session_id, _one_block(src, dst, 100 * (i + 1), dst_offset=1000 * i)
                )
                for i in range(3)
            ]
            # The first two end at once (one fails); waited for first, so that a busy machine cannot
            # turn the failure into a timeout of the short wait below.
            sender.wait(handles[:2], 5)
            early = sender.wait(handles, 0.05)
            assert [o.status for o in early.outcomes] == [
                BatchStatus.COMPLETED,
                BatchStatus.FAILED,
                BatchStatus.TIMED_OUT,
            ]
            assert early.bytes_completed == 100 and not early.ok
            assert early.failed[0].handle is handles[1] and early.timed_out[0].handle is handles[2]
            with pytest.raises(BatchFailedError) as failed:
                early.raise_for_status()
            assert failed.value.outcome.handle is handles[1]
            stats = sender.statistics()
            assert (stats.batches_submitted, stats.batches_completed, stats.batches_failed) == (3, 1, 1)
            assert stats.batches_in_flight == 1 and stats.batches_unwaited == 1
            late = sender.wait([handles[2]], 5)
            assert late.ok and late.outcomes[0].seconds >= 1.0
            assert sender.statistics().batches_unwaited == 0
            assert sender.statistics().bytes_completed == 400
        # Batches 1 and 3 landed; the failing batch 2 (partial_write=False) wrote nothing.
        assert np.all(dst.array[0:100] == 9) and np.all(dst.array[2000:2300] == 9)
        assert np.all(dst.array[1000:1200] == 0) and int(np.count_nonzero(dst.array)) == 400


def test_write_raises_typed_errors(fabric: LoopbackFabric) -> None:
    faults = LoopbackFaults(failing_peers={"loopback:elsewhere:1"}, delay_seconds=0.3, delay_batches={2})
    with (
        LoopbackBackend(LoopbackConfig(faults=faults), fabric=fabric) as sender,
        LoopbackBackend(fabric=fabric) as receiver,
    ):
        src, dst = HostBuffer(64), HostBuffer(64)
        with sender.register(src), receiver.register(dst):
            with pytest.raises(BatchFailedError, match="is failing") as failed:
                sender.write("loopback:elsewhere:1", _one_block(src, dst, 8))
            assert isinstance(failed.value, TransferError)
            with pytest.raises(BatchTimedOutError, match="may still be in flight"):
                sender.write(receiver.session_id, _one_block(src, dst, 8), timeout=0.01)
            sender.close()  # waits for the timed-out batch before unregistering
            assert sender.statistics().batches_in_flight == 0


def test_unregistered_source_names_the_block(pair: tuple[LoopbackBackend, LoopbackBackend]) -> None:
    sender, receiver = pair
    src = HostBuffer(64)
    with sender.register(src):
        batch = TransferBlocks(
            src=[src.data_ptr(), src.data_ptr() + 60], dst=[0, 0], length=[4, 8], buffer=[0, 0]
        )
        with pytest.raises(UnregisteredMemoryError) as refused:
            sender.submit_write(receiver.session_id, batch)
    assert (refused.value.block, refused.value.address, refused.value.length) == (1, src.data_ptr() + 60, 8)


def test_failing_batch_writes_part_of_itself_by_default(fabric: LoopbackFabric) -> None:
    faults = LoopbackFaults(fail_batches={1})
    with (
        LoopbackBackend(LoopbackConfig(faults=faults), fabric=fabric) as sender,
        LoopbackBackend(fabric=fabric) as receiver,
    ):
        src, dst = HostBuffer(4 * 16, fill=5), HostBuffer(4 * 16)
        with sender.register(src), receiver.register(dst):
            offsets = np.arange(4, dtype=np.int64) * 16
            batch = TransferBlocks(
                src=src.data_ptr() + offsets,
                dst=dst.data_ptr() + offsets,
                length=np.full(4, 16),
                buffer=np.zeros(4),
            )
            assert sender.wait([sender.submit_write(receiver.session_id, batch)]).failed
        # Half the blocks landed, as a real engine's partial write might: callers must not trust them.
        assert np.all(dst.array[:32] == 5) and np.all(dst.array[32:] == 0)


def test_delayed_batch_is_really_in_flight(pair: tuple[LoopbackBackend, LoopbackBackend]) -> None:
    sender, receiver = pair
    sender.set_faults(LoopbackFaults(delay_seconds=0.2))
    src, dst = HostBuffer(64, fill=3), HostBuffer(64)
    with sender.register(src), receiver.register(dst):
        handle = sender.submit_write(receiver.session_id, _one_block(src, dst, 64))
        time.sleep(0.05)
        assert np.all(dst.array == 0)  # nothing landed yet
        assert sender.wait([handle], 0).timed_out
        assert sender.wait([handle], 5).ok
        assert np.all(dst.array == 3)


class _CrashingBackend(LoopbackBackend):
    """Crashes launching odd batches and completing even ones."""

    def _launch(self, job: PieceJob) -> Future[None]:
        if job.handle.serial % 2:
            raise RuntimeError(f"engine crashed launching batch {job.handle.serial}")
        return super()._launch(job)

    def _complete(self, job: PieceJob, token: Future[None]) -> None:
        super()._complete(job, token)
        raise RuntimeError(f"engine crashed completing batch {job.handle.serial}")


def test_worker_exception_becomes_a_failed_batch(fabric: LoopbackFabric) -> None:
    with _CrashingBackend(fabric=fabric) as sender, LoopbackBackend(fabric=fabric) as receiver:
        src, dst = HostBuffer(64), HostBuffer(64)
        with sender.register(src), receiver.register(dst):
            first = sender.wait([sender.submit_write(receiver.session_id, _one_block(src, dst, 8))], 5)
            assert first.failed and "crashed launching batch 1" in first.failed[0].reason
            # The lane survived: the next batch is launched, and its completion crash is reported too.
            second = sender.wait([sender.submit_write(receiver.session_id, _one_block(src, dst, 8))], 5)
            assert second.failed and "crashed completing batch 2" in second.failed[0].reason
            assert sender.statistics().batches_in_flight == 0


def test_unknown_and_closed_peers(fabric: LoopbackFabric) -> None:
    with LoopbackBackend(fabric=fabric) as sender:
        receiver = LoopbackBackend(fabric=fabric)
        src, dst = HostBuffer(64), HostBuffer(64)
        receiver.register(dst)
        receiver.close()
        with sender.register(src):
            outcome = sender.wait(
                [sender.submit_write(receiver.session_id, _one_block(src, dst, 8))]
            ).outcomes[0]
        assert outcome.status is BatchStatus.FAILED and "no loopback backend" in outcome.reason


def test_default_fabric_is_shared() -> None:
    with LoopbackBackend() as first, LoopbackBackend() as second:
        assert LoopbackFabric.default().lookup(second.session_id) is second
        assert first.session_id != second.session_id


def test_an_idle_peer_lane_retires_and_a_later_batch_starts_a_new_one(fabric: LoopbackFabric) -> None:
    # A decode rank that restarted never sees its old session used again: the lanes of gone peers
    # must not pile up threads for the life of the process.
    with LoopbackBackend(fabric=fabric) as sender, LoopbackBackend(fabric=fabric) as receiver:
        sender.lane_idle_s = 0.1
        src, dst = HostBuffer(64), HostBuffer(64)
        src.array[:] = 7
        with sender.register(src), receiver.register(dst):

            def lane_threads() -> list[str]:
                prefix = f"{sender.thread_name}-{receiver.session_id}"
                return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]

            sender.write(receiver.session_id, _one_block(src, dst, 64))
            assert sender.lanes() == 1 and len(lane_threads()) == 2  # a launcher and a completer
            deadline = time.monotonic() + 10
            while (sender.lanes() or lane_threads()) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert sender.lanes() == 0 and lane_threads() == []  # retired: both threads ended
            dst.array[:] = 0
            sender.write(receiver.session_id, _one_block(src, dst, 64))  # a new lane serves it
            assert (dst.array == 7).all() and sender.lanes() == 1
