"""A sleeping thread's alarm clock: the moment it must look again, set by other threads; on Linux
without waking it before that moment.

Owns: ``AlarmClock`` (what a peer lane's completer sleeps on, ``pdkv.engine._threaded``), ``new_alarm``
(the best one this platform has), ``TimerFdAlarm`` (Linux: a timerfd the sleeper polls) and
``ConditionAlarm`` (anywhere: a condition variable). Must not know what the sleeper waits for: every
call is made with the owner's lock held, and the owner's state, read after waking, says what to do.

Why a timer and not only a condition: a completer must take a piece launched inline if its submitter
has not come to complete it by the end of a hold, and must not be woken at all when the submitter does
come (a woken thread takes the interpreter lock from the one doing the work). A thread asleep on a
condition can only be given a deadline by waking it, so that it sleeps again with a timeout; a timerfd
is given one by the setter (one system call, the interpreter lock kept: ctypes ``PyDLL``) and wakes the
sleeper only when the moment comes. ``ConditionAlarm`` keeps the same rules where there is no timerfd,
at the cost of that one wake-up per deadline set.
"""

from __future__ import annotations

import ctypes
import math
import os
import select
import sys
import threading
import time
from typing import Protocol

ALARM_NOW = 0.0
"""A moment that has passed: ``ring_at(ALARM_NOW)`` wakes the sleeper at once (``ring``)."""


class AlarmClock(Protocol):
    """When the sleeper must look again (``time.monotonic()`` seconds). Every call is made under the
    owner's lock, and calls made while the sleeper is awake change nothing: it reads its owner's state,
    under that lock, before it sleeps again, and passes ``sleep`` the moment that state needs."""

    @property
    def wakes(self) -> int:
        """How often the sleeper woke up (returned from the system's wait), the needless times included."""
        ...

    def ring_at(self, at: float) -> None:
        """Wake the sleeper at ``at`` at the latest (a moment later than the one set changes nothing)."""
        ...

    def ring(self) -> None:
        """Wake the sleeper now: there is something for it to do."""
        ...

    def disarm(self) -> None:
        """Forget the moment set: what it was set for is gone (the sleeper needs nothing now)."""
        ...

    def sleep(self, until: float = math.inf) -> None:
        """The sleeper's wait (owner's lock held): release the lock, sleep until ``until`` or an earlier
        moment set meanwhile (forever when neither), take the lock again."""
        ...

    def close(self) -> None:
        """The sleeper is gone: release what the alarm holds; every later call does nothing."""
        ...


class ConditionAlarm:
    """An alarm on a condition variable of the owner's lock: a moment set while the thread sleeps wakes
    it, and it sleeps again with that moment as its timeout (one needless wake-up per moment set)."""

    def __init__(self, lock: threading.Lock) -> None:
        self._condition = threading.Condition(lock)
        self._at = math.inf
        self._asleep = False
        self._wakes = 0

    @property
    def wakes(self) -> int:
        return self._wakes

    def ring_at(self, at: float) -> None:
        if self._asleep and at < self._at:
            self._at = at
            self._condition.notify()

    def ring(self) -> None:
        self.ring_at(ALARM_NOW)

    def disarm(self) -> None:
        if self._asleep:
            self._at = math.inf  # a sleeper in a timed wait wakes at the old moment, finds none, sleeps on

    def sleep(self, until: float = math.inf) -> None:
        self._asleep, self._at = True, until
        try:
            while (left := self._at - time.monotonic()) > 0:
                self._condition.wait(None if math.isinf(left) else left)
                self._wakes += 1
        finally:
            self._asleep, self._at = False, math.inf

    def close(self) -> None:
        self._asleep = False  # nobody sleeps on it any more: no later call notifies


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


_TFD_TIMER_ABSTIME = 1


