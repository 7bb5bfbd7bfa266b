"""Transfer engines: the ``TransferBackend`` contract and its implementations.

Owns: ``backend`` (the protocol, its records and errors), ``mooncake`` (the only module that imports
``mooncake``, and only when a ``MooncakeBackend`` is built, so importing this package never needs it)
and ``loopback`` (in-process memcpy with fault injection, for tests and single-process demos).
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
    Registration,
    RegistrationError,
    TransferBackend,
    UnregisteredMemoryError,
    WaitResult,
)
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

__all__ = [
    "BackendClosedError",
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
    "Registration",
    "RegistrationError",
    "TransferBackend",
    "UnregisteredMemoryError",
    "WaitResult",
    "load_transfer_engine",
]
