"""pdkv.runtime: what a scheduler embeds (DESIGN sections 7 and 10).

- ``PrefillTransport`` / ``KVSender`` and ``DecodeTransport`` / ``KVReceiver``: one transport per
  rank, one sender or receiver per room; every scheduler call is non-blocking;
- ``TransferExecutor``: shaped, bounded, fully-waited batches through a ``TransferBackend``;
- ``StagingPool``: registered staging memory the executor gathers scattered head slices into
  (MHA/GQA towards a decode rank of a higher TP), so the engine moves them as few large blocks;
- ``PerLayerTransferManager`` (``PrefillTransport.per_layer``): a chunk's KV sent layer by layer
  while its forward runs;
- ``all_reduce_polls``: the MIN consensus of KVPoll across a torch.distributed group;
- ``checksum``: per-(buffer, page) checksums of a room's KV (``PDKV_KV_CHECKSUM``; ``checksums_from_env``);
- ``channels``: the zmq wiring (default channel factory, registry client and service).

The only layer that starts threads and owns clocks; it imports protocol, mapping, engine, control,
alloc and metrics, and nothing imports it but the CLI, the demo and ``pdkv.testing``.
"""

from pdkv.runtime._layout_policy import layout_policy_from_env
from pdkv.runtime.channels import Registry
from pdkv.runtime.checksum import checksums_from_env
from pdkv.runtime.decode import DecodeConfig, DecodeTransport, KVReceiver, RouteUnavailableError
from pdkv.runtime.executor import (
    ExecutorConfig,
    JobFinishedError,
    JobStatus,
    TransferExecutor,
    TransferJob,
    TransferResult,
)
from pdkv.runtime.per_layer import (
    LayerTransferResult,
    PerLayerConfig,
    PerLayerMode,
    PerLayerStatistics,
    PerLayerTransferManager,
    UnknownLayerError,
)
from pdkv.runtime.prefill import KVSender, PrefillConfig, PrefillTransport
from pdkv.runtime.staging import StagingConfig, StagingPool, StagingStatistics

__all__ = [
    "DecodeConfig",
    "DecodeTransport",
    "ExecutorConfig",
    "JobFinishedError",
    "JobStatus",
    "KVReceiver",
    "KVSender",
    "LayerTransferResult",
    "PerLayerConfig",
    "PerLayerMode",
    "PerLayerStatistics",
    "PerLayerTransferManager",
    "PrefillConfig",
    "PrefillTransport",
    "Registry",
    "RouteUnavailableError",
    "StagingConfig",
    "StagingPool",
    "StagingStatistics",
    "TransferExecutor",
    "TransferJob",
    "TransferResult",
    "UnknownLayerError",
    "checksums_from_env",
    "layout_policy_from_env",
]
