"""Page allocator: 1-512 page allocations in a fragmented 10M-page pool, against linear-scan first fit.

Owns: the allocator benchmark and its two reference allocators (address-ordered free lists whose
first-fit search is a linear scan: a plain Python loop, and a numpy-vectorised scan that runs the
same linear pass in C). Must not assert speed: it prints figures and ratios.

Method. A ``PagePool`` of ``--pages`` pages (one lane) is filled completely with requests of
1 .. ``--max-request`` pages (log-uniform sizes: many small requests, some large), then random
requests are freed until occupancy is down to ``--fill`` (holes of every size, spread over the
whole pool), and ``--churn`` free+allocate steps bring it to a steady fragmented state. The
references start from a copy of exactly that state (the pool's free extents and live requests);
then every allocator runs the same measured sequence: free a random live request, allocate the
next size, timing each allocation (and each free). A reference may run only the first
``--reference-ops`` / ``--numpy-reference-ops`` operations because a linear scan is slow; the JSON
says how many it ran, and each ratio compares it with the pool over those same operations, overall
and per request-size class.
"""

from __future__ import annotations

import argparse
import bisect
import time
from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt

from pdkv.alloc import PagePool
from pdkv.bench._report import emit, table

IntArray = npt.NDArray[np.int64]


class PythonFirstFit:
    """Free list sorted by address; allocation scans it from the front in a Python loop."""

    def __init__(self, starts: Sequence[int], lengths: Sequence[int]) -> None:
        self._starts = list(starts)
        self._lengths = list(lengths)

    @property
    def extents(self) -> int:
        return len(self._starts)

    def allocate(self, count: int) -> IntArray:
        starts, lengths = self._starts, self._lengths
        for index, length in enumerate(lengths):  # the linear scan under test
            if length >= count:
                first = starts[index]
                if length == count:
                    del starts[index], lengths[index]
                else:
                    starts[index] = first + count
                    lengths[index] = length - count
                return np.arange(first, first + count, dtype=np.int64)
        # No single extent holds it: take extents front to back, as a first-fit list does.
        pieces: list[IntArray] = []
        remaining = count
        while remaining:
            if not starts:
                raise MemoryError(f"reference pool exhausted with {remaining} pages still wanted")
            take = min(lengths[0], remaining)
            pieces.append(np.arange(starts[0], starts[0] + take, dtype=np.int64))
            if take == lengths[0]:
                del starts[0], lengths[0]
            else:
                starts[0] += take
                lengths[0] -= take
            remaining -= take
        return np.concatenate(pieces)

    def free(self, pages: IntArray) -> None:
        runs = Runs.of(pages)
        for first, end in zip(runs.firsts, runs.ends, strict=True):
            self._free_run(first, end)

    def _free_run(self, first: int, end: int) -> None:
        starts, lengths = self._starts, self._lengths
        index = bisect.bisect_left(starts, first)
        merges_left = index > 0 and starts[index - 1] + lengths[index - 1] == first
        merges_right = index < len(starts) and starts[index] == end
        if merges_left and merges_right:
            lengths[index - 1] += end - first + lengths[index]
            del starts[index], lengths[index]
        elif merges_left:
            lengths[index - 1] += end - first
        elif merges_right:
            starts[index] = first
            lengths[index] += end - first
        else:
            starts.insert(index, first)
            lengths.insert(index, end - first)


