"""`pdkv bench alloc --quick`: well-formed JSON lines with sane, self-consistent figures."""

from __future__ import annotations

import json

import pytest

from pdkv.bench import alloc as bench_alloc


def test_quick_run_prints_consistent_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_alloc.main(["--quick"]) == 0
    captured = capsys.readouterr()
    records = [json.loads(line) for line in captured.out.splitlines()]
    assert all(record["bench"] == "alloc" for record in records)
    allocators = {r["impl"]: r for r in records if r["record"] == "allocator"}
    assert set(allocators) == {"pool", "linear_first_fit_python", "linear_first_fit_numpy"}
    pool = allocators["pool"]
    assert pool["pages"] == 100_000
    assert pool["allocations"] == 1_000
    assert 4.25 <= pool["metadata_bytes_per_page"] <= 4.5
    assert pool["free_extents_at_start"] > 1, "the workload must have fragmented the pool"
    for record in allocators.values():
        assert 0 < record["median_us"] <= record["p99_us"]
        assert record["runs_per_allocation"] >= 1.0
        assert 0 < record["allocations"] <= pool["allocations"]
    assert "first 200 of the pool's 1000" in allocators["linear_first_fit_python"]["note"]
    ratios = [r for r in records if r["record"] == "ratio"]
    assert {r["impl"] for r in ratios} == {
        "linear_first_fit_python_over_pool",
        "linear_first_fit_numpy_over_pool",
    }
    for ratio in ratios:
        reference = allocators[ratio["impl"].removesuffix("_over_pool")]
        assert ratio["reference_median_us"] == reference["median_us"]
        assert ratio["median_ratio"] == pytest.approx(ratio["reference_median_us"] / ratio["pool_median_us"])
        assert ratio["p99_ratio"] == pytest.approx(ratio["reference_p99_us"] / ratio["pool_p99_us"])
        assert ratio["median_ratio"] > 0 and ratio["p99_ratio"] > 0
    classes = [r for r in records if r["record"] == "size_class"]
    assert {c["request_pages"] for c in classes} <= {"1..8", "9..64", "65..512"}
    assert all(c["pool_median_us"] > 0 and c["reference_median_us"] > 0 for c in classes)
    assert "metadata bytes/page" in captured.err


def test_docstring_opens_with_the_one_line_help() -> None:
    # `pdkv bench list` shows this line.
    assert (bench_alloc.__doc__ or "").splitlines()[0].startswith("Page allocator: ")
