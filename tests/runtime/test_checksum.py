"""The checksum of ``pdkv.runtime.checksum`` against an independent reference, and what it detects.

The reference below is written from the module docstring's definition with plain Python integers
(exact arithmetic, explicit mod 2**32), reading items through numpy reshapes of the canonical rows:
the kernel (torch, tiled gathers, int32 block sums that wrap) must agree with it bit for bit.
"""

from __future__ import annotations

import math

import attrs
import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdkv.errors import ConfigError
from pdkv.mapping import AttentionKind, BufferKind, ItemLayout, ModelRole, PageInterleaved, head_range
from pdkv.protocol.ids import InstanceId
from pdkv.protocol.messages import RankCoord, StateIndices
from pdkv.runtime import checksum
from pdkv.runtime.checksum import (
    WHOLE,
    BufferViews,
    Checksummer,
    ChunkSources,
    Region,
    RoomPages,
    chunk_checksums,
    receiver_kv_pairs,
    sender_kv_pairs,
    verify_room,
)
from pdkv.testing.synthetic import Capacity, ModelSpec, RankMemory, pattern

U8 = npt.NDArray[np.uint8]


# ---------------------------------------------------------------- the reference


def reference_item(rows: U8, position: int) -> int:
    """The definition over one item's canonical rows (2-D uint8), exact integers."""
    row_bytes = rows.shape[1]
    padded = np.zeros((rows.shape[0], row_bytes + (-row_bytes) % 4), dtype=np.uint8)
    padded[:, :row_bytes] = rows
    words = padded.view("<u4")
    k = words.shape[1]
    block = math.gcd(k, 256)
    total, j = 0, 0
    for row in words:
        for start in range(0, k, block):
            b = sum(int(w) for w in row[start : start + block]) % 2**32
            m = ((2 * j + 1) * 2654435761) % 2**31
            total = (total + m * b) % 2**32
            j += 1
    return (total + ((position + 1) % 2**32) * 0x5BD1E995) % 2**32


def canonical_rows(item: U8, region: Region) -> U8:
    """The canonical rows of ``region`` of one item, by plain indexing (not the kernel's views)."""
    if not region.heads:
        return item.reshape(1, -1)
    t, h, hb = region.page_size, region.item_heads, region.head_bytes
    heads = range(region.offset, region.offset + region.count)
    if region.layout is ItemLayout.TOKEN_HEAD:
        cube = item.reshape(t, h, hb)
        return np.stack([np.concatenate([cube[tok, hd] for hd in heads]) for tok in range(t)])
    cube = item.reshape(h, t, hb)
    return np.stack([np.concatenate([cube[hd, tok] for hd in heads]) for tok in range(t)])


def reference(table: U8, items: list[int], positions: list[int], region: Region = WHOLE) -> list[int]:
    return [
        reference_item(canonical_rows(table[i], region), p) for i, p in zip(items, positions, strict=True)
    ]


def summer_of(memory: RankMemory) -> Checksummer:
    return Checksummer(BufferViews(memory.layout))


def index_of(memory: RankMemory, key: tuple[ModelRole, BufferKind, int]) -> int:
    model, kind, layer = key
    return next(
        i
        for i, b in enumerate(memory.layout.buffers)
        if (b.model, b.kind, b.layer_id) == (model, kind, layer)
    )


def one_buffer(item_bytes: int, items: int, rng: np.random.Generator) -> tuple[RankMemory, int, U8]:
    """A memory whose aux buffer (one whole-item buffer) holds random bytes; (memory, index, table)."""
    spec = ModelSpec(
        layers=1,
        page_size=4,
        kv_bytes_per_token=8,
        state_layers=(),
        draft_layers=0,
        aux_item_bytes=item_bytes,
    )
    memory = RankMemory(spec, Capacity(kv_pages=2, state_slots=1, aux_rows=items))
    key = (ModelRole.TARGET, BufferKind.AUX, 0)
    table = memory.view(key)
    table[:] = rng.integers(0, 256, size=table.shape, dtype=np.uint8)
    return memory, index_of(memory, key), table


# ---------------------------------------------------------------- the kernel is the definition


