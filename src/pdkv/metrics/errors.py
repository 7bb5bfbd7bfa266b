"""The metrics' errors, defined in ``pdkv.errors.metrics`` (every pdkv error lives under ``pdkv.errors``)
and importable here as before."""

from pdkv.errors.metrics import MetricValueError, PrometheusUnavailableError

__all__ = ["MetricValueError", "PrometheusUnavailableError"]