class NumpyFirstFit:
    """The same free list in numpy arrays: the first-fit scan is one vectorised (C) linear pass."""

    def __init__(self, starts: IntArray, lengths: IntArray) -> None:
        capacity = max(1024, 2 * starts.size)
        self._starts = np.zeros(capacity, dtype=np.int64)
        self._lengths = np.zeros(capacity, dtype=np.int64)
        self._count = int(starts.size)
        self._starts[: self._count] = starts
        self._lengths[: self._count] = lengths

    @property
    def extents(self) -> int:
        return self._count

    def allocate(self, count: int) -> IntArray:
        lengths = self._lengths[: self._count]
        fits = np.flatnonzero(lengths >= count)  # the linear scan under test, in C
        if fits.size:
            return self._take(int(fits[0]), count)
        pieces: list[IntArray] = []
        remaining = count
        while remaining:
            if not self._count:
                raise MemoryError(f"reference pool exhausted with {remaining} pages still wanted")
            take = min(int(self._lengths[0]), remaining)
            pieces.append(self._take(0, take))
            remaining -= take
        return np.concatenate(pieces)

    def _take(self, index: int, count: int) -> IntArray:
        first = int(self._starts[index])
        if int(self._lengths[index]) == count:
            self._delete(index)
        else:
            self._starts[index] += count
            self._lengths[index] -= count
        return np.arange(first, first + count, dtype=np.int64)

    def free(self, pages: IntArray) -> None:
        runs = Runs.of(pages)
        for first, end in zip(runs.firsts, runs.ends, strict=True):
            self._free_run(first, end)

    def _free_run(self, first: int, end: int) -> None:
        count = self._count
        index = int(np.searchsorted(self._starts[:count], first))
        merges_left = index > 0 and int(self._starts[index - 1] + self._lengths[index - 1]) == first
        merges_right = index < count and int(self._starts[index]) == end
        if merges_left and merges_right:
            self._lengths[index - 1] += end - first + self._lengths[index]
            self._delete(index)
        elif merges_left:
            self._lengths[index - 1] += end - first
        elif merges_right:
            self._starts[index] = first
            self._lengths[index] += end - first
        else:
            self._insert(index, first, end - first)

    def _delete(self, index: int) -> None:
        count = self._count
        self._starts[index : count - 1] = self._starts[index + 1 : count]
        self._lengths[index : count - 1] = self._lengths[index + 1 : count]
        self._count = count - 1

    def _insert(self, index: int, first: int, length: int) -> None:
        count = self._count
        if count == self._starts.size:
            self._starts = np.concatenate([self._starts, np.zeros(count, dtype=np.int64)])
            self._lengths = np.concatenate([self._lengths, np.zeros(count, dtype=np.int64)])
        self._starts[index + 1 : count + 1] = self._starts[index:count]
        self._lengths[index + 1 : count + 1] = self._lengths[index:count]
        self._starts[index] = first
        self._lengths[index] = length
        self._count = count + 1


@attrs.frozen(kw_only=True)
class Runs:
    """Runs of consecutive pages: run i is ``firsts[i] .. ends[i] - 1``."""

    firsts: list[int]
    ends: list[int]

    @classmethod
    def of(cls, pages: IntArray) -> Runs:
        """The runs of an ascending page array."""
        breaks = np.flatnonzero(pages[1:] != pages[:-1] + 1) + 1
        return cls(
            firsts=[int(pages[0]), *pages[breaks].tolist()],
            ends=[*(pages[breaks - 1] + 1).tolist(), int(pages[-1]) + 1],
        )


@attrs.frozen(kw_only=True)
class Figures:
    """Per-operation samples of one allocator over the measured sequence (operation i in slot i)."""

    sizes: list[int]  # pages requested by each allocation
    alloc_ns: list[int]
    free_ns: list[int]
    runs: list[int]  # runs of consecutive pages in each allocation

    @property
    def allocations(self) -> int:
        return len(self.alloc_ns)

    @property
    def runs_per_allocation(self) -> float:
        return float(np.mean(self.runs))

    def alloc_us(self, percentile: float) -> float:
        return float(np.percentile(np.asarray(self.alloc_ns, dtype=np.float64), percentile)) / 1000.0

    def free_us(self, percentile: float) -> float:
        return float(np.percentile(np.asarray(self.free_ns, dtype=np.float64), percentile)) / 1000.0

    def first(self, count: int) -> Figures:
        """The samples of the first ``count`` operations (to compare over the same window)."""
        return Figures(
            sizes=self.sizes[:count],
            alloc_ns=self.alloc_ns[:count],
            free_ns=self.free_ns[:count],
            runs=self.runs[:count],
        )

    def of_sizes(self, smallest: int, largest: int) -> Figures:
        """The samples of allocations of ``smallest .. largest`` pages."""
        keep = [i for i, size in enumerate(self.sizes) if smallest <= size <= largest]
        return Figures(
            sizes=[self.sizes[i] for i in keep],
            alloc_ns=[self.alloc_ns[i] for i in keep],
            free_ns=[self.free_ns[i] for i in keep],
            runs=[self.runs[i] for i in keep],
        )


@attrs.frozen(kw_only=True)
class SizeClass:
    smallest: int
    largest: int

    @property
    def label(self) -> str:
        return f"{self.smallest}..{self.largest}"


