"""TransportMetrics: exact totals under concurrent recording, frozen JSON-ready snapshots, counters
that only go up, and dummy senders that report nothing."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator

import attrs
import pytest

from pdkv.metrics import (
    CounterValues,
    KVTransferMetric,
    MetricValueError,
    TransportCounter,
    TransportMetrics,
)


@pytest.fixture
def fast_thread_switches() -> Iterator[None]:
    # switch threads every microsecond so unsynchronised read-modify-writes would interleave
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(previous)


def _room(room: int, *, pages: int = 4, page_bytes: int = 1024, seconds: float = 0.01) -> KVTransferMetric:
    return KVTransferMetric(room=room, pages=pages, bytes=pages * page_bytes, seconds=seconds)


@pytest.mark.usefixtures("fast_thread_switches")
def test_concurrent_recording_loses_nothing() -> None:
    metrics = TransportMetrics()
    threads_n, rooms_per_thread = 8, 2_000
    start = threading.Barrier(threads_n + 1)

    def worker(index: int) -> None:
        start.wait()
        for room in range(rooms_per_thread):
            metrics.record_room(
                _room(room, pages=index + 1, seconds=0.001 * (index + 1)), f"prefill-{index % 2}"
            )
            metrics.increment(TransportCounter.CHUNKS_SENT)
            metrics.increment(TransportCounter.ROOMS_SUCCEEDED, 2)

    def reader(stop: threading.Event, seen: list[int]) -> None:
        start.wait()
        while not stop.is_set():
            seen.append(metrics.snapshot().counters.chunks_sent)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(threads_n)]
    stop, seen = threading.Event(), list[int]()
    snapshotter = threading.Thread(target=reader, args=(stop, seen))
    for t in [*threads, snapshotter]:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    snapshotter.join()

    snap = metrics.snapshot()
    rooms = threads_n * rooms_per_thread
    pages = rooms_per_thread * sum(i + 1 for i in range(threads_n))
    assert snap.counters.chunks_sent == rooms
    assert snap.counters.rooms_succeeded == 2 * rooms
    assert snap.counters.pages_sent == pages
    assert snap.counters.bytes_sent == pages * 1024
    assert snap.peer_names() == ("prefill-0", "prefill-1")
    assert snap.latency("prefill-0").count == snap.latency("prefill-1").count == rooms // 2
    # even-numbered workers (seconds 0.001, 0.003, ...) went to prefill-0: its slowest is worker 6's
    assert snap.latency("prefill-0").max == pytest.approx(0.007)
    assert snap.latency("prefill-1").max == pytest.approx(0.008)
    # a reader racing the writers only ever saw a counter go up
    assert seen == sorted(seen)


def test_snapshot_is_frozen_and_detached_from_later_records() -> None:
    metrics = TransportMetrics()
    metrics.record_room(_room(1, seconds=0.2), "decode-0")
    snap = metrics.snapshot()
    metrics.record_room(_room(2, seconds=5.0), "decode-0")
    metrics.increment(TransportCounter.TIMEOUTS)
    assert snap.counters.timeouts == 0
    assert snap.latency("decode-0").count == 1
    assert snap.latency("decode-0").max == 0.2
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        snap.counters.bytes_sent = 0  # type: ignore[misc]  # proving it is refused
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        snap.peers = ()  # type: ignore[misc]  # proving it is refused
    assert isinstance(snap.peers, tuple)


def test_snapshot_round_trips_through_json() -> None:
    metrics = TransportMetrics()
    metrics.record_room(_room(1, pages=3, seconds=0.5), "prefill-a")
    metrics.record_room(_room(2, pages=1, seconds=1.5), "prefill-b")
    metrics.increment(TransportCounter.MALFORMED_MESSAGES, 7)
    as_dict = metrics.snapshot().to_dict()
    assert json.loads(json.dumps(as_dict)) == as_dict
    assert as_dict["counters"]["malformed_messages"] == 7
    assert as_dict["counters"]["pages_sent"] == 4
    assert as_dict["counters"]["bytes_sent"] == 4 * 1024
    assert set(as_dict["counters"]) == {c.value for c in TransportCounter}
    assert as_dict["transfer_latency_seconds"]["prefill-b"] == {
        "count": 1,
        "sum": 1.5,
        "min": 1.5,
        "max": 1.5,
        "p50": 1.5,
        "p90": 1.5,
        "p99": 1.5,
    }


def test_every_counter_has_a_snapshot_field_and_a_description() -> None:
    assert [f.name for f in attrs.fields(CounterValues)] == [c.value for c in TransportCounter]
    values = CounterValues(bytes_sent=5, timeouts=2)
    assert values[TransportCounter.BYTES_SENT] == 5
    assert values[TransportCounter.TIMEOUTS] == 2
    assert all(c.description.endswith(".") for c in TransportCounter)


def test_increment_by_default_adds_one() -> None:
    metrics = TransportMetrics()
    metrics.increment(TransportCounter.ABORTS_SENT)
    metrics.increment(TransportCounter.ABORTS_SENT)
    metrics.increment(TransportCounter.ABORTS_SENT, 0)
    assert metrics.value(TransportCounter.ABORTS_SENT) == 2
    assert metrics.value(TransportCounter.ABORTS_RECEIVED) == 0


@pytest.mark.parametrize("by", [-1, -100])
def test_negative_increments_are_an_error(by: int) -> None:
    metrics = TransportMetrics()
    metrics.increment(TransportCounter.BYTES_SENT, 10)
    with pytest.raises(MetricValueError, match="bytes_sent cannot go down"):
        metrics.increment(TransportCounter.BYTES_SENT, by)
    assert metrics.value(TransportCounter.BYTES_SENT) == 10


@pytest.mark.parametrize("by", [1.5, True, "3"])
def test_increment_takes_an_int(by: object) -> None:
    with pytest.raises(MetricValueError, match="incremented by an int"):
        TransportMetrics().increment(TransportCounter.TIMEOUTS, by)  # type: ignore[arg-type]  # wrong on purpose


def test_counters_are_named_by_the_enum_not_by_strings() -> None:
    with pytest.raises(MetricValueError, match="TransportCounter"):
        TransportMetrics().increment("timeouts")  # type: ignore[arg-type]  # wrong on purpose


def test_dummy_and_fake_senders_record_nothing() -> None:
    metrics = TransportMetrics()
    metrics.record_room(KVTransferMetric.empty(11), "prefill-dummy")
    snap = metrics.snapshot()
    assert snap.counters == CounterValues()
    assert snap.peers == ()


def test_a_room_cut_short_counts_its_bytes_but_not_its_latency() -> None:
    metrics = TransportMetrics()
    metrics.record_room(_room(1, pages=2, seconds=0.001), "prefill-0", completed=False)
    snap = metrics.snapshot()
    assert snap.counters.pages_sent == 2
    assert snap.counters.bytes_sent == 2048
    assert snap.peers == ()


def test_latency_is_kept_per_peer_so_a_slow_link_shows_by_name() -> None:
    metrics = TransportMetrics()
    for room in range(100):
        metrics.record_room(_room(room, seconds=0.010), "prefill-fast")
        metrics.record_room(_room(room, seconds=0.010 if room < 90 else 2.0), "prefill-straggler")
    snap = metrics.snapshot()
    assert snap.latency("prefill-fast").p99 == pytest.approx(0.010)
    assert snap.latency("prefill-straggler").p50 == pytest.approx(0.010, rel=0.01)
    assert snap.latency("prefill-straggler").p99 == pytest.approx(2.0, rel=0.01)


def test_unknown_peer_lookup_names_the_known_ones() -> None:
    metrics = TransportMetrics()
    metrics.record_room(_room(1), "prefill-0")
    with pytest.raises(KeyError, match=r"'prefill-9'.*\['prefill-0'\]"):
        metrics.snapshot().latency("prefill-9")


def test_forget_peer_drops_its_latency_but_keeps_counters() -> None:
    metrics = TransportMetrics()
    metrics.record_room(_room(1), "prefill-0")
    assert metrics.forget_peer("prefill-0") is True
    assert metrics.forget_peer("prefill-0") is False
    snap = metrics.snapshot()
    assert snap.peers == ()
    assert snap.counters.bytes_sent == 4096


@pytest.mark.parametrize("peer", ["", None, 3])
def test_peer_must_be_a_non_empty_name(peer: object) -> None:
    with pytest.raises(MetricValueError, match="non-empty string"):
        TransportMetrics().record_room(_room(1), peer)  # type: ignore[arg-type]  # wrong on purpose
