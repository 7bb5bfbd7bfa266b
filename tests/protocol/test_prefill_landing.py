"""PrefillEndpoint: a TransferRequest's landing grant is checked like its pages, before any byte moves.

A grant that fits this rank (its region for the window, clear of the decode's buffers) is accepted;
one of another size, one inside the decode's registered buffers, or one to a layout without heads
fails that room only, with the reason, as a bad destination page does.
"""

from __future__ import annotations

import attrs
import pytest

from pdkv.mapping import AttentionKind
from pdkv.mapping.landing import region_bytes, source_region
from pdkv.protocol.messages import LandingGrant, Origin, Outcome, RankCoord, TransferStatus
from pdkv.protocol.poll import KVPoll
from pdkv.testing.synthetic import Capacity, ModelSpec, RankMemory
from tests.protocol.helpers import DECODE, ROOM, prefill, register, request, sent

SPEC = ModelSpec(attention=AttentionKind.MHA, layers=1, page_size=4, kv_bytes_per_token=8 * 2, kv_heads=8)
CAPACITY = Capacity(kv_pages=16, state_slots=2, aux_rows=4)
# Prefill TP 4 rank 1 (heads 2, 3) -> decode TP 2 rank 0 (heads 0 .. 3).
SOURCE = RankMemory(SPEC, CAPACITY, tp_size=4, tp_rank=1)
DEST = RankMemory(SPEC, CAPACITY, tp_size=2, tp_rank=0)
FAR = 1 << 44  # a landing pool: another allocation than the decode's buffers


def granted(address: int, nbytes: int) -> object:
    req = attrs.evolve(request([1, 2, 3, 4]), prefix_pages=1)
    return attrs.evolve(req, landing=LandingGrant(address=address, nbytes=nbytes, first_position=1, slots=3))


def right_size() -> int:
    return region_bytes(source_region(DEST.layout, SOURCE.layout, base=FAR, slots=3))


@pytest.mark.parametrize(
    ("address", "extra", "needle"),
    [
        (FAR, 0, None),
        (FAR, 256, "landing grant of"),
        (None, 0, "overlaps the decode's"),
    ],
    ids=["fits", "wrong-size", "inside-the-pages"],
)
def test_a_grant_is_checked_before_any_byte_moves(
    address: int | None, extra: int, needle: str | None
) -> None:
    p = prefill(lay=SOURCE.layout)
    origin = Origin(instance=DECODE.instance, epoch=DECODE.epoch, rank=RankCoord(tp=0))
    p.receive(attrs.evolve(register(DEST.layout, origin), tp_size=2), 0.0)
    p.open_room(ROOM, num_pages=4, aux_row=None, now=0.0)
    at = DEST.layout.buffers[0].base_ptr if address is None else address
    effects = p.receive(granted(at, right_size() + extra), 0.0)  # type: ignore[arg-type]  # a TransferRequest
    if needle is None:
        assert sent(effects, TransferStatus) == []
        assert p.poll(ROOM) is KVPoll.WaitingForInput
        return
    [status] = sent(effects, TransferStatus)
    assert isinstance(status, TransferStatus) and status.outcome is Outcome.FAILED
    assert needle in status.reason
    assert p.poll(ROOM) is KVPoll.Failed
