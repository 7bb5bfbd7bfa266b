"""Inline launches and completions of the shared backend machinery: an idle lane launches on the
submitting thread, and a waiter completes its own one-piece batch when the completer is idle.

A minimal ``WorkerThreadBackend`` whose engine hooks record which thread launched and completed
which piece and whose completions wait for the test: order, the first-contact rule, the timeout
rule, failures and ``close``; and how often the completer wakes up (``completer_wakes``). Every test
runs with both kinds of completer alarm (``pdkv.engine._alarm``): the rules hold with either.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from pdkv.engine import BatchStatus, _alarm, _threaded
from pdkv.engine._threaded import PieceFailed, PieceJob, WorkerThreadBackend
from pdkv.engine.backend import MemoryRegion
from pdkv.errors.engine import BatchFailedError
from pdkv.mapping import TransferBlocks

BASE = 1 << 20


@pytest.fixture(autouse=True, params=["timerfd", "condition"])
def alarm_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The lanes made in the test sleep on this kind of alarm."""
    if request.param == "timerfd":
        if _alarm._timerfd is None:
            pytest.skip("no timerfd on this platform")
    else:
        monkeypatch.setattr(_threaded, "new_alarm", _alarm.ConditionAlarm)
    yield request.param


class GatedBackend(WorkerThreadBackend[int]):
    """Launches are recorded (serial, thread); each completion waits until the test releases it."""

    def __init__(
        self,
        *,
        budget: int = 64,
        refuse: frozenset[int] = frozenset(),
        bound_s: float | None = None,
        inline_max_entries: int | None = None,
    ) -> None:
        super().__init__(max_entries_in_flight=budget, thread_name="gated")
        self.bound_s = bound_s
        self.inline_max_entries = inline_max_entries
        self.launches: list[tuple[int, str]] = []
        self.completions: list[tuple[int, str]] = []
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
        self.completions.append((job.handle.serial, threading.current_thread().name))

    def _completion_bound_s(self, total_bytes: int) -> float | None:
        return self.bound_s

    def _inline_launch_allowed(self, piece: TransferBlocks) -> bool:
        return self.inline_max_entries is None or len(piece) <= self.inline_max_entries

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


# ---------------------------------------------------------------- completions on the waiting thread


def _warm(backend: GatedBackend) -> None:
    backend.register_range(BASE, 4096)
    first = backend.submit_write("peer", _batch())
    backend.release.release()
    assert backend.wait([first], 10).ok


def test_a_waiter_whose_timeout_covers_the_engine_bound_completes_its_batch_itself() -> None:
    backend = GatedBackend(bound_s=5.0)
    _warm(backend)
    backend.inline_hold_s = 5.0  # however slow this thread is to come and wait
    handle = backend.submit_write("peer", _batch())
    backend.release.release()
    assert backend.wait([handle], 10).ok
    assert backend.completions[-1] == (handle.serial, threading.current_thread().name)
    assert backend.statistics().batches_in_flight == 0
    backend.close()


def test_a_waiter_with_a_shorter_timeout_or_no_known_bound_leaves_it_to_the_completer() -> None:
    for bound in (None, 30.0):  # unknown bound; a bound past the 10 s the waiter gives
        backend = GatedBackend(bound_s=bound)
        _warm(backend)
        handle = backend.submit_write("peer", _batch())
        backend.release.release()
        assert backend.wait([handle], 10).ok
        serial, thread = backend.completions[-1]
        assert serial == handle.serial and thread.endswith("-complete")
        backend.close()


def test_without_a_timeout_the_waiter_completes_it_even_with_no_known_bound() -> None:
    backend = GatedBackend(bound_s=None)
    _warm(backend)
    backend.inline_hold_s = 5.0
    handle = backend.submit_write("peer", _batch())
    backend.release.release()
    assert backend.wait([handle], None).ok
    assert backend.completions[-1] == (handle.serial, threading.current_thread().name)
    backend.close()


