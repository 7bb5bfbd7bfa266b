"""Tests of the wire codec: round trips, the frozen byte format, and decode's only-RemoteProtocolError rule.

Generated decode inputs in the default run (the issue asks for at least 10,000 across the fuzz tests):
  test_mutated_encodings_decode_or_raise_remote_error   300 examples x 40 mutation chains = 12,000
  test_random_frames_raise_only_remote_error              600
  test_random_msgpack_bodies_raise_only_remote_error      600
  test_any_other_version_is_named_with_ours               200
  test_any_other_magic_is_rejected                        100
  test_mutated_head_layouts_decode_or_raise_remote_error  60 x 40 = 2,400 (version 2 heads)
  test_mutated_engine_metadata_decode_or_raise_remote_error 60 x 40 = 2,400 (version 5 metadata)
  test_mutated_register_acks_decode_or_raise_remote_error   60 x 40 = 2,400 (version 6 left-out lists)
  test_mutated_landing_grants_decode_or_raise_remote_error  60 x 40 = 2,400 (version 8 landing grants)
  total                                                23,100
plus 780 round-trip examples (60 per class, 60 for the buffer types) and every prefix and extension of
every frame of one message. Every fuzz input must decode to a message that survives re-encoding, or
raise RemoteProtocolError whose reason is not the decoder's catch-all (UNEXPECTED_FAILURE).
"""

from __future__ import annotations

import copy
import random
import struct
from collections.abc import Callable, Sequence

import attrs
import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdkv.errors import LocalProtocolError, RemoteProtocolError
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
from pdkv.protocol.codec import (
    _ORIGINS_KEPT,
    HEADER,
    MAGIC,
    MAX_ARRAY_BYTES,
    MAX_BODY_BYTES,
    MAX_FRAMES,
    MESSAGE_TYPE_CODES,
    PROTOCOL_VERSION,
    UNEXPECTED_FAILURE,
    _origins,
    decode,
    encode,
)
from pdkv.protocol.ids import Endpoint, Epoch, InstanceId, RoomId, SessionId
from pdkv.protocol.messages import (
    MAX_ENGINE_METADATA_BYTES,
    MAX_INDEX,
    MESSAGE_TYPES,
    Abort,
    AbortAck,
    Heartbeat,
    HeartbeatAck,
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
    TransferRequest,
    TransferStatus,
)
from tests.protocol.strategies import STRATEGY_BY_CLASS, messages, register_acks

Frames = list[bytes]

ORIGIN = Origin(instance=InstanceId("d0"), epoch=Epoch(3), rank=RankCoord(tp=1, cp=0))


def golden_request() -> TransferRequest:
    return TransferRequest(
        origin=ORIGIN,
        room=RoomId(42),
        dst_pages=[5, 6, 7],
        dst_aux_row=9,
        dst_state=[StateIndices(kind=BufferKind.SWA, indices=[1, 2])],
        required_dst_info_num=2,
    )


def body_of(frames: Sequence[bytes]) -> dict[str, object]:
    """The body frame as plain msgpack data (read independently of the codec)."""
    body = msgpack.unpackb(frames[1], raw=False)
    assert isinstance(body, dict)
    return body


def with_body(frames: Sequence[bytes], body: object) -> Frames:
    return [frames[0], msgpack.packb(body), *frames[2:]]


def rejection(frames: object) -> str:
    """decode's reason for refusing ``frames`` (fails the test if it decodes or raises anything else)."""
    with pytest.raises(RemoteProtocolError) as caught:
        decode(frames)  # type: ignore[arg-type]  # deliberately ill-typed inputs are part of the contract
    reason = str(caught.value)
    assert UNEXPECTED_FAILURE not in reason
    return reason


# ================================================================ round trips


@pytest.mark.parametrize("message_class", MESSAGE_TYPES, ids=lambda cls: cls.__name__)
@settings(max_examples=60)
@given(data=st.data())
def test_every_message_class_round_trips(message_class: type[Message], data: st.DataObject) -> None:
    message = data.draw(STRATEGY_BY_CLASS[message_class])
    frames = encode(message)
    decoded = decode(frames)
    assert type(decoded) is message_class
    assert decoded == message
    # The encoding is canonical: decoding then encoding again gives the same bytes.
    assert encode(decoded) == frames


@settings(max_examples=60)
@given(message=messages())
def test_round_trip_accepts_every_buffer_type(message: Message) -> None:
    frames = encode(message)
    assert decode([bytearray(f) for f in frames]) == message
    assert decode([memoryview(f) for f in frames]) == message
    assert decode(tuple(frames)) == message


def test_type_codes_are_the_documented_stable_numbers() -> None:
    assert {
        RankAnnounce: 1,
        RouteQuery: 2,
        RouteTable: 3,
        Register: 4,
        RegisterAck: 5,
        RegisterReject: 6,
        TransferRequest: 7,
        TransferStatus: 8,
        Abort: 9,
        AbortAck: 10,
        Heartbeat: 11,
        HeartbeatAck: 12,
    } == MESSAGE_TYPE_CODES
    assert set(MESSAGE_TYPE_CODES) == set(MESSAGE_TYPES)


# ================================================================ the frozen format


def test_golden_transfer_request_bytes() -> None:
    """Written by hand from the codec docstring; a change here is a change of the wire format."""
    header = b"PDKV" + b"\x08\x00" + b"\x07\x00" + b"\x02\x00"  # version 8, type 7, two array frames
    body = (
        b"\x89"  # map of 9, keys in the documented order
        + b"\xa6origin"
        + (b"\x83" + b"\xa8instance" + b"\xa2d0" + b"\xa5epoch" + b"\x03")
        + (b"\xa4rank" + b"\x82" + b"\xa2tp" + b"\x01" + b"\xa2cp" + b"\x00")
        + b"\xa4room"
        + b"\x2a"
        + b"\xa9dst_pages"
        + b"\x92\x04\x03"  # slot [width 4, count 3]
        + b"\xabdst_aux_row"
        + b"\x09"
        + b"\xa9dst_state"
        + (b"\x91" + b"\x82" + b"\xa4kind" + b"\xa3swa" + b"\xa7indices" + b"\x92\x04\x02")
        + (b"\xb5required_dst_info_num" + b"\x02")
        + (b"\xa5dummy" + b"\xc2")
        + (b"\xacprefix_pages" + b"\x00")
        + (b"\xa7landing" + b"\xc0")
    )
    pages = b"\x05\x00\x00\x00" + b"\x06\x00\x00\x00" + b"\x07\x00\x00\x00"
    swa = b"\x01\x00\x00\x00" + b"\x02\x00\x00\x00"
    golden = [header, body, pages, swa]

    assert encode(golden_request()) == golden
    assert decode(golden) == golden_request()


def granted_request() -> TransferRequest:
    return attrs.evolve(
        golden_request(),
        prefix_pages=1,
        landing=LandingGrant(address=0x10000, nbytes=4096, first_position=1, slots=2),
    )


