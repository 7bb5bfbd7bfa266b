"""The README's claim, end to end: ``pdkv demo`` writes JSON logs and ``pdkv trace`` draws one of
its aborted rooms across every rank, each Abort answered by an AbortAck before the release."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``python -m pdkv ARGS`` in its own process group; on timeout, kill the whole group."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    env.pop("PDKV_LOG_JSON", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdkv", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"pdkv {args} did not finish in {timeout} s:\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow
def test_trace_of_a_room_the_demo_aborted(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    demo = run(["demo", "--rooms", "8", "--json", "--log-dir", str(logs)], timeout=240)
    assert demo.returncode == 0, demo.stderr[-3000:]
    rows = [json.loads(line) for line in demo.stdout.splitlines() if line.startswith('{"room"')]
    aborted = [r["room"] for r in rows if r["abort"] == "decode" and r["outcome"] == "failed"]
    assert aborted, rows
    assert list(logs.glob("pdkv-*.jsonl"))  # one JSON log per rank process
    trace = run(["trace", str(aborted[0]), str(logs)], timeout=60)
    assert trace.returncode == 0, trace.stderr
    lines = trace.stdout.splitlines()
    lanes = dict(re.findall(r"^  participant (R\d+) as (.+)$", trace.stdout, flags=re.M))
    assert sorted(lanes.values()) == ["decode-0 tp0 cp0", "prefill-0 tp0 cp0", "prefill-0 tp0 cp1"]
    decode = next(lane for lane, name in lanes.items() if name.startswith("decode"))
    for lane in lanes:
        if lane == decode:
            continue
        abort = next(
            i for i, x in enumerate(lines) if x.startswith(f"  {decode}->>{lane}: ") and " Abort " in x
        )
        assert any(x.startswith(f"  {lane}->>{decode}: ") and "AbortAck" in x for x in lines[abort:]), lane
    acks = [i for i, x in enumerate(lines) if "AbortAck" in x]
    release = next(i for i, x in enumerate(lines) if re.search(r"pages released \((acked|settled|cut)\)", x))
    assert release > max(acks)
