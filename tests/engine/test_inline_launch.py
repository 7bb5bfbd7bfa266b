"""Inline launches of the shared backend machinery: an idle lane launches on the submitting thread.

A minimal ``WorkerThreadBackend`` whose engine hooks record which thread launched which piece and
whose completions wait for the test: launch order, the first-contact rule, failures and ``close``.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from pdkv.engine import BatchStatus
from pdkv.engine._threaded import PieceFailed, PieceJob, WorkerThreadBackend
from pdkv.engine.backend import MemoryRegion
from pdkv.mapping import TransferBlocks

BASE = 1 << 20


class GatedBackend(WorkerThreadBackend[int]):
    """Launches are recorded (serial, thread); each completion waits until the test releases it."""

    def __init__(self, *, budget: int = 64, refuse: frozenset[int] = frozenset()) -> None:
        super().__init__(max_entries_in_flight=budget, thread_name="gated")
        self.launches: list[tuple[int, str]] = []
        self.release = threading.Semaphore(0)
        self.refuse = refuse
        self.launch_gate = threading.Event()
        self.launch_gate.set()

    @property
    def session_id(self) -> str:
        return "gated"

    def _engine_register(self, region: MemoryRegion) -> None:
        pass

    def _engine_unregister(self, region: MemoryRegion) -> None:
        pass

    def _launch(self, job: PieceJob) -> int:
        self.launch_gate.wait(10)
        self.launches.append((job.handle.serial, threading.current_thread().name))
        if job.handle.serial in self.refuse:
            raise PieceFailed("refused")
        return job.handle.serial

    def _complete(self, job: PieceJob, token: int) -> None:
        assert self.release.acquire(timeout=10)

    def _engine_close(self) -> None:
        pass


def _batch(entries: int = 1) -> TransferBlocks:
    offsets = np.arange(entries, dtype=np.int64) * 8
    return TransferBlocks(
        src=BASE + offsets, dst=offsets, length=np.full(entries, 8), buffer=np.zeros(entries)
    )


def test_first_contact_goes_through_the_launcher_then_idle_lanes_launch_inline() -> None:
    backend = GatedBackend()
    backend.register_range(BASE, 4096)
    main = threading.current_thread().name
    first = backend.submit_write("peer", _batch())
    backend.release.release()
    assert backend.wait([first], 10).ok
    second = backend.submit_write("peer", _batch())
    backend.release.release()
    assert backend.wait([second], 10).ok
    assert backend.launches[0][1].endswith("-launch")  # the handshake is never on the caller's thread
    assert backend.launches[1] == (second.serial, main)
    backend.close()


def test_busy_lane_queues_and_launches_in_submission_order() -> None:
    backend = GatedBackend()
    backend.register_range(BASE, 4096)
    warm = backend.submit_write("peer", _batch())
    backend.release.release()
    assert backend.wait([warm], 10).ok
    # The first batch launches inline and then occupies the completer; the rest queue behind it.
    handles = [backend.submit_write("peer", _batch(2)) for _ in range(5)]
    for _ in handles:
        backend.release.release()
    result = backend.wait(handles, 10)
    assert result.ok
    assert [serial for serial, _ in backend.launches[1:]] == [h.serial for h in handles]
    backend.close()


def test_concurrent_submitters_never_launch_two_pieces_at_once() -> None:
    backend = GatedBackend(budget=8)
    backend.register_range(BASE, 4096)
    warm = backend.submit_write("peer", _batch())
    backend.release.release()
    assert backend.wait([warm], 10).ok
    active = [0]
    most = [0]
    lock = threading.Lock()
    original = backend._launch

    def counting(job: PieceJob) -> int:
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        time.sleep(0.001)
        with lock:
            active[0] -= 1
        return original(job)

    backend._launch = counting  # type: ignore[method-assign]
    handles: list[object] = []

    def submit() -> None:
        for _ in range(10):
            handles.append(backend.submit_write("peer", _batch(3)))

    threads = [threading.Thread(target=submit) for _ in range(4)]
    for t in threads:
        t.start()
    for _ in range(40):
        backend.release.release()
    for t in threads:
        t.join(10)
    assert len(handles) == 40
    result = backend.wait(handles, 10)  # type: ignore[arg-type]
    assert result.ok and most[0] == 1
    backend.close()


def test_a_refused_inline_launch_fails_only_its_batch() -> None:
    backend = GatedBackend(refuse=frozenset({2}))
    backend.register_range(BASE, 4096)
    warm = backend.submit_write("peer", _batch())
    backend.release.release()
    assert backend.wait([warm], 10).ok
    refused = backend.submit_write("peer", _batch())
    assert refused.serial == 2
    outcome = backend.wait([refused], 10).outcomes[0]
    assert outcome.status is BatchStatus.FAILED and "refused" in outcome.reason
    later = backend.submit_write("peer", _batch())
    backend.release.release()
    assert backend.wait([later], 10).ok
    assert backend.statistics().batches_in_flight == 0
    backend.close()


def test_close_waits_for_an_inline_launch_under_way() -> None:
    backend = GatedBackend()
    backend.register_range(BASE, 4096)
    warm = backend.submit_write("peer", _batch())
    backend.release.release()
    assert backend.wait([warm], 10).ok
    backend.launch_gate.clear()  # the next launch (inline, on the submitter's thread) hangs
    submitted: list[object] = []
    submitter = threading.Thread(target=lambda: submitted.append(backend.submit_write("peer", _batch())))
    submitter.start()
    time.sleep(0.05)
    closer = threading.Thread(target=backend.close)
    closer.start()
    time.sleep(0.05)
    assert closer.is_alive()  # close waits: the launch is under way
    backend.release.release()  # its completion may go as soon as it is launched
    backend.launch_gate.set()
    submitter.join(10)
    closer.join(10)
    assert not closer.is_alive()
    stats = backend.statistics()
    assert stats.batches_in_flight == 0 and stats.batches_completed == 2
