"""Tests of the message classes' own rules: bad fields raise, arrays are private read-only int64 copies,
equality compares values (arrays by content), and the classes are frozen and keyword-only.

The codec relies on these: a decoded message exists only if it passed these validators.
"""

from __future__ import annotations

import math

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdkv.mapping.layout import BufferKind, ModelRole
from pdkv.mapping.layout_policy import BufferKey
from pdkv.protocol.ids import MAX_ROOM_ID, Endpoint, Epoch, InstanceId, RoomId, SessionId
from pdkv.protocol.messages import (
    MAX_INDEX,
    MAX_NAME_CHARS,
    MAX_RANKS,
    MAX_REASON_CHARS,
    Abort,
    Heartbeat,
    Message,
    Origin,
    Outcome,
    RankAnnounce,
    RankCoord,
    RankRoute,
    RegisterAck,
    RouteTable,
    StateIndices,
    TransferMetricData,
    TransferRequest,
    TransferStatus,
    index_array,
)
from tests.protocol.strategies import messages

ORIGIN = Origin(instance=InstanceId("d0"), epoch=Epoch(3), rank=RankCoord(tp=1, cp=0))


def request(pages: object = (1, 2, 3), **changes: object) -> TransferRequest:
    fields: dict[str, object] = {"origin": ORIGIN, "room": RoomId(7), "dst_pages": pages, **changes}
    return TransferRequest(**fields)  # type: ignore[arg-type]  # field values vary on purpose


def route(tp: int, cp: int = 0) -> RankRoute:
    return RankRoute(
        rank=RankCoord(tp=tp, cp=cp), epoch=Epoch(1), endpoint=Endpoint("e"), session=SessionId("s")
    )


# ================================================================ value types


@pytest.mark.parametrize("bad", [-1, MAX_RANKS, True, 1.0, "1", None])
def test_rank_coord_rejects_out_of_range_and_non_int(bad: object) -> None:
    with pytest.raises(ValueError, match=r"tp must be an int in \[0, 4095\]"):
        RankCoord(tp=bad)  # type: ignore[arg-type]  # ill-typed on purpose
    with pytest.raises(ValueError, match=r"cp must be an int in \[0, 4095\]"):
        RankCoord(tp=0, cp=bad)  # type: ignore[arg-type]  # ill-typed on purpose


def test_rank_coord_bounds_are_inclusive() -> None:
    assert RankCoord(tp=MAX_RANKS - 1, cp=MAX_RANKS - 1).cp == 4095
    assert RankCoord(tp=0).cp == 0


def test_origin_validation() -> None:
    with pytest.raises(ValueError, match=r"instance must have 1\.\.256 characters, got 0"):
        Origin(instance=InstanceId(""), epoch=Epoch(0), rank=RankCoord(tp=0))
    with pytest.raises(ValueError, match="got 257"):
        Origin(instance=InstanceId("x" * (MAX_NAME_CHARS + 1)), epoch=Epoch(0), rank=RankCoord(tp=0))
    with pytest.raises(TypeError, match="instance must be str, got bytes"):
        Origin(instance=b"d0", epoch=Epoch(0), rank=RankCoord(tp=0))  # type: ignore[arg-type]  # on purpose
    with pytest.raises(ValueError, match="epoch must be an int"):
        Origin(instance=InstanceId("d0"), epoch=Epoch(-1), rank=RankCoord(tp=0))
    with pytest.raises(ValueError, match="epoch must be an int"):
        Origin(instance=InstanceId("d0"), epoch=Epoch(2**63), rank=RankCoord(tp=0))
    with pytest.raises(TypeError, match="rank"):
        Origin(instance=InstanceId("d0"), epoch=Epoch(0), rank=(0, 0))  # type: ignore[arg-type]  # on purpose
    assert str(ORIGIN) == "d0#3:tp1/cp0"


@pytest.mark.parametrize("seconds", [-0.5, math.inf, math.nan, True, "1"])
def test_metric_seconds_must_be_finite_and_non_negative(seconds: object) -> None:
    with pytest.raises(ValueError, match="seconds must be a finite float >= 0"):
        TransferMetricData(seconds=seconds)  # type: ignore[arg-type]  # ill-typed on purpose


