"""The landing zone (decode TP below prefill TP): every landing byte written once by the one prefill CP rank
owning its position, every decode head byte written exactly once from the right prefill head by the
scatter, and the lease's regions laid out as specs/mapping.md section 15 says.

Expected values never come from the code under test: the world, the ranks and the expected decode
memory are ``test_mapping_heads``'. The engine's writes into landing are memcpys of the prefill's blocks;
the scatter is applied here from the plan's groups (landing bytes in order into the listed rows of the
decode region), written independently of ``pdkv.runtime``.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings

from pdkv.errors import LayoutMismatchError, MappingError
from pdkv.mapping import (
    AttentionKind,
    BufferKind,
    ItemLayout,
    PageInterleaved,
    Topology,
    TransferBlocks,
    coalesce,
    decode_fanout,
    kv_blocks,
    map_chunk,
)
from pdkv.mapping.landing import (
    LandingPlan,
    ScatterPlan,
    grant_problem,
    landing_slots,
    landing_wanted,
    plan_landing,
    plan_scatter,
    source_region,
)
from pdkv.mapping.staging import StagingSources
from tests.mapping.test_mapping_heads import Rank, Scenario, chunk_bounds, make_world, mha, scenarios
from tests.mapping.test_mapping_staging import one_region

U8 = npt.NDArray[np.uint8]
LANDING = 1 << 30  # the landing lease's address: another allocation than the decode's buffers


class Landing:
    """A decode rank's landing lease as bytes, with a write count per byte."""

    def __init__(self, plan: LandingPlan) -> None:
        self.plan = plan
        self.memory = np.zeros(plan.total_bytes, dtype=np.uint8)
        self.writes = np.zeros(plan.total_bytes, dtype=np.int32)

    def write(self, blocks: TransferBlocks, src: Rank, region: int) -> None:
        """The engine: memcpy each block from the prefill rank into its landing region."""
        lo = LANDING + int(self.plan.offset[region])
        hi = lo + int(self.plan.nbytes[region])
        for s, d, n in zip(blocks.src.tolist(), blocks.dst.tolist(), blocks.length.tolist(), strict=True):
            assert lo <= d and d + n <= hi, "a block leaves its landing region"
            self.memory[d - LANDING : d - LANDING + n] = src.memory[s : s + n]
            self.writes[d - LANDING : d - LANDING + n] += 1


def scatter(plan: ScatterPlan, landing: Landing, regions: StagingSources, dst: Rank) -> None:
    for k in range(len(plan)):
        e, count = int(plan.element_bytes[k]), int(plan.count[k])
        at = int(plan.landing_address[k]) - LANDING
        values = landing.memory[at : at + count * e].reshape(count, e)
        start = int(regions.region_start[plan.region[k]])
        rows = plan.index[int(plan.first[k]) : int(plan.first[k]) + count]
        at_bytes = (start + rows[:, None] * e + np.arange(e)[None, :]).ravel()
        dst.memory[at_bytes] = values.ravel()
        np.add.at(dst.writes, at_bytes, 1)  # a row listed twice is counted twice


