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
    assert pacer.sleep_before_wait(MB // 2, launched_at=0.2, now=0.2) == 0.0  # small, no floor learnt
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


def test_small_pieces_sleep_through_most_of_the_lane_floor_from_their_launch() -> None:
    pacer = CompletionPacer(PacingConfig(sleep_fraction=0.5, min_sleep_s=0.0001, min_bytes=MB))
    pacer.completed(2048, launched_at=0.0, ended_at=0.001)  # a small piece on an idle lane: 1 ms
    assert pacer.floor == pytest.approx(0.001)
    assert pacer.rate == 0  # small pieces never teach the rate
    # Bytes do not matter below min_bytes: the floor is the whole expectation.
    assert pacer.sleep_before_wait(10, launched_at=1.0, now=1.0) == pytest.approx(0.0005)
    assert pacer.sleep_before_wait(MB - 1, launched_at=1.0, now=1.0002) == pytest.approx(0.0003)
    assert pacer.sleep_before_wait(2048, launched_at=1.0, now=1.00045) == 0.0  # under min_sleep_s left
    # A large piece still needs a rate: none learnt, so no sleep.
    assert pacer.sleep_before_wait(MB, launched_at=1.0, now=1.0) == 0.0


def test_a_small_piece_queued_behind_another_neither_sleeps_nor_teaches_the_floor() -> None:
    pacer = CompletionPacer(PacingConfig(sleep_fraction=1.0, min_sleep_s=0.0, min_bytes=MB))
    pacer.completed(2048, launched_at=0.0, ended_at=0.002)  # floor 2 ms
    # Launched while the previous piece was in flight: the engine may run both, so wait at once.
    assert pacer.sleep_before_wait(2048, launched_at=0.001, now=0.002) == 0.0
    # Its short time (0.1 ms after the previous end) is not a floor sample.
    pacer.completed(2048, launched_at=0.001, ended_at=0.0021)
    assert pacer.floor == pytest.approx(0.002)


def test_the_floor_is_the_shortest_recent_time_and_grows_towards_a_slower_lane() -> None:
    pacer = CompletionPacer(PacingConfig(floor_growth=2.0, min_bytes=MB))
    pacer.completed(2048, launched_at=0.0, ended_at=0.004)
    pacer.completed(2048, launched_at=1.0, ended_at=1.001)  # faster: taken at once
    assert pacer.floor == pytest.approx(0.001)
    pacer.completed(2048, launched_at=2.0, ended_at=2.010)  # slower (or a late wait): growth only
    assert pacer.floor == pytest.approx(0.002)
    pacer.completed(2048, launched_at=3.0, ended_at=3.010)
    pacer.completed(2048, launched_at=4.0, ended_at=4.010)
    assert pacer.floor == pytest.approx(0.008)
    pacer.completed(2048, launched_at=5.0, ended_at=5.010)
    assert pacer.floor == pytest.approx(0.010)  # the slower lane is learnt, never overshot


def test_a_piece_slept_for_can_lower_the_floor_but_never_raise_it() -> None:
    # It may have ended during the sleep: a wake-up after its end says nothing about the floor.
    pacer = CompletionPacer(
        PacingConfig(sleep_fraction=0.75, min_sleep_s=0.0, floor_growth=1.5, min_bytes=MB)
    )
    pacer.completed(2048, launched_at=0.0, ended_at=0.002)  # floor 2 ms
    for start in (1.0, 2.0, 3.0):  # each sleeps 1.5 ms, wakes 1 ms late: 2.5 ms measured
        assert pacer.sleep_before_wait(2048, launched_at=start, now=start) == pytest.approx(0.0015)
        pacer.completed(2048, launched_at=start, ended_at=start + 0.0025, slept=True)
    assert pacer.floor == pytest.approx(0.002)
    pacer.completed(2048, launched_at=4.0, ended_at=4.0018, slept=True)
    assert pacer.floor == pytest.approx(0.0018)
    pacer.completed(2048, launched_at=5.0, ended_at=5.0025)  # not slept for: may raise it (x1.5 at most)
    assert pacer.floor == pytest.approx(0.0025)
