"""plan_chunk end to end in one process: every CP rank's blocks, applied as memcpy into decode
memory, reproduce the prefill full layout (chunked, cached prefix, state on some layers, draft, aux)."""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdkv.errors import MappingError
from pdkv.mapping import AttentionKind, BufferKind, PageInterleaved, TransferBlocks
from pdkv.protocol.effects import ChunkSpec, DecodePeer, Destination, SubmitChunk
from pdkv.protocol.ids import Endpoint, Epoch, InstanceId, RoomId, SessionId
from pdkv.protocol.messages import Origin, RankCoord, StateIndices, TransferRequest
from pdkv.runtime.chunk_plan import plan_chunk
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
) -> tuple[int, list[str]]:
    policy = PageInterleaved(cp_size=cp)
    page = spec.page_size
    prefill = [RankMemory(spec, Capacity(kv_pages=64, state_slots=8, aux_rows=4)) for _ in range(cp)]
    for rank, memory in enumerate(prefill):
        memory.fill_prefill(cp_rank=rank, policy=policy)
    decode = RankMemory(spec, Capacity(kv_pages=256, state_slots=8, aux_rows=4))
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
                submit,
                submit.destinations[0],
                src_layout=prefill[rank].layout,
                cp_rank=rank,
                policy=policy,
                writes_extras=rank == 0,
            )
            apply(plan.blocks)
        token += size
    checked, mismatches = verify_room(
        decode,
        logical_ids=logical,
        dst_pages=dst,
        prefix_pages=prefix_tokens // page,
        state_src={k: src_slots for k in spec.state_kinds},
        state_dst={k: dst_slots for k in spec.state_kinds},
        aux_src=2,
        aux_dst=3,
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
            submit,
            submit.destinations[0],
            src_layout=memory.layout,
            cp_rank=0,
            policy=PageInterleaved(cp_size=1),
            writes_extras=True,
        )
