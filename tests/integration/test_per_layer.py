"""Per-layer transfer across real processes over real Mooncake TCP on 127.0.0.1.

The prefill ranks' forwards write each layer's KV as the layer ends (their pages are zeroed first),
so a layer sent before it was written lands as zeros and the decode side's byte check fails. One
cluster run mixes the cases: chunked rooms, a decode-side cached prefix, a prefill-side resident
prefix, a monolithic room beside per-layer ones, and aborts by either side in the middle of a
forward (decode canaries catch any write after the abort was acknowledged). And ``pdkv bench
per_layer --quick`` prints consistent figures."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdkv.protocol.ids import RoomId
from pdkv.protocol.poll import KVPoll
from pdkv.testing.cluster import AbortPlan, Cluster, ClusterSpec, RequestPlan
from pdkv.testing.synthetic import Capacity, ModelSpec

pytestmark = pytest.mark.slow

MLA = ModelSpec(layers=4, page_size=16, kv_bytes_per_token=64, state_layers=(0, 2), draft_layers=1)
LAYER_S = 0.003
ABORTED = {5, 6}


def plans() -> list[RequestPlan]:
    page = 16
    return [
        RequestPlan(
            room=RoomId(1),
            tokens=page * 20,
            chunk_tokens=(page * 8, page * 8, page * 4),
            layer_compute_s=LAYER_S,
        ),
        RequestPlan(
            room=RoomId(2), tokens=page * 13 + 5, chunk_tokens=(page * 13 + 5,), layer_compute_s=LAYER_S
        ),
        RequestPlan(
            room=RoomId(3),
            tokens=page * 24,
            prefix_tokens=page * 6,
            chunk_tokens=(page * 10, page * 8),
            resident_tokens=page * 3,
            layer_compute_s=LAYER_S,
        ),
        RequestPlan(
            room=RoomId(4),
            tokens=page * 12,
            chunk_tokens=(page * 12,),
            layer_compute_s=LAYER_S,
            per_layer=False,
        ),
        RequestPlan(
            room=RoomId(5),
            tokens=page * 30,
            chunk_tokens=(page * 10,) * 3,
            layer_compute_s=0.02,
            abort=AbortPlan(side="prefill", after_chunks=1, after_layers=2),
        ),
        RequestPlan(
            room=RoomId(6),
            tokens=page * 30,
            chunk_tokens=(page * 10,) * 3,
            layer_compute_s=0.03,
            abort=AbortPlan(side="decode", after_s=0.15),
        ),
    ]


@pytest.mark.parametrize(("backend", "cp"), [("mooncake", 1), ("mooncake", 4), ("nixl", 4)])
def test_per_layer_rooms_land_byte_for_byte(backend: str, cp: int) -> None:
    spec = ClusterSpec(
        model=MLA,
        backend=backend,
        prefill_cp=cp,
        per_layer=True,
        forward_writes_kv=True,
        prefill_capacity=Capacity(kv_pages=256, state_slots=32, aux_rows=16),
    )
    with Cluster(spec) as cluster:
        outcomes = cluster.run(plans(), max_active=3)
        reports = cluster.close()
    decode = {o.room: o for o in outcomes if o.side == "decode"}
    prefill = [o for o in outcomes if o.side == "prefill"]
    assert set(decode) == {1, 2, 3, 4, 5, 6}
    for room, o in decode.items():
        assert o.mismatches == (), (room, o.mismatches)
        if room not in ABORTED:
            assert o.poll == KVPoll.Success, (room, o.failure)
            assert o.bytes_checked > 0
    assert decode[5].poll == KVPoll.Failed  # aborted before its second chunk was ever sent
    for o in prefill:
        if o.room == 4:
            assert o.mode == "monolithic"
        elif o.room in ABORTED:
            assert o.mode in ("per_layer", ""), (o.room, o.rank, o.mode)  # "": aborted before any forward
        else:
            assert o.mode == "per_layer", (o.room, o.rank, o.mode)
    assert sum(r.canary_violations for r in reports) == 0
    assert sum(r.worker_errors for r in reports) == 0


def test_bench_per_layer_quick() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pdkv", "bench", "per_layer", "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    [record] = [json.loads(line) for line in proc.stdout.splitlines()]
    assert record["bench"] == "per_layer" and record["verified"] is True
    assert record["tokens"] == 1024 and record["layers"] == 4
    assert record["bytes"] == 16 * 64 * 1152 * 4  # 16 pages of 64 tokens, 1,152 B per token, 4 layers
    seconds = record["seconds"]
    assert seconds["monolithic"] > 0 and seconds["per_layer"] > 0
    assert record["per_layer_vs_monolithic"] == pytest.approx(seconds["per_layer"] / seconds["monolithic"])
    assert record["layer_compute_ms"] > 0
    assert record["forward_s"] == pytest.approx(record["layer_compute_ms"] * 4 / 1000)
    assert "per-layer ms" in proc.stderr
