"""The pdkv wire format (protocol version 8): messages <-> ZMQ multipart frames.

Owns: every byte of the control protocol: the header, the type-code table, the msgpack body schema of
each message, and the raw array frames. Must not import zmq, do I/O, or know any message's meaning
beyond its fields: ``encode`` takes a validated message, ``decode`` returns one (the classes in
``messages`` validate themselves). ``decode`` is the trust boundary: for ANY input it returns a
message or raises ``RemoteProtocolError``, never anything else.

Wire format, version 8 (normative; another implementation can be written from this text)
=========================================================================================

Changes from version 7: ``TransferRequest`` gains the key ``landing`` (``Landing | nil``): a decode rank
whose TP is below the prefill's leases a landing region per prefill TP rank and room, the prefill rank
writes its KV page items whole into it, and the decode scatters them into its pages before Success
(specs/mapping.md section 15); nil: write into ``dst_pages`` as before.
Changes from version 6 to 7: ``TransferStatus`` gains the key ``checksums`` (``Checksums | nil``): with
``PDKV_KV_CHECKSUM`` a Success status says, per (buffer, page), what the prefill rank wrote, and the
decode rank verifies its pages against it before it reports Success (``SUMS`` array slots).
Changes from version 5 to 6: ``RegisterAck`` gains the keys ``prefill_left_out`` and ``decode_left_out``
(lists of ``BufferRef``): the buffers of each side that the transfers of this pair of ranks leave out,
as the prefill's layout policy allowed (draft-model buffers only one side registers, during a rolling
deployment); both empty when the layouts match.
Changes from version 4 to 5: ``Register`` gains the key ``engine_metadata`` (``bin``, at most 256 KiB),
what the prefill's transfer engine needs beside the session to write into the decode's buffers (NIXL's
agent metadata and registered regions; empty for Mooncake). It is the only ``bin`` value of the format.
Changes from version 3 to 4: ``AbortAck`` gains the key ``fenced`` (bool): a write of the room to the
decode rank failed and the ack follows the fence that proved the engine queue drained (the decode then
cuts its connections from that host, or settles, before reusing the pages).
Changes from version 2 to 3: a side may send several messages to one peer in one envelope
(``pdkv.control.envelope``); the messages themselves are unchanged. The version changed so that a
side that cannot read envelopes refuses the other at registration instead of dropping them.
Changes from version 1 to 2: ``BufferSpec`` gains the key ``heads`` (``Heads | nil``), the KV heads
an MHA/GQA K or V buffer holds, so prefill and decode instances of different TP sizes can register.

A message is a sequence of ``2 + n`` byte frames (one ZMQ multipart message)::

    frame 0        header, exactly 10 bytes, little-endian, struct "<4sHHH":
                     magic    4 bytes   b"PDKV"
                     version  u16       8
                     type     u16       message type code (table below)
                     arrays   u16       n, the number of array frames after the body
    frame 1        body: exactly one msgpack map (at most 1 MiB)
    frame 2 .. 1+n array frames: raw little-endian integers, no header (each at most 256 MiB)

A receiver checks, in this order: 1 <= frame count <= 64; frame 0 is at least 6 bytes and starts with
the magic; the version equals its own (otherwise it reports both versions: the header may grow in a
later version, so magic and version are the only bytes whose position is frozen forever); frame 0 is
exactly 10 bytes; the type code is known; the frame count is exactly ``2 + n``.

Message type codes (stable; never reuse or renumber, 0 is reserved)::

    1 RankAnnounce   2 RouteQuery   3 RouteTable   4 Register    5 RegisterAck   6 RegisterReject
    7 TransferRequest  8 TransferStatus  9 Abort  10 AbortAck  11 Heartbeat  12 HeartbeatAck

Body. msgpack with str (UTF-8) map keys, str for text, no ext types, no duplicate keys, and no bin
value but ``Register.engine_metadata``.
Every map has exactly the keys listed (no missing, no extra); senders write them in the listed order
and receivers do not depend on the order. Integers use msgpack's shortest int encoding on the send
side (receivers accept any int encoding); bool is msgpack true/false and is never an integer; ``float``
is float64 (float32 accepted); ``nil`` only where ``| nil`` is written. Enums travel as their string
value. Value ranges are those of the message classes (``pdkv.protocol.messages``); a receiver rejects
any value outside them. Nested records::

    RankCoord   {"tp": int, "cp": int}
    Origin      {"instance": str, "epoch": int, "rank": RankCoord}
    RankRoute   {"rank": RankCoord, "epoch": int, "endpoint": str, "session": str}
    BufferSpec  {"kind": str, "model": str, "layer_id": int, "base_ptr": int, "length": int,
                 "item_bytes": int, "heads": Heads | nil}
                                        kind: kv k v index_k index_scale swa aux; model: target draft
    Heads       {"kv_heads": int, "head_start": int, "head_count": int, "head_bytes": int,
                 "item_layout": str}    item_layout: token_head head_token; only on k and v buffers
                                        of an mha layout, whose item_bytes is then
                                        page_size x head_count x head_bytes
    Layout      {"attention": str, "page_size": int, "buffers": [BufferSpec, ...]}
                                                    attention: mla mha; buffers in canonical order
    BufferRef   {"kind": str, "model": str, "layer_id": int}
                                        a buffer as both sides name it; values as in BufferSpec
    StateSlot   {"kind": str, "indices": ARRAY}     kind: index_k index_scale swa
    Metric      {"pages": int, "bytes": int, "seconds": float}
    Checksums   {"positions": ARRAY, "kv": SUMS, "state": [StateSums, ...], "aux": SUMS}
                                        positions strictly increasing; kv: KV buffers x positions,
                                        buffer-major; aux: one per aux buffer (empty: none written)
    StateSums   {"kind": str, "count": int, "sums": SUMS}
    Landing     {"address": int, "bytes": int, "first_position": int, "slots": int}
                                        first_position = prefix_pages, first_position + slots = the
                                        request's page count; address, bytes, slots at least 1
                                        kind: index_k index_scale swa; sums: buffers x count

``ARRAY`` is an array slot ``[width, count]`` (a msgpack array of two ints) describing the next array
frame not yet claimed: ``width`` is the item size in bytes, 4 (int32) or 8 (int64), and the frame is
exactly ``width * count`` bytes (an empty array is an empty frame; recording the count makes a
truncated or padded array frame an error instead of a shorter or longer array). Array frames are
claimed in the order their slots appear in the listing below (for TransferRequest: ``dst_pages`` is
frame 2, then one frame per ``dst_state`` entry in list order), and the body claims exactly ``n`` of
them. Senders use width 4 when every value is below 2**31, else 8; receivers accept either width for
any values. Indices are non-negative (a negative int32/int64 is rejected). ``SUMS`` is an array slot
of the same form whose frame holds little-endian uint32 checksums: ``width`` is always 4. Inside
``Checksums`` the frames are claimed in the order ``positions``, ``kv``, each ``state`` entry's
``sums`` in list order, then ``aux``.

Bodies by type (key order as written)::

    1 RankAnnounce    {"origin": Origin, "tp_size": int, "cp_size": int, "endpoint": str, "session": str,
                       "page_size": int, "layout_digest": str}
    2 RouteQuery      {"origin": Origin}
    3 RouteTable      {"origin": Origin, "tp_size": int, "cp_size": int, "page_size": int,
                       "layout_digest": str, "ranks": [RankRoute, ...], "complete": bool}
    4 Register        {"origin": Origin, "tp_size": int, "endpoint": str, "session": str, "layout": Layout,
                       "engine_metadata": bin}
    5 RegisterAck     {"origin": Origin, "prefill_left_out": [BufferRef, ...],
                       "decode_left_out": [BufferRef, ...]}     no buffer twice in one list
    6 RegisterReject  {"origin": Origin, "reason": str, "retry": bool}
    7 TransferRequest {"origin": Origin, "room": int, "dst_pages": ARRAY, "dst_aux_row": int | nil,
                       "dst_state": [StateSlot, ...], "required_dst_info_num": int, "dummy": bool,
                       "prefix_pages": int, "landing": Landing | nil}     a dummy's landing is nil
    8 TransferStatus  {"origin": Origin, "room": int, "outcome": str, "reason": str, "metric": Metric,
                       "checksums": Checksums | nil}
                                                    outcome: success failed; checksums: success only
    9 Abort           {"origin": Origin, "room": int, "reason": str}
   10 AbortAck        {"origin": Origin, "room": int, "fenced": bool}
   11 Heartbeat       {"origin": Origin, "seq": int, "endpoint": str | nil}
   12 HeartbeatAck    {"origin": Origin, "seq": int}

Limits: at most 64 frames, body at most 1 MiB (msgpack strings at most 16 KiB, bin at most 256 KiB,
lists at most 65,536 items, maps at most 16 keys), array frames at most 256 MiB each. ``encode`` refuses (with
``LocalProtocolError``) to produce anything a receiver would reject for size or representability
(an int outside msgpack's range, a str that is not valid Unicode).

Versioning: any change to the header layout, the type table or any body schema is a new version.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from types import MappingProxyType
from typing import Final, TypeAlias, TypeVar

import attrs
import msgpack
import numpy as np
import numpy.typing as npt

from pdkv.errors import LocalProtocolError, RemoteProtocolError
from pdkv.mapping._arrays import int_max
from pdkv.mapping.layout import (
    AttentionKind,
    BufferKind,
    BufferLayout,
    BufferSpec,
    HeadGeometry,
    ItemLayout,
    ModelRole,
)
from pdkv.mapping.layout_policy import BufferKey
from pdkv.protocol.ids import Endpoint, Epoch, InstanceId, RoomId, SessionId
from pdkv.protocol.messages import (
    MAX_ENGINE_METADATA_BYTES,
    Abort,
    AbortAck,
    Heartbeat,
    HeartbeatAck,
    IntArray,
    LandingGrant,
    Message,
    Origin,
    Outcome,
    PageChecksums,
    RankAnnounce,
    RankCoord,
    RankRoute,
    Register,
    RegisterAck,
    RegisterReject,
    RouteQuery,
    RouteTable,
    StateChecksums,
    StateIndices,
    SumArray,
    TransferMetricData,
    TransferRequest,
    TransferStatus,
)

PROTOCOL_VERSION: Final = 8
MAGIC: Final = b"PDKV"
HEADER: Final = struct.Struct("<4sHHH")  # magic, version, type code, number of array frames
_MAGIC_AND_VERSION_BYTES: Final = 6  # the only header bytes whose position no future version may move

MAX_FRAMES: Final = 64
MAX_BODY_BYTES: Final = 1 << 20
MAX_ARRAY_BYTES: Final = 256 << 20
MAX_BODY_STR_BYTES: Final = 16 << 10  # 4,096 characters (the longest text field) of up to 4 UTF-8 bytes
MAX_BODY_LIST_ITEMS: Final = 1 << 16
MAX_BODY_MAP_KEYS: Final = 16
MAX_BODY_BIN_BYTES: Final = MAX_ENGINE_METADATA_BYTES

_INT32_LIMIT: Final = 2**31
_INT32_LE: Final = np.dtype(np.int32).newbyteorder("<")
_INT64_LE: Final = np.dtype(np.int64).newbyteorder("<")
_UINT32_LE: Final = np.dtype(np.uint32).newbyteorder("<")

# Reason prefix of the last line of defence in ``decode``: tests assert it never appears, so a path
# that escapes the specific checks is found by the fuzzer instead of hidden by the catch-all.
UNEXPECTED_FAILURE: Final = "decoder fault"

_ERROR_TEXT_CHARS: Final = 240  # reasons quote peer-controlled text: keep log lines bounded

_T = TypeVar("_T")
_E = TypeVar("_E", bound=Enum)
_Frame: TypeAlias = bytes | bytearray | memoryview
_WireArray: TypeAlias = npt.NDArray[np.int32] | npt.NDArray[np.int64]


def _short(text: str) -> str:
    return text if len(text) <= _ERROR_TEXT_CHARS else text[: _ERROR_TEXT_CHARS - 3] + "..."


def _kind_of(value: object) -> str:
    """msgpack-level name of a decoded value's type, for error messages."""
    if value is None:
        return "nil"
    return {
        bool: "bool",
        int: "int",
        float: "float",
        str: "str",
        bytes: "bin",
        list: "array",
        dict: "map",
    }.get(type(value), type(value).__name__)


