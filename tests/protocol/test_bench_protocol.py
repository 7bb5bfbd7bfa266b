from __future__ import annotations

import json
import subprocess
import sys


def test_bench_protocol_prints_sane_json() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pdkv", "bench", "protocol", "--quick", "--pages", "512"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    figures = {r["figure"]: r for r in records}
    assert set(figures) == {
        "codec encode+decode, TransferRequest",
        "codec decode, 1-page TransferRequest",
        "codec decode, Success TransferStatus",
        "machine construction (transitions)",
        "trigger (table check + transitions)",
        "room lifecycle, prefill side",
        "room lifecycle, decode side",
    }
    assert all(r["microseconds"] > 0 for r in records)
    assert "512 pages" in figures["codec encode+decode, TransferRequest"]["note"]
    assert "once per room" in figures["codec decode, Success TransferStatus"]["note"]
    # A lifecycle fires several triggers and builds machines: it cannot be cheaper than one trigger.
    trigger = figures["trigger (table check + transitions)"]["microseconds"]
    assert figures["room lifecycle, prefill side"]["microseconds"] > trigger
    assert "pdkv bench protocol" in proc.stderr
