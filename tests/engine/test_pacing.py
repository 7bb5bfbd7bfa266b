"""CompletionPacer: how long a lane's completer sleeps before Mooncake's spinning status wait.

Pure arithmetic on given times: nothing is slept or timed here.
"""

from __future__ import annotations

import pytest

from pdkv.engine._pacing import CompletionPacer, PacingConfig

MB = 1 << 20


def test_nothing_learnt_means_no_sleep() -> None:
    pacer = CompletionPacer()
    assert pacer.rate == 0
    assert pacer.sleep_before_wait(64 * MB, launched_at=0.0, now=0.0) == 0.0


def test_sleeps_a_fraction_of_the_expected_time_from_launch() -> None:
    pacer = CompletionPacer(PacingConfig(sleep_fraction=0.5, min_sleep_s=0.0005))
    pacer.completed(100 * MB, launched_at=0.0, ended_at=0.1)  # 1,000 MB/s
    assert pacer.rate == pytest.approx(1000 * MB)
    # 50 MB expected to take 50 ms from its launch at t=1: sleep until 25 ms after launch.
    assert pacer.sleep_before_wait(50 * MB, launched_at=1.0, now=1.005) == pytest.approx(0.020)
    # Already past the wake-up time: wait at once.
    assert pacer.sleep_before_wait(50 * MB, launched_at=1.0, now=1.030) == 0.0


def test_a_piece_queued_behind_the_previous_one_starts_when_that_one_ended() -> None:
    pacer = CompletionPacer(PacingConfig(sleep_fraction=1.0))
    pacer.completed(10 * MB, launched_at=0.0, ended_at=0.01)  # 1,000 MB/s, lane busy until 0.01
    pacer.completed(10 * MB, launched_at=0.0, ended_at=0.02)  # started at 0.01: the same rate
    assert pacer.rate == pytest.approx(1000 * MB)
    # Launched at 0.0 too, but the lane was busy until 0.02: expected to end at 0.03.
    assert pacer.sleep_before_wait(10 * MB, launched_at=0.0, now=0.02) == pytest.approx(0.01)


def test_short_expected_waits_and_small_pieces_spin() -> None:
    pacer = CompletionPacer(PacingConfig(min_sleep_s=0.001, min_bytes=MB))
    pacer.completed(100 * MB, launched_at=0.0, ended_at=0.1)
    assert pacer.sleep_before_wait(MB, launched_at=0.2, now=0.2) == 0.0  # 1 ms x 0.75 < min sleep
    assert pacer.sleep_before_wait(MB // 2, launched_at=0.2, now=0.2) == 0.0  # below min_bytes
    before = pacer.rate
    pacer.completed(MB // 2, launched_at=0.2, ended_at=0.9)  # tiny and slow: teaches nothing
    assert pacer.rate == before


def test_the_fastest_recent_rate_is_kept_and_decays_towards_a_slower_link() -> None:
    pacer = CompletionPacer(PacingConfig(decay=0.5))
    pacer.completed(100 * MB, launched_at=0.0, ended_at=0.1)  # 1,000 MB/s
    pacer.completed(100 * MB, launched_at=1.0, ended_at=1.4)  # 250 MB/s (or a late wait): ignored...
    assert pacer.rate == pytest.approx(500 * MB)  # ...except for the decay
    pacer.completed(100 * MB, launched_at=2.0, ended_at=2.4)
    assert pacer.rate == pytest.approx(250 * MB)  # the slower link is learnt


def test_times_going_backwards_teach_nothing_and_never_give_a_negative_sleep() -> None:
    pacer = CompletionPacer()
    pacer.completed(10 * MB, launched_at=5.0, ended_at=5.0)
    assert pacer.rate == 0
    pacer.completed(10 * MB, launched_at=5.0, ended_at=5.01)
    assert pacer.sleep_before_wait(10 * MB, launched_at=0.0, now=100.0) == 0.0
