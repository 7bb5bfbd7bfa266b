"""A rolling deployment between real processes over real Mooncake TCP on 127.0.0.1: the prefill
instance registers its draft model's state buffers and the decode instance does not (and the
reverse). Rooms succeed, the decode checks every target byte and the draft KV byte for byte (and that
its own draft state, where the prefill has none, stayed untouched), each room reports the draft state
it did not get, and the prefill's reported bytes are those of the buffers both sides have.

Needs the prefill's registration row to answer through ``answer_register`` (see
tests/runtime/test_draft_rollout.py): until then the decode rank's registration is refused at start.
"""

from __future__ import annotations

import attrs
import pytest

from pdkv.protocol.ids import RoomId
from pdkv.protocol.poll import KVPoll
from pdkv.testing.cluster import Cluster, ClusterSpec, RequestPlan
from pdkv.testing.synthetic import Capacity, ModelSpec

pytestmark = pytest.mark.slow

WITH_DRAFT_STATE = ModelSpec(
    layers=3, page_size=16, state_layers=(0, 2), draft_layers=1, draft_state_layers=(0,)
)
WITHOUT_DRAFT_STATE = attrs.evolve(WITH_DRAFT_STATE, draft_state_layers=())
NOT_SENT = "draft state not transferred: not written here [], not sent by prefill-0:tp0/cp0 "
NOT_WRITTEN = "draft state not transferred: not written here "
LISTED = "[draft index_k layer 0, draft index_scale layer 0]"


def plans() -> list[RequestPlan]:
    return [
        RequestPlan(room=RoomId(1), tokens=16 * 12, chunk_tokens=(16 * 6, 16 * 6)),
        RequestPlan(room=RoomId(2), tokens=16 * 9 + 3, prefix_tokens=16 * 2, chunk_tokens=(16 * 7 + 3,)),
    ]


def both_sides_bytes(pages: int, slots: int) -> int:
    spec = WITHOUT_DRAFT_STATE  # the buffers both sides have
    kv = pages * spec.kv_item_bytes * (spec.layers + spec.draft_layers)
    state = slots * spec.state_item_bytes * len(spec.state_kinds) * len(spec.state_layers)
    return kv + state + spec.aux_item_bytes


@pytest.mark.parametrize("prefill_has_draft_state", [True, False], ids=["decode-without", "prefill-without"])
def test_rooms_succeed_without_the_draft_state_one_side_lacks(prefill_has_draft_state: bool) -> None:
    spec = ClusterSpec(
        model=WITH_DRAFT_STATE if prefill_has_draft_state else WITHOUT_DRAFT_STATE,
        decode_model=WITHOUT_DRAFT_STATE if prefill_has_draft_state else WITH_DRAFT_STATE,
        prefill_capacity=Capacity(kv_pages=128, state_slots=16, aux_rows=8),
        decode_capacity=Capacity(kv_pages=256, state_slots=16, aux_rows=8),
    )
    with Cluster(spec) as cluster:
        outcomes = cluster.run(plans(), max_active=2)
        decode = [o for o in outcomes if o.side == "decode"]
        assert sorted(o.room for o in decode) == [1, 2]
        for o in decode:
            assert o.poll == KVPoll.Success, (o.room, o.failure)
            assert o.mismatches == () and o.bytes_checked > 0, (o.room, o.mismatches)
            if prefill_has_draft_state:
                assert o.draft_skipped == NOT_SENT + LISTED
            else:
                assert o.draft_skipped.startswith(NOT_WRITTEN + LISTED)
        reported = {o.room: o.bytes_reported for o in decode}
        assert reported == {1: both_sides_bytes(12, 2), 2: both_sides_bytes(8, 2)}
        reports = cluster.close()
    assert sum(r.canary_violations for r in reports) == 0
    assert sum(r.worker_errors for r in reports) == 0