# ================================================================ encoding


def _array_slot(values: IntArray, arrays: list[bytes]) -> list[int]:
    """Append ``values`` as the next array frame; return its slot ``[width, count]`` for the body."""
    width = 4 if values.size == 0 or int_max(values) < _INT32_LIMIT else 8
    data = values.astype(_INT32_LE if width == 4 else _INT64_LE, copy=False).tobytes()
    if len(data) > MAX_ARRAY_BYTES:
        raise LocalProtocolError(
            f"array of {values.size} indices exceeds the {MAX_ARRAY_BYTES}-byte frame limit"
        )
    arrays.append(data)
    return [width, values.size]


def _sums_slot(values: SumArray, arrays: list[bytes]) -> list[int]:
    """Append checksums as the next (uint32) array frame; return its slot ``[4, count]``."""
    data = values.astype(_UINT32_LE, copy=False).tobytes()
    if len(data) > MAX_ARRAY_BYTES:
        raise LocalProtocolError(f"{values.size} checksums exceed the {MAX_ARRAY_BYTES}-byte frame limit")
    arrays.append(data)
    return [4, values.size]


def _checksums_body(sums: PageChecksums | None, arrays: list[bytes]) -> dict[str, object] | None:
    if sums is None:
        return None
    # Slots in frame order: positions, kv, the state entries' sums, aux.
    return {
        "positions": _array_slot(sums.positions, arrays),
        "kv": _sums_slot(sums.kv, arrays),
        "state": [
            {"kind": s.kind.value, "count": s.count, "sums": _sums_slot(s.sums, arrays)} for s in sums.state
        ],
        "aux": _sums_slot(sums.aux, arrays),
    }


