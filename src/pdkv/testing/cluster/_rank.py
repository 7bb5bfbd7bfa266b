"""What every rank process shares: its arguments (``_RankArgs``), its wiring (``_wire``: the backend,
Mooncake wrapped by the rank's faults, and the control channel factory), and the fault counts it reports.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from pdkv.protocol.messages import Side
from pdkv.testing.cluster.spec import ClusterSpec
from pdkv.testing.faults import (
    BackendFaults,
    ChannelFaults,
    FaultCounts,
    FaultyBackend,
    FaultyChannel,
    faulty_channel_factory,
    fixed_port_channel_factory,
    wrap_for_rank,
)

IntArray = npt.NDArray[np.int64]
log = logging.getLogger(__name__)


STEP_S = 0.0005
"""A rank's scheduler loop: its longest pause between two passes over its rooms. The loop has work
that no transport progress announces (rooms and Stop from the driver's pipe, planned aborts by age,
consensus rounds): this bounds how late it sees that."""


def pause(transport: Any, seen: int) -> None:
    """The scheduler loop's pause between two passes: until the transport's progress passes ``seen``
    (read before the pass), at most ``STEP_S``. However many rooms are active, the loop never sleeps
    past a change it could take: a change during the pass ends the pause at once, and the changes of
    many rooms that come during one pass are all taken by the next (a fixed step only added its
    pacing to every room's latency)."""
    transport.wait_progress(seen, STEP_S)


@attrs.frozen(kw_only=True)
class _RankArgs:
    side: Side
    tp: int
    cp: int
    spec: ClusterSpec
    registry: str
    log_level: int
    log_dir: str | None
    consensus_address: str | None = None
    control_port: int = 0


def _make_backend(faults: BackendFaults | None, side: Side, spec: ClusterSpec) -> Any:
    from pdkv.engine import make_backend
    from pdkv.engine.mooncake import TCP_DEFAULT_QUEUED_TRANSFERS_PER_PEER, MooncakeConfig
    from pdkv.engine.nixl import NixlConfig

    queue = spec.engine_tcp_queue
    if spec.netns is None:
        devices = "lo"
    else:  # the veth end of the rank's namespace (its lo is another host's 127.0.0.1 for the peer)
        devices = spec.netns.prefill_link if side is Side.PREFILL else spec.netns.decode_link
    backend = make_backend(
        spec.backend,
        host=spec.host(side),
        mooncake=MooncakeConfig(
            transfer_timeout_s=spec.engine_transfer_timeout_s,
            tcp_max_queued_transfers_per_peer=queue,
            max_entries_in_flight=None
            if queue is None
            else min(queue, TCP_DEFAULT_QUEUED_TRANSFERS_PER_PEER),
        ),
        nixl=NixlConfig(
            ucx_tls=spec.ucx_tls or "all",  # written out: the rank's environment may hold another
            ucx_net_devices=devices,
            transfer_timeout_s=float(spec.engine_transfer_timeout_s or 30),
            log_level="ERROR",
        ),
    )
    return backend if faults is None else FaultyBackend(backend, faults)


def _channel_factory(args: _RankArgs, faults: ChannelFaults | None, made: list[FaultyChannel]) -> Any:
    base = fixed_port_channel_factory(args.control_port) if args.control_port else None
    if faults is None:
        return base
    return faulty_channel_factory(faults, made, base)


@attrs.frozen
class _Wiring:
    """A rank's backend, its control channel factory, and the faulty channels that factory made."""

    backend: Any
    channel_factory: Any
    channels: list[FaultyChannel]

    def fault_counts(self) -> FaultCounts:
        return _fault_counts(self.backend, self.channels)


def _wire(args: _RankArgs, side: Side) -> _Wiring:
    """The rank's faults applied to a new backend (``spec.backend``) and to its control channels."""
    channel_faults, backend_faults = wrap_for_rank(args.spec.faults, side, args.tp, args.cp)
    channels: list[FaultyChannel] = []
    return _Wiring(
        backend=_make_backend(backend_faults, side, args.spec),
        channel_factory=_channel_factory(args, channel_faults, channels),
        channels=channels,
    )


def _fault_counts(backend: Any, channels: list[FaultyChannel]) -> FaultCounts:
    counts = backend.counts() if isinstance(backend, FaultyBackend) else FaultCounts()
    for channel in channels:
        c = channel.counts()
        counts = attrs.evolve(
            counts,
            dropped=counts.dropped + c.dropped,
            duplicated=counts.duplicated + c.duplicated,
            delayed=counts.delayed + c.delayed,
        )
    return counts


# Thread groups of a rank's CPU time, by thread-name prefix (pdkv names its threads; the rest are the
# engine's and zmq's own native threads, told apart by the name the kernel has for them).
_GROUPS = (
    ("MainThread", "scheduler"),
    ("pdkv-transfer-", "transfer workers"),
    ("pdkv-prefill-", "control loop"),
    ("pdkv-decode-", "control loop"),
    ("pdkv-per-layer", "per-layer"),
)


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of this process so far, by thread group (Linux ``/proc``; empty
    elsewhere). Engine lane threads are ``engine completer`` / ``engine launcher``; threads Python does
    not know are ``zmq`` (its I/O threads) or ``engine native`` (the transfer engine's own)."""
    import os
    import threading

    tick = os.sysconf("SC_CLK_TCK")
    named = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    groups: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return groups
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        seconds = (int(fields[11]) + int(fields[12])) / tick
        name = named.get(int(tid))
        if name is None:
            group = "zmq" if comm.startswith("ZMQ") else "engine native"
        elif name.endswith("-complete"):
            group = "engine completer"
        elif name.endswith("-launch"):
            group = "engine launcher"
        else:
            group = next((g for prefix, g in _GROUPS if name.startswith(prefix)), "other")
        groups[group] = groups.get(group, 0.0) + seconds
    return groups


def cpu_since(before: dict[str, float]) -> dict[str, float]:
    """``thread_cpu()`` now minus ``before`` (threads that ended since are not counted)."""
    now = thread_cpu()
    return {group: max(0.0, seconds - before.get(group, 0.0)) for group, seconds in now.items()}
