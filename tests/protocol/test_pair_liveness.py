"""Liveness scenarios through ``EndpointPair``: partitions, restarts behind the same address, late requests.

Each test scripts one story on a loss-free link with a fake clock and checks both sides, the
pages and the abort-safety record of the harness.
"""

from __future__ import annotations

from pdkv.protocol.config import Timeouts
from pdkv.protocol.effects import FailureCause, ReleaseKind
from pdkv.protocol.ids import Endpoint, Epoch, RoomId
from pdkv.protocol.messages import Abort, Message, TransferRequest
from pdkv.protocol.poll import KVPoll
from pdkv.testing.endpoint_pair import EndpointPair, LinkFaults, RoomPlan

TIMEOUTS = Timeouts(
    bootstrap=20,
    waiting=20,
    inflight=20,
    transfer=20,
    abort_ack=10,
    register_retry=0.5,
    heartbeat_interval=1,
    heartbeat_timeout=3,
    quarantine_settle=2,
)


def pair(cp: int = 1) -> EndpointPair:
    # The decode cuts connections, as a decode transport does: a restarted rank's rooms come back
    # once its host's connections are cut (the old process's bytes may sit in its sockets).
    p = EndpointPair(
        cp_size=cp,
        timeouts=TIMEOUTS,
        transfer_time=0.05,
        faults=LinkFaults(latency=0.001),
        cuts_connections=True,
    )
    p.connect()
    p.run(until=0.1)
    assert all(p.decode.peer_ready(t) for t in p.targets())
    return p


def plan(room: int, now: float) -> RoomPlan:
    return RoomPlan(room=RoomId(room), num_pages=4, chunk_pages=(2, 2))


def test_rooms_succeed_and_heartbeats_keep_idle_peers_registered() -> None:
    p = pair(cp=2)
    p.add_room(plan(1, p.clock.now))
    p.run(until=60.0)  # long idle time after the room: only heartbeats keep the peers alive
    assert p.decode.poll(RoomId(1)) is KVPoll.Success
    assert p.forgotten == [] and p.decode.statistics().peers_lost == 0
    assert all(x.statistics().peers_lost == 0 and x.statistics().peers_registered == 1 for x in p.prefills)
    assert p.link.statistics().posted > 4 * 60  # both ways, every second, per prefill rank


def test_partition_longer_than_the_heartbeat_timeout_fails_rooms_and_heals() -> None:
    p = pair(cp=2)
    p.add_room(RoomPlan(room=RoomId(1), num_pages=4, chunk_pages=(4,)))
    p.run(until=0.2)
    assert p.decode.poll(RoomId(1)) is KVPoll.Success
    p.transfer_time = 5.0  # room 2's writes are still going when the partition starts
    p.add_room(RoomPlan(room=RoomId(2), num_pages=4, chunk_pages=(4,)))
    p.run(until=0.5)
    p.partition(1, until=10.0)
    p.run(until=9.9)
    # Both sides noticed the silence of rank 1 (within timeout + one round); room 2 failed on
    # both (on decode maybe first through rank 0, which the CP consensus failed with rank 1).
    assert p.decode.poll(RoomId(2)) is KVPoll.Failed
    assert p.finished[("prefill1", RoomId(2))].cause is FailureCause.PEER_SILENT
    assert p.decode.statistics().peers_lost == 1 and p.prefills[1].statistics().peers_lost == 1
    assert p.prefills[0].statistics().peers_lost == 0
    assert [(who, f.endpoint) for who, f in p.forgotten] in (
        [("decode", p.prefill_endpoints[1]), ("prefill1", p.decode_endpoint)],
        [("prefill1", p.decode_endpoint), ("decode", p.prefill_endpoints[1])],
    )
    assert p.decode.poll(RoomId(1)) is KVPoll.Success  # a finished room is untouched
    # Rank 1 may still be writing (it is only unheard): the pages wait.
    assert not p.decode.release_ready(RoomId(2))
    p.run(until=14.0)
    # Healed at 10: registered again both ways; the resent Abort got its ack: released safely.
    assert all(p.decode.peer_ready(t) for t in p.targets())
    assert p.prefills[1].statistics().peers_registered == 1
    assert p.decode.release_ready(RoomId(2)) and p.decode.release_was_safe(RoomId(2))
    assert p.decode.statistics().unsafe_releases == 0 and p.violations == []
    # New rooms work again.
    p.transfer_time = 0.05
    p.add_room(RoomPlan(room=RoomId(3), num_pages=4, chunk_pages=(2, 2)))
    p.run(until=15.0)
    assert p.decode.poll(RoomId(3)) is KVPoll.Success


