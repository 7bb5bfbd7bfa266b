"""A prefill scheduler waiting for progress runs a small queued chunk itself (``wait_runs_chunk_bytes``).

The transfer workers are kept from taking chunks here (their loop replaced by one that ends at
once), so that which thread runs a chunk is decided, not raced: what a waiting scheduler does not
run stays queued.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import pytest

from pdkv.errors import ConfigError, TransportClosedError
from pdkv.protocol.ids import InstanceId, RoomId
from pdkv.protocol.messages import RankCoord
from pdkv.protocol.poll import KVPoll
from pdkv.runtime import chunk_plan
from pdkv.runtime.prefill import KVSender, PrefillConfig, PrefillTransport
from pdkv.testing.synthetic import Capacity, ModelSpec, RankMemory, verify_room
from pdkv.testing.transport_pair import TransportPair
from tests.runtime.rig import wait_for

MODEL = ModelSpec(layers=2, page_size=16, state_layers=(), state_kinds=(), draft_layers=0)
LONG_S = 30.0


@pytest.fixture
def no_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Transfer workers that end at once: a queued chunk runs only where a waiting scheduler takes it."""
    monkeypatch.setattr(PrefillTransport, "_work_loop", lambda self: None)


@pytest.fixture
def planners(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The names of the threads that planned a chunk, in order."""
    names: list[str] = []
    original = chunk_plan.plan_chunk

    def plan_chunk(*args: Any, **kwargs: Any) -> Any:
        names.append(threading.current_thread().name)
        return original(*args, **kwargs)

    monkeypatch.setattr("pdkv.runtime.prefill.plan_chunk", plan_chunk)
    yield names


def _open(pair: TransportPair, room: RoomId, dst: list[int], *, limit: int | None = None) -> KVSender:
    """Both sides of ``room`` up to WaitingForInput; ``limit``: the prefill's wait_runs_chunk_bytes."""
    prefill = pair.prefills[0]
    if limit is not None:
        prefill.config = attrs.evolve(prefill.config, wait_runs_chunk_bytes=limit)
    pair.decode.receiver(room, pair.prefill_instance).init(np.array(dst), 1)
    sender = prefill.sender(room)
    sender.init(len(dst), 2)
    wait_for(lambda: sender.poll() is KVPoll.WaitingForInput)
    return sender


def test_a_waiting_scheduler_runs_the_small_chunk_it_queued_and_the_room_lands(
    no_workers: None, planners: list[str]
) -> None:
    with TransportPair(model=MODEL) as pair:
        prefill, room = pair.prefills[0], RoomId(5)
        sender = _open(pair, room, [7, 3])
        sender.send(np.array([4, 9]), start_token=0, last=True)
        seen = prefill.progress()
        assert prefill.wait_progress(seen, LONG_S) > seen
        # The wait came back with the room done: it ran the chunk, on this thread, status sent.
        assert sender.poll() is KVPoll.Success
        assert planners == [threading.current_thread().name]
        assert prefill.statistics().chunks_run_waiting == 1
        receiver = pair.decode.receiver(room, pair.prefill_instance)
        wait_for(lambda: receiver.poll() is KVPoll.Success)
        checked, mismatches = verify_room(
            pair.decode_memory[0],
            logical_ids=np.array([4, 9]),
            dst_pages=np.array([7, 3]),
            prefix_pages=0,
            state_src={},
            state_dst={},
            aux_src=2,
            aux_dst=1,
        )
        assert mismatches == [] and checked > 0


@pytest.mark.parametrize(("limit", "runs"), [("zero", False), ("one byte short", False), ("exact", True)])
def test_a_chunk_runs_on_the_waiting_scheduler_only_within_the_limit(
    no_workers: None, planners: list[str], limit: str, runs: bool
) -> None:
    with TransportPair(model=MODEL) as pair:
        prefill = pair.prefills[0]
        chunk_bytes = 2 * sum(b.item_bytes for b in pair.prefill_memory[0].layout.kv_buffers)  # 2 pages
        bytes_allowed = {"zero": 0, "one byte short": chunk_bytes - 1, "exact": chunk_bytes}[limit]
        sender = _open(pair, RoomId(2), [12, 22], limit=bytes_allowed)
        sender.send(np.array([2, 10]), start_token=0, last=True)
        seen = prefill.progress()
        after = prefill.wait_progress(seen, LONG_S if runs else 0.05)
        statistics = prefill.statistics()
        if runs:
            assert after > seen and sender.poll() is KVPoll.Success and len(planners) == 1
            assert (statistics.chunks_run_waiting, statistics.queue_depth) == (1, 0)
        else:  # a plain wait: the chunk stays queued for the workers
            assert after == seen and sender.poll() is KVPoll.Transferring and planners == []
            assert (statistics.chunks_run_waiting, statistics.queue_depth) == (0, 1)


def test_close_waits_for_the_chunk_a_waiting_scheduler_is_running(
    no_workers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planned slowly, the chunk has nothing in the engine yet when close() starts (no batch for the
    engine's own drain to wait for): close() must wait for the thread that runs it, as for a worker."""
    planning = threading.Event()
    ran: list[float] = []
    plan, run = chunk_plan.plan_chunk, PrefillTransport._run_chunks_guarded

    def slow_plan(*args: Any, **kwargs: Any) -> Any:
        planning.set()
        time.sleep(0.3)
        return plan(*args, **kwargs)

    def timed_run(self: PrefillTransport, chunks: Any) -> None:
        try:
            run(self, chunks)
        finally:
            ran.append(time.monotonic())

    monkeypatch.setattr("pdkv.runtime.prefill.plan_chunk", slow_plan)
    monkeypatch.setattr(PrefillTransport, "_run_chunks_guarded", timed_run)
    with TransportPair(model=MODEL) as pair:
        prefill = pair.prefills[0]
        sender = _open(pair, RoomId(4), [5, 6])

        def scheduler() -> None:
            seen = prefill.progress()
            sender.send(np.array([1, 2]), start_token=0, last=True)
            with contextlib.suppress(TransportClosedError):  # closed while it ran: told on return
                prefill.wait_progress(seen, LONG_S)

        thread = threading.Thread(target=scheduler)
        thread.start()
        assert planning.wait(LONG_S)  # the scheduler's thread is planning the chunk (0.3 s)
        prefill.close(timeout_s=LONG_S)
        closed_at = time.monotonic()
        thread.join(LONG_S)
        assert len(ran) == 1 and ran[0] <= closed_at


def test_the_waiting_scheduler_takes_the_transport_lock_only_without_the_queue_lock(
    no_workers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread that queues a chunk holds the transport lock while it takes the work queue's: a
    waiting scheduler that asked ``per_layer.holds`` (the transport lock) inside the queue's lock
    would deadlock with it."""
    with TransportPair(model=MODEL) as pair:
        prefill = pair.prefills[0]
        queue_lock = prefill._work.mutex
        asked_inside: list[bool] = []
        holds = prefill.per_layer.holds

        def watched_holds(room: RoomId) -> bool:
            free = queue_lock.acquire(blocking=False)
            if free:
                queue_lock.release()
            asked_inside.append(not free)
            return holds(room)

        monkeypatch.setattr(prefill.per_layer, "holds", watched_holds)
        sender = _open(pair, RoomId(6), [8, 9])
        sender.send(np.array([6, 7]), start_token=0, last=True)
        seen = prefill.progress()
        assert prefill.wait_progress(seen, LONG_S) > seen and sender.poll() is KVPoll.Success
        assert asked_inside == [False]


def test_a_per_layer_chunk_is_left_to_the_workers_the_wait_would_hold_its_own_forward(
    no_workers: None, planners: list[str]
) -> None:
    """A per-layer room's chunk may wait for layers that only this scheduler's forward ends: run on the
    waiting thread it would hold that forward up to the per-layer deadline (60 s)."""
    with TransportPair(model=MODEL) as pair:
        prefill = pair.prefills[0]
        sender = _open(pair, RoomId(7), [40, 41])
        pages = np.array([12, 13])
        prefill.per_layer.register(RoomId(7), pages, start_token=0)
        sender.send(pages, start_token=0, last=True)  # before any layer of the forward ended
        seen = prefill.progress()
        started = time.monotonic()
        assert prefill.wait_progress(seen, 0.05) == seen
        assert time.monotonic() - started < LONG_S / 3
        assert planners == [] and prefill.statistics().queue_depth == 1


@pytest.mark.parametrize("value", [-1, True, 1.5])
def test_a_limit_that_is_not_a_whole_number_of_bytes_is_refused_naming_it(value: object) -> None:
    layout = RankMemory(MODEL, Capacity(kv_pages=4, state_slots=1, aux_rows=1)).layout
    with pytest.raises(ConfigError, match="wait_runs_chunk_bytes"):
        PrefillConfig(
            instance=InstanceId("p"),
            rank=RankCoord(tp=0),
            tp_size=1,
            layout=layout,
            registry="tcp://127.0.0.1:1",
            wait_runs_chunk_bytes=value,  # type: ignore[arg-type]  # the wrong type is the point
        )
