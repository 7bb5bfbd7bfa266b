"""MHA/GQA across unequal TP: head ranges, fan-out with GQA replicas, and byte-exact strided blocks.

Expected values never come from the code under test. The reference keeps the model's full KV as
numpy bytes ``[token, head, head_bytes]`` per buffer, gives rank ``r`` of TP ``T`` its heads by the
convention written as ``np.repeat(arange(H), max(1, T // H)).reshape(T, -1)[r]``, lays a page item
out by transposing (token-major or head-major), fills every prefill rank (CP shared KV included)
from it, applies the mapped blocks as plain memcpy between byte arrays, and counts the writes of
every decode byte: each byte of every sent position must be written exactly once, with the bytes
of the right head and token, and nothing else may be touched.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import attrs
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdkv.errors import LayoutMismatchError, MappingError
from pdkv.mapping import (
    AttentionKind,
    BufferKind,
    BufferLayout,
    BufferSpec,
    HeadGeometry,
    ItemLayout,
    ModelRole,
    PageInterleaved,
    PageRuns,
    Topology,
    TopologyError,
    TransferBlocks,
    coalesce,
    decode_fanout,
    head_blocks,
    head_plan,
    head_range,
    kv_blocks,
    layer_blocks,
    layout_kv_heads,
    map_chunk,
    prefill_fanout,
    rank_heads,
    required_dst_info_num,
)

U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]

HEAD_COUNTS = (1, 2, 4, 8, 16)
TP_SIZES = (1, 2, 4, 8)
BASE = 4096  # first buffer address of every rank (0 stays unused)
GAP = 48  # unused bytes after every buffer: a write past a buffer's end lands here and is counted


def splits(kv_heads: int, tp: int) -> bool:
    return kv_heads % tp == 0 or tp % kv_heads == 0


VALID = [
    (h, p, d)
    for h, p, d in itertools.product(HEAD_COUNTS, TP_SIZES, TP_SIZES)
    if splits(h, p) and splits(h, d) and (p % d == 0 or d % p == 0)
]


def reference_heads(kv_heads: int, tp: int) -> npt.NDArray[np.int64]:
    """Row r: the model heads TP rank r holds (one replicated head per rank when kv_heads < tp)."""
    return np.repeat(np.arange(kv_heads, dtype=np.int64), max(1, tp // kv_heads)).reshape(tp, -1)


def mha(prefill_tp: int, decode_tp: int, kv_heads: int, prefill_cp: int = 1) -> Topology:
    return Topology(
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        prefill_cp=prefill_cp,
        attention=AttentionKind.MHA,
        kv_heads=kv_heads,
    )


# ---------------------------------------------------------------- head ranges and fan-out


@pytest.mark.parametrize(("kv_heads", "tp"), [(h, t) for h in HEAD_COUNTS for t in TP_SIZES if splits(h, t)])
def test_head_range_follows_the_convention(kv_heads: int, tp: int) -> None:
    table = reference_heads(kv_heads, tp)
    for rank in range(tp):
        held = head_range(kv_heads, tp, rank)
        assert list(range(held.start, held.stop)) == table[rank].tolist()


@pytest.mark.parametrize(("kv_heads", "prefill_tp", "decode_tp"), VALID)
def test_fanout_sends_every_decode_head_once_from_a_holder(
    kv_heads: int, prefill_tp: int, decode_tp: int
) -> None:
    topology = mha(prefill_tp, decode_tp, kv_heads, prefill_cp=2)
    p_heads, d_heads = reference_heads(kv_heads, prefill_tp), reference_heads(kv_heads, decode_tp)
    heard: dict[int, list[int]] = {p: [] for p in range(prefill_tp)}
    for d in range(decode_tp):
        fan = decode_fanout(topology, d)
        tps = sorted({t.tp for t in fan.targets})
        real = sorted({t.tp for t in fan.targets if not t.dummy})
        for p in tps:
            heard[p].append(d)
            assert {t.cp for t in fan.targets if t.tp == p} == {0, 1}
        sent = np.concatenate([np.intersect1d(p_heads[p], d_heads[d]) for p in real])
        assert sorted(sent.tolist()) == sorted(set(d_heads[d].tolist()))  # every head of d, once
        for p in set(tps) - set(real):  # a dummy only holds heads a real target already sends
            assert set(p_heads[p].tolist()) <= set(sent.tolist())
        assert fan.required_statuses == 2 * len(real)  # one status per CP rank of each real source
    for p in range(prefill_tp):
        served = prefill_fanout(topology, p)
        assert list(served.decode_ranks) == heard[p]
        assert required_dst_info_num(topology, p) == len(heard[p])
        dummy_for = {t.dummy for d in heard[p] for t in decode_fanout(topology, d).targets if t.tp == p}
        assert dummy_for == {served.dummy}  # a prefill rank is a dummy for all its peers or for none


def test_replicated_heads_are_sent_by_one_rank() -> None:
    # 2 KV heads over prefill TP 4: ranks 0, 1 hold head 0 and ranks 2, 3 head 1.
    to_two = mha(4, 2, 2)
    assert [prefill_fanout(to_two, p).dummy for p in range(4)] == [False, True, False, True]
    assert decode_fanout(to_two, 1).required_statuses == 1
    # 8 KV heads over prefill TP 4 to decode TP 2: both sources of a decode rank are real.
    assert [prefill_fanout(mha(4, 2, 8), p).dummy for p in range(4)] == [False] * 4
    assert decode_fanout(mha(4, 2, 8), 0).required_statuses == 2
    # one KV head (MQA) from TP 8 to TP 2: one real rank in each group of four.
    assert [prefill_fanout(mha(8, 2, 1), p).dummy for p in range(8)] == [False, True, True, True] * 2


@pytest.mark.parametrize(("kv_heads", "prefill_tp", "decode_tp"), VALID)
def test_head_plan_matches_fanout_and_the_reference_ranges(
    kv_heads: int, prefill_tp: int, decode_tp: int
) -> None:
    topology = mha(prefill_tp, decode_tp, kv_heads)
    plan = head_plan(topology)
    p_heads, d_heads = reference_heads(kv_heads, prefill_tp), reference_heads(kv_heads, decode_tp)
    expected_pairs = [
        (t.tp, d, t.dummy) for d in range(decode_tp) for t in decode_fanout(topology, d).targets
    ]
    got_pairs = list(
        zip(plan.prefill_tp_rank.tolist(), plan.decode_tp_rank.tolist(), plan.dummy.tolist(), strict=True)
    )
    assert got_pairs == expected_pairs
    for i in range(len(plan)):
        p, d = int(plan.prefill_tp_rank[i]), int(plan.decode_tp_rank[i])
        if plan.dummy[i]:
            assert int(plan.num_heads[i]) == 0
            continue
        shared = np.intersect1d(p_heads[p], d_heads[d])
        n, start = int(plan.num_heads[i]), int(plan.head_start[i])
        assert list(range(start, start + n)) == shared.tolist()
        assert p_heads[p][int(plan.src_head[i])] == start
        assert d_heads[d][int(plan.dst_head[i])] == start


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prefill_tp": 2, "decode_tp": 4, "attention": AttentionKind.MHA}, "needs kv_heads"),
        (
            {"prefill_tp": 2, "decode_tp": 4, "attention": AttentionKind.MHA, "kv_heads": 6},
            "6 KV heads cannot be split over decode tp 4",
        ),
        (
            {"prefill_tp": 3, "decode_tp": 3, "attention": AttentionKind.MHA, "kv_heads": 2},
            "2 KV heads cannot be split over prefill tp 3",
        ),
        ({"prefill_tp": 2, "decode_tp": 1, "kv_heads": 8}, "given for MLA"),
        (
            {"prefill_tp": 2, "decode_tp": 1, "attention": AttentionKind.MHA, "kv_heads": 0},
            "kv_heads must be",
        ),
    ],
)
def test_impossible_head_splits_are_topology_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(TopologyError, match=message):
        Topology(**kwargs)  # type: ignore[arg-type]  # mixed-type kwargs on purpose


def test_head_helpers_refuse_bad_input() -> None:
    with pytest.raises(TopologyError, match="3 KV heads cannot be split over tp 2"):
        head_range(3, 2, 0)
    with pytest.raises(TopologyError, match="tp_rank 4 is outside tp_size 4"):
        head_range(8, 4, 4)
    with pytest.raises(TopologyError, match="needs an MHA topology with kv_heads"):
        head_plan(Topology(prefill_tp=2, decode_tp=1))
    assert rank_heads(kv_heads=2, tp_size=4, tp_rank=3, head_bytes=128) == HeadGeometry(
        kv_heads=2, head_start=1, head_count=1, head_bytes=128
    )


# ---------------------------------------------------------------- a tiny reference world


@attrs.frozen(kw_only=True)
class World:
    """A model's full KV for one request, and the shape every rank shares."""

    kv_heads: int
    head_bytes: int
    page_size: int
    layers: int
    full: dict[tuple[BufferKind, int], U8]  # (kind, layer) -> [token, head, head_bytes]

    @property
    def keys(self) -> list[tuple[BufferKind, int]]:
        return [(kind, layer) for kind in (BufferKind.K, BufferKind.V) for layer in range(self.layers)]


