"""`pdkv bench sglang`: a tiny run of SGLang's transfer and pdkv's, and the checks that can fail it.

The slow test runs the bench end to end (SGLang's real Mooncake and NIXL classes and pdkv's transports
over both engines, a prefill and a decode process per system, 1 page of 4 layers, 1 round): every
system's bytes verified, every planted wrong byte found, no GPU stub called, every figure present and
positive, each pdkv system's ratios against SGLang on its own engine. The others check, without
processes, the pieces that decide a failure or a figure: the byte check finds a planted byte and a
missed page, a run with a wrong byte, a missed control or a stub call is not ok, ratios pair by engine.
"""

from __future__ import annotations

import argparse
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


# NIXL comes with `make venv` (pdkv's backend) and `make sglang` (SGLang's `nixl` module): the quick run
# then has both engines, each on both systems.
SGLANG_ENGINES = ["mooncake", "nixl"] if sglang.nixl_installed() else ["mooncake"]
PDKV_ENGINES = ["mooncake", "nixl"] if not sglang.nixl_problem() else ["mooncake"]


@pytest.mark.slow
@requires_sglang
def test_quick_run_verifies_every_system(capsys: pytest.CaptureFixture[str]) -> None:
    # --quick alone: every engine installed, on both systems (here: Mooncake and NIXL)
    assert sglang.main(["--quick"]) == 0
    records = _records(capsys.readouterr().out)
    (summary,) = [r for r in records if r["kind"] == "summary"]
    systems = [f"sglang/{e}" for e in SGLANG_ENGINES] + [f"pdkv/{e}" for e in PDKV_ENGINES]
    assert summary["ok"] is True and summary["failures"] == []
    assert summary["systems"] == systems
    # the warm-up and the measured request of each system, every byte checked
    assert summary["verified"] == dict.fromkeys(systems, 2)
    assert summary["controls_detected"] == dict.fromkeys(systems, True)
    assert summary["stub_calls"] == {
        f"sglang/{e} {role}": 0 for e in SGLANG_ENGINES for role in ("prefill", "decode")
    }
    cases = {r["system"]: r for r in records if r["kind"] == "case"}
    assert set(cases) == set(systems)
    for name, record in cases.items():
        assert (record["case"], record["pages"], record["chunks"], record["rounds"]) == ("1", 1, 1, 1)
        assert record["requests"] == 1  # --quick: one request per small case and round
        assert record["bytes"] == 4 * PAGE
        assert record["engine"] == name.split("/")[1]
        for figure in (
            "prefill_success_ms",
            "decode_success_ms",
            "prefill_cpu_ms",
            "scheduler_thread_cpu_ms",
        ):
            stats = record[figure]
            assert 0 < stats["min"] <= stats["median"] <= stats["max"] < 60_000, (name, figure, stats)
    assert cases["sglang/mooncake"]["tcp_queue"] == 16384
    assert all(cases[name]["tcp_queue"] is None for name in systems if name != "sglang/mooncake")
    ratios = [r for r in records if r["kind"] == "ratio"]
    paired = [e for e in PDKV_ENGINES if e in SGLANG_ENGINES]
    assert [(r["pdkv"], r["versus"]) for r in ratios] == [(f"pdkv/{e}", f"sglang/{e}") for e in paired]
    for ratio in ratios:
        for key in ("speed", "cpu"):
            assert math.isfinite(ratio[key]) and ratio[key] > 0


# ----------------------------------------------------------------------------- the options


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        sglang.parse_args(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--backend", "rdma"], "--backend"),
        (["--backend", "mooncake,mooncake"], "--backend"),
        (["--backend", ","], "--backend"),
        (["--sglang", "mooncake,tcp"], "--sglang"),
        (["--cases", "4/5"], "--cases"),
        (["--rounds", "0"], "--rounds"),
        (["--small-repeats", "0"], "--small-repeats"),
    ],
)
def test_a_bad_option_exits_naming_it(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert f"error: {named}" in _error(argv, capsys)


def test_small_cases_take_several_requests_per_round_and_large_ones_one() -> None:
    args, _ = sglang.parse_args([])
    assert args.small_repeats == 5
    cases = [Case(pages=1), Case(pages=16), Case(pages=17), Case(pages=128, chunks=4)]
    assert [sglang.requests_per_round(args, c) for c in cases] == [5, 5, 1, 1]
    args, _ = sglang.parse_args(["--small-repeats", "2"])
    assert sglang.requests_per_round(args, Case(pages=16)) == 2


def test_auto_engines_follow_what_is_installed_quick_or_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sglang, "nixl_installed", lambda: False)
    monkeypatch.setattr(sglang, "nixl_problem", lambda: "")
    for argv in ([], ["--quick"]):
        args, _ = sglang.parse_args(argv)
        assert (args.backend, args.sglang) == (["mooncake", "nixl"], ["mooncake"])
    monkeypatch.setattr(sglang, "nixl_installed", lambda: True)
    monkeypatch.setattr(sglang, "nixl_problem", lambda: "no libnixl")
    args, cases = sglang.parse_args(["--quick"])
    assert (args.backend, args.sglang) == (["mooncake"], ["mooncake", "nixl"])
    assert ([c.label for c in cases], args.layers, args.rounds, args.small_repeats) == (["1"], 4, 1, 1)
    # named engines are kept as named, in order, whatever is installed
    args, _ = sglang.parse_args(["--backend", "nixl, mooncake", "--sglang", "nixl"])
    assert (args.backend, args.sglang) == (["nixl", "mooncake"], ["nixl"])