def _rank_body(rank: RankCoord) -> dict[str, object]:
    return {"tp": rank.tp, "cp": rank.cp}


def _origin_body(origin: Origin) -> dict[str, object]:
    return {"instance": origin.instance, "epoch": origin.epoch, "rank": _rank_body(origin.rank)}


def _heads_body(heads: HeadGeometry) -> dict[str, object]:
    return {
        "kv_heads": heads.kv_heads,
        "head_start": heads.head_start,
        "head_count": heads.head_count,
        "head_bytes": heads.head_bytes,
        "item_layout": heads.item_layout.value,
    }


def _layout_body(layout: BufferLayout) -> dict[str, object]:
    return {
        "attention": layout.attention.value,
        "page_size": layout.page_size,
        "buffers": [
            {
                "kind": b.kind.value,
                "model": b.model.value,
                "layer_id": b.layer_id,
                "base_ptr": b.base_ptr,
                "length": b.length,
                "item_bytes": b.item_bytes,
                "heads": None if b.heads is None else _heads_body(b.heads),
            }
            for b in layout.buffers
        ],
    }


def _buffer_ref_body(key: BufferKey) -> dict[str, object]:
    return {"kind": key.kind.value, "model": key.model.value, "layer_id": key.layer_id}


def _message_body(msg: Message, arrays: list[bytes]) -> dict[str, object]:
    match msg:
        case RankAnnounce():
            return {
                "origin": _origin_body(msg.origin),
                "tp_size": msg.tp_size,
                "cp_size": msg.cp_size,
                "endpoint": msg.endpoint,
                "session": msg.session,
                "page_size": msg.page_size,
                "layout_digest": msg.layout_digest,
            }
        case RouteQuery():
            return {"origin": _origin_body(msg.origin)}
        case RegisterAck():
            return {
                "origin": _origin_body(msg.origin),
                "prefill_left_out": [_buffer_ref_body(k) for k in msg.prefill_left_out],
                "decode_left_out": [_buffer_ref_body(k) for k in msg.decode_left_out],
            }
        case RouteTable():
            return {
                "origin": _origin_body(msg.origin),
                "tp_size": msg.tp_size,
                "cp_size": msg.cp_size,
                "page_size": msg.page_size,
                "layout_digest": msg.layout_digest,
                "ranks": [
                    {
                        "rank": _rank_body(r.rank),
                        "epoch": r.epoch,
                        "endpoint": r.endpoint,
                        "session": r.session,
                    }
                    for r in msg.ranks
                ],
                "complete": msg.complete,
            }
        case Register():
            return {
                "origin": _origin_body(msg.origin),
                "tp_size": msg.tp_size,
                "endpoint": msg.endpoint,
                "session": msg.session,
                "layout": _layout_body(msg.layout),
                "engine_metadata": msg.engine_metadata,
            }
        case RegisterReject():
            return {"origin": _origin_body(msg.origin), "reason": msg.reason, "retry": msg.retry}
        case TransferRequest():
            # Slots are written in frame order: dst_pages first, then dst_state in list order.
            return {
                "origin": _origin_body(msg.origin),
                "room": msg.room,
                "dst_pages": _array_slot(msg.dst_pages, arrays),
                "dst_aux_row": msg.dst_aux_row,
                "dst_state": [
                    {"kind": s.kind.value, "indices": _array_slot(s.indices, arrays)} for s in msg.dst_state
                ],
                "required_dst_info_num": msg.required_dst_info_num,
                "dummy": msg.dummy,
                "prefix_pages": msg.prefix_pages,
                "landing": None
                if msg.landing is None
                else {
                    "address": msg.landing.address,
                    "bytes": msg.landing.nbytes,
                    "first_position": msg.landing.first_position,
                    "slots": msg.landing.slots,
                },
            }
        case TransferStatus():
            return {
                "origin": _origin_body(msg.origin),
                "room": msg.room,
                "outcome": msg.outcome.value,
                "reason": msg.reason,
                "metric": {
                    "pages": msg.metric.pages,
                    "bytes": msg.metric.bytes,
                    # always float64 on the wire, even when the metric was built from an int
                    "seconds": float(msg.metric.seconds),
                },
                "checksums": _checksums_body(msg.checksums, arrays),
            }
        case Abort():
            return {"origin": _origin_body(msg.origin), "room": msg.room, "reason": msg.reason}
        case AbortAck():
            return {"origin": _origin_body(msg.origin), "room": msg.room, "fenced": msg.fenced}
        case Heartbeat():
            return {"origin": _origin_body(msg.origin), "seq": msg.seq, "endpoint": msg.endpoint}
        case HeartbeatAck():
            return {"origin": _origin_body(msg.origin), "seq": msg.seq}