@settings(max_examples=120, deadline=None)
@given(scenarios())
def test_landing_then_scatter_writes_every_decode_head_byte_once_from_the_right_head(case: Scenario) -> None:
    cp, n, prefix = case.prefill_cp, case.positions, case.prefix
    world = make_world(
        case.seed,
        kv_heads=case.kv_heads,
        head_bytes=case.head_bytes,
        page_size=case.page_size,
        layers=case.layers,
        positions=n,
    )
    rng = np.random.default_rng(case.seed + 1)
    logical = rng.permutation(3 * n)[:n]
    policy = PageInterleaved(cp_size=cp)
    prefill = {
        (p, c): Rank(world, case.prefill_tp, p, pages=3 * n // cp + 1, item_layout=case.src_layout)
        for p in range(case.prefill_tp)
        for c in range(cp)
    }
    for (_, c), rank in prefill.items():
        for q in range(n):
            if logical[q] % cp == c:
                for key in world.keys:
                    rank.put(key, int(logical[q]) // cp, rank.item(key, q))
    decode = {
        d: Rank(world, case.decode_tp, d, pages=2 * n, item_layout=case.dst_layout)
        for d in range(case.decode_tp)
    }
    dst_pages = {d: rng.permutation(2 * n)[:n] for d in decode}
    topology = mha(case.prefill_tp, case.decode_tp, case.kv_heads, prefill_cp=cp)
    # A room-sized lease per decode rank: slots for positions prefix .. n - 1.
    plans = {
        d: plan_landing(
            decode[d].layout,
            topology,
            d,
            first_position=prefix,
            slots=n - prefix,
            base=LANDING,
            source_item_layout=case.src_layout,
        )
        for d in decode
    }
    landings = {d: Landing(plans[d]) for d in decode}
    for start, end in chunk_bounds(prefix, n, case.cuts):
        for d in decode:
            for target in decode_fanout(topology, d).targets:
                if target.dummy:
                    continue
                mapped = map_chunk(
                    logical[start:end],
                    start_token=start * world.page_size,
                    page_size=world.page_size,
                    dst_pages=dst_pages[d],
                    cp_rank=target.cp,
                    policy=policy,
                )
                source = prefill[(target.tp, target.cp)]
                index = int(np.flatnonzero(plans[d].source_tp_rank == target.tp)[0])
                # The prefill rank lays its region out from the grant and its own layout alone: the
                # same region the decode planned, and a grant it accepts.
                base, size = LANDING + int(plans[d].offset[index]), int(plans[d].nbytes[index])
                region = source_region(decode[d].layout, source.layout, base=base, slots=n - prefix)
                assert region == plans[d].region_of(target.tp)
                assert (
                    grant_problem(
                        decode[d].layout, source.layout, address=base, nbytes=size, slots=n - prefix
                    )
                    is None
                )
                slots = landing_slots(mapped.positions, plans[d])
                blocks = kv_blocks(coalesce(mapped.src, slots), source.layout, region)
                landings[d].write(blocks, source, index)
    for d, rank in decode.items():
        landing = landings[d]
        used = np.zeros(landing.plan.total_bytes, dtype=np.int32)
        for i in range(len(landing.plan.regions)):
            at = int(landing.plan.offset[i])
            used[at : at + int(landing.plan.nbytes[i])] = 1
        assert np.array_equal(landing.writes, used), f"decode rank {d}: landing bytes not written once"
        regions = one_region(rank)
        for source_tp in landing.plan.source_tp_rank.tolist():
            plan = plan_scatter(
                landing.plan,
                source_tp,
                rank.layout,
                positions=np.arange(prefix, n),
                dst_pages=dst_pages[d],
                regions=regions,
            )
            scatter(plan, landing, regions, rank)
        expected = np.zeros_like(rank.memory)
        expected_writes = np.zeros_like(rank.writes)
        for q in range(prefix, n):
            for key in world.keys:
                start = rank.base[key] + int(dst_pages[d][q]) * rank.item_bytes
                expected[start : start + rank.item_bytes] = rank.item(key, q)
                expected_writes[start : start + rank.item_bytes] = 1
        assert np.array_equal(rank.writes, expected_writes), (
            f"decode rank {d}: bytes not written exactly once"
        )
        assert np.array_equal(rank.memory, expected), f"decode rank {d}: wrong bytes"


def test_a_lease_is_one_aligned_region_per_real_source_laid_out_as_that_ranks_items() -> None:
    # 8 KV heads of 2 bytes, pages of 4 tokens, 2 layers; prefill TP 4 (2 heads each) -> decode TP 2
    # (4 heads each): decode rank 1 hears from prefill ranks 2 and 3, both real.
    world = make_world(0, kv_heads=8, head_bytes=2, page_size=4, layers=2, positions=1)
    decode = Rank(world, 2, 1, pages=8, item_layout=ItemLayout.TOKEN_HEAD)
    topology = Topology(prefill_tp=4, decode_tp=2, attention=AttentionKind.MHA, kv_heads=8)
    plan = plan_landing(decode.layout, topology, 1, first_position=3, slots=5, base=LANDING)
    # A source item is 4 tokens x 2 heads x 2 bytes = 16 bytes; 4 K/V buffers x 5 slots = 320 bytes,
    # rounded up to 512 for the next region.
    assert plan.source_tp_rank.tolist() == [2, 3]
    assert plan.offset.tolist() == [0, 512] and plan.nbytes.tolist() == [320, 320]
    assert plan.total_bytes == 1024
    region = plan.region_of(3)
    kv = [b for b in region.buffers if b.kind in (BufferKind.K, BufferKind.V)]
    assert [b.base_ptr - LANDING for b in kv] == [512, 592, 672, 752]
    assert {(b.item_bytes, b.num_items) for b in kv} == {(16, 5)}
    assert {(b.heads.head_start, b.heads.head_count) for b in kv if b.heads} == {(6, 2)}
    assert landing_slots([3, 7], plan).tolist() == [0, 4]
    with pytest.raises(MappingError, match=r"positions 2\.\.8 are outside the landing window 3\.\.7"):
        landing_slots([2, 8], plan)
    with pytest.raises(
        MappingError, match=r"prefill tp rank 0 has no landing region here \(sources: \[2, 3\]\)"
    ):
        plan.region_of(0)


def test_gqa_replicas_get_no_landing_region_and_layouts_need_heads() -> None:
    # 2 KV heads over prefill TP 4: ranks 1 and 3 are dummies (replicas of 0 and 2); decode TP 2.
    world = make_world(0, kv_heads=2, head_bytes=2, page_size=2, layers=1, positions=1)
    decode = Rank(world, 2, 0, pages=4, item_layout=ItemLayout.TOKEN_HEAD)
    topology = Topology(prefill_tp=4, decode_tp=2, attention=AttentionKind.MHA, kv_heads=2)
    plan = plan_landing(decode.layout, topology, 0, first_position=0, slots=2, base=LANDING)
    assert plan.source_tp_rank.tolist() == [0]
    from tests.mapping.test_mapping_heads import _strip_heads

    with pytest.raises(LayoutMismatchError, match="K and V buffers all describe their heads"):
        plan_landing(_strip_heads(decode.layout), topology, 0, first_position=0, slots=2, base=LANDING)


def test_a_prefill_rank_refuses_a_grant_that_does_not_fit_it() -> None:
    # E32's shapes: prefill TP 4 (2 of 8 heads a rank) -> decode TP 2 (4 heads); a region of 3 slots of
    # 4 K/V buffers of 4 tokens x 2 heads x 2 bytes = 192 bytes.
    world = make_world(0, kv_heads=8, head_bytes=2, page_size=4, layers=2, positions=1)
    decode = Rank(world, 2, 1, pages=8, item_layout=ItemLayout.TOKEN_HEAD)
    source = Rank(world, 4, 2, pages=8, item_layout=ItemLayout.TOKEN_HEAD)
    assert grant_problem(decode.layout, source.layout, address=LANDING, nbytes=192, slots=3) is None
    assert grant_problem(decode.layout, source.layout, address=LANDING, nbytes=256, slots=3) == (
        "landing grant of 256 bytes, but 3 slots of this rank's items need 192"
    )
    inside = decode.layout.buffers[1].base_ptr + 8  # the grant would overwrite the decode's own pages
    problem = grant_problem(decode.layout, source.layout, address=inside, nbytes=192, slots=3)
    assert problem is not None and "overlaps the decode's" in problem
    topology = Topology(prefill_tp=4, decode_tp=2, attention=AttentionKind.MHA, kv_heads=8)
    assert landing_wanted(decode.layout, topology, 1)
    # Equal TP, decode TP above prefill TP and GQA replicas (one real source a decode rank) need none.
    assert not landing_wanted(
        decode.layout, Topology(prefill_tp=2, decode_tp=2, attention=AttentionKind.MHA, kv_heads=8), 1
    )
    assert not landing_wanted(
        decode.layout, Topology(prefill_tp=1, decode_tp=2, attention=AttentionKind.MHA, kv_heads=8), 1
    )
    replicas = Topology(prefill_tp=4, decode_tp=2, attention=AttentionKind.MHA, kv_heads=2)
    gqa = Rank(
        make_world(0, kv_heads=2, head_bytes=2, page_size=4, layers=1, positions=1),
        2,
        0,
        pages=4,
        item_layout=ItemLayout.TOKEN_HEAD,
    )
    assert not landing_wanted(gqa.layout, replicas, 0)
    # Head-major decode pages: each source's share is one stretch per page already.
    head_major = Rank(world, 2, 1, pages=8, item_layout=ItemLayout.HEAD_TOKEN)
    assert not landing_wanted(head_major.layout, topology, 1)
