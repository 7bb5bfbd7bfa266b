"""Several messages to one peer in one frame set: the envelope a channel sends them in.

Owns: ``pack`` / ``unpack`` of the envelope and its limits. Must not know messages (each message's
frames are the codec's, carried unchanged) nor sockets. Pure: no I/O.

Why: a rank that finishes several rooms in one control-loop turn has several messages for the same
peer (statuses to a decode rank, transfer requests to a prefill rank). One frame set costs one
socket call, one authentication tag and one receive instead of one each per message.

Format, version 1 (normative, with ``specs/protocol.md`` section 8):

    frame 0    magic b"PDKE" (4 bytes), envelope version u16 little-endian (1),
               message count n u16 little-endian (2 <= n <= MAX_MESSAGES)      8 bytes in all
    frame 1    n x u16 little-endian: how many frames each message has (each >= 1)
    frame 2..  the frames of message 1, then those of message 2, ... (sum of the counts in all)

The magic differs from the codec's (``PDKV``), so a frame set is either one message or one envelope,
told apart by its first four bytes. A receiver rejects (as one malformed frame set) an envelope of
another version, a count out of range, frame counts that do not add up to the frames present; the
messages inside are then decoded one by one, and one that fails decoding costs only itself. An
authentication tag (``pdkv.control.auth``) covers the whole envelope.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Final

MAGIC: Final = b"PDKE"
VERSION: Final = 1
MAX_MESSAGES: Final = 1024
HEADER: Final = struct.Struct("<4sHH")


class EnvelopeError(ValueError):
    """The frame set starts like an envelope but is not a valid one (the peer sent bad bytes)."""


def is_envelope(frames: Sequence[bytes | memoryview]) -> bool:
    """Does this frame set start with the envelope's magic (rather than one message's)?"""
    return bool(frames) and bytes(frames[0][:4]) == MAGIC


def pack(messages: Sequence[Sequence[bytes]]) -> list[bytes]:
    """One frame set carrying ``messages`` (each a message's frames, in order); 2..MAX_MESSAGES."""
    count = len(messages)
    if not 2 <= count <= MAX_MESSAGES:
        raise ValueError(f"an envelope carries 2..{MAX_MESSAGES} messages, got {count}")
    sizes = [len(frames) for frames in messages]
    if min(sizes) < 1 or max(sizes) > 0xFFFF:
        raise ValueError(f"every message has 1..65535 frames, got {sizes}")
    out = [HEADER.pack(MAGIC, VERSION, count), struct.pack(f"<{count}H", *sizes)]
    for frames in messages:
        out.extend(frames)
    return out


def unpack(frames: Sequence[bytes]) -> list[list[bytes]]:
    """The messages' frame sets inside an envelope (``is_envelope`` was true), or ``EnvelopeError``."""
    if len(frames) < 2:
        raise EnvelopeError(f"an envelope has a header and a size frame, got {len(frames)} frames")
    header = frames[0]
    if len(header) != HEADER.size:
        raise EnvelopeError(f"envelope header of {len(header)} bytes, expected {HEADER.size}")
    magic, version, count = HEADER.unpack(header)
    if magic != MAGIC:
        raise EnvelopeError(f"envelope magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise EnvelopeError(f"peer sends envelope version {version}, this side reads version {VERSION}")
    if not 2 <= count <= MAX_MESSAGES:
        raise EnvelopeError(f"envelope of {count} messages, expected 2..{MAX_MESSAGES}")
    if len(frames[1]) != 2 * count:
        raise EnvelopeError(f"size frame of {len(frames[1])} bytes for {count} messages")
    sizes = struct.unpack(f"<{count}H", frames[1])
    if min(sizes) < 1 or sum(sizes) != len(frames) - 2:
        raise EnvelopeError(
            f"frame counts of {count} messages (first {list(sizes[:8])}) do not cover the "
            f"{len(frames) - 2} frames carried"
        )
    messages: list[list[bytes]] = []
    at = 2
    for size in sizes:
        messages.append(list(frames[at : at + size]))
        at += size
    return messages