def make_world(
    seed: int, *, kv_heads: int, head_bytes: int, page_size: int, layers: int, positions: int
) -> World:
    rng = np.random.default_rng(seed)
    full = {
        (kind, layer): rng.integers(
            1, 256, size=(positions * page_size, kv_heads, head_bytes), dtype=np.uint8
        )
        for kind in (BufferKind.K, BufferKind.V)
        for layer in range(layers)
    }
    return World(kv_heads=kv_heads, head_bytes=head_bytes, page_size=page_size, layers=layers, full=full)


def encode(tokens_heads: U8, item_layout: ItemLayout) -> U8:
    """One page item's bytes from its ``[token, head, head_bytes]`` content."""
    ordered = tokens_heads if item_layout is ItemLayout.TOKEN_HEAD else tokens_heads.transpose(1, 0, 2)
    return np.ascontiguousarray(ordered).reshape(-1)


class Rank:
    """One rank's K/V buffers in a flat byte array addressed from 0 (buffers start at BASE)."""

    def __init__(self, world: World, tp: int, tp_rank: int, pages: int, item_layout: ItemLayout) -> None:
        self.world, self.item_layout = world, item_layout
        self.heads = reference_heads(world.kv_heads, tp)[tp_rank]
        self.item_bytes = world.page_size * self.heads.size * world.head_bytes
        self.base = {key: BASE + i * (pages * self.item_bytes + GAP) for i, key in enumerate(world.keys)}
        size = BASE + len(world.keys) * (pages * self.item_bytes + GAP)
        self.memory = np.zeros(size, dtype=np.uint8)
        self.writes = np.zeros(size, dtype=np.int32)
        geometry = HeadGeometry(
            kv_heads=world.kv_heads,
            head_start=int(self.heads[0]),
            head_count=int(self.heads.size),
            head_bytes=world.head_bytes,
            item_layout=item_layout,
        )
        self.layout = BufferLayout.build(
            attention=AttentionKind.MHA,
            page_size=world.page_size,
            buffers=[
                BufferSpec(
                    kind=kind,
                    model=ModelRole.TARGET,
                    layer_id=layer,
                    base_ptr=self.base[(kind, layer)],
                    length=pages * self.item_bytes,
                    item_bytes=self.item_bytes,
                    heads=geometry,
                )
                for kind, layer in world.keys
            ],
        )

    def item(self, key: tuple[BufferKind, int], position: int) -> U8:
        """What a page item at request position ``position`` must hold on this rank."""
        size = self.world.page_size
        content = self.world.full[key][position * size : (position + 1) * size][:, self.heads, :]
        return encode(content, self.item_layout)

    def put(self, key: tuple[BufferKind, int], page: int, data: U8) -> None:
        start = self.base[key] + page * self.item_bytes
        self.memory[start : start + self.item_bytes] = data

    def buffer_bounds(self, index: int) -> tuple[int, int]:
        spec = self.layout.buffers[index]
        return spec.base_ptr, spec.base_ptr + spec.length


