"""Chunk offsets, CP ownership and the exact page contract (partition, chunked == whole, errors)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pdkv.errors import MappingError
from pdkv.mapping import (
    BlockCyclic,
    OwnershipPolicy,
    PageInterleaved,
    PageRuns,
    check_page_counts,
    chunk_page_start,
    coalesce,
    cp_owned,
    dst_for_positions,
    expand,
    map_chunk,
)
from pdkv.mapping._arrays import as_index_array, as_non_negative_index_array


def policies() -> st.SearchStrategy[OwnershipPolicy]:
    interleaved = st.sampled_from([1, 2, 4, 8]).map(lambda c: PageInterleaved(cp_size=c))
    cyclic = st.builds(
        lambda c, b: BlockCyclic(cp_size=c, block_pages=b),
        st.sampled_from([1, 2, 3, 4, 8]),
        st.integers(1, 5),
    )
    return st.one_of(interleaved, cyclic)


logical_pages = st.lists(st.integers(0, 10_000), min_size=0, max_size=80, unique=True)


# ---------------------------------------------------------------- chunk_page_start


def test_chunk_page_start_divides_aligned_offsets() -> None:
    assert chunk_page_start(0, 64) == 0
    assert chunk_page_start(4096, 64) == 64
    assert chunk_page_start(np.int64(192), 64) == 3


@pytest.mark.parametrize(("start", "page_size"), [(65, 64), (1, 2), (127, 64)])
def test_chunk_page_start_rejects_unaligned_offsets(start: int, page_size: int) -> None:
    with pytest.raises(MappingError, match=f"{start} is not aligned to page_size {page_size}"):
        chunk_page_start(start, page_size)


@pytest.mark.parametrize(("start", "page_size"), [(-64, 64), (0, 0), (True, 64), (64.0, 64)])
def test_chunk_page_start_rejects_bad_values(start: object, page_size: object) -> None:
    with pytest.raises(MappingError):
        chunk_page_start(start, page_size)  # type: ignore[arg-type]  # invalid on purpose


# ---------------------------------------------------------------- ownership


@given(logical_pages, st.integers(0, 500), policies())
def test_positions_partition_the_chunk_exactly_once(
    pages: list[int], first: int, policy: OwnershipPolicy
) -> None:
    owned = [cp_owned(pages, first, rank, policy) for rank in range(policy.cp_size)]
    all_positions = np.concatenate([o.positions for o in owned])
    assert sorted(all_positions.tolist()) == list(range(first, first + len(pages)))
    for rank, part in enumerate(owned):
        assert np.all(np.diff(part.positions) > 0)
        chosen = np.asarray(pages, dtype=np.int64)[part.positions - first]
        assert np.all(policy.owner(chosen) == rank)
        assert np.array_equal(policy.logical(rank, part.physical), chosen)


@given(logical_pages, st.integers(0, 500))
def test_cp_size_one_is_the_identity(pages: list[int], first: int) -> None:
    for policy in (None, PageInterleaved(cp_size=1), BlockCyclic(cp_size=1, block_pages=3)):
        owned = cp_owned(pages, first, 0, policy)
        assert owned.physical.tolist() == pages
        assert owned.positions.tolist() == list(range(first, first + len(pages)))


def test_cp_owned_hand_example_interleaved() -> None:
    owned = cp_owned([10, 11, 12, 13, 14, 15, 16, 17, 18, 19], 4, 1, PageInterleaved(cp_size=4))
    assert owned.physical.tolist() == [3, 4]  # logical 13 and 17
    assert owned.positions.tolist() == [7, 11]


def test_cp_owned_rejects_rank_outside_cp_size() -> None:
    with pytest.raises(MappingError, match="cp_rank 4 is outside cp_size 4"):
        cp_owned([0, 1], 0, 4, PageInterleaved(cp_size=4))


def test_cp_owned_rejects_negative_page_ids_with_summary() -> None:
    with pytest.raises(MappingError, match=r"got -1 at index 2; chunk_logical_pages: n=3"):
        cp_owned([0, 1, -1], 0, 0)


# ---------------------------------------------------------------- chunked == whole


@st.composite
def chunked_requests(draw: st.DrawFn) -> tuple[int, int, list[int], list[int], list[int], OwnershipPolicy]:
    page_size = draw(st.sampled_from([1, 4, 16, 64]))
    tokens = draw(st.integers(1, 60 * page_size))
    num_pages = -(-tokens // page_size)
    logical = draw(st.lists(st.integers(0, 5000), min_size=num_pages, max_size=num_pages, unique=True))
    dst = draw(st.lists(st.integers(0, 5000), min_size=num_pages, max_size=num_pages, unique=True))
    prefix_pages = draw(st.integers(0, num_pages - 1))
    cuts = (
        sorted(draw(st.sets(st.integers(prefix_pages + 1, num_pages - 1), max_size=6)))
        if prefix_pages + 1 < num_pages
        else []
    )
    bounds = [prefix_pages, *cuts, num_pages]
    return page_size, tokens, logical, dst, bounds, draw(policies())


@given(chunked_requests())
def test_chunk_by_chunk_equals_whole_request(
    case: tuple[int, int, list[int], list[int], list[int], OwnershipPolicy],
) -> None:
    page_size, _tokens, logical, dst, bounds, policy = case
    first = bounds[0]
    for rank in range(policy.cp_size):
        whole = map_chunk(
            logical[first:],
            start_token=first * page_size,
            page_size=page_size,
            dst_pages=dst,
            cp_rank=rank,
            policy=policy,
        )
        parts = [
            map_chunk(
                logical[a:b],
                start_token=a * page_size,
                page_size=page_size,
                dst_pages=dst,
                cp_rank=rank,
                policy=policy,
            )
            for a, b in itertools.pairwise(bounds)
        ]
        assert np.concatenate([p.src for p in parts]).tolist() == whole.src.tolist()
        assert np.concatenate([p.dst for p in parts]).tolist() == whole.dst.tolist()
        assert np.concatenate([p.positions for p in parts]).tolist() == whole.positions.tolist()
        # a later chunk never lands on an earlier chunk's destination pages
        for index, (part, a) in enumerate(zip(parts, bounds, strict=False)):
            assert set(part.dst.tolist()).isdisjoint(dst[:a])
            if index:
                assert int(part.positions.min(initial=a)) >= a


# ---------------------------------------------------------------- exact contract


def test_dst_for_positions_selects_by_absolute_position() -> None:
    assert dst_for_positions([50, 51, 52, 90, 91], [0, 3, 4]).tolist() == [50, 90, 91]
    assert dst_for_positions([50, 51], []).tolist() == []


def test_position_past_the_end_names_both_lists() -> None:
    with pytest.raises(MappingError) as info:
        dst_for_positions(np.arange(100, 105), np.arange(3, 9))
    text = str(info.value)
    assert "4 position(s) outside the destination list (valid 0..4, got 3..8)" in text
    assert "positions: n=6 runs=1 [3 4 5 6 7 8]" in text
    assert "dst_pages: n=5 runs=1 [100 101 102 103 104]" in text


def test_summary_shows_only_the_ends_of_long_lists() -> None:
    positions = np.concatenate([np.arange(0, 500), np.arange(900, 1400)])
    with pytest.raises(MappingError) as info:
        dst_for_positions(np.arange(1000), positions)
    text = str(info.value)
    assert "positions: n=1000 runs=2 [0 1 2 ... 1397 1398 1399]" in text
    assert "dst_pages: n=1000 runs=1 [0 1 2 ... 997 998 999]" in text
    assert len(text) < 400


def test_negative_position_is_an_error() -> None:
    with pytest.raises(MappingError, match="outside the destination list"):
        dst_for_positions([1, 2, 3], [-1])


def test_check_page_counts_refuses_to_clip() -> None:
    assert check_page_counts([1, 2, 3], [7, 8, 9]) == 3
    with pytest.raises(
        MappingError, match=r"3 source vs 2 destination pages; src_pages: n=3 runs=1 \[1 2 3\]"
    ):
        check_page_counts([1, 2, 3], [7, 8])


# ---------------------------------------------------------------- input kinds


class _FakeDevice:
    type = "cuda"


class _FakeCudaTensor:
    """Just enough of a CUDA tensor: converting it must never be attempted."""

    device = _FakeDevice()

    def __array__(self, *args: object, **kwargs: object) -> np.ndarray:
        raise AssertionError("a CUDA tensor must not be copied to the host")


class _FakeIsCuda:
    is_cuda = True

    def __array__(self, *args: object, **kwargs: object) -> np.ndarray:
        raise AssertionError("a CUDA tensor must not be copied to the host")


@pytest.mark.parametrize("fake", [_FakeCudaTensor(), _FakeIsCuda()])
def test_accelerator_tensors_are_rejected_without_a_copy(fake: object) -> None:
    with pytest.raises(MappingError, match="must live on the CPU, got a tensor on 'cuda'"):
        cp_owned(fake, 0, 0)
    with pytest.raises(MappingError, match="must live on the CPU"):
        dst_for_positions(fake, [0])
    with pytest.raises(MappingError, match="must live on the CPU"):
        coalesce([0], fake)


def test_cpu_torch_tensors_and_lists_are_accepted() -> None:
    mapped = map_chunk(
        torch.tensor([8, 9, 10, 11], dtype=torch.int32),
        start_token=64,
        page_size=64,
        dst_pages=torch.arange(100, 106),
        cp_rank=0,
        policy=PageInterleaved(cp_size=2),
    )
    assert mapped.src.tolist() == [4, 5]
    assert mapped.positions.tolist() == [1, 3]
    assert mapped.dst.tolist() == [101, 103]
    assert mapped.src.dtype == np.int64


@pytest.mark.parametrize("bad", [[0.5, 1.0], [[1, 2]], np.array([True, False]), ["a"]])
def test_non_integer_or_non_flat_inputs_are_rejected(bad: object) -> None:
    with pytest.raises(MappingError):
        cp_owned(bad, 0, 0)


def test_block_cyclic_chunk_coalesces_into_block_runs() -> None:
    # rank 1 owns blocks 1 and 3 (logical 4..7, 12..15) -> physical 0..3 and 4..7, positions 4..7, 12..15
    mapped = map_chunk(
        list(range(16)),
        start_token=0,
        page_size=4,
        dst_pages=list(range(100, 116)),
        cp_rank=1,
        policy=BlockCyclic(cp_size=2, block_pages=4),
    )
    runs = coalesce(mapped.src, mapped.dst)
    assert runs.src_start.tolist() == [0, 4]
    assert runs.dst_start.tolist() == [104, 112]
    assert runs.length.tolist() == [4, 4]
    pairs = expand(runs)
    assert pairs.src.tolist() == mapped.src.tolist()
    assert pairs.dst.tolist() == mapped.dst.tolist()


def test_results_do_not_alias_the_callers_arrays() -> None:
    pages = torch.tensor([5, 6, 7], dtype=torch.int64)
    dst = np.array([50, 51, 52, 53], dtype=np.int64)
    mapped = map_chunk(pages, start_token=0, page_size=4, dst_pages=dst)
    owned = cp_owned(pages, 0, 0)
    pages[:] = 0
    dst[:] = 0
    assert mapped.src.tolist() == [5, 6, 7]
    assert owned.physical.tolist() == [5, 6, 7]
    assert mapped.dst.tolist() == [50, 51, 52]


def test_index_intake_takes_int64_arrays_as_they_are_and_checks_the_rest() -> None:
    """The intake returns a flat contiguous int64 array itself (no copy, no re-check); anything else
    still goes through every check."""
    ready = np.array([3, 1, 2], dtype=np.int64)
    assert as_index_array(ready, "x") is ready
    strided = np.arange(6, dtype=np.int64)[::2]  # int64 but not contiguous: a contiguous copy
    taken = as_index_array(strided, "x")
    assert taken.flags.c_contiguous and taken.tolist() == [0, 2, 4]
    empty = np.zeros(0, dtype=np.int64)
    assert as_index_array(empty, "x") is not empty and as_index_array(empty, "x").size == 0
    with pytest.raises(MappingError, match="1-D"):
        as_index_array(np.zeros((2, 2), dtype=np.int64), "x")
    with pytest.raises(MappingError, match="non-negative, got -4 at index 1"):
        as_non_negative_index_array(np.array([1, -4], dtype=np.int64), "x")
    assert as_index_array(np.array([7], dtype=np.int32), "x").dtype == np.int64


def test_one_page_coalesces_into_one_fresh_run() -> None:
    src = np.array([9], dtype=np.int64)
    dst = np.array([4], dtype=np.int64)
    runs = coalesce(src, dst)
    assert runs == PageRuns(src_start=[9], dst_start=[4], length=[1])
    src[0] = dst[0] = 0  # the caller reuses its arrays: the runs keep their own copies
    assert runs.src_start.tolist() == [9] and runs.dst_start.tolist() == [4]
    with pytest.raises(MappingError, match="non-negative"):
        coalesce(np.array([-1], dtype=np.int64), dst)
    with pytest.raises(MappingError, match="1 source vs 2 destination pages"):
        coalesce(src, np.array([1, 2], dtype=np.int64))
