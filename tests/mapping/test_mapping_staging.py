"""The staged gather: every decode head byte written exactly once from the right prefill head, through
staging pieces, and pieces that are exactly their blocks' bytes.

Expected values never come from the code under test. The world is ``test_mapping_heads``': the model's
full KV as numpy bytes, every prefill rank filled from it, decode memory expected from it. The staged
path is applied the way an engine and a copy kernel would apply it, written here independently: each
gather group views its region as rows of ``element_bytes`` and copies the listed rows into the piece;
each staged block is then a memcpy from the piece to the decode rank, checked to stay inside the peer
buffer of the local buffer it names.
"""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdkv.errors import MappingError
from pdkv.mapping import (
    ItemLayout,
    PageInterleaved,
    TransferBlocks,
    coalesce,
    decode_fanout,
    kv_blocks,
    map_chunk,
)
from pdkv.mapping.staging import (
    NO_REGION,
    StagedPiece,
    StagingSources,
    plan_staged_pieces,
    stageable,
    staged_entries,
)
from tests.mapping.test_mapping_heads import (
    Rank,
    Scenario,
    chunk_bounds,
    make_world,
    mha,
    scenarios,
)

U8 = npt.NDArray[np.uint8]


def one_region(rank: Rank) -> StagingSources:
    """Every buffer of the rank in one region: its whole byte array (addresses from 0)."""
    buffers = rank.layout.buffers
    return StagingSources(
        buffer_region=np.zeros(len(buffers), dtype=np.int64),
        buffer_start=[b.base_ptr for b in buffers],
        buffer_end=[b.base_ptr + b.length for b in buffers],
        region_start=[0],
        region_bytes=[rank.memory.size],
    )


def region_per_buffer(rank: Rank) -> StagingSources:
    """Every buffer its own region (separate tensors)."""
    buffers = rank.layout.buffers
    return StagingSources(
        buffer_region=np.arange(len(buffers), dtype=np.int64),
        buffer_start=[b.base_ptr for b in buffers],
        buffer_end=[b.base_ptr + b.length for b in buffers],
        region_start=[b.base_ptr for b in buffers],
        region_bytes=[b.length for b in buffers],
    )


def gather(piece: StagedPiece, sources: StagingSources, memory: U8) -> U8:
    """What a copy kernel puts into the piece: group by group, the listed rows of the region."""
    out = np.full(piece.nbytes, 0xEE, dtype=np.uint8)  # a byte the gather misses would stay 0xEE
    plan = piece.gather
    for k in range(len(plan)):
        start, size = int(sources.region_start[plan.region[k]]), int(sources.region_bytes[plan.region[k]])
        e = int(plan.element_bytes[k])
        rows = memory[start : start + size // e * e].reshape(-1, e)
        taken = rows[plan.index[int(plan.first[k]) : int(plan.first[k]) + int(plan.count[k])]]
        at = int(plan.out_offset[k])
        out[at : at + taken.size] = taken.reshape(-1)
    return out


def apply_staged(piece: StagedPiece, staging: U8, src: Rank, dst: Rank) -> None:
    """memcpy every staged block from the piece into the decode rank, counting writes."""
    blocks = piece.blocks
    for s, d, n, b in zip(
        blocks.src.tolist(), blocks.dst.tolist(), blocks.length.tolist(), blocks.buffer.tolist(), strict=True
    ):
        assert s >= 0 and s + n <= piece.nbytes, "a staged block leaves its piece"
        spec = src.layout.buffers[b]
        peer = next(x for x in dst.layout.buffers if (x.kind, x.layer_id) == (spec.kind, spec.layer_id))
        assert peer.base_ptr <= d and d + n <= peer.base_ptr + peer.length, "a block leaves the peer buffer"
        dst.memory[d : d + n] = staging[s : s + n]
        dst.writes[d : d + n] += 1


@settings(max_examples=120, deadline=None)
@given(scenarios(), st.data())
def test_every_decode_head_byte_is_written_once_from_the_right_head_through_staging(
    case: Scenario, data: st.DataObject
) -> None:
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
    # Runs of destination pages (as a scheduler's allocator gives), so staged pages can merge.
    dst_pages = {d: (np.arange(2 * n) + d) % (2 * n) if d % 2 else rng.permutation(2 * n) for d in decode}
    split = data.draw(st.sampled_from([one_region, region_per_buffer]))
    topology = mha(case.prefill_tp, case.decode_tp, case.kv_heads, prefill_cp=cp)
    for start, end in chunk_bounds(prefix, n, case.cuts):
        for d in range(case.decode_tp):
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
                blocks = kv_blocks(coalesce(mapped.src, mapped.dst), source.layout, decode[d].layout)
                if not len(blocks):
                    continue
                longest = int(blocks.length.max())
                piece_bytes = data.draw(st.integers(longest, max(longest, blocks.total_bytes)))
                sources = split(source)
                pieces = plan_staged_pieces(blocks, sources, piece_bytes=piece_bytes)
                assert TransferBlocks.concat([p.source for p in pieces]) == blocks  # every block, in order
                for piece in pieces:
                    assert piece.nbytes == piece.source.total_bytes == piece.blocks.total_bytes <= piece_bytes
                    assert piece.gather.total_bytes == piece.nbytes
                    assert len(piece.blocks) <= len(piece.source)
                    apply_staged(piece, gather(piece, sources, source.memory), source, decode[d])

    for d, rank in decode.items():
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


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 4), (1, 8), (2, 8)])
def test_a_decode_rank_of_a_higher_tp_gets_one_staged_block_per_destination_run(
    prefill_tp: int, decode_tp: int
) -> None:
    # Token-major on both sides, 8 KV heads: the decode rank holds a subset of the prefill rank's heads,
    # so its pages are whole in staging and consecutive destination pages merge into one block.
    world = make_world(0, kv_heads=8, head_bytes=2, page_size=4, layers=2, positions=12)
    here = Rank(world, prefill_tp, 0, pages=16, item_layout=ItemLayout.TOKEN_HEAD)
    there = Rank(world, decode_tp, 0, pages=16, item_layout=ItemLayout.TOKEN_HEAD)
    src = np.array([3, 4, 5, 9, 10, 0, 1, 2, 6, 7, 8, 11])
    dst = np.array([0, 1, 2, 3, 4, 8, 9, 5, 6, 7, 12, 13])  # runs of destination pages: 0-4, 8-9, 5-7, 12-13
    blocks = kv_blocks(coalesce(src, dst), here.layout, there.layout)
    assert len(blocks) == len(world.keys) * 12 * 4  # one block per token of every page: strided here
    assert staged_entries(blocks) == len(world.keys) * 4  # the 4 destination runs, in every buffer
    (piece,) = plan_staged_pieces(blocks, one_region(here), piece_bytes=blocks.total_bytes)
    assert len(piece.blocks) == len(world.keys) * 4
    # The other direction: the prefill rank's share is a strided slice of every decode token.
    back = kv_blocks(coalesce(dst, src), there.layout, here.layout)
    assert staged_entries(back) == len(back)  # nothing merges: staging on the prefill gains nothing