def apply(blocks: TransferBlocks, src: Rank, dst: Rank) -> None:
    """memcpy every block, checking it stays inside the buffer it names (on both sides)."""
    for s, d, n, b in zip(
        blocks.src.tolist(), blocks.dst.tolist(), blocks.length.tolist(), blocks.buffer.tolist(), strict=True
    ):
        lo, hi = src.buffer_bounds(b)
        assert lo <= s and s + n <= hi, "a block leaves its local buffer"
        spec = src.layout.buffers[b]
        peer = next(x for x in dst.layout.buffers if (x.kind, x.layer_id) == (spec.kind, spec.layer_id))
        assert peer.base_ptr <= d and d + n <= peer.base_ptr + peer.length, "a block leaves the peer buffer"
        dst.memory[d : d + n] = src.memory[s : s + n]
        dst.writes[d : d + n] += 1


def chunk_bounds(first: int, total: int, cuts: list[int]) -> Iterator[tuple[int, int]]:
    edges = sorted({first, total, *[c for c in cuts if first < c < total]})
    return itertools.pairwise(edges)


@attrs.frozen(kw_only=True)
class Scenario:
    kv_heads: int
    prefill_tp: int
    decode_tp: int
    prefill_cp: int
    page_size: int
    head_bytes: int
    layers: int
    positions: int
    prefix: int  # cached prefix pages: the first chunk starts at prefix x page_size
    cuts: list[int]  # chunk boundaries (positions) after the prefix
    src_layout: ItemLayout
    dst_layout: ItemLayout
    seed: int


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    kv_heads, prefill_tp, decode_tp = draw(st.sampled_from(VALID))
    positions = draw(st.integers(1, 9))
    return Scenario(
        kv_heads=kv_heads,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        prefill_cp=draw(st.integers(1, 3)),
        page_size=draw(st.integers(1, 4)),
        head_bytes=draw(st.integers(1, 3)),
        layers=draw(st.integers(1, 2)),
        positions=positions,
        prefix=draw(st.integers(0, positions - 1)),
        cuts=draw(st.lists(st.integers(1, positions - 1), max_size=3)) if positions > 1 else [],
        src_layout=draw(st.sampled_from(ItemLayout)),
        dst_layout=draw(st.sampled_from(ItemLayout)),
        seed=draw(st.integers(0, 2**31)),
    )


