"""`pdkv bench engine` and `pdkv bench transfer` in --quick mode: well-formed JSON, sane figures.

Both start a Mooncake peer in a spawned process and move real bytes over TCP on 127.0.0.1.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdkv.bench import engine as engine_bench
from pdkv.bench import transfer as transfer_bench

pytestmark = pytest.mark.slow


def _records(out: str) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert records, "the benchmark printed no JSON"
    assert all(isinstance(r, dict) for r in records)
    return records


def test_engine_bench_quick(capsys: pytest.CaptureFixture[str]) -> None:
    assert engine_bench.main(["--quick"]) == 0
    records = _records(capsys.readouterr().out)
    shapes = [r for r in records if r["kind"] == "shape"]
    (summary,) = [r for r in records if r["kind"] == "summary"]
    assert len(shapes) == 4  # quick: 2 slice sizes x 1 entry count x 2 in-flight counts
    for row in shapes:
        assert row["bytes"] == 16 << 20 and row["seconds"] > 0
        assert row["gb_per_s"] == pytest.approx(row["bytes"] / row["seconds"] / 1e9)
        assert 0 < row["median_gb_per_s"] <= row["gb_per_s"]
    best, default = summary["best"], summary["default"]
    assert best["gb_per_s"] == max(r["gb_per_s"] for r in shapes)
    assert summary["default_vs_best"] == pytest.approx(best["seconds"] / default["seconds"])
    assert summary["verified"] is True


def test_transfer_bench_quick(capsys: pytest.CaptureFixture[str]) -> None:
    assert transfer_bench.main(["--quick"]) == 0
    records = _records(capsys.readouterr().out)
    runs = [r for r in records if r["kind"] == "run"]
    (summary,) = [r for r in records if r["kind"] == "summary"]
    assert sorted(r["method"] for r in runs) == ["executor", "plain", "raw", "same runs"]
    assert all(r["verified"] is True and r["seconds"] > 0 for r in runs)
    total = 4096 * 4 * 1152
    assert summary["bytes"] == total and summary["verified"] is True
    seconds, gbps = summary["seconds"], summary["gb_per_s"]
    for method in ("executor", "raw", "same runs", "plain"):
        assert gbps[method] == pytest.approx(total / seconds[method] / 1e9)
    assert summary["executor_vs_raw"] == pytest.approx(seconds["raw"] / seconds["executor"])
    assert summary["executor_vs_same_runs"] == pytest.approx(seconds["same runs"] / seconds["executor"])
    assert summary["same_runs_vs_raw"] == pytest.approx(seconds["raw"] / seconds["same runs"])
    assert summary["executor_vs_plain"] == pytest.approx(seconds["plain"] / seconds["executor"])
    assert summary["run_blocks"] > 4  # scattered pages: more than one block per layer
