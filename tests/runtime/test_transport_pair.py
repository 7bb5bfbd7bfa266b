"""``pdkv.testing.TransportPair``: the production transports wired in memory, what an embedder tests
its scheduler against: rooms end to end byte for byte, an abort, and not one socket opened."""

from __future__ import annotations

import numpy as np

from pdkv import Failure, FailureCause, KVTransferMetric, RankCoord
from pdkv.engine import sockets
from pdkv.protocol.ids import RoomId
from pdkv.protocol.messages import StateIndices
from pdkv.protocol.poll import KVPoll
from pdkv.testing.synthetic import ModelSpec, verify_room
from pdkv.testing.transport_pair import TransportPair
from tests.runtime.rig import wait_for

MODEL = ModelSpec(layers=3, page_size=16, state_layers=(1,), draft_layers=1)


def test_a_cp2_room_lands_byte_for_byte_without_opening_a_socket() -> None:
    before = sockets.listening_ports()
    with TransportPair(model=MODEL, cp=2) as pair:
        # No control socket, no engine port: nothing new listens (an earlier test's socket may close).
        assert sockets.listening_ports() <= before
        room = RoomId(7)
        logical = np.array([5, 0, 7, 2, 9], dtype=np.int64)
        dst = np.array([40, 41, 42, 100, 7], dtype=np.int64)
        receiver = pair.decode.receiver(room, pair.prefill_instance)
        receiver.init(dst, 5, [StateIndices(kind=k, indices=np.array([3])) for k in MODEL.state_kinds])
        senders = [p.sender(room) for p in pair.prefills]
        for sender in senders:
            sender.init(len(logical), 2)
        wait_for(lambda: all(s.poll() is KVPoll.WaitingForInput for s in senders))
        state = [StateIndices(kind=k, indices=np.array([6])) for k in MODEL.state_kinds]
        for sender in senders:
            sender.send(logical, start_token=0, last=True, state_indices=state)
        wait_for(lambda: receiver.poll() is KVPoll.Success)
        checked, mismatches = verify_room(
            pair.decode_memory[0],
            logical_ids=logical,
            dst_pages=dst,
            prefix_pages=0,
            state_src={k: np.array([6]) for k in MODEL.state_kinds},
            state_dst={k: np.array([3]) for k in MODEL.state_kinds},
            aux_src=2,
            aux_dst=5,
        )
        assert mismatches == [] and checked > 0
        # Every message crossed the wire codec: both sides counted what they received.
        assert pair.decode.statistics().channel.received >= 2
        assert all(p.statistics().channel.received >= 2 for p in pair.prefills)


def test_a_decode_abort_is_acknowledged_and_releases_the_pages() -> None:
    with TransportPair(model=MODEL) as pair:
        room = RoomId(9)
        receiver = pair.decode.receiver(room, pair.prefill_instance)
        receiver.init(np.array([1, 2]), None)
        sender = pair.prefills[0].sender(room)
        sender.init(2, None)
        wait_for(lambda: sender.poll() is KVPoll.WaitingForInput)
        receiver.abort("client went away")
        wait_for(lambda: sender.poll() is KVPoll.Failed)
        wait_for(receiver.release_ready)
        assert receiver.release_was_safe()
        assert pair.prefills[0].statistics().endpoint.aborts_received == 1


def test_failures_are_typed_with_cause_reason_and_peer_and_metrics_are_public() -> None:
    with TransportPair(model=MODEL) as pair:
        room = RoomId(11)
        receiver = pair.decode.receiver(room, pair.prefill_instance)
        receiver.init(np.array([1, 2]), None)
        sender = pair.prefills[0].sender(room)
        sender.init(2, None)
        wait_for(lambda: sender.poll() is KVPoll.WaitingForInput)
        assert sender.failure() is None and receiver.failure() is None
        receiver.abort("client went away")
        wait_for(lambda: sender.poll() is KVPoll.Failed)
        here, there = receiver.failure(), sender.failure()
        assert isinstance(here, Failure) and isinstance(there, Failure)
        assert (here.cause, here.peer) == (FailureCause.ABORTED_HERE, None)
        assert "client went away" in str(here)
        # The prefill side names the decode rank whose Abort failed the room.
        assert there.cause is FailureCause.ABORTED_BY_PEER
        assert there.peer == f"{pair.decode_instance}:{RankCoord(tp=0)}"
        assert "client went away" in there.reason
        for metric in (sender.metric(), receiver.metric()):
            assert isinstance(metric, KVTransferMetric) and metric.room == room
            assert (metric.pages, metric.bytes) == (0, 0) and metric.seconds >= 0


def test_close_keeps_memory_registered_while_a_write_may_still_land_and_frees_it_otherwise() -> None:
    pair = TransportPair(model=MODEL)
    try:
        pair.start()
        registered = pair.decode_backends[0].statistics().registrations
        assert registered > 0
        room = RoomId(13)
        receiver = pair.decode.receiver(room, pair.prefill_instance)
        receiver.init(np.array([1, 2]), None)
        sender = pair.prefills[0].sender(room)
        sender.init(2, None)
        wait_for(lambda: sender.poll() is KVPoll.WaitingForInput)  # the prefill was told the pages
        # The prefill rank vanishes without a word (its loop stops; its memory goes with the process).
        pair.prefills[0]._loop.stop()
        pair.decode.close(timeout_s=0.2)  # the room's AbortAck can never come
        assert pair.decode.stuck_writes
        assert pair.decode_backends[0].statistics().registrations == registered
    finally:
        pair.close()
    # A clean close frees everything.
    with TransportPair(model=MODEL) as clean:
        backend = clean.decode_backends[0]
    assert not clean.decode.stuck_writes and backend.statistics().registrations == 0
