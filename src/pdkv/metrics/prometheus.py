"""Optional Prometheus exposition of a ``TransportMetrics``: ``PrometheusExporter``.

Owns: the mapping from a ``TransportMetricsSnapshot`` to Prometheus metric families, read at scrape
time by a custom collector. Must not import ``prometheus_client`` at module import (it is the
optional ``prometheus`` extra: ``import pdkv.metrics`` works without it), keep state of its own
between scrapes, or import anything above pdkv.errors.

Exposed (``pdkv`` is the namespace; ``constant_labels`` are added to every sample):

    pdkv_<counter>_total                                  counter, one per TransportCounter
    pdkv_<gauge>                                          gauge, one per TransportGauge (quarantine)
    pdkv_transfer_latency_seconds_count / _sum {peer}     summary (rate(sum) / rate(count) = mean)
    pdkv_transfer_latency_quantile_seconds {peer,quantile} gauge: p50, p90, p99 since start
    pdkv_transfer_latency_max_seconds {peer}              gauge

Quantiles are gauges rather than summary samples because prometheus_client's public
``SummaryMetricFamily`` has no quantile API; they cover everything since the transport started
(the distribution is not windowed), so compare them across scrapes, not within one.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Final

from pdkv.metrics.errors import MetricValueError, PrometheusUnavailableError
from pdkv.metrics.transport import (
    TransportCounter,
    TransportGauge,
    TransportMetrics,
    TransportMetricsSnapshot,
)

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

INSTALL_HINT: Final = "pip install 'pdkv[prometheus]'"
_NAME: Final = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_RESERVED_LABELS: Final = frozenset({"peer", "quantile"})


def _require_prometheus_client() -> None:
    try:
        import prometheus_client  # noqa: F401  (only to learn whether the extra is installed)
    except ImportError as exc:
        raise PrometheusUnavailableError(
            f"Prometheus exposition needs the optional dependency prometheus_client: {INSTALL_HINT}"
        ) from exc


class _SnapshotCollector:
    """The prometheus_client ``Collector``: every ``collect()`` reads one fresh snapshot."""

    def __init__(self, metrics: TransportMetrics, namespace: str, constant_labels: Mapping[str, str]) -> None:
        self._metrics = metrics
        self._namespace = namespace
        self._label_names = tuple(constant_labels)
        self._label_values = tuple(constant_labels.values())

    def describe(self) -> Iterator[Metric]:
        # describe() lets the registry refuse a second exporter with the same names at register time
        # instead of producing duplicate series at scrape time
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        return self._families(self._metrics.snapshot())

    def _families(self, snapshot: TransportMetricsSnapshot | None) -> Iterator[Metric]:
        from prometheus_client.metrics_core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            SummaryMetricFamily,
        )

        prefix = self._namespace
        labels = self._label_names
        values = self._label_values
        for counter in TransportCounter:
            family = CounterMetricFamily(f"{prefix}_{counter.value}", counter.description, labels=labels)
            if snapshot is not None:
                family.add_metric(values, snapshot.counters[counter])
            yield family
        for gauge in TransportGauge:
            level = GaugeMetricFamily(f"{prefix}_{gauge.value}", gauge.description, labels=labels)
            if snapshot is not None:
                level.add_metric(values, snapshot.gauges[gauge])
            yield level

        summary = SummaryMetricFamily(
            f"{prefix}_transfer_latency_seconds",
            "Engine seconds per room transfer, by peer.",
            labels=(*labels, "peer"),
        )
        quantiles = GaugeMetricFamily(
            f"{prefix}_transfer_latency_quantile_seconds",
            "Quantiles of engine seconds per room transfer since start, by peer (relative error <= 1%).",
            labels=(*labels, "peer", "quantile"),
        )
        maximum = GaugeMetricFamily(
            f"{prefix}_transfer_latency_max_seconds",
            "Longest engine seconds of one room transfer since start, by peer.",
            labels=(*labels, "peer"),
        )
        if snapshot is not None:
            for entry in snapshot.peers:
                latency = entry.latency
                summary.add_metric((*values, entry.peer), latency.count, latency.sum)
                for q, seconds in latency.quantile_items():
                    quantiles.add_metric((*values, entry.peer, repr(q)), seconds)
                maximum.add_metric((*values, entry.peer), latency.max)
        yield summary
        yield quantiles
        yield maximum


class PrometheusExporter:
    """Registers a collector for ``metrics`` in ``registry`` (prometheus_client's global REGISTRY
    when None); ``close()`` unregisters it.

    Raises ``PrometheusUnavailableError`` naming the extra when prometheus_client is not installed,
    and prometheus_client's ``ValueError`` when the registry already has these metric names: two
    transports in one process need their own registries or namespaces (``constant_labels`` such as
    ``{"role": "prefill", "rank": "3"}`` tell their series apart once they are scraped together).
    """

    def __init__(
        self,
        metrics: TransportMetrics,
        *,
        namespace: str = "pdkv",
        registry: CollectorRegistry | None = None,
        constant_labels: Mapping[str, str] | None = None,
    ) -> None:
        _require_prometheus_client()
        from prometheus_client.registry import REGISTRY

        if not _NAME.match(namespace) or namespace.startswith("__"):
            raise MetricValueError(f"namespace {namespace!r} is not a valid Prometheus metric name prefix")
        labels = dict(constant_labels or {})
        for name, value in labels.items():
            if not _NAME.match(name) or name.startswith("__") or name in _RESERVED_LABELS:
                raise MetricValueError(
                    f"constant label {name!r} is not a valid Prometheus label name, or is one pdkv sets "
                    f"itself ({sorted(_RESERVED_LABELS)})"
                )
            if not isinstance(value, str):
                raise MetricValueError(f"constant label {name!r} needs a str value, got {value!r}")
        self._registry = REGISTRY if registry is None else registry
        self._collector = _SnapshotCollector(metrics, namespace, labels)
        self._registry.register(self._collector)
        self._registered = True

    def close(self) -> None:
        """Unregister from the registry; safe to call twice."""
        if self._registered:
            self._registry.unregister(self._collector)
            self._registered = False

    def __enter__(self) -> PrometheusExporter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
