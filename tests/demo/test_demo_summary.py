"""The demo's verdict on a room: the decode ranks' consensus (a MIN over KVPoll, as a decode scheduler
reduces its TP ranks' polls), so a planned abort that failed some decode ranks after others succeeded
is as planned, and an unplanned room that any decode rank failed is not."""

from __future__ import annotations

from pdkv.demo.cluster import summarize
from pdkv.protocol.ids import RoomId
from pdkv.protocol.poll import KVPoll
from pdkv.testing.cluster import AbortPlan, RequestPlan, RoomOutcome


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