def test_golden_transfer_request_with_landing_bytes() -> None:
    """Version 8's landing grant, written by hand from the codec docstring."""
    frames = encode(granted_request())
    body = frames[1]
    tail = (
        (b"\xacprefix_pages" + b"\x01")
        + b"\xa7landing"
        + b"\x84"
        + (b"\xa7address" + b"\xce\x00\x01\x00\x00")  # uint32 65536
        + (b"\xa5bytes" + b"\xcd\x10\x00")  # uint16 4096
        + (b"\xaefirst_position" + b"\x01")
        + (b"\xa5slots" + b"\x02")
    )
    assert body.endswith(tail)
    assert body[:1] == b"\x89"
    assert frames[0] == b"PDKV\x08\x00\x07\x00\x02\x00"
    assert decode(frames) == granted_request()


def test_landing_grant_errors() -> None:
    good = encode(granted_request())

    def reason_with(**landing: object) -> str:
        body = body_of(good)
        grant = dict(body["landing"])  # type: ignore[call-overload]  # a dict: the body read back
        grant.update(landing)
        body["landing"] = grant
        return rejection(with_body(good, body))

    assert "invalid Landing: address must be an int in [1," in reason_with(address=0)
    assert "invalid Landing: slots must be an int in [1," in reason_with(slots=0)
    assert "body.landing has missing keys ['slots']" in rejection(
        with_body(good, {**body_of(good), "landing": {"address": 1, "bytes": 1, "first_position": 1}})
    )
    # A window that is not the request's positions after its prefix is refused as a whole request.
    assert "invalid TransferRequest: the landing window 1+1 is not the request's positions 1..2" in (
        reason_with(slots=1)
    )
    # A dummy carries no grant.
    dummy = body_of(good)
    dummy.update(dummy=True, dst_pages=[4, 0], dst_aux_row=None, dst_state=[], prefix_pages=0)
    dummy["landing"] = {"address": 1, "bytes": 1, "first_position": 0, "slots": 1}
    assert "invalid TransferRequest: a dummy TransferRequest carries no destination" in rejection(
        [good[0][:-2] + b"\x01\x00", msgpack.packb(dummy), b""]
    )


def test_header_layout() -> None:
    frames = encode(Heartbeat(origin=ORIGIN, seq=1))
    assert len(frames) == 2
    assert frames[0] == b"PDKV\x08\x00\x0b\x00\x00\x00"
    assert HEADER.size == 10 and MAGIC == b"PDKV" and PROTOCOL_VERSION == 8


@pytest.mark.parametrize(
    ("pages", "width"),
    [
        ([], 4),
        ([0, 2**31 - 1], 4),
        ([0, 2**31], 8),
        ([MAX_INDEX - 1], 8),
    ],
)
def test_array_width_switches_from_int32_to_int64(pages: list[int], width: int) -> None:
    message = TransferRequest(origin=ORIGIN, room=RoomId(1), dst_pages=pages)
    frames = encode(message)
    assert body_of(frames)["dst_pages"] == [width, len(pages)]
    assert frames[2] == b"".join(p.to_bytes(width, "little") for p in pages)
    decoded = decode(frames)
    assert isinstance(decoded, TransferRequest)
    assert decoded.dst_pages.tolist() == pages
    assert decoded.dst_pages.dtype == np.int64


def test_receiver_accepts_int64_for_small_values() -> None:
    """A foreign sender may always use width 8; the values, not the width, define the message."""
    body = body_of(encode(golden_request()))
    body["dst_pages"] = [8, 3]
    frames = with_body(encode(golden_request()), body)
    frames[2] = np.array([5, 6, 7], dtype="<i8").tobytes()
    assert decode(frames) == golden_request()


def test_decoded_arrays_are_read_only_int64_copies_of_the_frames() -> None:
    frames: list[bytearray] = [bytearray(f) for f in encode(golden_request())]
    decoded = decode(frames)
    assert isinstance(decoded, TransferRequest)
    frames[2][0] = 99  # the sender's buffer is reused after decode
    assert decoded.dst_pages.tolist() == [5, 6, 7]
    assert decoded.dst_pages.dtype == np.int64
    assert not decoded.dst_pages.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        decoded.dst_pages[0] = 1


# ================================================================ specific rejections


def test_frame_count_and_type_errors() -> None:
    good = encode(golden_request())
    assert rejection([]) == "no frames"
    assert "frames must be a sequence" in rejection(None)
    assert "frames must be a sequence" in rejection(12)
    assert f"{MAX_FRAMES + 1} frames, limit {MAX_FRAMES}" in rejection([good[0]] * (MAX_FRAMES + 1))
    assert "frame 1 has type str, not a bytes-like buffer" in rejection([good[0], "body", *good[2:]])
    assert "frame 0 has type NoneType" in rejection([None])
    assert "header announces 2 array frames, got 3 frames" in rejection(good[:3])
    assert "header announces 2 array frames, got 5 frames" in rejection([*good, b""])


def test_header_errors() -> None:
    good = encode(golden_request())
    assert "header frame has 3 bytes, expected 10" in rejection([b"PDK", *good[1:]])
    assert "bad magic b'PDKW', expected b'PDKV'" in rejection([b"PDKW" + good[0][4:], *good[1:]])
    assert "header frame has 11 bytes, expected 10" in rejection([good[0] + b"\x00", *good[1:]])
    for code in (0, 13, 65535):
        header = HEADER.pack(MAGIC, PROTOCOL_VERSION, code, 2)
        assert f"unknown message type {code}" in rejection([header, *good[1:]])


def test_other_version_is_reported_before_the_header_size() -> None:
    """A later version may lengthen the header: the peer still learns it is a version mismatch."""
    v9_header = MAGIC + struct.pack("<H", 9) + bytes(30)
    reason = rejection([v9_header, b"whatever v9 sends"])
    assert reason == "peer speaks protocol version 9, this side speaks version 8"


def test_body_msgpack_errors() -> None:
    good = encode(golden_request())
    assert "body is not valid msgpack" in rejection([good[0], b"\xc1", *good[2:]])
    assert "body is not valid msgpack" in rejection([good[0], good[1][:-1], *good[2:]])
    assert "body is not valid msgpack" in rejection([good[0], good[1] + b"\x00", *good[2:]])
    # A declared length far beyond the frame must fail on the limit, not allocate.
    assert "exceeds max_array_len" in rejection([good[0], b"\xdd\xff\xff\xff\xff", *good[2:]])
    assert "body is not valid msgpack" in rejection([good[0], b"\x91" * 5000 + b"\x00", *good[2:]])
    # bin is parsed (Register.engine_metadata is one), bounded, and refused where the schema has none.
    over = MAX_ENGINE_METADATA_BYTES + 1
    too_long_bin = b"\xc6" + over.to_bytes(4, "big") + bytes(over)
    assert "exceeds max_bin_len" in rejection([good[0], too_long_bin, *good[2:]])
    assert "body.origin must be a map, got bin" in rejection(
        with_body(good, {**body_of(good), "origin": b"raw"})
    )
    ext = msgpack.packb({"origin": msgpack.ExtType(5, b"x")})
    assert "body is not valid msgpack" in rejection([good[0], ext, *good[2:]])
    duplicated = b"\x82" + b"\xa4room" + b"\x01" + b"\xa4room" + b"\x02"
    assert "duplicated key" in rejection([good[0], duplicated, *good[2:]])
    assert "not allowed for map key" in rejection([good[0], b"\x81\x01\x02", *good[2:]])