def encode(msg: Message) -> list[bytes]:
    """The frames of ``msg``: header, msgpack body, then one raw frame per index array.

    Raises ``LocalProtocolError`` when ``msg`` is not a message or cannot be represented within the
    limits of the format (a receiver would reject it).
    """
    code = MESSAGE_TYPE_CODES.get(type(msg))
    if code is None:
        raise LocalProtocolError(f"cannot encode {type(msg).__name__}: not a pdkv message class")
    arrays: list[bytes] = []
    body = _message_body(msg, arrays)
    try:
        packed = msgpack.packb(body, use_bin_type=True)
    except (OverflowError, UnicodeEncodeError) as exc:
        # Validators bound most ints, but BufferSpec.base_ptr is not, and str admits lone surrogates.
        raise LocalProtocolError(f"cannot encode {type(msg).__name__}: {_short(str(exc))}") from exc
    if len(packed) > MAX_BODY_BYTES:
        raise LocalProtocolError(
            f"cannot encode {type(msg).__name__}: body of {len(packed)} bytes exceeds {MAX_BODY_BYTES}"
        )
    return [HEADER.pack(MAGIC, PROTOCOL_VERSION, code, len(arrays)), packed, *arrays]


# ================================================================ decoding: typed readers


def _reject(reason: str) -> RemoteProtocolError:
    return RemoteProtocolError(_short(reason))


class _Fields:
    """One msgpack map with exactly the expected keys; every read checks the type and names the path."""

    __slots__ = ("_path", "_values")

    def __init__(self, value: object, path: str, keys: frozenset[str]) -> None:
        if not isinstance(value, dict):
            raise _reject(f"{path} must be a map, got {_kind_of(value)}")
        if value.keys() != keys:
            missing = sorted(keys.difference(value))
            unexpected = sorted(repr(k) for k in value if k not in keys)
            raise _reject(f"{path} has missing keys {missing} and unexpected keys {unexpected}")
        self._values: dict[str, object] = value
        self._path = path

    def path(self, key: str) -> str:
        return f"{self._path}.{key}"

    def raw(self, key: str) -> object:
        """The value as msgpack gave it, unchecked (the typed reads below check it)."""
        return self._values[key]

    def _wrong(self, key: str, expected: str) -> RemoteProtocolError:
        return _reject(f"{self.path(key)} must be {expected}, got {_kind_of(self._values[key])}")

    def read_int(self, key: str) -> int:
        value = self._values[key]
        if type(value) is not int:  # bool is an int subclass, and never an int on this wire
            raise self._wrong(key, "an int")
        return value

    def read_optional_int(self, key: str) -> int | None:
        return None if self._values[key] is None else self.read_int(key)

    def read_text(self, key: str) -> str:
        value = self._values[key]
        if not isinstance(value, str):
            raise self._wrong(key, "a str")
        return value

    def read_optional_text(self, key: str) -> str | None:
        return None if self._values[key] is None else self.read_text(key)

    def read_bytes(self, key: str) -> bytes:
        value = self._values[key]
        if not isinstance(value, bytes):
            raise self._wrong(key, "bin")
        return value

    def read_bool(self, key: str) -> bool:
        value = self._values[key]
        if not isinstance(value, bool):
            raise self._wrong(key, "a bool")
        return value

    def read_float(self, key: str) -> float:
        value = self._values[key]
        if not isinstance(value, float):
            raise self._wrong(key, "a float")
        return value

    def read_enum(self, key: str, enum_type: type[_E]) -> _E:
        text = self.read_text(key)
        try:
            return enum_type(text)
        except ValueError:
            allowed = [str(member.value) for member in enum_type]
            raise _reject(f"{self.path(key)} must be one of {allowed}, got {text!r}") from None

    def read_map(self, key: str, keys: frozenset[str]) -> _Fields:
        return _Fields(self._values[key], self.path(key), keys)

    def read_optional_map(self, key: str, keys: frozenset[str]) -> _Fields | None:
        return None if self._values[key] is None else self.read_map(key, keys)

    def read_list(self, key: str) -> list[object]:
        value = self._values[key]
        if not isinstance(value, list):
            raise self._wrong(key, "an array")
        return value


