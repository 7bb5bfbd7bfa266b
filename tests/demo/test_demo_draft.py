"""``pdkv demo --decode-without-draft-state``: the summary counts rooms served without draft state and
fails a rolling deployment whose rooms do not say so; the run itself between real processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdkv.demo.cluster import summarize
from pdkv.protocol.ids import RoomId
from pdkv.protocol.poll import KVPoll
from pdkv.testing.cluster import RequestPlan, RoomOutcome
from tests.diagrams.test_trace_demo import run

PLANS = [RequestPlan(room=RoomId(r), tokens=32, chunk_tokens=(32,)) for r in (1, 2)]


def outcome(room: int, skipped: str) -> RoomOutcome:
    return RoomOutcome(
        room=room,
        side="decode",
        rank="decode tp0",
        poll=int(KVPoll.Success),
        failure="",
        seconds=0.1,
        bytes_checked=64,
        draft_skipped=skipped,
    )


def test_a_rolling_deployment_must_report_the_draft_state_each_room_missed() -> None:
    said = "draft state not transferred: not written here [], not sent by p:tp0/cp0 [draft index_k layer 0]"
    both = [outcome(1, said), outcome(2, said)]
    summary, rows = summarize(PLANS, both, [], 1.0, draft_left_out=True)
    assert (summary.draft_skipped, summary.draft_unreported, summary.ok) == (2, 0, True)
    assert rows[0]["draft_skipped"] == said
    # The control: a room that does not report it fails the run.
    silent = [outcome(1, said), outcome(2, "")]
    summary, _ = summarize(PLANS, silent, [], 1.0, draft_left_out=True)
    assert (summary.draft_skipped, summary.draft_unreported, summary.ok) == (1, 1, False)
    # Without a rolling deployment nothing is expected.
    summary, _ = summarize(PLANS, [outcome(1, ""), outcome(2, "")], [], 1.0)
    assert (summary.draft_skipped, summary.draft_unreported, summary.ok) == (0, 0, True)


@pytest.mark.slow
def test_the_demo_serves_a_decode_without_draft_state(tmp_path: Path) -> None:
    demo = run(
        [
            "demo",
            "--decode-without-draft-state",
            "--rooms",
            "4",
            "--cp",
            "1",
            "--aborts",
            "0",
            "--json",
            "--log-dir",
            str(tmp_path),
        ],
        timeout=240,
    )
    assert demo.returncode == 0, demo.stderr[-3000:]
    rows = [json.loads(line) for line in demo.stdout.splitlines() if line.startswith('{"room"')]
    assert len(rows) == 4 and all(r["outcome"] == "success" for r in rows)
    assert all("not sent by prefill-0:tp0/cp0 [draft index_k layer 0" in r["draft_skipped"] for r in rows)
    summary = json.loads(demo.stdout.splitlines()[-1])
    assert summary["ok"] and summary["summary"]["draft_skipped"] == 4
