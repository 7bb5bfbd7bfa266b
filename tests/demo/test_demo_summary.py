"""The demo's verdict on a room: the decode ranks' consensus (a MIN over KVPoll, as a decode scheduler
reduces its TP ranks' polls), so a planned abort that failed some decode ranks after others succeeded
is as planned, and an unplanned room that any decode rank failed is not."""

from __future__ import annotations

from typing import Any

import attrs

from pdkv.demo.cluster import summarize
from pdkv.protocol.ids import RoomId
from pdkv.protocol.poll import KVPoll
from pdkv.testing.cluster import AbortPlan, RankReport, RequestPlan, RoomOutcome


def outcome(room: int, rank: str, poll: KVPoll, checked: int = 0) -> RoomOutcome:
    return RoomOutcome(
        room=room, side="decode", rank=rank, poll=int(poll), failure="", seconds=1.0, bytes_checked=checked
    )


def plan(room: int, *, aborted: bool) -> RequestPlan:
    abort = AbortPlan(side="prefill", after_chunks=0) if aborted else None
    return RequestPlan(room=RoomId(room), tokens=32, chunk_tokens=(32,), abort=abort)


def test_a_planned_abort_that_one_decode_rank_outran_is_as_planned() -> None:
    # Prefill TP 2 -> decode TP 2: prefill tp0 aborted the room; decode rank 1's source, prefill tp1,
    # had already finished, so decode rank 1 reported Success before the consensus failed the room.
    plans = [plan(1, aborted=True), plan(2, aborted=False), plan(3, aborted=True)]
    outcomes = [
        outcome(1, "decode tp0", KVPoll.Failed),
        outcome(1, "decode tp1", KVPoll.Success, checked=100),
        outcome(2, "decode tp0", KVPoll.Success, checked=100),
        outcome(2, "decode tp1", KVPoll.Failed),
        outcome(3, "decode tp0", KVPoll.Success, checked=100),
        outcome(3, "decode tp1", KVPoll.Success, checked=100),
    ]
    summary, rows = summarize(plans, outcomes, [], 1.0)
    assert [(r["outcome"], r["as_planned"]) for r in rows] == [
        ("failed", True),  # consensus Failed, and an abort was planned
        ("failed", False),  # nobody aborted it: a failed decode rank is unexpected
        ("success", True),  # the abort lost the race on every rank
    ]
    assert (summary.succeeded, summary.failed, summary.unexpected) == (1, 2, 1)
    assert not summary.ok


def report(side: str, **counts: Any) -> RankReport:
    base = RankReport(
        side=side,
        rank=f"{side} tp0",
        rooms=1,
        canary_violations=0,
        unsafe_releases=0,
        bytes_written=0,
        worker_errors=0,
    )
    return attrs.evolve(base, **counts)


def test_staging_or_landing_memory_still_held_at_the_end_fails_the_demo() -> None:
    plans = [plan(1, aborted=False)]
    outcomes = [outcome(1, "decode tp0", KVPoll.Success, checked=100)]
    returned = [report("prefill", staged_writes=3), report("decode", rooms_landed=1)]
    summary, _ = summarize(plans, outcomes, returned, 1.0)
    assert summary.ok and (summary.staged_writes, summary.rooms_landed, summary.leased_at_end) == (3, 1, 0)
    for held in (report("prefill", staging_leased_at_end=4096), report("decode", landing_leased_at_end=1)):
        summary, _ = summarize(plans, outcomes, [*returned, held], 1.0)
        assert not summary.ok and summary.leased_at_end > 0
