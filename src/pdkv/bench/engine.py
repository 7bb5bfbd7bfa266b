"""Engine sweep across two processes: GB/s by slice size, entries per batch and batches in flight.

What it measures: one contiguous region (``--total-mib``) written from this process into a spawned
process over the configured engine (``--backend``: Mooncake and its protocol, or NIXL and its
UCX transports), moved by the transfer executor with each shape of
the sweep (slice bytes x entries per batch x batches in flight); the best of ``--repeats`` runs per
shape. The last line compares the executor's current defaults (``pdkv.runtime.executor``) with the
best shape of the same run. The destination bytes are checked (SHA-1) after the sweep.

This is how the executor's shaping defaults were chosen: rerun it on the target machine and protocol.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import statistics
import time
from collections.abc import Iterator, Sequence

import attrs
import numpy as np

from pdkv.bench._report import emit, table
from pdkv.engine import (
    BackendKind,
    MooncakeBackend,
    MooncakeConfig,
    MooncakeLogLevel,
    MooncakeProtocol,
    NixlBackend,
    NixlConfig,
    TransferBackend,
    backend_kind,
)
from pdkv.engine.choice import CHOICES
from pdkv.mapping import TransferBlocks
from pdkv.runtime.executor import ExecutorConfig, TransferExecutor
from pdkv.testing.backend_conformance import HostBuffer, MetadataSyncedPeer, SpawnedPeer

_SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'256K' -> 262144, '4M' -> 4194304, '512' -> 512."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = _SUFFIXES.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in _SUFFIXES else text
    return int(number) * scale


def parse_sizes(text: str) -> list[int]:
    return [parse_size(t) for t in text.split(",") if t.strip()]


def parse_ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def human_size(nbytes: int) -> str:
    for suffix, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{suffix}"
    return str(nbytes)


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        choices=CHOICES[:2],
        default=None,
        help="transfer engine (default: PDKV_BACKEND, else mooncake)",
    )
    parser.add_argument(
        "--ucx-tls", default="all", help="nixl: UCX_TLS of both agents (default all: cma + tcp here; or tcp)"
    )
    parser.add_argument("--protocol", choices=[p.value for p in MooncakeProtocol], default="tcp")
    parser.add_argument("--device", default="", help="RDMA device names (protocol rdma)")
    parser.add_argument("--hostname", default="127.0.0.1", help="address both engines listen on")


def engine_config(args: argparse.Namespace, **settings: int) -> MooncakeConfig:
    return MooncakeConfig(
        protocol=MooncakeProtocol(args.protocol),
        device_name=args.device,
        local_hostname=args.hostname,
        log_level=MooncakeLogLevel.ERROR,
        tcp_max_queued_transfers_per_peer=settings.get("tcp_queue"),
    )


@contextlib.contextmanager
def mooncake_endpoints(config: MooncakeConfig) -> Iterator[tuple[MooncakeBackend, SpawnedPeer]]:
    """A Mooncake sender in this process and a Mooncake peer in a spawned child; both stopped after."""
    with SpawnedPeer(functools.partial(MooncakeBackend, config)) as peer, MooncakeBackend(config) as sender:
        yield sender, peer


def nixl_config(args: argparse.Namespace) -> NixlConfig:
    return NixlConfig(hostname=args.hostname, ucx_tls=args.ucx_tls, ucx_net_devices="lo", log_level="ERROR")


def backend_of(args: argparse.Namespace) -> BackendKind:
    return backend_kind(args.backend)


@contextlib.contextmanager
def endpoints(
    args: argparse.Namespace, **settings: int
) -> Iterator[tuple[TransferBackend, MetadataSyncedPeer | SpawnedPeer]]:
    """A sender in this process and a peer in a spawned child, of the engine ``--backend`` names (a
    NIXL peer's registrations reach the sender as a decode's Register carries them)."""
    if backend_of(args) is BackendKind.NIXL:
        config = nixl_config(args)
        with SpawnedPeer(functools.partial(NixlBackend, config)) as spawned, NixlBackend(config) as sender:
            peer = MetadataSyncedPeer(spawned)
            peer.attach(sender)
            yield sender, peer
        return
    with mooncake_endpoints(engine_config(args, **settings)) as (mooncake, spawned_peer):
        yield mooncake, spawned_peer


@attrs.frozen
class Shape:
    slice_bytes: int
    max_entries: int
    max_in_flight: int

    def executor_config(self) -> ExecutorConfig:
        return ExecutorConfig(
            slice_bytes=self.slice_bytes,
            max_entries=self.max_entries,
            max_batch_bytes=self.slice_bytes * self.max_entries,
            max_in_flight=self.max_in_flight,
        )

    def describe(self) -> dict[str, int]:
        return {
            "slice_bytes": self.slice_bytes,
            "max_entries": self.max_entries,
            "max_in_flight": self.max_in_flight,
        }


@attrs.frozen
class Timing:
    shape: Shape
    nbytes: int
    seconds: list[float]

    @property
    def best_s(self) -> float:
        return min(self.seconds)

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.best_s / 1e9

    @property
    def median_gb_per_s(self) -> float:
        return self.nbytes / statistics.median(self.seconds) / 1e9


def time_executor(
    sender: TransferBackend, peer: str, blocks: TransferBlocks, shape: Shape, repeats: int
) -> Timing:
    executor = TransferExecutor(sender, shape.executor_config())
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = executor.transfer(peer, blocks)
        elapsed = time.perf_counter() - started
        if not result.ok:
            raise RuntimeError(f"transfer with {shape} failed: {result.reason}")
        seconds.append(elapsed)
    return Timing(shape, blocks.total_bytes, seconds)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="pdkv bench engine", description=__doc__.splitlines()[0])
    add_engine_options(parser)
    parser.add_argument("--total-mib", type=int, default=256, help="bytes moved per run (MiB)")
    parser.add_argument("--slices", default="16K,64K,256K,1M,4M", help="slice sizes to sweep")
    parser.add_argument("--entries", default="128,512,2048", help="entries per batch to sweep")
    parser.add_argument("--in-flight", default="1,4", help="batches in flight to sweep")
    parser.add_argument("--repeats", type=int, default=3, help="runs per shape (best is reported)")
    parser.add_argument("--quick", action="store_true", help="tiny run: 16 MiB, 2 slices, 1 repeat")
    args = parser.parse_args(list(argv))
    if args.quick:
        args.total_mib, args.slices, args.entries, args.in_flight, args.repeats = (
            16,
            "64K,256K",
            "512",
            "1,4",
            1,
        )
    total = args.total_mib << 20
    shapes = [
        Shape(s, e, k)
        for s in parse_sizes(args.slices)
        for e in parse_ints(args.entries)
        for k in parse_ints(args.in_flight)
    ]
    defaults = ExecutorConfig()
    default_shape = Shape(defaults.slice_bytes, defaults.max_entries, defaults.max_in_flight)

    source = HostBuffer(total)
    source.array.view(np.uint64)[:] = np.arange(total // 8, dtype=np.uint64)
    expected = hashlib.sha1(source.array.data).hexdigest()
    timings: list[Timing] = []
    with endpoints(args) as (sender, peer), sender.register(source):
        region = peer.allocate(total)
        blocks = TransferBlocks(src=[source.data_ptr()], dst=[region.address], length=[total], buffer=[0])
        time_executor(sender, peer.session_id, blocks, default_shape, 1)  # warm-up: handshake, first touch
        for shape in shapes:
            timing = time_executor(sender, peer.session_id, blocks, shape, args.repeats)
            timings.append(timing)
            emit(
                {
                    "bench": "engine",
                    "kind": "shape",
                    "protocol": args.protocol,
                    **shape.describe(),
                    "bytes": total,
                    "seconds": timing.best_s,
                    "gb_per_s": timing.gb_per_s,
                    "median_gb_per_s": timing.median_gb_per_s,
                }
            )
        peer.fill(region.address, region.length, 0)
        default_timing = time_executor(sender, peer.session_id, blocks, default_shape, args.repeats)
        verified = peer.digest(region.address, region.length) == expected
    best = max(timings, key=lambda t: t.gb_per_s)
    table(
        f"pdkv bench engine: {human_size(total)} per run, {args.protocol}, best of {args.repeats}",
        ["slice", "entries", "in flight", "GB/s", "median GB/s"],
        [
            [
                human_size(t.shape.slice_bytes),
                t.shape.max_entries,
                t.shape.max_in_flight,
                t.gb_per_s,
                t.median_gb_per_s,
            ]
            for t in timings
        ]
        + [
            [
                f"default {human_size(default_shape.slice_bytes)}",
                default_shape.max_entries,
                default_shape.max_in_flight,
                default_timing.gb_per_s,
                default_timing.median_gb_per_s,
            ]
        ],
    )
    emit(
        {
            "bench": "engine",
            "kind": "summary",
            "protocol": args.protocol,
            "bytes": total,
            "best": {**best.shape.describe(), "seconds": best.best_s, "gb_per_s": best.gb_per_s},
            "default": {
                **default_shape.describe(),
                "seconds": default_timing.best_s,
                "gb_per_s": default_timing.gb_per_s,
            },
            "default_vs_best": best.best_s / default_timing.best_s,
            "verified": verified,
        }
    )
    return 0 if verified else 1
