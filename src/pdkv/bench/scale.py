"""Control plane at scale, simulated: messages, endpoint CPU and deadline heaps as ranks and rooms grow.

The sans-IO endpoints (``pdkv.testing.EndpointPair``: one prefill instance of ``--cp`` CP ranks and
one decode rank, messages through the real codec over an in-memory link, a fake clock) run
``--rooms`` rooms arriving every ``--gap`` fake seconds, with issue 15's request-size mix (1, 16, 128
and 512 pages: 50/30/15/5%, chunked prefill of ``--chunk-pages`` pages), ``--abort-rate`` of the rooms
aborted by either side, and one prefill rank restarted halfway. Every combination of ``--cp`` and
``--rooms`` is one run. Reported per run:

- messages per room, by type, and encoded control bytes per room (TransferRequest carries the
  room's destination pages);
- endpoint CPU per room (thread CPU time around each ``receive``, ``tick``, ``queue_chunk``,
  ``chunk_done``... call: the protocol's own cost, not the harness's), for the decode rank and per
  prefill rank, and the mean cost of each call;
- heartbeat messages per fake second (they grow with peers, not rooms);
- the largest deadline heap and the most rooms open on each side (they grow with rooms in flight,
  i.e. arrival rate x room lifetime, not with rooms run).

What it does not simulate: several prefill instances or decode ranks (a decode rank of a real
deployment talks to every CP x TP rank its rooms fan out to: read the per-rank figures times that
fan-out), the registry (its load is per rank start and per restart, never per room), threads and
sockets. Deadline heaps are read from the endpoints' private ``_deadlines`` (a bench may look).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from pdkv.bench._report import emit, table
from pdkv.protocol import codec
from pdkv.protocol.config import Timeouts
from pdkv.protocol.ids import Endpoint, RoomId
from pdkv.protocol.messages import Message
from pdkv.protocol.poll import KVPoll
from pdkv.testing.endpoint_pair import EndpointPair, RoomPlan, default_layout

SIZE_MIX = ((1, 0.50), (16, 0.30), (128, 0.15), (512, 0.05))
TRANSFER_S_PER_PAGE = 0.0003  # fake seconds of engine time per page (about 4.5 MB per 1.5-3 ms)
ABORT_WINDOW = 0.05
CLOSE_EVERY = 50
TIMED_CALLS = (
    "receive",
    "tick",
    "open_room",
    "queue_chunk",
    "start_chunk",
    "chunk_done",
    "chunk_failed",
    "abort_room",
    "close_room",
    "connect",
)


class CallTimer:
    """CPU time spent inside endpoint calls, by side and call name (wrappers set on the instances)."""

    def __init__(self) -> None:
        self.seconds: defaultdict[tuple[str, str], float] = defaultdict(float)
        self.calls: Counter[tuple[str, str]] = Counter()

    def wrap(self, endpoint: Any, side: str) -> None:
        for name in TIMED_CALLS:
            method = getattr(endpoint, name, None)
            if method is not None:
                setattr(endpoint, name, self._timed(method, (side, name)))

    def _timed(self, method: Callable[..., Any], key: tuple[str, str]) -> Callable[..., Any]:
        seconds, calls = self.seconds, self.calls

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time()  # CPU time: a preempted call on a busy host is not charged
            try:
                return method(*args, **kwargs)
            finally:
                seconds[key] += time.thread_time() - started
                calls[key] += 1

        return timed

    def side_seconds(self, side: str) -> float:
        return sum(s for (who, _), s in self.seconds.items() if who == side)


@attrs.define
class LinkCounter:
    """Messages and encoded bytes posted on the link, by type; heartbeats by fake second."""

    by_type: Counter[str] = attrs.Factory(Counter)
    bytes: int = 0
    heartbeats: int = 0

    def install(self, pair: EndpointPair) -> None:
        post = pair.link.post

        def counted(to: Endpoint, message: Message, now: float, *, sender: Endpoint | None = None) -> None:
            name = type(message).__name__
            self.by_type[name] += 1
            self.bytes += sum(len(frame) for frame in codec.encode(message))
            if "Heartbeat" in name:
                self.heartbeats += 1
            post(to, message, now, sender=sender)

        pair.link.post = counted  # type: ignore[method-assign]


@attrs.frozen(kw_only=True)
class RunResult:
    cp: int
    rooms: int
    succeeded: int
    failed: int
    unsettled: int
    messages_per_room: float
    by_type_per_room: dict[str, float]
    control_bytes_per_room: float
    decode_us_per_room: float
    prefill_us_per_room_per_rank: float
    calls_us: dict[str, float]
    heartbeats_per_fake_s: float
    max_heap_decode: int
    max_heap_prefill: int
    max_rooms_open_decode: int
    fake_seconds: float
    wall_seconds: float


def _size(rng: random.Random) -> int:
    pick = rng.random()
    for pages, share in SIZE_MIX:
        if pick < share:
            return pages
        pick -= share
    return SIZE_MIX[-1][0]


def _heap(endpoint: Any) -> int:
    heap = getattr(endpoint, "_deadlines", None)
    return len(heap) if heap is not None else 0


def run_once(*, cp: int, rooms: int, gap: float, chunk_pages: int, abort_rate: float, seed: int) -> RunResult:
    rng = random.Random(seed)
    layout = default_layout(layers=4, pages=8192, page_size=64)
    pair = EndpointPair(
        cp_size=cp,
        seed=seed,
        # The defaults, but a restart's rooms (whose ack proves nothing of the old process's sockets)
        # settle within the run: the figures measure the protocol, not the 300 s bound.
        timeouts=Timeouts(quarantine_settle=10.0),
        transfer_time=TRANSFER_S_PER_PAGE * chunk_pages,
        layout=layout,
        notice_limit=0,
    )
    timer = CallTimer()
    timer.wrap(pair.decode, "decode")
    for prefill in pair.prefills:
        timer.wrap(prefill, "prefill")
    links = LinkCounter()
    links.install(pair)
    pair.connect()
    pair.run(until=0.05)
    start_fake = pair.clock.now
    wall_start = time.perf_counter()
    succeeded = failed = 0
    max_heap_decode = max_heap_prefill = max_open = 0
    restart_at = rooms // 2
    for index in range(rooms):
        room = RoomId(index + 1)
        now = pair.clock.now
        if index == restart_at and rooms >= 2:
            timer.wrap(pair.restart_prefill(index % cp, announce=True), "prefill")
        pages = _size(rng)
        chunks = tuple(min(chunk_pages, pages - start) for start in range(0, pages, chunk_pages))
        abort_decode_at = abort_prefill_at = None
        if rng.random() < abort_rate:
            at = now + rng.uniform(0.0, ABORT_WINDOW)
            if rng.random() < 0.5:
                abort_decode_at = at
            else:
                abort_prefill_at = at
        pair.add_room(
            RoomPlan(
                room=room,
                num_pages=pages,
                chunk_pages=chunks,
                abort_decode_at=abort_decode_at,
                abort_prefill_at=abort_prefill_at,
            ),
            decode_first=True,
        )
        pair.run(until=now + gap)
        max_heap_decode = max(max_heap_decode, _heap(pair.decode))
        max_heap_prefill = max(max_heap_prefill, max(_heap(p) for p in pair.prefills))
        max_open = max(max_open, len(pair.open_rooms()))
        if index % CLOSE_EVERY == CLOSE_EVERY - 1:
            for closed in pair.close_settled():
                succeeded += closed.decode is KVPoll.Success
                failed += closed.decode is not KVPoll.Success
            pair.retired.clear()
    pair.settle(limit=120.0)
    for closed in pair.close_settled():
        succeeded += closed.decode is KVPoll.Success
        failed += closed.decode is not KVPoll.Success
    wall = time.perf_counter() - wall_start
    fake = pair.clock.now - start_fake
    total_messages = sum(links.by_type.values())
    calls_us = {
        f"{side}.{name}": seconds / max(1, timer.calls[(side, name)]) * 1e6
        for (side, name), seconds in sorted(timer.seconds.items())
    }
    return RunResult(
        cp=cp,
        rooms=rooms,
        succeeded=succeeded,
        failed=failed,
        unsettled=len(pair.open_rooms()),
        messages_per_room=total_messages / rooms,
        by_type_per_room={name: count / rooms for name, count in sorted(links.by_type.items())},
        control_bytes_per_room=links.bytes / rooms,
        decode_us_per_room=timer.side_seconds("decode") / rooms * 1e6,
        prefill_us_per_room_per_rank=timer.side_seconds("prefill") / rooms / cp * 1e6,
        calls_us=calls_us,
        heartbeats_per_fake_s=links.heartbeats / fake if fake > 0 else 0.0,
        max_heap_decode=max_heap_decode,
        max_heap_prefill=max_heap_prefill,
        max_rooms_open_decode=max_open,
        fake_seconds=fake,
        wall_seconds=wall,
    )


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="pdkv bench scale", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--cp", default="1,8,32", help="prefill CP ranks per run (comma-separated)")
    parser.add_argument("--rooms", default="500,2000", help="rooms per run (comma-separated)")
    parser.add_argument("--gap", type=float, default=0.002, help="fake seconds between room arrivals")
    parser.add_argument("--chunk-pages", type=int, default=128, help="pages per prefill chunk")
    parser.add_argument("--abort-rate", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny run for tests: cp 1,4 x 100,200 rooms")
    args = parser.parse_args(list(argv))
    if args.quick:
        args.cp, args.rooms = "1,4", "100,200"
    cps = [int(c) for c in args.cp.split(",") if c.strip()]
    room_counts = [int(r) for r in args.rooms.split(",") if r.strip()]
    if not cps or not room_counts or min(cps) < 1 or min(room_counts) < 1 or args.gap <= 0:
        parser.error("--cp and --rooms must list positive numbers and --gap must be positive")
    results: list[RunResult] = []
    for cp in cps:
        for rooms in room_counts:
            print(f"  cp {cp}, {rooms} rooms ...", file=sys.stderr, flush=True)
            result = run_once(
                cp=cp,
                rooms=rooms,
                gap=args.gap,
                chunk_pages=args.chunk_pages,
                abort_rate=args.abort_rate,
                seed=args.seed,
            )
            results.append(result)
            emit({"bench": "scale", "kind": "run", **attrs.asdict(result)})
    table(
        f"pdkv bench scale: sans-IO endpoints, fake clock, a room every {args.gap * 1e3:g} fake ms, "
        f"{args.abort_rate:.0%} aborted, one prefill restart per run",
        [
            "cp",
            "rooms",
            "ok",
            "msgs/room",
            "ctl B/room",
            "decode us/room",
            "prefill us/room/rank",
            "hb/fake s",
            "max heap D",
            "max heap P",
            "max open",
            "wall s",
        ],
        [
            [
                r.cp,
                r.rooms,
                r.succeeded,
                r.messages_per_room,
                r.control_bytes_per_room,
                r.decode_us_per_room,
                r.prefill_us_per_room_per_rank,
                r.heartbeats_per_fake_s,
                r.max_heap_decode,
                r.max_heap_prefill,
                r.max_rooms_open_decode,
                r.wall_seconds,
            ]
            for r in results
        ],
    )
    base = results[0]
    emit(
        {
            "bench": "scale",
            "kind": "summary",
            "decode_us_per_room_growth": {
                f"cp{r.cp}/{r.rooms}": r.decode_us_per_room / base.decode_us_per_room for r in results
            },
            "messages_per_room_growth": {
                f"cp{r.cp}/{r.rooms}": r.messages_per_room / base.messages_per_room for r in results
            },
            "unsettled": sum(r.unsettled for r in results),
        }
    )
    return 0 if all(r.unsettled == 0 for r in results) else 1
