"""What both control channels do with frame sets, whatever carries them: sign and encode on the way
out, verify, unpack and decode on the way in, and who may receive.

Owns: ``encode_parts`` (messages -> signed frame sets, an envelope per ``envelope.MAX_MESSAGES``),
``Inbox`` (frame sets -> valid messages, with the counters and the queue of an envelope's messages not
handed out yet) and ``ReceiverClaim`` (one receiving thread at a time). Must not touch a socket: the
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
    """Receiving is one thread at a time: a receive call holds the claim while it runs (``with
    claim:``), and a receive call from another thread meanwhile is refused with
    ``ChannelOwnershipError`` (sockets and a poll set one thread reads must not be read by another at
    the same time). Between calls any thread may receive: a transport's control thread lends
    receiving to a scheduler thread that waits for progress (``pdkv.runtime._loop``), and a control
    thread started again after a failed start takes over. The claim is a lock, so the thread that
    receives next sees everything the last one did (the memory barrier zmq asks for)."""

    def __init__(self, address: str) -> None:
        self._address = address
        self._lock = threading.Lock()
        self._holder: threading.Thread | None = None

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            raise ChannelOwnershipError(
                f"channel {self._address} is being received on by thread {self._holder_name()}, "
                f"used from {threading.current_thread().name!r} at the same time"
            )
        self._holder = threading.current_thread()

    def __exit__(self, *_: object) -> None:
        self._holder = None
        self._lock.release()

    def check_close(self) -> None:
        """``close()`` is refused while another thread is inside a receive call (its sockets would
        close under it): stop that thread's receiving first."""
        holder = self._holder
        if self._lock.locked() and holder is not threading.current_thread():
            raise ChannelOwnershipError(
                f"channel {self._address} is being received on by thread {self._holder_name()}; "
                f"close it once that receive call returned"
            )

    def _holder_name(self) -> str:
        holder = self._holder
        return repr(holder.name) if holder is not None else "another thread"
