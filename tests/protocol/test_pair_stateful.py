"""Hypothesis drives a CP group of prefill endpoints and a decode endpoint through a faulty link.

Rules open rooms (chunked, aborted by either side at random times, with engine failures) and move
time forward; the link drops, duplicates, delays and reorders messages. Checked at every step:
- abort safety: no write starts or is in flight when decode releases a room's pages as safe
  (``EndpointPair`` records every breach), and unsafe releases happen only via the counted timeout;
- decode Success only when every prefill rank (all are required here) reached Success;
- liveness: every room is terminal on both sides, and its pages released, by the sum of the
  deadlines of the states it can pass through (``BOUND`` seconds after it was opened).
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pdkv.protocol.config import Timeouts
from pdkv.protocol.effects import ReleasePages
from pdkv.protocol.ids import RoomId
from pdkv.protocol.machines import DecodeAbortState
from pdkv.protocol.poll import KVPoll
from pdkv.testing.endpoint_pair import EndpointPair, LinkFaults, RoomPlan

TIMEOUTS = Timeouts(bootstrap=4, waiting=4, inflight=4, transfer=4, abort_ack=2, register_retry=0.5, tombstone=100)
TRANSFER_TIME = 0.02
# Decode: bootstrap + waiting + transfer + abort_ack; prefill: bootstrap + inflight + a transfer.
BOUND = TIMEOUTS.bootstrap + TIMEOUTS.waiting + TIMEOUTS.transfer + TIMEOUTS.abort_ack + 4 * TRANSFER_TIME


class PairFaults(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pair: EndpointPair
        self.opened: dict[RoomId, float] = {}
        self.failing: set[tuple[int, int, int]] = set()
        self.next_room = 1

    @initialize(
        cp=st.integers(1, 3),
        seed=st.integers(0, 2**16),
        drop=st.sampled_from([0.0, 0.05, 0.3]),
        duplicate=st.sampled_from([0.0, 0.2]),
        max_delay=st.sampled_from([0.0, 0.01, 0.6]),
    )
    def setup(self, cp: int, seed: int, drop: float, duplicate: float, max_delay: float) -> None:
        self.pair = EndpointPair(
            cp_size=cp,
            seed=seed,
            faults=LinkFaults(drop=drop, duplicate=duplicate, max_delay=max_delay),
            timeouts=TIMEOUTS,
            transfer_time=TRANSFER_TIME,
            fail_write=lambda room, chunk, rank: (room, chunk, rank) in self.failing,
        )
        self.pair.connect()

    @rule(
        chunks=st.lists(st.integers(1, 4), min_size=1, max_size=4),
        decode_first=st.booleans(),
        abort_decode=st.none() | st.floats(0.0, 0.2),
        abort_prefill=st.none() | st.floats(0.0, 0.2),
        fail_chunk=st.none() | st.integers(0, 3),
    )
    def open_room(
        self,
        chunks: list[int],
        decode_first: bool,
        abort_decode: float | None,
        abort_prefill: float | None,
        fail_chunk: int | None,
    ) -> None:
        room = RoomId(self.next_room)
        self.next_room += 1
        now = self.pair.clock.now
        if fail_chunk is not None:
            self.failing.add((room, fail_chunk, fail_chunk % len(self.pair.prefills)))
        plan = RoomPlan(
            room=room,
            num_pages=sum(chunks),
            chunk_pages=tuple(chunks),
            abort_decode_at=None if abort_decode is None else now + abort_decode,
            abort_prefill_at=None if abort_prefill is None else now + abort_prefill,
        )
        self.pair.add_room(plan, decode_first=decode_first)
        self.opened[room] = now

    @rule(dt=st.floats(0.0005, 3.0))
    def advance(self, dt: float) -> None:
        self.pair.run(until=self.pair.clock.now + dt)

    @invariant()
    def abort_safety(self) -> None:
        if hasattr(self, "pair"):
            assert self.pair.violations == []

    @invariant()
    def unsafe_release_only_by_counted_timeout(self) -> None:
        if not hasattr(self, "pair"):
            return
        unsafe = [e for e in self.pair.releases.values() if isinstance(e, ReleasePages) and not e.safe]
        assert len(unsafe) == self.pair.decode.statistics().unsafe_releases
        for e in unsafe:
            assert self.pair.decode.abort_state(e.room) is DecodeAbortState.TIMED_OUT

    @invariant()
    def success_means_every_rank_succeeded(self) -> None:
        if not hasattr(self, "pair"):
            return
        for room in self.opened:
            if self.pair.decode.poll(room) is KVPoll.Success:
                assert all(p.poll(room) is KVPoll.Success for p in self.pair.prefills)

    @invariant()
    def rooms_terminal_by_their_deadline(self) -> None:
        if not hasattr(self, "pair"):
            return
        now = self.pair.clock.now
        for room, opened in self.opened.items():
            if now >= opened + BOUND:
                assert self.pair.decode.release_ready(room), (room, self.pair.decode.room_history(room))
                for p in self.pair.prefills:
                    assert p.poll(room) in (KVPoll.Success, KVPoll.Failed), (room, p.room_history(room))
                    assert p.in_flight(room) == 0

    def teardown(self) -> None:
        if hasattr(self, "pair") and self.opened:
            self.pair.run(until=max(self.opened.values()) + BOUND)
            self.rooms_terminal_by_their_deadline()
            self.abort_safety()


PairFaults.TestCase.settings = settings(max_examples=150, stateful_step_count=25, deadline=None)
test_endpoint_pair_under_faults = PairFaults.TestCase
