"""`pdkv bench mapping --quick` prints one well-formed JSON record with sane, consistent figures."""

from __future__ import annotations

import json

import pytest

import pdkv.bench.mapping as bench_mapping


def test_quick_run_prints_consistent_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert (bench_mapping.__doc__ or "").startswith("Mapping: one CP rank's full map")
    assert bench_mapping.main(["--quick"]) == 0
    captured = capsys.readouterr()
    lines = [line for line in captured.out.splitlines() if line.strip()]
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["bench"] == "mapping"
    assert record["identical"] is True
    assert record["vectorised_s"] > 0
    assert record["reference_s"] > 0
    assert record["speedup"] == pytest.approx(record["reference_s"] / record["vectorised_s"])
    # --quick: 8,192 tokens, page 64 -> 128 pages; CP 8 page-interleaved, rank 0 owns every 8th page
    assert record["pages_owned"] == 16
    assert record["blocks"] == record["runs"] * record["layers"] == 16 * 4
    assert record["bytes"] == record["pages_owned"] * record["layers"] * record["item_bytes"]
    assert record["item_bytes"] == 64 * 1152
    assert record["batches"] >= 1
    assert "python loop" in captured.err


def test_options_change_the_workload(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--quick",
        "--policy",
        "block",
        "--block-pages",
        "4",
        "--cp",
        "2",
        "--rank",
        "1",
        "--slice-bytes",
        "65536",
    ]
    assert bench_mapping.main(argv) == 0
    record = json.loads(capsys.readouterr().out.strip())
    assert record["pages_owned"] == 64  # half of 128 pages
    # 73,728-byte pages sliced at 64 KiB: every run of n pages becomes ceil(n * 73728 / 65536) entries
    assert record["blocks"] > record["runs"] * record["layers"]
    assert record["bytes"] == 64 * 4 * 73_728
    assert record["identical"] is True
