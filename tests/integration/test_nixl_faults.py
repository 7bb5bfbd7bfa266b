"""A NIXL peer killed in the middle of a write, then the sender torn down, in a process of its own
(tests/integration/nixl_peer_killed.py) so that an abort inside UCX shows as its exit status: the write
and the next one fail, the teardown returns, the process exits 0. The control runs the raw agent
sequence NixlBackend never reaches (a standalone notification queued to the dead peer) and sees UCX
abort the process: the check can fail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    """The case in a child that starts with no ``UCX_*`` / ``NIXL_*`` settings: a NixlBackend made
    earlier in this process wrote its own into ``os.environ`` (UCX reads them from there), and a
    child inheriting ``UCX_TLS=tcp`` from another test ran the control on other transports (it then
    missed the abort in all its attempts)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "NIXL_"))}
    return subprocess.run(
        [sys.executable, "-m", "tests.integration.nixl_peer_killed", *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env=env,
    )


@pytest.mark.parametrize("tls", ["all", "tcp"])
def test_peer_killed_mid_write_fails_the_batches_and_teardown_survives(tls: str) -> None:
    done = _run("backend", tls)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["first"] == "failed", report  # killed 5 ms into a 256 MiB write
    assert report["first_s"] < 30, report  # a failure, not the transfer timeout
    assert report["second"] == "failed", report  # posting to the dead peer fails at once


def test_control_the_sequence_pdkv_avoids_aborts_the_process() -> None:
    done = _run("raw-notify")
    assert done.returncode == -signal.SIGABRT, (done.returncode, done.stderr[-2000:])
    assert "ucs_arbiter_group_is_empty" in done.stderr + done.stdout