def test_a_busy_completer_keeps_the_launch_order_of_completions() -> None:
    backend = GatedBackend(bound_s=1.0)
    _warm(backend)
    earlier = backend.submit_write("peer", _batch())  # launched inline; the completer takes it
    deadline = time.monotonic() + 5
    while backend._lanes["peer"]._launched and time.monotonic() < deadline:
        time.sleep(0.001)
    later = backend.submit_write("peer", _batch())
    waited: list[bool] = []
    waiter = threading.Thread(target=lambda: waited.append(backend.wait([later], 10).ok))
    waiter.start()
    time.sleep(0.05)
    assert waiter.is_alive()  # the completer is still in the earlier batch's completion
    backend.release.release()
    backend.release.release()
    waiter.join(10)
    assert waited == [True] and backend.wait([earlier], 10).ok
    assert [serial for serial, _ in backend.completions[1:]] == [earlier.serial, later.serial]
    assert all(thread.endswith("-complete") for _, thread in backend.completions[1:])
    backend.close()


def test_close_waits_for_a_completion_a_waiter_claimed() -> None:
    backend = GatedBackend(bound_s=1.0)
    _warm(backend)
    backend.inline_hold_s = 5.0  # the completer leaves it to the waiter, however slow it is to start
    handle = backend.submit_write("peer", _batch())
    waiter = threading.Thread(target=lambda: backend.wait([handle], 10))
    waiter.start()
    deadline = time.monotonic() + 5
    while not backend._lanes["peer"]._completing and time.monotonic() < deadline:
        time.sleep(0.001)
    closer = threading.Thread(target=backend.close)
    closer.start()
    time.sleep(0.05)
    assert closer.is_alive()  # the claimed completion is under way: no memory may be unregistered
    backend.release.release()
    waiter.join(10)
    closer.join(10)
    assert not closer.is_alive()
    assert backend.completions[-1] == (handle.serial, waiter.name)
    assert backend.statistics().batches_completed == 2


def test_a_submitter_that_does_not_come_to_wait_leaves_its_batch_to_the_completer() -> None:
    backend = GatedBackend(bound_s=1.0)
    _warm(backend)
    backend.inline_hold_s = 0.05
    handle = backend.submit_write("peer", _batch())
    assert backend.launches[-1] == (handle.serial, threading.current_thread().name)  # inline
    backend.release.release()
    deadline = time.monotonic() + 5
    while not handle.verdict_future.done() and time.monotonic() < deadline:
        time.sleep(0.005)  # never calls wait: the completer takes it once the hold ran out
    assert handle.verdict_future.done()
    serial, thread = backend.completions[-1]
    assert serial == handle.serial and thread.endswith("-complete")
    assert backend.wait([handle], 0).ok
    backend.close()


# ------------------------------------------------------------------- the completer's wake-ups


def _warm_through_the_completer(backend: GatedBackend) -> None:
    """First contact, completed by the completer (no wait): afterwards it sleeps with nothing to do."""
    backend.register_range(BASE, 4096)
    first = backend.submit_write("peer", _batch())
    backend.release.release()
    deadline = time.monotonic() + 5
    while not first.verdict_future.done() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert backend.wait([first], 0).ok
    assert backend.completions[-1][1].endswith("-complete")


@pytest.mark.parametrize("alarm_kind", ["timerfd"], indirect=True)
def test_the_completer_sleeps_through_batches_their_submitters_complete() -> None:
    backend = GatedBackend(bound_s=5.0)
    _warm_through_the_completer(backend)
    backend.inline_hold_s = 5.0  # every submitter comes to wait well within its hold
    lane = backend._lanes["peer"]
    before = lane.completer_wakes
    main = threading.current_thread().name
    for _ in range(20):
        handle = backend.submit_write("peer", _batch())
        backend.release.release()
        assert backend.wait([handle], 10).ok
        # This thread's other work, which lets go of the interpreter lock as engine calls do: a
        # completer woken for the piece would run now (a notified thread waits for that lock).
        time.sleep(0.002)
    assert [thread for _, thread in backend.completions[1:]] == [main] * 20
    # Neither the launch nor the claim nor a hold's end woke it: 20 pieces, no wake-up.
    assert lane.completer_wakes == before
    backend.close()