def _size_classes(max_request: int) -> list[SizeClass]:
    """1..8, 9..64, 65..512, ...: powers of 8, the last one ending at ``max_request``."""
    classes: list[SizeClass] = []
    smallest, bound = 1, 8
    while smallest <= max_request:
        largest = min(bound, max_request)
        classes.append(SizeClass(smallest=smallest, largest=largest))
        smallest, bound = largest + 1, bound * 8
    return classes


def _request_sizes(rng: np.random.Generator, count: int, max_request: int) -> list[int]:
    sizes = np.floor(np.exp(rng.uniform(0.0, np.log(max_request + 1), count))).astype(np.int64)
    clipped: list[int] = np.clip(sizes, 1, max_request).tolist()
    return clipped


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="pdkv bench alloc", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--pages", type=int, default=10_000_000, help="pool size in pages")
    parser.add_argument(
        "--fill",
        type=float,
        default=0.9,
        help="occupancy left after freeing random requests from a full pool",
    )
    parser.add_argument("--max-request", type=int, default=512, help="largest request, pages")
    parser.add_argument("--churn", type=int, default=20_000, help="unmeasured free+allocate steps")
    parser.add_argument("--ops", type=int, default=20_000, help="measured allocations of the pool")
    parser.add_argument(
        "--reference-ops", type=int, default=5_000, help="measured allocations of the Python linear scan"
    )
    parser.add_argument(
        "--numpy-reference-ops", type=int, default=20_000, help="measured allocations of the numpy scan"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny run (for tests)")
    args = parser.parse_args(list(argv))
    if args.quick:
        args.pages, args.churn, args.ops = 100_000, 500, 1_000
        args.reference_ops, args.numpy_reference_ops = 200, 500
    if args.pages < 2 * args.max_request or not 0.0 < args.fill < 1.0 or args.ops < 1:
        parser.error("need --pages >= 2 * --max-request, 0 < --fill < 1 and --ops >= 1")
    reference_ops = max(1, min(args.reference_ops, args.ops))
    numpy_reference_ops = max(1, min(args.numpy_reference_ops, args.ops))

    rng = np.random.default_rng(args.seed)
    setup_started = time.perf_counter()
    pool = PagePool(pages_per_lane=args.pages, tier="host")
    live: list[IntArray] = []
    _fill_completely(pool, live, rng, args.max_request)
    # Free random requests down to the fill level: holes of every size spread over the whole pool.
    victim_order = rng.permutation(len(live)).tolist()
    kept = [True] * len(live)
    used = pool.total_pages
    for index in victim_order:
        if used <= args.fill * pool.total_pages:
            break
        pool.free(live[index])
        used -= live[index].size
        kept[index] = False
    live = [pages for pages, keep in zip(live, kept, strict=True) if keep]
    churn_sizes = _request_sizes(rng, args.churn, args.max_request)
    churn_victims = rng.integers(0, 2**62, args.churn).tolist()
    _run_sequence(pool, live, churn_sizes, churn_victims)
    setup_s = time.perf_counter() - setup_started

    start_stats = pool.statistics()
    extents = pool.free_extents()
    sizes = _request_sizes(rng, args.ops, args.max_request)
    victims = rng.integers(0, 2**62, args.ops).tolist()
    # Each allocator starts from the same free extents and live requests and runs the same steps.
    pool_figures = _run_sequence(pool, list(live), sizes, victims)
    python_figures = _run_sequence(
        PythonFirstFit(extents.starts.tolist(), extents.lengths.tolist()),
        list(live),
        sizes[:reference_ops],
        victims[:reference_ops],
    )
    numpy_figures = _run_sequence(
        NumpyFirstFit(extents.starts, extents.lengths),
        list(live),
        sizes[:numpy_reference_ops],
        victims[:numpy_reference_ops],
    )

    common: dict[str, object] = {
        "bench": "alloc",
        "pages": args.pages,
        "fill": args.fill,
        "request_pages": f"1..{args.max_request} log-uniform",
        "free_extents_at_start": start_stats.extents,
        "free_pages_at_start": start_stats.free_pages,
    }
    emit(
        {
            **common,
            "record": "allocator",
            "impl": "pool",
            "allocations": pool_figures.allocations,
            "median_us": pool_figures.alloc_us(50),
            "p99_us": pool_figures.alloc_us(99),
            "free_median_us": pool_figures.free_us(50),
            "free_p99_us": pool_figures.free_us(99),
            "runs_per_allocation": pool_figures.runs_per_allocation,
            "largest_extent_at_start": start_stats.largest_extent,
            "metadata_bytes_per_page": start_stats.metadata_bytes_per_page,
            "setup_s": setup_s,
        }
    )
    rows: list[list[object]] = [
        _row("pool (extent tree)", "all", pool_figures),
    ]
    for name, figures in (
        ("linear_first_fit_python", python_figures),
        ("linear_first_fit_numpy", numpy_figures),
    ):
        # Compare over the same operations: the pool's first N, where the reference ran N.
        pool_window = pool_figures.first(figures.allocations)
        note = (
            "same operations as the pool"
            if figures.allocations == pool_figures.allocations
            else f"linear scan is slow: ran the first {figures.allocations} of the pool's "
            f"{pool_figures.allocations} operations; ratios use the pool's same first {figures.allocations}"
        )
        emit(
            {
                **common,
                "record": "allocator",
                "impl": name,
                "allocations": figures.allocations,
                "median_us": figures.alloc_us(50),
                "p99_us": figures.alloc_us(99),
                "runs_per_allocation": figures.runs_per_allocation,
                "note": note,
            }
        )
        emit(
            {
                "bench": "alloc",
                "record": "ratio",
                "impl": f"{name}_over_pool",
                "allocations": figures.allocations,
                "pool_median_us": pool_window.alloc_us(50),
                "reference_median_us": figures.alloc_us(50),
                "median_ratio": figures.alloc_us(50) / pool_window.alloc_us(50),
                "pool_p99_us": pool_window.alloc_us(99),
                "reference_p99_us": figures.alloc_us(99),
                "p99_ratio": figures.alloc_us(99) / pool_window.alloc_us(99),
                "pool_runs_per_allocation": pool_window.runs_per_allocation,
                "reference_runs_per_allocation": figures.runs_per_allocation,
            }
        )
        rows.append(_row(name, "all", figures))
        for size_class in _size_classes(args.max_request):
            ours = pool_window.of_sizes(size_class.smallest, size_class.largest)
            theirs = figures.of_sizes(size_class.smallest, size_class.largest)
            if not ours.allocations:
                continue
            emit(
                {
                    "bench": "alloc",
                    "record": "size_class",
                    "impl": f"{name}_vs_pool",
                    "request_pages": size_class.label,
                    "allocations": ours.allocations,
                    "pool_median_us": ours.alloc_us(50),
                    "pool_p99_us": ours.alloc_us(99),
                    "reference_median_us": theirs.alloc_us(50),
                    "reference_p99_us": theirs.alloc_us(99),
                }
            )
            rows.append(_row(f"  pool, same ops as {name}", size_class.label, ours))
            rows.append(_row(f"  {name}", size_class.label, theirs))
    table(
        f"pdkv bench alloc: {args.pages:,} pages, {start_stats.extents:,} free extents at start, "
        f"{start_stats.metadata_bytes_per_page:.2f} metadata bytes/page (pool)",
        ["allocator", "request pages", "allocations", "median us", "p99 us", "runs/alloc"],
        rows,
    )
    return 0


def _row(name: str, sizes: str, figures: Figures) -> list[object]:
    return [
        name,
        sizes,
        figures.allocations,
        figures.alloc_us(50),
        figures.alloc_us(99),
        figures.runs_per_allocation,
    ]


def _fill_completely(
    pool: PagePool, live: list[IntArray], rng: np.random.Generator, max_request: int
) -> None:
    free = pool.free_pages
    while free:
        for size in _request_sizes(rng, 1024, max_request):
            size = min(size, free)
            live.append(pool.allocate(size))
            free -= size
            if not free:
                break


def _run_sequence(
    allocator: PagePool | PythonFirstFit | NumpyFirstFit,
    live: list[IntArray],
    sizes: list[int],
    victims: list[int],
) -> Figures:
    """Free a live request (``victim`` mod the live count), allocate ``size``; time both."""
    alloc_ns: list[int] = []
    free_ns: list[int] = []
    runs: list[int] = []
    clock = time.perf_counter_ns
    for size, victim in zip(sizes, victims, strict=True):
        index = victim % len(live)
        began = clock()
        allocator.free(live[index])
        free_ns.append(clock() - began)
        live[index] = live[-1]
        live.pop()
        began = clock()
        pages = allocator.allocate(size)
        alloc_ns.append(clock() - began)
        runs.append(1 + int(np.count_nonzero(np.diff(np.sort(pages)) != 1)))
        live.append(pages)
    return Figures(sizes=list(sizes), alloc_ns=alloc_ns, free_ns=free_ns, runs=runs)
