"""Byte blocks per buffer: addresses, bytes per buffer, order, pairing by key, layout mismatches."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdkv.errors import LayoutMismatchError, MappingError
from pdkv.mapping import (
    AttentionKind,
    BufferKind,
    BufferLayout,
    BufferSpec,
    ModelRole,
    PageRuns,
    StateLayerMap,
    TransferBlocks,
    aux_blocks,
    coalesce,
    expand,
    layer_blocks,
    pair_buffers,
    state_blocks,
)

T, D = ModelRole.TARGET, ModelRole.DRAFT


def spec(
    kind: BufferKind, model: ModelRole, layer: int, base: int, items: int, item_bytes: int
) -> BufferSpec:
    return BufferSpec(
        kind=kind,
        model=model,
        layer_id=layer,
        base_ptr=base,
        length=items * item_bytes,
        item_bytes=item_bytes,
    )


def kv_layout(
    *,
    attention: AttentionKind,
    layers: int,
    draft_layers: int,
    item_bytes: int,
    items: int,
    base: int,
    page_size: int = 16,
) -> BufferLayout:
    """KV buffers laid out one after another from ``base`` (MLA: KV; MHA: K and V)."""
    kinds = [BufferKind.KV] if attention is AttentionKind.MLA else [BufferKind.K, BufferKind.V]
    specs: list[BufferSpec] = []
    stride = items * item_bytes
    for model, count in ((T, layers), (D, draft_layers)):
        for kind in kinds:
            for layer in range(count):
                specs.append(spec(kind, model, layer, base + len(specs) * stride, items, item_bytes))
    return BufferLayout.build(attention=attention, page_size=page_size, buffers=specs)


@st.composite
def kv_cases(draw: st.DrawFn) -> tuple[PageRuns, BufferLayout, BufferLayout]:
    attention = draw(st.sampled_from(list(AttentionKind)))
    layers = draw(st.integers(1, 5))
    draft = draw(st.integers(0, 2))
    item_bytes = draw(st.sampled_from([1, 8, 576, 73_728]))
    src_items, dst_items = draw(st.integers(40, 60)), draw(st.integers(40, 60))
    local = kv_layout(
        attention=attention,
        layers=layers,
        draft_layers=draft,
        item_bytes=item_bytes,
        items=src_items,
        base=1 << 20,
    )
    peer = kv_layout(
        attention=attention,
        layers=layers,
        draft_layers=draft,
        item_bytes=item_bytes,
        items=dst_items,
        base=1 << 40,
    )
    count = draw(st.integers(0, 40))
    src = draw(st.lists(st.integers(0, src_items - 1), min_size=count, max_size=count, unique=True))
    dst = draw(st.lists(st.integers(0, dst_items - 1), min_size=count, max_size=count, unique=True))
    return coalesce(src, dst), local, peer


@given(kv_cases())
def test_block_bytes_sum_to_pages_times_item_bytes_per_buffer(
    case: tuple[PageRuns, BufferLayout, BufferLayout],
) -> None:
    runs, local, peer = case
    blocks = layer_blocks(runs, local, peer)
    kv = [i for i, b in enumerate(local.buffers) if b.kind.is_kv]
    assert len(blocks) == len(runs) * len(kv)
    for index in kv:
        mine = blocks.buffer == index
        assert int(blocks.length[mine].sum()) == runs.num_pages * local.buffers[index].item_bytes


def _keeps_the_block_rules(blocks: TransferBlocks) -> None:
    """What the checked constructor would make of the same arrays: 1-D contiguous int64, one size,
    lengths >= 0 (the builders below skip that check: their arrays keep the rules by construction)."""
    for array in (blocks.src, blocks.dst, blocks.length, blocks.buffer):
        assert array.dtype == np.int64 and array.ndim == 1 and array.flags.c_contiguous
    assert (
        TransferBlocks(src=blocks.src, dst=blocks.dst, length=blocks.length, buffer=blocks.buffer) == blocks
    )
    assert not blocks.length.size or int(blocks.length.min()) >= 0


@given(kv_cases(), st.integers(0, 3))
def test_built_and_concatenated_blocks_keep_the_rules_they_are_not_checked_for(
    case: tuple[PageRuns, BufferLayout, BufferLayout], copies: int
) -> None:
    runs, local, peer = case
    blocks = layer_blocks(runs, local, peer)
    _keeps_the_block_rules(blocks)
    first_half = blocks.take(slice(0, len(blocks) // 2))
    joined = TransferBlocks.concat([blocks, first_half, TransferBlocks.empty()] * copies)
    _keeps_the_block_rules(joined)
    assert len(joined) == copies * (len(blocks) + len(first_half))
    assert joined.total_bytes == copies * (blocks.total_bytes + first_half.total_bytes)


@given(kv_cases())
def test_every_page_lands_at_base_plus_page_times_item_bytes(
    case: tuple[PageRuns, BufferLayout, BufferLayout],
) -> None:
    runs, local, peer = case
    blocks = layer_blocks(runs, local, peer)
    pairs = expand(runs)
    # reference loop: per buffer, per page, the address the layout formula gives
    expected_src: list[int] = []
    expected_dst: list[int] = []
    for here, there in zip(local.buffers, peer.buffers, strict=True):
        expected_src.extend(here.base_ptr + int(p) * here.item_bytes for p in pairs.src)
        expected_dst.extend(there.base_ptr + int(p) * there.item_bytes for p in pairs.dst)
    got_src: list[int] = []
    got_dst: list[int] = []
    for s, d, n, b in zip(blocks.src, blocks.dst, blocks.length, blocks.buffer, strict=True):
        item = local.buffers[int(b)].item_bytes
        assert int(n) % item == 0
        got_src.extend(int(s) + k * item for k in range(int(n) // item))
        got_dst.extend(int(d) + k * item for k in range(int(n) // item))
    assert got_src == expected_src
    assert got_dst == expected_dst


def test_mla_hand_example() -> None:
    local = BufferLayout.build(
        attention=AttentionKind.MLA,
        page_size=64,
        buffers=[spec(BufferKind.KV, T, 0, 1000, 10, 100), spec(BufferKind.KV, T, 1, 5000, 10, 100)],
    )
    peer = BufferLayout.build(
        attention=AttentionKind.MLA,
        page_size=64,
        buffers=[spec(BufferKind.KV, T, 0, 90_000, 20, 100), spec(BufferKind.KV, T, 1, 70_000, 20, 100)],
    )
    runs = PageRuns(src_start=[2, 7], dst_start=[11, 3], length=[3, 1])
    assert layer_blocks(runs, local, peer) == TransferBlocks(
        src=[1200, 1700, 5200, 5700],
        dst=[91_100, 90_300, 71_100, 70_300],
        length=[300, 100, 300, 100],
        buffer=[0, 0, 1, 1],
    )


def test_mha_blocks_are_k_layers_then_v_layers_then_draft() -> None:
    local = kv_layout(attention=AttentionKind.MHA, layers=2, draft_layers=1, item_bytes=10, items=8, base=0)
    blocks = layer_blocks(PageRuns(src_start=[1], dst_start=[2], length=[1]), local, local)
    kinds = [
        (local.buffers[int(b)].model, local.buffers[int(b)].kind, local.buffers[int(b)].layer_id)
        for b in blocks.buffer
    ]
    assert kinds == [
        (T, BufferKind.K, 0),
        (T, BufferKind.K, 1),
        (T, BufferKind.V, 0),
        (T, BufferKind.V, 1),
        (D, BufferKind.K, 0),
        (D, BufferKind.V, 0),
    ]


def test_layer_and_model_selection_for_per_layer_transfer() -> None:
    local = kv_layout(attention=AttentionKind.MLA, layers=4, draft_layers=2, item_bytes=10, items=8, base=0)
    runs = PageRuns(src_start=[0], dst_start=[0], length=[2])
    only_layer_2 = layer_blocks(runs, local, local, layers=[2], model=T)
    assert [local.buffers[int(b)].layer_id for b in only_layer_2.buffer] == [2]
    layer_1_both_models = layer_blocks(runs, local, local, layers=[1])
    assert [
        (local.buffers[int(b)].model, local.buffers[int(b)].layer_id) for b in layer_1_both_models.buffer
    ] == [
        (T, 1),
        (D, 1),
    ]
    assert len(layer_blocks(runs, local, local, model=D)) == 2


def test_page_past_a_peer_buffer_end_is_an_error() -> None:
    local = kv_layout(attention=AttentionKind.MLA, layers=2, draft_layers=0, item_bytes=10, items=50, base=0)
    peer = kv_layout(
        attention=AttentionKind.MLA, layers=2, draft_layers=0, item_bytes=10, items=8, base=10_000
    )
    with pytest.raises(MappingError, match=r"page 9 is past the end of 2 peer buffer\(s\).*holds 8 pages"):
        layer_blocks(PageRuns(src_start=[0], dst_start=[6], length=[4]), local, peer)


def test_layer_id_difference_is_named_with_both_lists() -> None:
    local = kv_layout(attention=AttentionKind.MLA, layers=3, draft_layers=0, item_bytes=10, items=8, base=0)
    peer = BufferLayout.build(
        attention=AttentionKind.MLA,
        page_size=16,
        buffers=[spec(BufferKind.KV, T, layer, 1000 * layer, 8, 10) for layer in (0, 1, 5)],
    )
    with pytest.raises(LayoutMismatchError) as info:
        layer_blocks(PageRuns(src_start=[0], dst_start=[0], length=[1]), local, peer)
    assert "missing here [target:5], missing at the peer [target:2]" in str(info.value)
    assert "here [target:0, target:1, target:2] vs peer [target:0, target:1, target:5]" in str(info.value)


def test_item_bytes_and_page_size_differences_are_mismatches() -> None:
    local = kv_layout(attention=AttentionKind.MLA, layers=1, draft_layers=0, item_bytes=10, items=8, base=0)
    wider = kv_layout(attention=AttentionKind.MLA, layers=1, draft_layers=0, item_bytes=12, items=8, base=0)
    other_pages = kv_layout(
        attention=AttentionKind.MLA, layers=1, draft_layers=0, item_bytes=10, items=8, base=0, page_size=32
    )
    mha = kv_layout(attention=AttentionKind.MHA, layers=1, draft_layers=0, item_bytes=10, items=8, base=0)
    runs = PageRuns(src_start=[0], dst_start=[0], length=[1])
    with pytest.raises(LayoutMismatchError, match="target kv layer 0: 10 vs 12 bytes per item"):
        layer_blocks(runs, local, wider)
    with pytest.raises(LayoutMismatchError, match="page sizes differ: 16 here vs 32"):
        layer_blocks(runs, local, other_pages)
    with pytest.raises(LayoutMismatchError, match="attention kinds differ"):
        layer_blocks(runs, local, mha)


def _state_layout(*, base: int) -> BufferLayout:
    """KV on 6 layers, NSA index K on the compact layers 1 and 4 only (slots 0 and 1), one aux buffer."""
    compact = StateLayerMap.from_layer_ids([4, 1], num_layers=6)
    specs = [spec(BufferKind.KV, T, layer, base + 1000 * layer, 10, 10) for layer in range(6)]
    specs += [
        spec(BufferKind.INDEX_K, T, int(compact.layer_of([slot])[0]), base + 50_000 + 1000 * slot, 10, 4)
        for slot in range(compact.num_slots)
    ]
    specs.append(spec(BufferKind.AUX, T, 0, base + 90_000, 4, 64))
    return BufferLayout.build(attention=AttentionKind.MLA, page_size=16, buffers=specs)


def test_state_blocks_follow_the_compact_state_layers() -> None:
    local = _state_layout(base=0)
    peer = _state_layout(base=1_000_000)
    blocks = state_blocks(BufferKind.INDEX_K, [2, 3, 7], [5, 6, 0], local, peer)
    # runs: (2->5, 2 slots), (7->0, 1 slot); buffers: index K of layer 1 (slot 0) then layer 4 (slot 1)
    assert blocks == TransferBlocks(
        src=[50_008, 50_028, 51_008, 51_028],
        dst=[1_050_020, 1_050_000, 1_051_020, 1_051_000],
        length=[8, 4, 8, 4],
        buffer=[6, 6, 7, 7],
    )
    assert len(state_blocks(BufferKind.INDEX_K, [2], [5], local, peer, layers=[2])) == 0
    only_4 = state_blocks(BufferKind.INDEX_K, [2], [5], local, peer, layers=[4])
    assert only_4.buffer.tolist() == [7]


def test_state_blocks_require_equal_lengths_and_a_state_kind() -> None:
    local = _state_layout(base=0)
    with pytest.raises(MappingError, match="2 source vs 1 destination"):
        state_blocks(BufferKind.INDEX_K, [1, 2], [1], local, local)
    with pytest.raises(MappingError, match="not a state buffer kind"):
        state_blocks(BufferKind.KV, [1], [1], local, local)
    with pytest.raises(MappingError, match="no buffer for them"):
        state_blocks(BufferKind.SWA, [1], [1], local, local)


def test_aux_pairs_by_key_not_by_position() -> None:
    local = BufferLayout.build(
        attention=AttentionKind.MLA,
        page_size=16,
        buffers=[spec(BufferKind.KV, T, 0, 0, 10, 10), spec(BufferKind.AUX, T, 0, 5000, 4, 64)],
    )
    # the peer keeps extra SWA state, so its aux buffer sits at index 2, not 1
    peer = BufferLayout.build(
        attention=AttentionKind.MLA,
        page_size=16,
        buffers=[
            spec(BufferKind.KV, T, 0, 100_000, 10, 10),
            spec(BufferKind.SWA, T, 0, 200_000, 10, 10),
            spec(BufferKind.AUX, T, 0, 300_000, 8, 64),
        ],
    )
    assert aux_blocks(3, 7, local, peer) == TransferBlocks(src=[5192], dst=[300_448], length=[64], buffer=[1])
    assert pair_buffers(local, peer, [BufferKind.AUX]).peer_buffer.tolist() == [2]
    with pytest.raises(MappingError, match="row 4 is past the end of 1 local buffer"):
        aux_blocks(4, 0, local, peer)
    assert aux_blocks(0, 7, local, peer).dst.tolist() == [300_448]  # the peer's last row
    with pytest.raises(
        MappingError, match=r"row 8 is past the end of 1 peer buffer.*runs: 1 covering 1 rows"
    ):
        aux_blocks(0, 8, local, peer)


def test_identity_cache_never_serves_a_previous_layout() -> None:
    runs = PageRuns(src_start=[1], dst_start=[1], length=[1])
    seen_ids: set[int] = set()
    reused = 0
    for base in range(0, 50_000, 1000):
        local = kv_layout(
            attention=AttentionKind.MLA, layers=1, draft_layers=0, item_bytes=10, items=8, base=base
        )
        peer = kv_layout(
            attention=AttentionKind.MLA, layers=1, draft_layers=0, item_bytes=10, items=8, base=base + 7
        )
        reused += id(local) in seen_ids
        seen_ids.add(id(local))
        blocks = layer_blocks(runs, local, peer)
        assert blocks.src.tolist() == [base + 10]
        assert blocks.dst.tolist() == [base + 17]
        del local, peer  # freed at once: the next layouts may reuse these addresses (and ids)
    assert reused  # the situation the weak references guard against did occur


def test_no_runs_give_no_blocks() -> None:
    local = kv_layout(attention=AttentionKind.MLA, layers=2, draft_layers=0, item_bytes=10, items=8, base=0)
    assert len(layer_blocks(PageRuns.empty(), local, local)) == 0
    assert np.array_equal(layer_blocks(PageRuns.empty(), local, local).src, np.zeros(0, dtype=np.int64))


def _mixed_layout(*, kv_items: int = 10, swa_items: int = 6) -> BufferLayout:
    return BufferLayout.build(
        attention=AttentionKind.MLA,
        page_size=16,
        buffers=[
            spec(BufferKind.AUX, T, 0, 900_000, 8, 64),
            spec(BufferKind.KV, D, 0, 500_000, 7, 10),
            spec(BufferKind.SWA, T, 2, 700_000, swa_items, 10),
            spec(BufferKind.KV, T, 1, 100_000, kv_items, 10),
            spec(BufferKind.INDEX_K, T, 1, 800_000, 4, 10),
            spec(BufferKind.KV, T, 0, 0, 12, 10),
        ],
    )


def test_layout_views_by_kind_and_capacities() -> None:
    """The per-kind views and capacities are derived once per layout: they must say what the
    buffers say, in canonical order, and follow a changed layout (``attrs.evolve``), never go stale."""
    layout = _mixed_layout()
    names = [(b.model, b.kind, b.layer_id) for b in layout.kv_buffers]
    assert names == [(T, BufferKind.KV, 0), (T, BufferKind.KV, 1), (D, BufferKind.KV, 0)]
    assert [(b.kind, b.layer_id) for b in layout.state_buffers] == [
        (BufferKind.INDEX_K, 1),
        (BufferKind.SWA, 2),
    ]
    assert [b.base_ptr for b in layout.aux_buffers] == [900_000]
    assert [b.layer_id for b in layout.select(BufferKind.SWA)] == [2]
    assert layout.select(BufferKind.V) == ()
    assert [b.model for b in layout.select(BufferKind.KV, model=D)] == [D]
    assert len(layout.select()) == 6
    assert layout.min_kv_items == 7  # the draft layer's 7 pages bound every KV buffer
    assert layout.min_items(BufferKind.KV) == 7
    assert layout.min_items(BufferKind.SWA) == 6
    assert layout.min_items(BufferKind.AUX) == 8
    assert layout.min_items(BufferKind.V) == 0  # no buffer of that kind: nothing addressable

    smaller = _mixed_layout(kv_items=3, swa_items=2)
    assert smaller == attrs.evolve(layout, buffers=smaller.buffers)
    evolved = attrs.evolve(layout, buffers=smaller.buffers)
    assert evolved.min_kv_items == 3 and evolved.min_items(BufferKind.SWA) == 2
    assert evolved.kv_buffers == smaller.kv_buffers and evolved.kv_buffers != layout.kv_buffers
    # derived views take no part in equality and hashing: equal buffers, equal layouts
    assert _mixed_layout() == layout and hash(_mixed_layout()) == hash(layout)
    assert BufferLayout.build(attention=AttentionKind.MLA, page_size=16, buffers=[]).min_kv_items == 0


def test_capacity_check_passes_the_last_item_and_refuses_one_past() -> None:
    """The check compares with each side's smallest buffer first; the refusal still names the
    shortest buffer, whichever side and whichever layer it is."""
    local = BufferLayout.build(
        attention=AttentionKind.MLA,
        page_size=16,
        buffers=[spec(BufferKind.KV, T, 0, 0, 9, 10), spec(BufferKind.KV, T, 1, 1000, 6, 10)],
    )
    peer = kv_layout(attention=AttentionKind.MLA, layers=2, draft_layers=0, item_bytes=10, items=8, base=9000)
    assert len(layer_blocks(PageRuns(src_start=[5], dst_start=[7], length=[1]), local, peer)) == 2
    with pytest.raises(
        MappingError, match=r"page 6 is past the end of 1 local buffer\(s\); first: buffer #1"
    ):
        layer_blocks(PageRuns(src_start=[5], dst_start=[0], length=[2]), local, peer)
    with pytest.raises(MappingError, match=r"page 8 is past the end of 2 peer buffer\(s\)"):
        layer_blocks(PageRuns(src_start=[0], dst_start=[8], length=[1]), local, peer)
    only_layer_0 = layer_blocks(PageRuns(src_start=[7], dst_start=[0], length=[1]), local, peer, layers=[0])
    assert only_layer_0.src.tolist() == [70]  # layer 1 (6 pages) is not selected: page 7 fits layer 0