def test_body_schema_errors_name_the_field() -> None:
    good = encode(golden_request())

    def reason_with(change: Callable[[dict[str, object]], object]) -> str:
        body = body_of(good)
        change(body)
        return rejection(with_body(good, body))

    assert "TransferRequest: body must be a map, got array" in rejection(with_body(good, [1, 2]))
    assert "missing keys ['room']" in reason_with(lambda b: b.pop("room"))
    assert "unexpected keys [\"'extra'\"]" in reason_with(lambda b: b.update(extra=1))
    assert "body.room must be an int, got str" in reason_with(lambda b: b.update(room="42"))
    assert "body.room must be an int, got bool" in reason_with(lambda b: b.update(room=True))
    assert "body.dummy must be a bool, got int" in reason_with(lambda b: b.update(dummy=0))
    assert "body.dst_aux_row must be an int, got float" in reason_with(lambda b: b.update(dst_aux_row=1.0))
    assert "body.origin must be a map, got nil" in reason_with(lambda b: b.update(origin=None))
    assert "body.origin.rank has missing keys ['cp']" in reason_with(
        lambda b: b.update(origin={"instance": "d0", "epoch": 3, "rank": {"tp": 1}})
    )
    assert "body.dst_state[0].kind must be one of" in reason_with(
        lambda b: b.update(dst_state=[{"kind": "bogus", "indices": [4, 2]}])
    )


def test_body_values_out_of_range_are_validation_errors() -> None:
    good = encode(golden_request())

    def reason_with(**changes: object) -> str:
        body = body_of(good)
        body.update(changes)
        return rejection(with_body(good, body))

    assert reason_with(room=0).startswith(
        "TransferRequest: invalid TransferRequest: room must be an int in [1,"
    )
    assert "invalid Origin: epoch must be an int in [0," in reason_with(
        origin={"instance": "d0", "epoch": -1, "rank": {"tp": 1, "cp": 0}}
    )
    assert "invalid RankCoord: tp must be an int in [0, 4095], got 4096" in reason_with(
        origin={"instance": "d0", "epoch": 3, "rank": {"tp": 4096, "cp": 0}}
    )
    assert "invalid StateIndices: kv is not a state buffer kind" in reason_with(
        dst_state=[{"kind": "kv", "indices": [4, 2]}]
    )
    assert "invalid TransferRequest: a dummy TransferRequest carries no destination" in reason_with(
        dummy=True
    )
    # A negative int32 on the wire is a negative index, whatever its bit pattern would mean unsigned.
    frames = encode(golden_request())
    frames[2] = b"\xff\xff\xff\xff" + frames[2][4:]
    assert "invalid TransferRequest: indices must be in [0, 2**62)" in rejection(frames)


def test_an_origin_seen_before_is_still_checked_field_by_field() -> None:
    """Decoded origins are kept by their wire values: a value equal to a kept one but of another
    type (``True == 1``, ``1.0 == 1``) or out of range must still be refused, every time."""
    good = encode(golden_request())
    assert decode(good).origin == ORIGIN  # kept: d0, epoch 3, tp1/cp0

    def origin_with(instance: object, epoch: object, tp: object, cp: object) -> Frames:
        body = body_of(good)
        body["origin"] = {"instance": instance, "epoch": epoch, "rank": {"tp": tp, "cp": cp}}
        return with_body(good, body)

    one = origin_with("d0", 1, 1, 0)
    assert decode(one).origin == Origin(instance=InstanceId("d0"), epoch=Epoch(1), rank=RankCoord(tp=1))
    for _ in range(2):  # the refusal does not depend on what was decoded before
        assert "body.origin.epoch must be an int, got bool" in rejection(origin_with("d0", True, 1, 0))
        assert "body.origin.rank.tp must be an int, got bool" in rejection(origin_with("d0", 3, True, 0))
        assert "body.origin.rank.cp must be an int, got float" in rejection(origin_with("d0", 3, 1, 0.0))
        assert "invalid Origin: epoch must be an int in [0," in rejection(origin_with("d0", -1, 1, 0))
    again = decode(one).origin
    assert again == decode(one).origin and again.epoch == 1 and type(again.epoch) is int


def test_kept_origins_are_bounded() -> None:
    good = encode(golden_request())
    for n in range(_ORIGINS_KEPT + 50):
        body = body_of(good)
        body["origin"] = {"instance": f"peer-{n}", "epoch": n, "rank": {"tp": 0, "cp": 0}}
        decoded = decode(with_body(good, body)).origin
        assert decoded.instance == f"peer-{n}" and decoded.epoch == n
        assert len(_origins) <= _ORIGINS_KEPT


def test_nested_validation_errors_for_layouts_and_routes() -> None:
    spec = BufferSpec(
        kind=BufferKind.KV, model=ModelRole.TARGET, layer_id=0, base_ptr=4096, length=64, item_bytes=16
    )
    layout = BufferLayout.build(attention=AttentionKind.MLA, page_size=16, buffers=[spec])
    register = Register(
        origin=ORIGIN, tp_size=2, endpoint=Endpoint("tcp://h:1"), session=SessionId("h:2"), layout=layout
    )
    frames = encode(register)
    body = body_of(frames)
    layout_body = body["layout"]
    assert isinstance(layout_body, dict)
    other = dict(layout_body["buffers"][0], kind="k")
    layout_body["buffers"] = [other, layout_body["buffers"][0]]  # K before KV: not canonical order
    assert "invalid BufferLayout: buffers must be in canonical order" in rejection(with_body(frames, body))
    layout_body["buffers"] = [dict(other, length=65)]
    assert "invalid BufferSpec: target k layer 0: length 65 is not a multiple of item_bytes 16" in rejection(
        with_body(frames, body)
    )

    route = RankRoute(rank=RankCoord(tp=0), epoch=Epoch(1), endpoint=Endpoint("e"), session=SessionId("s"))
    table = RouteTable(
        origin=ORIGIN, tp_size=1, cp_size=1, page_size=16, layout_digest="ab", ranks=(route,), complete=True
    )
    frames = encode(table)
    body = body_of(frames)
    body["ranks"] = [*body["ranks"], *body["ranks"]]  # type: ignore[misc]  # it is a list on the wire
    assert "invalid RouteTable: route table lists a rank twice" in rejection(with_body(frames, body))


