"""`pdkv bench sglang`: a tiny run of SGLang's transfer and pdkv's, and the checks that can fail it.

The slow test runs the bench end to end (SGLang's real Mooncake classes and pdkv's transports, four
processes, 1 page of 4 layers, 1 round): both systems' bytes verified, both planted wrong bytes
found, no GPU stub called, every figure present and positive. The others check, without processes,
the pieces that decide a failure: the byte check finds a planted byte and a missed page, a run with
a wrong byte, a missed control or a stub call is not ok.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest

from pdkv.bench import sglang
from pdkv.bench._sglang_ranks import (
    Case,
    Check,
    DecodeResult,
    PrefillResult,
    check_pages,
    kv_content,
    plant_wrong_byte,
)
from pdkv.errors import InvalidArgumentError
from pdkv.protocol.poll import KVPoll
from tests.adapters.helpers import requires_sglang

PAGE = 64 * 1152


def _records(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.mark.slow
@requires_sglang
def test_quick_run_verifies_both_systems(capsys: pytest.CaptureFixture[str]) -> None:
    assert sglang.main(["--quick", "--sglang", "mooncake"]) == 0
    records = _records(capsys.readouterr().out)
    (summary,) = [r for r in records if r["kind"] == "summary"]
    systems = ["sglang/mooncake", "pdkv/mooncake"]
    assert summary["ok"] is True and summary["failures"] == []
    assert summary["systems"] == systems
    # the warm-up and the measured request of each system, every byte checked
    assert summary["verified"] == dict.fromkeys(systems, 2)
    assert summary["controls_detected"] == dict.fromkeys(systems, True)
    assert summary["stub_calls"] == {"sglang/mooncake prefill": 0, "sglang/mooncake decode": 0}
    cases = {r["system"]: r for r in records if r["kind"] == "case"}
    assert set(cases) == set(systems)
    for name, record in cases.items():
        assert (record["case"], record["pages"], record["chunks"], record["rounds"]) == ("1", 1, 1, 1)
        assert record["bytes"] == 4 * PAGE
        for figure in (
            "prefill_success_ms",
            "decode_success_ms",
            "prefill_cpu_ms",
            "scheduler_thread_cpu_ms",
        ):
            stats = record[figure]
            assert 0 < stats["min"] <= stats["median"] <= stats["max"] < 60_000, (name, figure, stats)
    assert cases["sglang/mooncake"]["tcp_queue"] == 16384
    assert cases["pdkv/mooncake"]["tcp_queue"] is None
    (ratio,) = [r for r in records if r["kind"] == "ratio"]
    assert (ratio["pdkv"], ratio["versus"]) == ("pdkv/mooncake", "sglang/mooncake")
    for key in ("speed", "cpu"):
        assert math.isfinite(ratio[key]) and ratio[key] > 0


# ----------------------------------------------------------------------------- the byte check


def _landed(pages: int, layers: int = 3, pool: int = 12) -> tuple[list[Any], Any, list[Any]]:
    """A decode pool where a request's pages landed right: views, dst pages, expected."""
    rng = np.random.default_rng(1)
    src = rng.choice(np.arange(1, pool), pages, replace=False).astype(np.int64)
    dst = rng.choice(np.arange(1, pool), pages, replace=False).astype(np.int64)
    views = [np.zeros((pool, PAGE), dtype=np.uint8) for _ in range(layers)]
    expected = [kv_content(layer, src, PAGE) for layer in range(layers)]
    for view, want in zip(views, expected, strict=True):
        view[dst] = want
    return views, dst, expected


def test_check_passes_landed_pages_and_finds_a_planted_byte() -> None:
    views, dst, expected = _landed(5)
    assert check_pages(views, dst, expected, aux_ok=True) == Check(
        items=15, mismatched=0, first=None, aux_ok=True
    )
    planted = plant_wrong_byte(views, dst, room=7)
    check = check_pages(views, dst, expected, aux_ok=True)
    assert (check.mismatched, check.first, check.ok) == (1, planted, False)
    assert planted == (7 % 3, 4)


def test_check_finds_a_missed_page_and_a_wrong_aux_row() -> None:
    views, dst, expected = _landed(4)
    views[2][dst[1]] = 0  # one layer of one page never written
    check = check_pages(views, dst, expected, aux_ok=True)
    assert (check.mismatched, check.first) == (1, (2, 1))
    views, dst, expected = _landed(4)
    assert not check_pages(views, dst, expected, aux_ok=False).ok


def test_content_differs_per_layer_and_page() -> None:
    pages = np.arange(1, 4, dtype=np.int64)
    first, second = kv_content(0, pages, PAGE), kv_content(1, pages, PAGE)
    assert not np.array_equal(first, second)
    assert not np.array_equal(first[0], first[1])
    assert first.min() > 0  # a zeroed page never passes