@pytest.mark.parametrize("alarm_kind", ["timerfd"], indirect=True)
def test_a_hold_that_runs_out_wakes_the_completer_once_to_take_the_piece() -> None:
    backend = GatedBackend(bound_s=5.0)
    _warm_through_the_completer(backend)
    backend.inline_hold_s = 0.05
    lane = backend._lanes["peer"]
    before = lane.completer_wakes
    handle = backend.submit_write("peer", _batch())
    backend.release.release()
    deadline = time.monotonic() + 5
    while not handle.verdict_future.done() and time.monotonic() < deadline:
        time.sleep(0.005)  # never calls wait
    assert backend.completions[-1][1].endswith("-complete")
    assert lane.completer_wakes == before + 1  # at the hold's end, not at the launch as well
    backend.close()


def test_a_piece_behind_a_claimed_one_is_completed_when_the_claimed_one_ends() -> None:
    backend = GatedBackend(bound_s=5.0, inline_max_entries=1)
    _warm(backend)
    backend.inline_hold_s = 30.0  # the completer would otherwise take the held piece only at its end
    held = backend.submit_write("peer", _batch())  # inline, left to this thread
    behind = backend.submit_write("peer", _batch(2))  # too big to launch inline: the launcher's
    deadline = time.monotonic() + 5
    while len(backend._lanes["peer"]._launched) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    backend.release.release()
    backend.release.release()
    assert backend.wait([held], 10).ok
    # The completer, woken for the later piece while the held one was next, went back to sleep until
    # the hold's end; the claim turned that alarm off, so the end of the claimed completion must ring
    # it (a lost wake-up would leave the later piece for the 30 s hold).
    assert backend.wait([behind], 5).ok
    assert backend.completions[-2] == (held.serial, threading.current_thread().name)
    assert backend.completions[-1][0] == behind.serial
    backend.close()


# ------------------------------------------------------------------ write_outcome on the caller's thread


def test_write_outcome_launches_and_completes_on_the_callers_thread_without_waking_the_completer() -> None:
    backend = GatedBackend(bound_s=5.0)
    _warm_through_the_completer(backend)
    lane = backend._lanes["peer"]
    wakes = lane.completer_wakes
    main = threading.current_thread().name
    backend.release.release()
    outcome = backend.write_outcome("peer", _batch(3), timeout=10)
    assert outcome.ok and outcome.handle.entries == 3 and outcome.seconds >= 0
    assert backend.launches[-1] == (outcome.handle.serial, main)
    assert backend.completions[-1] == (outcome.handle.serial, main)
    assert lane.completer_wakes == wakes  # neither woken nor left a hold to time out
    time.sleep(0.05)
    assert lane.completer_wakes == wakes
    statistics = backend.statistics()
    assert (statistics.batches_submitted, statistics.batches_completed) == (2, 2)
    assert (statistics.batches_in_flight, statistics.batches_unwaited) == (0, 0)
    backend.close()


@pytest.mark.parametrize("case", ["first contact", "bound over the timeout", "no bound", "too big"])
def test_write_outcome_leaves_to_the_lane_what_the_caller_may_not_write_itself(case: str) -> None:
    """The first contact goes through the launcher (the handshake), as does a piece the engine lets
    no caller launch; a completion that could outlast the timeout is the completer's."""
    backend = GatedBackend(bound_s=None if case == "no bound" else 5.0, inline_max_entries=2)
    if case == "first contact":
        backend.register_range(BASE, 4096)
    else:
        _warm_through_the_completer(backend)
    timeout = 1.0 if case == "bound over the timeout" else 10.0
    backend.release.release()
    outcome = backend.write_outcome("peer", _batch(3 if case == "too big" else 1), timeout=timeout)
    assert outcome.ok
    launched_by = dict(backend.launches)[outcome.handle.serial]
    completed_by = dict(backend.completions)[outcome.handle.serial]
    if case in ("first contact", "too big"):
        assert launched_by.endswith("-launch")
    else:
        assert completed_by.endswith("-complete")
    backend.close()


