"""plan_chunk end to end in one process: every CP rank's blocks, applied as memcpy into decode
memory, reproduce the prefill full layout (chunked, cached prefix, state on some layers, draft, aux);
MHA/GQA across unequal TP sizes in both directions, with exactly one extras writer per decode rank."""

from __future__ import annotations

import ctypes
import itertools

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdkv.errors import LayoutMismatchError, MappingError
from pdkv.mapping import (
    AttentionKind,
    BufferKind,
    ItemLayout,
    ModelRole,
    PageInterleaved,
    Topology,
    TransferBlocks,
    decode_fanout,
)
from pdkv.protocol.effects import ChunkSpec, DecodePeer, Destination, SubmitChunk
from pdkv.protocol.ids import Endpoint, Epoch, InstanceId, RoomId, SessionId
from pdkv.protocol.messages import Origin, RankCoord, StateIndices, TransferRequest
from pdkv.runtime.chunk_plan import plan_chunk, writes_extras_to
from pdkv.testing.synthetic import Capacity, ModelSpec, RankMemory, verify_room

DECODE = Origin(instance=InstanceId("d"), epoch=Epoch(1), rank=RankCoord(tp=0))


def apply(blocks: TransferBlocks) -> None:
    for src, dst, n in zip(blocks.src.tolist(), blocks.dst.tolist(), blocks.length.tolist(), strict=True):
        ctypes.memmove(dst, src, n)


