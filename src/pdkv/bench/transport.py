"""A large MLA request through the full transports, against the raw engine moving the same bytes.

The ``bench transfer`` request (``--tokens`` tokens, 61 layers, page size 64, 1,152 bytes per token
per layer) runs as real rooms through ``pdkv.testing.cluster``: prefill CP ranks and a decode rank in
their own processes, the registry, TransferRequest, one monolithic chunk per room, the executor,
TransferStatus; the decode side verifies every byte. The time is the decode side's, from
``receiver.init`` to Success. The raw engine reference (two processes, contiguous blocks per layer,
the executor's best shape) moves the same number of bytes in the same invocation.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import numpy as np

from pdkv.bench._report import emit, table
from pdkv.mapping import TransferBlocks
from pdkv.protocol.ids import RoomId
from pdkv.protocol.poll import KVPoll
from pdkv.runtime.executor import ExecutorConfig, TransferExecutor
from pdkv.testing.backend_conformance import HostBuffer, mooncake_pair
from pdkv.testing.cluster import Cluster, ClusterSpec, RequestPlan
from pdkv.testing.synthetic import Capacity, ModelSpec


def raw_engine_seconds(total: int, layers: int, repeats: int) -> float:
    """Best time for the executor to move ``total`` contiguous bytes (a block per layer) across processes."""
    layer_bytes = total // layers
    source = HostBuffer(layer_bytes * layers)
    best = float("inf")
    with mooncake_pair() as pair, pair.sender.register(source):
        region = pair.peer.allocate(layer_bytes * layers)
        blocks = TransferBlocks(
            src=source.data_ptr() + np.arange(layers) * layer_bytes,
            dst=region.address + np.arange(layers) * layer_bytes,
            length=np.full(layers, layer_bytes),
            buffer=np.arange(layers),
        )
        executor = TransferExecutor(pair.sender, ExecutorConfig())
        for _ in range(repeats):
            started = time.perf_counter()
            result = executor.transfer(pair.peer.session_id, blocks)
            best = min(best, time.perf_counter() - started)
            if not result.ok:
                raise RuntimeError(f"raw transfer failed: {result.reason}")
    return best


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="pdkv bench transport", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--bytes-per-token", type=int, default=1152)
    parser.add_argument("--cp", type=int, default=1, help="prefill CP ranks")
    parser.add_argument(
        "--repeats", type=int, default=3, help="rooms run one after another (best is reported)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny run: 2,048 tokens, 4 layers, 1 room")
    args = parser.parse_args(list(argv))
    if args.quick:
        args.tokens, args.layers, args.repeats = 2048, 4, 1
    pages = -(-args.tokens // args.page_size)
    model = ModelSpec.kv_only(
        layers=args.layers,
        page_size=args.page_size,
        kv_bytes_per_token=args.bytes_per_token,
    )
    spec = ClusterSpec(
        model=model,
        prefill_cp=args.cp,
        prefill_capacity=Capacity(kv_pages=pages * args.repeats // args.cp + 8, state_slots=8, aux_rows=8),
        decode_capacity=Capacity(kv_pages=pages + 8, state_slots=8, aux_rows=8),
        state_slots_per_room=0,
    )
    total = pages * model.kv_item_bytes * args.layers
    plans = [
        RequestPlan(room=RoomId(1 + i), tokens=args.tokens, chunk_tokens=(args.tokens,))
        for i in range(args.repeats)
    ]
    with Cluster(spec) as cluster:
        outcomes = cluster.run(plans, max_active=1)
    decode = [o for o in outcomes if o.side == "decode"]
    verified = all(o.poll == KVPoll.Success and not o.mismatches and o.bytes_checked for o in decode)
    transport_s = min(o.seconds for o in decode)
    raw_s = raw_engine_seconds(total, args.layers, args.repeats)
    record = {
        "bench": "transport",
        "kind": "summary",
        "tokens": args.tokens,
        "layers": args.layers,
        "prefill_cp": args.cp,
        "bytes": total,
        "seconds": {"transport": transport_s, "raw": raw_s},
        "gb_per_s": {"transport": total / transport_s / 1e9, "raw": total / raw_s / 1e9},
        "transport_vs_raw": raw_s / transport_s,
        "verified": verified,
    }
    emit(record)
    table(
        f"pdkv bench transport: {args.tokens} tokens x {args.layers} layers = {total / 1e9:.2f} GB, "
        f"prefill cp{args.cp}",
        ["path", "seconds", "GB/s"],
        [
            ["full transports (init -> Success)", transport_s, total / transport_s / 1e9],
            ["raw engine, contiguous", raw_s, total / raw_s / 1e9],
        ],
    )
    return 0 if verified else 1
