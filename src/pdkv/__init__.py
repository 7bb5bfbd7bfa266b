"""pdkv: the KV-cache transport between prefill and decode servers (prefill/decode disaggregation).

A scheduler embeds one transport per rank and one sender (prefill) or receiver (decode) per room::

    transport = PrefillTransport(PrefillConfig(...), MooncakeBackend(MooncakeConfig()))
    transport.start()
    sender = transport.sender(room)
    sender.init(num_pages, aux_row)
    sender.send(chunk_pages, start_token=..., last=...)     # non-blocking
    sender.poll()                                          # KVPoll

The public surface is listed in ``__all__`` (and in README.md); ``pdkv.mapping`` is public too.
"""

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
    TransferBackend,
)
from pdkv.engine.backend import (
    BackendClosedError,
    BatchFailedError,
    BatchTimedOutError,
    ForeignHandleError,
    InvalidBatchError,
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
from pdkv.mapping import AttentionKind, BufferKind, BufferLayout, BufferSpec, ModelRole
from pdkv.mapping.fanout import (
    TopologyError,
)
from pdkv.control.channel import ChannelStatistics
from pdkv.engine.backend import BackendStatistics
from pdkv.metrics import KVTransferMetric, TransportMetrics, TransportMetricsSnapshot
from pdkv.metrics.errors import (
    MetricValueError,
    PrometheusUnavailableError,
)
from pdkv.protocol import KVPoll, RoomId, Timeouts, room_id
from pdkv.protocol.decode import DecodeStatistics
from pdkv.protocol.effects import ChecksumMismatch, Failure, FailureCause, ReleaseKind
from pdkv.protocol.prefill import PrefillStatistics
from pdkv.protocol.ids import InstanceId
from pdkv.protocol.messages import RankCoord, StateIndices
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
)
from pdkv.runtime.consensus import (
    ConsensusError,
)
from pdkv.runtime.decode import DecodeTransportStatistics
from pdkv.runtime.per_layer import PerLayerStatistics
from pdkv.runtime.prefill import PrefillTransportStatistics
from pdkv.runtime.executor import (
    JobFinishedError,
)
from pdkv.runtime.per_layer import (
    UnknownLayerError,
)

__version__ = "0.1.0"

__all__ = [
    "AllocatorError",
    "AttentionKind",
    "AuthenticationError",
    "BackendClosedError",
    "BackendStatistics",
    "BatchFailedError",
    "BatchTimedOutError",
    "BufferKind",
    "BufferLayout",
    "BufferSpec",
    "ChannelClosedError",
    "ChannelOwnershipError",
    "ChannelStatistics",
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
    "EngineInitError",
    "EngineUnavailableError",
    "ExecutorConfig",
    "ChecksumMismatch",
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
    "LocalProtocolError",
    "LoopbackBackend",
    "LoopbackFabric",
    "MappingError",
    "MetricValueError",
    "ModelRole",
    "MooncakeBackend",
    "MooncakeConfig",
    "OutOfPagesError",
    "PagePool",
    "PdkvError",
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
    "mapping",
    "room_id",
    "__version__",
]
