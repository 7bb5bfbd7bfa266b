"""pdkv: the KV-cache transport between prefill and decode servers (prefill/decode disaggregation).

A scheduler embeds one transport per rank and one sender (prefill) or receiver (decode) per room::

    transport = PrefillTransport(PrefillConfig(...), MooncakeBackend(MooncakeConfig()))
    transport.start()
    sender = transport.sender(room)
    sender.init(num_pages, aux_row)
    sender.send(chunk_pages, start_token=..., last=...)     # non-blocking
    sender.poll()                                          # KVPoll

The public surface is listed in ``__all__`` (and in README.md); ``pdkv.mapping`` is public too.
Every name is imported when first used (PEP 562): ``import pdkv`` costs nothing, and ``import
pdkv.protocol`` (the sans-IO core) pulls in neither torch nor zmq.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdkv import mapping
    from pdkv.alloc import FreeRoomTargets, PagePool, PoolStatistics
    from pdkv.alloc.errors import (
        AllocatorError,
        DoubleFreeError,
        ForeignPageError,
        InvalidAllocationError,
        InvalidFreeError,
        OutOfPagesError,
        ReentrantAllocationError,
    )
    from pdkv.control.channel import ChannelStatistics
    from pdkv.control.errors import (
        AuthenticationError,
        ChannelClosedError,
        ChannelOwnershipError,
        ControlBindError,
        ControlError,
        ControlTimeoutError,
    )
    from pdkv.engine import (
        LoopbackBackend,
        LoopbackFabric,
        MooncakeBackend,
        MooncakeConfig,
        NixlBackend,
        NixlConfig,
        TransferBackend,
    )
    from pdkv.engine.backend import (
        BackendClosedError,
        BackendStatistics,
        BatchFailedError,
        BatchTimedOutError,
        ForeignHandleError,
        InvalidBatchError,
        PeerMetadataError,
        RegistrationError,
        UnregisteredMemoryError,
    )
    from pdkv.engine.mooncake import (
        EngineInitError,
    )
    from pdkv.engine.sockets import ConnectionCutUnavailableError
    from pdkv.errors import (
        ConfigError,
        DiagramScenarioError,
        EngineUnavailableError,
        InvalidArgumentError,
        LayoutError,
        LayoutMismatchError,
        LocalProtocolError,
        MappingError,
        PdkvError,
        ProtocolError,
        RegistryError,
        RemoteProtocolError,
        RouteUnavailableError,
        TraceLogError,
        TransferError,
        TransportClosedError,
    )
    from pdkv.mapping import (
        AttentionKind,
        BufferKey,
        BufferKind,
        BufferLayout,
        BufferSpec,
        LayoutPolicy,
        ModelRole,
    )
    from pdkv.mapping.fanout import (
        TopologyError,
    )
    from pdkv.metrics import KVTransferMetric, TransportMetrics, TransportMetricsSnapshot
    from pdkv.metrics.errors import (
        MetricValueError,
        PrometheusUnavailableError,
    )
    from pdkv.protocol import KVPoll, RoomId, Timeouts, room_id
    from pdkv.protocol.decode import DecodeStatistics
    from pdkv.protocol.effects import ChecksumMismatch, Failure, FailureCause, ReleaseKind
    from pdkv.protocol.ids import InstanceId
    from pdkv.protocol.messages import RankCoord, StateIndices
    from pdkv.protocol.prefill import PrefillStatistics
    from pdkv.protocol.registration import DraftSkipped
    from pdkv.runtime import (
        DecodeConfig,
        DecodeTransport,
        ExecutorConfig,
        KVReceiver,
        KVSender,
        PerLayerConfig,
        PerLayerMode,
        PerLayerTransferManager,
        PrefillConfig,
        PrefillTransport,
        Registry,
        StagingConfig,
        StagingPool,
    )
    from pdkv.runtime.consensus import (
        ConsensusError,
    )
    from pdkv.runtime.decode import DecodeTransportStatistics
    from pdkv.runtime.executor import (
        JobFinishedError,
    )
    from pdkv.runtime.per_layer import (
        PerLayerStatistics,
        UnknownLayerError,
    )
    from pdkv.runtime.prefill import PrefillTransportStatistics

__version__ = "0.1.0"

# Each public name -> the module that defines it (a submodule, for ``mapping``).
_EXPORTS: dict[str, str] = {
    "AllocatorError": "pdkv.alloc.errors",
    "AttentionKind": "pdkv.mapping",
    "AuthenticationError": "pdkv.control.errors",
    "BackendClosedError": "pdkv.engine.backend",
    "BackendStatistics": "pdkv.engine.backend",
    "BatchFailedError": "pdkv.engine.backend",
    "BatchTimedOutError": "pdkv.engine.backend",
    "BufferKey": "pdkv.mapping",
    "BufferKind": "pdkv.mapping",
    "BufferLayout": "pdkv.mapping",
    "BufferSpec": "pdkv.mapping",
    "ChannelClosedError": "pdkv.control.errors",
    "ChannelOwnershipError": "pdkv.control.errors",
    "ChannelStatistics": "pdkv.control.channel",
    "ConfigError": "pdkv.errors",
    "ConnectionCutUnavailableError": "pdkv.engine.sockets",
    "ConsensusError": "pdkv.runtime.consensus",
    "ControlBindError": "pdkv.control.errors",
    "ControlError": "pdkv.control.errors",
    "ControlTimeoutError": "pdkv.control.errors",
    "DecodeConfig": "pdkv.runtime",
    "DecodeStatistics": "pdkv.protocol.decode",
    "DecodeTransport": "pdkv.runtime",
    "DecodeTransportStatistics": "pdkv.runtime.decode",
    "DiagramScenarioError": "pdkv.errors",
    "DraftSkipped": "pdkv.protocol.registration",
    "DoubleFreeError": "pdkv.alloc.errors",
    "EngineInitError": "pdkv.engine.mooncake",
    "EngineUnavailableError": "pdkv.errors",
    "ExecutorConfig": "pdkv.runtime",
    "ChecksumMismatch": "pdkv.protocol.effects",
    "Failure": "pdkv.protocol.effects",
    "FailureCause": "pdkv.protocol.effects",
    "ForeignHandleError": "pdkv.engine.backend",
    "ForeignPageError": "pdkv.alloc.errors",
    "FreeRoomTargets": "pdkv.alloc",
    "InstanceId": "pdkv.protocol.ids",
    "InvalidAllocationError": "pdkv.alloc.errors",
    "InvalidArgumentError": "pdkv.errors",
    "InvalidBatchError": "pdkv.engine.backend",
    "InvalidFreeError": "pdkv.alloc.errors",
    "JobFinishedError": "pdkv.runtime.executor",
    "KVPoll": "pdkv.protocol",
    "KVReceiver": "pdkv.runtime",
    "KVSender": "pdkv.runtime",
    "KVTransferMetric": "pdkv.metrics",
    "LayoutError": "pdkv.errors",
    "LayoutMismatchError": "pdkv.errors",
    "LayoutPolicy": "pdkv.mapping",
    "LocalProtocolError": "pdkv.errors",
    "LoopbackBackend": "pdkv.engine",
    "LoopbackFabric": "pdkv.engine",
    "MappingError": "pdkv.errors",
    "MetricValueError": "pdkv.metrics.errors",
    "ModelRole": "pdkv.mapping",
    "MooncakeBackend": "pdkv.engine",
    "MooncakeConfig": "pdkv.engine",
    "NixlBackend": "pdkv.engine",
    "NixlConfig": "pdkv.engine",
    "OutOfPagesError": "pdkv.alloc.errors",
    "PagePool": "pdkv.alloc",
    "PdkvError": "pdkv.errors",
    "PeerMetadataError": "pdkv.engine.backend",
    "PerLayerConfig": "pdkv.runtime",
    "PerLayerMode": "pdkv.runtime",
    "PerLayerStatistics": "pdkv.runtime.per_layer",
    "PerLayerTransferManager": "pdkv.runtime",
    "PoolStatistics": "pdkv.alloc",
    "PrefillConfig": "pdkv.runtime",
    "PrefillStatistics": "pdkv.protocol.prefill",
    "PrefillTransport": "pdkv.runtime",
    "PrefillTransportStatistics": "pdkv.runtime.prefill",
    "PrometheusUnavailableError": "pdkv.metrics.errors",
    "ProtocolError": "pdkv.errors",
    "RankCoord": "pdkv.protocol.messages",
    "ReentrantAllocationError": "pdkv.alloc.errors",
    "RegistrationError": "pdkv.engine.backend",
    "Registry": "pdkv.runtime",
    "RegistryError": "pdkv.errors",
    "ReleaseKind": "pdkv.protocol.effects",
    "RemoteProtocolError": "pdkv.errors",
    "RoomId": "pdkv.protocol",
    "RouteUnavailableError": "pdkv.errors",
    "StagingConfig": "pdkv.runtime",
    "StagingPool": "pdkv.runtime",
    "StateIndices": "pdkv.protocol.messages",
    "Timeouts": "pdkv.protocol",
    "TopologyError": "pdkv.mapping.fanout",
    "TraceLogError": "pdkv.errors",
    "TransferBackend": "pdkv.engine",
    "TransferError": "pdkv.errors",
    "TransportClosedError": "pdkv.errors",
    "TransportMetrics": "pdkv.metrics",
    "TransportMetricsSnapshot": "pdkv.metrics",
    "UnknownLayerError": "pdkv.runtime.per_layer",
    "UnregisteredMemoryError": "pdkv.engine.backend",
    "mapping": "pdkv.mapping",
    "room_id": "pdkv.protocol",
}


def __getattr__(name: str) -> Any:
    """A public name, imported on first use and kept (PEP 562)."""
    home = _EXPORTS.get(name)
    if home is None:
        raise AttributeError(f"module 'pdkv' has no attribute {name!r}")
    module = importlib.import_module(home)
    value = module if home == f"pdkv.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = [
    "AllocatorError",
    "AttentionKind",
    "AuthenticationError",
    "BackendClosedError",
    "BackendStatistics",
    "BatchFailedError",
    "BatchTimedOutError",
    "BufferKey",
    "BufferKind",
    "BufferLayout",
    "BufferSpec",
    "ChannelClosedError",
    "ChannelOwnershipError",
    "ChannelStatistics",
    "ChecksumMismatch",
    "ConfigError",
    "ConnectionCutUnavailableError",
    "ConsensusError",
    "ControlBindError",
    "ControlError",
    "ControlTimeoutError",
    "DecodeConfig",
    "DecodeStatistics",
    "DecodeTransport",
    "DecodeTransportStatistics",
    "DiagramScenarioError",
    "DoubleFreeError",
    "DraftSkipped",
    "EngineInitError",
    "EngineUnavailableError",
    "ExecutorConfig",
    "Failure",
    "FailureCause",
    "ForeignHandleError",
    "ForeignPageError",
    "FreeRoomTargets",
    "InstanceId",
    "InvalidAllocationError",
    "InvalidArgumentError",
    "InvalidBatchError",
    "InvalidFreeError",
    "JobFinishedError",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "KVTransferMetric",
    "LayoutError",
    "LayoutMismatchError",
    "LayoutPolicy",
    "LocalProtocolError",
    "LoopbackBackend",
    "LoopbackFabric",
    "MappingError",
    "MetricValueError",
    "ModelRole",
    "MooncakeBackend",
    "MooncakeConfig",
    "NixlBackend",
    "NixlConfig",
    "OutOfPagesError",
    "PagePool",
    "PdkvError",
    "PeerMetadataError",
    "PerLayerConfig",
    "PerLayerMode",
    "PerLayerStatistics",
    "PerLayerTransferManager",
    "PoolStatistics",
    "PrefillConfig",
    "PrefillStatistics",
    "PrefillTransport",
    "PrefillTransportStatistics",
    "PrometheusUnavailableError",
    "ProtocolError",
    "RankCoord",
    "ReentrantAllocationError",
    "RegistrationError",
    "Registry",
    "RegistryError",
    "ReleaseKind",
    "RemoteProtocolError",
    "RoomId",
    "RouteUnavailableError",
    "StagingConfig",
    "StagingPool",
    "StateIndices",
    "Timeouts",
    "TopologyError",
    "TraceLogError",
    "TransferBackend",
    "TransferError",
    "TransportClosedError",
    "TransportMetrics",
    "TransportMetricsSnapshot",
    "UnknownLayerError",
    "UnregisteredMemoryError",
    "__version__",
    "mapping",
    "room_id",
]
