"""Protocol timing: every deadline of every non-terminal state, with ``PDKV_*`` overrides.

Owns: ``Timeouts``. Must not read a clock: deadlines are ``now + timeout`` where ``now`` is a
parameter. ``from_env`` takes the environment as a mapping (``os.environ`` by default) so tests
pass their own.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Final

import attrs

from pdkv.errors import ConfigError


def _positive_seconds(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{attribute.name} must be a positive number of seconds, got {value!r}")


@attrs.frozen(kw_only=True)
class Timeouts:
    """Seconds. Defaults follow DESIGN section 8: 300 s everywhere except the abort-ack wait."""

    bootstrap: float = attrs.field(default=300.0, validator=_positive_seconds)
    """Sender: no TransferRequest set yet. Receiver: registration with its targets not done."""
    waiting: float = attrs.field(default=300.0, validator=_positive_seconds)
    """Receiver: requests sent, no status from any required prefill rank."""
    inflight: float = attrs.field(default=300.0, validator=_positive_seconds)
    """Sender: residency from WAITING_FOR_INPUT to Success (forward plus transfer)."""
    transfer: float = attrs.field(default=300.0, validator=_positive_seconds)
    """Receiver: from the first Success status to the last (transfer-queue liveness bound)."""
    abort_ack: float = attrs.field(default=30.0, validator=_positive_seconds)
    """Receiver: wait for AbortAcks before releasing pages anyway (counted as unsafe)."""
    register_retry: float = attrs.field(default=2.0, validator=_positive_seconds)
    """Receiver: resend Register to a prefill rank that has not answered."""
    tombstone: float = attrs.field(default=600.0, validator=_positive_seconds)
    """Sender: how long a closed or aborted room id is remembered, so late requests for it are refused."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: float) -> Timeouts:
        """Defaults, then ``PDKV_<NAME>_TIMEOUT`` variables (e.g. ``PDKV_ABORT_ACK_TIMEOUT=10``), then kwargs."""
        source = os.environ if env is None else env
        values: dict[str, float] = {}
        for field in attrs.fields(cls):
            var = ENV_VARS[field.name]
            if var in source:
                raw = source[var]
                try:
                    values[field.name] = float(raw)
                except ValueError:
                    raise ConfigError(f"{var}={raw!r} is not a number of seconds") from None
        values.update(overrides)
        return cls(**values)


ENV_VARS: Final[Mapping[str, str]] = {
    f.name: f"PDKV_{f.name.upper()}_TIMEOUT" for f in attrs.fields(Timeouts)
}