class _TimerFd:
    """``timerfd_create`` / ``timerfd_settime`` through ctypes (Python has them only from 3.13)."""

    def __init__(self) -> None:
        # PyDLL: the interpreter lock stays held across the call. These calls never block, and releasing
        # the lock would let a waiting thread take it: the very hand-off the timer exists to avoid.
        libc = ctypes.PyDLL(None, use_errno=True)
        self._create = libc.timerfd_create
        self._create.argtypes = [ctypes.c_int, ctypes.c_int]
        self._create.restype = ctypes.c_int
        self._settime = libc.timerfd_settime
        self._settime.argtypes = [
            ctypes.c_int,
            ctypes.c_int,
            ctypes.POINTER(_Itimerspec),
            ctypes.POINTER(_Itimerspec),
        ]
        self._settime.restype = ctypes.c_int

    def create(self) -> int:
        # TFD_NONBLOCK and TFD_CLOEXEC are O_NONBLOCK and O_CLOEXEC by definition (linux/timerfd.h).
        fd = int(self._create(time.CLOCK_MONOTONIC, os.O_NONBLOCK | os.O_CLOEXEC))
        if fd < 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"timerfd_create: {os.strerror(errno)}")
        return fd

    def set(self, fd: int, at: float | None) -> None:
        """Expire at monotonic time ``at`` (a moment passed: at once), or disarm (None). Either way the
        expirations not yet read are dropped (the kernel resets them), so the fd is not readable after
        a disarm."""
        spec = _Itimerspec()
        if at is not None:
            # An all-zero it_value disarms: a moment passed is given as 1 ns after the clock's start.
            nanos = max(1, int(at * 1e9))
            spec.it_value.tv_sec, spec.it_value.tv_nsec = divmod(nanos, 1_000_000_000)
        if self._settime(fd, _TFD_TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"timerfd_settime: {os.strerror(errno)}")


def _load_timerfd() -> _TimerFd | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        timerfd = _TimerFd()
        os.close(timerfd.create())  # the kernel may refuse (seccomp, ancient kernels): then a condition
    except (OSError, AttributeError):
        return None
    return timerfd


_timerfd = _load_timerfd()


class TimerFdAlarm:
    """An alarm on a timerfd: the thread sleeps polling it; a moment set meanwhile arms the timer and
    wakes the sleeper only when it expires (at once for ``ring``)."""

    def __init__(self, lock: threading.Lock, timerfd: _TimerFd) -> None:
        self._lock = lock
        self._timerfd = timerfd
        self._fd = timerfd.create()
        self._poll = select.poll()
        self._poll.register(self._fd, select.POLLIN)
        self._at = math.inf
        self._asleep = False
        self._wakes = 0
        self._closed = False

    @property
    def wakes(self) -> int:
        return self._wakes

    def ring_at(self, at: float) -> None:
        if self._asleep and at < self._at:
            self._at = at
            self._timerfd.set(self._fd, at)

    def ring(self) -> None:
        self.ring_at(ALARM_NOW)

    def disarm(self) -> None:
        if self._asleep and not math.isinf(self._at):
            self._at = math.inf
            self._timerfd.set(self._fd, None)

    def sleep(self, until: float = math.inf) -> None:
        # Set (or disarmed) before every sleep, which also drops an expiry left from the last one: a
        # moment set between that expiry and the sleeper taking the lock again had passed too.
        self._timerfd.set(self._fd, None if math.isinf(until) else until)
        self._asleep, self._at = True, until
        self._lock.release()
        try:
            self._poll.poll()  # until the timer expires; the interpreter lock is released meanwhile
        finally:
            self._lock.acquire()
            self._asleep, self._at = False, math.inf
        self._wakes += 1

    def close(self) -> None:
        if not self._closed:
            self._closed = True  # before the fd goes: its number may be reused by another file at once
            self._asleep = False
            self._poll.unregister(self._fd)
            os.close(self._fd)


def new_alarm(lock: threading.Lock) -> AlarmClock:
    """A timerfd alarm where the platform has timerfds, else a condition alarm; ``lock``: the owner's."""
    if _timerfd is not None:
        return TimerFdAlarm(lock, _timerfd)
    return ConditionAlarm(lock)
