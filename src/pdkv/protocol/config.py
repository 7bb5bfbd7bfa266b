"""Protocol timing: every deadline of every non-terminal state, with ``PDKV_*`` overrides.

Owns: ``Timeouts`` and ``ENV_VARS`` (field name -> environment variable). Must not read a clock:
deadlines are ``now + timeout`` where ``now`` is a parameter. ``from_env`` takes the environment as
a mapping (``os.environ`` by default) so tests pass their own.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Final

import attrs

from pdkv.errors import ConfigError

_ENV = "pdkv_env"  # attrs metadata key: a field's environment variable when it is not PDKV_<NAME>_TIMEOUT


def _positive_seconds(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(f"{attribute.name} must be a positive number of seconds, got {value!r}")


@attrs.frozen(kw_only=True)
class Timeouts:
    """Seconds. Defaults follow DESIGN section 8: 300 s for room states, 30 s for the abort-ack wait;
    a heartbeat every 5 s, a peer lost after 30 s of silence."""

    bootstrap: float = attrs.field(default=300.0, validator=_positive_seconds)
    """Sender: no TransferRequest set yet. Receiver: registration with its targets not done."""
    waiting: float = attrs.field(default=300.0, validator=_positive_seconds)
    """Receiver: requests sent, no status from any required prefill rank."""
    inflight: float = attrs.field(default=300.0, validator=_positive_seconds)
    """Sender: residency from WAITING_FOR_INPUT to Success (forward plus transfer)."""
    transfer: float = attrs.field(default=300.0, validator=_positive_seconds)
    """Receiver: from the first Success status to the last (transfer-queue liveness bound)."""
    abort_ack: float = attrs.field(default=30.0, validator=_positive_seconds)
    """Receiver: wait for AbortAcks; past it a room's pages are quarantined (still held)."""
    quarantine: float = attrs.field(default=1200.0, validator=_positive_seconds)
    """Receiver: how long quarantined pages wait for the missing AbortAcks before they are released
    anyway: the only unsafe release, counted and logged. Longer than a cut TCP link's stuck writes
    can outlive the cut with Linux and Mooncake defaults (specs/mooncake-tcp-late-writes.md)."""
    quarantine_settle: float = attrs.field(
        default=300.0, validator=_positive_seconds, metadata={_ENV: "PDKV_QUARANTINE_SETTLE"}
    )
    """Receiver: once every missing AbortAck of a quarantined room came in, how long its pages still
    wait: a rank that was cut off may have bytes of failed writes in orphaned TCP sockets (kept
    retransmitting for about 100 s) and queued pieces that reconnect after the link is back (about
    127 s of connect retries); measured, such bytes landed 19-30 s after a heal
    (specs/mooncake-tcp-late-writes.md). Lower it only for transports without that hazard."""
    abort_resend: float = attrs.field(
        default=1.0, validator=_positive_seconds, metadata={_ENV: "PDKV_ABORT_RESEND_INTERVAL"}
    )
    """Both sides: first interval before an unacknowledged Abort (or a Failed status) is sent again;
    it doubles after each resend, at most ``MAX_ABORT_RESENDS`` times."""
    register_retry: float = attrs.field(default=2.0, validator=_positive_seconds)
    """Receiver: resend Register to a prefill rank that has not answered."""
    tombstone: float = attrs.field(default=600.0, validator=_positive_seconds)
    """Sender: how long a closed or aborted room id is remembered, so late requests for it are refused."""
    heartbeat_interval: float = attrs.field(
        default=5.0, validator=_positive_seconds, metadata={_ENV: "PDKV_HEARTBEAT_INTERVAL"}
    )
    """Both sides: a Heartbeat goes to every registered peer this often; silence is checked as often."""
    heartbeat_timeout: float = attrs.field(
        default=30.0, validator=_positive_seconds, metadata={_ENV: "PDKV_HEARTBEAT_TIMEOUT"}
    )
    """Both sides: a peer that sent nothing for this long is lost (noticed at the next heartbeat round,
    so within ``heartbeat_timeout + heartbeat_interval``): its rooms fail and its socket is rebuilt."""

    def __attrs_post_init__(self) -> None:
        if self.heartbeat_timeout <= self.heartbeat_interval:
            # Otherwise every peer would be declared lost between two of its own heartbeats.
            raise ConfigError(
                f"heartbeat_timeout ({self.heartbeat_timeout:g} s) must exceed heartbeat_interval "
                f"({self.heartbeat_interval:g} s)"
            )

    def resend_at(self, now: float, resends: int) -> float | None:
        """When an unanswered Abort (or Failed status) already sent ``resends`` times goes again:
        ``abort_resend`` after the first send, doubling; None once ``MAX_ABORT_RESENDS`` went."""
        if resends >= MAX_ABORT_RESENDS:
            return None
        return now + self.abort_resend * (1 << resends)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: float) -> Timeouts:
        """Defaults, then the variables of ``ENV_VARS`` that are set (e.g. ``PDKV_ABORT_ACK_TIMEOUT=10``,
        ``PDKV_HEARTBEAT_INTERVAL=2``), then kwargs."""
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


MAX_ABORT_RESENDS: Final = 8
"""Resends of one Abort (or Failed status) to one peer; with the doubling interval from 1 s they
span about four minutes, well inside the quarantine bound."""

ENV_VARS: Final[Mapping[str, str]] = {
    f.name: str(f.metadata.get(_ENV, f"PDKV_{f.name.upper()}_TIMEOUT")) for f in attrs.fields(Timeouts)
}
"""Field name -> the environment variable that overrides it."""
