"""The landing zone's two halves with real tensors (decode TP below prefill TP; not wired into the
transports yet): prefill ranks of TP 4 write their whole pages into a decode rank's landing lease (the
engine's part, done here as memcpys of the mapped blocks), then ``LandingRegions.scatter`` copies them
into the decode's pages. The decode memory is checked with the content rule of
``pdkv.testing.synthetic`` (per model head and token, whatever the TP split); a control that skips one
source's scatter must be caught by the same check."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from pdkv.errors import ConfigError
from pdkv.mapping import AttentionKind, PageInterleaved, Topology, TransferBlocks, coalesce, kv_blocks
from pdkv.mapping.landing import LandingPlan, landing_slots, plan_landing, plan_scatter
from pdkv.runtime.staging import LandingRegions
from pdkv.testing.synthetic import Capacity, ModelSpec, RankMemory, verify_room

SPEC = ModelSpec(
    attention=AttentionKind.MHA, layers=2, page_size=16, kv_bytes_per_token=8 * 8, kv_heads=8, draft_layers=1
)
TOPOLOGY = Topology(prefill_tp=4, decode_tp=2, attention=AttentionKind.MHA, kv_heads=8)


def memcpy(blocks: TransferBlocks) -> None:
    for s, d, n in zip(blocks.src.tolist(), blocks.dst.tolist(), blocks.length.tolist(), strict=True):
        ctypes.memmove(d, s, n)


def land(
    decode_tp_rank: int, logical: np.ndarray, dst: np.ndarray
) -> tuple[RankMemory, LandingPlan, torch.Tensor]:
    """Every real source of ``decode_tp_rank`` writes every position of the room into a fresh lease."""
    policy = PageInterleaved(cp_size=1)
    decode = RankMemory(
        SPEC, Capacity(kv_pages=64, state_slots=1, aux_rows=1), tp_size=2, tp_rank=decode_tp_rank
    )
    probe = plan_landing(
        decode.layout, TOPOLOGY, decode_tp_rank, first_position=0, slots=len(logical), base=0
    )
    lease = torch.zeros(probe.total_bytes, dtype=torch.uint8)
    plan = plan_landing(
        decode.layout, TOPOLOGY, decode_tp_rank, first_position=0, slots=len(logical), base=lease.data_ptr()
    )
    slots = landing_slots(np.arange(len(logical)), plan)
    for source in plan.source_tp_rank.tolist():
        prefill = RankMemory(
            SPEC, Capacity(kv_pages=64, state_slots=1, aux_rows=1), tp_size=4, tp_rank=source
        )
        prefill.fill_prefill(cp_rank=0, policy=policy)
        memcpy(kv_blocks(coalesce(logical, slots), prefill.layout, plan.region_of(source)))
    return decode, plan, lease


def check(decode: RankMemory, logical: np.ndarray, dst: np.ndarray) -> list[str]:
    _, mismatches = verify_room(
        decode,
        logical_ids=logical,
        dst_pages=dst,
        prefix_pages=0,
        state_src={},
        state_dst={},
        aux_src=None,
        aux_dst=None,
    )
    return [m.what for m in mismatches]


@pytest.mark.parametrize("decode_tp_rank", [0, 1])
def test_landing_then_scatter_gives_the_decode_every_head_of_every_token(decode_tp_rank: int) -> None:
    rng = np.random.default_rng(decode_tp_rank)
    logical = rng.choice(64, size=20, replace=False).astype(np.int64)
    dst = np.concatenate([np.arange(30, 40), rng.choice(np.arange(40, 64), size=10, replace=False)]).astype(
        np.int64
    )
    decode, plan, lease = land(decode_tp_rank, logical, dst)
    targets = LandingRegions(
        decode.layout, [decode.tensors[(b.model, b.kind, b.layer_id)] for b in decode.layout.buffers]
    )
    assert plan.source_tp_rank.tolist() == [2 * decode_tp_rank, 2 * decode_tp_rank + 1]
    assert check(decode, logical, dst)  # nothing scattered yet: the check fails
    for source in plan.source_tp_rank.tolist():
        scatter = plan_scatter(
            plan, source, decode.layout, positions=np.arange(20), dst_pages=dst, regions=targets.sources
        )
        assert len(scatter) == 2 * (SPEC.layers + SPEC.draft_layers)  # one copy per K/V buffer
        targets.scatter(scatter, lease)
    assert check(decode, logical, dst) == []


def test_a_skipped_source_leaves_its_heads_unwritten() -> None:
    logical = np.arange(8, dtype=np.int64) + 3
    dst = np.arange(8, dtype=np.int64) + 20
    decode, plan, lease = land(0, logical, dst)
    targets = LandingRegions(
        decode.layout, [decode.tensors[(b.model, b.kind, b.layer_id)] for b in decode.layout.buffers]
    )
    first = plan_scatter(
        plan, 0, decode.layout, positions=np.arange(8), dst_pages=dst, regions=targets.sources
    )
    targets.scatter(first, lease)  # source 1's heads never scattered: the control
    assert check(decode, logical, dst) != []


def test_a_plan_outside_the_landing_tensor_is_refused() -> None:
    logical = np.arange(4, dtype=np.int64)
    dst = np.arange(4, dtype=np.int64)
    decode, plan, lease = land(0, logical, dst)
    targets = LandingRegions(
        decode.layout, [decode.tensors[(b.model, b.kind, b.layer_id)] for b in decode.layout.buffers]
    )
    scatter = plan_scatter(
        plan, 1, decode.layout, positions=np.arange(4), dst_pages=dst, regions=targets.sources
    )
    with pytest.raises(ConfigError, match="outside the"):
        targets.scatter(scatter, lease[: lease.numel() // 2])
    with pytest.raises(ConfigError, match="tensors for"):
        LandingRegions(decode.layout, [])
