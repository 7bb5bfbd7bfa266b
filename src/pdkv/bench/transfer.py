"""A 32K-token MLA request across two processes over Mooncake or NIXL: executor vs raw engine vs one batch.

The request: ``--tokens`` tokens in pages of ``--page-size``, ``--layers`` layers of
``--bytes-per-token`` bytes per token (DeepSeek-style MLA latent: 576 bf16 values = 1,152 B). Each
side holds it in one pool region (layer after layer); the pages are placed so that
``--run-fraction`` of them lie in runs contiguous on both sides and the rest are single pages
scattered. Four ways to move it, round-robin for ``--repeats`` rounds (best round reported):

- executor: ``TransferExecutor`` with its defaults, given one block per maximal run of every layer;
- raw: the engine (the backend, no executor) moving the same number of bytes in its best shape,
  i.e. each layer as one contiguous range, sliced and batched by the best of a few shapes;
- same runs: the engine moving the executor's blocks (the runs) in their best shape, found by the
  same sweep with 2,048 entries per batch tried too: the most any of those batchings of these
  blocks gets from the engine, so executor / same runs is the executor's own cost, and
  same runs / raw what the engine charges for scattered entries;
- plain: one block per maximal run, all layers in a single batch (what a simple integration does;
  the engine's TCP queue is raised so that it stays one engine batch);
- raw agent (``--backend nixl`` only): a NIXL agent of its own, no pdkv code in the path, moving the
  executor's blocks as one WRITE and polling it without sleeping: executor / raw agent is what pdkv
  costs over NIXL itself.

``--checksum``: a fifth method, ``executor+checksum``: what the executor does with
``PDKV_KV_CHECKSUM``: this process computes a checksum per (layer, page) of the source pages
(``pdkv.runtime.checksum``, as a prefill rank does before it submits), the executor moves the runs,
then the peer process computes the same checksums over its pages (as a decode rank does before it
reports Success) and they are compared; the summary gives what that adds to the executor's time.

The destination is zeroed before and checked (SHA-1 against an image built here) after every
timed run. Memory: the request is tokens x layers x bytes-per-token per side (2.3 GB at the
defaults), freed when the benchmark ends.

``--mha --tp P --decode-tp D``: an MHA/GQA request (``--kv-heads`` KV heads of ``--head-bytes``
bytes per token, K and V per layer, token-major page items as SGLang's pool) between prefill TP
rank 0 and decode TP rank 0 of a prefill TP P / decode TP D pair of instances: the blocks are
``kv_blocks``' head slices (one per token when the ranks hold different heads, so the entry count
grows by the page size). Methods on those same blocks:

- executor: ``TransferExecutor`` with its defaults (what pdkv's prefill transport does);
- raw: the same blocks straight to the engine, pre-shaped by the best of a few shapes;
- contiguous: the same number of bytes as one contiguous range per buffer, best shape (what the
  bytes cost without head slicing), timed before the sliced methods: after a stream of small
  entries Mooncake TCP here moved even large blocks far slower for a while.

The decode image to check is built here from the head ranges alone (numpy slicing of
``[page][token][head][byte]`` views), independently of ``kv_blocks``.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import numpy.typing as npt
import torch

from pdkv.bench._report import emit, table
from pdkv.bench.engine import Shape, add_engine_options, backend_of, endpoints, human_size, nixl_config
from pdkv.engine import BackendKind, BatchHandle, TransferBackend
from pdkv.engine.nixl import RawNixlWriter
from pdkv.mapping import (
    AttentionKind,
    BufferKind,
    BufferLayout,
    BufferSpec,
    HeadGeometry,
    ModelRole,
    Topology,
    TopologyError,
    TransferBlocks,
    coalesce,
    kv_blocks,
    rank_heads,
    shape_batches,
)
from pdkv.mapping.landing import LandingPlan, plan_landing, plan_scatter
from pdkv.mapping.staging import staged_entries
from pdkv.runtime.checksum import WHOLE, BufferViews, Checksummer
from pdkv.runtime.executor import ExecutorConfig, TransferExecutor
from pdkv.runtime.staging import LandingRegions, StagingConfig, StagingPool
from pdkv.testing.backend_conformance import HostBuffer, MetadataSyncedPeer, PeerMemory

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


def write_shaped(sender: TransferBackend, peer: str, batches: list[TransferBlocks], in_flight: int) -> None:
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
    parser.add_argument("--tokens", type=int, default=None, help="default 32,768 (--mha: 8,192)")
    parser.add_argument("--layers", type=int, default=None, help="default 61 (--mha: 16)")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--bytes-per-token", type=int, default=1152, help="MLA latent bytes per token")
    parser.add_argument("--run-fraction", type=float, default=0.7)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (best is reported)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny run: 4,096 tokens, 4 layers, 1 round")
    parser.add_argument(
        "--checksum",
        action="store_true",
        help="also time the executor with PDKV_KV_CHECKSUM's work on both sides (executor+checksum)",
    )
    parser.add_argument("--mha", action="store_true", help="MHA/GQA K and V split by heads over TP")
    parser.add_argument("--tp", type=int, default=1, help="--mha: prefill TP size (default 1)")
    parser.add_argument("--decode-tp", type=int, default=1, help="--mha: decode TP size (default 1)")
    parser.add_argument("--kv-heads", type=int, default=8, help="--mha: the model's KV heads (default 8)")
    parser.add_argument(
        "--head-bytes", type=int, default=256, help="--mha: bytes per KV head per token (default 256)"
    )
    parser.add_argument(
        "--direct-rounds",
        type=int,
        default=1,
        help="--mha: timed rounds of the unstaged head slices, after the others (slow; default 1, 0: none)",
    )
    args = parser.parse_args(list(argv))
    if args.tokens is None:
        args.tokens = 8192 if args.mha else 32768
    if args.layers is None:
        args.layers = 16 if args.mha else 61
    if args.quick:
        args.tokens, args.layers, args.repeats = 4096, 4, 1
        args.direct_rounds = min(args.direct_rounds, 1)
    if args.tokens % args.page_size:
        parser.error("--tokens must be a multiple of --page-size")
    if args.mha:
        try:
            topology = Topology(
                prefill_tp=args.tp,
                decode_tp=args.decode_tp,
                attention=AttentionKind.MHA,
                kv_heads=args.kv_heads,
            )
        except TopologyError as exc:
            parser.error(str(exc))
        return mha_main(args, topology)
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

    nixl = backend_of(args) is BackendKind.NIXL
    best: dict[str, float] = {}
    verified = True
    with endpoints(args, tcp_queue=PLAIN_TCP_QUEUE) as (sender, peer), sender.register(source):
        region = peer.allocate(total)
        runs = run_blocks(request, source.data_ptr(), region.address)
        executor = TransferExecutor(sender, ExecutorConfig.from_env())
        layers_contiguous = TransferBlocks(
            src=source.data_ptr() + np.arange(request.layers) * request.layer_bytes,
            dst=region.address + np.arange(request.layers) * request.layer_bytes,
            length=np.full(request.layers, request.layer_bytes),
            buffer=np.arange(request.layers),
        )
        raw_shape = pick_raw_shape(sender, peer, layers_contiguous, quick=args.quick)
        # Many scattered entries: the executor's 2,048 entries per batch are among the shapes tried.
        runs_shape = pick_raw_shape(sender, peer, runs, quick=args.quick, entries=(512, 2048))

        def run_executor() -> None:
            result = executor.transfer(peer.session_id, runs)
            if not result.ok:
                raise RuntimeError(f"executor transfer failed: {result.reason}")

        def run_raw() -> None:
            write_shaped(
                sender, peer.session_id, shaped(layers_contiguous, raw_shape), raw_shape.max_in_flight
            )

        def run_same_runs() -> None:
            write_shaped(sender, peer.session_id, shaped(runs, runs_shape), runs_shape.max_in_flight)

        def run_plain() -> None:
            sender.write(peer.session_id, runs)

        # --checksum: both sides' checksums per (layer, page), by position, around the executor's write.
        src_layers = [
            (source.data_ptr() + i * request.layer_bytes, request.layer_bytes) for i in range(args.layers)
        ]
        dst_layers = tuple(
            (region.address + i * request.layer_bytes, request.layer_bytes) for i in range(args.layers)
        )
        summer = Checksummer(BufferViews(_pool_layout(src_layers, request.page_bytes)))
        positions = np.arange(pages, dtype=np.int64)
        every_layer = [(i, WHOLE) for i in range(args.layers)]
        mismatched: list[int] = []

        def run_executor_checksum() -> None:
            sent = summer.many(every_layer, request.src_pages, positions)
            run_executor()
            got = peer.checksums(dst_layers, request.page_bytes, request.dst_pages, positions)
            mismatched.append(int((got != sent).sum()))

        methods = [
            Method("executor", run_executor, permuted_digest),
            Method("raw", run_raw, identity_digest),
            Method("same runs", run_same_runs, permuted_digest),
            Method("plain", run_plain, permuted_digest),
        ]
        if args.checksum:
            methods.insert(1, Method("executor+checksum", run_executor_checksum, permuted_digest))
            summer.many(every_layer, request.src_pages, positions)  # warm-up: views, scratch, weights
            peer.checksums(dst_layers, request.page_bytes, request.dst_pages, positions)
        raw_agent: RawNixlWriter | None = None
        if nixl and isinstance(peer, MetadataSyncedPeer):
            # The raw NIXL agent (no pdkv code) moving the executor's very blocks as one WRITE.
            raw_agent = RawNixlWriter(nixl_config(args), [(source.data_ptr(), total)])
            agent_peer = raw_agent.connect(peer.engine_metadata())
            raw_agent.write(agent_peer, runs)  # warm-up: connection, first touch

            def run_raw_agent() -> None:
                assert raw_agent is not None
                raw_agent.write(agent_peer, runs)

            methods.append(Method("raw agent", run_raw_agent, permuted_digest))
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
        if raw_agent is not None:
            raw_agent.close()
    verified &= not any(mismatched)  # executor+checksum: the peer's checksums equal the sender's
    del source  # 2.3 GB at the defaults: give it back before printing
    gbps = {name: total / seconds / 1e9 for name, seconds in best.items()}
    defaults = ExecutorConfig.from_env()
    engine = f"NIXL (UCX_TLS={args.ucx_tls})" if nixl else f"Mooncake {args.protocol}"
    table(
        f"pdkv bench transfer over {engine}: {args.tokens} tokens x {args.layers} layers = "
        f"{total / 1e9:.2f} GB, {len(runs)} run blocks, best of {args.repeats}",
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
            [
                "same runs",
                f"the executor's blocks, slice {human_size(runs_shape.slice_bytes)}, "
                f"{runs_shape.max_entries}/batch, {runs_shape.max_in_flight} in flight",
                best["same runs"],
                gbps["same runs"],
            ],
            ["plain", f"{len(runs)} runs in one batch", best["plain"], gbps["plain"]],
            *(
                [
                    [
                        "executor+checksum",
                        "the executor, with both sides' checksums",
                        best["executor+checksum"],
                        gbps["executor+checksum"],
                    ]
                ]
                if args.checksum
                else []
            ),
        ]
        + (
            [
                [
                    "raw agent",
                    f"NIXL alone: the {len(runs)} runs as one WRITE",
                    best["raw agent"],
                    gbps["raw agent"],
                ]
            ]
            if "raw agent" in best
            else []
        ),
    )
    emit(
        {
            "bench": "transfer",
            "kind": "summary",
            "backend": "nixl" if nixl else "mooncake",
            "ucx_tls": args.ucx_tls if nixl else None,
            "tokens": args.tokens,
            "layers": args.layers,
            "bytes": total,
            "run_blocks": len(runs),
            "seconds": best,
            "gb_per_s": gbps,
            "raw_shape": raw_shape.describe(),
            "same_runs_shape": runs_shape.describe(),
            "executor_vs_raw": best["raw"] / best["executor"],
            "executor_vs_same_runs": best["same runs"] / best["executor"],
            "same_runs_vs_raw": best["raw"] / best["same runs"],
            "executor_vs_plain": best["plain"] / best["executor"],
            **(
                {
                    "checksum_adds": best["executor+checksum"] / best["executor"] - 1.0,
                    "checksum_mismatches": sum(mismatched),
                }
                if args.checksum
                else {}
            ),
            "executor_vs_raw_agent": best["raw agent"] / best["executor"] if "raw agent" in best else None,
            "verified": verified,
        }
    )
    if args.checksum:
        print(
            f"pdkv bench transfer: PDKV_KV_CHECKSUM adds "
            f"{100 * (best['executor+checksum'] / best['executor'] - 1):+.1f}% to the executor's "
            f"{best['executor']:.3f} s (both sides' checksums, best rounds)",
            file=sys.stderr,
            flush=True,
        )
    if "raw agent" in best:
        print(
            f"pdkv bench transfer: executor {best['raw agent'] / best['executor']:.2f}x the raw NIXL agent "
            "moving the same blocks",
            file=sys.stderr,
            flush=True,
        )
    print(
        f"pdkv bench transfer: executor {best['raw'] / best['executor']:.2f}x the raw best shape "
        f"(contiguous layers) and "
        f"{best['same runs'] / best['executor']:.2f}x the engine's best shape for the same runs, which "
        f"itself is {best['raw'] / best['same runs']:.2f}x the contiguous layers",
        file=sys.stderr,
        flush=True,
    )
    return 0 if verified else 1


def _pool_layout(layers: Sequence[tuple[int, int]], page_bytes: int) -> BufferLayout:
    """The layer regions of one pool as a layout of one KV buffer per layer (for checksums)."""
    return BufferLayout.build(
        attention=AttentionKind.MLA,
        page_size=1,
        buffers=[
            BufferSpec(
                kind=BufferKind.KV,
                model=ModelRole.TARGET,
                layer_id=i,
                base_ptr=a,
                length=n,
                item_bytes=page_bytes,
            )
            for i, (a, n) in enumerate(layers)
        ],
    )


def shaped(blocks: TransferBlocks, shape: Shape) -> list[TransferBlocks]:
    return shape_batches(
        blocks,
        max_entries=shape.max_entries,
        slice_bytes=shape.slice_bytes,
        max_batch_bytes=shape.slice_bytes * shape.max_entries,
    )


def pick_raw_shape(
    sender: TransferBackend,
    peer: PeerMemory,
    blocks: TransferBlocks,
    *,
    quick: bool,
    entries: Sequence[int] = (512,),
) -> Shape:
    """The fastest of a few shapes around the engine sweep's winners (one untimed warm-up first);
    ``entries``: the entries per batch tried with each slice size and batches in flight."""
    candidates = [Shape(s, e, k) for s in (256 << 10, 1 << 20, 4 << 20) for e in entries for k in (1, 4)]
    if quick:
        candidates = candidates[:2]
    write_shaped(sender, peer.session_id, shaped(blocks, candidates[0]), 1)
    timings = []
    for shape in candidates:
        started = time.perf_counter()
        write_shaped(sender, peer.session_id, shaped(blocks, shape), shape.max_in_flight)
        timings.append((time.perf_counter() - started, shape))
    return min(timings, key=lambda pair: pair[0])[1]


# ---------------------------------------------------------------- MHA/GQA across unequal TP


@attrs.frozen
class HeadRequest:
    """One MHA request between prefill TP rank 0 and decode TP rank 0: K then V buffers per layer."""

    page_size: int
    layers: int
    pages: int
    src: HeadGeometry
    dst: HeadGeometry
    src_pages: IntArray
    dst_pages: IntArray

    @property
    def buffers(self) -> list[tuple[BufferKind, int]]:
        """Canonical layout order (and memory order here): every K layer, then every V layer."""
        return [(kind, layer) for kind in (BufferKind.K, BufferKind.V) for layer in range(self.layers)]

    def item_bytes(self, heads: HeadGeometry) -> int:
        return heads.item_bytes(self.page_size)

    def region_bytes(self, heads: HeadGeometry) -> int:
        return len(self.buffers) * self.pages * self.item_bytes(heads)

    def layout(self, heads: HeadGeometry, base: int) -> BufferLayout:
        item = self.item_bytes(heads)
        return BufferLayout.build(
            attention=AttentionKind.MHA,
            page_size=self.page_size,
            buffers=[
                BufferSpec(
                    kind=kind,
                    model=ModelRole.TARGET,
                    layer_id=layer,
                    base_ptr=base + i * self.pages * item,
                    length=self.pages * item,
                    item_bytes=item,
                    heads=heads,
                )
                for i, (kind, layer) in enumerate(self.buffers)
            ],
        )


def expected_head_digest(request: HeadRequest, source: HostBuffer) -> str:
    """SHA-1 of the decode region after the request landed, from the two head ranges alone.

    Every buffer is viewed as ``[page][token][head][byte]`` on both sides; the heads both ranks hold
    go from the prefill page at each position to the decode page at that position.
    """
    src, dst = request.src, request.dst
    lo, hi = max(src.head_start, dst.head_start), min(src.head_stop, dst.head_stop)
    shape_src = (request.pages, request.page_size, src.head_count, src.head_bytes)
    shape_dst = (request.pages, request.page_size, dst.head_count, dst.head_bytes)
    src_bytes = request.pages * request.item_bytes(src)
    digest = hashlib.sha1()
    for i in range(len(request.buffers)):
        pages = source.array[i * src_bytes : (i + 1) * src_bytes].reshape(shape_src)
        image = np.zeros(shape_dst, dtype=np.uint8)
        image[request.dst_pages, :, lo - dst.head_start : hi - dst.head_start, :] = pages[
            request.src_pages, :, lo - src.head_start : hi - src.head_start, :
        ]
        digest.update(image.data)
    return digest.hexdigest()


def runs_digest(
    source: HostBuffer, *, buffers: int, pages: int, item: int, request: HeadRequest, region_bytes: int
) -> str:
    """SHA-1 of a decode region of ``region_bytes`` after whole ``item``-byte pages moved, buffer after
    buffer, from the prefill page at each position to the decode page at that position (the rest 0)."""
    image = np.zeros(region_bytes, dtype=np.uint8)
    for i in range(buffers):
        pages_here = source.array[i * pages * item : (i + 1) * pages * item].reshape(pages, item)
        there = image[i * pages * item : (i + 1) * pages * item].reshape(pages, item)
        there[request.dst_pages] = pages_here[request.src_pages]
    return hashlib.sha1(image.data).hexdigest()


def mha_main(args: argparse.Namespace, topology: Topology) -> int:
    """``--mha``: the head-sliced blocks of one real (prefill, decode) pair, staged and direct, against
    the homogeneous path moving the same bytes as whole pages and against one contiguous range."""
    if topology.kv_heads is None:  # Topology(attention=MHA, kv_heads=...) was built by main
        raise AssertionError("an MHA bench topology needs kv_heads")
    rng = np.random.default_rng(args.seed)
    pages = args.tokens // args.page_size
    src_pages, dst_pages = place_pages(pages, args.run_fraction, rng)
    src_heads = rank_heads(
        kv_heads=topology.kv_heads, tp_size=topology.prefill_tp, tp_rank=0, head_bytes=args.head_bytes
    )
    dst_heads = rank_heads(
        kv_heads=topology.kv_heads, tp_size=topology.decode_tp, tp_rank=0, head_bytes=args.head_bytes
    )
    request = HeadRequest(
        page_size=args.page_size,
        layers=args.layers,
        pages=pages,
        src=src_heads,
        dst=dst_heads,
        src_pages=src_pages,
        dst_pages=dst_pages,
    )
    lo = max(src_heads.head_start, dst_heads.head_start)
    shared_heads = min(src_heads.head_stop, dst_heads.head_stop) - lo
    buffers = len(request.buffers)
    moved = buffers * pages * args.page_size * shared_heads * args.head_bytes
    # The homogeneous path: equal TP, both ranks holding exactly the shared heads, so every page item is
    # the slice and pages move as runs (what the same bytes cost when no head is sliced).
    same_heads = HeadGeometry(
        kv_heads=topology.kv_heads, head_start=lo, head_count=shared_heads, head_bytes=args.head_bytes
    )
    homogeneous_item = request.item_bytes(same_heads)
    source = HostBuffer(request.region_bytes(src_heads))
    words = source.array.view(np.uint64)  # every 8-byte word holds its own index: misplacement shows
    words[:] = np.arange(words.size, dtype=np.uint64)
    expected = expected_head_digest(request, source)
    dst_total = request.region_bytes(dst_heads)
    expected_homogeneous = runs_digest(
        source, buffers=buffers, pages=pages, item=homogeneous_item, request=request, region_bytes=dst_total
    )

    best: dict[str, float] = {}
    verified = True
    src_tensor = torch.from_numpy(source.array)  # the pool's sources: views of the one prefill region
    src_item = request.item_bytes(src_heads)
    with endpoints(args, tcp_queue=PLAIN_TCP_QUEUE) as (sender, peer), sender.register(source):
        region = peer.allocate(dst_total)
        src_layout = request.layout(src_heads, source.data_ptr())
        dst_layout = request.layout(dst_heads, region.address)
        blocks = kv_blocks(coalesce(src_pages, dst_pages), src_layout, dst_layout)
        if int(blocks.length.sum()) != moved:
            raise AssertionError(f"kv_blocks move {int(blocks.length.sum())} bytes, the heads say {moved}")
        homogeneous = kv_blocks(
            coalesce(src_pages, dst_pages),
            request.layout(same_heads, source.data_ptr()),
            request.layout(same_heads, region.address),
        )
        contiguous = TransferBlocks(
            src=source.data_ptr() + np.arange(buffers) * (moved // buffers),
            dst=region.address + np.arange(buffers) * (moved // buffers),
            length=np.full(buffers, moved // buffers),
            buffer=np.arange(buffers),
        )
        staging_config = StagingConfig.from_env()
        sources = [src_tensor[i * pages * src_item : (i + 1) * pages * src_item] for i in range(buffers)]
        with StagingPool(sender, src_layout, sources, staging_config) as pool:
            executor = TransferExecutor(sender, ExecutorConfig.from_env())
            staged_executor = TransferExecutor(sender, ExecutorConfig.from_env(), staging=pool)
            # The contiguous reference goes first: after a stream of small entries, Mooncake TCP here
            # moved even large blocks tens of times slower for a while (measured), which would make the
            # reference look as slow as the sliced methods; the direct (unstaged) method goes last.
            contiguous_shape = pick_raw_shape(sender, peer, contiguous, quick=args.quick)

            def transfer_with(chosen: TransferExecutor, moving: TransferBlocks) -> Callable[[], None]:
                def run() -> None:
                    result = chosen.transfer(peer.session_id, moving)
                    if not result.ok:
                        raise RuntimeError(f"executor transfer failed: {result.reason}")

                return run

            def run_contiguous() -> None:
                write_shaped(
                    sender,
                    peer.session_id,
                    shaped(contiguous, contiguous_shape),
                    contiguous_shape.max_in_flight,
                )

            def timed(method: Method) -> bool:
                peer.fill(region.address, region.length, 0)
                started = time.perf_counter()
                method.run()
                seconds = time.perf_counter() - started
                landed = not method.expected or peer.digest(region.address, region.length) == method.expected
                best[method.name] = min(best.get(method.name, seconds), seconds)
                emit(
                    {
                        "bench": "transfer",
                        "kind": "run",
                        "mha": True,
                        "method": method.name,
                        "bytes": moved,
                        "seconds": seconds,
                        "gb_per_s": moved / seconds / 1e9,
                        "verified": landed if method.expected else None,
                    }
                )
                return landed

            reference = Method("contiguous", run_contiguous, "")  # other bytes: timed, not checked
            rounds = [Method("homogeneous", transfer_with(executor, homogeneous), expected_homogeneous)]
            # The pool's own rule (StagingPool.plan): staging must save min_gain times the entries. With
            # decode TP below prefill TP nothing merges, the pool would send the slices as they are (the
            # direct method), and timing that here would also slow the methods after it (see above).
            worth_staging = staged_entries(blocks) * staging_config.min_gain <= len(blocks)
            if worth_staging:
                rounds.append(Method("staged", transfer_with(staged_executor, blocks), expected))
            for _ in range(args.repeats):
                timed(reference)
                for method in rounds:
                    verified &= timed(method)
            if topology.decode_tp < topology.prefill_tp:
                verified &= landing_methods(
                    args, request, source, peer, executor, dst_layout, src_layout, expected, best
                )
            for _ in range(args.direct_rounds):
                verified &= timed(Method("direct", transfer_with(executor, blocks), expected))
            stats = pool.statistics()
    del source
    gbps = {name: moved / seconds / 1e9 for name, seconds in best.items()}
    defaults = ExecutorConfig.from_env()
    sizes = np.unique(blocks.length)
    shape = (
        f"slice {human_size(defaults.slice_bytes)}, {defaults.max_entries}/batch, "
        f"{defaults.max_in_flight} in flight"
    )
    staged_rows = (
        [
            [
                "staged",
                f"{len(blocks):,} blocks gathered into {stats.staged_pieces // max(1, stats.staged_writes)} "
                f"pieces of <= {human_size(staging_config.piece_bytes)}, then {shape}",
                best["staged"],
                gbps["staged"],
            ]
        ]
        if "staged" in best
        else []
    )
    landing_rows = []
    if "landing" in best:
        best["landing path"] = best["landing"] + best["scatter"]
        gbps["landing path"] = moved / best["landing path"] / 1e9
        gbps["scatter"] = moved / best["scatter"] / 1e9
        landing_rows = [
            [
                "landing (engine)",
                f"executor, whole prefill pages into the decode's landing zone, {shape}",
                best["landing"],
                moved / best["landing"] / 1e9,
            ],
            [
                "scatter (decode copy)",
                "landing zone -> decode pages, one index_copy_ per buffer (timed here, on a copy)",
                best["scatter"],
                gbps["scatter"],
            ],
            [
                "landing path",
                "engine, then scatter (a room runs them in sequence)",
                best["landing path"],
                gbps["landing path"],
            ],
        ]
    table(
        f"pdkv bench transfer --mha: prefill tp{topology.prefill_tp} rank 0 -> decode tp{topology.decode_tp} "
        f"rank 0, {topology.kv_heads} KV heads x {args.head_bytes} B, {args.tokens} tokens x {args.layers} "
        f"layers x K,V = {moved / 1e6:.1f} MB in {len(blocks):,} head-slice blocks "
        f"({human_size(int(sizes.min()))}..{human_size(int(sizes.max()))}), best of {args.repeats}",
        ["method", "shape", "seconds", "GB/s"],
        [
            [
                "contiguous (same bytes)",
                f"one range per buffer, slice {human_size(contiguous_shape.slice_bytes)}, "
                f"{contiguous_shape.max_entries}/batch, {contiguous_shape.max_in_flight} in flight",
                best["contiguous"],
                gbps["contiguous"],
            ],
            [
                "homogeneous (same bytes)",
                f"executor, whole pages: {len(homogeneous):,} run blocks, {shape}",
                best["homogeneous"],
                gbps["homogeneous"],
            ],
            *staged_rows,
            *landing_rows,
            *(
                [["direct", f"executor, the head slices unstaged, {shape}", best["direct"], gbps["direct"]]]
                if "direct" in best
                else []
            ),
        ],
    )
    ratios = {}
    if "staged" in best:
        ratios["staged_vs_homogeneous"] = best["homogeneous"] / best["staged"]
        ratios["staged_vs_contiguous"] = best["contiguous"] / best["staged"]
    if "landing path" in best:
        ratios["landing_path_vs_homogeneous"] = best["homogeneous"] / best["landing path"]
    if "direct" in best:
        ratios["direct_vs_homogeneous"] = best["homogeneous"] / best["direct"]
    emit(
        {
            "bench": "transfer",
            "kind": "summary",
            "mha": True,
            "prefill_tp": topology.prefill_tp,
            "decode_tp": topology.decode_tp,
            "kv_heads": topology.kv_heads,
            "tokens": args.tokens,
            "layers": args.layers,
            "bytes": moved,
            "blocks": len(blocks),
            "homogeneous_blocks": len(homogeneous),
            "seconds": best,
            "gb_per_s": gbps,
            "contiguous_shape": contiguous_shape.describe(),
            "staging": attrs.asdict(stats),
            "staging_config": attrs.asdict(staging_config),
            **ratios,
            "verified": verified,
        }
    )
    said = []
    if "staged" in best:
        said.append(
            f"staged {ratios['staged_vs_homogeneous']:.2f}x the homogeneous path (same bytes as whole pages) "
            f"and {ratios['staged_vs_contiguous']:.2f}x one contiguous range per buffer, gather "
            f"{stats.gather_seconds / max(1, stats.staged_writes):.3f} s per transfer"
        )
    else:
        said.append("not staged (the destination is strided: staging would merge nothing)")
    if "landing_path_vs_homogeneous" in ratios:
        said.append(
            f"landing path {ratios['landing_path_vs_homogeneous']:.2f}x the homogeneous path "
            "(engine, then scatter)"
        )
    if "direct" in best:
        said.append(f"direct (unstaged) {ratios['direct_vs_homogeneous']:.3f}x")
    print(f"pdkv bench transfer --mha: {'; '.join(said)}", file=sys.stderr, flush=True)
    return 0 if verified else 1


def landing_image(request: HeadRequest, source: HostBuffer, lease: LandingPlan) -> npt.NDArray[np.uint8]:
    """The landing lease after prefill rank 0 wrote every position: slot ``q`` of each K/V buffer holds
    the prefill page of position ``q``, whole (built from the request's page lists alone)."""
    image = np.zeros(lease.total_bytes, dtype=np.uint8)
    item = request.item_bytes(request.src)
    for i in range(len(request.buffers)):
        pages = source.array[i * request.pages * item : (i + 1) * request.pages * item].reshape(-1, item)
        at = int(lease.offset[0]) + i * request.pages * item
        image[at : at + request.pages * item] = pages[request.src_pages].reshape(-1)
    return image


def landing_methods(
    args: argparse.Namespace,
    request: HeadRequest,
    source: HostBuffer,
    peer: PeerMemory,
    executor: TransferExecutor,
    dst_layout: BufferLayout,
    src_layout: BufferLayout,
    expected: str,
    best: dict[str, float],
) -> bool:
    """Decode TP below prefill TP: the landing-zone path in the two halves a room runs one after the
    other (``pdkv.runtime.landing``): the engine writing prefill rank 0's whole pages into decode rank
    0's landing zone, then the decode's scatter of them into its pages (the kernel ``LandingPool``
    runs after the room's last Success), timed here on a copy of the decode memory (the peer is
    another process). Both verified; returns whether both were."""
    topology = Topology(
        prefill_tp=args.tp, decode_tp=args.decode_tp, attention=AttentionKind.MHA, kv_heads=args.kv_heads
    )
    positions = np.arange(request.pages, dtype=np.int64)

    def lease_at(base: int, layout: BufferLayout) -> LandingPlan:
        return plan_landing(layout, topology, 0, first_position=0, slots=request.pages, base=base)

    size = lease_at(0, dst_layout).total_bytes
    region = peer.allocate(size)
    lease = lease_at(region.address, dst_layout)
    writes = kv_blocks(coalesce(request.src_pages, positions), src_layout, lease.region_of(0))
    image = landing_image(request, source, lease)
    landed_digest = hashlib.sha1(image.data).hexdigest()
    ok = True
    for _ in range(args.repeats):
        peer.fill(region.address, region.length, 0)
        started = time.perf_counter()
        result = executor.transfer(peer.session_id, writes)
        seconds = time.perf_counter() - started
        ok &= result.ok and peer.digest(region.address, region.length) == landed_digest
        best["landing"] = min(best.get("landing", seconds), seconds)
    # The decode's half, on a local copy: its pages and a landing tensor holding what the engine wrote.
    decode = HostBuffer(request.region_bytes(request.dst))
    local_layout = request.layout(request.dst, decode.data_ptr())
    memory = torch.from_numpy(decode.array)
    item = request.item_bytes(request.dst)
    tensors: list[torch.Tensor | None] = [
        memory[i * request.pages * item : (i + 1) * request.pages * item] for i in range(len(request.buffers))
    ]
    targets = LandingRegions(local_layout, tensors)
    landing = torch.from_numpy(image.copy())
    local_lease = lease_at(landing.data_ptr(), local_layout)
    plan = plan_scatter(
        local_lease,
        0,
        local_layout,
        positions=positions,
        dst_pages=request.dst_pages,
        regions=targets.sources,
    )
    for _ in range(args.repeats):
        decode.array[:] = 0
        started = time.perf_counter()
        targets.scatter(plan, landing)
        seconds = time.perf_counter() - started
        ok &= hashlib.sha1(decode.array.data).hexdigest() == expected
        best["scatter"] = min(best.get("scatter", seconds), seconds)
    emit({"bench": "transfer", "kind": "landing", "groups": len(plan), "landing_bytes": size, "verified": ok})
    return ok
