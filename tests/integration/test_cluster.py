"""Real processes over real Mooncake TCP on 127.0.0.1 (and over NIXL, UCX's default transports and
tcp, for the CP case that has every feature): decode memory compared byte for byte.

One cluster run per topology; each run mixes the features (chunked rooms, cached prefixes, state
on some layers only, a draft model, aborts by either side) so the suite stays short."""

from __future__ import annotations

import pytest

from pdkv.mapping import AttentionKind
from pdkv.protocol.ids import RoomId
from pdkv.protocol.poll import KVPoll
from pdkv.testing.cluster import AbortPlan, Cluster, ClusterSpec, RequestPlan, RoomOutcome
from pdkv.testing.synthetic import Capacity, ModelSpec

pytestmark = pytest.mark.slow

MLA = ModelSpec(layers=4, page_size=16, kv_bytes_per_token=64, state_layers=(0, 2), draft_layers=1)
MHA = ModelSpec(
    attention=AttentionKind.MHA,
    layers=3,
    page_size=16,
    kv_bytes_per_token=32,
    state_layers=(1,),
    draft_layers=1,
)


def plans(*, aborts: bool) -> list[RequestPlan]:
    out = [
        RequestPlan(room=RoomId(1), tokens=16 * 20, chunk_tokens=(16 * 8, 16 * 8, 16 * 4)),
        RequestPlan(room=RoomId(2), tokens=16 * 13 + 5, chunk_tokens=(16 * 13 + 5,)),  # partial last page
        RequestPlan(
            room=RoomId(3), tokens=16 * 24, prefix_tokens=16 * 6, chunk_tokens=(16 * 10, 16 * 8)
        ),  # cached prefix
        RequestPlan(room=RoomId(4), tokens=16 * 40, chunk_tokens=(16 * 10,) * 4),
    ]
    if aborts:
        out += [
            RequestPlan(
                room=RoomId(5),
                tokens=16 * 30,
                chunk_tokens=(16 * 10,) * 3,
                abort=AbortPlan(side="prefill", after_chunks=1),
            ),
            RequestPlan(
                room=RoomId(6),
                tokens=16 * 30,
                chunk_tokens=(16 * 10,) * 3,
                abort=AbortPlan(side="decode", after_s=0.0),
            ),
        ]
    return out


def check(outcomes: list[RoomOutcome], cluster: Cluster, *, decode_ranks: int = 1) -> None:
    decode = [o for o in outcomes if o.side == "decode"]
    assert decode, "no decode outcome"
    for o in decode:
        assert o.mismatches == (), (o.room, o.mismatches)
        if o.room in (5, 6):
            continue  # planned aborts: Failed, or Success if the abort lost the race
        assert o.poll == KVPoll.Success, (o.room, o.failure)
        assert o.bytes_checked > 0
    assert len(decode) == len({o.room for o in decode}) * decode_ranks
    reports = cluster.close()
    assert sum(r.canary_violations for r in reports) == 0
    assert sum(r.worker_errors for r in reports) == 0


@pytest.mark.parametrize(
    ("backend", "ucx_tls", "cp"),
    [
        ("mooncake", None, 1),
        ("mooncake", None, 2),
        ("mooncake", None, 4),
        ("nixl", None, 2),
        ("nixl", "tcp", 2),
    ],
    ids=["mooncake-cp1", "mooncake-cp2", "mooncake-cp4", "nixl-cp2", "nixl-tcp-cp2"],
)
def test_cp_shared_kv_mla(backend: str, ucx_tls: str | None, cp: int) -> None:
    spec = ClusterSpec(
        model=MLA,
        prefill_cp=cp,
        prefill_capacity=Capacity(kv_pages=256, state_slots=32, aux_rows=16),
        backend=backend,
        ucx_tls=ucx_tls,
    )
    with Cluster(spec) as cluster:
        outcomes = cluster.run(plans(aborts=cp == 2), max_active=4)
        check(outcomes, cluster)


def test_mha_layout() -> None:
    spec = ClusterSpec(
        model=MHA, prefill_cp=2, prefill_capacity=Capacity(kv_pages=256, state_slots=32, aux_rows=16)
    )
    with Cluster(spec) as cluster:
        check(cluster.run(plans(aborts=False)), cluster)


def test_prefill_tp2_to_decode_tp1_uses_a_dummy() -> None:
    spec = ClusterSpec(
        model=MLA, prefill_tp=2, prefill_capacity=Capacity(kv_pages=256, state_slots=32, aux_rows=16)
    )
    with Cluster(spec) as cluster:
        outcomes = cluster.run(plans(aborts=False))
        prefill = [o for o in outcomes if o.side == "prefill"]
        # The replica (tp1) reports Success without writing; tp0 wrote every byte.
        assert {o.rank for o in prefill} == {"prefill tp0/cp0", "prefill tp1/cp0"}
        assert all(o.poll == KVPoll.Success for o in prefill)
        assert all(o.bytes_reported == 0 for o in prefill if o.rank == "prefill tp1/cp0")
        assert all(o.bytes_reported > 0 for o in prefill if o.rank == "prefill tp0/cp0")
        check(outcomes, cluster)


def test_prefill_tp1_fans_out_to_decode_tp2() -> None:
    spec = ClusterSpec(
        model=MLA, decode_tp=2, prefill_capacity=Capacity(kv_pages=256, state_slots=32, aux_rows=16)
    )
    with Cluster(spec) as cluster:
        outcomes = cluster.run(plans(aborts=False))
        check(outcomes, cluster, decode_ranks=2)