def test_a_named_engine_that_cannot_run_stops_before_any_process(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sglang, "sglang_installed", lambda: True)
    monkeypatch.setattr(sglang, "nixl_installed", lambda: False)
    monkeypatch.setattr(sglang, "nixl_problem", lambda: "no libnixl")
    started: list[object] = []

    def run(*args: object) -> int:
        started.append(args)
        return 0

    monkeypatch.setattr(sglang, "_run", run)
    assert sglang.main(["--quick", "--backend", "nixl", "--sglang", "mooncake"]) == 1
    assert "--backend nixl, but pdkv's NIXL backend cannot load: no libnixl" in capsys.readouterr().err
    assert sglang.main(["--quick", "--backend", "mooncake", "--sglang", "nixl"]) == 1
    assert "--sglang nixl, but nixl / nixl-cu12 are not installed" in capsys.readouterr().err
    assert started == []
    assert sglang.main(["--quick", "--backend", "mooncake", "--sglang", "mooncake"]) == 0
    assert len(started) == 1


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


# ----------------------------------------------------------------------------- the report


def _timed(room: int, wall_ms: float, cpu_ms: float) -> Any:
    prefill = PrefillResult(
        room=room,
        state=int(KVPoll.Success),
        failure="",
        sent_at=1.0,
        wall_s=wall_ms / 1e3,
        cpu_s=cpu_ms / 1e3,
        thread_cpu_s=0.001,
    )
    decode = DecodeResult(
        room=room,
        state=int(KVPoll.Success),
        failure="",
        success_at=1.0 + wall_ms / 1e3,
        check=None,
        planted=None,
    )
    return sglang.Outcome(prefill=prefill, decode=decode)


def _report_args() -> argparse.Namespace:
    return argparse.Namespace(
        layers=4,
        rounds=3,
        small_repeats=1,
        sglang_tcp_queue=16384,
        sglang_poll_us=100.0,
        sleep_poll=False,
        pdkv_poll_us=5000.0,
    )


def test_ratios_pair_each_pdkv_system_with_sglang_on_its_own_engine(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # ->P and CPU per request (ms), 3 rounds each; the medians are 10/20, 4/8, 5/10 and 8/2. Crossed
    # pairs would give other figures (sglang/nixl / pdkv/mooncake: 0.8x; sglang/mooncake / pdkv/nixl: 1.25x).
    timings = {
        "sglang/mooncake": [(9, 30), (10, 20), (12, 19)],
        "sglang/nixl": [(4, 8), (3, 9), (5, 7)],
        "pdkv/mooncake": [(5, 10), (6, 11), (4, 9)],
        "pdkv/nixl": [(8, 2), (7, 3), (9, 1)],
    }
    results = {
        name: {"1": [_timed(n, wall, cpu) for n, (wall, cpu) in enumerate(runs)]}
        for name, runs in timings.items()
    }
    sglang.report(_report_args(), [Case(pages=1)], results)
    captured = capsys.readouterr()
    ratios = {r["pdkv"]: r for r in _records(captured.out) if r["kind"] == "ratio"}
    assert set(ratios) == {"pdkv/mooncake", "pdkv/nixl"}
    mooncake, nixl = ratios["pdkv/mooncake"], ratios["pdkv/nixl"]
    assert (mooncake["versus"], mooncake["engine"]) == ("sglang/mooncake", "mooncake")
    assert (nixl["versus"], nixl["engine"]) == ("sglang/nixl", "nixl")
    assert mooncake["speed"] == pytest.approx(2.0) and mooncake["cpu"] == pytest.approx(0.5)
    assert nixl["speed"] == pytest.approx(0.5) and nixl["cpu"] == pytest.approx(0.25)
    # the table: pairs side by side, each pdkv row naming the SGLang row it is compared with
    rows = [line.split() for line in captured.err.splitlines() if line.strip().startswith("1 ")]
    assert [row[2] for row in rows] == ["sglang/mooncake", "pdkv/mooncake", "sglang/nixl", "pdkv/nixl"]
    assert rows[1][-4:] == ["2.00x", "0.50", "vs", "sglang/mooncake"]
    assert rows[3][-4:] == ["0.50x", "0.25", "vs", "sglang/nixl"]
    assert len(rows[0]) == len(rows[2]) == 10  # SGLang's rows carry no ratio
    assert [row[3] for row in rows] == ["3"] * 4  # n: the requests each figure rests on


def test_a_pdkv_system_without_sglang_on_its_engine_gets_no_ratio() -> None:
    figures = {
        name: sglang.case_figures([_timed(1, wall, cpu)])
        for name, (wall, cpu) in {
            "sglang/mooncake": (6, 3),
            "pdkv/mooncake": (3, 3),
            "pdkv/nixl": (1, 1),
        }.items()
    }
    assert sglang.paired_ratios(figures) == {
        "pdkv/mooncake": sglang.Ratio(pdkv="pdkv/mooncake", versus="sglang/mooncake", speed=2.0, cpu=1.0)
    }
    assert sglang.report_order(["sglang/nixl", "pdkv/mooncake", "pdkv/nixl", "sglang/mooncake"]) == [
        "sglang/nixl",
        "pdkv/nixl",
        "sglang/mooncake",
        "pdkv/mooncake",
    ]


def test_engine_lists() -> None:
    assert sglang.parse_names(" nixl, mooncake ", ("mooncake", "nixl"), "backend") == ["nixl", "mooncake"]
    for bad in ("", "mooncake,mooncake", "rdma", "mooncake,tcp"):
        with pytest.raises(InvalidArgumentError, match="backend") as raised:
            sglang.parse_names(bad, ("mooncake", "nixl"), "backend")
        assert raised.value.argument == "backend"


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
