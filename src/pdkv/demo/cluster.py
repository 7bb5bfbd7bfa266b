"""``pdkv demo``: prefill CP ranks and a decode rank in real processes over Mooncake TCP or NIXL on loopback.

Owns: the demo workload and its report. It starts a bootstrap registry, ``--cp`` prefill rank
processes (x ``--tp``) and ``--decode-tp`` decode processes (``pdkv.testing.cluster``), runs a
synthetic model (``--layers`` layers of MLA KV, NSA-style index state on every other layer only, a
draft model layer, aux rows) over a workload of requests: chunked prefill, cached prefixes already on
the decode side, and a few rooms aborted by either side (some in the middle of a forward). Each
chunk's forward is simulated (``--layer-ms`` per layer, writing each layer's KV as it ends); by
default every chunk is sent layer by layer while its forward runs (``--no-per-layer``: whole, after
the forward), which ``pdkv bench per_layer`` shows ends the transfer far sooner after the forward.
Every successful room's decode memory is compared byte for byte with the prefill full layout; the
pages of aborted rooms get a canary after their safe release, checked at the end (no late write).
``--mha``: K and V buffers split by KV heads over TP (``--kv-heads``, GQA: fewer heads than ranks
replicate), heads described in the layout, so ``--tp`` and ``--decode-tp`` may differ in either
direction; each decode rank checks its heads against the model's full layout, whichever prefill
ranks wrote them. Head slices move as few large blocks (``--no-staging``: one engine entry each): a
prefill rank gathers them into a staging pool for a decode rank of a higher TP, and a decode rank of a
lower TP leases a landing zone the prefill ranks write whole pages into, and scatters it into its pages
before Success.
``--decode-without-draft-state`` (``--prefill-without-draft-state``): a rolling deployment, where the
prefill ranks register the draft model's NSA-style index state and the decode ranks do not (or the
reverse): under ``--layout-policy degrade_draft`` (the default) every room is served without it and
must say so (``receiver.draft_skipped()``: the ``draft`` column), while its target bytes and draft KV
are checked as ever (and the decode's own draft state, where only it has one, checked untouched);
under ``--layout-policy strict`` the registration is refused, naming both lists.
Shows progress, prints a summary table (``--json``: one JSON object per room plus a summary line),
exits non-zero on any mismatch. The prefill ranks (CP x TP) run rank consensus over a gloo group
(``--no-consensus`` turns it off): one rank's failure fails the room on every rank together.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence

import attrs

from pdkv.config import cli_fraction, cli_int
from pdkv.engine import BackendKind, backend_kind
from pdkv.engine.choice import CHOICES
from pdkv.errors import ConfigError
from pdkv.mapping import DEFAULT_LAYOUT_POLICY, AttentionKind, LayoutPolicy, Topology, TopologyError
from pdkv.protocol.ids import RoomId
from pdkv.protocol.poll import KVPoll
from pdkv.runtime import json_log
from pdkv.runtime.landing import LandingConfig
from pdkv.runtime.staging import StagingConfig
from pdkv.testing.cluster import (
    AbortPlan,
    Cluster,
    ClusterError,
    ClusterSpec,
    RankReport,
    RequestPlan,
    RoomOutcome,
)
from pdkv.testing.synthetic import Capacity, ModelSpec


def build_workload(
    rooms: int, *, page_size: int, max_tokens: int, aborts: float, seed: int, layer_compute_s: float = 0.0
) -> list[RequestPlan]:
    """Random requests: 1-4 chunks, some with a cached prefix, ``aborts`` of them aborted (by the
    decode side, or by the prefill side before a chunk or in the middle of its forward)."""
    rng = random.Random(seed)
    plans = []
    for i in range(rooms):
        tokens = rng.randint(page_size, max_tokens)
        prefix = 0
        if rng.random() < 0.25 and tokens > 4 * page_size:
            prefix = rng.randint(1, tokens // page_size // 2) * page_size
        remaining = tokens - prefix
        n_chunks = min(rng.randint(1, 4), max(1, remaining // page_size))
        cuts = sorted(rng.sample(range(1, remaining // page_size), n_chunks - 1)) if n_chunks > 1 else []
        bounds = [0, *(c * page_size for c in cuts), remaining]
        chunks = tuple(b - a for a, b in itertools.pairwise(bounds))
        abort = None
        if rng.random() < aborts:
            if rng.random() < 0.5:
                abort = AbortPlan(side="decode", after_s=rng.uniform(0.0, 0.01))
            else:
                mid_forward = rng.random() < 0.5
                abort = AbortPlan(
                    side="prefill",
                    after_chunks=rng.randint(0, len(chunks) - 1),
                    after_layers=rng.randint(1, 3) if mid_forward else None,
                )
        plans.append(
            RequestPlan(
                room=RoomId(1000 + i),
                tokens=tokens,
                chunk_tokens=chunks,
                prefix_tokens=prefix,
                abort=abort,
                layer_compute_s=layer_compute_s,
            )
        )
    return plans


@attrs.frozen(kw_only=True)
class Summary:
    rooms: int
    succeeded: int
    failed: int
    planned_aborts: int
    unexpected: int
    bytes_verified: int
    bytes_reported: int
    mismatches: int
    canary_violations: int
    unsafe_releases: int
    worker_errors: int
    seconds: float
    room_p50_ms: float
    room_p99_ms: float
    checksums: bool = False
    """``--checksum``: every decode rank verified its rooms' pages before Success."""
    rooms_verified: int = 0
    decode_successes: int = 0
    checksum_failures: int = 0
    draft_skipped: int = 0
    """Successful rooms served without some draft-model state (a rolling deployment)."""
    draft_unreported: int = 0
    """Successful rooms of a rolling deployment that did not report the draft state they missed."""
    staged_writes: int = 0
    """Prefill writes gathered through a staging pool (decode TP above prefill TP)."""
    rooms_landed: int = 0
    """Decode rooms whose heads landed in a landing pool and were scattered (decode TP below prefill TP)."""
    leased_at_end: int = 0
    """Staging and landing bytes (and rooms waiting for landing) still held when the ranks stopped."""

    @property
    def ok(self) -> bool:
        # With --checksum every decode Success must have been verified first (else the option did nothing).
        unverified = self.checksums and self.rooms_verified != self.decode_successes
        return not (
            self.unexpected
            or self.mismatches
            or self.canary_violations
            or self.worker_errors
            or self.checksum_failures
            or unverified
            or self.draft_unreported
            or self.leased_at_end
        )