def test_array_frame_errors() -> None:
    good = encode(golden_request())

    def reason_with_slot(slot: object) -> str:
        body = body_of(good)
        body["dst_pages"] = slot
        return rejection(with_body(good, body))

    assert "body.dst_pages must be an array, got int" in reason_with_slot(4)
    assert "body.dst_pages must be an array slot [width, count] of two ints" in reason_with_slot([4])
    assert "body.dst_pages must be an array slot [width, count] of two ints" in reason_with_slot([4, "3"])
    assert "body.dst_pages has item width 2, expected 4 or 8" in reason_with_slot([2, 6])
    assert "array frame 2 (body.dst_pages) holds 3 items, slot says 4" in reason_with_slot([4, 4])
    assert "array frame 2 (body.dst_pages) holds 3 items, slot says 2" in reason_with_slot([4, 2])
    assert "array frame 2 (body.dst_pages) has 12 bytes, not a multiple of 8" in reason_with_slot([8, 1])
    assert "has 11 bytes, not a multiple of 4" in rejection([*good[:2], good[2][:-1], good[3]])

    # The header and the body must agree on the number of array frames.
    fewer = [HEADER.pack(MAGIC, PROTOCOL_VERSION, 7, 1), *good[1:3]]
    assert "body.dst_state[0].indices claims array frame 3, but the header announces 1" in rejection(fewer)
    more = [HEADER.pack(MAGIC, PROTOCOL_VERSION, 7, 3), *good[1:], b""]
    assert "header announces 3 array frames, the body claims 2" in rejection(more)


def golden_status() -> TransferStatus:
    return TransferStatus(
        origin=ORIGIN,
        room=RoomId(42),
        outcome=Outcome.SUCCESS,
        checksums=PageChecksums(
            positions=[3, 4],
            kv=[1, 2, 3, 0xFFFFFFFF],
            state=[StateChecksums(kind=BufferKind.SWA, count=1, sums=[9])],
            aux=[7],
        ),
    )


def test_golden_status_with_checksums_bytes() -> None:
    """Version 7's field, written by hand from the codec docstring: raw uint32 frames, in the order
    positions, kv, state sums, aux."""
    header = b"PDKV" + b"\x08\x00" + b"\x08\x00" + b"\x04\x00"  # version 8, type 8, four array frames
    body = (
        b"\x86"
        + b"\xa6origin"
        + (b"\x83" + b"\xa8instance" + b"\xa2d0" + b"\xa5epoch" + b"\x03")
        + (b"\xa4rank" + b"\x82" + b"\xa2tp" + b"\x01" + b"\xa2cp" + b"\x00")
        + (b"\xa4room" + b"\x2a")
        + (b"\xa7outcome" + b"\xa7success")
        + (b"\xa6reason" + b"\xa0")
        + b"\xa6metric"
        + (b"\x83" + b"\xa5pages\x00" + b"\xa5bytes\x00" + b"\xa7seconds" + b"\xcb" + bytes(8))
        + b"\xa9checksums"
        + b"\x84"
        + (b"\xa9positions" + b"\x92\x04\x02")
        + (b"\xa2kv" + b"\x92\x04\x04")
        + (b"\xa5state" + b"\x91\x83" + b"\xa4kind\xa3swa" + b"\xa5count\x01" + b"\xa4sums\x92\x04\x01")
        + (b"\xa3aux" + b"\x92\x04\x01")
    )
    positions = b"\x03\x00\x00\x00\x04\x00\x00\x00"
    kv = b"\x01\x00\x00\x00\x02\x00\x00\x00\x03\x00\x00\x00\xff\xff\xff\xff"
    golden = [header, body, positions, kv, b"\x09\x00\x00\x00", b"\x07\x00\x00\x00"]

    assert encode(golden_status()) == golden
    decoded = decode(golden)
    assert decoded == golden_status()
    assert isinstance(decoded, TransferStatus) and decoded.checksums is not None
    assert decoded.checksums.kv.dtype == np.uint32 and not decoded.checksums.kv.flags.writeable
    assert decoded.checksums.kv_matrix().tolist() == [[1, 2], [3, 0xFFFFFFFF]]


def test_checksum_frame_errors() -> None:
    good = encode(golden_status())

    def reason_with(**changes: object) -> str:
        body = body_of(good)
        sums = body["checksums"]
        assert isinstance(sums, dict)
        sums.update(changes)
        return rejection(with_body(good, body))

    assert "body.checksums.kv has item width 8, expected 4 (uint32 checksums)" in reason_with(kv=[8, 2])
    assert "array frame 3 (body.checksums.kv) has 16 bytes, slot says 3 checksums" in reason_with(kv=[4, 3])
    no_aux = body_of(good)
    del no_aux["checksums"]["aux"]  # type: ignore[attr-defined]  # a dict: the golden body
    assert "body.checksums has missing keys ['aux']" in rejection(with_body(good, no_aux))
    # Values the message classes refuse: the decoder names the class.
    backwards = [*good[:2], b"\x04\x00\x00\x00\x03\x00\x00\x00", *good[3:]]
    assert "invalid Checksums: positions must be strictly increasing" in rejection(backwards)
    short_kv = [*good[:3], good[3][:12], *good[4:]]
    short_body = body_of(good)
    short_body["checksums"]["kv"] = [4, 3]  # type: ignore[index]  # a dict: the golden body
    assert "invalid Checksums: 3 KV checksums do not fill buffers of 2 positions" in rejection(
        with_body(short_kv, short_body)
    )
    assert "invalid StateSums" in reason_with(state=[{"kind": "swa", "count": 2, "sums": [4, 1]}])
    assert "invalid StateSums: kv is not a state buffer kind" in reason_with(
        state=[{"kind": "kv", "count": 1, "sums": [4, 1]}]
    )
    # A Failed status never carries checksums.
    failed = body_of(good)
    failed["outcome"], failed["reason"] = "failed", "x"
    assert "a Failed status carries no checksums" in rejection(with_body(good, failed))


def test_oversized_and_odd_buffers() -> None:
    good = encode(golden_request())
    assert f"frame 1 has {MAX_BODY_BYTES + 1} bytes, limit {MAX_BODY_BYTES}" in rejection(
        [good[0], bytes(MAX_BODY_BYTES + 1), *good[2:]]
    )
    huge = np.empty(MAX_ARRAY_BYTES + 4, dtype=np.uint8)  # never touched: the size check comes first
    assert f"frame 2 has {MAX_ARRAY_BYTES + 4} bytes, limit {MAX_ARRAY_BYTES}" in rejection(
        [*good[:2], huge.data, good[3]]
    )
    strided = np.arange(6, dtype=np.int32)[::2].data
    assert "frame 2 is not a contiguous buffer" in rejection([*good[:2], strided, good[3]])
    released = memoryview(b"gone")
    released.release()
    assert "frame 2 is not a readable buffer" in rejection([*good[:2], released, good[3]])
    # A contiguous multi-byte-format buffer is read as its bytes.
    as_int32 = np.array([5, 6, 7], dtype="<i4").data
    assert decode([*good[:2], as_int32, good[3]]) == golden_request()


