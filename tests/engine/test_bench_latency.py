"""`pdkv bench latency --quick`: both transports and the raw engine across processes, well-formed JSON.

A prefill transport in this process and a decode transport in a spawned one move real bytes over
Mooncake TCP on 127.0.0.1. Figures are only checked for shape and consistency, never for speed.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

from pdkv.bench import latency

pytestmark = pytest.mark.slow


def test_latency_bench_quick(capsys: pytest.CaptureFixture[str]) -> None:
    interval = sys.getswitchinterval()
    assert (
        latency.main(
            ["--quick", "--ab-pacing", "--ab-workers", "--load-threads", "1", "--switch-interval-us", "1000"]
        )
        == 0
    )
    assert sys.getswitchinterval() == interval  # the bench's setting does not outlive it
    assert not [t for t in threading.enumerate() if t.name.startswith("pdkv-bench-load")]
    records: list[dict[str, Any]] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    sizes = [r for r in records if r["kind"] == "size"]
    (summary,) = [r for r in records if r["kind"] == "summary"]
    assert summary == {"bench": "latency", "kind": "summary", "verified": True, "failures": []}
    assert sorted((r["pages"], r["variant"]) for r in sizes) == [
        (1, "pdkv"),
        (1, "pdkv-spin"),
        (1, "pdkv-workers"),
        (4, "pdkv"),
        (4, "pdkv-spin"),
        (4, "pdkv-workers"),
    ]
    for r in sizes:
        assert r["rounds"] == 2 and r["layers"] == 4
        assert r["load_threads"] == 1 and r["switch_interval_us"] == pytest.approx(1000)
        assert r["bytes"] == r["pages"] * 4 * 64 * 1152
        seconds = r["seconds"]
        for method in ("pdkv_prefill_success", "pdkv_decode_success", "raw_one_batch", "raw_best_shape"):
            assert 0 < seconds[method]["min"] <= seconds[method]["median"]
        assert r["pdkv_vs_one_batch"] == pytest.approx(
            seconds["raw_one_batch"]["median"] / seconds["pdkv_prefill_success"]["median"]
        )
        assert set(r["phases_ms"]) == set(r["phase_means_ms"]) == set(latency.PHASES)
        # Every phase was observed (none missing), and none is negative.
        assert all(math.isfinite(v) and v >= 0 for v in r["phases_ms"].values())
        # The CPU of the phases that stay on one prefill thread: the scheduler's call and the worker's
        # planning and status step always do; one thread's CPU never exceeds the time it took.
        cpu = r["phase_cpu_ms"]
        assert {"scheduler_call", "plan", "status_sent"} <= set(cpu) <= set(latency.CPU_PHASES)
        for name, value in cpu.items():
            assert 0 <= value <= r["phases_ms"][name] + 0.05, name
    # The hand-offs of every size and variant were counted along the whole path: the scheduler's
    # send() first, the decode scheduler last, the engine's threads between (2 crossings: the
    # default stream channel has no thread of its own on the way; zmq's added 3).
    hand_offs = [r for r in records if r["kind"] == "hand_offs"]
    assert sorted((r["pages"], r["variant"]) for r in hand_offs) == sorted(
        (r["pages"], r["variant"]) for r in sizes
    )
    for r in hand_offs:
        assert r["rooms"] == 2 and r["native_p50"] == 2 and r["channel"] == "stream"
        assert (
            r["total_min"] <= r["total_p50"] <= r["total_max"] and r["total_p50"] >= r["to_decode_p50"] >= 3
        )
        steps = [step for step, _ in r["path"]]
        assert steps[0] == "send()" and steps[-1] == "decode poll sees Success"
        assert r["path"][0][1].endswith("/MainThread") and r["path"][-1][1].endswith("/MainThread")
        assert r["path"][0][1] != r["path"][-1][1]  # two processes
        if r["variant"] == "pdkv-workers":  # no chunk runs on a waiting scheduler: a worker plans it
            assert "/pdkv-transfer-" in dict(r["path"])["plan"]
    # The counted rooms (the pdkv variant; both quick sizes run on the waiting scheduler): every
    # phase made calls, and the total is their sum.
    calls = [r for r in records if r["kind"] == "calls"]
    assert sorted(r["pages"] for r in calls) == [1, 4]
    for r in calls:
        assert r["rooms"] == latency.CALL_ROOMS and r["variant"] == "pdkv"
        assert set(r["phase_calls"]) == set(latency.COUNTED_PHASES)
        assert all(n > 0 for n in r["phase_calls"].values()), r
        assert r["calls_per_room"] == pytest.approx(sum(r["phase_calls"].values()), rel=0.2)


def test_pages_are_placed_in_runs_on_both_sides() -> None:
    rng = np.random.default_rng(3)
    src, dst = latency.place_pages(512, 0.7, 16, rng)
    for side in (src, dst):
        assert sorted(side.tolist()) == list(range(512))  # a permutation of the pool
    blocks = latency.run_blocks(src, dst, [0, 1 << 40], [0, 1 << 40], 100)
    assert blocks.total_bytes == 2 * 512 * 100
    per_layer = len(blocks) // 2
    # 30% single pages plus runs of 2-16: far fewer blocks than pages, far more than one.
    assert 512 * 0.3 < per_layer < 512 * 0.3 + 0.7 * 512 / 2 + 2
    assert latency.shapes_for(61)[-1] == latency.RawShape(61, 1)
    assert all(s.entries <= 61 for s in latency.shapes_for(61))


def test_a_phase_s_cpu_is_its_thread_s_own_and_unknown_when_another_thread_ends_it() -> None:
    timeline = latency.Timeline()
    timeline.mark("busy_start")
    spin_until = time.monotonic() + 0.03
    while time.monotonic() < spin_until:
        pass
    timeline.mark("busy_end")
    timeline.mark("idle_start")
    time.sleep(0.03)
    timeline.mark("idle_end")
    elsewhere = threading.Thread(target=timeline.mark, args=("other_end",))
    elsewhere.start()
    elsewhere.join()
    assert 0.02 <= timeline.cpu("busy_start", "busy_end") <= 0.04
    assert timeline.cpu("idle_start", "idle_end") < 0.01  # a wait costs its thread nothing
    assert math.isnan(timeline.cpu("busy_start", "other_end"))  # another thread's clock
    assert math.isnan(timeline.cpu("busy_start", "never_marked"))
    assert math.isnan(timeline.cpu("busy_end", "busy_start"))  # an end before its start


def test_calls_are_counted_per_phase_on_the_marking_thread_without_the_bench_s_own() -> None:
    timeline = latency.Timeline()
    counter = latency.CallCounter()
    timeline.listener = counter.marked

    def work() -> None:
        pass

    elsewhere = threading.Thread(target=timeline.mark, args=("plan_end",))  # another thread's mark
    elsewhere.start()
    elsewhere.join()
    counter.start()
    try:
        timeline.mark("send_call")
        for _ in range(5):
            work()
        latency._stats([1.0, 2.0])  # the bench's own code, and what it calls: not counted
        timeline.mark("plan_start")
        for _ in range(3):
            work()
        timeline.mark("status_sent")  # the count stops
        for _ in range(7):
            work()
    finally:
        counter.stop()
    assert counter.calls["scheduler_call"] == 5
    assert counter.calls["plan"] == 3
    assert sum(counter.calls.values()) == 8
    assert not counter.complete  # the other thread's plan_end began no phase of this thread
    for name in ("send_returned", "plan_end", "launch", "engine_done", "wait_returned"):
        timeline.mark(name)
    assert counter.complete
