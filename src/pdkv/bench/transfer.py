"""A 32K-token MLA request across two processes over Mooncake: executor vs raw engine vs one batch of runs.

The request: ``--tokens`` tokens in pages of ``--page-size``, ``--layers`` layers of
``--bytes-per-token`` bytes per token (DeepSeek-style MLA latent: 576 bf16 values = 1,152 B). Each
side holds it in one pool region (layer after layer); the pages are placed so that
``--run-fraction`` of them lie in runs contiguous on both sides and the rest are single pages
scattered. Three ways to move it, round-robin for ``--repeats`` rounds (best round reported):

- executor: ``TransferExecutor`` with its defaults, given one block per maximal run of every layer;
- raw: the engine (the backend, no executor) moving the same number of bytes in its best shape,
  i.e. each layer as one contiguous range, sliced and batched by the best of a few shapes;
- plain: one block per maximal run, all layers in a single batch (what a simple integration does;
  the engine's TCP queue is raised so that it stays one engine batch).

The destination is zeroed before and checked (SHA-1 against an image built here) after every
timed run. Memory: the request is tokens x layers x bytes-per-token per side (2.3 GB at the
defaults), freed when the benchmark ends.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import numpy.typing as npt

from pdkv.bench._report import emit, table
from pdkv.bench.engine import Shape, add_engine_options, engine_config, human_size, mooncake_endpoints
from pdkv.engine import BatchHandle, MooncakeBackend
from pdkv.mapping import TransferBlocks, shape_batches
from pdkv.runtime.executor import ExecutorConfig, TransferExecutor
from pdkv.testing.backend_conformance import HostBuffer, SpawnedPeer

IntArray = npt.NDArray[np.int64]

# The plain method sends every run of every layer as one engine batch; the default TCP lane queue
# (2,048 entries) would refuse it, so the benchmark raises the queue (verified accepted: 16,384).
PLAIN_TCP_QUEUE = 16384


@attrs.frozen
class Request:
    layers: int
    pages: int
    page_bytes: int
    src_pages: IntArray  # by position: the page in the prefill pool
    dst_pages: IntArray  # by position: the page in the decode pool

    @property
    def layer_bytes(self) -> int:
        return self.pages * self.page_bytes

    @property
    def total_bytes(self) -> int:
        return self.layers * self.layer_bytes


def place_pages(pages: int, run_fraction: float, rng: np.random.Generator) -> tuple[IntArray, IntArray]:
    """Pool pages for each position: ``run_fraction`` of positions in runs of 2..32, the rest single.

    Segments (runs and singles) are laid out in an independent random order on each side, so a
    run is contiguous on both sides and singles are scattered.
    """
    in_runs = round(pages * run_fraction)
    lengths: list[int] = []
    while sum(lengths) < in_runs:
        lengths.append(min(int(rng.integers(2, 33)), in_runs - sum(lengths)))
    lengths += [1] * (pages - in_runs)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    segment_lengths = np.asarray(lengths, dtype=np.int64)

    def layout(order: IntArray) -> IntArray:
        pool_start = np.empty(len(lengths), dtype=np.int64)
        pool_start[order] = np.concatenate([[0], np.cumsum(segment_lengths[order])[:-1]])
        segment_of = np.repeat(np.arange(len(lengths)), segment_lengths)
        return pool_start[segment_of] + (np.arange(pages) - starts[segment_of])

    return layout(rng.permutation(len(lengths))), layout(rng.permutation(len(lengths)))


def run_blocks(request: Request, src_base: int, dst_base: int) -> TransferBlocks:
    """One block per maximal run contiguous on both sides, for every layer (layer-major)."""
    src, dst = request.src_pages, request.dst_pages
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate([[0], breaks]).astype(np.int64)
    lengths = np.diff(np.concatenate([starts, [src.size]])) * request.page_bytes
    layer_offsets = np.arange(request.layers, dtype=np.int64)[:, None] * request.layer_bytes
    return TransferBlocks(
        src=(src_base + layer_offsets + src[starts] * request.page_bytes).ravel(),
        dst=(dst_base + layer_offsets + dst[starts] * request.page_bytes).ravel(),
        length=np.tile(lengths, request.layers),
        buffer=np.repeat(np.arange(request.layers), starts.size),
    )


def expected_digest(request: Request, source: HostBuffer) -> str:
    """SHA-1 of the decode pool after the request landed (built layer by layer with numpy)."""
    digest = hashlib.sha1()
    for layer in range(request.layers):
        pages = source.array[layer * request.layer_bytes : (layer + 1) * request.layer_bytes]
        image = np.empty((request.pages, request.page_bytes), dtype=np.uint8)
        image[request.dst_pages] = pages.reshape(request.pages, request.page_bytes)[request.src_pages]
        digest.update(image.data)
    return digest.hexdigest()


def write_shaped(sender: MooncakeBackend, peer: str, batches: list[TransferBlocks], in_flight: int) -> None:
    """The raw path: pre-shaped batches straight to the backend, ``in_flight`` at a time."""
    outstanding: list[BatchHandle] = []
    for batch in batches:
        if len(outstanding) == in_flight:
            sender.wait(outstanding[:1]).raise_for_status()
            outstanding.pop(0)
        outstanding.append(sender.submit_write(peer, batch))
    sender.wait(outstanding).raise_for_status()


@attrs.frozen
class Method:
    name: str
    run: Callable[[], None]
    expected: str


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="pdkv bench transfer", description=__doc__.splitlines()[0])
    add_engine_options(parser)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--bytes-per-token", type=int, default=1152)
    parser.add_argument("--run-fraction", type=float, default=0.7)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (best is reported)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny run: 4,096 tokens, 4 layers, 1 round")
    args = parser.parse_args(list(argv))
    if args.quick:
        args.tokens, args.layers, args.repeats = 4096, 4, 1
    if args.tokens % args.page_size:
        parser.error("--tokens must be a multiple of --page-size")
    rng = np.random.default_rng(args.seed)
    pages = args.tokens // args.page_size
    src_pages, dst_pages = place_pages(pages, args.run_fraction, rng)
    request = Request(args.layers, pages, args.page_size * args.bytes_per_token, src_pages, dst_pages)
    total = request.total_bytes

    source = HostBuffer(total)
    words = source.array.view(np.uint64)  # every 8-byte word holds its own index: misplacement shows
    step = request.layer_bytes // 8
    for layer in range(request.layers):
        words[layer * step : (layer + 1) * step] = np.arange(
            layer * step, (layer + 1) * step, dtype=np.uint64
        )
    permuted_digest = expected_digest(request, source)
    identity_digest = hashlib.sha1(source.array.data).hexdigest()

    config = engine_config(args, tcp_queue=PLAIN_TCP_QUEUE)
    best: dict[str, float] = {}
    verified = True
    with mooncake_endpoints(config) as (sender, peer), sender.register(source):
        region = peer.allocate(total)
        runs = run_blocks(request, source.data_ptr(), region.address)
        executor = TransferExecutor(sender, ExecutorConfig())
        layers_contiguous = TransferBlocks(
            src=source.data_ptr() + np.arange(request.layers) * request.layer_bytes,
            dst=region.address + np.arange(request.layers) * request.layer_bytes,
            length=np.full(request.layers, request.layer_bytes),
            buffer=np.arange(request.layers),
        )
        raw_shape = pick_raw_shape(sender, peer, layers_contiguous, quick=args.quick)

        def run_executor() -> None:
            result = executor.transfer(peer.session_id, runs)
            if not result.ok:
                raise RuntimeError(f"executor transfer failed: {result.reason}")

        def run_raw() -> None:
            write_shaped(
                sender, peer.session_id, shaped(layers_contiguous, raw_shape), raw_shape.max_in_flight
            )

        def run_plain() -> None:
            sender.write(peer.session_id, runs)

        methods = [
            Method("executor", run_executor, permuted_digest),
            Method("raw", run_raw, identity_digest),
            Method("plain", run_plain, permuted_digest),
        ]
        for _ in range(args.repeats):
            for method in methods:
                peer.fill(region.address, region.length, 0)
                started = time.perf_counter()
                method.run()
                seconds = time.perf_counter() - started
                landed = peer.digest(region.address, region.length) == method.expected
                verified &= landed
                best[method.name] = min(best.get(method.name, seconds), seconds)
                emit(
                    {
                        "bench": "transfer",
                        "kind": "run",
                        "method": method.name,
                        "bytes": total,
                        "seconds": seconds,
                        "gb_per_s": total / seconds / 1e9,
                        "verified": landed,
                    }
                )
    del source  # 2.3 GB at the defaults: give it back before printing
    gbps = {name: total / seconds / 1e9 for name, seconds in best.items()}
    defaults = ExecutorConfig()
    table(
        f"pdkv bench transfer: {args.tokens} tokens x {args.layers} layers = {total / 1e9:.2f} GB, "
        f"{len(runs)} run blocks, best of {args.repeats}",
        ["method", "shape", "seconds", "GB/s"],
        [
            [
                "executor",
                f"slice {human_size(defaults.slice_bytes)}, {defaults.max_entries}/batch, "
                f"{defaults.max_in_flight} in flight",
                best["executor"],
                gbps["executor"],
            ],
            [
                "raw",
                f"contiguous, slice {human_size(raw_shape.slice_bytes)}, {raw_shape.max_entries}/batch, "
                f"{raw_shape.max_in_flight} in flight",
                best["raw"],
                gbps["raw"],
            ],
            ["plain", f"{len(runs)} runs in one batch", best["plain"], gbps["plain"]],
        ],
    )
    emit(
        {
            "bench": "transfer",
            "kind": "summary",
            "tokens": args.tokens,
            "layers": args.layers,
            "bytes": total,
            "run_blocks": len(runs),
            "seconds": best,
            "gb_per_s": gbps,
            "raw_shape": raw_shape.describe(),
            "executor_vs_raw": best["raw"] / best["executor"],
            "executor_vs_plain": best["plain"] / best["executor"],
            "verified": verified,
        }
    )
    return 0 if verified else 1


def shaped(blocks: TransferBlocks, shape: Shape) -> list[TransferBlocks]:
    return shape_batches(
        blocks,
        max_entries=shape.max_entries,
        slice_bytes=shape.slice_bytes,
        max_batch_bytes=shape.slice_bytes * shape.max_entries,
    )


def pick_raw_shape(
    sender: MooncakeBackend, peer: SpawnedPeer, blocks: TransferBlocks, *, quick: bool
) -> Shape:
    """The fastest of a few shapes around the engine sweep's winners (one untimed warm-up first)."""
    candidates = [Shape(s, 512, k) for s in (256 << 10, 1 << 20, 4 << 20) for k in (1, 4)]
    if quick:
        candidates = candidates[:2]
    write_shaped(sender, peer.session_id, shaped(blocks, candidates[0]), 1)
    timings = []
    for shape in candidates:
        started = time.perf_counter()
        write_shaped(sender, peer.session_id, shaped(blocks, shape), shape.max_in_flight)
        timings.append((time.perf_counter() - started, shape))
    return min(timings, key=lambda pair: pair[0])[1]
