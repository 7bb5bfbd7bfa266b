"""The cluster harness's scheduler pause (``pdkv.testing.cluster._rank.pause``): between two passes over
its rooms a rank's loop waits for its transport's progress, never longer than ``STEP_S``, whatever the
number of rooms active (the loops of ``prefill_rank`` and ``decode_rank`` call it after every pass).

A stand-in transport keeps progress as the transports do (a counter; ``wait_progress`` returns once it
passed what the caller saw) and records each wait; ``time.sleep`` is refused, so a pause that paces the
loop by the clock instead of by progress fails whatever the machine's speed.
"""

from __future__ import annotations

import threading
import time

import pytest

from pdkv.testing.cluster._rank import STEP_S, pause


class ProgressOnly:
    """Progress as ``PrefillTransport`` / ``DecodeTransport`` count it, and every wait asked of it."""

    def __init__(self) -> None:
        self._progressed = threading.Condition()
        self._count = 0
        self.waits: list[tuple[int, float]] = []
        self.ended_by_progress = 0

    def progress(self) -> int:
        return self._count

    def advance(self) -> None:
        with self._progressed:
            self._count += 1
            self._progressed.notify_all()

    def wait_progress(self, seen: int, timeout_s: float) -> int:
        with self._progressed:
            self.waits.append((seen, timeout_s))
            if self._progressed.wait_for(lambda: self._count != seen, timeout_s):
                self.ended_by_progress += 1
            return self._count


@pytest.fixture(autouse=True)
def no_clock_pacing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(seconds: float) -> None:
        raise AssertionError(f"the scheduler slept {seconds} s instead of waiting for progress")

    monkeypatch.setattr(time, "sleep", refuse)


def test_a_change_during_the_pass_ends_the_pause_at_once() -> None:
    transport = ProgressOnly()
    seen = transport.progress()  # read before the pass, as the ranks do
    transport.advance()  # a message handled while the loop polled its rooms
    pause(transport, seen)
    assert transport.waits == [(seen, STEP_S)]
    assert transport.ended_by_progress == 1


def test_without_progress_the_pause_ends_after_the_step() -> None:
    transport = ProgressOnly()
    seen = transport.progress()
    pause(transport, seen)  # nothing changed: back after STEP_S, for the driver's pipe and the clock
    assert transport.waits == [(seen, STEP_S)] and transport.ended_by_progress == 0
    assert 0 < STEP_S <= 0.001
