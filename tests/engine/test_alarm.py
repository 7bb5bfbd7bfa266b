"""The sleeping thread's alarm clock (``pdkv.engine._alarm``): both kinds wake the sleeper at the moment
set and not before, an earlier moment wins, a disarmed alarm wakes it only when rung; the timerfd kind
is set without waking the sleeper, which is what the lanes' completers rely on.

Each test runs the sleeper on a thread of its own and the setter on the test's thread, as a lane's
submitter and completer do; moments are tens of milliseconds apart, so a loaded machine shifts when the
sleeper wakes but not how often.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from pdkv.engine import _alarm
from pdkv.engine._alarm import AlarmClock, ConditionAlarm, TimerFdAlarm

needs_timerfd = pytest.mark.skipif(_alarm._timerfd is None, reason="no timerfd on this platform")


def _timerfd_alarm(lock: threading.Lock) -> AlarmClock:
    assert _alarm._timerfd is not None
    return TimerFdAlarm(lock, _alarm._timerfd)


KINDS: dict[str, Callable[[threading.Lock], AlarmClock]] = {
    "timerfd": _timerfd_alarm,
    "condition": ConditionAlarm,
}


class Sleeper:
    """One thread that sleeps on the alarm once and records when it returned."""

    def __init__(self, make: Callable[[threading.Lock], AlarmClock]) -> None:
        self.lock = threading.Lock()
        self.alarm = make(self.lock)
        self.asleep = threading.Event()
        self.woke_at: float | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self, until: float = math.inf) -> None:
        self._until = until
        self._thread.start()
        assert self.asleep.wait(5)
        with self.lock:  # free once the sleeper is in the system's wait
            pass

    def _run(self) -> None:
        with self.lock:
            self.asleep.set()
            self.alarm.sleep(self._until)
            self.woke_at = time.monotonic()

    def join(self) -> float:
        """When it woke (it must have)."""
        self._thread.join(5)
        assert not self._thread.is_alive() and self.woke_at is not None
        return self.woke_at

    def set(self, action: Callable[[AlarmClock], None]) -> None:
        with self.lock:
            action(self.alarm)


@pytest.fixture(params=sorted(KINDS))
def kind(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "timerfd" and _alarm._timerfd is None:
        pytest.skip("no timerfd on this platform")
    yield request.param


def test_the_sleepers_own_moment_wakes_it_then_and_not_before(kind: str) -> None:
    sleeper = Sleeper(KINDS[kind])
    at = time.monotonic() + 0.08
    sleeper.start(until=at)
    assert sleeper.join() >= at
    assert sleeper.alarm.wakes == 1


def test_ring_wakes_a_sleeper_with_no_moment_set(kind: str) -> None:
    sleeper = Sleeper(KINDS[kind])
    sleeper.start()
    rung = time.monotonic()
    sleeper.set(lambda alarm: alarm.ring())
    assert sleeper.join() >= rung
    assert sleeper.alarm.wakes == 1


def test_an_earlier_moment_wins_and_a_later_one_changes_nothing(kind: str) -> None:
    sleeper = Sleeper(KINDS[kind])
    late = time.monotonic() + 5.0
    sleeper.start(until=late)
    early = time.monotonic() + 0.05
    sleeper.set(lambda alarm: alarm.ring_at(early))
    sleeper.set(lambda alarm: alarm.ring_at(early + 10.0))  # later than the one set: ignored
    assert early <= sleeper.join() < late


def test_a_disarmed_alarm_wakes_the_sleeper_only_when_rung(kind: str) -> None:
    sleeper = Sleeper(KINDS[kind])
    sleeper.start()
    soon = time.monotonic() + 0.03
    sleeper.set(lambda alarm: alarm.ring_at(soon))
    sleeper.set(lambda alarm: alarm.disarm())
    time.sleep(0.1)  # well past the moment that was disarmed
    assert sleeper.woke_at is None
    sleeper.set(lambda alarm: alarm.ring())
    assert sleeper.join() >= soon + 0.05


@needs_timerfd
def test_a_timerfd_alarm_is_set_without_waking_the_sleeper() -> None:
    sleeper = Sleeper(KINDS["timerfd"])
    sleeper.start()
    at = time.monotonic() + 0.08
    sleeper.set(lambda alarm: alarm.ring_at(at))
    assert sleeper.join() >= at
    assert sleeper.alarm.wakes == 1  # only when the moment came


def test_a_condition_alarm_pays_one_wake_up_for_a_moment_set_while_it_sleeps() -> None:
    # The cost the timerfd kind exists to avoid, stated so that the difference stays visible.
    sleeper = Sleeper(KINDS["condition"])
    sleeper.start()
    at = time.monotonic() + 0.08
    sleeper.set(lambda alarm: alarm.ring_at(at))
    assert sleeper.join() >= at
    assert sleeper.alarm.wakes == 2


def test_calls_while_the_sleeper_is_awake_change_nothing_and_a_closed_alarm_ignores_every_call(
    kind: str,
) -> None:
    lock = threading.Lock()
    alarm = KINDS[kind](lock)
    with lock:
        alarm.sleep(until=time.monotonic())  # a moment passed: back at once
        alarm.ring()  # while awake: the owner's state, read before the next sleep, says it all
        started = time.monotonic()
        alarm.sleep(until=started + 0.05)  # neither that ring nor the first expiry ends this one
        assert time.monotonic() >= started + 0.05
        assert alarm.wakes == (1 if kind == "timerfd" else 0) + 1
        alarm.close()
        alarm.ring()
        alarm.ring_at(time.monotonic())
        alarm.disarm()
        alarm.close()
