"""`pdkv bench channel --quick`: both channels answer every message across processes; figures well formed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdkv.bench import channel


def test_channel_bench_quick(capsys: pytest.CaptureFixture[str]) -> None:
    assert channel.main(["--quick"]) == 0
    records: list[dict[str, Any]] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    kinds = {r["channel"]: r for r in records if r["kind"] == "channel"}
    (summary,) = [r for r in records if r["kind"] == "summary"]
    assert sorted(kinds) == ["stream", "zmq"]
    for r in kinds.values():
        assert r["lost"] == 0 and r["messages"] == 50 and r["rounds"] == 2
        assert 0 < r["rtt_p50_us"] <= r["rtt_p99_us"] and r["cpu_per_trip_us"] > 0 and r["burst_per_s"] > 0
    assert summary["rtt_p50_zmq_over_stream"] == pytest.approx(
        kinds["zmq"]["rtt_p50_us"] / kinds["stream"]["rtt_p50_us"]
    )
    assert summary["burst_stream_over_zmq"] == pytest.approx(
        kinds["stream"]["burst_per_s"] / kinds["zmq"]["burst_per_s"]
    )


@pytest.mark.parametrize("argv", [["--messages", "0"], ["--rounds", "0"], ["--messages", "-5"]])
def test_a_count_below_one_is_refused_naming_it_before_any_process_starts(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        channel.main(argv)
    assert exited.value.code == 2
    assert f"error: argument {argv[0]}" in capsys.readouterr().err