def test_write_outcome_behind_a_batch_in_flight_waits_its_turn() -> None:
    """The lane is busy (a batch launched, not completed): the write queues behind it, and the two
    complete in launch order."""
    backend = GatedBackend(bound_s=5.0)
    _warm(backend)
    backend.inline_hold_s = 30.0
    earlier = backend.submit_write("peer", _batch())  # launched inline, held for this thread
    results: list[object] = []
    writer = threading.Thread(
        target=lambda: results.append(backend.write_outcome("peer", _batch(2), timeout=10))
    )
    writer.start()
    time.sleep(0.05)
    assert writer.is_alive()  # behind the earlier batch, not beside it
    backend.release.release()
    backend.release.release()
    assert backend.wait([earlier], 10).ok
    writer.join(10)
    (outcome,) = results
    assert getattr(outcome, "ok", False)
    assert [serial for serial, _ in backend.completions[-2:]] == [earlier.serial, earlier.serial + 1]
    backend.close()


@pytest.mark.parametrize("where", ["launch", "completion"])
def test_a_write_on_the_callers_thread_that_fails_is_its_outcome_and_frees_the_lane(where: str) -> None:
    backend = GatedBackend(bound_s=5.0, refuse=frozenset({2}) if where == "launch" else frozenset())
    _warm(backend)
    if where == "completion":

        def broken(job: PieceJob, token: int) -> None:
            raise RuntimeError("engine bug")

        backend._complete = broken  # type: ignore[method-assign]
    outcome = backend.write_outcome("peer", _batch(), timeout=10)
    assert outcome.handle.serial == 2 and outcome.status is BatchStatus.FAILED
    assert ("refused" if where == "launch" else "engine bug") in outcome.reason
    if where == "completion":
        del backend._complete  # the class's again
    backend.release.release()
    assert backend.write_outcome("peer", _batch(), timeout=10).ok  # the lane was given back
    statistics = backend.statistics()
    assert (statistics.batches_failed, statistics.batches_completed, statistics.batches_in_flight) == (
        1,
        2,
        0,
    )
    backend.refuse = frozenset({4})
    with pytest.raises(BatchFailedError, match="refused"):
        backend.write("peer", _batch(), timeout=10)  # write() raises for what write_outcome returns
    backend.close()


def test_close_waits_for_a_write_on_the_callers_thread() -> None:
    backend = GatedBackend(bound_s=5.0)
    _warm(backend)
    results: list[object] = []
    writer = threading.Thread(
        target=lambda: results.append(backend.write_outcome("peer", _batch(), timeout=10))
    )
    writer.start()
    deadline = time.monotonic() + 5
    while len(backend.launches) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert backend.launches[-1][1] == writer.name  # launched on its thread, now in its completion
    closer = threading.Thread(target=backend.close)
    closer.start()
    time.sleep(0.05)
    assert closer.is_alive()  # memory stays registered while the write can still touch it
    backend.release.release()
    closer.join(10)
    writer.join(10)
    assert not closer.is_alive() and getattr(results[0], "ok", False)


@pytest.mark.parametrize("timeout", [-1.0, float("nan")], ids=["negative", "nan"])
def test_write_outcome_takes_a_timeout_as_wait_does(timeout: float) -> None:
    """A negative or NaN timeout is no time at all, as for ``wait``: the write is not made on the
    caller's thread (it would wait for the engine), the outcome is TIMED_OUT at once and the batch is
    still there to wait for."""
    backend = GatedBackend(bound_s=5.0)
    _warm(backend)
    outcome = backend.write_outcome("peer", _batch(), timeout=timeout)
    assert outcome.status is BatchStatus.TIMED_OUT  # at once: made here, it would wait for the release
    backend.release.release()
    assert backend.wait([outcome.handle], 10).ok
    backend.close()