def test_blocks_outside_readable_buffers_are_refused() -> None:
    world = make_world(0, kv_heads=4, head_bytes=2, page_size=2, layers=1, positions=2)
    here = Rank(world, 1, 0, pages=4, item_layout=ItemLayout.TOKEN_HEAD)
    sources = one_region(here)
    first = here.layout.buffers[0]
    blocks = TransferBlocks(src=[first.base_ptr], dst=[0], length=[8], buffer=[0])
    assert stageable(blocks, sources)
    unreadable = attrs.evolve(sources, buffer_region=np.full(sources.buffers, NO_REGION))
    assert not stageable(blocks, unreadable)
    with pytest.raises(MappingError, match="not all inside buffers the stager can read"):
        plan_staged_pieces(blocks, unreadable, piece_bytes=64)
    past_end = TransferBlocks(src=[first.base_ptr + first.length - 4], dst=[0], length=[8], buffer=[0])
    assert not stageable(past_end, sources)
    with pytest.raises(MappingError, match="a block of 8 bytes exceeds piece_bytes 4"):
        plan_staged_pieces(blocks, sources, piece_bytes=4)
    with pytest.raises(MappingError, match="piece_bytes must be a positive int"):
        plan_staged_pieces(blocks, sources, piece_bytes=0)
    empty = TransferBlocks(src=[5], dst=[0], length=[0], buffer=[0])
    assert plan_staged_pieces(empty, sources, piece_bytes=4) == []


def test_staging_sources_validate_their_tables() -> None:
    with pytest.raises(MappingError, match="one of each per buffer"):
        StagingSources(
            buffer_region=[0, 0], buffer_start=[0], buffer_end=[4, 8], region_start=[0], region_bytes=[8]
        )
    with pytest.raises(MappingError, match=r"names a region outside 0\.\.0"):
        StagingSources(
            buffer_region=[1], buffer_start=[0], buffer_end=[4], region_start=[0], region_bytes=[8]
        )
    with pytest.raises(MappingError, match=r"buffer #0 \[0x4, 0x10\) is not inside region #0 \[0x0, 0x8\)"):
        StagingSources(
            buffer_region=[0], buffer_start=[4], buffer_end=[16], region_start=[0], region_bytes=[8]
        )
    table = StagingSources(
        buffer_region=[NO_REGION, 0],
        buffer_start=[0, 8],
        buffer_end=[4, 12],
        region_start=[8],
        region_bytes=[4],
    )
    assert (table.buffers, table.regions) == (2, 1)


def test_staged_blocks_never_merge_across_buffers_or_destination_gaps() -> None:
    # Four 4-byte blocks from two buffers; the peer buffers are adjacent (51..59 ends where 59.. starts).
    blocks = TransferBlocks(
        src=[100, 108, 200, 208], dst=[51, 55, 59, 64], length=[4, 4, 4, 4], buffer=[0, 0, 1, 1]
    )
    sources = StagingSources(
        buffer_region=[0, 0],
        buffer_start=[100, 200],
        buffer_end=[120, 220],
        region_start=[100],
        region_bytes=[120],
    )
    assert staged_entries(blocks) == 3  # 51+55 merge; 59 is another buffer; 64 does not follow 59 + 4
    (piece,) = plan_staged_pieces(blocks, sources, piece_bytes=16)
    assert piece.blocks == TransferBlocks(
        src=[0, 8, 12], dst=[51, 59, 64], length=[8, 4, 4], buffer=[0, 1, 1]
    )
    # One gather group (one region), elements of 4 bytes at region offsets 0, 8, 100, 108.
    assert piece.gather.index.tolist() == [0, 2, 25, 27]
    assert piece.gather.element_bytes.tolist() == [4]
