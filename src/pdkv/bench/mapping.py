"""Mapping: one CP rank's full map of a 128K-token request (ownership -> batches), numpy vs a plain loop.

Owns: the mapping benchmark only. Measures the vectorised path of ``pdkv.mapping`` (``map_chunk``:
ownership, positions, destination pages; ``coalesce``; ``layer_blocks``; ``shape_batches``) against a
plain-Python reference loop doing the same steps, checks that both produce identical batches, and
prints both times and their ratio. Never asserts speed; exits 1 only if the two paths disagree.

The request is laid out as an allocator would leave it: the prefill's logical pages and the decode's
destination pages are runs of ``--run-pages`` consecutive pages at shuffled places (seeded).
Buffer pairing between the two layouts is registration-time work: the vectorised path's warm-up
call computes it and later calls reuse it, as a running transport does.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

import numpy as np

from pdkv.bench._report import emit, table
from pdkv.mapping import (
    AttentionKind,
    BlockCyclic,
    BufferKind,
    BufferLayout,
    BufferSpec,
    ModelRole,
    OwnershipPolicy,
    PageInterleaved,
    TransferBlocks,
    coalesce,
    layer_blocks,
    map_chunk,
    shape_batches,
)
from pdkv.mapping.blocks import IntArray

Entry = tuple[int, int, int, int]  # (src address, dst address, length, buffer) in the reference path


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdkv bench mapping", description=__doc__)
    parser.add_argument("--tokens", type=int, default=131_072, help="request length in tokens")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--cp", type=int, default=8, help="prefill CP size (shared KV)")
    parser.add_argument("--rank", type=int, default=0, help="the CP rank whose map is measured")
    parser.add_argument("--layers", type=int, default=61, help="MLA layers (one KV buffer each)")
    parser.add_argument("--bytes-per-token", type=int, default=1_152, help="KV bytes per token per layer")
    parser.add_argument("--policy", choices=["interleaved", "block"], default="interleaved")
    parser.add_argument("--block-pages", type=int, default=16, help="block size of --policy block")
    parser.add_argument("--run-pages", type=int, default=32, help="allocation run length on both sides")
    parser.add_argument("--max-entries", type=int, default=2_048)
    parser.add_argument("--slice-bytes", type=int, default=256 * 1024)
    parser.add_argument("--max-batch-bytes", type=int, default=64 * 1024 * 1024)
    parser.add_argument("--repeat", type=int, default=5, help="timed runs of each path (best is kept)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny run (8K tokens, 4 layers, 2 repeats)")
    args = parser.parse_args(list(argv))
    if args.quick:
        args.tokens, args.layers, args.repeat = 8_192, 4, 2
    return args


def _allocation(num_pages: int, run_pages: int, rng: np.random.Generator, *, base: int) -> IntArray:
    """``num_pages`` page ids made of ``run_pages``-long consecutive runs in shuffled order."""
    runs = -(-num_pages // run_pages)
    order = rng.permutation(runs).astype(np.int64)
    pages = (order[:, None] * run_pages + np.arange(run_pages, dtype=np.int64)[None, :]).ravel()
    return pages[:num_pages] + base


def _layout(*, layers: int, item_bytes: int, items: int, base: int, page_size: int) -> BufferLayout:
    stride = items * item_bytes
    specs = [
        BufferSpec(
            kind=BufferKind.KV,
            model=ModelRole.TARGET,
            layer_id=layer,
            base_ptr=base + layer * stride,
            length=stride,
            item_bytes=item_bytes,
        )
        for layer in range(layers)
    ]
    return BufferLayout.build(attention=AttentionKind.MLA, page_size=page_size, buffers=specs)


# ---------------------------------------------------------------- the two paths


def vectorised_map(
    logical: IntArray,
    dst_pages: IntArray,
    *,
    args: argparse.Namespace,
    policy: OwnershipPolicy,
    local: BufferLayout,
    peer: BufferLayout,
    stage_seconds: dict[str, float],
) -> list[TransferBlocks]:
    t0 = time.perf_counter()
    mapped = map_chunk(
        logical,
        start_token=0,
        page_size=args.page_size,
        dst_pages=dst_pages,
        cp_rank=args.rank,
        policy=policy,
    )
    t1 = time.perf_counter()
    runs = coalesce(mapped.src, mapped.dst)
    t2 = time.perf_counter()
    blocks = layer_blocks(runs, local, peer)
    t3 = time.perf_counter()
    batches = shape_batches(
        blocks,
        max_entries=args.max_entries,
        slice_bytes=args.slice_bytes,
        max_batch_bytes=args.max_batch_bytes,
    )
    t4 = time.perf_counter()
    for stage, seconds in (
        ("ownership", t1 - t0),
        ("coalesce", t2 - t1),
        ("blocks", t3 - t2),
        ("shaping", t4 - t3),
    ):
        stage_seconds[stage] = min(stage_seconds.get(stage, seconds), seconds)
    return batches


def _owner_and_physical(page: int, policy: OwnershipPolicy) -> tuple[int, int]:
    if isinstance(policy, BlockCyclic):
        block = page // policy.block_pages
        return block % policy.cp_size, (
            block // policy.cp_size
        ) * policy.block_pages + page % policy.block_pages
    return page % policy.cp_size, page // policy.cp_size


def reference_map(
    logical: list[int],
    dst_pages: list[int],
    *,
    args: argparse.Namespace,
    policy: OwnershipPolicy,
    local: BufferLayout,
    peer: BufferLayout,
) -> list[list[Entry]]:
    """The same map as a plain loop over pages, runs, buffers and slices."""
    src: list[int] = []
    dst: list[int] = []
    for index, page in enumerate(logical):
        owner, physical = _owner_and_physical(page, policy)
        if owner == args.rank:
            src.append(physical)
            dst.append(dst_pages[index])  # position = index (the chunk starts at token 0)
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    entries: list[Entry] = []
    for index, (here, there) in enumerate(zip(local.buffers, peer.buffers, strict=True)):
        item = here.item_bytes
        for s, d, n in runs:
            start_src, start_dst, length = here.base_ptr + s * item, there.base_ptr + d * item, n * item
            offset = 0
            while offset < length:
                piece = min(args.slice_bytes, length - offset)
                entries.append((start_src + offset, start_dst + offset, piece, index))
                offset += piece
    batches: list[list[Entry]] = []
    current: list[Entry] = []
    current_bytes = 0
    for entry in entries:
        if current and (len(current) == args.max_entries or current_bytes + entry[2] > args.max_batch_bytes):
            batches.append(current)
            current, current_bytes = [], 0
        current.append(entry)
        current_bytes += entry[2]
    if current:
        batches.append(current)
    return batches


def _as_entries(batches: list[TransferBlocks]) -> list[list[Entry]]:
    return [
        list(zip(b.src.tolist(), b.dst.tolist(), b.length.tolist(), b.buffer.tolist(), strict=True))
        for b in batches
    ]


def _best_of(repeat: int, run: Callable[[], object]) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = run()
        best = min(best, time.perf_counter() - start)
    return best, result


def main(argv: Sequence[str]) -> int:
    args = _parse(argv)
    rng = np.random.default_rng(args.seed)
    num_pages = -(-args.tokens // args.page_size)
    item_bytes = args.page_size * args.bytes_per_token
    policy: OwnershipPolicy = (
        PageInterleaved(cp_size=args.cp)
        if args.policy == "interleaved"
        else BlockCyclic(cp_size=args.cp, block_pages=args.block_pages)
    )
    logical = _allocation(num_pages, args.run_pages, rng, base=4 * args.cp * args.run_pages)
    dst_pages = _allocation(num_pages, args.run_pages, rng, base=3 * args.run_pages)
    src_items = int(policy.physical(logical).max()) + 1
    local = _layout(
        layers=args.layers,
        item_bytes=item_bytes,
        items=src_items,
        base=0x7F00_0000_0000,
        page_size=args.page_size,
    )
    peer = _layout(
        layers=args.layers,
        item_bytes=item_bytes,
        items=int(dst_pages.max()) + 1,
        base=0x7E00_0000_0000,
        page_size=args.page_size,
    )
    logical_list, dst_list = logical.tolist(), dst_pages.tolist()
    stages: dict[str, float] = {}

    def run_vectorised() -> list[TransferBlocks]:
        return vectorised_map(
            logical, dst_pages, args=args, policy=policy, local=local, peer=peer, stage_seconds=stages
        )

    def run_reference() -> list[list[Entry]]:
        return reference_map(logical_list, dst_list, args=args, policy=policy, local=local, peer=peer)

    warm = run_vectorised()  # computes the buffer pairing once, as registration would
    stages.clear()
    vectorised_s, vectorised = _best_of(args.repeat, run_vectorised)
    reference_s, reference = _best_of(args.repeat, run_reference)
    assert isinstance(vectorised, list) and isinstance(reference, list)
    identical = _as_entries(vectorised) == reference and _as_entries(warm) == reference
    merged = TransferBlocks.concat(vectorised)
    owned = int(np.count_nonzero(policy.owner(logical) == args.rank))
    record: dict[str, object] = {
        "bench": "mapping",
        "tokens": args.tokens,
        "page_size": args.page_size,
        "cp": args.cp,
        "rank": args.rank,
        "policy": args.policy,
        "layers": args.layers,
        "item_bytes": item_bytes,
        "pages_owned": owned,
        "runs": len(coalesce(*_owned_pairs(logical, dst_pages, args, policy))),
        "blocks": len(merged),
        "batches": len(vectorised),
        "bytes": merged.total_bytes,
        "repeat": args.repeat,
        "vectorised_s": vectorised_s,
        "reference_s": reference_s,
        "speedup": reference_s / vectorised_s,
        "identical": identical,
        **{f"stage_{name}_s": seconds for name, seconds in stages.items()},
    }
    emit(record)
    table(
        f"pdkv bench mapping: {args.tokens} tokens, page {args.page_size}, CP {args.cp} rank {args.rank}, "
        f"{args.layers} layers x {item_bytes} B/page ({args.policy})",
        ["path", "seconds", "blocks", "batches", "identical"],
        [
            ["vectorised", vectorised_s, len(merged), len(vectorised), identical],
            ["python loop", reference_s, sum(len(b) for b in reference), len(reference), identical],
            ["ratio", reference_s / vectorised_s, "", "", ""],
        ],
    )
    return 0 if identical else 1


def _owned_pairs(
    logical: IntArray, dst_pages: IntArray, args: argparse.Namespace, policy: OwnershipPolicy
) -> tuple[IntArray, IntArray]:
    mapped = map_chunk(
        logical,
        start_token=0,
        page_size=args.page_size,
        dst_pages=dst_pages,
        cp_rank=args.rank,
        policy=policy,
    )
    return mapped.src, mapped.dst
