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
from pdkv.engine import (
    LoopbackBackend,
    LoopbackFabric,
    MooncakeBackend,
    MooncakeConfig,
    TransferBackend,
)
from pdkv.errors import (
    ConfigError,
    EngineUnavailableError,
    InvalidArgumentError,
    LayoutMismatchError,
    LocalProtocolError,
    MappingError,
    PdkvError,
    ProtocolError,
    RegistryError,
    RemoteProtocolError,
    RouteUnavailableError,
    TransferError,
    TransportClosedError,
)
from pdkv.mapping import AttentionKind, BufferKind, BufferLayout, BufferSpec, ModelRole
from pdkv.metrics import KVTransferMetric, TransportMetrics
from pdkv.protocol import KVPoll, RoomId, Timeouts, room_id
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

__version__ = "0.1.0"

__all__ = [
    "AttentionKind",
    "BufferKind",
    "BufferLayout",
    "BufferSpec",
    "ConfigError",
    "DecodeConfig",
    "DecodeTransport",
    "EngineUnavailableError",
    "ExecutorConfig",
    "FreeRoomTargets",
    "InvalidArgumentError",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "KVTransferMetric",
    "LayoutMismatchError",
    "LocalProtocolError",
    "LoopbackBackend",
    "LoopbackFabric",
    "MappingError",
    "ModelRole",
    "MooncakeBackend",
    "MooncakeConfig",
    "PagePool",
    "PdkvError",
    "PerLayerConfig",
    "PerLayerMode",
    "PerLayerTransferManager",
    "PoolStatistics",
    "PrefillConfig",
    "PrefillTransport",
    "ProtocolError",
    "RankCoord",
    "Registry",
    "RegistryError",
    "RemoteProtocolError",
    "RoomId",
    "RouteUnavailableError",
    "StateIndices",
    "Timeouts",
    "TransferBackend",
    "TransferError",
    "TransportClosedError",
    "TransportMetrics",
    "__version__",
    "mapping",
    "room_id",
]
