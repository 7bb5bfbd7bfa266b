"""Errors raised by pdkv.metrics, each a subclass of a class in pdkv.errors.

Owns: exception classes for metrics only (``pdkv.metrics.errors`` re-exports them). Must not import
anything above pdkv.errors.
"""

from __future__ import annotations

from pdkv.errors import PdkvError


class MetricValueError(PdkvError, ValueError):
    """A metric was given an impossible value: a negative count, a negative or non-finite duration,
    or timestamps out of order. Metrics refuse these instead of clamping them, because a clamped
    value would hide the caller's bug in a dashboard."""


class PrometheusUnavailableError(PdkvError, ImportError):
    """Prometheus exposition was asked for but ``prometheus_client`` (the ``prometheus`` extra) is
    not installed."""
