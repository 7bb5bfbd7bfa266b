"""When to start a blocking status wait that spins: after most of a piece's expected transfer time.

Owns: ``CompletionPacer``, one per peer lane: from the bytes of a launched piece and the fastest
recent rate towards that peer, how long the lane's completer may sleep before it calls the engine's
status wait. Must not sleep, read a clock or call an engine: times are parameters (the backend sleeps).

Why: Mooncake's ``get_batch_transfer_status`` spins on a core until the batch ends, and the only
non-spinning check (``transfer_check_status``) looks at the first task of a batch alone. On a host
whose cores also run the engine's own transfer threads (and, over TCP on one machine, the peer),
the spin slows the transfer it waits for (measured with 2 cores: 976 x 72 KiB blocks 69 ms spinning,
57 ms when the wait started near the end). Sleeping through most of the expected time and spinning
for the rest keeps the completion as prompt as a pure spin when the estimate holds.

Small pieces (under ``min_bytes``) take the engine's fixed cost per batch, not bytes over a rate:
over Mooncake's TCP transport on one 2-core machine a batch of a few KiB took 0.2 ms at the median
with the machine otherwise idle (1.6-1.9 ms at the 90th percentile) and about 1.7 ms with 32 rooms
in flight, all of it spun through by the waiting thread: about a quarter of the prefill's CPU per
room in ``pdkv bench control``. Their expected time is the lane's floor: the shortest recent time of
a small piece launched on an idle lane (a decaying minimum). On an idle lane that floor is under
``min_sleep_s`` and nothing changes; under load it is not, and the waits sleep first. A small piece
launched while another was in flight is not slept for (the engine may be running both at once) and
teaches nothing. A piece slept for may
have ended during the sleep, so its time only bounds the floor from above: it can lower the floor,
never raise it (if it could, each wake-up later than the piece's end would raise the floor a little
more, and the sleeps with it).

The estimate errs towards waking early: the rate is the fastest seen recently (a decaying maximum),
the floor the shortest, a piece's transfer is taken to start no earlier than the previous piece of
the lane ended, the sleep covers only ``sleep_fraction`` of the expected time, and pieces expected to
take less than ``min_sleep_s`` are not slept for at all. A sample whose wait started after the
transfer ended would understate the rate and overstate the floor; the decaying maximum and minimum
ignore it until the real figure has moved.
"""

from __future__ import annotations

import math

import attrs


@attrs.frozen(kw_only=True)
class PacingConfig:
    sleep_fraction: float = 0.75
    """Share of the expected transfer time slept before the spinning wait."""
    min_sleep_s: float = 0.0005
    """Shorter sleeps are not worth a wake-up: spin instead."""
    decay: float = 0.9
    """Per sample, the remembered fastest rate decays by this factor (so a slower link is learnt)."""
    min_bytes: int = 64 << 10
    """Pieces smaller than this neither use nor teach the rate (fixed costs dominate them): they are
    expected to take the lane's floor."""
    floor_growth: float = 1.1
    """Per small-piece sample, the remembered floor may grow by this factor (so a slower lane is
    learnt)."""


class CompletionPacer:
    """Per-peer rate memory and the sleep it suggests before waiting for a launched piece."""

    def __init__(self, config: PacingConfig | None = None) -> None:
        self.config = config or PacingConfig()
        self._rate = 0.0  # bytes per second; 0: nothing learnt yet (no sleeping)
        self._floor = 0.0  # seconds of a small piece on an idle lane; 0: nothing learnt yet
        self._previous_end = -math.inf

    @property
    def rate(self) -> float:
        """The remembered fastest rate (bytes/s), 0 before the first sample."""
        return self._rate

    @property
    def floor(self) -> float:
        """The remembered shortest time of a small piece on an idle lane (seconds), 0 before the first
        sample."""
        return self._floor

    def sleep_before_wait(self, nbytes: int, launched_at: float, now: float) -> float:
        """Seconds the completer may sleep at ``now`` before the status wait of a piece of ``nbytes``
        launched at ``launched_at`` (0: wait at once)."""
        if nbytes < self.config.min_bytes:
            if launched_at < self._previous_end:
                return 0.0  # queued behind another piece: the engine may be running both
            started, expected = launched_at, self._floor
        elif self._rate > 0:
            started, expected = max(launched_at, self._previous_end), nbytes / self._rate
        else:
            return 0.0
        if expected <= 0:
            return 0.0
        wake_at = started + self.config.sleep_fraction * expected
        delay = wake_at - now
        return delay if delay >= self.config.min_sleep_s else 0.0

    def completed(self, nbytes: int, launched_at: float, ended_at: float, *, slept: bool = False) -> None:
        """The status wait of the piece returned at ``ended_at`` (success or not); ``slept``: the
        completer slept before that wait (``sleep_before_wait`` said so)."""
        idle = launched_at >= self._previous_end
        started = max(launched_at, self._previous_end)
        self._previous_end = ended_at
        seconds = ended_at - started
        if nbytes < self.config.min_bytes:
            if idle and seconds > 0:
                if self._floor <= 0:
                    self._floor = seconds
                elif slept:
                    # The piece may have ended during the sleep: its time is at most this, so it can
                    # lower the floor but never raise it (else each oversleep would ratchet it up).
                    self._floor = min(self._floor, seconds)
                else:
                    self._floor = min(seconds, self._floor * self.config.floor_growth)
            return
        if seconds <= 0:
            return
        self._rate = max(nbytes / seconds, self._rate * self.config.decay)
