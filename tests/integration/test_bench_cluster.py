"""`pdkv bench control` and `pdkv bench transport` (multi-process) print consistent figures."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def run(*args: str) -> list[dict[str, object]]:
    proc = subprocess.run(
        [sys.executable, "-m", "pdkv", "bench", *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_bench_control_quick() -> None:
    records = {str(r["kind"]): r for r in run("control", "--quick")}
    serial, concurrent, summary = records["serial"], records["concurrent"], records["summary"]
    for r in (serial, concurrent):
        assert r["failed"] == 0
        assert 0 < float(str(r["p50_ms"])) <= float(str(r["p99_ms"]))
        assert float(str(r["rooms_per_s"])) > 0
    # One room at a time: no two rooms' chunks can share a transfer job.
    assert serial["rooms_per_job"] == 1.0
    assert float(str(concurrent["rooms_per_job"])) >= 1.0
    ratio = float(str(concurrent["rooms_per_s"])) / float(str(serial["rooms_per_s"]))
    assert summary["concurrent_vs_serial_rooms_per_s"] == pytest.approx(ratio)


def test_bench_transport_quick() -> None:
    [record] = run("transport", "--quick")
    assert record["verified"] is True
    seconds = record["seconds"]
    gbps = record["gb_per_s"]
    assert isinstance(seconds, dict) and isinstance(gbps, dict)
    assert record["transport_vs_raw"] == pytest.approx(seconds["raw"] / seconds["transport"])
    assert gbps["transport"] == pytest.approx(int(str(record["bytes"])) / seconds["transport"] / 1e9)
