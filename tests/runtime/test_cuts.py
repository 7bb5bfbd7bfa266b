"""The decode's connection cuts are coalesced: one cut per prefill host serves every quarantined room
that asked before it began, rooms that ask during a cut get a cut of their own after it, and a cut
that fails fails every room it served (their pages then wait for the settle time)."""

from __future__ import annotations

import threading
import time

from pdkv.errors.engine import ConnectionCutUnavailableError
from pdkv.protocol.effects import CutConnections
from pdkv.protocol.ids import RoomId
from pdkv.runtime._cuts import HostCutter


class Recorder:
    def __init__(self, *, fail: bool = False) -> None:
        self.cuts: list[str] = []
        self.reports: list[tuple[RoomId, bool, str]] = []
        self.first_cut_entered = threading.Event()
        self.release_first_cut = threading.Event()
        self.fail = fail
        self._done = threading.Condition()

    def cut(self, host: str) -> int:
        self.cuts.append(host)
        if len(self.cuts) == 1:
            self.first_cut_entered.set()
            assert self.release_first_cut.wait(10)
        if self.fail:
            raise ConnectionCutUnavailableError("no CAP_NET_ADMIN")
        return 2

    def report(self, effect: CutConnections, ok: bool, reason: str) -> None:
        with self._done:
            self.reports.append((effect.room, ok, reason))
            self._done.notify_all()

    def wait_reports(self, count: int) -> None:
        with self._done:
            assert self._done.wait_for(lambda: len(self.reports) >= count, timeout=10)


def test_rooms_asking_during_a_cut_share_the_next_one_and_each_host_is_cut_once() -> None:
    r = Recorder()
    cutter = HostCutter(r.cut, r.report)
    cutter.request(CutConnections(room=RoomId(1), hosts=("10.0.0.1",)))
    assert r.first_cut_entered.wait(10)
    # Acknowledged while the first cut runs: served by the next cut, together.
    cutter.request(CutConnections(room=RoomId(2), hosts=("10.0.0.1", "10.0.0.2")))
    cutter.request(CutConnections(room=RoomId(3), hosts=("10.0.0.2",)))
    r.release_first_cut.set()
    r.wait_reports(3)
    assert r.cuts == ["10.0.0.1", "10.0.0.1", "10.0.0.2"]  # rooms 2 and 3 cost one cut per host
    assert r.reports == [(RoomId(1), True, ""), (RoomId(2), True, ""), (RoomId(3), True, "")]
    assert cutter.cuts == 3
    deadline = time.monotonic() + 10
    while not cutter.idle():  # the worker retires once nothing is queued
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_failed_cut_fails_every_room_it_served() -> None:
    r = Recorder(fail=True)
    r.release_first_cut.set()
    cutter = HostCutter(r.cut, r.report)
    cutter.request(CutConnections(room=RoomId(5), hosts=("10.0.0.9",)))
    r.wait_reports(1)
    assert r.reports == [(RoomId(5), False, "no CAP_NET_ADMIN")]
