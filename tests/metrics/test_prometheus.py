"""PrometheusExporter: the exposition text for a known sequence of records, registration rules,
and a clear error naming the extra when prometheus_client is missing."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdkv.metrics import (
    KVTransferMetric,
    MetricValueError,
    PrometheusExporter,
    PrometheusUnavailableError,
    TransportCounter,
    TransportGauge,
    TransportMetrics,
)


def _known_metrics() -> TransportMetrics:
    metrics = TransportMetrics()
    # prefill-0: three rooms of 0.1, 0.2, 0.4 s; prefill-1: one room of 3 s
    for room, seconds in enumerate((0.1, 0.2, 0.4)):
        metrics.record_room(
            KVTransferMetric(room=room, pages=8, bytes=8 * 4096, seconds=seconds), "prefill-0"
        )
    metrics.record_room(KVTransferMetric(room=10, pages=2, bytes=2 * 4096, seconds=3.0), "prefill-1")
    metrics.increment(TransportCounter.ROOMS_SUCCEEDED, 3)
    metrics.increment(TransportCounter.ROOMS_FAILED)
    metrics.increment(TransportCounter.UNSAFE_RELEASES)
    return metrics


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def test_exposition_carries_counters_and_per_peer_latency() -> None:
    registry = CollectorRegistry()
    PrometheusExporter(_known_metrics(), registry=registry, constant_labels={"role": "decode"})
    text = generate_latest(registry).decode()

    assert "# TYPE pdkv_bytes_sent_total counter" in text
    assert "# TYPE pdkv_transfer_latency_seconds summary" in text
    assert "# TYPE pdkv_transfer_latency_quantile_seconds gauge" in text
    assert 'pdkv_transfer_latency_seconds_count{peer="prefill-0",role="decode"} 3.0' in text

    samples = _samples(text)
    role = ("role", "decode")
    assert samples[("pdkv_bytes_sent_total", (role,))] == 26 * 4096
    assert samples[("pdkv_pages_sent_total", (role,))] == 26
    assert samples[("pdkv_rooms_succeeded_total", (role,))] == 3
    assert samples[("pdkv_rooms_failed_total", (role,))] == 1
    assert samples[("pdkv_unsafe_releases_total", (role,))] == 1
    assert samples[("pdkv_timeouts_total", (role,))] == 0
    for counter in TransportCounter:
        assert (f"pdkv_{counter.value}_total", (role,)) in samples

    peer0 = (("peer", "prefill-0"), role)
    assert samples[("pdkv_transfer_latency_seconds_count", peer0)] == 3
    assert samples[("pdkv_transfer_latency_seconds_sum", peer0)] == pytest.approx(0.7)
    assert samples[("pdkv_transfer_latency_max_seconds", peer0)] == 0.4
    # nearest rank over [0.1, 0.2, 0.4]: p50 is the 2nd value, p90 and p99 the 3rd (within 1 %)
    quantile = "pdkv_transfer_latency_quantile_seconds"
    assert samples[(quantile, (("peer", "prefill-0"), ("quantile", "0.5"), role))] == pytest.approx(
        0.2, rel=0.01
    )
    assert samples[(quantile, (("peer", "prefill-0"), ("quantile", "0.9"), role))] == 0.4
    assert samples[(quantile, (("peer", "prefill-0"), ("quantile", "0.99"), role))] == 0.4
    peer1 = (("peer", "prefill-1"), role)
    assert samples[("pdkv_transfer_latency_seconds_count", peer1)] == 1
    assert samples[(quantile, (("peer", "prefill-1"), ("quantile", "0.99"), role))] == 3.0


def test_each_scrape_reads_a_fresh_snapshot() -> None:
    metrics = TransportMetrics()
    registry = CollectorRegistry()
    PrometheusExporter(metrics, registry=registry, namespace="kv")
    assert _samples(generate_latest(registry).decode())[("kv_timeouts_total", ())] == 0
    metrics.increment(TransportCounter.TIMEOUTS, 4)
    text = generate_latest(registry).decode()
    assert _samples(text)[("kv_timeouts_total", ())] == 4
    # no peer recorded yet: the latency families are declared but carry no series
    assert "kv_transfer_latency_seconds_count" not in text
    assert "pdkv_" not in text


def test_a_second_exporter_with_the_same_names_is_refused_until_the_first_closes() -> None:
    registry = CollectorRegistry()
    first = PrometheusExporter(TransportMetrics(), registry=registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        PrometheusExporter(TransportMetrics(), registry=registry)
    PrometheusExporter(TransportMetrics(), registry=registry, namespace="pdkv_decode")
    first.close()
    first.close()
    PrometheusExporter(TransportMetrics(), registry=registry)


def test_closing_removes_the_series() -> None:
    registry = CollectorRegistry()
    with PrometheusExporter(_known_metrics(), registry=registry):
        assert "pdkv_bytes_sent_total" in generate_latest(registry).decode()
    assert "pdkv_bytes_sent_total" not in generate_latest(registry).decode()


@pytest.mark.parametrize("namespace", ["", "1pdkv", "pd-kv", "__pdkv"])
def test_invalid_namespace_is_refused(namespace: str) -> None:
    with pytest.raises(MetricValueError, match="namespace"):
        PrometheusExporter(TransportMetrics(), namespace=namespace, registry=CollectorRegistry())


@pytest.mark.parametrize("label", ["peer", "quantile", "bad-name", "__reserved"])
def test_invalid_or_clashing_constant_labels_are_refused(label: str) -> None:
    with pytest.raises(MetricValueError, match="constant label"):
        PrometheusExporter(TransportMetrics(), registry=CollectorRegistry(), constant_labels={label: "x"})


def test_missing_prometheus_client_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    # a None entry in sys.modules makes any import of that module raise ImportError
    for name in [m for m in sys.modules if m == "prometheus_client" or m.startswith("prometheus_client.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(PrometheusUnavailableError, match=r"pip install 'pdkv\[prometheus\]'") as caught:
        PrometheusExporter(TransportMetrics())
    assert isinstance(caught.value, ImportError)
    assert isinstance(caught.value.__cause__, ImportError)


def test_pdkv_metrics_imports_without_prometheus_client() -> None:
    script = textwrap.dedent(
        """
        import sys
        sys.modules["prometheus_client"] = None
        import pdkv.metrics
        m = pdkv.metrics.TransportMetrics()
        m.increment(pdkv.metrics.TransportCounter.TIMEOUTS)
        assert m.snapshot().counters.timeouts == 1
        try:
            pdkv.metrics.PrometheusExporter(m)
        except pdkv.metrics.PrometheusUnavailableError as exc:
            print("refused:", exc)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "refused:" in done.stdout
    assert "pip install 'pdkv[prometheus]'" in done.stdout


def test_quarantine_gauges_and_counters_are_exposed() -> None:
    metrics = TransportMetrics()
    metrics.set_gauge(TransportGauge.ROOMS_QUARANTINED, 2)
    metrics.set_gauge(TransportGauge.PAGES_QUARANTINED, 48)
    metrics.increment(TransportCounter.QUARANTINES, 3)
    registry = CollectorRegistry()
    PrometheusExporter(metrics, registry=registry)
    samples = {
        s.name: s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }
    assert samples["pdkv_rooms_quarantined"] == 2.0
    assert samples["pdkv_pages_quarantined"] == 48.0
    assert samples["pdkv_quarantines_total"] == 3.0
    metrics.set_gauge(TransportGauge.PAGES_QUARANTINED, 0)  # a level, not a count: it goes down
    again = generate_latest(registry).decode()
    assert "pdkv_pages_quarantined 0.0" in again