@pytest.mark.parametrize("item_bytes", [1, 3, 4, 6, 12, 36, 64, 1028, 4096, 8192 + 4])
def test_kernel_equals_the_reference_for_whole_items(item_bytes: int) -> None:
    rng = np.random.default_rng(item_bytes)
    memory, index, table = one_buffer(item_bytes, 9, rng)
    items = [4, 0, 8, 3]
    positions = [0, 7, 2**31 + 5, 12]
    got = summer_of(memory).sums(index, WHOLE, np.array(items), np.array(positions))
    assert got.dtype == np.uint32
    assert got.tolist() == reference(table, items, positions)


def test_sums_wrap_mod_2_to_the_32_as_the_reference_does() -> None:
    """All-0xFF words overflow every int32 block sum: the kernel's wrapping must be exact mod 2**32."""
    memory, index, table = one_buffer(4096, 3, np.random.default_rng(0))
    table[:] = 0xFF
    got = summer_of(memory).sums(index, WHOLE, np.array([0, 1, 2]), np.array([5, 5, 6]))
    assert got.tolist() == reference(table, [0, 1, 2], [5, 5, 6])
    assert got[0] == got[1] != got[2]  # same bytes, same position: equal; another position: not


def test_tiles_do_not_change_the_result(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(3)
    memory, index, table = one_buffer(256, 64, rng)
    items = rng.permutation(64)[:50]
    positions = np.arange(50) + 10
    whole = summer_of(memory).sums(index, WHOLE, items, positions)
    monkeypatch.setattr(checksum, "CPU_TILE_BYTES", 256 * 7)  # 7 items a tile: 8 tiles, the last short
    tiled = summer_of(memory).sums(index, WHOLE, items, positions)
    assert tiled.tolist() == whole.tolist() == reference(table, items.tolist(), positions.tolist())


@settings(max_examples=25, deadline=None)
@given(
    page_size=st.integers(1, 5),
    kv_heads=st.sampled_from([1, 2, 4, 8]),
    head_bytes=st.sampled_from([2, 4, 6, 8, 16]),
    layout=st.sampled_from(ItemLayout),
    data=st.data(),
)
def test_kernel_equals_the_reference_for_head_slices(
    page_size: int, kv_heads: int, head_bytes: int, layout: ItemLayout, data: st.DataObject
) -> None:
    model = ModelSpec(
        attention=AttentionKind.MHA,
        layers=1,
        page_size=page_size,
        kv_heads=kv_heads,
        kv_bytes_per_token=kv_heads * head_bytes,
        item_layout=layout,
        state_layers=(),
        draft_layers=0,
    )
    memory = RankMemory(model, Capacity(kv_pages=6, state_slots=1, aux_rows=1))
    key = (ModelRole.TARGET, BufferKind.K, 0)
    table = memory.view(key)
    table[:] = np.random.default_rng(data.draw(st.integers(0, 99))).integers(
        0, 256, table.shape, dtype=np.uint8
    )
    lo = data.draw(st.integers(0, kv_heads - 1))
    hi = data.draw(st.integers(lo + 1, kv_heads))
    region = Region.of_heads(memory.layout.buffers[index_of(memory, key)], page_size, lo, hi)
    items, positions = [5, 1, 2], [3, 0, 9]
    got = summer_of(memory).sums(index_of(memory, key), region, np.array(items), np.array(positions))
    assert got.tolist() == reference(table, items, positions, region)


# ---------------------------------------------------------------- what it detects


def test_every_single_bit_flip_is_detected() -> None:
    """A flip of any bit of an item changes its checksum: every bit of three items, exhaustively."""
    memory, index, table = one_buffer(72, 3, np.random.default_rng(7))
    summer = summer_of(memory)
    items, positions = np.array([0, 1, 2]), np.array([4, 5, 6])
    good = summer.sums(index, WHOLE, items, positions)
    for item in range(3):
        for byte in range(72):
            for bit in range(8):
                table[item, byte] ^= 1 << bit
                changed = summer.sums(index, WHOLE, items, positions)
                table[item, byte] ^= 1 << bit
                assert changed[item] != good[item], (item, byte, bit)
                assert np.array_equal(np.delete(changed, item), np.delete(good, item))


def test_zeroed_swapped_and_moved_bytes_are_detected() -> None:
    memory, index, table = one_buffer(4096, 4, np.random.default_rng(11))
    summer = summer_of(memory)
    items, positions = np.array([0, 1, 2, 3]), np.array([0, 1, 2, 3])
    good = summer.sums(index, WHOLE, items, positions)
    # Two pages swapped: each position now holds the other's bytes.
    assert (summer.sums(index, WHOLE, np.array([1, 0, 2, 3]), positions)[:2] != good[:2]).all()
    # The same item at another position checks differently (the position is in the checksum).
    assert summer.sums(index, WHOLE, np.array([0]), np.array([1]))[0] != good[0]
    # A zeroed page.
    saved = table[2].copy()
    table[2] = 0
    assert summer.sums(index, WHOLE, items, positions)[2] != good[2]
    # Two 1 KiB halves of a page swapped (a block moved inside an item): other weights.
    table[2] = saved
    table[3, :2048], table[3, 2048:] = table[3, 2048:].copy(), table[3, :2048].copy()
    assert summer.sums(index, WHOLE, items, positions)[3] != good[3]


# ---------------------------------------------------------------- both sides agree


def mha_memory(tp_size: int, tp_rank: int, layout: ItemLayout) -> RankMemory:
    model = ModelSpec(
        attention=AttentionKind.MHA,
        layers=2,
        page_size=4,
        kv_heads=4,
        kv_bytes_per_token=4 * 8,
        state_layers=(),
        draft_layers=1,
    )
    return RankMemory(
        model,
        Capacity(kv_pages=8, state_slots=2, aux_rows=2),
        tp_size=tp_size,
        tp_rank=tp_rank,
        item_layout=layout,
    )


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "prefill_layout", "decode_layout"),
    [
        (2, 1, ItemLayout.TOKEN_HEAD, ItemLayout.TOKEN_HEAD),
        (1, 2, ItemLayout.TOKEN_HEAD, ItemLayout.HEAD_TOKEN),
        (4, 2, ItemLayout.HEAD_TOKEN, ItemLayout.TOKEN_HEAD),
        (2, 2, ItemLayout.HEAD_TOKEN, ItemLayout.HEAD_TOKEN),
    ],
)
def test_prefill_and_decode_compute_the_same_checksums_across_tp_sizes_and_item_layouts(
    prefill_tp: int, decode_tp: int, prefill_layout: ItemLayout, decode_layout: ItemLayout
) -> None:
    """A prefill rank's checksums of the heads it sends equal the decode rank's of the heads it
    received, whatever the two TP sizes and item layouts (the content rule gives both sides' bytes)."""
    prefill = mha_memory(prefill_tp, 0, prefill_layout)
    decode = mha_memory(decode_tp, 0, decode_layout)
    logical = np.arange(8)
    prefill.fill_prefill(cp_rank=0, policy=PageInterleaved(cp_size=1))
    # The decode's pages hold what the whole model holds there (every prefill rank wrote its heads).
    for key in decode.spec.kv_keys():
        model, kind, layer = key
        decode.view(key)[:] = decode.kv_content(model, kind, layer, logical)
    src_pages, positions = np.array([3, 1, 6]), np.array([0, 1, 2])
    dst_pages = src_pages[::-1].copy()  # other pages on the decode side
    sent = chunk_checksums(
        summer_of(prefill),
        ChunkSources(kv_src=src_pages, kv_positions=positions),
        prefill.layout,
        decode.layout,
    )
    decode.clear_pages(np.arange(8))
    for key in decode.spec.kv_keys():
        model, kind, layer = key
        decode.view(key)[dst_pages] = decode.kv_content(model, kind, layer, src_pages)
    held = head_range(4, prefill_tp, 0)
    pairs = receiver_kv_pairs(decode.layout, (held.start, held.stop))
    got = summer_of(decode).many([(p.buffer, p.region) for p in pairs], dst_pages, positions)
    assert got.tolist() == sent.kv_matrix().tolist()
    assert len(sender_kv_pairs(prefill.layout, decode.layout)) == len(decode.layout.kv_buffers) == 6


