"""coalesce / expand: runs are maximal, contiguous on both sides, and expand back to the pairs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdkv.errors import MappingError
from pdkv.mapping import PageRuns, coalesce, expand


@st.composite
def page_pairs(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    # runs of random lengths at random starts, so both contiguous and broken stretches occur
    pieces = draw(
        st.lists(st.tuples(st.integers(0, 200), st.integers(0, 200), st.integers(1, 6)), max_size=15)
    )
    src = [s + k for s, _, n in pieces for k in range(n)]
    dst = [d + k for _, d, n in pieces for k in range(n)]
    return src, dst


@given(page_pairs())
def test_expand_of_coalesce_gives_the_pairs_back(pairs: tuple[list[int], list[int]]) -> None:
    src, dst = pairs
    back = expand(coalesce(src, dst))
    assert back.src.tolist() == src
    assert back.dst.tolist() == dst


@given(page_pairs())
def test_runs_are_maximal_and_contiguous_on_both_sides(pairs: tuple[list[int], list[int]]) -> None:
    src, dst = pairs
    runs = coalesce(src, dst)
    assert runs.num_pages == len(src)
    # reference: count the breaks with a plain loop
    breaks = sum(1 for i in range(1, len(src)) if src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1)
    assert len(runs) == (breaks + 1 if src else 0)
    ends_src = runs.src_start + runs.length
    ends_dst = runs.dst_start + runs.length
    # two neighbouring runs are never joinable
    joinable = (ends_src[:-1] == runs.src_start[1:]) & (ends_dst[:-1] == runs.dst_start[1:])
    assert not bool(np.any(joinable))


def test_hand_example() -> None:
    runs = coalesce([0, 1, 2, 5, 6], [10, 11, 13, 14, 15])
    assert runs == PageRuns(src_start=[0, 2, 5], dst_start=[10, 13, 14], length=[2, 1, 2])


def test_contiguous_on_one_side_only_is_not_a_run() -> None:
    runs = coalesce([3, 4, 5], [9, 7, 8])
    assert runs.length.tolist() == [1, 2]


def test_empty_and_mismatched_inputs() -> None:
    assert len(coalesce([], [])) == 0
    assert len(expand(PageRuns.empty()).src) == 0
    with pytest.raises(MappingError, match="2 source vs 3 destination pages"):
        coalesce([1, 2], [1, 2, 3])


def test_runs_must_be_at_least_one_page() -> None:
    with pytest.raises(MappingError, match="at least one page"):
        PageRuns(src_start=[0], dst_start=[0], length=[0])
