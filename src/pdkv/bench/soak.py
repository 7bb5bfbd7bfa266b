"""Soak: thousands of rooms with aborts, engine failures and link faults through the sans-IO endpoint pair.

Runs ``--rooms`` rooms (default 10,000) through ``pdkv.testing.EndpointPair`` on a fake clock: a
CP group of prefill endpoints and a decode endpoint over a link that drops, duplicates, delays and
reorders messages (through the real codec), ``--abort-rate`` of the rooms aborted by either side at
a random point of their life, ``--engine-failure-rate`` of them with an injected engine failure on
a random chunk and rank; optionally ``--partitions`` control-link partitions longer than the
heartbeat timeout and ``--restarts`` prefill rank restarts behind the same address. Rooms arrive
every ``--gap`` fake seconds and are cleared as the schedulers would once settled, so the run keeps
only live rooms.

Reports, as one JSON line on stdout and a table on stderr: rooms terminal on both sides (must be
all), rooms and pages leaked (decode rooms never released, prefill rooms not terminal or still
writing), canary violations (the harness's abort-safety breaches: a write started or in flight
after a safe release, or bytes of a failed write still queued in the engine that land after it:
``EndpointPair`` models them, and the prefill's fence writes flush them), fences made, unsafe
releases (counted abort-ack timeouts: lost Aborts/AbortAcks), the outcome counts, resident memory at
start, after the first tenth of the rooms (warm: imports and caches settled) and at the end (flat
from warm to end: nothing grows per room), and rooms per second of wall time.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import time
from collections import Counter
from collections.abc import Sequence

from pdkv.bench._report import emit, table
from pdkv.protocol.config import Timeouts
from pdkv.protocol.effects import FailureCause
from pdkv.protocol.ids import RoomId
from pdkv.protocol.poll import KVPoll
from pdkv.testing.endpoint_pair import ClosedRoom, EndpointPair, LinkFaults, RoomPlan

# Short deadlines so that rooms on the failure paths settle within seconds of fake time.
SOAK_TIMEOUTS = Timeouts(
    bootstrap=2.0,
    waiting=2.0,
    inflight=2.0,
    transfer=2.0,
    abort_ack=1.0,
    quarantine=4.0,
    quarantine_settle=3.0,  # longer than LATE_WRITE_S: the bound within which stuck bytes land
    abort_resend=0.2,
    register_retry=0.2,
    tombstone=5.0,
    heartbeat_interval=0.5,
    heartbeat_timeout=2.0,
)
TRANSFER_TIME = 0.002  # fake seconds per chunk write
ABORT_WINDOW = 0.03  # aborts land uniformly in the first 30 ms of a room: bootstrap, transfer, or after
CLOSE_EVERY = 50  # rooms between two clears of the settled ones
PARTITION_S = 3.0  # longer than the heartbeat timeout: both sides lose the peer, then find it again
LATE_WRITE_S = 2.0  # bytes of a failed write land this long after it, unless the decode's cut ends them


def resident_bytes() -> int:
    """Resident set size now (``/proc/self/statm``), or the peak where that file does not exist."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak * 1024  # Linux reports KiB


class _Tally:
    """Outcomes of the cleared rooms, counted as they are cleared (the run keeps no per-room record)."""

    def __init__(self) -> None:
        self.terminal = 0
        self.outcomes: Counter[KVPoll] = Counter()
        self.causes: Counter[FailureCause] = Counter()
        self.prefill_causes: Counter[FailureCause] = Counter()  # per room: its first failing CP rank's
        self.prefill_failed = 0

    def add(self, closed: Sequence[ClosedRoom], pages_of: dict[RoomId, int]) -> None:
        for c in closed:
            pages_of.pop(c.room, None)
            self.outcomes[c.decode] += 1
            if c.decode_cause is not None:
                self.causes[c.decode_cause] += 1
            # Where the room failed first on the prefill side: an injected engine failure shows
            # here as `engine` (the decode side only hears "aborted by peer").
            own = [cause for cause in c.prefill_causes if cause is not None]
            if FailureCause.ENGINE in own:
                self.prefill_causes[FailureCause.ENGINE] += 1
            elif own:
                self.prefill_causes[own[0]] += 1
            finished = (KVPoll.Success, KVPoll.Failed, None)  # None: that rank restarted (not in a soak)
            if c.decode in (KVPoll.Success, KVPoll.Failed) and all(p in finished for p in c.prefill):
                self.terminal += 1


