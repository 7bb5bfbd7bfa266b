"""Page runs: (src, dst) page pairs coalesced into runs contiguous on both sides.

Owns: ``PageRuns`` (struct of arrays) with ``coalesce`` and its inverse ``expand``. Pure and
vectorised. Must not reorder pairs: a run is a maximal stretch of consecutive pairs where both the
source and the destination page advance by exactly one, so one engine entry per run and buffer
moves the same bytes as one entry per page.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from pdkv.errors import MappingError
from pdkv.mapping._arrays import IntArray, as_non_negative_index_array, int_min, int_sum, summarize
from pdkv.mapping.pages import require_equal_counts


def _array_eq() -> Any:
    return attrs.cmp_using(eq=np.array_equal)


def _int64(value: object) -> IntArray:
    return np.ascontiguousarray(value, dtype=np.int64)


@attrs.frozen(kw_only=True)
class PageRuns:
    """Run i copies pages ``src_start[i] .. src_start[i] + length[i] - 1`` to ``dst_start[i] ..``."""

    src_start: IntArray = attrs.field(converter=_int64, eq=_array_eq())
    dst_start: IntArray = attrs.field(converter=_int64, eq=_array_eq())
    length: IntArray = attrs.field(converter=_int64, eq=_array_eq())

    def __attrs_post_init__(self) -> None:
        n = self.src_start.size
        if self.src_start.ndim != 1 or not (self.dst_start.size == self.length.size == n):
            raise MappingError(
                f"run arrays differ: src_start {self.src_start.shape}, dst_start {self.dst_start.shape}, "
                f"length {self.length.shape}"
            )
        if n and int_min(self.length) <= 0:
            raise MappingError(f"runs are at least one page long; {summarize(self.length, 'length')}")

    def __len__(self) -> int:
        return int(self.length.size)

    @property
    def num_pages(self) -> int:
        return int_sum(self.length)

    @classmethod
    def empty(cls) -> PageRuns:
        zero = np.zeros(0, dtype=np.int64)
        return cls(src_start=zero, dst_start=zero, length=zero)


def coalesce(src_pages: object, dst_pages: object) -> PageRuns:
    """Maximal runs of pairs contiguous on both sides, in the order of the pairs.

    The two lists must be equally long (``check_page_counts``): a mismatch is a ``MappingError``.
    """
    src = as_non_negative_index_array(src_pages, "src_pages")
    dst = as_non_negative_index_array(dst_pages, "dst_pages")
    require_equal_counts(src, dst)
    if src.size == 0:
        return PageRuns.empty()
    if src.size == 1:
        # One page is one run; skips the scan below, whose fixed cost is most of a 1-page chunk's.
        return PageRuns(src_start=src.copy(), dst_start=dst.copy(), length=np.ones(1, dtype=np.int64))
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate([np.zeros(1, dtype=np.int64), breaks])
    ends = np.concatenate([breaks, np.array([src.size], dtype=np.int64)])
    return PageRuns(src_start=src[starts], dst_start=dst[starts], length=ends - starts)


@attrs.frozen(kw_only=True)
class PagePairs:
    """Page ``src[i]`` goes to peer page ``dst[i]``."""

    src: IntArray = attrs.field(eq=_array_eq())
    dst: IntArray = attrs.field(eq=_array_eq())


def expand(runs: PageRuns) -> PagePairs:
    """The (src, dst) page pairs that ``runs`` cover, in order: ``expand(coalesce(s, d)) == (s, d)``."""
    total = runs.num_pages
    run_of_page = np.repeat(np.arange(len(runs), dtype=np.int64), runs.length)
    first_page_of_run = np.cumsum(runs.length) - runs.length
    step = np.arange(total, dtype=np.int64) - first_page_of_run[run_of_page]
    return PagePairs(src=runs.src_start[run_of_page] + step, dst=runs.dst_start[run_of_page] + step)