@settings(max_examples=120)
@given(scenarios())
def test_every_decode_head_byte_is_written_once_from_the_right_head(case: Scenario) -> None:
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
    logical = rng.permutation(3 * n)[:n]  # the scheduler's page per position, the same on every CP rank
    policy = PageInterleaved(cp_size=cp)
    prefill = {
        (p, c): Rank(world, case.prefill_tp, p, pages=3 * n // cp + 1, item_layout=case.src_layout)
        for p in range(case.prefill_tp)
        for c in range(cp)
    }
    for (_, c), rank in prefill.items():
        for q in range(n):
            if logical[q] % cp == c:  # CP shared KV: the owner stores the page at logical // cp
                for key in world.keys:
                    rank.put(key, int(logical[q]) // cp, rank.item(key, q))
    decode = {
        d: Rank(world, case.decode_tp, d, pages=2 * n, item_layout=case.dst_layout)
        for d in range(case.decode_tp)
    }
    dst_pages = {d: rng.permutation(2 * n)[:n] for d in range(case.decode_tp)}

    topology = mha(case.prefill_tp, case.decode_tp, case.kv_heads, prefill_cp=cp)
    for start, end in chunk_bounds(prefix, n, case.cuts):
        for d in range(case.decode_tp):
            for target in decode_fanout(topology, d).targets:
                if target.dummy:
                    continue  # a dummy gets no destination and sends nothing
                mapped = map_chunk(
                    logical[start:end],
                    start_token=start * world.page_size,
                    page_size=world.page_size,
                    dst_pages=dst_pages[d],
                    cp_rank=target.cp,
                    policy=policy,
                )
                source = prefill[(target.tp, target.cp)]
                apply(
                    kv_blocks(coalesce(mapped.src, mapped.dst), source.layout, decode[d].layout),
                    source,
                    decode[d],
                )

    for d, rank in decode.items():
        expected = np.zeros_like(rank.memory)
        expected_writes = np.zeros_like(rank.writes)
        for q in range(prefix, n):  # the cached prefix is already on the decode side: never written
            for key in world.keys:
                start = rank.base[key] + int(dst_pages[d][q]) * rank.item_bytes
                expected[start : start + rank.item_bytes] = rank.item(key, q)
                expected_writes[start : start + rank.item_bytes] = 1
        assert np.array_equal(rank.writes, expected_writes), (
            f"decode rank {d}: bytes not written exactly once"
        )
        assert np.array_equal(rank.memory, expected), f"decode rank {d}: wrong bytes"


# ---------------------------------------------------------------- block shapes and coalescing


def _world(kv_heads: int = 8, page_size: int = 4, head_bytes: int = 2, layers: int = 2) -> World:
    return make_world(
        0, kv_heads=kv_heads, head_bytes=head_bytes, page_size=page_size, layers=layers, positions=1
    )


def _strip_heads(layout: BufferLayout) -> BufferLayout:
    return BufferLayout.build(
        attention=layout.attention,
        page_size=layout.page_size,
        buffers=[attrs.evolve(b, heads=None) for b in layout.buffers],
    )


@given(
    st.lists(st.integers(0, 15), min_size=1, max_size=12, unique=True),
    st.lists(st.integers(0, 15), min_size=12, max_size=12, unique=True),
    st.sampled_from(ItemLayout),
)
def test_equal_head_ranges_give_exactly_the_whole_page_blocks(
    src: list[int], dst: list[int], item: ItemLayout
) -> None:
    world = _world()
    here, there = Rank(world, 2, 1, 16, item), Rank(world, 2, 1, 16, item)
    runs = coalesce(src, dst[: len(src)])
    got = head_blocks(runs, here.layout, there.layout)
    assert got == layer_blocks(runs, _strip_heads(here.layout), _strip_heads(there.layout))
    assert len(got) == len(runs) * 2 * world.layers  # whole pages: one block per run and buffer


def test_sliced_pages_become_one_block_per_token_or_per_page() -> None:
    world = _world()  # 8 heads, pages of 4 tokens, 2 bytes per head, 2 layers: 4 buffers
    runs = PageRuns(src_start=[0], dst_start=[5], length=[3])
    token_major = head_blocks(
        runs,
        Rank(world, 2, 0, 8, ItemLayout.TOKEN_HEAD).layout,
        Rank(world, 4, 1, 8, ItemLayout.TOKEN_HEAD).layout,
    )
    assert len(token_major) == 4 * 3 * 4  # buffers x pages x tokens: the slice is strided in the source
    assert set(token_major.length.tolist()) == {2 * 2}  # two heads of 2 bytes
    # Prefill rank 0 holds heads 0..3 (8 bytes per token), decode rank 1 heads 2..3 (4 bytes per token,
    # 16 per page): heads 2..3 of token t sit at 8t + 4 here and at 4t of page 5 there.
    first = token_major.take(slice(0, 4))
    assert first.src.tolist() == [BASE + 4, BASE + 12, BASE + 20, BASE + 28]
    assert first.dst.tolist() == [BASE + 5 * 16, BASE + 5 * 16 + 4, BASE + 5 * 16 + 8, BASE + 5 * 16 + 12]
    head_major = head_blocks(
        runs,
        Rank(world, 2, 0, 8, ItemLayout.HEAD_TOKEN).layout,
        Rank(world, 4, 1, 8, ItemLayout.HEAD_TOKEN).layout,
    )
    assert len(head_major) == 4 * 3  # heads 2..3 are one stretch of a head-major item
    assert head_major.take(slice(0, 1)).src.tolist() == [BASE + 2 * 4 * 2]
    assert set(head_major.length.tolist()) == {2 * 4 * 2}


def test_blocks_are_buffer_major_and_select_layers() -> None:
    world = _world()
    here, there = Rank(world, 4, 3, 8, ItemLayout.TOKEN_HEAD), Rank(world, 2, 1, 8, ItemLayout.TOKEN_HEAD)
    runs = PageRuns(src_start=[2], dst_start=[0], length=[2])
    everything = head_blocks(runs, here.layout, there.layout)
    assert everything.buffer.tolist() == np.repeat(np.arange(4), 2 * 4).tolist()
    layer_one = head_blocks(runs, here.layout, there.layout, layers=[1])
    keep = np.isin(everything.buffer, [i for i, b in enumerate(here.layout.buffers) if b.layer_id == 1])
    assert layer_one == everything.take(np.flatnonzero(keep))


def test_a_draft_with_another_kv_head_count_is_refused() -> None:
    # Target 8 KV heads, draft 1 over TP 4 -> 2: prefill ranks 0 and 1 are both real for the target
    # (heads 0..1 and 2..3) but both hold the draft's one head: it would land twice.
    page_size, head_bytes = 2, 4

    def layout(tp: int, rank: int, base: int) -> BufferLayout:
        buffers = []
        for i, model in enumerate(ModelRole):
            kv_heads = 8 if model is ModelRole.TARGET else 1
            geometry = rank_heads(kv_heads=kv_heads, tp_size=tp, tp_rank=rank, head_bytes=head_bytes)
            item = geometry.item_bytes(page_size)
            buffers += [
                BufferSpec(
                    kind=kind,
                    model=model,
                    layer_id=0,
                    base_ptr=base + 10_000 * (2 * i + j),
                    length=8 * item,
                    item_bytes=item,
                    heads=geometry,
                )
                for j, kind in enumerate((BufferKind.K, BufferKind.V))
            ]
        return BufferLayout.build(attention=AttentionKind.MHA, page_size=page_size, buffers=buffers)

    runs = PageRuns(src_start=[1], dst_start=[3], length=[2])
    with pytest.raises(
        LayoutMismatchError, match=r"different KV head counts \[\('draft', 1\), \('target', 8\)\]"
    ):
        head_blocks(runs, layout(4, 1, 0), layout(2, 0, 100_000))
    assert layout_kv_heads(layout(4, 1, 0)) == 8


def test_kv_blocks_uses_layer_blocks_when_no_heads_are_described() -> None:
    world = _world()
    here = _strip_heads(Rank(world, 2, 0, 8, ItemLayout.TOKEN_HEAD).layout)
    runs = PageRuns(src_start=[0], dst_start=[1], length=[3])
    assert kv_blocks(runs, here, here) == layer_blocks(runs, here, here)


# ---------------------------------------------------------------- layouts: registration and errors


def test_layouts_of_different_tp_sizes_are_compatible_when_they_describe_heads() -> None:
    world = _world()
    two, four = (
        Rank(world, 2, 0, 8, ItemLayout.TOKEN_HEAD).layout,
        Rank(world, 4, 3, 8, ItemLayout.HEAD_TOKEN).layout,
    )
    assert two.difference(four) is None
    assert "bytes per item differ" in str(_strip_heads(two).difference(_strip_heads(four)))
    assert "head geometry described on all buffers here vs no at the peer" in str(
        two.difference(_strip_heads(four))
    )
    other = Rank(_world(kv_heads=4), 2, 0, 8, ItemLayout.TOKEN_HEAD).layout
    assert "(KV heads, bytes per head) differ: [(8, 2)] vs [(4, 2)]" in str(two.difference(other))
    assert two.digest() != _strip_heads(two).digest()
    # Every rank of an instance announces one digest, whatever heads it holds; so does the peer.
    assert two.digest() == four.digest() == Rank(world, 2, 1, 8, ItemLayout.TOKEN_HEAD).layout.digest()
    assert two.digest() != other.digest()


def test_head_blocks_refuse_what_cannot_be_sliced() -> None:
    world = _world()
    runs = PageRuns(src_start=[0], dst_start=[0], length=[1])
    rank0, rank3 = Rank(world, 4, 0, 8, ItemLayout.TOKEN_HEAD), Rank(world, 4, 3, 8, ItemLayout.TOKEN_HEAD)
    with pytest.raises(
        LayoutMismatchError, match=r"holds heads 0\.\.1, the peer heads 6\.\.7: no head to send"
    ):
        head_blocks(runs, rank0.layout, rank3.layout)
    with pytest.raises(LayoutMismatchError, match="head geometry described on all buffers here vs no"):
        head_blocks(runs, rank0.layout, _strip_heads(rank3.layout))
    with pytest.raises(MappingError, match="page 8 is past the end"):
        head_blocks(PageRuns(src_start=[7], dst_start=[0], length=[2]), rank0.layout, rank0.layout)


def test_layout_validates_head_geometry() -> None:
    geometry = HeadGeometry(kv_heads=8, head_start=4, head_count=4, head_bytes=2)
    spec = BufferSpec(
        kind=BufferKind.K,
        model=ModelRole.TARGET,
        layer_id=0,
        base_ptr=0,
        length=64,
        item_bytes=32,
        heads=geometry,
    )
    assert BufferLayout.build(attention=AttentionKind.MHA, page_size=4, buffers=[spec]).buffers == (spec,)
    with pytest.raises(ValueError, match=r"item_bytes 32 != page_size 2 x 4 heads x 2 bytes per head"):
        BufferLayout.build(attention=AttentionKind.MHA, page_size=2, buffers=[spec])
    with pytest.raises(ValueError, match="only MHA layouts describe heads"):
        BufferLayout.build(attention=AttentionKind.MLA, page_size=4, buffers=[spec])
    with pytest.raises(ValueError, match="only K and V buffers describe heads"):
        attrs.evolve(spec, kind=BufferKind.KV)
    with pytest.raises(ValueError, match=r"heads 6\.\.9 are outside the model's 8 KV heads"):
        HeadGeometry(kv_heads=8, head_start=6, head_count=4, head_bytes=2)