def test_every_prefix_and_extension_of_every_frame_is_rejected() -> None:
    """Array slots record their count, so no cut at an item boundary passes for a shorter array."""
    good = encode(golden_request())
    for index, frame in enumerate(good):
        for cut in range(len(frame)):
            rejection([*good[:index], frame[:cut], *good[index + 1 :]])
        for extra in (b"\x00", b"\x00" * 4, b"\x00" * 8):
            rejection([*good[:index], frame + extra, *good[index + 1 :]])


# ================================================================ encoding limits


def test_encode_refuses_what_a_receiver_would_reject() -> None:
    with pytest.raises(LocalProtocolError, match="not a pdkv message class"):
        encode(ORIGIN)  # type: ignore[arg-type]  # the runtime check behind the static one
    # The message classes refuse what cannot travel (values past 2**63, lone surrogates) ...
    with pytest.raises(ValueError, match="base_ptr"):
        BufferSpec(
            kind=BufferKind.KV, model=ModelRole.TARGET, layer_id=0, base_ptr=2**64, length=0, item_bytes=1
        )
    with pytest.raises(ValueError, match="lone surrogate"):
        Abort(origin=ORIGIN, room=RoomId(1), reason="lone surrogate \ud800")
    # ... and encode still refuses an object whose fields were forced past validation.
    forced = Abort(origin=ORIGIN, room=RoomId(1), reason="fine")
    object.__setattr__(forced, "reason", "lone surrogate \ud800")
    with pytest.raises(LocalProtocolError, match="cannot encode Abort"):
        encode(forced)
    many = [
        RankRoute(
            rank=RankCoord(tp=tp), epoch=Epoch(0), endpoint=Endpoint("e" * 256), session=SessionId("s" * 256)
        )
        for tp in range(4096)
    ]
    table = RouteTable(
        origin=ORIGIN, tp_size=4096, cp_size=1, page_size=1, layout_digest="ab", ranks=many, complete=True
    )
    with pytest.raises(LocalProtocolError, match=f"exceeds {MAX_BODY_BYTES}"):
        encode(table)


def test_longest_texts_and_widest_values_round_trip() -> None:
    reason = "\U0001f600" * 4096  # 4 UTF-8 bytes each: the longest reason in bytes
    for message in (
        Abort(origin=ORIGIN, room=RoomId(2**63 - 1), reason=reason),
        TransferRequest(
            origin=Origin(
                instance=InstanceId("\U0001f600" * 256),
                epoch=Epoch(2**63 - 1),
                rank=RankCoord(tp=4095, cp=4095),
            ),
            room=RoomId(1),
            dst_pages=[MAX_INDEX - 1, 0],
            dst_aux_row=MAX_INDEX - 1,
            required_dst_info_num=4096,
        ),
    ):
        assert decode(encode(message)) == message


# ================================================================ fuzzing


def decode_or_reject(frames: object) -> None:
    """The fuzz oracle: a message that survives re-encoding, or RemoteProtocolError from a known path."""
    try:
        message = decode(frames)  # type: ignore[arg-type]  # fuzz inputs are deliberately ill-typed
    except RemoteProtocolError as exc:
        assert UNEXPECTED_FAILURE not in str(exc), str(exc)
        return
    assert type(message) in MESSAGE_TYPE_CODES
    assert decode(encode(message)) == message


_INTERESTING_INTS = [0, 1, -1, 2, 3, 4, 8, 12, 255, 4095, 4096, 2**31 - 1, 2**31, 2**62 - 1, 2**62]
_INTERESTING_INTS += [2**63 - 1, 2**63, 2**64 - 1, -(2**63)]
_INTERESTING_TEXTS = ["", "x", "kv", "k", "swa", "aux", "index_k", "mla", "mha", "draft", "target"]
_INTERESTING_TEXTS += ["success", "failed", "origin", "\x00", "é" * 300]


def _evil_value(rng: random.Random) -> object:
    choice = rng.randrange(9)
    if choice == 0:
        return rng.choice(_INTERESTING_INTS)
    if choice == 1:
        return rng.randint(-(2**63), 2**64 - 1)
    if choice == 2:
        return rng.choice([True, False, None])
    if choice == 3:
        return rng.choice([0.0, -1.0, 0.5, float("nan"), float("inf"), 1e300])
    if choice == 4:
        return rng.choice(_INTERESTING_TEXTS)
    if choice == 5:
        return rng.choice([b"", b"\x01"])
    if choice == 6:
        return rng.choice([[], [4, 3], [8, 1], [4, -1], [4, 2**40], [4, 2, 1], [[4, 3]]])
    if choice == 7:
        return rng.choice([{}, {"tp": 1, "cp": 0}, {"kind": "swa", "indices": [4, 2]}])
    return [rng.randrange(3) for _ in range(rng.randrange(4))]


@attrs.frozen(eq=False)
class _Place:
    """One slot of a decoded msgpack structure: a key of a map or an index of a list."""

    container: dict[object, object] | list[object]
    key: object

    def get(self) -> object:
        if isinstance(self.container, dict):
            return self.container[self.key]
        assert isinstance(self.key, int)
        return self.container[self.key]

    def put(self, value: object) -> None:
        if isinstance(self.container, dict):
            self.container[self.key] = value
        else:
            assert isinstance(self.key, int)
            self.container[self.key] = value

    def remove(self) -> None:
        if isinstance(self.container, dict):
            del self.container[self.key]
        else:
            assert isinstance(self.key, int)
            del self.container[self.key]


def _places(node: object) -> list[_Place]:
    found: list[_Place] = []
    if isinstance(node, dict):
        for key, child in node.items():
            found.append(_Place(node, key))
            found.extend(_places(child))
    elif isinstance(node, list):
        for index, child in enumerate(node):
            found.append(_Place(node, index))
            found.extend(_places(child))
    return found


def _mutate_body(body_frame: bytes, rng: random.Random) -> bytes:
    """Change the decoded structure (not the bytes), so the mutation reaches the schema checks."""
    body = msgpack.unpackb(body_frame, raw=False, strict_map_key=False)
    places = _places(body)
    if not places:
        return msgpack.packb(_evil_value(rng))
    place = rng.choice(places)
    action = rng.randrange(4)
    if action == 0:
        place.remove()
    elif action == 1 and isinstance(place.container, dict):
        place.container[rng.choice(["extra", "room", "kind", "origin"])] = _evil_value(rng)
    elif action == 2:
        place.put(
            copy.deepcopy(rng.choice(places).get())
        )  # a plausible value in the wrong place (copied: no cycles)
    else:
        place.put(_evil_value(rng))
    return msgpack.packb(body)


def _mutate_header(header: bytes, rng: random.Random) -> bytes:
    magic, version, code, arrays = header[:4], PROTOCOL_VERSION, 7, 0
    if len(header) == HEADER.size:
        magic, version, code, arrays = HEADER.unpack(header)
    field = rng.randrange(3)
    if field == 0:
        code = rng.choice([rng.randint(1, 12), rng.randint(0, 65535)])  # type confusion, mostly valid codes
    elif field == 1:
        arrays = rng.randint(0, 5)
    else:
        version = rng.choice([0, 1, 2, 3, 4, 6, 7, 65535])
    return HEADER.pack(magic, version, code, arrays)