def test_metric_counts_are_bounded() -> None:
    with pytest.raises(ValueError, match="pages"):
        TransferMetricData(pages=-1)
    with pytest.raises(ValueError, match="bytes"):
        TransferMetricData(bytes=2**63)
    assert TransferMetricData() == TransferMetricData(pages=0, bytes=0, seconds=0.0)


# ================================================================ index arrays


@pytest.mark.parametrize(
    "source",
    [
        [3, 1, 2],
        (3, 1, 2),
        np.array([3, 1, 2], dtype=np.int32),
        np.array([3, 1, 2], dtype=np.uint8),
        np.array([3, 1, 2], dtype=">i8"),
        np.array([0, 3, 9, 1, 7, 2], dtype=np.int64)[1::2],  # strided view
        torch.tensor([3, 1, 2]),
    ],
    ids=["list", "tuple", "int32", "uint8", "big-endian", "strided", "torch"],
)
def test_index_arrays_become_read_only_native_int64(source: object) -> None:
    result = index_array(source)
    assert result.dtype == np.dtype(np.int64)
    assert result.tolist() == [3, 1, 2]
    assert not result.flags.writeable
    assert result.flags.c_contiguous
    with pytest.raises(ValueError, match="read-only"):
        result[0] = 5


@pytest.mark.parametrize(
    "make_source",
    [
        lambda: np.array([3, 1, 2], dtype=np.int64),
        lambda: np.arange(10, dtype=np.int64)[3:6],  # a view of a larger array
        lambda: torch.tensor([3, 1, 2], dtype=torch.int64),  # np.asarray shares a CPU tensor's memory
    ],
    ids=["int64", "int64-view", "torch-int64"],
)
def test_index_arrays_never_alias_the_callers_memory(make_source: object) -> None:
    source = make_source()  # type: ignore[operator]  # a zero-argument factory
    message = request(source)
    expected = message.dst_pages.tolist()
    source[0] = 99  # the caller reuses its buffer
    assert message.dst_pages.tolist() == expected


