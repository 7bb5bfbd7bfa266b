"""``pdkv bench soak --quick``: well-formed JSON, every room terminal, nothing leaked, figures consistent."""

from __future__ import annotations

import json
import subprocess
import sys

from pdkv.protocol.effects import FailureCause


def test_bench_soak_quick_run_is_complete_and_consistent() -> None:
    # More aborts, failures and loss than the defaults, so the failure paths run in a small run.
    argv = ["--quick", "--abort-rate", "0.2", "--engine-failure-rate", "0.1", "--drop", "0.01", "--seed", "3"]
    proc = subprocess.run(
        [sys.executable, "-m", "pdkv", "bench", "soak", *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    [record] = [json.loads(line) for line in proc.stdout.splitlines()]
    assert record["bench"] == "soak" and record["rooms"] == 300
    # Liveness and safety: all terminal, nothing leaked, no write after a safe release.
    assert record["rooms_terminal"] == 300
    assert record["rooms_leaked_decode"] == record["rooms_leaked_prefill"] == record["pages_leaked"] == 0
    assert record["canary_violations"] == 0
    # Per-layer rooms went through the real per-layer rules, and no context outlived its room.
    assert record["per_layer_rooms"] > 50 and record["layer_contexts_finished"] > 50
    assert record["layer_contexts_failed"] + record["layer_contexts_dropped"] > 0
    assert record["layer_contexts_leaked"] == 0
    # The faults were really injected and the failure paths taken.
    assert record["aborts_injected"] > 30 and record["engine_failures_injected"] > 10
    assert record["messages_dropped"] > 0 and record["rooms_failed"] > 30
    # Outcomes add up; every decode failure has a cause.
    assert record["rooms_succeeded"] + record["rooms_failed"] == 300
    assert sum(record[f"failed_{c.value}"] for c in FailureCause) == record["rooms_failed"]
    # Injected engine failures are accounted where they happen: the prefill side fails the room with
    # the engine cause (the decode side only hears "aborted by peer"); a room can carry more than one
    # injection, or be aborted before its failing write starts, so at most one per injected room.
    assert 0 < record["prefill_failed_engine"] <= record["engine_failures_injected"]
    # Figures are sane: positive memory, and the rate is rooms over wall time.
    assert record["rss_start_mib"] > 0 and record["rss_warm_mib"] > 0 and record["rss_end_mib"] > 0
    assert record["wall_seconds"] > 0 and record["fake_seconds"] > 0
    assert abs(record["rooms_per_s"] - 300 / record["wall_seconds"]) <= 0.01 * record["rooms_per_s"] + 1
    assert "pdkv bench soak: 300 rooms" in proc.stderr