def _mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    operation = rng.randrange(5)
    position = rng.randrange(len(data)) if data else 0
    if operation == 0 and data:  # flip one bit
        return data[:position] + bytes([data[position] ^ (1 << rng.randrange(8))]) + data[position + 1 :]
    if operation == 1 and data:  # overwrite one byte
        return data[:position] + bytes([rng.randrange(256)]) + data[position + 1 :]
    if operation == 2:  # truncate
        return data[:position]
    if operation == 3:  # extend
        return data + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
    return bytes(rng.randrange(256) for _ in range(rng.randrange(24)))  # replace


def _mutate_frame_list(frames: list[object], rng: random.Random) -> list[object]:
    index = rng.randrange(len(frames))
    operation = rng.randrange(6)
    if operation == 0:
        del frames[index]
    elif operation == 1:
        frames.insert(index, frames[index])
    elif operation == 2:
        other = rng.randrange(len(frames))
        frames[index], frames[other] = frames[other], frames[index]
    elif operation == 3:  # an object that is not a buffer at all
        frames[index] = rng.choice(["text", 7, None, [b"x"], 1.5])
    elif operation == 4 and isinstance(frames[index], bytes):  # another, valid, buffer type
        frames[index] = rng.choice([bytearray, memoryview])(frames[index])
    else:
        frames.append(bytes(rng.randrange(256) for _ in range(rng.randrange(16))))
    return frames


def _mutate(frames: list[object], rng: random.Random) -> list[object]:
    """One mutation, weighted towards the ones that get past the header into the schema checks."""
    frames = list(frames)
    if not frames:
        return [bytes(rng.randrange(256) for _ in range(rng.randrange(12)))]
    category = rng.random()
    if category < 0.45 and len(frames) > 1 and isinstance(frames[1], bytes):
        try:
            frames[1] = _mutate_body(frames[1], rng)
        except (ValueError, TypeError):  # an earlier mutation already broke the body (TypeError: map key)
            frames[1] = _mutate_bytes(frames[1], rng)
    elif category < 0.55 and isinstance(frames[0], bytes):
        frames[0] = _mutate_header(frames[0], rng)  # type confusion, array count, version
    elif category < 0.85:
        index = rng.randrange(len(frames))
        # Mostly the body and arrays: a broken header is the least interesting failure.
        index = rng.randrange(1, len(frames)) if len(frames) > 1 and rng.random() < 0.8 else index
        frame = frames[index]
        if isinstance(frame, (bytes, bytearray, memoryview)):
            frames[index] = _mutate_bytes(bytes(frame), rng)
    else:
        frames = _mutate_frame_list(frames, rng)
    return frames


MUTATIONS_PER_MESSAGE = 40


@settings(max_examples=300)
@given(message=messages(), seed=st.integers(0, 2**32 - 1))
def test_mutated_encodings_decode_or_raise_remote_error(message: Message, seed: int) -> None:
    """300 examples x 40 mutation chains = 12,000 decoded inputs; a chain compounds 1 to 3 mutations."""
    rng = random.Random(seed)
    original: list[object] = list(encode(message))
    for _ in range(MUTATIONS_PER_MESSAGE):
        frames = original
        for _ in range(rng.choice([1, 1, 2, 3])):
            frames = _mutate(frames, rng)
        decode_or_reject(frames)


_header_frames = st.builds(
    HEADER.pack,
    st.just(MAGIC) | st.binary(min_size=4, max_size=4),
    st.integers(0, 3),
    st.integers(0, 14),
    st.integers(0, 4),
)
_random_frames = st.one_of(
    st.lists(st.binary(max_size=40), max_size=6),
    st.tuples(_header_frames, st.lists(st.binary(max_size=40), max_size=5)).map(lambda t: [t[0], *t[1]]),
)


@settings(max_examples=600)
@given(frames=_random_frames)
def test_random_frames_raise_only_remote_error(frames: list[bytes]) -> None:
    decode_or_reject(frames)


_FIELD_NAMES = sorted(
    {
        "origin",
        "instance",
        "epoch",
        "rank",
        "tp",
        "cp",
        "tp_size",
        "cp_size",
        "endpoint",
        "session",
        "page_size",
    }
    | {"layout_digest", "ranks", "complete", "layout", "attention", "buffers", "kind", "model", "layer_id"}
    | {
        "base_ptr",
        "length",
        "item_bytes",
        "reason",
        "room",
        "dst_pages",
        "dst_aux_row",
        "dst_state",
        "indices",
    }
    | {"required_dst_info_num", "dummy", "outcome", "metric", "pages", "bytes", "seconds", "seq"}
    | {"heads", "kv_heads", "head_start", "head_count", "head_bytes", "item_layout"}
)
_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.sampled_from(_INTERESTING_INTS)
    | st.floats()
    | st.sampled_from(_INTERESTING_TEXTS)
    | st.text(max_size=8)
    | st.binary(max_size=2),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(_FIELD_NAMES) | st.text(max_size=4), children, max_size=6)
    ),
    max_leaves=16,
)


@settings(max_examples=600)
@given(
    code=st.integers(1, 12),
    body=st.dictionaries(st.sampled_from(_FIELD_NAMES), _msgpack_values, max_size=8),
    arrays=st.lists(st.binary(max_size=24), max_size=3),
)
def test_random_msgpack_bodies_raise_only_remote_error(
    code: int, body: dict[str, object], arrays: list[bytes]
) -> None:
    """Well-formed msgpack with plausible keys: gets past the parser into the schema checks."""
    decode_or_reject([HEADER.pack(MAGIC, PROTOCOL_VERSION, code, len(arrays)), msgpack.packb(body), *arrays])


@settings(max_examples=200)
@given(message=messages(), version=st.integers(0, 65535).filter(lambda v: v != PROTOCOL_VERSION))
def test_any_other_version_is_named_with_ours(message: Message, version: int) -> None:
    frames = encode(message)
    frames[0] = MAGIC + struct.pack("<H", version) + frames[0][6:]
    assert rejection(frames) == f"peer speaks protocol version {version}, this side speaks version 8"


@settings(max_examples=100)
@given(message=messages(), magic=st.binary(min_size=4, max_size=4).filter(lambda m: m != MAGIC))
def test_any_other_magic_is_rejected(message: Message, magic: bytes) -> None:
    frames = encode(message)
    frames[0] = magic + frames[0][4:]
    assert rejection(frames).startswith("bad magic")


# ================================================================ version 2: heads in the Register layout


