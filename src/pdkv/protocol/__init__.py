"""pdkv.protocol: the control protocol as pure, sans-IO code (DESIGN sections 4 and 5).

- ``messages`` / ``codec``: typed messages and the only module that knows their bytes;
- ``machines``: the room, chunk and abort state machines (``transitions``), and ``KVPoll``;
- ``prefill`` / ``decode``: per-rank endpoints that take messages, scheduler calls, worker results
  and timer ticks (each with ``now``) and return effects as data (``effects``);
- ``config``: every deadline, with ``PDKV_*`` overrides.

Must not do I/O, start threads or read a clock: time is a parameter. Imports only
``pdkv.mapping`` and ``pdkv.errors`` from the rest of pdkv.
"""

from pdkv.protocol.config import Timeouts
from pdkv.protocol.decode import DecodeEndpoint, DecodeStatistics
from pdkv.protocol.effects import (
    ChunkSpec,
    DecodePeer,
    Destination,
    Effect,
    FailureCause,
    ForgetPeer,
    Notice,
    NoticeLevel,
    ReleasePages,
    RoomFinished,
    Send,
    SubmitChunk,
    Target,
)
from pdkv.protocol.ids import Endpoint, Epoch, InstanceId, RoomId, SessionId, room_id
from pdkv.protocol.poll import KVPoll, consensus, consensus_columns
from pdkv.protocol.prefill import PrefillEndpoint, PrefillStatistics

__all__ = [
    "ChunkSpec",
    "DecodeEndpoint",
    "DecodePeer",
    "DecodeStatistics",
    "Destination",
    "Effect",
    "Endpoint",
    "Epoch",
    "FailureCause",
    "ForgetPeer",
    "InstanceId",
    "KVPoll",
    "Notice",
    "NoticeLevel",
    "PrefillEndpoint",
    "PrefillStatistics",
    "ReleasePages",
    "RoomFinished",
    "RoomId",
    "Send",
    "SessionId",
    "SubmitChunk",
    "Target",
    "Timeouts",
    "consensus",
    "consensus_columns",
    "room_id",
]