class _ArrayFrames:
    """The array frames of one message, claimed in order by the body's array slots."""

    __slots__ = ("_claimed", "_views")

    def __init__(self, views: list[memoryview]) -> None:
        self._views = views
        self._claimed = 0

    def claim(self, fields: _Fields, key: str) -> _WireArray:
        """The next array frame, checked against the slot ``[width, count]`` at ``fields[key]``."""
        path = fields.path(key)
        slot = fields.read_list(key)
        width, count = slot if len(slot) == 2 else (None, None)
        if type(width) is not int or type(count) is not int:
            raise _reject(f"{path} must be an array slot [width, count] of two ints")
        if width not in (4, 8):
            raise _reject(f"{path} has item width {width}, expected 4 or 8")
        index = 2 + self._claimed  # frame number, as the sender counts
        if self._claimed == len(self._views):
            raise _reject(f"{path} claims array frame {index}, but the header announces {len(self._views)}")
        view = self._views[self._claimed]
        if view.nbytes % width:
            raise _reject(f"array frame {index} ({path}) has {view.nbytes} bytes, not a multiple of {width}")
        if view.nbytes != width * count:
            raise _reject(
                f"array frame {index} ({path}) holds {view.nbytes // width} items, slot says {count}"
            )
        self._claimed += 1
        # Zero copy here; the message's converter makes its own read-only int64 array.
        return np.frombuffer(view, dtype=_INT32_LE) if width == 4 else np.frombuffer(view, dtype=_INT64_LE)

    def claim_sums(self, fields: _Fields, key: str) -> npt.NDArray[np.uint32]:
        """The next array frame as uint32 checksums, checked against the slot ``[4, count]``."""
        path = fields.path(key)
        slot = fields.read_list(key)
        width, count = slot if len(slot) == 2 else (None, None)
        if type(width) is not int or type(count) is not int:
            raise _reject(f"{path} must be an array slot [width, count] of two ints")
        if width != 4:
            raise _reject(f"{path} has item width {width}, expected 4 (uint32 checksums)")
        index = 2 + self._claimed
        if self._claimed == len(self._views):
            raise _reject(f"{path} claims array frame {index}, but the header announces {len(self._views)}")
        view = self._views[self._claimed]
        if view.nbytes != 4 * count:
            raise _reject(
                f"array frame {index} ({path}) has {view.nbytes} bytes, slot says {count} checksums"
            )
        self._claimed += 1
        return np.frombuffer(view, dtype=_UINT32_LE)

    def check_all_claimed(self) -> None:
        if self._claimed != len(self._views):
            raise _reject(
                f"header announces {len(self._views)} array frames, the body claims {self._claimed}"
            )


def _validated(what: str, make: Callable[[], _T]) -> _T:
    """Run a constructor on decoded values; its validators' ValueError/TypeError become the peer's fault."""
    try:
        return make()
    except (ValueError, TypeError) as exc:
        raise _reject(f"invalid {what}: {exc}") from exc


def _strict_map(pairs: list[tuple[object, object]]) -> dict[object, object]:
    """msgpack object_pairs_hook: a duplicated key is ambiguous (which value wins?), so it is rejected."""
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("map with a duplicated key")
    return result


# ================================================================ decoding: body schemas
#
# Each reader builds its value inside ``_validated``: the field reads raise RemoteProtocolError for a
# wrong type (which passes through), the constructor's validators raise ValueError/TypeError for a
# wrong value (which becomes RemoteProtocolError naming the class). Keyword arguments are evaluated
# left to right, so readers that claim array frames do so in the documented frame order.

_RANK_KEYS: Final = frozenset({"tp", "cp"})
_ORIGIN_KEYS: Final = frozenset({"instance", "epoch", "rank"})
_ROUTE_KEYS: Final = frozenset({"rank", "epoch", "endpoint", "session"})
_SPEC_KEYS: Final = frozenset({"kind", "model", "layer_id", "base_ptr", "length", "item_bytes", "heads"})
_HEADS_KEYS: Final = frozenset({"kv_heads", "head_start", "head_count", "head_bytes", "item_layout"})
_LAYOUT_KEYS: Final = frozenset({"attention", "page_size", "buffers"})
_STATE_KEYS: Final = frozenset({"kind", "indices"})
_BUFFER_REF_KEYS: Final = frozenset({"kind", "model", "layer_id"})
_METRIC_KEYS: Final = frozenset({"pages", "bytes", "seconds"})
_CHECKSUMS_KEYS: Final = frozenset({"positions", "kv", "state", "aux"})
_STATE_SUMS_KEYS: Final = frozenset({"kind", "count", "sums"})
_LANDING_KEYS: Final = frozenset({"address", "bytes", "first_position", "slots"})


def _items(body: _Fields, key: str, keys: frozenset[str]) -> list[_Fields]:
    return [_Fields(item, f"{body.path(key)}[{i}]", keys) for i, item in enumerate(body.read_list(key))]


def _rank(fields: _Fields) -> RankCoord:
    return _validated("RankCoord", lambda: RankCoord(tp=fields.read_int("tp"), cp=fields.read_int("cp")))


_ORIGINS_KEPT: Final = 256
"""Decoded origins kept by their wire values (``_origin``): a rank hears from few peers, and each
sends its one origin on every message, so the map rarely grows past a handful; when full it is
emptied, never scanned."""

_origins: dict[tuple[str, int, int, int], Origin] = {}


def _origin_key(fields: _Fields) -> tuple[str, int, int, int] | None:
    """The origin map's values when each has its exact wire type (so that equal keys mean equal
    values of one type, which validate alike: ``True == 1``, but ``bool`` is not ``int``); None
    otherwise (the full read then names what is wrong)."""
    instance, epoch, rank = fields.raw("instance"), fields.raw("epoch"), fields.raw("rank")
    if type(instance) is not str or type(epoch) is not int or type(rank) is not dict:
        return None
    if rank.keys() != _RANK_KEYS:
        return None
    tp, cp = rank["tp"], rank["cp"]
    if type(tp) is not int or type(cp) is not int:
        return None
    return instance, epoch, tp, cp


