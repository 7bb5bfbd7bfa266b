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

Replays: a receiver that keeps a ``ReplayGuard`` rejects a tag it has already accepted while that
tag is inside the window (outside it, the timestamp check rejects it). A sender never signs two
frame sets with the same timestamp (its timestamps strictly increase), so a byte-identical frame set
is always a replay, never a legitimate resend. The guard's memory is bounded by what one window
can carry.

What this is not: no encryption (anyone on the path reads the frames). Without a key there is no
tag frame at all.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import struct
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Final

import attrs

from pdkv import config
from pdkv.control.errors import AuthenticationError
from pdkv.errors import ConfigError

_KEY_VAR: Final = config.text_var(
    "PDKV_AUTH_KEY",
    "Shared secret (>= 16 bytes): HMAC on every control message; unset: none",
    parse=lambda text: text.encode("utf-8", "surrogateescape"),
)
_WINDOW_VAR: Final = config.seconds_var(
    "PDKV_AUTH_WINDOW_S", "Accepted age of a signed message (replay window), seconds"
)
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


class _Stamps:
    """Strictly increasing signing timestamps (unix ms) for one authenticator, any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = 0

    def next(self, now_ms: int) -> int:
        with self._lock:
            self._last = max(now_ms, self._last + 1)
            return self._last


class ReplayGuard:
    """The tags a receiver accepted within the window: a second copy of one is a replay.

    Not thread-safe: one per channel, used by its receiving thread of the moment (the receive claim
    serialises them). Memory: one entry per accepted frame set of the
    last ``window_s`` seconds.
    """

    def __init__(self, window_s: float) -> None:
        self._window_ms = window_s * 1000.0
        self._seen: set[bytes] = set()
        self._order: deque[tuple[int, bytes]] = deque()  # (signed ms, tag) in arrival order
        self.replays = 0

    def check(self, tag: bytes, signed_ms: int, now_ms: int) -> None:
        """Remember ``tag``; raises ``AuthenticationError`` when it was accepted before."""
        horizon = now_ms - 2 * self._window_ms  # past it the window check rejects the tag anyway
        while self._order and self._order[0][0] < horizon:
            self._seen.discard(self._order.popleft()[1])
        if tag in self._seen:
            self.replays += 1
            raise AuthenticationError(
                f"replayed frame set: its tag (signed {now_ms - signed_ms} ms ago) was accepted before"
            )
        self._seen.add(tag)
        self._order.append((signed_ms, tag))

    def __len__(self) -> int:
        return len(self._seen)


@attrs.frozen(kw_only=True)
class Authenticator:
    """Signs outbound frame lists and verifies inbound ones with a shared key (never shown in repr)."""

    key: bytes = attrs.field(repr=False, validator=_check_key, metadata=_KEY_VAR)
    window_s: float = attrs.field(default=DEFAULT_WINDOW_S, validator=_check_window, metadata=_WINDOW_VAR)
    _stamps: _Stamps = attrs.field(factory=_Stamps, repr=False, eq=False, init=False)

    def replay_guard(self) -> ReplayGuard:
        """A fresh guard for one receiver (sized by this authenticator's window)."""
        return ReplayGuard(self.window_s)

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
        return config.from_env(cls, source)

    def sign(self, frames: Sequence[bytes], now_ms: int) -> list[bytes]:
        """``frames`` with the tag frame appended (signed at ``now_ms``, or just after the last
        signature of this authenticator: no two frame sets share a timestamp)."""
        timestamp = _TIMESTAMP.pack(self._stamps.next(now_ms))
        return [*frames, timestamp + self._mac(timestamp, frames)]

    def verify(self, frames: Sequence[bytes], now_ms: int, replay: ReplayGuard | None = None) -> list[bytes]:
        """The frames without their tag; raises ``AuthenticationError`` naming what was wrong (with
        ``replay``, also for a frame set it already accepted)."""
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
        if replay is not None:
            replay.check(tag, signed_ms, now_ms)
        return payload

    def _mac(self, timestamp: bytes, frames: Sequence[bytes]) -> bytes:
        mac = hmac.new(self.key, _DOMAIN, hashlib.sha256)
        mac.update(timestamp)
        mac.update(_COUNT.pack(len(frames)))
        for frame in frames:
            mac.update(_LENGTH.pack(len(frame)))
            mac.update(frame)
        return mac.digest()
