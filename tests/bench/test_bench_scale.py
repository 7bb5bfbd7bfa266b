"""`pdkv bench scale --quick`: the sans-IO endpoints at two sizes, every room settled, figures well formed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdkv.bench import scale


def test_scale_bench_quick(capsys: pytest.CaptureFixture[str]) -> None:
    assert scale.main(["--quick"]) == 0
    records: list[dict[str, Any]] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    runs = [r for r in records if r["kind"] == "run"]
    (summary,) = [r for r in records if r["kind"] == "summary"]
    assert [(r["cp"], r["rooms"]) for r in runs] == [(1, 100), (1, 200), (4, 100), (4, 200)]
    assert summary["unsettled"] == 0
    for r in runs:
        assert r["unsettled"] == 0 and r["succeeded"] + r["failed"] == r["rooms"]
        assert r["succeeded"] > 0
        # Every room asks each CP rank once: at least cp TransferRequests per room.
        assert r["by_type_per_room"]["TransferRequest"] >= r["cp"]
        assert r["messages_per_room"] == pytest.approx(sum(r["by_type_per_room"].values()))
        assert r["decode_us_per_room"] > 0 and r["prefill_us_per_room_per_rank"] > 0
        assert r["max_heap_decode"] >= 1 and r["max_heap_prefill"] >= 1


def test_size_mix_is_the_issue_mix() -> None:
    assert sum(share for _, share in scale.SIZE_MIX) == pytest.approx(1.0)
    assert [pages for pages, _ in scale.SIZE_MIX] == [1, 16, 128, 512]
