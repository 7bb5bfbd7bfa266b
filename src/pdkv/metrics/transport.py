"""Counters and per-peer latency of one transport: ``TransportMetrics`` and its frozen snapshot.

Owns: the counter names (``TransportCounter``; call sites never pass free-form strings), the one
lock that transfer workers and the control thread share when they record, and
``TransportMetricsSnapshot``, the plain-valued copy that logs, JSON and the Prometheus exporter read.
Must not read a clock, log, or import anything above pdkv.errors.

Cost: every update takes one ``threading.Lock`` for a dict increment (and, in ``record_room``, one
bucket increment); ``snapshot`` copies under the lock and computes quantiles after releasing it, so
a scrape never holds up a transfer worker for longer than a copy.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Mapping
from typing import Final, TypedDict

import attrs

from pdkv.metrics.errors import MetricValueError
from pdkv.metrics.latency import LatencyDistribution, LatencySummary
from pdkv.metrics.transfer import KVTransferMetric


class TransportCounter(enum.Enum):
    """Every counter a transport keeps; the value is the exported name (Prometheus adds ``_total``)."""

    ROOMS_SUCCEEDED = "rooms_succeeded"
    ROOMS_FAILED = "rooms_failed"
    ROOMS_ABORTED = "rooms_aborted"
    BYTES_SENT = "bytes_sent"
    PAGES_SENT = "pages_sent"
    BYTES_RECEIVED = "bytes_received"
    PAGES_RECEIVED = "pages_received"
    CHUNKS_SENT = "chunks_sent"
    CHUNKS_SKIPPED = "chunks_skipped"
    ABORTS_SENT = "aborts_sent"
    ABORTS_RECEIVED = "aborts_received"
    ABORT_ACKS = "abort_acks"
    UNSAFE_RELEASES = "unsafe_releases"
    MALFORMED_MESSAGES = "malformed_messages"
    UNAUTHENTICATED_MESSAGES = "unauthenticated_messages"
    STALE_MESSAGES = "stale_messages"
    ENGINE_FAILURES = "engine_failures"
    TIMEOUTS = "timeouts"
    QUARANTINES = "quarantines"
    QUARANTINES_RELEASED = "quarantines_released"
    QUARANTINES_PROVEN = "quarantines_proven"
    RELEASES_ACKED = "releases_acked"
    RELEASES_CUT = "releases_cut"
    RELEASES_SETTLED = "releases_settled"
    FENCES = "fences"
    WRITES = "writes"
    WRITE_JOBS = "write_jobs"
    ROOMS_VERIFIED = "rooms_verified"
    CHECKSUM_FAILURES = "checksum_failures"
    ROOMS_DRAFT_SKIPPED = "rooms_draft_skipped"
    ROOMS_LANDED = "rooms_landed"

    # Hashed by identity, in C (members are singletons): every increment looks a counter up, and
    # enum.Enum's own __hash__ is a Python call.
    __hash__ = object.__hash__

    @property
    def description(self) -> str:
        """One line for operators (the Prometheus HELP text)."""
        return COUNTER_DESCRIPTIONS[self]


class TransportGauge(enum.Enum):
    """Values that go up and down (exported as Prometheus gauges under the value's name)."""

    ROOMS_QUARANTINED = "rooms_quarantined"
    PAGES_QUARANTINED = "pages_quarantined"
    DRAFT_BUFFERS_SKIPPED = "draft_buffers_skipped"
    LANDING_BYTES_IN_USE = "landing_bytes_in_use"
    ROOMS_WAITING_FOR_LANDING = "rooms_waiting_for_landing"

    __hash__ = object.__hash__  # as TransportCounter's

    @property
    def description(self) -> str:
        return GAUGE_DESCRIPTIONS[self]


GAUGE_DESCRIPTIONS: Final[Mapping[TransportGauge, str]] = {
    TransportGauge.ROOMS_QUARANTINED: (
        "Aborted rooms whose pages are held now because a prefill rank has not acknowledged the abort."
    ),
    TransportGauge.PAGES_QUARANTINED: "Destination pages of the quarantined rooms (not reusable yet).",
    TransportGauge.DRAFT_BUFFERS_SKIPPED: (
        "Draft-model buffers left out of the transfers (only one side of the pair registers them, "
        "a rolling deployment under PDKV_LAYOUT_POLICY=degrade_draft), both sides' counted, summed "
        "over the peer ranks registered now."
    ),
    TransportGauge.LANDING_BYTES_IN_USE: (
        "Decode: landing-pool bytes leased now to rooms from prefill ranks of a larger TP "
        "(PDKV_LANDING_BYTES)."
    ),
    TransportGauge.ROOMS_WAITING_FOR_LANDING: (
        "Decode: rooms held in Bootstrapping now because the landing pool has no space for them yet."
    ),
}


COUNTER_DESCRIPTIONS: Final[Mapping[TransportCounter, str]] = {
    TransportCounter.ROOMS_SUCCEEDED: "Rooms that reached Success on this transport.",
    TransportCounter.ROOMS_FAILED: "Rooms that reached Failed on this transport (aborted rooms included).",
    TransportCounter.ROOMS_ABORTED: "Rooms that failed because either side aborted them.",
    TransportCounter.BYTES_SENT: "Prefill: KV, state and aux bytes this rank's engine actually wrote.",
    TransportCounter.PAGES_SENT: "Prefill: KV pages this rank's engine actually wrote.",
    TransportCounter.BYTES_RECEIVED: "Decode: KV, state and aux bytes prefill ranks reported writing here.",
    TransportCounter.PAGES_RECEIVED: "Decode: KV pages prefill ranks reported writing here.",
    TransportCounter.CHUNKS_SENT: "Prefill chunks whose writes all completed.",
    TransportCounter.CHUNKS_SKIPPED: "Queued chunks not written because their room had already failed.",
    TransportCounter.ABORTS_SENT: (
        "Aborts told to a peer: Abort messages (decode), Failed statuses of rooms aborted here (prefill)."
    ),
    TransportCounter.ABORTS_RECEIVED: "Abort messages received from a peer.",
    TransportCounter.ABORT_ACKS: "AbortAck messages (sent by prefill, received by decode).",
    TransportCounter.UNSAFE_RELEASES: (
        "Aborted rooms whose pages were released after the quarantine bound, an AbortAck still missing."
    ),
    TransportCounter.MALFORMED_MESSAGES: "Control frames that did not decode; dropped.",
    TransportCounter.UNAUTHENTICATED_MESSAGES: (
        "Control messages from an unknown or unregistered sender; dropped."
    ),
    TransportCounter.STALE_MESSAGES: "Control messages for an old epoch or a closed room; dropped.",
    TransportCounter.ENGINE_FAILURES: (
        "Chunks failed by the transfer engine (a failed batch shared by several rooms counts once per room)."
    ),
    TransportCounter.TIMEOUTS: "Rooms or aborts that hit a deadline.",
    TransportCounter.QUARANTINES: "Aborted rooms whose AbortAck wait timed out: pages held in quarantine.",
    TransportCounter.QUARANTINES_RELEASED: (
        "Quarantined rooms whose pages came back safely (every prefill rank acknowledged in the end)."
    ),
    TransportCounter.QUARANTINES_PROVEN: (
        "Of those, released proven: acknowledged after fences, then the prefill hosts' connections cut."
    ),
    TransportCounter.RELEASES_ACKED: (
        "Decode: failed rooms whose pages came back on the acks alone (every write completed): proven."
    ),
    TransportCounter.RELEASES_CUT: (
        "Decode: failed rooms whose pages came back after the acks and a cut of the prefill hosts' "
        "connections: proven."
    ),
    TransportCounter.RELEASES_SETTLED: (
        "Decode: failed rooms whose pages came back quarantine_settle after the acks (a write had failed, "
        "or its writer restarted, and no cut): a time bound, not a proof."
    ),
    TransportCounter.FENCES: "Fence writes made before an AbortAck because a write of the room had failed.",
    TransportCounter.WRITES: "Chunk writes to a decode rank (one per chunk and destination with bytes).",
    TransportCounter.WRITE_JOBS: (
        "Transfer jobs those writes went in; writes / write_jobs is how many rooms' chunks shared a job."
    ),
    TransportCounter.ROOMS_VERIFIED: (
        "Decode: rooms whose pages matched every prefill rank's checksums before Success (PDKV_KV_CHECKSUM)."
    ),
    TransportCounter.CHECKSUM_FAILURES: (
        "Decode: rooms failed because a received page differed from what the prefill sent (checksums)."
    ),
    TransportCounter.ROOMS_DRAFT_SKIPPED: (
        "Decode: rooms that succeeded without some draft-model state (receiver.draft_skipped()): the "
        "scheduler should not speculate from it."
    ),
    TransportCounter.ROOMS_LANDED: (
        "Decode: rooms whose KV landed in the landing pool and was scattered into their pages before Success."
    ),
}


@attrs.frozen(kw_only=True)
class CounterValues:
    """Every ``TransportCounter`` at one moment, as plain ints (field name = counter value)."""

    rooms_succeeded: int = 0
    rooms_failed: int = 0
    rooms_aborted: int = 0
    bytes_sent: int = 0
    pages_sent: int = 0
    bytes_received: int = 0
    pages_received: int = 0
    chunks_sent: int = 0
    chunks_skipped: int = 0
    aborts_sent: int = 0
    aborts_received: int = 0
    abort_acks: int = 0
    unsafe_releases: int = 0
    malformed_messages: int = 0
    unauthenticated_messages: int = 0
    stale_messages: int = 0
    engine_failures: int = 0
    timeouts: int = 0
    quarantines: int = 0
    quarantines_released: int = 0
    quarantines_proven: int = 0
    releases_acked: int = 0
    releases_cut: int = 0
    releases_settled: int = 0
    fences: int = 0
    writes: int = 0
    write_jobs: int = 0
    rooms_verified: int = 0
    checksum_failures: int = 0
    rooms_draft_skipped: int = 0
    rooms_landed: int = 0

    def __getitem__(self, counter: TransportCounter) -> int:
        value: int = getattr(self, counter.value)
        return value

    def to_dict(self) -> dict[str, int]:
        return {counter.value: self[counter] for counter in TransportCounter}


@attrs.frozen(kw_only=True)
class PeerLatency:
    """One peer's transfer latency distribution at one moment."""

    peer: str
    latency: LatencySummary


class SnapshotDict(TypedDict):
    """``TransportMetricsSnapshot.to_dict()``: plain JSON types only."""

    counters: dict[str, int]
    gauges: dict[str, int]
    transfer_latency_seconds: dict[str, dict[str, float | int]]


@attrs.frozen(kw_only=True)
class TransportMetricsSnapshot:
    """Counters and per-peer latency summaries, consistent with each other (copied under one lock)."""

    counters: CounterValues
    peers: tuple[PeerLatency, ...]
    """Sorted by peer name."""
    gauges: Mapping[TransportGauge, int] = attrs.field(factory=lambda: dict.fromkeys(TransportGauge, 0))

    def peer_names(self) -> tuple[str, ...]:
        return tuple(p.peer for p in self.peers)

    def latency(self, peer: str) -> LatencySummary:
        """The peer's summary; KeyError names the peers that have one."""
        for entry in self.peers:
            if entry.peer == peer:
                return entry.latency
        raise KeyError(f"no latency recorded for peer {peer!r}; peers: {list(self.peer_names())}")

    def to_dict(self) -> SnapshotDict:
        return {
            "counters": self.counters.to_dict(),
            "gauges": {gauge.value: value for gauge, value in self.gauges.items()},
            "transfer_latency_seconds": {p.peer: p.latency.to_dict() for p in self.peers},
        }


def _check_peer(peer: str) -> None:
    if not isinstance(peer, str) or not peer:
        raise MetricValueError(f"a peer is named by a non-empty string, got {peer!r}")


_SENT: Final = (TransportCounter.BYTES_SENT, TransportCounter.PAGES_SENT)
_RECEIVED: Final = (TransportCounter.BYTES_RECEIVED, TransportCounter.PAGES_RECEIVED)


class TransportMetrics:
    """Thread-safe counters and per-peer transfer latency for one transport.

    Transfer workers and the control thread both call ``increment`` / ``record_room``; readers call
    ``snapshot``. Per-peer memory is fixed (see ``pdkv.metrics.latency``); call ``forget_peer`` when
    a peer leaves for good so a long-lived process does not keep every peer it ever met.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[TransportCounter, int] = dict.fromkeys(TransportCounter, 0)
        self._gauges: dict[TransportGauge, int] = dict.fromkeys(TransportGauge, 0)
        self._latency: dict[str, LatencyDistribution] = {}

    def increment(self, counter: TransportCounter, by: int = 1) -> None:
        """Add ``by`` (an int >= 0) to ``counter``; counters never go down."""
        if not isinstance(counter, TransportCounter):
            raise MetricValueError(f"counters are named by TransportCounter, got {counter!r}")
        if isinstance(by, bool) or not isinstance(by, int):
            raise MetricValueError(f"{counter.value} is incremented by an int, got {by!r}")
        if by < 0:
            raise MetricValueError(f"{counter.value} cannot go down: increment by {by}")
        with self._lock:
            self._counts[counter] += by

    def record_room(
        self, metric: KVTransferMetric, peer: str, *, completed: bool = True, received: bool = False
    ) -> None:
        """Count what ``metric`` says was written to ``peer`` (``received``: written here by ``peer``,
        counted as received), and its engine seconds as a latency sample of that peer.

        An empty metric (a dummy rank, a fake sender) records nothing at all, so it can neither
        inflate the byte counters nor drag the peer's latency towards 0. ``completed=False`` (a room
        that failed part-way) counts its bytes and pages, which really moved, but adds no latency
        sample, since a cut-short transfer would read as a fast one. Room outcomes are counted
        separately with ``increment(TransportCounter.ROOMS_*)``.
        """
        if not isinstance(metric, KVTransferMetric):
            raise MetricValueError(f"record_room takes a KVTransferMetric, got {type(metric).__name__}")
        _check_peer(peer)
        if metric.is_empty:
            return
        byte_counter, page_counter = _RECEIVED if received else _SENT
        with self._lock:
            self._counts[byte_counter] += metric.bytes
            self._counts[page_counter] += metric.pages
            if completed:
                distribution = self._latency.get(peer)
                if distribution is None:
                    distribution = self._latency[peer] = LatencyDistribution()
                distribution.record(metric.seconds)

    def forget_peer(self, peer: str) -> bool:
        """Drop ``peer``'s latency distribution (counters are kept); True if it had one."""
        with self._lock:
            return self._latency.pop(peer, None) is not None

    def set_gauge(self, gauge: TransportGauge, value: int) -> None:
        """Set a gauge to its current value (the transport owns what it measures)."""
        with self._lock:
            self._gauges[gauge] = int(value)

    def value(self, counter: TransportCounter) -> int:
        """One counter's current value."""
        with self._lock:
            return self._counts[counter]

    def snapshot(self) -> TransportMetricsSnapshot:
        """A frozen, JSON-ready copy of every counter and every peer's latency summary."""
        with self._lock:
            counts = {counter.value: value for counter, value in self._counts.items()}
            gauges = dict(self._gauges)
            distributions = [(peer, d.copy()) for peer, d in self._latency.items()]
        # quantiles are computed outside the lock: recorders only wait for the copies above
        peers = tuple(
            PeerLatency(peer=peer, latency=d.summary())
            for peer, d in sorted(distributions, key=lambda pd: pd[0])
        )
        return TransportMetricsSnapshot(counters=CounterValues(**counts), peers=peers, gauges=gauges)