def _origin(body: _Fields) -> Origin:
    """The message's origin; one seen before (same wire values) is the Origin validated then."""
    fields = body.read_map("origin", _ORIGIN_KEYS)
    key = _origin_key(fields)
    if key is not None and (seen := _origins.get(key)) is not None:
        return seen
    origin = _validated(
        "Origin",
        lambda: Origin(
            instance=InstanceId(fields.read_text("instance")),
            epoch=Epoch(fields.read_int("epoch")),
            rank=_rank(fields.read_map("rank", _RANK_KEYS)),
        ),
    )
    if key is not None:  # only now: an origin that failed validation is never kept
        if len(_origins) >= _ORIGINS_KEPT:
            _origins.clear()
        _origins[key] = origin
    return origin


def _route(fields: _Fields) -> RankRoute:
    return _validated(
        "RankRoute",
        lambda: RankRoute(
            rank=_rank(fields.read_map("rank", _RANK_KEYS)),
            epoch=Epoch(fields.read_int("epoch")),
            endpoint=Endpoint(fields.read_text("endpoint")),
            session=SessionId(fields.read_text("session")),
        ),
    )


def _spec(fields: _Fields) -> BufferSpec:
    return _validated(
        "BufferSpec",
        lambda: BufferSpec(
            kind=fields.read_enum("kind", BufferKind),
            model=fields.read_enum("model", ModelRole),
            layer_id=fields.read_int("layer_id"),
            base_ptr=fields.read_int("base_ptr"),
            length=fields.read_int("length"),
            item_bytes=fields.read_int("item_bytes"),
            heads=_optional_heads(fields.read_optional_map("heads", _HEADS_KEYS)),
        ),
    )


def _optional_heads(fields: _Fields | None) -> HeadGeometry | None:
    if fields is None:
        return None
    return _validated(
        "Heads",
        lambda: HeadGeometry(
            kv_heads=fields.read_int("kv_heads"),
            head_start=fields.read_int("head_start"),
            head_count=fields.read_int("head_count"),
            head_bytes=fields.read_int("head_bytes"),
            item_layout=fields.read_enum("item_layout", ItemLayout),
        ),
    )


def _layout(fields: _Fields) -> BufferLayout:
    # The plain constructor, not ``build``: a layout out of canonical order is the sender's error.
    return _validated(
        "BufferLayout",
        lambda: BufferLayout(
            attention=fields.read_enum("attention", AttentionKind),
            page_size=fields.read_int("page_size"),
            buffers=tuple(_spec(item) for item in _items(fields, "buffers", _SPEC_KEYS)),
        ),
    )


def _buffer_ref(fields: _Fields) -> BufferKey:
    # BufferKey raises LayoutError (a ValueError) for a layer id out of range: the peer's fault.
    return _validated(
        "BufferRef",
        lambda: BufferKey(
            model=fields.read_enum("model", ModelRole),
            kind=fields.read_enum("kind", BufferKind),
            layer_id=fields.read_int("layer_id"),
        ),
    )


def _state_slot(fields: _Fields, arrays: _ArrayFrames) -> StateIndices:
    return _validated(
        "StateIndices",
        lambda: StateIndices(
            kind=fields.read_enum("kind", BufferKind),
            indices=arrays.claim(fields, "indices"),
        ),
    )


def _metric(fields: _Fields) -> TransferMetricData:
    return _validated(
        "TransferMetricData",
        lambda: TransferMetricData(
            pages=fields.read_int("pages"),
            bytes=fields.read_int("bytes"),
            seconds=fields.read_float("seconds"),
        ),
    )


def _state_sums(fields: _Fields, arrays: _ArrayFrames) -> StateChecksums:
    return _validated(
        "StateSums",
        lambda: StateChecksums(
            kind=fields.read_enum("kind", BufferKind),
            count=fields.read_int("count"),
            sums=arrays.claim_sums(fields, "sums"),
        ),
    )


def _checksums(fields: _Fields | None, arrays: _ArrayFrames) -> PageChecksums | None:
    if fields is None:
        return None
    # Claim order is frame order: positions, kv, each state entry's sums, aux.
    positions = arrays.claim(fields, "positions")
    kv = arrays.claim_sums(fields, "kv")
    state = tuple(_state_sums(item, arrays) for item in _items(fields, "state", _STATE_SUMS_KEYS))
    aux = arrays.claim_sums(fields, "aux")
    return _validated("Checksums", lambda: PageChecksums(positions=positions, kv=kv, state=state, aux=aux))


def _decode_rank_announce(body: _Fields, _: _ArrayFrames) -> RankAnnounce:
    return _validated(
        "RankAnnounce",
        lambda: RankAnnounce(
            origin=_origin(body),
            tp_size=body.read_int("tp_size"),
            cp_size=body.read_int("cp_size"),
            endpoint=Endpoint(body.read_text("endpoint")),
            session=SessionId(body.read_text("session")),
            page_size=body.read_int("page_size"),
            layout_digest=body.read_text("layout_digest"),
        ),
    )


def _decode_route_query(body: _Fields, _: _ArrayFrames) -> RouteQuery:
    return _validated("RouteQuery", lambda: RouteQuery(origin=_origin(body)))


def _decode_route_table(body: _Fields, _: _ArrayFrames) -> RouteTable:
    ranks = tuple(_route(item) for item in _items(body, "ranks", _ROUTE_KEYS))
    return _validated(
        "RouteTable",
        lambda: RouteTable(
            origin=_origin(body),
            tp_size=body.read_int("tp_size"),
            cp_size=body.read_int("cp_size"),
            page_size=body.read_int("page_size"),
            layout_digest=body.read_text("layout_digest"),
            ranks=ranks,
            complete=body.read_bool("complete"),
        ),
    )


