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
    lines = run("control", "--quick", "--serial-rooms", "7")
    records = {str(r["kind"]): r for r in lines}
    serial, concurrent, summary = records["serial"], records["concurrent"], records["summary"]
    assert (serial["rooms"], concurrent["rooms"]) == (7, 20)
    for r in (serial, concurrent):
        assert r["failed"] == 0
        assert 0 < float(str(r["p50_ms"])) <= float(str(r["p99_ms"]))
        assert float(str(r["rooms_per_s"])) > 0
    # One room at a time: no two rooms' chunks can share a transfer job.
    assert serial["rooms_per_job"] == 1.0
    assert float(str(concurrent["rooms_per_job"])) >= 1.0
    ratio = float(str(concurrent["rooms_per_s"])) / float(str(serial["rooms_per_s"]))
    assert summary["concurrent_vs_serial_rooms_per_s"] == pytest.approx(ratio)
    # The engine alone (Mooncake, the default): as many one-page batches as serial rooms, and what the
    # serial rooms add over it.
    engine = records["engine"]
    assert engine["batches"] == serial["rooms"]
    assert 0 < float(str(engine["p50_ms"])) <= float(str(engine["p99_ms"]))
    # The same batches again, each after one serial room's period of idle.
    paced = records["engine_paced"]
    assert paced["batches"] == serial["rooms"]
    assert paced["idle_ms"] == pytest.approx(1000 / float(str(serial["rooms_per_s"])))
    assert 0 < float(str(paced["p50_ms"])) <= float(str(paced["p99_ms"]))
    for stat in ("p50", "p99"):
        assert summary[f"serial_{stat}_over_engine_ms"] == pytest.approx(
            float(str(serial[f"{stat}_ms"])) - float(str(engine[f"{stat}_ms"]))
        )
        assert summary[f"serial_{stat}_over_engine_paced_ms"] == pytest.approx(
            float(str(serial[f"{stat}_ms"])) - float(str(paced[f"{stat}_ms"]))
        )
    # CPU per room of each process of each mode; the sides' groups add up to their totals.
    cpu = {(r["mode"], r["process"]): r for r in lines if r["kind"] == "cpu_ms_per_room"}
    assert set(cpu) == {
        (m, p) for m in ("serial", "concurrent") for p in ("prefill", "decode", "bench driver", "all")
    }
    for mode in ("serial", "concurrent"):
        sides = [cpu[(mode, p)] for p in ("prefill", "decode", "bench driver")]
        for side in sides:
            parts = [
                float(str(v))
                for k, v in side.items()
                if k not in ("bench", "kind", "mode", "process", "total")
            ]
            assert sum(parts) == pytest.approx(float(str(side["total"])))
        assert float(str(cpu[(mode, "all")]["total"])) == pytest.approx(
            sum(float(str(s["total"])) for s in sides)
        )
        assert (
            float(str(cpu[(mode, "all")]["total"])) > 0
        )  # (10 ms clock ticks: a side of 5 rooms may read 0)


def test_bench_transport_quick() -> None:
    [record] = run("transport", "--quick")
    assert record["verified"] is True
    seconds = record["seconds"]
    gbps = record["gb_per_s"]
    assert isinstance(seconds, dict) and isinstance(gbps, dict)
    assert record["transport_vs_raw"] == pytest.approx(seconds["raw"] / seconds["transport"])
    assert gbps["transport"] == pytest.approx(int(str(record["bytes"])) / seconds["transport"] / 1e9)


@pytest.mark.parametrize("option", ["--rooms", "--serial-rooms"])
def test_bench_control_refuses_no_rooms(option: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pdkv", "bench", "control", option, "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert "--rooms and --serial-rooms must be at least 1" in proc.stderr
