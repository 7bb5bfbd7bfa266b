"""Metrics of pdkv transports: how much moved, how fast, and which peer is slow.

Owns: ``KVTransferMetric`` (one room as one side saw it), ``LatencyDistribution`` (bounded memory,
1 % relative quantile error), ``TransportMetrics`` (thread-safe counters named by
``TransportCounter`` plus per-peer latency, read through a frozen ``snapshot()``), and the optional
``PrometheusExporter``. Must not read a clock (callers pass monotonic timestamps), do I/O, import
``prometheus_client`` at import time, or import any pdkv package other than pdkv.errors.
"""

from __future__ import annotations

from pdkv.metrics.errors import MetricValueError, PrometheusUnavailableError
from pdkv.metrics.latency import (
    QUANTILES,
    RELATIVE_ERROR,
    LatencyDistribution,
    LatencySummary,
)
from pdkv.metrics.prometheus import PrometheusExporter
from pdkv.metrics.transfer import KVTransferMetric, bytes_written
from pdkv.metrics.transport import (
    CounterValues,
    PeerLatency,
    SnapshotDict,
    TransportCounter,
    TransportGauge,
    TransportMetrics,
    TransportMetricsSnapshot,
)

__all__ = [
    "QUANTILES",
    "RELATIVE_ERROR",
    "CounterValues",
    "KVTransferMetric",
    "LatencyDistribution",
    "LatencySummary",
    "MetricValueError",
    "PeerLatency",
    "PrometheusExporter",
    "PrometheusUnavailableError",
    "SnapshotDict",
    "TransportCounter",
    "TransportGauge",
    "TransportMetrics",
    "TransportMetricsSnapshot",
    "bytes_written",
]
