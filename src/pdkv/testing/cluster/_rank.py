"""What every rank process shares: its arguments (``_RankArgs``), its backend (Mooncake, wrapped by the
rank's faults) and its control channel factory, and the fault counts it reports.
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
)

IntArray = npt.NDArray[np.int64]
log = logging.getLogger(__name__)


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


def _make_backend(faults: BackendFaults | None, host: str, spec: ClusterSpec) -> Any:
    from pdkv.engine.mooncake import TCP_DEFAULT_QUEUED_TRANSFERS_PER_PEER, MooncakeBackend, MooncakeConfig

    queue = spec.engine_tcp_queue
    backend = MooncakeBackend(
        MooncakeConfig(
            local_hostname=host,
            transfer_timeout_s=spec.engine_transfer_timeout_s,
            tcp_max_queued_transfers_per_peer=queue,
            max_entries_in_flight=None
            if queue is None
            else min(queue, TCP_DEFAULT_QUEUED_TRANSFERS_PER_PEER),
        )
    )
    return backend if faults is None else FaultyBackend(backend, faults)


def _channel_factory(args: _RankArgs, faults: ChannelFaults | None, made: list[FaultyChannel]) -> Any:
    base = fixed_port_channel_factory(args.control_port) if args.control_port else None
    if faults is None:
        return base
    return faulty_channel_factory(faults, made, base)


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