def test_restart_announced_by_the_route_table() -> None:
    p = pair(cp=2)
    p.transfer_time = 1.0
    p.add_room(RoomPlan(room=RoomId(1), num_pages=4, chunk_pages=(4,)))
    p.run(until=0.5)
    new = p.restart_prefill(0, announce=True)
    assert new.origin.epoch == Epoch(2)
    p.run(until=0.6)
    assert p.decode.poll(RoomId(1)) is KVPoll.Failed
    assert p.finished[("decode", RoomId(1))].cause is FailureCause.PEER_RESTART
    assert [(who, f.endpoint) for who, f in p.forgotten] == [("decode", p.prefill_endpoints[0])]
    # The new process acknowledged the abort at once; rank 1 acks when its write ends (at ~1.0).
    # Rank 0's old process may have left bytes in its sockets: the pages settle (2 s) after that.
    assert not p.decode.release_ready(RoomId(1))
    p.run(until=2.9)
    assert not p.decode.release_ready(RoomId(1))
    p.run(until=3.2)
    assert p.decode.release_ready(RoomId(1)) and p.decode.release_was_safe(RoomId(1))
    assert p.decode.release_kind(RoomId(1)) is ReleaseKind.SETTLED
    assert p.violations == []
    p.transfer_time = 0.05
    p.add_room(RoomPlan(room=RoomId(2), num_pages=4, chunk_pages=(4,)))
    p.run(until=3.5)
    assert p.decode.poll(RoomId(2)) is KVPoll.Success


def test_an_unannounced_restart_is_found_at_the_next_heartbeat_then_rooms_work_again() -> None:
    p = pair()
    p.transfer_time = 1.0
    p.add_room(RoomPlan(room=RoomId(1), num_pages=4, chunk_pages=(4,)))
    p.run(until=0.5)
    p.restart_prefill(0, announce=False)
    # The new process does not know the decode rank: it answers the decode's next heartbeat (which
    # carries the decode's endpoint) with "register again", in its new epoch. The decode learns of
    # the restart then, well before its heartbeat timeout (3 s) would have.
    p.run(until=2.5)
    assert p.decode.poll(RoomId(1)) is KVPoll.Failed
    assert p.decode.statistics().peer_restarts == 1 and p.decode.statistics().peers_lost == 0
    assert p.prefills[0].statistics().told_to_register >= 1
    p.run(until=5.0)
    assert p.decode.peer_epoch(p.targets()[0]) == Epoch(2) and p.decode.peer_ready(p.targets()[0])
    assert p.decode.release_ready(RoomId(1)) and p.decode.release_was_safe(RoomId(1))
    # Old-epoch messages replayed now are dropped and answer nothing.
    stale = p.stale_messages()
    assert stale
    before = p.decode.statistics().stale_messages
    for to, message in stale:
        assert p.deliver(to, message)[0].__class__.__name__ == "Notice"
    assert p.decode.statistics().stale_messages - before == len(stale)
    p.transfer_time = 0.05
    p.add_room(RoomPlan(room=RoomId(2), num_pages=4, chunk_pages=(4,)))
    p.run(until=6.0)
    assert p.decode.poll(RoomId(2)) is KVPoll.Success and p.violations == []


def test_a_request_that_reaches_the_new_incarnation_late_keeps_the_pages_until_its_ack() -> None:
    """The decode side sent a request to the address before it knew of the restart; the new
    process gets it after the decode side registered with it, and writes. Learning the new epoch
    must not release the room's pages: only the new process's AbortAck may."""
    p = pair()
    p.run(until=0.5)
    p.restart_prefill(0, announce=False)
    held: list[tuple[Endpoint, Message]] = []

    def hold(to: Endpoint, message: Message) -> bool:
        if isinstance(message, (TransferRequest, Abort)) and message.room == RoomId(7):
            held.append((to, message))
            return True
        return False

    p.link.drop_if = hold
    # Opened at once, before the decode's next heartbeat tells it of the restart: its request goes
    # to the address, and the new process opens the room too.
    p.add_room(RoomPlan(room=RoomId(7), num_pages=4, chunk_pages=(4,)))
    p.run(until=5.0)
    # The new epoch was learnt (the new process answered a heartbeat "register again"), registered
    # with again, and the Abort sent to the new process once it acknowledged, and resent with
    # backoff while no AbortAck comes.
    assert p.decode.peer_epoch(p.targets()[0]) == Epoch(2) and p.decode.peer_ready(p.targets()[0])
    assert p.decode.poll(RoomId(7)) is KVPoll.Failed
    names = [type(m).__name__ for _, m in held]
    assert names[0] == "TransferRequest" and names[1:] == ["Abort"] * (len(names) - 1) and len(names) >= 2
    assert not p.decode.release_ready(RoomId(7))
    # The request arrives at the new process, which accepts it and starts writing; then the Abort.
    p.transfer_time = 0.5
    p.link.drop_if = None
    p.deliver(*held[0])
    p.run(until=5.1)
    assert p.writes_started == 1 and p.prefills[0].may_write(RoomId(7))
    assert not p.decode.release_ready(RoomId(7))
    p.deliver(*held[-1])
    p.run(until=10.0)
    assert p.violations == []
    assert p.decode.release_ready(RoomId(7)) and p.decode.release_was_safe(RoomId(7))
