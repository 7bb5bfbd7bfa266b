"""Transfer engines: the ``TransferBackend`` contract and its implementations.

Owns: ``backend`` (the protocol, its records and errors), ``mooncake`` (the only module that imports
``mooncake``, and only when a ``MooncakeBackend`` is built, so importing this package never needs it),
``nixl`` (the same for ``nixl``: ``NixlBackend``), ``loopback`` (in-process memcpy with fault injection,
for tests and single-process demos) and ``choice`` (``make_backend``: a backend by name, or by
``PDKV_BACKEND``, for every entry point).
Must not know about rooms, pages, layouts or batch shaping: that is ``pdkv.mapping`` and the runtime.
"""

from pdkv.engine.backend import (
    BackendClosedError,
    BackendStatistics,
    BatchFailedError,
    BatchHandle,
    BatchOutcome,
    BatchStatus,
    BatchTimedOutError,
    ForeignHandleError,
    InvalidBatchError,
    MemoryRegion,
    PeerMetadataError,
    Registration,
    RegistrationError,
    TransferBackend,
    UnregisteredMemoryError,
    WaitResult,
)
from pdkv.engine.choice import BackendKind, backend_kind, make_backend
from pdkv.engine.loopback import (
    Corruption,
    CorruptionKind,
    LoopbackBackend,
    LoopbackConfig,
    LoopbackFabric,
    LoopbackFaults,
)
from pdkv.engine.mooncake import (
    EngineInitError,
    MooncakeBackend,
    MooncakeConfig,
    MooncakeLogLevel,
    MooncakeProtocol,
    load_transfer_engine,
)
from pdkv.engine.nixl import NixlBackend, NixlConfig

__all__ = [
    "BackendClosedError",
    "BackendKind",
    "BackendStatistics",
    "BatchFailedError",
    "BatchHandle",
    "BatchOutcome",
    "BatchStatus",
    "BatchTimedOutError",
    "Corruption",
    "CorruptionKind",
    "EngineInitError",
    "ForeignHandleError",
    "InvalidBatchError",
    "LoopbackBackend",
    "LoopbackConfig",
    "LoopbackFabric",
    "LoopbackFaults",
    "MemoryRegion",
    "MooncakeBackend",
    "MooncakeConfig",
    "MooncakeLogLevel",
    "MooncakeProtocol",
    "NixlBackend",
    "NixlConfig",
    "PeerMetadataError",
    "Registration",
    "RegistrationError",
    "TransferBackend",
    "UnregisteredMemoryError",
    "WaitResult",
    "backend_kind",
    "load_transfer_engine",
    "make_backend",
]
