"""Errors of the control plane, all under ``pdkv.errors``.

Owns: the exception classes raised by ``pdkv.control`` (``pdkv.control.errors`` re-exports them).
Must not import zmq or anything above ``pdkv.errors``: callers catch these without knowing which
socket library sits underneath.

    PdkvError
      ControlError                 a control socket could not do what was asked
        ControlTimeoutError        ... a request got no valid reply in time (also a TimeoutError)
        ControlBindError           ... a channel or service could not bind its address (also an OSError)
        ChannelClosedError         ... the channel or service was already closed (a caller bug)
        ChannelOwnershipError      ... a thread other than the owner used a channel (a caller bug)
      RemoteProtocolError
        AuthenticationError        inbound frames without a valid, fresh authentication tag
"""

from __future__ import annotations

from pdkv.errors import PdkvError, RemoteProtocolError


class ControlError(PdkvError):
    """A control socket operation failed; the message names the address concerned."""


class ControlTimeoutError(ControlError, TimeoutError):
    """A request got no valid reply within its time budget, after every attempt."""

    def __init__(self, message: str, *, address: str, attempts: int, timeout_s: float) -> None:
        super().__init__(message)
        self.address = address
        self.attempts = attempts
        self.timeout_s = timeout_s


class ControlBindError(ControlError, OSError):
    """The address could not be bound (in use, not a local interface, malformed)."""


class ChannelClosedError(ControlError):
    """The channel (or service) was used after ``close()``."""


class ChannelOwnershipError(ControlError, RuntimeError):
    """A channel was used from a thread that does not own it (zmq sockets are not thread-safe)."""


class AuthenticationError(RemoteProtocolError):
    """Inbound frames carry no tag, a tag that does not verify, or a timestamp outside the window."""
