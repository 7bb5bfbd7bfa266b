"""``repeated_ids``: every id that occurs more than once, each once, sorted (against a Counter)."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from pdkv.protocol.arguments import repeated_ids


@given(st.lists(st.integers(min_value=0, max_value=20), max_size=40))
def test_repeated_ids_are_the_ids_seen_twice(ids: list[int]) -> None:
    expected = sorted(i for i, n in Counter(ids).items() if n > 1)
    got = repeated_ids(np.array(ids, dtype=np.int64))
    assert got.tolist() == expected and got.dtype == np.int64
