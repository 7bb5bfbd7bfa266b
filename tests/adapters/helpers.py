"""Running ``tests.adapters.sglang_child`` scenarios from pytest: plans, processes, results, cleanup.

Owns: starting each SGLang-side process with its plan, waiting for it with a timeout, and stopping it by
pid (terminate, then kill) whatever happens, so a failing test leaves nothing running. Must not import
SGLang (the pytest process stays free of SGLang and its GPU stubs).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

requires_sglang = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None,
    reason="SGLang is not installed (make sglang installs its pinned CPU closure)",
)


class Child:
    """One scenario process; ``result()`` reads what it wrote."""

    def __init__(
        self, scenario: str, plan: dict[str, Any], workdir: Path, env: dict[str, str] | None = None
    ) -> None:
        self.plan_path = workdir / f"{scenario}-plan.json"
        self.result_path = Path(plan["result"])
        self.log_path = workdir / f"{scenario}.log"
        self.plan_path.write_text(json.dumps(plan))
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.adapters.sglang_child", scenario, str(self.plan_path)],
            cwd=REPO,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(
                f"{self.plan_path.stem} did not finish in {timeout_s:g} s:\n{self.log_tail()}"
            ) from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()

    def result(self) -> dict[str, Any]:
        if not self.result_path.exists():
            raise AssertionError(f"{self.plan_path.stem} wrote no result:\n{self.log_tail()}")
        data: dict[str, Any] = json.loads(self.result_path.read_text())
        if "harness_error" in data:
            raise AssertionError(f"{self.plan_path.stem} failed:\n{data['harness_error']}\n{self.log_tail()}")
        return data

    def log_tail(self, chars: int = 4000) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]


@contextmanager
def children() -> Iterator[list[Child]]:
    """Every Child appended to the yielded list is stopped on exit, even when the test fails."""
    started: list[Child] = []
    try:
        yield started
    finally:
        for child in started:
            child.stop()
