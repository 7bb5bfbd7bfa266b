"""The control plane's errors, defined in ``pdkv.errors.control`` (every pdkv error lives under
``pdkv.errors``) and importable here as before."""

from pdkv.errors.control import (
    AuthenticationError,
    ChannelClosedError,
    ChannelOwnershipError,
    ControlBindError,
    ControlError,
    ControlTimeoutError,
)

__all__ = [
    "AuthenticationError",
    "ChannelClosedError",
    "ChannelOwnershipError",
    "ControlBindError",
    "ControlError",
    "ControlTimeoutError",
]