def test_index_arrays_reject_bad_shapes_dtypes_and_ranges() -> None:
    with pytest.raises(ValueError, match=r"1-D, got shape \(2, 2\)"):
        request([[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="1-D"):
        request(np.int64(3))
    with pytest.raises(TypeError, match="dtype float64"):
        request([1.0, 2.0])
    with pytest.raises(TypeError, match="dtype bool"):
        request([True, False])
    with pytest.raises(TypeError, match="dtype object"):
        request([2**70])
    with pytest.raises(ValueError, match=r"indices must be in \[0, 2\*\*62\), got min -1 max 2"):
        request([2, -1])
    with pytest.raises(ValueError, match="got min 0 max 4611686018427387904"):
        request([0, MAX_INDEX])
    with pytest.raises(ValueError, match="index out of range"):
        request(np.array([2**63], dtype=np.uint64))
    assert request([MAX_INDEX - 1]).dst_pages.tolist() == [MAX_INDEX - 1]


def test_empty_index_arrays_of_any_dtype_are_empty_int64() -> None:
    empties: list[object] = [[], np.zeros(0, dtype=np.float32), np.zeros(0, dtype=np.uint64)]
    for empty in empties:
        pages = request(empty).dst_pages
        assert pages.dtype == np.int64 and pages.size == 0 and not pages.flags.writeable


# ================================================================ message rules


def test_room_ids_are_1_to_2_63_minus_1() -> None:
    assert request(room=RoomId(MAX_ROOM_ID)).room == MAX_ROOM_ID
    for bad in (0, -1, MAX_ROOM_ID + 1, True):
        with pytest.raises(ValueError, match="room must be an int in"):
            request(room=bad)


def test_transfer_request_optional_fields() -> None:
    with pytest.raises(ValueError, match="dst_aux_row"):
        request(dst_aux_row=-1)
    with pytest.raises(ValueError, match="dst_aux_row"):
        request(dst_aux_row=MAX_INDEX)
    with pytest.raises(ValueError, match="required_dst_info_num"):
        request(required_dst_info_num=0)
    with pytest.raises(ValueError, match="required_dst_info_num"):
        request(required_dst_info_num=MAX_RANKS + 1)
    with pytest.raises(TypeError, match="dummy"):
        request(dummy=1)


def test_dummy_request_carries_no_destination() -> None:
    assert request([], dummy=True).dummy
    with pytest.raises(ValueError, match="a dummy TransferRequest carries no destination"):
        request([1], dummy=True)
    with pytest.raises(ValueError, match="carries no destination"):
        request([], dummy=True, dst_aux_row=0)
    with pytest.raises(ValueError, match="carries no destination"):
        request([], dummy=True, dst_state=[StateIndices(kind=BufferKind.SWA, indices=[])])


def test_state_indices_rules() -> None:
    with pytest.raises(ValueError, match="kv is not a state buffer kind"):
        StateIndices(kind=BufferKind.KV, indices=[1])
    with pytest.raises(ValueError, match="aux is not a state buffer kind"):
        StateIndices(kind=BufferKind.AUX, indices=[1])
    with pytest.raises(TypeError, match="kind"):
        StateIndices(kind="swa", indices=[1])  # type: ignore[arg-type]  # ill-typed on purpose
    swa = StateIndices(kind=BufferKind.SWA, indices=[1])
    with pytest.raises(ValueError, match=r"dst_state lists a state kind twice: \['swa', 'swa'\]"):
        request(dst_state=[swa, swa])
    with pytest.raises(TypeError, match="dst_state holds StateIndices, got tuple"):
        request(dst_state=[(BufferKind.SWA, [1])])
    both = request(dst_state=[swa, StateIndices(kind=BufferKind.INDEX_K, indices=[2])])
    assert isinstance(both.dst_state, tuple) and len(both.dst_state) == 2


def test_failed_status_needs_a_reason() -> None:
    with pytest.raises(ValueError, match="a Failed status carries a reason"):
        TransferStatus(origin=ORIGIN, room=RoomId(1), outcome=Outcome.FAILED)
    assert TransferStatus(origin=ORIGIN, room=RoomId(1), outcome=Outcome.SUCCESS).reason == ""
    with pytest.raises(TypeError, match="outcome"):
        TransferStatus(origin=ORIGIN, room=RoomId(1), outcome="success")  # type: ignore[arg-type]  # on purpose


def test_reason_length_limit() -> None:
    assert len(Abort(origin=ORIGIN, room=RoomId(1), reason="r" * MAX_REASON_CHARS).reason) == MAX_REASON_CHARS
    with pytest.raises(ValueError, match=r"reason must have 1\.\.4096 characters, got 4097"):
        Abort(origin=ORIGIN, room=RoomId(1), reason="r" * (MAX_REASON_CHARS + 1))
    with pytest.raises(ValueError, match=r"reason must have 1\.\.4096 characters, got 0"):
        Abort(origin=ORIGIN, room=RoomId(1), reason="")


def test_rank_announce_rank_must_lie_inside_the_instance() -> None:
    def announce(tp_size: int, cp_size: int) -> RankAnnounce:
        return RankAnnounce(
            origin=ORIGIN,  # tp1/cp0
            tp_size=tp_size,
            cp_size=cp_size,
            endpoint=Endpoint("tcp://h:1"),
            session=SessionId("h:2"),
            page_size=16,
            layout_digest="ab",
        )

    assert announce(2, 1).tp_size == 2
    with pytest.raises(ValueError, match="rank tp1/cp0 outside tp_size 1 cp_size 1"):
        announce(1, 1)
    with pytest.raises(ValueError, match="layout_digest"):
        RankAnnounce(
            origin=ORIGIN,
            tp_size=2,
            cp_size=1,
            endpoint=Endpoint("e"),
            session=SessionId("s"),
            page_size=16,
            layout_digest="a" * 65,
        )


def test_route_table_rules() -> None:
    def table(*routes: RankRoute, tp_size: int = 2, cp_size: int = 1) -> RouteTable:
        return RouteTable(
            origin=ORIGIN,
            tp_size=tp_size,
            cp_size=cp_size,
            page_size=16,
            layout_digest="ab",
            ranks=list(routes),
            complete=False,
        )

    assert table(route(0), route(1)).ranks == (route(0), route(1))
    with pytest.raises(ValueError, match="route table lists a rank twice"):
        table(route(0), route(0))
    with pytest.raises(ValueError, match="rank tp2/cp0 outside tp_size 2 cp_size 1"):
        table(route(2))
    with pytest.raises(ValueError, match="more ranks than tp_size"):
        table(route(0), route(1), route(2), tp_size=1, cp_size=2)
    with pytest.raises(TypeError, match="ranks"):
        table(RankCoord(tp=0))  # type: ignore[arg-type]  # ill-typed on purpose


def test_heartbeat_seq_range() -> None:
    assert Heartbeat(origin=ORIGIN, seq=2**63 - 1).seq == 2**63 - 1
    with pytest.raises(ValueError, match="seq"):
        Heartbeat(origin=ORIGIN, seq=-1)


# ================================================================ equality, immutability, construction


def test_equality_compares_arrays_by_content() -> None:
    assert request([1, 2, 3]) == request(np.array([1, 2, 3], dtype=np.int32))
    assert request([1, 2, 3]) != request([1, 2, 4])
    assert request([1, 2, 3]) != request([1, 2])  # no broadcasting
    assert request([]) == request(np.zeros(0, dtype=np.int64))
    swa = StateIndices(kind=BufferKind.SWA, indices=[1, 2])
    assert request(dst_state=[swa]) == request(dst_state=[StateIndices(kind=BufferKind.SWA, indices=(1, 2))])
    assert request(dst_state=[swa]) != request(dst_state=[StateIndices(kind=BufferKind.SWA, indices=[2, 1])])
    other_class: object = Abort(origin=ORIGIN, room=RoomId(7), reason="x")
    assert request() != other_class


@settings(max_examples=60)
@given(message=messages())
def test_generated_messages_equal_their_field_by_field_copy(message: Message) -> None:
    copy = attrs.evolve(message)
    assert copy == message
    assert (copy != message) is False


def test_messages_are_frozen_and_keyword_only() -> None:
    message = request()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        message.room = RoomId(8)  # type: ignore[misc]  # frozen on purpose
    with pytest.raises(TypeError):
        Abort(ORIGIN, RoomId(1), "reason")  # type: ignore[call-arg]  # positional on purpose


def test_evolve_revalidates() -> None:
    with pytest.raises(ValueError, match="room"):
        attrs.evolve(request(), room=RoomId(0))
    with pytest.raises(ValueError, match="carries no destination"):
        attrs.evolve(request(), dummy=True)


@given(values=st.lists(st.integers(0, MAX_INDEX - 1), max_size=20))
@settings(max_examples=60)
def test_index_array_preserves_values_and_order(values: list[int]) -> None:
    assert index_array(values).tolist() == values


def test_register_ack_names_each_left_out_buffer_once() -> None:
    key = BufferKey(model=ModelRole.DRAFT, kind=BufferKind.SWA, layer_id=3)
    ack = RegisterAck(origin=ORIGIN, decode_left_out=[key])
    assert ack.decode_left_out == (key,) and ack.prefill_left_out == () and ack.leaves_out
    assert not RegisterAck(origin=ORIGIN).leaves_out
    with pytest.raises(
        ValueError, match=r"prefill_left_out lists a buffer twice: \[draft swa layer 3, draft swa"
    ):
        RegisterAck(origin=ORIGIN, prefill_left_out=[key, key])
    with pytest.raises(TypeError, match="decode_left_out holds BufferKey, got tuple"):
        RegisterAck(origin=ORIGIN, decode_left_out=[("draft", "swa", 3)])  # type: ignore[list-item]  # on purpose
