"""Protocol timing: every deadline of every non-terminal state, with ``PDKV_*`` overrides.

Owns: ``Timeouts`` and ``ENV_VARS`` (field name -> environment variable). Must not read a clock:
deadlines are ``now + timeout`` where ``now`` is a parameter. ``from_env`` takes the environment as
a mapping (``os.environ`` by default) so tests pass their own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import attrs

from pdkv import config
from pdkv.config import positive_seconds
from pdkv.errors import ConfigError


def _seconds(default: float, var: str, meaning: str) -> float:
    """A ``Timeouts`` field: its default, the shared validator, and the variable that overrides it."""
    result: float = attrs.field(
        default=default, validator=positive_seconds, metadata=config.seconds_var(var, meaning)
    )
    return result


@attrs.frozen(kw_only=True)
class Timeouts:
    """Seconds. Defaults follow DESIGN section 8: 300 s for room states, 30 s for the abort-ack wait;
    a heartbeat every 5 s, a peer lost after 30 s of silence."""

    bootstrap: float = _seconds(
        300.0,
        "PDKV_BOOTSTRAP_TIMEOUT",
        "Bootstrapping rooms: no TransferRequest yet (prefill), registration not done (decode)",
    )
    """Sender: no TransferRequest set yet. Receiver: registration with its targets not done."""
    waiting: float = _seconds(
        300.0, "PDKV_WAITING_TIMEOUT", "Decode: requests sent, no status from a required prefill rank"
    )
    """Receiver: requests sent, no status from any required prefill rank."""
    inflight: float = _seconds(
        300.0,
        "PDKV_INFLIGHT_TIMEOUT",
        "Prefill: residency from WaitingForInput to Success (forward plus transfer)",
    )
    """Sender: residency from WAITING_FOR_INPUT to Success (forward plus transfer)."""
    transfer: float = _seconds(
        300.0, "PDKV_TRANSFER_TIMEOUT", "Decode: from the first Success status to the last"
    )
    """Receiver: from the first Success status to the last (transfer-queue liveness bound)."""
    abort_ack: float = _seconds(
        30.0, "PDKV_ABORT_ACK_TIMEOUT", "Decode: AbortAck wait; past it the room is quarantined"
    )
    """Receiver: wait for AbortAcks; past it a room's pages are quarantined (still held)."""
    quarantine: float = _seconds(
        1200.0,
        "PDKV_QUARANTINE_TIMEOUT",
        "Decode: quarantine bound; past it the pages are released unsafely (counted)",
    )
    """Receiver: how long quarantined pages wait for the missing AbortAcks before they are released
    anyway: the only unsafe release, counted and logged. Longer than a cut TCP link's stuck writes
    can outlive the cut with Linux and Mooncake defaults (specs/mooncake-tcp-late-writes.md)."""
    quarantine_settle: float = _seconds(
        300.0,
        "PDKV_QUARANTINE_SETTLE",
        "Decode: an acknowledged quarantined room's pages come back after this without a connection cut",
    )
    """Receiver, the fallback of the proven release (used only when the decode cannot cut the prefill
    hosts' engine connections, or the cut failed): once every missing AbortAck of a quarantined
    room came in, how long its pages still wait. A rank that was cut off may have bytes of failed
    writes in orphaned TCP sockets (kept retransmitting for about 100 s); measured, such bytes landed
    19-30 s after a heal (specs/mooncake-tcp-late-writes.md)."""
    abort_resend: float = _seconds(
        1.0,
        "PDKV_ABORT_RESEND_INTERVAL",
        "Both sides: first resend interval of an unanswered Abort or Failed status (doubling)",
    )
    """Both sides: first interval before an unacknowledged Abort (or a Failed status) is sent again;
    it doubles after each resend, at most ``MAX_ABORT_RESENDS`` times."""
    register_retry: float = _seconds(
        2.0, "PDKV_REGISTER_RETRY_TIMEOUT", "Decode: resend Register to a prefill rank that has not answered"
    )
    """Receiver: resend Register to a prefill rank that has not answered."""
    tombstone: float = _seconds(
        600.0, "PDKV_TOMBSTONE_TIMEOUT", "Prefill: how long a closed or aborted room id is refused"
    )
    """Sender: how long a closed or aborted room id is remembered, so late requests for it are refused."""
    heartbeat_interval: float = _seconds(
        5.0, "PDKV_HEARTBEAT_INTERVAL", "Both sides: a Heartbeat to every registered peer this often"
    )
    """Both sides: a Heartbeat goes to every registered peer this often; silence is checked as often."""
    heartbeat_timeout: float = _seconds(
        30.0, "PDKV_HEARTBEAT_TIMEOUT", "Both sides: a peer silent this long is lost and its rooms fail"
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
        return config.from_env(cls, env, **overrides)


MAX_ABORT_RESENDS: Final = 8
"""Resends of one Abort (or Failed status) to one peer; with the doubling interval from 1 s they
span about four minutes, well inside the quarantine bound."""

ENV_VARS: Final[Mapping[str, str]] = config.env_vars(Timeouts)
"""Field name -> the environment variable that overrides it."""