def summarize(
    plans: Sequence[RequestPlan],
    outcomes: Sequence[RoomOutcome],
    reports: Sequence[RankReport],
    seconds: float,
    *,
    checksums: bool = False,
    draft_left_out: bool = False,
) -> tuple[Summary, list[dict[str, object]]]:
    """``draft_left_out``: the two sides register different draft state, so every successful room must
    report what it missed (``RoomOutcome.draft_skipped``)."""
    by_room: dict[int, list[RoomOutcome]] = {}
    for outcome in outcomes:
        by_room.setdefault(outcome.room, []).append(outcome)
    rows: list[dict[str, object]] = []
    succeeded = failed = unexpected = skipped = unreported = 0
    latencies: list[float] = []
    for plan in plans:
        got = by_room.get(int(plan.room), [])
        decode = [o for o in got if o.side == "decode"]
        # The room's outcome is the decode ranks' consensus, as a decode scheduler MIN-reduces KVPoll
        # over its TP ranks: one Failed fails the room. With several decode ranks fed by different
        # prefill TP ranks, a prefill-side abort can fail some decode ranks after others already
        # succeeded (their prefill rank had finished); the room is then Failed, as planned.
        consensus = min((KVPoll(o.poll) for o in decode), default=KVPoll.Failed)
        all_ok = bool(decode) and consensus is KVPoll.Success
        planned_abort = plan.abort is not None
        # A planned abort may lose the race against a fast transfer: Success is fine then.
        as_planned = all_ok or (planned_abort and consensus is KVPoll.Failed)
        succeeded += all_ok
        failed += not all_ok
        unexpected += not as_planned
        draft = sorted({o.draft_skipped for o in decode if o.draft_skipped})
        skipped += all_ok and bool(draft)
        unreported += all_ok and draft_left_out and not all(o.draft_skipped for o in decode)
        latencies += [o.seconds for o in decode]
        rows.append(
            {
                "room": int(plan.room),
                "tokens": plan.tokens,
                "chunks": len(plan.chunk_tokens),
                "prefix_tokens": plan.prefix_tokens,
                "abort": None if plan.abort is None else plan.abort.side,
                "outcome": "success" if all_ok else "failed",
                "as_planned": as_planned,
                "bytes_verified": sum(o.bytes_checked for o in decode),
                "mismatches": [m for o in decode for m in o.mismatches],
                "failure": "; ".join(sorted({o.failure for o in got if o.failure})),
                "draft_skipped": "; ".join(draft),
            }
        )
    latencies.sort()
    summary = Summary(
        rooms=len(plans),
        succeeded=succeeded,
        failed=failed,
        planned_aborts=sum(p.abort is not None for p in plans),
        unexpected=unexpected,
        bytes_verified=sum(o.bytes_checked for o in outcomes),
        bytes_reported=sum(o.bytes_reported for o in outcomes if o.side == "decode"),
        mismatches=sum(len(o.mismatches) for o in outcomes),
        canary_violations=sum(r.canary_violations for r in reports),
        unsafe_releases=sum(r.unsafe_releases for r in reports),
        worker_errors=sum(r.worker_errors for r in reports),
        seconds=seconds,
        room_p50_ms=1000 * (statistics.median(latencies) if latencies else 0.0),
        room_p99_ms=1000
        * (latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else 0.0),
        checksums=checksums,
        rooms_verified=sum(r.rooms_verified for r in reports),
        decode_successes=sum(1 for o in outcomes if o.side == "decode" and o.poll == KVPoll.Success),
        checksum_failures=sum(r.checksum_failures for r in reports),
        draft_skipped=skipped,
        draft_unreported=unreported,
        staged_writes=sum(r.staged_writes for r in reports),
        rooms_landed=sum(r.rooms_landed for r in reports),
        leased_at_end=sum(r.staging_leased_at_end + r.landing_leased_at_end for r in reports),
    )
    return summary, rows


