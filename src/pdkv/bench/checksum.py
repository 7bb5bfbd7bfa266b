"""Checksum kernel: per-(buffer, page) checksums of one request on a device (CPU or CUDA), against a
gather copy.

The request of issue 15 by default: ``--layers`` 61 MLA layers (one buffer each) of ``--pages`` 128
pages of 64 tokens x 1,152 B (576 MB), ``--run-fraction`` of the pages in runs, the rest scattered
in a pool of ``--pool-pages`` pages per layer. Each round times, on ``--device``:

- checksum: ``pdkv.runtime.checksum.Checksummer.many`` over every layer's buffer, as a prefill rank
  computes a chunk's checksums (and a decode rank verifies them: the same kernel on its pages), from
  views built on the registered addresses (``BufferViews``: on CUDA, ``__cuda_array_interface__``);
- gather: ``index_select`` of the same pages into a preallocated buffer: the memory traffic floor
  of reading scattered pages once (checksum / gather is the kernel's own cost over that floor).

``--mha``: K and V buffers per layer (``--kv-heads`` heads of ``--head-bytes``), read as the head
slice a prefill rank of TP 2 sends to a decode rank of TP 1 (half of each item, one row per token).
On CUDA the device is synchronised around each timed call, and the checksums are compared with the
CPU kernel's on a copy of the same pages (``matches_cpu``). ``--link-gbps``: what the checksums of
both sides would add to a send at those link speeds, if not overlapped with it (the estimate of
the GPU cost for a deployment: run it where a GPU is, e.g. ``--device cuda --link-gbps 25,50``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt
import torch

from pdkv.bench._report import emit, table
from pdkv.config import cli_fraction, cli_int
from pdkv.mapping import AttentionKind, BufferKind, BufferLayout, HeadGeometry, ModelRole
from pdkv.runtime.checksum import WHOLE, BufferViews, Checksummer, Region


def place(pages: int, pool: int, run_fraction: float, rng: np.random.Generator) -> np.ndarray:
    """Pool pages for ``pages`` positions: ``run_fraction`` of them in runs of 2..16, the rest single,
    the segments in a random order with random gaps in a pool of ``pool`` pages."""
    in_runs = round(pages * run_fraction)
    lengths: list[int] = []
    while sum(lengths) < in_runs:
        lengths.append(min(int(rng.integers(2, 17)), in_runs - sum(lengths)))
    lengths += [1] * (pages - sum(lengths))
    order = rng.permutation(len(lengths))
    gaps = rng.multinomial(pool - pages, np.full(len(lengths), 1.0 / len(lengths)))
    starts = np.empty(len(lengths), dtype=np.int64)
    at = 0
    for k, segment in enumerate(order):  # a loop over segments (setup, not timed)
        at += int(gaps[k])
        starts[segment] = at
        at += lengths[segment]
    return np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)]).astype(
        np.int64
    )


def _timed(run: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":  # pragma: no cover - needs a GPU
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    run()
    if device.type == "cuda":  # pragma: no cover - needs a GPU
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="pdkv bench checksum", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    parser.add_argument("--layers", type=cli_int(1), default=61)
    parser.add_argument("--pages", type=cli_int(1), default=128)
    parser.add_argument("--page-size", type=cli_int(1), default=64)
    parser.add_argument("--bytes-per-token", type=cli_int(1), default=1152)
    parser.add_argument(
        "--pool-pages", type=cli_int(1), default=None, help="pages per layer (default 4 x --pages)"
    )
    parser.add_argument("--run-fraction", type=cli_fraction, default=0.7)
    parser.add_argument("--repeats", type=cli_int(1), default=5)
    parser.add_argument(
        "--mha", action="store_true", help="K and V per layer, read as a TP 2 -> 1 head slice"
    )
    parser.add_argument("--kv-heads", type=cli_int(2), default=8)
    parser.add_argument("--head-bytes", type=cli_int(4), default=256)
    parser.add_argument("--link-gbps", default="1.2,25,50", help="link speeds (GB/s) for the estimate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick", action="store_true", help="tiny run for tests: 3 layers, 8 pages, 2 rounds"
    )
    args = parser.parse_args(list(argv))
    if args.quick:
        args.layers, args.pages, args.repeats = 3, 8, 2
    try:
        device = torch.device(args.device)
    except (RuntimeError, TypeError) as exc:
        parser.error(f"--device {args.device!r}: {exc}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch has no CUDA here")
    links = [float(x) for x in args.link_gbps.split(",") if x.strip()]
    pool = max(args.pool_pages or 2 * args.pages, args.pages)
    rng = np.random.default_rng(args.seed)
    pages = place(args.pages, pool, args.run_fraction, rng)
    kinds = [BufferKind.K, BufferKind.V] if args.mha else [BufferKind.KV]
    if args.mha:
        item = args.page_size * args.kv_heads * args.head_bytes
        heads = HeadGeometry(
            kv_heads=args.kv_heads, head_start=0, head_count=args.kv_heads, head_bytes=args.head_bytes
        )
    else:
        item = args.page_size * args.bytes_per_token
        heads = None
    print(
        f"filling {args.layers} layers x {len(kinds)} buffer(s) x {pool} pages of {item} B on {device} ...",
        file=sys.stderr,
        flush=True,
    )
    tensors = []
    for layer in range(args.layers):
        for kind in kinds:
            generator = torch.Generator(device=device).manual_seed(args.seed * 1000 + layer)
            t = torch.randint(0, 256, (pool, item), dtype=torch.uint8, device=device, generator=generator)
            tensors.append((kind, ModelRole.TARGET, layer, t, item))
    layout = BufferLayout.from_tensors(
        attention=AttentionKind.MHA if args.mha else AttentionKind.MLA,
        page_size=args.page_size,
        tensors=tensors,
        heads=None if heads is None else {ModelRole.TARGET: heads},
    )
    summer = Checksummer(
        BufferViews(layout, str(device))
    )  # the registered addresses, as a transport reads them
    region = WHOLE
    if args.mha:
        region = Region.of_heads(
            layout.buffers[0], args.page_size, 0, args.kv_heads // 2
        )  # a TP 2 rank's heads
    pairs = [(i, region) for i in range(len(layout.buffers))]
    positions = np.arange(pages.size, dtype=np.int64)
    nbytes = int(pages.size) * item * len(pairs)
    read_bytes = nbytes // 2 if args.mha else nbytes
    index = torch.tensor(pages, device=device)
    scratch = torch.empty((pages.size, item), dtype=torch.uint8, device=device)
    views = [summer.views[i] for i, _ in pairs]

    def checksum() -> npt.NDArray[np.uint32]:
        return summer.many(pairs, pages, positions)

    def gather() -> None:
        for view in views:
            if item % 8 == 0:
                torch.index_select(view.view(torch.int64), 0, index, out=scratch.view(torch.int64))
            else:
                torch.index_select(view, 0, index, out=scratch)

    sums = checksum()  # warm-up (and the views, weights and scratch tiles)
    gather()
    matches_cpu: bool | None = None
    if device.type == "cuda":  # pragma: no cover - needs a GPU
        cpu_tensors = [(k, m, lay, t[index].cpu(), b) for k, m, lay, t, b in tensors]
        cpu_layout = BufferLayout.from_tensors(
            attention=layout.attention,
            page_size=args.page_size,
            tensors=cpu_tensors,
            heads=None if heads is None else {ModelRole.TARGET: heads},
        )
        cpu_summer = Checksummer(BufferViews(cpu_layout))
        cpu_sums = cpu_summer.many([(i, region) for i in range(len(pairs))], np.arange(pages.size), positions)
        matches_cpu = bool(np.array_equal(cpu_sums, sums))
    checksum_s: list[float] = []
    gather_s: list[float] = []
    for _ in range(args.repeats):
        checksum_s.append(_timed(checksum, device))
        gather_s.append(_timed(gather, device))
    c_med, g_med = statistics.median(checksum_s), statistics.median(gather_s)
    over_send = {f"{gbps:g}": 2 * c_med / (nbytes / (gbps * 1e9)) for gbps in links}
    record: dict[str, object] = {
        "bench": "checksum",
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "layout": "mha head slice" if args.mha else "mla",
        "buffers": len(pairs),
        "pages": int(pages.size),
        "item_bytes": item,
        "bytes": nbytes,
        "bytes_read_for_checksum": read_bytes,
        "checksums": int(sums.size),
        "seconds": {
            "checksum": {"median": c_med, "min": min(checksum_s)},
            "gather": {"median": g_med, "min": min(gather_s)},
        },
        "checksum_gbps": read_bytes / c_med / 1e9,
        "gather_gbps": nbytes / g_med / 1e9,
        "checksum_vs_gather": c_med / g_med,
        "matches_cpu": matches_cpu,
        "both_sides_over_send": over_send,
    }
    emit(record)
    table(
        f"pdkv bench checksum on {device}: {len(pairs)} buffers x {pages.size} pages of {item} B "
        f"({nbytes / 1e6:.0f} MB), {args.repeats} rounds (ms, median)",
        ["method", "ms p50", "ms min", "GB/s"],
        [
            ["checksum", c_med * 1e3, min(checksum_s) * 1e3, read_bytes / c_med / 1e9],
            ["gather", g_med * 1e3, min(gather_s) * 1e3, nbytes / g_med / 1e9],
        ],
    )
    estimate = ", ".join(f"{gbps} GB/s: +{100 * share:.1f}%" for gbps, share in over_send.items())
    print(f"both sides' checksums over a send of these bytes (not overlapped): {estimate}", file=sys.stderr)
    if matches_cpu is not None:
        print(f"device checksums equal the CPU kernel's: {matches_cpu}", file=sys.stderr)
    return 0 if matches_cpu is not False else 1