def _decode_register(body: _Fields, _: _ArrayFrames) -> Register:
    return _validated(
        "Register",
        lambda: Register(
            origin=_origin(body),
            tp_size=body.read_int("tp_size"),
            endpoint=Endpoint(body.read_text("endpoint")),
            session=SessionId(body.read_text("session")),
            layout=_layout(body.read_map("layout", _LAYOUT_KEYS)),
            engine_metadata=body.read_bytes("engine_metadata"),
        ),
    )


def _decode_register_ack(body: _Fields, _: _ArrayFrames) -> RegisterAck:
    prefill = tuple(_buffer_ref(item) for item in _items(body, "prefill_left_out", _BUFFER_REF_KEYS))
    decode = tuple(_buffer_ref(item) for item in _items(body, "decode_left_out", _BUFFER_REF_KEYS))
    return _validated(
        "RegisterAck",
        lambda: RegisterAck(origin=_origin(body), prefill_left_out=prefill, decode_left_out=decode),
    )


def _decode_register_reject(body: _Fields, _: _ArrayFrames) -> RegisterReject:
    return _validated(
        "RegisterReject",
        lambda: RegisterReject(
            origin=_origin(body), reason=body.read_text("reason"), retry=body.read_bool("retry")
        ),
    )


def _landing(fields: _Fields | None) -> LandingGrant | None:
    if fields is None:
        return None
    return _validated(
        "Landing",
        lambda: LandingGrant(
            address=fields.read_int("address"),
            nbytes=fields.read_int("bytes"),
            first_position=fields.read_int("first_position"),
            slots=fields.read_int("slots"),
        ),
    )


def _decode_transfer_request(body: _Fields, arrays: _ArrayFrames) -> TransferRequest:
    # Claim order is frame order: dst_pages, then each dst_state entry in list order.
    dst_pages = arrays.claim(body, "dst_pages")
    dst_state = tuple(_state_slot(item, arrays) for item in _items(body, "dst_state", _STATE_KEYS))
    landing = _landing(body.read_optional_map("landing", _LANDING_KEYS))
    return _validated(
        "TransferRequest",
        lambda: TransferRequest(
            origin=_origin(body),
            room=RoomId(body.read_int("room")),
            dst_pages=dst_pages,
            dst_aux_row=body.read_optional_int("dst_aux_row"),
            dst_state=dst_state,
            required_dst_info_num=body.read_int("required_dst_info_num"),
            dummy=body.read_bool("dummy"),
            prefix_pages=body.read_int("prefix_pages"),
            landing=landing,
        ),
    )


def _decode_transfer_status(body: _Fields, arrays: _ArrayFrames) -> TransferStatus:
    checksums = _checksums(body.read_optional_map("checksums", _CHECKSUMS_KEYS), arrays)
    return _validated(
        "TransferStatus",
        lambda: TransferStatus(
            origin=_origin(body),
            room=RoomId(body.read_int("room")),
            outcome=body.read_enum("outcome", Outcome),
            reason=body.read_text("reason"),
            metric=_metric(body.read_map("metric", _METRIC_KEYS)),
            checksums=checksums,
        ),
    )


def _decode_abort(body: _Fields, _: _ArrayFrames) -> Abort:
    return _validated(
        "Abort",
        lambda: Abort(
            origin=_origin(body), room=RoomId(body.read_int("room")), reason=body.read_text("reason")
        ),
    )


def _decode_abort_ack(body: _Fields, _: _ArrayFrames) -> AbortAck:
    return _validated(
        "AbortAck",
        lambda: AbortAck(
            origin=_origin(body), room=RoomId(body.read_int("room")), fenced=body.read_bool("fenced")
        ),
    )


def _decode_heartbeat(body: _Fields, _: _ArrayFrames) -> Heartbeat:
    def build() -> Heartbeat:
        endpoint = body.read_optional_text("endpoint")
        return Heartbeat(
            origin=_origin(body),
            seq=body.read_int("seq"),
            endpoint=None if endpoint is None else Endpoint(endpoint),
        )

    return _validated("Heartbeat", build)


def _decode_heartbeat_ack(body: _Fields, _: _ArrayFrames) -> HeartbeatAck:
    return _validated("HeartbeatAck", lambda: HeartbeatAck(origin=_origin(body), seq=body.read_int("seq")))


@attrs.frozen
class _WireType:
    """One row of the type table: the stable code, the class, its body keys, and its body reader."""

    code: int
    message_class: type[Message]
    keys: frozenset[str]
    read: Callable[[_Fields, _ArrayFrames], Message]


def _keys(*names: str) -> frozenset[str]:
    return frozenset(("origin", *names))


# The explicit table. Codes are part of the protocol: append new types, never renumber or reuse.
_WIRE_TYPES: Final = (
    _WireType(
        1,
        RankAnnounce,
        _keys("tp_size", "cp_size", "endpoint", "session", "page_size", "layout_digest"),
        _decode_rank_announce,
    ),
    _WireType(2, RouteQuery, _keys(), _decode_route_query),
    _WireType(
        3,
        RouteTable,
        _keys("tp_size", "cp_size", "page_size", "layout_digest", "ranks", "complete"),
        _decode_route_table,
    ),
    _WireType(
        4, Register, _keys("tp_size", "endpoint", "session", "layout", "engine_metadata"), _decode_register
    ),
    _WireType(5, RegisterAck, _keys("prefill_left_out", "decode_left_out"), _decode_register_ack),
    _WireType(6, RegisterReject, _keys("reason", "retry"), _decode_register_reject),
    _WireType(
        7,
        TransferRequest,
        _keys(
            "room",
            "dst_pages",
            "dst_aux_row",
            "dst_state",
            "required_dst_info_num",
            "dummy",
            "prefix_pages",
            "landing",
        ),
        _decode_transfer_request,
    ),
    _WireType(
        8, TransferStatus, _keys("room", "outcome", "reason", "metric", "checksums"), _decode_transfer_status
    ),
    _WireType(9, Abort, _keys("room", "reason"), _decode_abort),
    _WireType(10, AbortAck, _keys("room", "fenced"), _decode_abort_ack),
    _WireType(11, Heartbeat, _keys("seq", "endpoint"), _decode_heartbeat),
    _WireType(12, HeartbeatAck, _keys("seq"), _decode_heartbeat_ack),
)
_WIRE_TYPE_BY_CODE: Final = {row.code: row for row in _WIRE_TYPES}

