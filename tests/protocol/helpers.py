"""Small builders for endpoint unit tests (direct calls, no link)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pdkv.mapping.layout import AttentionKind, BufferKind, BufferLayout, BufferSpec, ModelRole
from pdkv.protocol.config import Timeouts
from pdkv.protocol.decode import DecodeEndpoint
from pdkv.protocol.effects import Effect, Send
from pdkv.protocol.ids import Endpoint, Epoch, InstanceId, RoomId, SessionId
from pdkv.protocol.messages import (
    Message,
    Origin,
    RankCoord,
    RankRoute,
    Register,
    RouteTable,
    StateIndices,
    TransferRequest,
)
from pdkv.protocol.prefill import PrefillEndpoint
from pdkv.testing.endpoint_pair import default_layout

DECODE = Origin(instance=InstanceId("d"), epoch=Epoch(1), rank=RankCoord(tp=0))
PREFILL = Origin(instance=InstanceId("p"), epoch=Epoch(1), rank=RankCoord(tp=0))
DECODE_EP = Endpoint("inproc://d")
PREFILL_EP = Endpoint("inproc://p")
ROOM = RoomId(42)


def layout(**kw: int) -> BufferLayout:
    return default_layout(**kw)


def swa_layout() -> BufferLayout:
    base = default_layout()
    swa = BufferSpec(
        kind=BufferKind.SWA,
        model=ModelRole.TARGET,
        layer_id=0,
        base_ptr=0x30_0000_0000,
        length=8 * 128,
        item_bytes=128,
    )
    return BufferLayout.build(
        attention=AttentionKind.MLA, page_size=base.page_size, buffers=[*base.buffers, swa]
    )


def prefill(timeouts: Timeouts | None = None, lay: BufferLayout | None = None) -> PrefillEndpoint:
    return PrefillEndpoint(origin=PREFILL, layout=lay or layout(), timeouts=timeouts)


def decode(timeouts: Timeouts | None = None, lay: BufferLayout | None = None) -> DecodeEndpoint:
    return DecodeEndpoint(
        origin=DECODE,
        tp_size=1,
        endpoint=DECODE_EP,
        session=SessionId("d:1"),
        layout=lay or layout(),
        timeouts=timeouts,
    )


def register(lay: BufferLayout | None = None, origin: Origin = DECODE) -> Register:
    return Register(
        origin=origin,
        tp_size=origin.rank.tp + 1,
        endpoint=DECODE_EP,
        session=SessionId("d:1"),
        layout=lay or layout(),
    )


def request(
    pages: Sequence[int] | np.ndarray = (1, 2, 3),
    *,
    aux: int | None = None,
    required: int = 1,
    dummy: bool = False,
    state: Sequence[StateIndices] = (),
    origin: Origin = DECODE,
    room: RoomId = ROOM,
) -> TransferRequest:
    return TransferRequest(
        origin=origin,
        room=room,
        dst_pages=pages,
        dst_aux_row=aux,
        dst_state=state,
        required_dst_info_num=required,
        dummy=dummy,
    )


def route() -> RouteTable:
    return RouteTable(
        origin=PREFILL,
        tp_size=1,
        cp_size=1,
        page_size=16,
        layout_digest=layout().digest(),
        ranks=[
            RankRoute(rank=PREFILL.rank, epoch=PREFILL.epoch, endpoint=PREFILL_EP, session=SessionId("p:1"))
        ],
        complete=True,
    )


def sent(effects: Sequence[Effect], kind: type[Message] | None = None) -> list[Message]:
    return [
        e.message for e in effects if isinstance(e, Send) and (kind is None or isinstance(e.message, kind))
    ]
