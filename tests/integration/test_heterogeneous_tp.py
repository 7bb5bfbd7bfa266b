"""MHA/GQA between prefill and decode instances of different TP sizes: real processes, real Mooncake TCP.

Both directions, with CP on the prefill side, chunked rooms, a cached prefix, per-layer and
monolithic transfer; every decode rank compares its heads byte for byte with the model's full layout
(``pdkv.testing.synthetic``: content per model head and token, whatever the TP split). Kept to three
small clusters so the suite stays short.
"""

from __future__ import annotations

import pytest

from pdkv.mapping import AttentionKind
from pdkv.protocol.poll import KVPoll
from pdkv.runtime.staging import StagingConfig
from pdkv.testing.cluster import Cluster, ClusterSpec, RoomOutcome
from pdkv.testing.synthetic import Capacity, ModelSpec
from tests.integration.test_cluster import check, plans

pytestmark = pytest.mark.slow

CAPACITY = Capacity(kv_pages=256, state_slots=32, aux_rows=16)
STATE_ITEM_BYTES = 32
AUX_ITEM_BYTES = 64
STATE_LAYERS = (1,)
STATE_SLOTS_PER_ROOM = 2


def gqa(kv_heads: int) -> ModelSpec:
    return ModelSpec(
        attention=AttentionKind.MHA,
        layers=3,
        page_size=16,
        kv_bytes_per_token=kv_heads * 8,
        kv_heads=kv_heads,
        state_layers=STATE_LAYERS,
        state_item_bytes=STATE_ITEM_BYTES,
        aux_item_bytes=AUX_ITEM_BYTES,
        draft_layers=1,
    )


def prefill_bytes(outcomes: list[RoomOutcome], rank: str) -> dict[int, int]:
    return {o.room: o.bytes_reported for o in outcomes if o.side == "prefill" and o.rank == rank}


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_prefill_tp1_cp2_splits_two_heads_over_decode_tp2(staged: bool) -> None:
    """P < D: each CP rank of the one prefill TP rank writes head 0 to decode rank 0 and head 1 to 1:
    one slice per token of its pages, sent as they are or gathered through its staging pool."""
    spec = ClusterSpec(
        model=gqa(2),
        prefill_cp=2,
        decode_tp=2,
        prefill_capacity=CAPACITY,
        state_slots_per_room=STATE_SLOTS_PER_ROOM,
        staging=StagingConfig(capacity_bytes=64 << 10, piece_bytes=8 << 10) if staged else None,
    )
    with Cluster(spec) as cluster:
        outcomes = cluster.run(plans(aborts=False))
        check(outcomes, cluster, decode_ranks=2)
        reports = cluster.close()
    prefills = [r for r in reports if r.side == "prefill"]
    assert all((r.staged_writes > 0) is staged for r in prefills)
    assert all(r.staging_leased_at_end == 0 for r in prefills)


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_prefill_tp2_merges_eight_heads_into_decode_tp1_and_one_rank_writes_extras(backend: str) -> None:
    """P > D, per layer: both prefill TP ranks are real (4 heads each); only tp0 writes state and aux.

    Both write the same KV bytes (half the heads each), so tp0 reports exactly the extras more: the
    state slots of every state kind and layer, and one aux row. The KV lands whole in the decode's
    landing pool and is scattered into its pages before Success (every room), the leases all back at
    the end.
    """
    model = gqa(8)
    spec = ClusterSpec(
        model=model,
        prefill_tp=2,
        prefill_capacity=CAPACITY,
        state_slots_per_room=STATE_SLOTS_PER_ROOM,
        per_layer=True,
        forward_writes_kv=True,
        backend=backend,
    )
    with Cluster(spec) as cluster:
        outcomes = cluster.run(plans(aborts=False))
        first, second = prefill_bytes(outcomes, "prefill tp0/cp0"), prefill_bytes(outcomes, "prefill tp1/cp0")
        assert all(o.poll == KVPoll.Success for o in outcomes if o.side == "prefill")
        assert {o.mode for o in outcomes if o.side == "prefill"} == {"per_layer"}  # one destination each
        extras = len(model.state_kinds) * len(STATE_LAYERS) * STATE_SLOTS_PER_ROOM * STATE_ITEM_BYTES
        extras += AUX_ITEM_BYTES
        assert first.keys() == second.keys() and first
        assert all(second[room] > 0 for room in second)
        assert {room: first[room] - second[room] for room in first} == dict.fromkeys(first, extras)
        check(outcomes, cluster)
        reports = cluster.close()
    (decode,) = [r for r in reports if r.side == "decode"]
    assert decode.rooms_landed == len(first)
    assert decode.landing_leased_at_end == 0


def test_gqa_replica_prefill_tp2_of_one_head_to_decode_tp1_uses_a_dummy() -> None:
    """P > D with one KV head held by both prefill ranks: tp1 is a replica, a dummy that writes nothing,
    and tp0's pages are the decode's whole: no landing zone."""
    spec = ClusterSpec(
        model=gqa(1), prefill_tp=2, prefill_capacity=CAPACITY, state_slots_per_room=STATE_SLOTS_PER_ROOM
    )
    with Cluster(spec) as cluster:
        outcomes = cluster.run(plans(aborts=False))
        assert set(prefill_bytes(outcomes, "prefill tp1/cp0").values()) == {0}
        assert all(b > 0 for b in prefill_bytes(outcomes, "prefill tp0/cp0").values())
        check(outcomes, cluster)
        reports = cluster.close()
    assert [r.rooms_landed for r in reports if r.side == "decode"] == [0]  # whole pages: nothing to land