@st.composite
def head_layouts(draw: st.DrawFn) -> BufferLayout:
    """MHA layouts whose K and V buffers describe the heads of one TP rank (any split that is valid)."""
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    kv_heads = draw(st.sampled_from([h for h in (1, 2, 4, 8, 16) if h % tp == 0 or tp % h == 0]))
    rank = draw(st.integers(0, tp - 1))
    count = max(1, kv_heads // tp)
    heads = HeadGeometry(
        kv_heads=kv_heads,
        head_start=rank * kv_heads // tp,
        head_count=count,
        head_bytes=draw(st.integers(1, 1024)),
        item_layout=draw(st.sampled_from(ItemLayout)),
    )
    page_size = draw(st.integers(1, 256))
    item = page_size * count * heads.head_bytes
    layers = draw(st.integers(1, 4))
    specs = [
        BufferSpec(
            kind=kind,
            model=ModelRole.TARGET,
            layer_id=layer,
            base_ptr=draw(st.integers(0, 2**48)),
            length=item * draw(st.integers(0, 64)),
            item_bytes=item,
            heads=heads,
        )
        for kind in (BufferKind.K, BufferKind.V)
        for layer in range(layers)
    ]
    specs.append(
        BufferSpec(
            kind=BufferKind.AUX, model=ModelRole.TARGET, layer_id=0, base_ptr=0, length=64, item_bytes=64
        )
    )
    return BufferLayout.build(attention=AttentionKind.MHA, page_size=page_size, buffers=specs)


def _register(layout: BufferLayout) -> Register:
    return Register(
        origin=ORIGIN, tp_size=2, endpoint=Endpoint("tcp://h:1"), session=SessionId("h:2"), layout=layout
    )


@settings(max_examples=60)
@given(layout=head_layouts())
def test_register_carries_the_head_geometry(layout: BufferLayout) -> None:
    frames = encode(_register(layout))
    assert decode(frames) == _register(layout)
    assert encode(decode(frames)) == frames
    buffers = body_of(frames)["layout"]["buffers"]  # type: ignore[index]  # plain msgpack data
    first, aux = buffers[0], buffers[-1]
    heads = layout.buffers[0].heads
    assert heads is not None
    assert list(first) == ["kind", "model", "layer_id", "base_ptr", "length", "item_bytes", "heads"]
    assert first["heads"] == {
        "kv_heads": heads.kv_heads,
        "head_start": heads.head_start,
        "head_count": heads.head_count,
        "head_bytes": heads.head_bytes,
        "item_layout": heads.item_layout.value,
    }
    assert list(first["heads"]) == ["kv_heads", "head_start", "head_count", "head_bytes", "item_layout"]
    assert aux["heads"] is None


def test_golden_heads_map_bytes() -> None:
    """The Heads map as written by hand from the codec docstring (key order, shortest ints, str enum)."""
    heads = HeadGeometry(
        kv_heads=8, head_start=2, head_count=2, head_bytes=256, item_layout=ItemLayout.HEAD_TOKEN
    )
    spec = BufferSpec(
        kind=BufferKind.K,
        model=ModelRole.TARGET,
        layer_id=0,
        base_ptr=0,
        length=1024,
        item_bytes=1024,
        heads=heads,
    )
    frames = encode(_register(BufferLayout.build(attention=AttentionKind.MHA, page_size=2, buffers=[spec])))
    golden = (
        b"\xa5heads"
        + b"\x85"
        + (b"\xa8kv_heads" + b"\x08")
        + (b"\xaahead_start" + b"\x02")
        + (b"\xaahead_count" + b"\x02")
        + (b"\xaahead_bytes" + b"\xcd\x01\x00")
        + (b"\xabitem_layout" + b"\xaahead_token")
    )
    # The last buffer's last key, then (version 5) the Register's empty engine metadata.
    assert frames[1].endswith(golden + b"\xafengine_metadata\xc4\x00")
    assert frames[1].count(b"\xa5heads") == 1


def test_heads_are_validated_on_decode() -> None:
    heads = HeadGeometry(kv_heads=8, head_start=2, head_count=2, head_bytes=4)
    spec = BufferSpec(
        kind=BufferKind.K,
        model=ModelRole.TARGET,
        layer_id=0,
        base_ptr=0,
        length=64,
        item_bytes=16,
        heads=heads,
    )
    frames = encode(_register(BufferLayout.build(attention=AttentionKind.MHA, page_size=2, buffers=[spec])))

    def reason(**changes: object) -> str:
        body = body_of(frames)
        buffer = body["layout"]["buffers"][0]  # type: ignore[index]  # plain msgpack data
        for key, value in changes.items():
            if key in buffer:
                buffer[key] = value
            else:
                buffer["heads"][key] = value
        return rejection(with_body(frames, body))

    assert "invalid Heads: heads 7..8 are outside the model's 8 KV heads" in reason(head_start=7)
    assert "item_layout must be one of ['token_head', 'head_token'], got 'nhd'" in reason(item_layout="nhd")
    assert "invalid BufferSpec: target kv layer 0: only K and V buffers describe heads" in reason(kind="kv")
    assert "item_bytes 16 != page_size 2 x 2 heads x 8 bytes per head" in reason(head_bytes=8)
    assert "heads must be a map, got int" in reason(heads=3)
    assert "has missing keys ['item_layout']" in reason(
        heads={"kv_heads": 8, "head_start": 2, "head_count": 2, "head_bytes": 4}
    )
    body = body_of(frames)
    del body["layout"]["buffers"][0]["heads"]  # type: ignore[index]  # a version 1 BufferSpec
    assert "has missing keys ['heads']" in rejection(with_body(frames, body))


@settings(max_examples=60)
@given(layout=head_layouts(), seed=st.integers(0, 2**32 - 1))
def test_mutated_head_layouts_decode_or_raise_remote_error(layout: BufferLayout, seed: int) -> None:
    """60 x 40 more mutation chains, on Registers whose layouts carry heads (the version 2 schema)."""
    rng = random.Random(seed)
    original: list[object] = list(encode(_register(layout)))
    for _ in range(MUTATIONS_PER_MESSAGE):
        frames = original
        for _ in range(rng.choice([1, 1, 2, 3])):
            frames = _mutate(frames, rng)
        decode_or_reject(frames)


# ================================================================ version 5: engine metadata in Register


def _register_with(metadata: bytes) -> Register:
    layout = BufferLayout.build(
        attention=AttentionKind.MLA,
        page_size=4,
        buffers=[
            BufferSpec(
                kind=BufferKind.KV,
                model=ModelRole.TARGET,
                layer_id=0,
                base_ptr=4096,
                length=64,
                item_bytes=16,
            )
        ],
    )
    return Register(
        origin=ORIGIN,
        tp_size=2,
        endpoint=Endpoint("tcp://h:1"),
        session=SessionId("h:2"),
        layout=layout,
        engine_metadata=metadata,
    )


def test_golden_engine_metadata_bytes() -> None:
    """The last key of a version 5 Register, written by hand: msgpack bin 8 (0xc4, one length byte)."""
    frames = encode(_register_with(b"\x00\xffnixl"))
    assert frames[1].endswith(b"\xafengine_metadata" + b"\xc4\x06" + b"\x00\xffnixl")
    assert list(body_of(frames))[-1] == "engine_metadata"
    assert encode(_register_with(b""))[1].endswith(b"\xafengine_metadata\xc4\x00")
    assert decode(frames) == _register_with(b"\x00\xffnixl")


def test_engine_metadata_is_validated_on_decode() -> None:
    frames = encode(_register_with(b"md"))

    def reason(value: object) -> str:
        body = body_of(frames)
        body["engine_metadata"] = value
        return rejection(with_body(frames, body))

    assert "body.engine_metadata must be bin, got str" in reason("md")
    assert "body.engine_metadata must be bin, got nil" in reason(None)
    body = body_of(frames)
    del body["engine_metadata"]  # a version 4 Register
    assert "has missing keys ['engine_metadata']" in rejection(with_body(frames, body))
    too_long = msgpack.packb({**body_of(frames), "engine_metadata": bytes(MAX_ENGINE_METADATA_BYTES + 1)})
    assert "body is not valid msgpack" in rejection([frames[0], too_long])
    biggest = _register_with(bytes(MAX_ENGINE_METADATA_BYTES))
    assert decode(encode(biggest)) == biggest
    with pytest.raises(ValueError, match="at most 262144 bytes"):
        _register_with(bytes(MAX_ENGINE_METADATA_BYTES + 1))


def test_bin_values_are_refused_everywhere_else() -> None:
    """engine_metadata is the format's only bin value: a bin in any text field is a type error."""
    frames = encode(golden_request())
    body = body_of(frames)
    body["origin"]["instance"] = b"d0"  # type: ignore[index]  # plain msgpack data
    assert "body.origin.instance must be a str, got bin" in rejection(with_body(frames, body))
    register = encode(_register_with(b"md"))
    body = body_of(register)
    body["session"] = b"h:2"
    assert "body.session must be a str, got bin" in rejection(with_body(register, body))


@settings(max_examples=60)
@given(metadata=st.binary(max_size=512), seed=st.integers(0, 2**32 - 1))
def test_mutated_engine_metadata_decode_or_raise_remote_error(metadata: bytes, seed: int) -> None:
    """60 x 40 more mutation chains, on Registers that carry engine metadata (the version 5 schema)."""
    rng = random.Random(seed)
    original: list[object] = list(encode(_register_with(metadata)))
    for _ in range(MUTATIONS_PER_MESSAGE):
        frames = original
        for _ in range(rng.choice([1, 1, 2, 3])):
            frames = _mutate(frames, rng)
        decode_or_reject(frames)


# ================================================================ version 6: what a RegisterAck leaves out

_DRAFT_INDEX_K = BufferKey(model=ModelRole.DRAFT, kind=BufferKind.INDEX_K, layer_id=0)


def test_golden_register_ack_bytes() -> None:
    """A RegisterAck naming one prefill buffer left out, as written by hand from the codec docstring."""
    ack = RegisterAck(origin=ORIGIN, prefill_left_out=[_DRAFT_INDEX_K])
    frames = encode(ack)
    assert frames[0] == HEADER.pack(b"PDKV", 8, 5, 0)
    golden = (
        b"\xb0prefill_left_out"
        + b"\x91\x83"
        + (b"\xa4kind" + b"\xa7index_k")
        + (b"\xa5model" + b"\xa5draft")
        + (b"\xa8layer_id" + b"\x00")
        + (b"\xafdecode_left_out" + b"\x90")
    )
    assert frames[1].startswith(b"\x83\xa6origin") and frames[1].endswith(golden)
    assert decode(frames) == ack


@settings(max_examples=100)
@given(ack=register_acks())
def test_register_ack_round_trips_what_is_left_out(ack: RegisterAck) -> None:
    back = decode(encode(ack))
    assert isinstance(back, RegisterAck)
    assert back.prefill_left_out == ack.prefill_left_out and back.decode_left_out == ack.decode_left_out


def test_register_ack_left_out_is_validated_on_decode() -> None:
    frames = encode(RegisterAck(origin=ORIGIN, decode_left_out=[_DRAFT_INDEX_K]))

    def reason(key: str, value: object) -> str:
        body = body_of(frames)
        body[key] = value
        return rejection(with_body(frames, body))

    ref = {"kind": "index_k", "model": "draft", "layer_id": 0}
    assert "decode_left_out lists a buffer twice: [draft index_k layer 0, draft index_k layer 0]" in reason(
        "decode_left_out", [ref, ref]
    )
    assert "body.prefill_left_out[0].model must be one of ['target', 'draft'], got 'drafts'" in reason(
        "prefill_left_out", [{**ref, "model": "drafts"}]
    )
    assert "invalid BufferRef: layer_id must be an int in [0, 2**63), got -1" in reason(
        "prefill_left_out", [{**ref, "layer_id": -1}]
    )
    assert "prefill_left_out[0] has missing keys ['layer_id']" in reason(
        "prefill_left_out", [{"kind": "kv", "model": "draft"}]
    )
    assert "body.prefill_left_out must be an array, got map" in reason("prefill_left_out", ref)
    body = body_of(frames)
    del body["prefill_left_out"], body["decode_left_out"]  # a version 4 RegisterAck
    assert "has missing keys ['decode_left_out', 'prefill_left_out']" in rejection(with_body(frames, body))


@settings(max_examples=60)
@given(seed=st.integers(0, 2**32 - 1))
def test_mutated_register_acks_decode_or_raise_remote_error(seed: int) -> None:
    """60 x 40 more mutation chains on RegisterAcks that leave buffers out (the version 6 schema)."""
    rng = random.Random(seed)
    ack = RegisterAck(
        origin=ORIGIN,
        prefill_left_out=[_DRAFT_INDEX_K, attrs.evolve(_DRAFT_INDEX_K, layer_id=2**40)],
        decode_left_out=[BufferKey(model=ModelRole.DRAFT, kind=BufferKind.KV, layer_id=1)],
    )
    original: list[object] = list(encode(ack))
    for _ in range(MUTATIONS_PER_MESSAGE):
        frames = original
        for _ in range(rng.choice([1, 1, 2, 3])):
            frames = _mutate(frames, rng)
        decode_or_reject(frames)


# ================================================================ version 8: the landing grant


@settings(max_examples=60)
@given(seed=st.integers(0, 2**32 - 1))
def test_mutated_landing_grants_decode_or_raise_remote_error(seed: int) -> None:
    """60 x 40 more mutation chains on TransferRequests with a landing grant (the version 8 schema)."""
    rng = random.Random(seed)
    original: list[object] = list(encode(granted_request()))
    for _ in range(MUTATIONS_PER_MESSAGE):
        frames = original
        for _ in range(rng.choice([1, 1, 2, 3])):
            frames = _mutate(frames, rng)
        decode_or_reject(frames)


def test_version_7_request_without_landing_key_is_refused_by_name() -> None:
    frames = encode(golden_request())
    body = body_of(frames)
    del body["landing"]
    assert "has missing keys ['landing']" in rejection(with_body(frames, body))
