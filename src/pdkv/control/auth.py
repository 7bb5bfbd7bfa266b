"""Optional message authentication for control frames: an HMAC-SHA256 tag frame with a timestamp.

Owns: the tag format, ``Authenticator`` (sign / verify) and the ``PDKV_AUTH_KEY`` reading (only in
``Authenticator.from_env``, never at import). Must not do I/O or know messages: it works on frame
lists, before decoding on the way in and after encoding on the way out. Time is a parameter
(``now_ms``, unix milliseconds) so tests can make stale tags; sockets pass ``unix_ms()``.

Tag frame, appended after the message's own frames, exactly 40 bytes::

    timestamp  u64 little-endian   unix time in milliseconds when the sender signed
    mac        32 bytes            HMAC-SHA256(key, DOMAIN || timestamp || u32 frame count ||
                                                (u64 length || frame bytes) for each frame)

Lengths are inside the MAC so that moving bytes across a frame boundary, or adding or dropping an
empty frame, breaks the tag. A receiver rejects frames whose tag is missing or malformed, whose MAC
does not match (constant-time compare), or whose timestamp is further than ``window_s`` from its
own clock in either direction (a sender's clock may run ahead). Clocks across hosts must agree to
well within the window.

What this is not: no encryption (anyone on the path reads the frames) and no replay cache (a
captured message can be replayed while its timestamp is inside the window; the protocol's epochs
and room ids make most replays harmless, not all). Without a key there is no tag frame at all.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import struct
import time
from collections.abc import Mapping, Sequence
from typing import Final

import attrs

from pdkv.control.errors import AuthenticationError
from pdkv.errors import ConfigError

ENV_KEY: Final = "PDKV_AUTH_KEY"
ENV_WINDOW: Final = "PDKV_AUTH_WINDOW_S"
DEFAULT_WINDOW_S: Final = 30.0
MIN_KEY_BYTES: Final = 16  # a shorter shared secret is guessable; refuse it rather than pretend
TAG_BYTES: Final = 40

_DOMAIN: Final = b"pdkv-control-auth-v1\x00"  # separates these MACs from any other use of the key
_TIMESTAMP: Final = struct.Struct("<Q")
_COUNT: Final = struct.Struct("<I")
_LENGTH: Final = struct.Struct("<Q")


def unix_ms() -> int:
    """The wall clock in unix milliseconds: tags cross processes and hosts, so not a monotonic clock."""
    return time.time_ns() // 1_000_000


def _check_key(_: object, attribute: attrs.Attribute[bytes], value: bytes) -> None:
    if not isinstance(value, bytes):
        raise TypeError(f"{attribute.name} must be bytes, got {type(value).__name__}")
    if len(value) < MIN_KEY_BYTES:
        raise ConfigError(f"authentication key has {len(value)} bytes, at least {MIN_KEY_BYTES} required")


def _check_window(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    is_number = not isinstance(value, bool) and isinstance(value, (int, float))
    if not is_number or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{attribute.name} must be a finite number of seconds > 0, got {value!r}")


@attrs.frozen(kw_only=True)
class Authenticator:
    """Signs outbound frame lists and verifies inbound ones with a shared key (never shown in repr)."""

    key: bytes = attrs.field(repr=False, validator=_check_key)
    window_s: float = attrs.field(default=DEFAULT_WINDOW_S, validator=_check_window)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Authenticator | None:
        """``PDKV_AUTH_KEY`` (its UTF-8 bytes) and ``PDKV_AUTH_WINDOW_S``; None when no key is set.

        A variable that is set but empty is an error, not "no authentication": a deployment that
        meant to turn authentication on must not run without it because of a templating slip.
        """
        source = os.environ if env is None else env
        raw_key = source.get(ENV_KEY)
        if raw_key is None:
            return None
        if not raw_key:
            raise ConfigError(f"{ENV_KEY} is set but empty; unset it to run without authentication")
        raw_window = source.get(ENV_WINDOW)
        if raw_window is None:
            return cls(key=raw_key.encode("utf-8", "surrogateescape"))
        try:
            window = float(raw_window)
        except ValueError:
            raise ConfigError(f"{ENV_WINDOW}={raw_window!r} is not a number of seconds") from None
        return cls(key=raw_key.encode("utf-8", "surrogateescape"), window_s=window)

    def sign(self, frames: Sequence[bytes], now_ms: int) -> list[bytes]:
        """``frames`` with the tag frame appended (signed at ``now_ms``)."""
        timestamp = _TIMESTAMP.pack(now_ms)
        return [*frames, timestamp + self._mac(timestamp, frames)]

    def verify(self, frames: Sequence[bytes], now_ms: int) -> list[bytes]:
        """The frames without their tag; raises ``AuthenticationError`` naming what was wrong."""
        if len(frames) < 2:
            raise AuthenticationError(f"no authentication tag: only {len(frames)} frame(s)")
        tag = frames[-1]
        if len(tag) != TAG_BYTES:
            raise AuthenticationError(
                f"no authentication tag: last frame has {len(tag)} bytes, a tag has {TAG_BYTES}"
            )
        payload = list(frames[:-1])
        timestamp = tag[: _TIMESTAMP.size]
        if not hmac.compare_digest(tag[_TIMESTAMP.size :], self._mac(timestamp, payload)):
            raise AuthenticationError("authentication tag does not verify (wrong key or altered frames)")
        (signed_ms,) = _TIMESTAMP.unpack(timestamp)
        age_ms = now_ms - signed_ms
        if abs(age_ms) > self.window_s * 1000.0:
            raise AuthenticationError(
                f"authentication tag is {age_ms / 1000.0:+.3f} s old, outside the {self.window_s:g} s window"
            )
        return payload

    def _mac(self, timestamp: bytes, frames: Sequence[bytes]) -> bytes:
        mac = hmac.new(self.key, _DOMAIN, hashlib.sha256)
        mac.update(timestamp)
        mac.update(_COUNT.pack(len(frames)))
        for frame in frames:
            mac.update(_LENGTH.pack(len(frame)))
            mac.update(frame)
        return mac.digest()