class _Progress:
    """Rooms done: a room is done once every decode rank reported it, failed if any rank failed it."""

    def __init__(self, total: int, decode_ranks: int = 1) -> None:
        self.total = total
        self.decode_ranks = decode_ranks
        self.done = 0
        self.failed = 0
        self.tty = sys.stderr.isatty()
        self._last = 0.0
        self._seen: dict[int, list[bool]] = {}

    def __call__(self, outcome: RoomOutcome) -> None:
        if outcome.side != "decode":
            return
        seen = self._seen.setdefault(outcome.room, [])
        seen.append(outcome.poll == KVPoll.Success)
        if len(seen) < self.decode_ranks:
            return
        del self._seen[outcome.room]
        self.done += 1
        self.failed += not all(seen)
        now = time.monotonic()
        if self.tty:
            bar = "#" * (30 * self.done // self.total)
            print(
                f"\r  rooms [{bar:<30}] {self.done}/{self.total} ({self.failed} failed)",
                end="",
                file=sys.stderr,
                flush=True,
            )
        elif now - self._last > 2 or self.done == self.total:
            self._last = now
            print(f"  rooms {self.done}/{self.total} ({self.failed} failed)", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr)


def _kv_description(model: ModelSpec, prefill_tp: int, decode_tp: int) -> str:
    if model.kv_heads is None:
        return f"{model.kv_item_bytes} B per page per layer ({model.attention.value})"
    return (
        f"mha {model.kv_heads} KV heads x {model.head_bytes} B, K and V pages of "
        f"{model.rank_kv_item_bytes(prefill_tp)} B per prefill rank, "
        f"{model.rank_kv_item_bytes(decode_tp)} B per decode rank"
    )


def _heads_path(args: argparse.Namespace) -> str:
    if not args.staging:
        return ", head slices unstaged"
    if args.decode_tp > args.tp:
        return ", head slices staged on the prefill"
    if args.decode_tp < args.tp:
        return ", heads landed and scattered on the decode"
    return ""


def _layout_policy(text: str) -> LayoutPolicy:
    try:
        return LayoutPolicy.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(prog="pdkv demo", description=(__doc__ or "").splitlines()[0])
    positive = cli_int(1)  # every count of the demo: 0 or less is an argument error, never "result OK"
    parser.add_argument("--cp", type=positive, default=2, help="prefill context-parallel ranks (default 2)")
    parser.add_argument("--tp", type=positive, default=1, help="prefill tensor-parallel ranks (default 1)")
    parser.add_argument(
        "--decode-tp", type=positive, default=1, help="decode tensor-parallel ranks (default 1)"
    )
    parser.add_argument("--rooms", type=positive, default=32, help="requests (default 32)")
    parser.add_argument("--layers", type=positive, default=8)
    parser.add_argument("--page-size", type=positive, default=16)
    parser.add_argument(
        "--bytes-per-token", type=positive, default=576, help="KV bytes per token per layer (MLA latent)"
    )
    parser.add_argument(
        "--kv-heads",
        type=positive,
        default=8,
        help="--mha: the model's KV heads (default 8; e.g. 2 over tp 4)",
    )
    parser.add_argument(
        "--head-bytes",
        type=positive,
        default=128,
        help="--mha: bytes of one KV head of one token (head_dim x dtype size; default 128)",
    )
    parser.add_argument("--max-tokens", type=positive, default=2048)
    parser.add_argument(
        "--aborts", type=cli_fraction, default=0.15, help="fraction of rooms aborted (default 0.15)"
    )
    parser.add_argument("--max-active", type=positive, default=8, help="rooms in flight at once")
    parser.add_argument("--mha", action="store_true", help="MHA layout (K and V per layer) instead of MLA")
    parser.add_argument(
        "--per-layer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send each chunk layer by layer during its forward (default; --no-per-layer: whole, after it)",
    )
    parser.add_argument(
        "--layer-ms", type=float, default=0.5, help="simulated compute per layer (default 0.5 ms)"
    )
    parser.add_argument(
        "--consensus",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="prefill ranks MIN-reduce room polls over a gloo group (default on; --no-consensus: off)",
    )
    parser.add_argument(
        "--engine-timeout-s",
        type=int,
        default=None,
        help="Mooncake MC_TRANSFER_TIMEOUT of every rank (default: the engine's 30 s; --mha: 120 s, as "
        "head slices of token-major pages cost one engine entry per token, and TCP here moves tens of "
        "thousands of entries per second)",
    )
    parser.add_argument(
        "--engine-tcp-queue",
        type=int,
        default=None,
        help="Mooncake MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER, pdkv's entry budget per peer staying 2,048 "
        "(default: the engine's; --mha: 16,384, headroom for a stream of per-token head slices)",
    )
    parser.add_argument(
        "--checksum",
        action="store_true",
        help="PDKV_KV_CHECKSUM on every rank: decode ranks check each room's pages against the prefill "
        "ranks' checksums before Success (the byte check after it still runs)",
    )
    parser.add_argument(
        "--staging",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--mha: head slices move as few large blocks: prefill ranks gather them into a registered "
        "staging pool (decode TP above prefill TP; PDKV_STAGING_* set its shape) and decode ranks "
        "lease a landing zone and scatter from it (decode TP below; PDKV_LANDING_BYTES); default on; "
        "--no-staging: one engine entry per token and head slice",
    )
    rollout = parser.add_mutually_exclusive_group()
    rollout.add_argument(
        "--decode-without-draft-state",
        action="store_true",
        help="a rolling deployment: the prefill ranks register the draft model's index state, the "
        "decode ranks do not (rooms are served without it and report it)",
    )
    rollout.add_argument(
        "--prefill-without-draft-state",
        action="store_true",
        help="the reverse: the decode ranks register the draft model's index state, the prefill ranks do not",
    )
    parser.add_argument(
        "--layout-policy",
        type=_layout_policy,
        default=DEFAULT_LAYOUT_POLICY,
        help="both sides' layout policy: degrade_draft (default: draft buffers one side lacks are left "
        "out) or strict (any difference refuses the registration)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--backend",
        choices=CHOICES[:2],
        default=None,
        help="transfer engine (default: PDKV_BACKEND, else mooncake)",
    )
    parser.add_argument(
        "--ucx-tls", default=None, help="--backend nixl: UCX_TLS (default: UCX's own, cma + tcp here)"
    )
    parser.add_argument("--json", action="store_true", help="JSON lines on stdout instead of the table")
    parser.add_argument(
        "--log-dir", default=None, help="where rank logs go (default: a new temporary folder)"
    )
    args = parser.parse_args(list(argv))

    model = ModelSpec(
        attention=AttentionKind.MHA if args.mha else AttentionKind.MLA,
        layers=args.layers,
        page_size=args.page_size,
        kv_bytes_per_token=args.kv_heads * args.head_bytes if args.mha else args.bytes_per_token,
        kv_heads=args.kv_heads if args.mha else None,
        state_layers=tuple(range(0, args.layers, 2)),
        draft_layers=1,
    )
    with_draft_state = attrs.evolve(model, draft_state_layers=(0,))
    rollout = args.decode_without_draft_state or args.prefill_without_draft_state
    prefill_model, decode_model = model, model
    if args.decode_without_draft_state:
        prefill_model = with_draft_state
    elif args.prefill_without_draft_state:
        decode_model = with_draft_state
    if args.mha:
        try:
            Topology(
                prefill_tp=args.tp,
                decode_tp=args.decode_tp,
                prefill_cp=args.cp,
                attention=AttentionKind.MHA,
                kv_heads=args.kv_heads,
            )
        except TopologyError as exc:
            parser.error(str(exc))
    plans = build_workload(
        args.rooms,
        page_size=args.page_size,
        max_tokens=args.max_tokens,
        aborts=args.aborts,
        seed=args.seed,
        layer_compute_s=args.layer_ms / 1000,
    )
    try:
        backend = backend_kind(args.backend)
    except ConfigError as exc:
        parser.error(str(exc))
    if backend is BackendKind.LOOPBACK:
        parser.error("the demo's ranks are processes: PDKV_BACKEND=loopback cannot reach across them")
    pages_total = sum(-(-p.tokens // args.page_size) for p in plans)
    max_room_pages = -(-args.max_tokens // args.page_size)
    spec = ClusterSpec(
        model=prefill_model,
        decode_model=decode_model,
        prefill_layout_policy=args.layout_policy,
        decode_layout_policy=args.layout_policy,
        prefill_tp=args.tp,
        prefill_cp=args.cp,
        decode_tp=args.decode_tp,
        prefill_capacity=Capacity(
            kv_pages=pages_total // args.cp + 2 * max_room_pages, state_slots=256, aux_rows=256
        ),
        decode_capacity=Capacity(
            kv_pages=(args.max_active + 2 * args.rooms // 5 + 2) * max_room_pages,
            state_slots=256,
            aux_rows=256,
        ),
        per_layer=args.per_layer,
        forward_writes_kv=True,
        consensus=args.consensus,
        engine_transfer_timeout_s=args.engine_timeout_s or (120 if args.mha else None),
        engine_tcp_queue=args.engine_tcp_queue or (16384 if args.mha else None),
        kv_checksum=args.checksum,
        backend=backend.value,
        ucx_tls=args.ucx_tls,
        staging=StagingConfig.from_env() if args.mha and args.staging else None,
        landing=LandingConfig.from_env() if args.staging else LandingConfig(capacity_bytes=0),
    )
    engine = f"NIXL (UCX_TLS={args.ucx_tls or 'all'})" if backend is BackendKind.NIXL else "Mooncake TCP"
    print(
        f"pdkv demo: prefill tp{args.tp} x cp{args.cp}, decode tp{args.decode_tp}, "
        f"{engine} on 127.0.0.1; "
        f"{args.rooms} rooms, {model.layers} layers + {model.draft_layers} draft, page {model.page_size}, "
        f"{_kv_description(model, args.tp, args.decode_tp)}; "
        f"{'per-layer' if args.per_layer else 'monolithic'} transfer, {args.layer_ms:g} ms compute per layer"
        f"{', checksums verified before Success' if args.checksum else ''}"
        f"{_heads_path(args) if args.mha else ''}",
        file=sys.stderr,
    )
    if rollout:
        lacking = "decode" if args.decode_without_draft_state else "prefill"
        print(
            f"  rolling deployment: the {lacking} ranks register no draft-model index state; layout "
            f"policy {args.layout_policy.value}",
            file=sys.stderr,
        )
    started = time.monotonic()
    progress = _Progress(len(plans), decode_ranks=args.decode_tp)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="pdkv-demo-")
    os.makedirs(log_dir, exist_ok=True)
    os.environ.setdefault(json_log.ENV, log_dir)  # every rank's JSON log lands there: `pdkv trace ROOM DIR`
    print(f"  starting registry and rank processes (rank logs: {log_dir}) ...", file=sys.stderr, flush=True)
    try:
        with Cluster(spec, log_level=logging.INFO, log_dir=log_dir) as cluster:
            ready = time.monotonic()
            outcomes = cluster.run(plans, max_active=args.max_active, progress=progress)
            progress.close()
            elapsed = time.monotonic() - ready
            reports = cluster.close()
    except ClusterError as exc:
        if not (rollout and args.layout_policy is LayoutPolicy.STRICT):
            raise
        # The expected end of a strict rolling deployment: the decode rank's registration is refused.
        refusal = str(exc).strip().splitlines()[-1]
        print(f"registration refused (layout policy strict): {refusal}", file=sys.stderr)
        print(f"result              REFUSED (rank logs: {log_dir})")
        return 1
    summary, rows = summarize(
        plans, outcomes, reports, elapsed, draft_left_out=rollout, checksums=args.checksum
    )
    if args.json:
        for row in rows:
            print(json.dumps(row))
        print(json.dumps({"summary": attrs.asdict(summary), "ok": summary.ok}))
    else:
        _print_table(summary, rows, startup_s=ready - started)
        print(f"rank logs           {log_dir}")
    return 0 if summary.ok else 1


def _print_table(summary: Summary, rows: list[dict[str, object]], *, startup_s: float) -> None:
    header = f"{'room':>6} {'tokens':>6} {'chunks':>6} {'prefix':>6} {'abort':>7} {'outcome':>8}"
    print(f"{header} {'verified':>10}  note")
    for row in rows:
        note = "" if row["as_planned"] else "UNEXPECTED "
        if row["mismatches"]:
            note += f"MISMATCH {row['mismatches']} "
        if row["outcome"] == "failed":
            note += str(row["failure"])[:70]
        elif row["draft_skipped"]:
            note += "no draft state"
        print(
            f"{row['room']:>6} {row['tokens']:>6} {row['chunks']:>6} {row['prefix_tokens']:>6} "
            f"{row['abort'] or '-':>7} {row['outcome']:>8} "
            f"{int(str(row['bytes_verified'])) / 1e6:>8.2f}MB  {note}"
        )
    gbps = summary.bytes_reported / summary.seconds / 1e9 if summary.seconds else 0.0
    s = summary
    print()
    print(
        f"rooms               {s.rooms} ({s.succeeded} succeeded, {s.failed} failed, "
        f"{s.planned_aborts} aborts planned)"
    )
    print(f"verified            {s.bytes_verified / 1e6:.1f} MB byte for byte, {s.mismatches} mismatches")
    print(
        f"moved (reported)    {s.bytes_reported / 1e6:.1f} MB in {s.seconds:.2f} s "
        f"({gbps:.2f} GB/s incl. scheduling)"
    )
    print(
        f"room latency        p50 {s.room_p50_ms:.1f} ms, p99 {s.room_p99_ms:.1f} ms "
        "(init to terminal, decode side)"
    )
    print(f"abort safety        {s.canary_violations} canary violations, {s.unsafe_releases} unsafe releases")
    if s.checksums:
        print(
            f"checksums           {s.rooms_verified} of {s.decode_successes} decode Successes verified "
            f"first, {s.checksum_failures} checksum failures"
        )
    if s.staged_writes or s.rooms_landed or s.leased_at_end:
        print(
            f"head slices         {s.staged_writes} prefill writes staged, {s.rooms_landed} rooms landed "
            f"and scattered on decode ranks, "
            f"{'nothing' if not s.leased_at_end else s.leased_at_end} held at the end"
        )
    if s.draft_skipped or s.draft_unreported:
        print(
            f"draft state         {s.draft_skipped} rooms served without it (reported per room), "
            f"{s.draft_unreported} that did not report it"
        )
    print(f"start-up            {startup_s:.1f} s (processes, engines, registration)")
    print(f"result              {'OK' if summary.ok else 'FAILED'}")