MESSAGE_TYPE_CODES: Final[Mapping[type[Message], int]] = MappingProxyType(
    {row.message_class: row.code for row in _WIRE_TYPES}
)
"""Stable type code of every message class (the header's ``type`` field)."""


# ================================================================ decoding: frames


def _frame_view(frame: object, index: int, limit: int) -> memoryview:
    """A flat byte view of one frame, or the reason it is not one (type, size, layout)."""
    try:
        view = memoryview(frame)  # type: ignore[arg-type]  # any object may arrive; TypeError is handled
    except TypeError:
        raise _reject(f"frame {index} has type {type(frame).__name__}, not a bytes-like buffer") from None
    except ValueError as exc:  # e.g. a released memoryview
        raise _reject(f"frame {index} is not a readable buffer: {exc}") from None
    if view.nbytes > limit:
        raise _reject(f"frame {index} has {view.nbytes} bytes, limit {limit}")
    if not view.c_contiguous:
        raise _reject(f"frame {index} is not a contiguous buffer")
    if view.format == "B" and view.ndim == 1:
        return view
    try:
        return view.cast("B")  # other formats and shapes: read as the bytes they are
    except (TypeError, ValueError) as exc:
        raise _reject(f"frame {index} cannot be read as bytes: {exc}") from None


def _read_header(frame: object) -> tuple[_WireType, int]:
    # Bounded by the body limit, not the v1 header size: a longer header of a later version must still
    # reach the version check and be reported as a version mismatch.
    view = _frame_view(frame, 0, MAX_BODY_BYTES)
    if view.nbytes < _MAGIC_AND_VERSION_BYTES:
        raise _reject(f"header frame has {view.nbytes} bytes, expected {HEADER.size}")
    if bytes(view[:4]) != MAGIC:
        raise _reject(f"bad magic {bytes(view[:4])!r}, expected {MAGIC!r}")
    version = int.from_bytes(view[4:6], "little")
    if version != PROTOCOL_VERSION:
        raise _reject(f"peer speaks protocol version {version}, this side speaks version {PROTOCOL_VERSION}")
    if view.nbytes != HEADER.size:
        raise _reject(f"header frame has {view.nbytes} bytes, expected {HEADER.size}")
    _, _, code, array_count = HEADER.unpack(view)
    wire_type = _WIRE_TYPE_BY_CODE.get(code)
    if wire_type is None:
        raise _reject(f"unknown message type {code}")
    return wire_type, array_count


def _unpack_body(view: memoryview) -> object:
    try:
        body: object = msgpack.unpackb(
            view,
            use_list=True,
            raw=False,
            strict_map_key=True,
            object_pairs_hook=_strict_map,
            max_str_len=MAX_BODY_STR_BYTES,
            max_bin_len=MAX_BODY_BIN_BYTES,  # Register.engine_metadata, the only bin value
            max_ext_len=0,  # ... and no ext types (not even msgpack's timestamp)
            max_array_len=MAX_BODY_LIST_ITEMS,
            max_map_len=MAX_BODY_MAP_KEYS,
        )
    except ValueError as exc:  # msgpack's format/limit/extra-data/depth errors and UnicodeDecodeError
        raise _reject(f"body is not valid msgpack: {exc}") from exc
    return body


def _decode_frames(frames: Sequence[_Frame]) -> Message:
    try:
        frame_count = len(frames)
    except TypeError:
        raise _reject(f"frames must be a sequence, got {type(frames).__name__}") from None
    if frame_count == 0:
        raise _reject("no frames")
    if frame_count > MAX_FRAMES:
        raise _reject(f"{frame_count} frames, limit {MAX_FRAMES}")
    wire_type, array_count = _read_header(frames[0])
    name = wire_type.message_class.__name__
    if frame_count != 2 + array_count:
        raise _reject(f"{name}: header announces {array_count} array frames, got {frame_count} frames in all")
    body = _unpack_body(_frame_view(frames[1], 1, MAX_BODY_BYTES))
    arrays = _ArrayFrames([_frame_view(frames[i], i, MAX_ARRAY_BYTES) for i in range(2, frame_count)])
    try:
        message = wire_type.read(_Fields(body, "body", wire_type.keys), arrays)
        arrays.check_all_claimed()
    except RemoteProtocolError as exc:
        raise _reject(f"{name}: {exc}") from exc
    return message


def decode(frames: Sequence[_Frame]) -> Message:
    """The message carried by ``frames`` (as ``encode`` makes them); raises only ``RemoteProtocolError``.

    Any frame type with the buffer protocol is accepted (bytes, bytearray, memoryview, zmq frames'
    buffers). The result never aliases the frames: the message classes copy their arrays.
    """
    try:
        return _decode_frames(frames)
    except RemoteProtocolError:
        raise
    except Exception as exc:
        # Last line of defence only: every known path raises a specific RemoteProtocolError above, and the
        # fuzz tests assert this prefix never shows up. Kept so that untrusted bytes can never raise
        # anything else into a control loop.
        raise _reject(f"{UNEXPECTED_FAILURE}: {type(exc).__name__}: {exc}") from exc
