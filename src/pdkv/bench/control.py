"""Control plane across processes: rooms/s and init-to-Success latency (p50/p99) of 1-page rooms.

A prefill rank and a decode rank in their own processes (``pdkv.testing.cluster``, Mooncake TCP on
127.0.0.1, or NIXL with ``--backend nixl``) run ``--rooms`` one-page rooms with up to
``--concurrency`` in flight. The latency is the
decode side's, from ``receiver.init`` to Success seen by its poll loop: registration is done once
at start-up, so this is the per-room protocol (TransferRequest, forward, one tiny write, status)
plus the two simple schedulers' polling. The same run is repeated with one room at a time
(``--serial-rooms`` of them, 1,000 by default, so that its p99 rests on ten rooms), whose latency is
the floor the concurrent figure is compared with. Each mode runs on its own pair of
processes; "rooms/job" is how many rooms' chunks shared one transfer job (engine submission and
status wait) on average, from the prefill's ``writes`` / ``write_jobs`` counters. The decode's byte
check of every room (zeroing its pages before, comparing every byte after: most of the decode's work
for a one-page room, and not the control plane's) is off unless ``--verify``; the latency bench
checks bytes.

Beside the rooms, over Mooncake (the default ``--backend``), the engine alone: a prefill process's
own ``TransferEngine`` writes one page of every KV buffer of the same model to a decode rank's
registered memory as one batch waited for by the engine (SGLang's way; ``bench.latency``'s
``engine_batches``), as many times one after another as the serial mode has rooms. Its p50 and
p99 are the floor the serial latency stands on, printed in the same table, with what the serial
mode adds over them. The same batches again at the serial rooms' pace ("engine paced": each after
one serial room's period of sleep) show what the engine itself costs when its threads were asleep,
as they are when a serial room's write comes: on this machine more than back to back.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence

import numpy as np

from pdkv.bench._report import emit, table
from pdkv.bench.latency import engine_batches
from pdkv.engine import BackendKind, backend_kind
from pdkv.engine.choice import CHOICES
from pdkv.protocol.ids import RoomId
from pdkv.protocol.poll import KVPoll
from pdkv.testing.cluster import Cluster, ClusterSpec, RankReport, RequestPlan
from pdkv.testing.synthetic import Capacity, ModelSpec


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="pdkv bench control", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rooms", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument(
        "--serial-rooms",
        type=int,
        default=None,
        help="rooms of the serial mode, one at a time (its p99 is the slowest 1%%: under a few hundred "
        "rooms, one or two of them); default 1,000, 5 with --quick",
    )
    parser.add_argument("--cp", type=int, default=1, help="prefill CP ranks")
    parser.add_argument("--verify", action="store_true", help="check every room's bytes on the decode")
    parser.add_argument("--quick", action="store_true", help="tiny run for tests")
    parser.add_argument(
        "--backend",
        choices=CHOICES[:2],
        default=None,
        help="transfer engine (default: PDKV_BACKEND, else mooncake)",
    )
    parser.add_argument(
        "--ucx-tls", default=None, help="--backend nixl: UCX_TLS (default: UCX's own, cma + tcp here)"
    )
    args = parser.parse_args(list(argv))
    rooms = 20 if args.quick else args.rooms
    serial_rooms = args.serial_rooms if args.serial_rooms is not None else 5 if args.quick else 1000
    if rooms < 1 or serial_rooms < 1:
        parser.error("--rooms and --serial-rooms must be at least 1")
    model = ModelSpec.kv_only(layers=2, page_size=16, kv_bytes_per_token=64)
    spec = ClusterSpec(
        model=model,
        prefill_cp=args.cp,
        prefill_capacity=Capacity(kv_pages=max(rooms, serial_rooms) * 2 + 16, state_slots=8, aux_rows=8),
        decode_capacity=Capacity(
            kv_pages=args.concurrency * 2 + 16,
            state_slots=args.concurrency * 2 + 8,
            aux_rows=args.concurrency + 8,
        ),
        state_slots_per_room=0,
        verify_bytes=args.verify,
        backend=backend_kind(args.backend).value,
        ucx_tls=args.ucx_tls,
    )
    rows: list[list[object]] = []
    cpu_rows: list[list[object]] = []
    records: dict[str, dict[str, float]] = {}
    base = 1
    for label, concurrency in (("serial", 1), ("concurrent", args.concurrency)):
        # A cluster per mode, so the prefill's counters (rooms per transfer job) are this mode's.
        count = serial_rooms if concurrency == 1 else rooms
        plans = [RequestPlan(room=RoomId(base + i), tokens=16, chunk_tokens=(16,)) for i in range(count)]
        base += count
        with Cluster(spec) as cluster:
            started = time.perf_counter()
            driver_cpu = time.process_time()
            outcomes = cluster.run(plans, max_active=concurrency)
            seconds = time.perf_counter() - started
            driver_cpu = time.process_time() - driver_cpu
        prefill = [r for r in cluster.reports if r.side == "prefill"]
        writes = sum(r.writes for r in prefill)
        jobs = sum(r.write_jobs for r in prefill)
        decode = [o for o in outcomes if o.side == "decode"]
        failed = sum(o.poll != KVPoll.Success for o in decode)
        lat = np.array([o.seconds for o in decode]) * 1000
        record = {
            "rooms": float(count),
            "concurrency": float(concurrency),
            "rooms_per_s": count / seconds,
            "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99)),
            "failed": float(failed),
            "rooms_per_job": writes / jobs if jobs else 0.0,
        }
        records[label] = record
        cpu_rows.extend(_cpu_rows(label, count, cluster.reports, driver_cpu))
        rows.append(
            [
                label,
                count,
                concurrency,
                record["rooms_per_s"],
                record["p50_ms"],
                record["p99_ms"],
                record["rooms_per_job"],
                failed,
            ]
        )
    serial = records["serial"]
    over_engine = ""
    summary: dict[str, object] = {}
    if backend_kind(args.backend) is BackendKind.MOONCAKE:
        # The serial rooms' pace: the engine sits idle for about one room's period between two of
        # their writes (the room's own write is a small part of it).
        back_to_back, at_pace = engine_batches(
            model, rounds=int(serial["rooms"]), idle_s=1 / serial["rooms_per_s"]
        )
        engine = _engine_record(back_to_back)
        paced = _engine_record(at_pace)
        emit({"bench": "control", "kind": "engine", **engine})
        emit({"bench": "control", "kind": "engine_paced", "idle_ms": 1000 / serial["rooms_per_s"], **paced})
        for label, series, record in (("engine", back_to_back, engine), ("engine paced", at_pace, paced)):
            per_s = 1 / float(np.mean(series))
            rows.append([label, len(series), 1, per_s, record["p50_ms"], record["p99_ms"], "-", 0])
        summary = {
            "serial_p50_over_engine_ms": serial["p50_ms"] - engine["p50_ms"],
            "serial_p99_over_engine_ms": serial["p99_ms"] - engine["p99_ms"],
            "serial_p50_over_engine_paced_ms": serial["p50_ms"] - paced["p50_ms"],
            "serial_p99_over_engine_paced_ms": serial["p99_ms"] - paced["p99_ms"],
        }
        over_engine = (
            f"; serial over the engine alone: p50 {summary['serial_p50_over_engine_ms']:+.2f} ms, "
            f"p99 {summary['serial_p99_over_engine_ms']:+.2f} ms, over the engine paced: p50 "
            f"{summary['serial_p50_over_engine_paced_ms']:+.2f} ms, p99 "
            f"{summary['serial_p99_over_engine_paced_ms']:+.2f} ms (engine: the engine alone, one batch "
            "of the same KV blocks at a time, no pdkv code, back to back; paced: each batch after "
            "one serial room's period of idle, as the serial rooms' writes come)"
        )
    for label, record in records.items():
        emit({"bench": "control", "kind": label, **record})
    ratio = records["concurrent"]["rooms_per_s"] / serial["rooms_per_s"]
    emit(
        {
            "bench": "control",
            "kind": "summary",
            "concurrent_vs_serial_rooms_per_s": ratio,
            "prefill_cp": args.cp,
            **summary,
        }
    )
    table(
        f"pdkv bench control: 1-page rooms across processes (prefill cp{args.cp}, decode tp1); "
        f"concurrency gives {ratio:.1f}x the serial rate{over_engine}",
        ["mode", "rooms", "in flight", "rooms/s", "p50 ms", "p99 ms", "rooms/job", "failed"],
        rows,
    )
    table(
        "CPU per room (ms), by process and thread group, from the end of start-up to the last room "
        f"(this machine has {os.cpu_count()} cores: rooms/s cannot pass cores x 1000 / total)",
        ["mode", "process", *_CPU_GROUPS, "total"],
        cpu_rows,
    )
    for row in cpu_rows:
        emit(
            {
                "bench": "control",
                "kind": "cpu_ms_per_room",
                "mode": row[0],
                "process": row[1],
                **dict(zip([*_CPU_GROUPS, "total"], row[2:], strict=True)),
            }
        )
    return 0 if all(r["failed"] == 0 for r in records.values()) else 1


def _engine_record(seconds: Sequence[float]) -> dict[str, float]:
    ms = np.array(seconds) * 1000
    return {
        "batches": float(ms.size),
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
    }


_CPU_GROUPS = (
    "scheduler",
    "transfer workers",
    "engine launcher",
    "engine completer",
    "engine native",
    "control loop",
    "zmq",
    "other",
)


def _cpu_rows(mode: str, rooms: int, reports: Sequence[RankReport], driver_s: float) -> list[list[object]]:
    """Rows of CPU milliseconds per room: each side's ranks summed by thread group, the bench driver
    (its own scheduler of both sides: pipes to the rank processes), and all together."""
    rows: list[list[object]] = []
    total = driver_s
    for side in ("prefill", "decode"):
        groups: dict[str, float] = {}
        for report in reports:
            if report.side == side:
                for group, seconds in report.cpu_s.items():
                    groups[group] = groups.get(group, 0.0) + seconds
        side_total = sum(groups.values())
        total += side_total
        shown = [groups.get(g, 0.0) for g in _CPU_GROUPS[:-1]]
        shown.append(max(0.0, round(side_total - sum(shown), 9)))  # "other": every group not named above
        rows.append([mode, side, *(s * 1000 / rooms for s in shown), side_total * 1000 / rooms])
    rows.append(
        [
            mode,
            "bench driver",
            *([0.0] * (len(_CPU_GROUPS) - 1)),
            driver_s * 1000 / rooms,
            driver_s * 1000 / rooms,
        ]
    )
    rows.append([mode, "all", *([""] * len(_CPU_GROUPS)), total * 1000 / rooms])
    return rows