def test_verify_room_names_the_buffer_position_and_rank() -> None:
    model = ModelSpec(layers=3, page_size=4, kv_bytes_per_token=16, draft_layers=1)
    prefill = RankMemory(model, Capacity(kv_pages=8, state_slots=4, aux_rows=2))
    decode = RankMemory(model, Capacity(kv_pages=16, state_slots=4, aux_rows=2))
    prefill.fill_prefill(cp_rank=0, policy=PageInterleaved(cp_size=1))
    src, dst = np.array([2, 5, 7, 0]), np.array([9, 3, 4, 11])
    slots_src, slots_dst = np.array([1, 3]), np.array([0, 2, 3])
    for key in model.kv_keys():
        decode.view(key)[dst[1:]] = prefill.view(key)[src[1:]]
    for key in model.state_keys():
        decode.view(key)[slots_dst[:2]] = prefill.view(key)[slots_src]
    aux = (ModelRole.TARGET, BufferKind.AUX, 0)
    decode.view(aux)[1] = prefill.view(aux)[0]
    sources = ChunkSources(
        kv_src=src[1:],
        kv_positions=np.array([1, 2, 3]),
        state=tuple((kind, slots_src) for kind in model.state_kinds),
        aux_src=0,
    )
    report = chunk_checksums(summer_of(prefill), sources, prefill.layout, decode.layout)
    room = RoomPages(
        dst_pages=dst,
        prefix_pages=1,
        dst_state=tuple(StateIndices(kind=k, indices=slots_dst) for k in model.state_kinds),
        dst_aux_row=1,
    )
    rank = (InstanceId("prefill-0"), RankCoord(tp=0))
    summer = summer_of(decode)
    assert verify_room(summer, room, {rank: report}, prefill_heads=lambda _: None) is None
    # Target kv layer 2's page at position 2 (decode page 4): one byte flipped.
    decode.view((ModelRole.TARGET, BufferKind.KV, 2))[4, 5] ^= 0x10
    found = verify_room(summer, room, {rank: report}, prefill_heads=lambda _: None)
    assert found is not None
    assert (found.buffer, found.layer, found.position, found.dst_index, found.prefill, found.entries) == (
        "target kv layer 2",
        2,
        2,
        4,
        "prefill-0:tp0/cp0",
        1,
    )
    decode.view((ModelRole.TARGET, BufferKind.KV, 2))[4, 5] ^= 0x10
    # A state slot (index_scale of layer 2, slot 1 of the room = decode slot 2) zeroed.
    decode.view((ModelRole.TARGET, BufferKind.INDEX_SCALE, 2))[2] = 0
    found = verify_room(summer, room, {rank: report}, prefill_heads=lambda _: None)
    assert found is not None and (found.buffer, found.position, found.dst_index) == (
        "target index_scale layer 2",
        1,
        2,
    )
    decode.view((ModelRole.TARGET, BufferKind.INDEX_SCALE, 2))[2] = prefill.view(
        (ModelRole.TARGET, BufferKind.INDEX_SCALE, 2)
    )[3]
    assert verify_room(summer, room, {rank: report}, prefill_heads=lambda _: None) is None
    # A rank that sent no checksums, and a room position nobody covered.
    none = verify_room(summer, room, {rank: None}, prefill_heads=lambda _: None)
    assert none is not None and "sent no checksums" in none.detail
    wider = attrs.evolve(room, prefix_pages=0)
    uncovered = verify_room(summer, wider, {rank: report}, prefill_heads=lambda _: None)
    assert uncovered is not None and (uncovered.position, uncovered.prefill) == (0, None)


def test_views_wrap_the_registered_bytes_and_reject_other_devices() -> None:
    memory = RankMemory(ModelSpec(), Capacity(kv_pages=4, state_slots=2, aux_rows=2))
    views = BufferViews(memory.layout)
    key = (ModelRole.TARGET, BufferKind.KV, 1)
    index = index_of(memory, key)
    memory.view(key)[2] = pattern(3, np.array([2]), memory.kv_item_bytes)[0]
    assert torch.equal(views[index][2], memory.tensors[key][2])
    assert views[index].data_ptr() == memory.tensors[key].data_ptr()
    with pytest.raises(ConfigError, match="only cpu and cuda"):
        BufferViews(memory.layout, "meta")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA"):
            BufferViews(memory.layout, "cuda:0")
