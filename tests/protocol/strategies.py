"""Hypothesis strategies for every protocol message and the values they carry (reusable by any test).

Owns: generators of VALID messages only (each draw passes the class validators and fits the wire
format's limits), one strategy per message class plus ``messages()`` for any of them, and
``STRATEGY_BY_CLASS`` for tests that parametrize over classes. Must not encode or decode: tests
of the codec and of the endpoints build on these, so they stay independent of both.

Sizes are kept small (a few items per list, texts of tens of characters) so that suites drawing
hundreds of examples stay fast; the boundaries (longest reason, widest index) are covered by the
example tests that need them.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt
from hypothesis import strategies as st

from pdkv.mapping.layout import AttentionKind, BufferKind, BufferLayout, BufferSpec, ModelRole
from pdkv.mapping.layout_policy import BufferKey
from pdkv.protocol.ids import MAX_EPOCH, MAX_ROOM_ID, Endpoint, Epoch, InstanceId, RoomId, SessionId
from pdkv.protocol.messages import (
    MAX_INDEX,
    MAX_NAME_CHARS,
    MAX_RANKS,
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
    TransferMetricData,
    TransferRequest,
    TransferStatus,
)

MAX_I64: Final = 2**63 - 1  # BufferSpec/BufferLayout integers are bounded to signed 64-bit
STATE_KINDS: Final = tuple(kind for kind in BufferKind if kind.is_state)

_names = st.text(min_size=1, max_size=24)
_reasons = st.text(min_size=1, max_size=80)


def rank_coords(*, tp_size: int = MAX_RANKS, cp_size: int = MAX_RANKS) -> st.SearchStrategy[RankCoord]:
    """A rank inside a ``tp_size`` x ``cp_size`` instance."""
    return st.builds(RankCoord, tp=st.integers(0, tp_size - 1), cp=st.integers(0, cp_size - 1))


def origins(*, tp_size: int = MAX_RANKS, cp_size: int = MAX_RANKS) -> st.SearchStrategy[Origin]:
    return st.builds(
        Origin,
        instance=_names.map(InstanceId),
        epoch=st.integers(0, MAX_EPOCH).map(Epoch),
        rank=rank_coords(tp_size=tp_size, cp_size=cp_size),
    )


def rooms() -> st.SearchStrategy[RoomId]:
    return st.integers(1, MAX_ROOM_ID).map(RoomId)


@st.composite
def index_arrays(draw: st.DrawFn, *, max_size: int = 40) -> IntArray:
    """Page/slot indices: sometimes all below 2**31 (int32 on the wire), sometimes up to 2**62 - 1."""
    upper = draw(st.sampled_from([255, 2**31 - 1, 2**31, MAX_INDEX - 1]))
    values = draw(st.lists(st.integers(0, upper), max_size=max_size))
    return np.array(values, dtype=np.int64)


def state_indices(kind: BufferKind | None = None) -> st.SearchStrategy[StateIndices]:
    kinds = st.just(kind) if kind is not None else st.sampled_from(STATE_KINDS)
    return st.builds(StateIndices, kind=kinds, indices=index_arrays())


def transfer_metrics() -> st.SearchStrategy[TransferMetricData]:
    # seconds are floats: the wire carries float64, so an int beyond 2**53 would not survive exactly.
    return st.builds(
        TransferMetricData,
        pages=st.integers(0, MAX_INDEX),
        bytes=st.integers(0, 2**63 - 1),
        seconds=st.floats(min_value=0.0, allow_nan=False, allow_infinity=False),
    )


@st.composite
def buffer_specs(
    draw: st.DrawFn,
    *,
    kind: BufferKind | None = None,
    model: ModelRole | None = None,
    layer_id: int | None = None,
) -> BufferSpec:
    item_bytes = draw(st.integers(1, 2**20))
    return BufferSpec(
        kind=kind if kind is not None else draw(st.sampled_from(BufferKind)),
        model=model if model is not None else draw(st.sampled_from(ModelRole)),
        layer_id=layer_id if layer_id is not None else draw(st.integers(0, 255)),
        base_ptr=draw(st.integers(0, MAX_I64)),
        length=item_bytes * draw(st.integers(0, 2**20)),
        item_bytes=item_bytes,
    )


@st.composite
def buffer_layouts(draw: st.DrawFn, *, max_buffers: int = 8) -> BufferLayout:
    """Layouts with unique (model, kind, layer) buffers, put in canonical order by ``build``."""
    keys = draw(
        st.lists(
            st.tuples(st.sampled_from(ModelRole), st.sampled_from(BufferKind), st.integers(0, 127)),
            unique=True,
            max_size=max_buffers,
        )
    )
    specs = [draw(buffer_specs(kind=kind, model=model, layer_id=layer)) for model, kind, layer in keys]
    return BufferLayout.build(
        attention=draw(st.sampled_from(AttentionKind)),
        page_size=draw(st.one_of(st.integers(1, 1024), st.integers(1, MAX_I64))),
        buffers=specs,
    )


def _sizes() -> st.SearchStrategy[int]:
    """tp_size / cp_size: mostly small real shapes, sometimes anywhere up to MAX_RANKS."""
    return st.one_of(st.integers(1, 8), st.integers(1, MAX_RANKS))


def _digests() -> st.SearchStrategy[str]:
    return st.text(alphabet="0123456789abcdef", min_size=1, max_size=64)


def _endpoints() -> st.SearchStrategy[Endpoint]:
    return st.one_of(
        st.builds(lambda port: Endpoint(f"tcp://127.0.0.1:{port}"), st.integers(1, 65535)),
        st.text(min_size=1, max_size=MAX_NAME_CHARS).map(Endpoint),
    )


def _sessions() -> st.SearchStrategy[SessionId]:
    return _names.map(SessionId)


# ---------------------------------------------------------------- one strategy per message class


@st.composite
def rank_announces(draw: st.DrawFn) -> RankAnnounce:
    tp_size, cp_size = draw(_sizes()), draw(_sizes())
    return RankAnnounce(
        origin=draw(origins(tp_size=tp_size, cp_size=cp_size)),
        tp_size=tp_size,
        cp_size=cp_size,
        endpoint=draw(_endpoints()),
        session=draw(_sessions()),
        page_size=draw(st.integers(1, 2**20)),
        layout_digest=draw(_digests()),
    )


def route_queries() -> st.SearchStrategy[RouteQuery]:
    return st.builds(RouteQuery, origin=origins())


@st.composite
def rank_routes(draw: st.DrawFn, *, tp_size: int = MAX_RANKS, cp_size: int = MAX_RANKS) -> RankRoute:
    return RankRoute(
        rank=draw(rank_coords(tp_size=tp_size, cp_size=cp_size)),
        epoch=draw(st.integers(0, MAX_EPOCH).map(Epoch)),
        endpoint=draw(_endpoints()),
        session=draw(_sessions()),
    )


@st.composite
def route_tables(draw: st.DrawFn) -> RouteTable:
    tp_size, cp_size = draw(_sizes()), draw(_sizes())
    routes = draw(
        st.lists(
            rank_routes(tp_size=tp_size, cp_size=cp_size),
            max_size=min(6, tp_size * cp_size),
            unique_by=lambda route: (route.rank.tp, route.rank.cp),
        )
    )
    return RouteTable(
        origin=draw(origins()),
        tp_size=tp_size,
        cp_size=cp_size,
        page_size=draw(st.integers(1, 2**20)),
        layout_digest=draw(_digests()),
        ranks=routes,
        # Complete means every tp x cp rank announced; a partial table is never complete.
        complete=len(routes) == tp_size * cp_size and draw(st.booleans()),
    )


@st.composite
def registers(draw: st.DrawFn) -> Register:
    origin = draw(origins())
    return Register(
        origin=origin,
        tp_size=draw(st.integers(origin.rank.tp + 1, MAX_RANKS)),
        endpoint=draw(_endpoints()),
        session=draw(_sessions()),
        layout=draw(buffer_layouts()),
        engine_metadata=draw(st.binary(max_size=600) | st.just(b"")),
    )


def buffer_keys() -> st.SearchStrategy[BufferKey]:
    return st.builds(
        BufferKey,
        model=st.sampled_from(ModelRole),
        kind=st.sampled_from(BufferKind),
        layer_id=st.one_of(st.integers(0, 127), st.integers(0, MAX_I64)),
    )


def _key_lists() -> st.SearchStrategy[list[BufferKey]]:
    return st.lists(buffer_keys(), unique=True, max_size=4)


@st.composite
def register_acks(draw: st.DrawFn) -> RegisterAck:
    """Acks of matching layouts, and of pairs that leave buffers out on either side (version 5)."""
    if draw(st.booleans()):
        return RegisterAck(origin=draw(origins()))
    return RegisterAck(
        origin=draw(origins()), prefill_left_out=draw(_key_lists()), decode_left_out=draw(_key_lists())
    )


def register_rejects() -> st.SearchStrategy[RegisterReject]:
    return st.builds(RegisterReject, origin=origins(), reason=_reasons, retry=st.booleans())


@st.composite
def transfer_requests(draw: st.DrawFn) -> TransferRequest:
    origin, room = draw(origins()), draw(rooms())
    required = draw(st.one_of(st.integers(1, 8), st.integers(1, MAX_RANKS)))
    if draw(st.integers(0, 9)) == 9:  # 9, not 0: shrinking then heads for the ordinary request
        # A dummy request carries no destination at all.
        return TransferRequest(
            origin=origin,
            room=room,
            dst_pages=np.zeros(0, np.int64),
            required_dst_info_num=required,
            dummy=True,
        )
    kinds = draw(st.lists(st.sampled_from(STATE_KINDS), unique=True, max_size=len(STATE_KINDS)))
    dst_pages = draw(index_arrays())
    prefix = draw(st.integers(0, int(dst_pages.size)))
    landing = None
    if prefix < dst_pages.size and draw(st.booleans()):  # a grant covers the positions after the prefix
        address = st.sampled_from([1, 2**31 - 1, 2**31, 2**63 - 1]) | st.integers(1, 2**63 - 1)
        landing = LandingGrant(
            address=draw(address),
            nbytes=draw(address),
            first_position=prefix,
            slots=int(dst_pages.size) - prefix,
        )
    return TransferRequest(
        origin=origin,
        room=room,
        dst_pages=dst_pages,
        dst_aux_row=draw(st.none() | st.integers(0, MAX_INDEX - 1)),
        dst_state=tuple(draw(state_indices(kind)) for kind in kinds),
        required_dst_info_num=required,
        dummy=False,
        prefix_pages=prefix,
        landing=landing,
    )


@st.composite
def checksum_arrays(draw: st.DrawFn, size: int) -> npt.NDArray[np.uint32]:
    """``size`` uint32 checksums (the extremes included)."""
    value = st.sampled_from([0, 1, 2**31, 2**32 - 1]) | st.integers(0, 2**32 - 1)
    values = draw(st.lists(value, min_size=size, max_size=size))
    return np.array(values, dtype=np.uint32)


@st.composite
def page_checksums(draw: st.DrawFn) -> PageChecksums:
    """A status's checksums: increasing positions (int32 or int64 on the wire), a few KV buffers,
    state kinds with a slot count each, an aux checksum or none."""
    positions = np.unique(draw(index_arrays(max_size=12)))
    buffers = draw(st.integers(0, 4)) if positions.size else 0
    kinds = draw(st.lists(st.sampled_from(STATE_KINDS), unique=True, max_size=len(STATE_KINDS)))
    state = []
    for kind in kinds:
        count = draw(st.integers(0, 4))
        sums = draw(checksum_arrays(count * draw(st.integers(1, 3))))
        state.append(StateChecksums(kind=kind, count=count, sums=sums))
    return PageChecksums(
        positions=positions,
        kv=draw(checksum_arrays(buffers * int(positions.size))),
        state=state,
        aux=draw(checksum_arrays(draw(st.integers(0, 2)))),
    )


@st.composite
def transfer_statuses(draw: st.DrawFn) -> TransferStatus:
    outcome = draw(st.sampled_from(Outcome))
    reason = draw(_reasons if outcome is Outcome.FAILED else st.just("") | _reasons)
    checksums = None if outcome is Outcome.FAILED else draw(st.none() | page_checksums())
    return TransferStatus(
        origin=draw(origins()),
        room=draw(rooms()),
        outcome=outcome,
        reason=reason,
        metric=draw(transfer_metrics()),
        checksums=checksums,
    )


def aborts() -> st.SearchStrategy[Abort]:
    return st.builds(Abort, origin=origins(), room=rooms(), reason=_reasons)


def abort_acks() -> st.SearchStrategy[AbortAck]:
    return st.builds(AbortAck, origin=origins(), room=rooms(), fenced=st.booleans())


def heartbeats() -> st.SearchStrategy[Heartbeat]:
    return st.builds(Heartbeat, origin=origins(), seq=st.integers(0, 2**63 - 1))


def heartbeat_acks() -> st.SearchStrategy[HeartbeatAck]:
    return st.builds(HeartbeatAck, origin=origins(), seq=st.integers(0, 2**63 - 1))


STRATEGY_BY_CLASS: Final[dict[type[Message], st.SearchStrategy[Message]]] = {
    RankAnnounce: rank_announces(),
    RouteQuery: route_queries(),
    RouteTable: route_tables(),
    Register: registers(),
    RegisterAck: register_acks(),
    RegisterReject: register_rejects(),
    TransferRequest: transfer_requests(),
    TransferStatus: transfer_statuses(),
    Abort: aborts(),
    AbortAck: abort_acks(),
    Heartbeat: heartbeats(),
    HeartbeatAck: heartbeat_acks(),
}


def messages() -> st.SearchStrategy[Message]:
    """Any valid message of any class."""
    return st.one_of(*STRATEGY_BY_CLASS.values())
