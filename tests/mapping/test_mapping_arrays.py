"""The small-array reductions of ``pdkv.mapping._arrays``: the same answers as numpy's on both sides of
``SMALL_ARRAY`` (a short array goes through a Python list, a long one through numpy)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdkv.mapping._arrays import SMALL_ARRAY, all_true, any_true, int_bounds, int_max, int_min, int_sum

SIZES = st.integers(1, 3 * SMALL_ARRAY)


@given(st.data(), SIZES)
def test_the_reductions_agree_with_numpy_on_both_sides_of_the_small_size(
    data: st.DataObject, size: int
) -> None:
    # Within +-2**50, so that numpy's int64 sum of up to 96 of them cannot wrap.
    values = data.draw(st.lists(st.integers(-(2**50), 2**50), min_size=size, max_size=size))
    arr = np.array(values, dtype=np.int64)
    assert (int_min(arr), int_max(arr), int_sum(arr)) == (min(values), max(values), sum(values))
    assert int_bounds(arr) == (min(values), max(values))
    assert all(type(x) is int for x in (int_min(arr), int_max(arr), int_sum(arr), *int_bounds(arr)))
    flags = arr > 0
    assert (any_true(flags), all_true(flags)) == (any(v > 0 for v in values), all(v > 0 for v in values))


@pytest.mark.parametrize("size", [SMALL_ARRAY, SMALL_ARRAY + 1, 2 * SMALL_ARRAY + 1])
def test_unsigned_ids_past_int64_keep_their_value(size: int) -> None:
    arr = np.full(size, 2**64 - 1, dtype=np.uint64)
    assert int_bounds(arr) == (2**64 - 1, 2**64 - 1) and int_max(arr) == 2**64 - 1


def test_an_empty_array_has_no_bounds_but_a_sum_and_truth_values() -> None:
    empty = np.zeros(0, dtype=np.int64)
    for reduce in (int_min, int_max, int_bounds):
        with pytest.raises(ValueError):
            reduce(empty)
    assert int_sum(empty) == 0 and not any_true(empty) and all_true(empty)