def main(argv: Sequence[str]) -> int:
    description = __doc__.splitlines()[0] if __doc__ else None
    parser = argparse.ArgumentParser(prog="pdkv bench soak", description=description)
    add = parser.add_argument
    add("--rooms", type=int, default=10_000, help="rooms to run (default 10,000)")
    add("--cp", type=int, default=2, help="prefill CP ranks (default 2)")
    add("--abort-rate", type=float, default=0.05, help="share of rooms aborted (default 0.05)")
    add("--engine-failure-rate", type=float, default=0.01, help="share of rooms with a failed write (0.01)")
    add("--per-layer-rate", type=float, default=0.3, help="share of rooms sent layer by layer (0.3)")
    add("--drop", type=float, default=0.001, help="per-message loss probability (default 0.001)")
    add("--duplicate", type=float, default=0.01, help="per-message duplication (default 0.01)")
    add("--max-delay", type=float, default=0.004, help="random delay per message, fake s (0.004)")
    add("--gap", type=float, default=0.002, help="fake seconds between room arrivals (default 0.002)")
    add("--partitions", type=int, default=0, help=f"control-link partitions, {PARTITION_S:g} fake s each (0)")
    add("--restarts", type=int, default=0, help="prefill rank restarts, every other one unannounced (0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny run for tests (300 rooms)")
    args = parser.parse_args(list(argv))
    rooms = 300 if args.quick else args.rooms
    if rooms <= 0 or args.cp <= 0 or args.gap <= 0 or args.partitions < 0 or args.restarts < 0:
        parser.error("--rooms, --cp and --gap must be positive, --partitions and --restarts not negative")

    rng = random.Random(args.seed)
    failing: set[tuple[int, int, int]] = set()
    pair = EndpointPair(
        cp_size=args.cp,
        seed=args.seed,
        faults=LinkFaults(drop=args.drop, duplicate=args.duplicate, max_delay=args.max_delay),
        timeouts=SOAK_TIMEOUTS,
        transfer_time=TRANSFER_TIME,
        fail_write=lambda room, chunk, rank: (room, chunk, rank) in failing,
        notice_limit=100,
        late_write_s=LATE_WRITE_S,
        cuts_connections=True,  # as a decode transport does: a failed write's pages come back proven
    )
    pair.connect()
    pair.run(until=0.05)
    rss_start = resident_bytes()
    wall_start = time.perf_counter()

    pages_of: dict[RoomId, int] = {}  # rooms not cleared yet
    tally = _Tally()
    aborted = engine_failures = per_layer_rooms = 0
    rss_warm = rss_start
    warm_after = max(1, rooms // 10)
    # Liveness faults at evenly spaced rooms, rank by rank.
    partitions = {rooms * (k + 1) // (args.partitions + 1): k % args.cp for k in range(args.partitions)}
    restarts = {rooms * (2 * k + 1) // (2 * args.restarts + 1): k for k in range(args.restarts)}
    for index in range(rooms):
        room = RoomId(index + 1)
        now = pair.clock.now
        if index in partitions:
            pair.partition(partitions[index], until=now + PARTITION_S)
        if index in restarts:
            k = restarts[index]
            pair.restart_prefill(k % args.cp, announce=k % 2 == 0)
        chunks = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
        abort_decode_at = abort_prefill_at = None
        if rng.random() < args.abort_rate:
            aborted += 1
            at = now + rng.uniform(0.0, ABORT_WINDOW)
            if rng.random() < 0.5:
                abort_decode_at = at
            else:
                abort_prefill_at = at
        if rng.random() < args.engine_failure_rate:
            engine_failures += 1
            failing.add((room, rng.randrange(len(chunks)), rng.randrange(args.cp)))
        per_layer = rng.random() < args.per_layer_rate
        per_layer_rooms += per_layer
        plan = RoomPlan(
            room=room,
            num_pages=sum(chunks),
            chunk_pages=chunks,
            abort_decode_at=abort_decode_at,
            abort_prefill_at=abort_prefill_at,
            per_layer=per_layer,
        )
        pages_of[room] = plan.num_pages
        pair.add_room(plan, decode_first=rng.random() < 0.5)
        pair.run(until=now + args.gap)
        if index % CLOSE_EVERY == CLOSE_EVERY - 1:
            tally.add(pair.close_settled(), pages_of)
            pair.retired.clear()  # dead processes' state, kept by the harness for tests: not ours to hold
        if index + 1 == warm_after:
            rss_warm = resident_bytes()
    # Every deadline is at most a few seconds of fake time: this bound is generous.
    pair.settle(limit=60.0)
    # Then long enough for every unfenced byte of a failed write to land (a landing after its room's
    # release is a canary violation).
    pair.run(until=pair.clock.now + LATE_WRITE_S)
    tally.add(pair.close_settled(), pages_of)
    wall = time.perf_counter() - wall_start
    rss_end = resident_bytes()

    # What is left was never settled: decode rooms not released, prefill rooms still live or writing.
    leaked_decode = pair.decode.rooms()
    leaked_prefill = sorted({r for p in pair.prefills for r in p.rooms()})
    pages_leaked = sum(pages_of.get(r, 0) for r in leaked_decode)
    layer_books = [p.layers.statistics() for p in pair.prefills]
    contexts_leaked = sum(len(p.layers.rooms()) for p in pair.prefills)
    stats = pair.decode.statistics()
    link = pair.link.statistics()
    record: dict[str, object] = {
        "bench": "soak",
        "rooms": rooms,
        "cp": args.cp,
        "rooms_terminal": tally.terminal,
        "rooms_succeeded": tally.outcomes.get(KVPoll.Success, 0),
        "rooms_failed": tally.outcomes.get(KVPoll.Failed, 0),
        "aborts_injected": aborted,
        "engine_failures_injected": engine_failures,
        "per_layer_rooms": per_layer_rooms,
        "layer_contexts_finished": sum(b.finished for b in layer_books),
        "layer_contexts_failed": sum(b.failed for b in layer_books),
        "layer_contexts_dropped": sum(b.dropped for b in layer_books),
        "layer_contexts_leaked": contexts_leaked,
        "rooms_leaked_decode": len(leaked_decode),
        "rooms_leaked_prefill": len(leaked_prefill),
        "pages_leaked": pages_leaked,
        "canary_violations": len(pair.violations),
        "unsafe_releases": stats.unsafe_releases,
        "releases_acked": stats.releases_acked,
        "releases_cut": stats.releases_cut,
        "releases_settled": stats.releases_settled,
        "releases_nothing_sent": stats.releases_nothing_sent,
        "cuts": pair.cuts_made,
        "fences": sum(p.statistics().fences_submitted for p in [*pair.prefills, *pair.retired]),
        "late_writes_landed": pair.late_writes_landed,
        "partitions": args.partitions,
        "restarts": args.restarts,
        "peers_lost_decode": stats.peers_lost,
        "peers_lost_prefill": sum(p.statistics().peers_lost for p in pair.prefills),
        "peer_restarts_seen": stats.peer_restarts,
        **{f"failed_{cause.value}": tally.causes.get(cause, 0) for cause in FailureCause},
        **{f"prefill_failed_{cause.value}": tally.prefill_causes.get(cause, 0) for cause in FailureCause},
        "messages_posted": link.posted,
        "messages_dropped": link.dropped,
        "messages_duplicated": link.duplicated,
        "fake_seconds": round(pair.clock.now, 3),
        "wall_seconds": round(wall, 3),
        "rooms_per_s": round(rooms / wall, 1),
        "rss_start_mib": round(rss_start / 2**20, 1),
        "rss_warm_mib": round(rss_warm / 2**20, 1),
        "rss_end_mib": round(rss_end / 2**20, 1),
    }
    emit(record)
    rows = [(name, value) for name, value in record.items() if name != "bench"]
    title = f"pdkv bench soak: {rooms} rooms, {args.cp} prefill CP ranks, sans-IO, fake clock"
    table(title, ["figure", "value"], rows)
    ok = (
        tally.terminal == rooms
        and not leaked_decode
        and not leaked_prefill
        and not contexts_leaked
        and not pair.violations
    )
    return 0 if ok else 1
