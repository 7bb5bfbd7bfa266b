"""Per-layer vs monolithic: time from the end of the prefill forward to decode Success, same request.

Real rooms through ``pdkv.testing.cluster`` (a prefill rank and a decode rank in their own processes,
Mooncake TCP on 127.0.0.1): an MLA request of ``--tokens`` tokens, 61 layers, page size 64, 1,152 bytes
per token per layer (73,728 bytes per page per layer), sent as one chunk after a simulated forward
(``simulate_forward``: a sleep per layer, then ``on_layer_end``). The per-layer compute time is, unless
``--layer-ms`` fixes it, the measured monolithic transfer time divided by the layers, so compute and
transfer take about the same time per layer, the case per-layer transfer is for.

Per size, rooms run one at a time: a calibration room (monolithic, no forward), then ``--repeats``
monolithic and ``--repeats`` per-layer rooms with the forward; the best of each is reported. The time
is the decode rank's clock at Success minus the prefill rank's clock at the end of the forward (one
monotonic clock for every process of the machine). Every room is verified byte for byte.

``--decode-tp 2`` runs the fan-out case (decode TP above prefill TP): every layer goes to each decode
rank on its own submission lane, against the monolithic path writing the chunk to each in turn.

``--mha --tp P --decode-tp D`` (``--kv-heads``, ``--head-bytes``): an MHA/GQA model whose K and V heads
are split over TP, each prefill rank writing its heads to the decode ranks that hold them; with D above
P every layer goes to several decode ranks as head slices, gathered through each prefill rank's
staging pool (``--no-staging``: one engine entry per token slice). With
``PDKV_PER_LAYER_FAN_OUT_MIN_BYTES=1`` every size goes per layer, which is how the fan-out rule
(``PerLayerConfig.fan_out_min_layer_bytes``) is measured.

The default sizes (1,024 and 8,192 tokens) take about half a minute here; ``--tokens
1024,8192,32768`` adds the 2.3 GB request (about 80 s more, mostly filling and verifying memory).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from pdkv.bench._report import emit, table
from pdkv.mapping import AttentionKind, Topology, TopologyError
from pdkv.protocol.ids import RoomId
from pdkv.protocol.poll import KVPoll
from pdkv.runtime.staging import StagingConfig
from pdkv.testing.cluster import Cluster, ClusterSpec, RequestPlan, RoomOutcome
from pdkv.testing.synthetic import Capacity, ModelSpec

TARGET_RATIO = 0.25  # the goal: per-layer at most a quarter of monolithic


def _tokens(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--tokens takes whole numbers separated by commas: {text!r}"
        ) from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"--tokens needs positive token counts, got {text!r}")
    return values


class _Runner:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.next_room = 1
        self.verified = True

    def tail_seconds(self, tokens: int, *, per_layer: bool, layer_s: float) -> float:
        """One room: seconds from the end of its forward (last prefill rank) to decode Success."""
        room = RoomId(self.next_room)
        self.next_room += 1
        plan = RequestPlan(
            room=room, tokens=tokens, chunk_tokens=(tokens,), per_layer=per_layer, layer_compute_s=layer_s
        )
        outcomes = self.cluster.run([plan], max_active=1)
        decode = [o for o in outcomes if o.side == "decode"]
        prefill = [o for o in outcomes if o.side == "prefill"]
        self.verified &= _verified(decode) and all(o.poll == KVPoll.Success for o in prefill)
        expected = "per_layer" if per_layer else "monolithic"
        if any(o.mode != expected for o in prefill):
            raise RuntimeError(f"room {room} went {[o.mode for o in prefill]}, expected {expected}")
        forward_end = max(o.forward_end_at for o in prefill)
        return max(0.0, max(o.finished_at for o in decode) - forward_end)


def _verified(decode: list[RoomOutcome]) -> bool:
    landed = all(o.poll == KVPoll.Success and not o.mismatches and o.bytes_checked for o in decode)
    return bool(decode) and landed


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="pdkv bench per_layer", description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--tokens", type=_tokens, default=[1024, 8192], help="request sizes (default 1024,8192)"
    )
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--bytes-per-token", type=int, default=1152, help="KV bytes per token per layer")
    parser.add_argument(
        "--layer-ms", type=float, default=None, help="compute per layer (default: transfer/layers)"
    )
    parser.add_argument("--cp", type=int, default=1, help="prefill CP ranks")
    parser.add_argument(
        "--decode-tp",
        type=int,
        default=1,
        help="decode TP ranks (MLA fan-out: every layer goes to each of them; default 1)",
    )
    parser.add_argument("--mha", action="store_true", help="MHA/GQA: K and V split by KV heads over TP")
    parser.add_argument("--tp", type=int, default=1, help="--mha: prefill TP ranks (default 1)")
    parser.add_argument("--kv-heads", type=int, default=8, help="--mha: the model's KV heads (default 8)")
    parser.add_argument(
        "--head-bytes", type=int, default=256, help="--mha: bytes of one KV head of one token (default 256)"
    )
    parser.add_argument(
        "--staging",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--mha: head slices through each prefill rank's staging pool (default; PDKV_STAGING_*)",
    )
    parser.add_argument("--repeats", type=int, default=2, help="rooms per mode and size (best is reported)")
    parser.add_argument("--quick", action="store_true", help="tiny run: 1,024 tokens, 4 layers, 1 repeat")
    args = parser.parse_args(list(argv))
    if args.quick:
        args.tokens, args.layers, args.repeats = [1024], 4, 1
    if args.mha:
        try:
            Topology(
                prefill_tp=args.tp,
                decode_tp=args.decode_tp,
                attention=AttentionKind.MHA,
                kv_heads=args.kv_heads,
            )
        except TopologyError as exc:
            parser.error(str(exc))
    elif args.tp != 1:
        parser.error("--tp needs --mha (MLA prefill TP ranks beyond the first are dummies)")
    model = ModelSpec.kv_only(
        attention=AttentionKind.MHA if args.mha else AttentionKind.MLA,
        layers=args.layers,
        page_size=args.page_size,
        kv_bytes_per_token=args.kv_heads * args.head_bytes if args.mha else args.bytes_per_token,
        kv_heads=args.kv_heads if args.mha else None,
    )
    # Bytes a room moves: MLA writes the whole latent to every decode rank; MHA writes K and V once per
    # decode replica of each head (decode TP above the head count replicates heads).
    copies = max(1, args.decode_tp // args.kv_heads) if args.mha else args.decode_tp
    buffers = 2 if args.mha else 1
    max_pages = -(-max(args.tokens) // args.page_size)
    spec = ClusterSpec(
        model=model,
        prefill_tp=args.tp,
        prefill_cp=args.cp,
        decode_tp=args.decode_tp,
        staging=StagingConfig.from_env() if args.mha and args.staging else None,
        prefill_capacity=Capacity(kv_pages=max_pages // args.cp + 8, state_slots=8, aux_rows=8),
        decode_capacity=Capacity(kv_pages=max_pages + 8, state_slots=8, aux_rows=8),
        state_slots_per_room=0,
    )
    rows = []
    ok = True
    with Cluster(spec) as cluster:
        runner = _Runner(cluster)
        for tokens in args.tokens:
            pages = -(-tokens // args.page_size)
            total = pages * model.kv_item_bytes * args.layers * buffers * copies
            calibration = runner.tail_seconds(tokens, per_layer=False, layer_s=0.0)
            layer_s = args.layer_ms / 1000 if args.layer_ms is not None else calibration / args.layers
            best: dict[bool, float] = {}
            for per_layer in (False, True):
                runs = [
                    runner.tail_seconds(tokens, per_layer=per_layer, layer_s=layer_s)
                    for _ in range(args.repeats)
                ]
                best[per_layer] = min(runs)
            monolithic, layered = best[False], best[True]
            ratio = layered / monolithic if monolithic > 0 else float("inf")
            record = {
                "bench": "per_layer",
                "kind": "size",
                "tokens": tokens,
                "layers": args.layers,
                "attention": model.attention.value,
                "prefill_tp": args.tp,
                "prefill_cp": args.cp,
                "decode_tp": args.decode_tp,
                "staging": spec.staging is not None,
                "bytes": total,
                "layer_compute_ms": layer_s * 1000,
                "forward_s": layer_s * args.layers,
                "calibration_transfer_s": calibration,
                "seconds": {"monolithic": monolithic, "per_layer": layered},
                "per_layer_vs_monolithic": ratio,
                "target_ratio": TARGET_RATIO,
                "repeats": args.repeats,
                "verified": runner.verified,
            }
            ok &= runner.verified
            emit(record)
            ms = [layer_s * 1000, monolithic * 1000, layered * 1000]
            rows.append([tokens, total / 1e9, *ms, ratio, runner.verified])
    staged = ", staged" if spec.staging else ""
    kind = (
        f"mha {args.kv_heads} KV heads x {args.head_bytes} B{staged}, prefill tp{args.tp}"
        if args.mha
        else "mla"
    )
    table(
        f"pdkv bench per_layer: {kind}, {args.layers} layers, {model.kv_item_bytes:,} B per page per layer, "
        f"prefill cp{args.cp}, decode tp{args.decode_tp}, end of forward -> decode Success "
        f"(best of {args.repeats})",
        ["tokens", "GB", "layer ms", "monolithic ms", "per-layer ms", "ratio", "verified"],
        rows,
    )
    return 0 if ok else 1