# ----------------------------------------------------------------------------- what fails a run


def _outcome(room: int, check: Check | None, *, state: KVPoll = KVPoll.Success, planted: Any = None) -> Any:
    prefill = PrefillResult(
        room=room, state=int(state), failure="", sent_at=1.0, wall_s=0.01, cpu_s=0.01, thread_cpu_s=0.001
    )
    decode = DecodeResult(
        room=room, state=int(state), failure="boom", success_at=1.01, check=check, planted=planted
    )
    return sglang.Outcome(prefill=prefill, decode=decode)


def _run() -> sglang.Run:
    run = sglang.Run(cases=[Case(pages=1)], systems=[])
    return run


def test_a_wrong_byte_or_a_failed_request_fails_the_run() -> None:
    case = Case(pages=1)
    good = Check(items=4, mismatched=0, first=None, aux_ok=True)
    run = _run()
    assert run.accept("pdkv/mooncake", case, _outcome(1, good))
    assert run.passed() and run.verified == {"pdkv/mooncake": 1}
    wrong = Check(items=4, mismatched=1, first=(2, 0), aux_ok=True)
    assert not run.accept("pdkv/mooncake", case, _outcome(2, wrong))
    assert not run.passed() and "1 of 4 KV items differ" in run.failures[0]
    run = _run()
    assert not run.accept("sglang/mooncake", case, _outcome(3, None, state=KVPoll.Failed))
    assert not run.passed() and "prefill Failed" in run.failures[0]
    run = _run()
    assert not run.accept(
        "sglang/mooncake", case, _outcome(4, Check(items=4, mismatched=0, first=None, aux_ok=False))
    )
    assert "aux row wrong" in run.failures[0]


def test_a_control_counts_only_when_its_byte_is_found_alone_where_planted() -> None:
    case = Case(pages=1)
    run = _run()
    found = Check(items=4, mismatched=1, first=(1, 0), aux_ok=True)
    assert not run.accept("pdkv/mooncake", case, _outcome(1, found, planted=(1, 0)), planted=True)
    assert run.controls == {"pdkv/mooncake": True} and run.failures == []
    for check in (
        Check(items=4, mismatched=0, first=None, aux_ok=True),  # not found
        Check(items=4, mismatched=2, first=(1, 0), aux_ok=True),  # found with another
        Check(items=4, mismatched=1, first=(2, 0), aux_ok=True),  # found elsewhere
    ):
        run = _run()
        run.accept("pdkv/mooncake", case, _outcome(1, check, planted=(1, 0)), planted=True)
        assert run.controls == {"pdkv/mooncake": False} and len(run.failures) == 1


def test_a_stub_call_or_a_missing_report_fails_the_run() -> None:
    run = _run()
    run.stub_report("sglang/mooncake prefill", ())
    assert run.passed() and run.stub_calls == {"sglang/mooncake prefill": 0}
    run.stub_report("sglang/mooncake decode", ("triton.cdiv",))
    assert not run.passed() and "triton.cdiv" in run.failures[0]
    run = _run()
    run.stub_report("sglang/mooncake decode", None)
    assert not run.passed() and run.stub_calls == {"sglang/mooncake decode": -1}


# ----------------------------------------------------------------------------- the workload


def test_cases_and_chunks() -> None:
    cases = sglang.parse_cases("1,16,128,128/4")
    assert [c.label for c in cases] == ["1", "16", "128", "128/4"]
    assert cases[3].chunk_bounds() == [(0, 32), (32, 64), (64, 96), (96, 128)]
    assert Case(pages=10, chunks=3).chunk_bounds() == [(0, 4), (4, 8), (8, 10)]
    for bad in ("0", "4/5", "", "x", "2/0"):
        with pytest.raises(InvalidArgumentError, match="cases"):
            sglang.parse_cases(bad)


def test_page_lists_are_shared_by_sizes_and_avoid_the_padding_page() -> None:
    lists = sglang.draw_page_lists(sglang.parse_cases("1,16,128,128/4"), 0.7, 16, seed=0)
    assert sorted(lists) == [1, 16, 128]
    for pages, pair in lists.items():
        for side in (pair.src, pair.dst):
            assert sorted(side.tolist()) == list(range(1, pages + 1))  # a permutation, page 0 unused
    runs = np.flatnonzero((np.diff(lists[128].src) == 1) & (np.diff(lists[128].dst) == 1))
    assert len(runs) >= 0.5 * 128  # most pages sit in runs contiguous on both sides