def run_request(
    spec: ModelSpec,
    *,
    cp: int,
    tokens: int,
    prefix_tokens: int,
    chunk_tokens: list[int],
    seed: int,
    ignore_offset: bool = False,
    decode_spec: ModelSpec | None = None,
    planned_bytes: list[int] | None = None,
) -> tuple[int, list[str]]:
    """Plan and apply every chunk of one request on every CP rank; ``decode_spec``: the decode's
    model when it differs (draft buffers only one side has are checked untouched where the decode
    has them); ``planned_bytes`` collects the bytes of each plan."""
    policy = PageInterleaved(cp_size=cp)
    page = spec.page_size
    prefill = [RankMemory(spec, Capacity(kv_pages=64, state_slots=8, aux_rows=4)) for _ in range(cp)]
    for rank, memory in enumerate(prefill):
        memory.fill_prefill(cp_rank=rank, policy=policy)
    decode = RankMemory(decode_spec or spec, Capacity(kv_pages=256, state_slots=8, aux_rows=4))
    rng = np.random.default_rng(seed)
    num_pages = -(-tokens // page)
    logical = rng.choice(64 * cp, size=num_pages, replace=False).astype(np.int64)
    dst = rng.choice(256, size=num_pages, replace=False).astype(np.int64)
    src_slots, dst_slots = np.array([1, 5]), np.array([7, 2])
    request = TransferRequest(
        origin=DECODE,
        room=RoomId(9),
        dst_pages=dst,
        dst_aux_row=3,
        dst_state=[StateIndices(kind=k, indices=dst_slots) for k in spec.state_kinds],
    )
    peer = DecodePeer(
        instance=DECODE.instance,
        epoch=DECODE.epoch,
        rank=DECODE.rank,
        tp_size=1,
        endpoint=Endpoint("e"),
        session=SessionId("s"),
        layout=decode.layout,
    )
    token = prefix_tokens
    for n, size in enumerate(chunk_tokens):
        last = n == len(chunk_tokens) - 1
        first_page = token // page
        end_page = num_pages if last else (token + size) // page
        spec_chunk = ChunkSpec(
            pages=logical[first_page:end_page],
            start_token=0 if ignore_offset else token,
            last=last,
            state=[StateIndices(kind=k, indices=src_slots) for k in spec.state_kinds] if last else (),
        )
        for rank in range(cp):
            submit = SubmitChunk(
                room=RoomId(9),
                chunk=n,
                spec=spec_chunk,
                num_pages=num_pages,
                src_aux_row=2,
                destinations=(Destination(peer=peer, request=request),),
            )
            plan = plan_chunk(
                submit.room,
                submit.spec,
                submit.destinations[0],
                src_aux_row=submit.src_aux_row,
                src_layout=prefill[rank].layout,
                cp_rank=rank,
                policy=policy,
                writes_extras=rank == 0,
            )
            apply(plan.blocks)
            if planned_bytes is not None:
                planned_bytes.append(plan.blocks.total_bytes)
        token += size
    prefill_keys = set(spec.kv_keys() + spec.state_keys())
    unsent = [k for k in decode.tensors if k[0] is ModelRole.DRAFT and k not in prefill_keys]
    checked, mismatches = verify_room(
        decode,
        logical_ids=logical,
        dst_pages=dst,
        prefix_pages=prefix_tokens // page,
        state_src={k: src_slots for k in spec.state_kinds},
        state_dst={k: dst_slots for k in spec.state_kinds},
        aux_src=2,
        aux_dst=3,
        left_out=unsent,
    )
    return checked, [f"{m.what} {m.index}" for m in mismatches]


@settings(max_examples=40, deadline=None)
@given(
    cp=st.sampled_from([1, 2, 4, 8]),
    pages=st.integers(1, 20),
    prefix_pages=st.integers(0, 5),
    cuts=st.lists(st.integers(1, 19), max_size=3, unique=True),
    partial=st.integers(0, 15),
    mha=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_all_ranks_reproduce_the_full_layout(
    cp: int, pages: int, prefix_pages: int, cuts: list[int], partial: int, mha: bool, seed: int
) -> None:
    spec = ModelSpec(
        attention=AttentionKind.MHA if mha else AttentionKind.MLA, layers=3, page_size=16, state_layers=(1,)
    )
    prefix_pages = min(prefix_pages, pages - 1)
    tokens = pages * 16 - (partial if pages > prefix_pages + 1 else 0)
    inner = sorted(c for c in cuts if prefix_pages < c < pages)
    bounds = [prefix_pages * 16, *(c * 16 for c in inner), tokens]
    chunks = [b - a for a, b in itertools.pairwise(bounds)]
    checked, mismatches = run_request(
        spec, cp=cp, tokens=tokens, prefix_tokens=prefix_pages * 16, chunk_tokens=chunks, seed=seed
    )
    assert mismatches == []
    assert checked > 0


def test_a_chunk_mapped_without_its_offset_is_caught() -> None:
    """The property above could fail: chunk 1 mapped as if it started at token 0 lands on chunk 0's pages."""
    spec = ModelSpec(layers=2, page_size=16, state_layers=(), state_kinds=())
    _, ok = run_request(spec, cp=2, tokens=64, prefix_tokens=0, chunk_tokens=[32, 32], seed=1)
    assert ok == []
    _, bad = run_request(
        spec, cp=2, tokens=64, prefix_tokens=0, chunk_tokens=[32, 32], seed=1, ignore_offset=True
    )
    assert bad and all("position" in m for m in bad)


# ---------------------------------------------------------------- a rolling deployment's draft buffers

WITH_DRAFT_STATE = ModelSpec(
    layers=3, page_size=16, state_layers=(0, 2), draft_layers=1, draft_state_layers=(0,)
)
WITHOUT_DRAFT_STATE = attrs.evolve(WITH_DRAFT_STATE, draft_state_layers=())


def expected_bytes(spec: ModelSpec, pages: int, slots: int) -> int:
    """What one room moves when only ``spec``'s buffers pair (restated from the model's shape)."""
    kv = pages * spec.kv_item_bytes * (spec.layers + spec.draft_layers)
    state = slots * spec.state_item_bytes * len(spec.state_kinds) * len(spec.state_layers)
    return kv + state + spec.aux_item_bytes


@pytest.mark.parametrize(
    ("prefill", "decode"), [(WITH_DRAFT_STATE, WITHOUT_DRAFT_STATE), (WITHOUT_DRAFT_STATE, WITH_DRAFT_STATE)]
)
@pytest.mark.parametrize("cp", [1, 2])
def test_draft_state_only_one_side_registers_is_left_out(
    prefill: ModelSpec, decode: ModelSpec, cp: int
) -> None:
    """Target KV and state, draft KV and aux land byte for byte; the draft state buffers the decode has
    and the prefill lacks stay zero; the bytes planned are those of the buffers both sides have."""
    planned: list[int] = []
    checked, mismatches = run_request(
        prefill,
        cp=cp,
        tokens=100,
        prefix_tokens=16,
        chunk_tokens=[32, 52],
        seed=3,
        decode_spec=decode,
        planned_bytes=planned,
    )
    assert mismatches == [] and checked > 0
    assert sum(planned) == expected_bytes(WITHOUT_DRAFT_STATE, pages=7 - 1, slots=2)


def test_the_left_out_check_catches_a_write_into_a_draft_buffer() -> None:
    """The control: planned on the decode's own layout (as if the prefill had the draft state), the
    decode's draft state buffer is written, and ``verify_room`` says so."""
    decode = RankMemory(WITH_DRAFT_STATE, Capacity(kv_pages=8, state_slots=8, aux_rows=4))
    key = (ModelRole.DRAFT, BufferKind.INDEX_K, 0)
    decode.view(key)[7] = 1
    _, mismatches = verify_room(
        decode,
        logical_ids=np.zeros(0, dtype=np.int64),
        dst_pages=np.zeros(0, dtype=np.int64),
        prefix_pages=0,
        state_src={},
        state_dst={BufferKind.INDEX_K: np.array([7])},
        aux_src=None,
        aux_dst=None,
        left_out=[key],
    )
    assert [m.what for m in mismatches] == ["draft/index_k/L0 left out, written at"]


def test_other_draft_state_layers_are_still_refused_by_the_planner() -> None:
    """Draft lists of which neither starts the other are another draft model: no plan, even if a
    registration had let them through."""
    other = attrs.evolve(WITH_DRAFT_STATE, draft_state_layers=(1,))
    with pytest.raises(LayoutMismatchError):
        run_request(
            WITH_DRAFT_STATE, cp=1, tokens=32, prefix_tokens=0, chunk_tokens=[32], seed=1, decode_spec=other
        )


def test_state_kind_without_destination_is_a_mapping_error() -> None:
    spec = ModelSpec(layers=2, page_size=16, state_layers=(0,))
    memory = RankMemory(spec, Capacity(kv_pages=8, state_slots=4, aux_rows=2))
    request = TransferRequest(origin=DECODE, room=RoomId(1), dst_pages=[0])
    peer = DecodePeer(
        instance=DECODE.instance,
        epoch=DECODE.epoch,
        rank=DECODE.rank,
        tp_size=1,
        endpoint=Endpoint("e"),
        session=SessionId("s"),
        layout=memory.layout,
    )
    submit = SubmitChunk(
        room=RoomId(1),
        chunk=0,
        spec=ChunkSpec(
            pages=[0], start_token=0, last=True, state=[StateIndices(kind=BufferKind.INDEX_K, indices=[0])]
        ),
        num_pages=1,
        src_aux_row=None,
        destinations=(Destination(peer=peer, request=request),),
    )
    with pytest.raises(MappingError, match="names no destination slots"):
        plan_chunk(
            submit.room,
            submit.spec,
            submit.destinations[0],
            src_aux_row=submit.src_aux_row,
            src_layout=memory.layout,
            cp_rank=0,
            policy=PageInterleaved(cp_size=1),
            writes_extras=True,
        )


# ---------------------------------------------------------------- MHA/GQA across unequal TP


def run_tp_request(
    spec: ModelSpec,
    *,
    prefill_tp: int,
    decode_tp: int,
    cp: int,
    chunk_pages: list[int],
    prefix_pages: int,
    seed: int,
    decode_layout: ItemLayout | None = None,
) -> tuple[list[RankMemory], list[int], list[str]]:
    """Every real (tp, cp) source of every decode rank plans every chunk; blocks applied as memcpy.

    Returns the decode memories, the aux rows written per decode rank (extras writers) and the
    mismatches of each decode rank against the prefill full layout.
    """
    assert spec.kv_heads is not None
    policy = PageInterleaved(cp_size=cp)
    capacity = Capacity(kv_pages=64, state_slots=8, aux_rows=4)
    prefill = {
        (tp, rank): RankMemory(spec, capacity, tp_size=prefill_tp, tp_rank=tp)
        for tp in range(prefill_tp)
        for rank in range(cp)
    }
    for (_, rank), memory in prefill.items():
        memory.fill_prefill(cp_rank=rank, policy=policy)
    decode = [
        RankMemory(
            spec,
            Capacity(kv_pages=256, state_slots=8, aux_rows=4),
            tp_size=decode_tp,
            tp_rank=d,
            item_layout=decode_layout,
        )
        for d in range(decode_tp)
    ]
    rng = np.random.default_rng(seed)
    num_pages = prefix_pages + sum(chunk_pages)
    logical = rng.choice(64 * cp, size=num_pages, replace=False).astype(np.int64)
    dst = rng.choice(256, size=num_pages, replace=False).astype(np.int64)
    src_slots, dst_slots = np.array([1, 5]), np.array([7, 2])
    topology = Topology(
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        prefill_cp=cp,
        attention=AttentionKind.MHA,
        kv_heads=spec.kv_heads,
    )
    aux_writes: list[int] = []
    problems: list[str] = []
    for d, memory in enumerate(decode):
        origin = Origin(instance=InstanceId("d"), epoch=Epoch(1), rank=RankCoord(tp=d))
        request = TransferRequest(
            origin=origin,
            room=RoomId(9),
            dst_pages=dst,
            dst_aux_row=3,
            dst_state=[StateIndices(kind=k, indices=dst_slots) for k in spec.state_kinds],
        )
        peer = DecodePeer(
            instance=origin.instance,
            epoch=origin.epoch,
            rank=origin.rank,
            tp_size=decode_tp,
            endpoint=Endpoint("e"),
            session=SessionId("s"),
            layout=memory.layout,
        )
        written = 0
        page = prefix_pages
        for n, size in enumerate(chunk_pages):
            last = n == len(chunk_pages) - 1
            chunk = ChunkSpec(
                pages=logical[page : page + size],
                start_token=page * spec.page_size,
                last=last,
                state=[StateIndices(kind=k, indices=src_slots) for k in spec.state_kinds] if last else (),
            )
            for target in decode_fanout(topology, d).real_targets:
                submit = SubmitChunk(
                    room=RoomId(9),
                    chunk=n,
                    spec=chunk,
                    num_pages=num_pages,
                    src_aux_row=2,
                    destinations=(Destination(peer=peer, request=request),),
                )
                plan = plan_chunk(
                    submit.room,
                    submit.spec,
                    submit.destinations[0],
                    src_aux_row=submit.src_aux_row,
                    src_layout=prefill[(target.tp, target.cp)].layout,
                    cp_rank=target.cp,
                    policy=policy,
                    writes_extras=target.cp == 0,
                )
                apply(plan.blocks)
                written += plan.aux_rows
            page += size
        aux_writes.append(written)
        _, mismatches = verify_room(
            memory,
            logical_ids=logical,
            dst_pages=dst,
            prefix_pages=prefix_pages,
            state_src={k: src_slots for k in spec.state_kinds},
            state_dst={k: dst_slots for k in spec.state_kinds},
            aux_src=2,
            aux_dst=3,
        )
        problems += [f"decode {d}: {m.what} {m.index}" for m in mismatches]
    return decode, aux_writes, problems


TP_CASES = [
    # (prefill tp, decode tp, kv heads): both directions, heads that divide and that replicate
    (2, 4, 8),
    (4, 2, 8),
    (1, 4, 2),
    (4, 2, 2),
    (4, 1, 2),
    (2, 1, 8),
    (2, 2, 8),
]


@settings(max_examples=30, deadline=None)
@given(
    case=st.sampled_from(TP_CASES),
    cp=st.sampled_from([1, 2]),
    chunk_pages=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    prefix_pages=st.integers(0, 3),
    head_major=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_unequal_tp_reproduces_every_decode_head_and_writes_extras_once(
    case: tuple[int, int, int],
    cp: int,
    chunk_pages: list[int],
    prefix_pages: int,
    head_major: bool,
    seed: int,
) -> None:
    prefill_tp, decode_tp, heads = case
    spec = ModelSpec(
        attention=AttentionKind.MHA,
        layers=2,
        page_size=4,
        kv_bytes_per_token=heads * 8,
        kv_heads=heads,
        state_layers=(1,),
    )
    _, aux_writes, problems = run_tp_request(
        spec,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        cp=cp,
        chunk_pages=chunk_pages,
        prefix_pages=prefix_pages,
        seed=seed,
        decode_layout=ItemLayout.HEAD_TOKEN if head_major else None,
    )
    assert problems == []
    assert aux_writes == [1] * decode_tp  # one extras writer per decode rank, never two


def test_decode_head_bytes_come_from_the_right_prefill_head() -> None:
    """Hand-built oracle: 2 KV heads of 3 bytes, page of 2 tokens, prefill TP 1 -> decode TP 2.

    The prefill item is [token][head][byte]; decode rank 1 holds head 1, so its item must be the
    bytes 3..5 (token 0) and 9..11 (token 1) of the prefill item, nothing else.
    """
    spec = ModelSpec(
        attention=AttentionKind.MHA,
        layers=1,
        page_size=2,
        kv_bytes_per_token=6,
        kv_heads=2,
        state_layers=(),
        state_kinds=(),
        draft_layers=0,
    )
    source = RankMemory(spec, Capacity(kv_pages=64, state_slots=1, aux_rows=1))  # as run_tp_request
    source.fill_prefill(cp_rank=0, policy=PageInterleaved(cp_size=1))
    decode, _, problems = run_tp_request(
        spec, prefill_tp=1, decode_tp=2, cp=1, chunk_pages=[1], prefix_pages=0, seed=3
    )
    assert problems == []
    full = source.view((ModelRole.TARGET, BufferKind.K, 0))
    landed = decode[1].view((ModelRole.TARGET, BufferKind.K, 0))
    rows = [i for i in range(landed.shape[0]) if landed[i].any()]
    assert len(rows) == 1 and landed.shape[1] == 6
    matches = [
        p for p in range(full.shape[0]) if np.array_equal(landed[rows[0]], full[p][[3, 4, 5, 9, 10, 11]])
    ]
    assert len(matches) == 1


def test_extras_writer_is_the_source_holding_the_first_decode_head() -> None:
    spec = ModelSpec(attention=AttentionKind.MHA, kv_bytes_per_token=64, kv_heads=8)
    cap = Capacity(kv_pages=2, state_slots=1, aux_rows=1)
    decode = RankMemory(spec, cap, tp_size=2, tp_rank=1)  # heads 4..7
    sources = [RankMemory(spec, cap, tp_size=4, tp_rank=p).layout for p in range(4)]  # 2 heads each
    assert [writes_extras_to(s, decode.layout) for s in sources] == [False, False, True, False]
    mla = RankMemory(ModelSpec(), cap).layout
    assert writes_extras_to(mla, mla)
