"""A transfer worker's internal error fails the chunk's room at once, on both sides.

The worker's guard (``PrefillTransport._run_chunks_guarded``) turns any exception of a chunk's run
into that chunk's failure. One raised before the chunk started (``start_chunk``, the first step of
a run) left the room Transferring on both sides until the in-flight deadline, as the chunk machine
had no row for a failure before its start.
"""

from __future__ import annotations

import queue
from typing import Any

import numpy as np
import pytest

from pdkv.protocol.ids import RoomId
from pdkv.protocol.poll import KVPoll
from pdkv.protocol.prefill import PrefillEndpoint
from pdkv.testing.synthetic import ModelSpec
from pdkv.testing.transport_pair import TransportPair
from tests.runtime.rig import wait_for

MODEL = ModelSpec(layers=2, page_size=16, state_layers=(), state_kinds=(), draft_layers=0)


def test_an_error_before_the_chunk_started_fails_the_room_on_both_sides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = PrefillEndpoint.start_chunk
    raised: list[int] = []

    def start_chunk(self: PrefillEndpoint, room: RoomId, chunk: int, now: float) -> Any:
        if not raised:
            raised.append(chunk)
            raise RuntimeError("worker bug before the start")
        return original(self, room, chunk, now)

    monkeypatch.setattr(PrefillEndpoint, "start_chunk", start_chunk)
    with TransportPair(model=MODEL) as pair:
        prefill, room = pair.prefills[0], RoomId(3)
        receiver = pair.decode.receiver(room, pair.prefill_instance)
        receiver.init(np.array([7, 3]), 1)
        sender = prefill.sender(room)
        sender.init(2, 2)
        wait_for(lambda: sender.poll() is KVPoll.WaitingForInput)
        sender.send(np.array([4, 9]), start_token=0, last=True)
        wait_for(lambda: sender.poll() is KVPoll.Failed, timeout=10.0)
        assert "worker bug before the start" in str(sender.failure())
        wait_for(lambda: receiver.poll() is KVPoll.Failed, timeout=10.0)
        assert "worker bug before the start" in str(receiver.failure())
        assert raised == [0] and prefill.statistics().worker_errors == 1


def test_a_chunk_the_full_transfer_queue_refuses_fails_its_room_unstarted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``send()`` never blocks: a chunk the transfer queue has no room for fails at once (no worker
    ever had it, so it fails unstarted) and the decode is told."""
    with TransportPair(model=MODEL) as pair:
        prefill, room = pair.prefills[0], RoomId(4)
        receiver = pair.decode.receiver(room, pair.prefill_instance)
        receiver.init(np.array([5]), 1)
        sender = prefill.sender(room)
        sender.init(1, 2)
        wait_for(lambda: sender.poll() is KVPoll.WaitingForInput)

        def full(item: object) -> None:
            raise queue.Full

        monkeypatch.setattr(prefill._work, "put_nowait", full)  # the queue, as if full
        sender.send(np.array([6]), start_token=0, last=True)
        assert sender.poll() is KVPoll.Failed  # at once, in send()'s own step
        assert "transfer queue full" in str(sender.failure())
        wait_for(lambda: receiver.poll() is KVPoll.Failed, timeout=10.0)
        assert "transfer queue full" in str(receiver.failure())
