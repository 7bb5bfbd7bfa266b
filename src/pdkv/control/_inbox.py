"""What both control channels do with frame sets, whatever carries them: sign and encode on the way
out, verify, unpack and decode on the way in, and who may receive.

Owns: ``encode_parts`` (messages -> signed frame sets, an envelope per ``envelope.MAX_MESSAGES``),
``Inbox`` (frame sets -> valid messages, with the counters and the queue of an envelope's messages not
handed out yet) and ``ReceiverClaim`` (the one-owner rule of receiving). Must not touch a socket: the
zmq channel (``channel``) and the stream channel (``stream``) hand their frame sets in and take
messages out, so the two cannot differ in what they accept.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from typing import Generic

import attrs

from pdkv.control import envelope
from pdkv.control._sockets import WarningLimiter
from pdkv.control.auth import Authenticator, unix_ms
from pdkv.control.errors import AuthenticationError, ChannelOwnershipError
from pdkv.control.framing import M, WireCodec

log = logging.getLogger("pdkv.control.channel")


@attrs.frozen
class Part:
    """One frame set to send: its frames (signed), how many messages it carries, what to call it."""

    frames: list[bytes]
    count: int
    what: str


def encode_parts(codec: WireCodec[M], auth: Authenticator | None, messages: Sequence[M]) -> list[Part]:
    """``messages`` for one peer as frame sets, in order: one message alone, several in envelopes of
    at most ``envelope.MAX_MESSAGES``. Encoding and signing happen here, outside any socket lock."""
    parts: list[Part] = []
    for start in range(0, len(messages), envelope.MAX_MESSAGES):
        chunk = messages[start : start + envelope.MAX_MESSAGES]
        encoded = [codec.encode(m) for m in chunk]
        frames = encoded[0] if len(chunk) == 1 else envelope.pack(encoded)
        if auth is not None:
            frames = auth.sign(frames, unix_ms())
        parts.append(Part(frames, len(chunk), type(chunk[-1]).__name__))
    return parts


class SendCounts:
    """The sending side's counters of a channel (changed under its send lock, read from any thread)."""

    __slots__ = ("dropped", "envelopes", "sent")

    def __init__(self) -> None:
        self.sent = 0
        self.dropped = 0
        self.envelopes = 0

    def queued(self, part: Part) -> None:
        self.sent += part.count
        if part.count > 1:
            self.envelopes += 1


class Inbox(Generic[M]):
    """The receiving half of a channel: frame sets in, valid messages out, bad input counted.

    One thread uses it (the channel's receiver). Frames that fail authentication or decoding are
    counted, logged at WARNING with the reason (rate-limited) and skipped: nothing a peer sends raises.
    """

    def __init__(self, codec: WireCodec[M], auth: Authenticator | None, address: str) -> None:
        self._codec = codec
        self._auth = auth
        self._replay = None if auth is None else auth.replay_guard()
        self._address = address
        self.warnings = WarningLimiter(log)
        self.pending: deque[M] = deque()  # accepted, not handed out yet
        self.received = 0
        self.malformed = 0
        self.unauthenticated = 0
        self.envelopes_received = 0

    @property
    def replayed(self) -> int:
        return 0 if self._replay is None else self._replay.replays

    def counters(self, sends: SendCounts, peers: int) -> dict[str, int]:
        """The fields of ``ChannelStatistics``: this inbox's counters, ``sends``' and ``peers``."""
        return {
            "received": self.received,
            "malformed": self.malformed,
            "unauthenticated": self.unauthenticated,
            "replayed": self.replayed,
            "sent": sends.sent,
            "dropped_sends": sends.dropped,
            "peers": peers,
            "envelopes_sent": sends.envelopes,
            "envelopes_received": self.envelopes_received,
        }

    def take(self, limit: int) -> list[M]:
        """Up to ``limit`` of the accepted messages, oldest first."""
        pending = self.pending
        if len(pending) <= limit:
            out = list(pending)
            pending.clear()
            return out
        return [pending.popleft() for _ in range(limit)]

    def accept(self, frames: list[bytes]) -> None:
        """Queue the valid messages of one frame set (one message, or an envelope's)."""
        if self._auth is not None:
            try:
                frames = self._auth.verify(frames, unix_ms(), self._replay)
            except AuthenticationError as exc:
                self.unauthenticated += 1
                self.warnings.warning("control channel %s rejected a frame set: %s", self._address, exc)
                return
        if not envelope.is_envelope(frames):
            self._decode(frames)
            return
        try:
            inner = envelope.unpack(frames)
        except envelope.EnvelopeError as exc:
            self.malformed += 1
            self.warnings.warning("control channel %s skipped a malformed envelope: %s", self._address, exc)
            return
        self.envelopes_received += 1
        for message_frames in inner:
            self._decode(message_frames)

    def _decode(self, frames: list[bytes]) -> None:
        try:
            message = self._codec.decode(frames)
        except self._codec.decode_error as exc:
            self.malformed += 1
            self.warnings.warning("control channel %s skipped a malformed frame set: %s", self._address, exc)
            return
        self.received += 1
        self.pending.append(message)


class ReceiverClaim:
    """Receiving has one owner thread: the first that receives; once it ended, the next one.

    (Sockets that one thread reads must not be read by another at the same time; a transport whose
    start failed and was retried starts a new control thread on the same channel, which takes over.)
    """

    def __init__(self, address: str) -> None:
        self._address = address
        self._owner: threading.Thread | None = None
        self._lock = threading.Lock()

    def check(self) -> None:
        """Claim the channel for this thread, or ``ChannelOwnershipError`` while another owns it."""
        current = threading.current_thread()
        if self._owner is current:
            return
        with self._lock:
            owner = self._owner
            if owner is None or not owner.is_alive():
                self._owner = current
                return
        raise ChannelOwnershipError(
            f"channel {self._address} is owned by thread {owner.name!r}, used from {current.name!r}"
        )

    def check_close(self) -> None:
        """``close()`` belongs to the owner, or to any thread once the owner has ended."""
        owner = self._owner
        if owner is not None and owner is not threading.current_thread() and owner.is_alive():
            raise ChannelOwnershipError(
                f"channel {self._address} is owned by thread {owner.name!r}, still running; "
                f"close it there, or after that thread ended"
            )
