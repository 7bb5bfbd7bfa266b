import enum
from typing import Any

import numpy as np
import numpy.typing as npt
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.server_args import ServerArgs

class StateType(str, enum.Enum):  # noqa: UP042 (as SGLang declares it)
    MAMBA = "mamba"
    SWA = "swa"
    DSA = "dsa"

class KVTransferMetric:
    transfer_latency_s: float | None
    alloc_latency_s: float | None
    transfer_total_bytes: int | None
    def __init__(
        self,
        transfer_latency_s: float | None = None,
        alloc_latency_s: float | None = None,
        transfer_total_bytes: int | None = None,
    ) -> None: ...

class KVTransferDestination(str, enum.Enum):  # noqa: UP042 (as SGLang declares it)
    DEVICE = "device"
    HOST = "host"

class KVArgs:
    engine_rank: int
    kv_data_ptrs: list[int]
    kv_data_lens: list[int]
    kv_item_lens: list[int]
    kv_layer_ids: list[int]
    aux_data_ptrs: list[int]
    aux_data_lens: list[int]
    aux_item_lens: list[int]
    state_types: list[StateType]
    state_data_ptrs: list[list[int]]
    state_data_lens: list[list[int]]
    state_item_lens: list[list[int]]
    state_layer_ids: list[list[int]]
    ib_device: str
    gpu_id: int
    kv_head_num: int
    total_kv_head_num: int
    page_size: int
    system_dp_rank: int
    pp_rank: int
    prefill_start_layer: int
    prefill_end_layer: int | None
    mla_compression_ratios: list[int] | None
    num_draft_entries: int

class KVPoll:
    Failed: int
    Bootstrapping: int
    WaitingForInput: int
    Transferring: int
    Success: int

class BaseKVManager:
    enable_deferred_decode_kv_release: bool
    supports_host_destination: bool
    supports_role_switch: bool
    supports_deferred_decode_kv_release: bool
    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: ServerArgs,
        is_mla_backend: bool | None = False,
    ) -> None: ...
    def register_to_bootstrap(self) -> None: ...
    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool: ...
    def teardown(self) -> None: ...

class BaseKVSender:
    def __init__(
        self,
        mgr: BaseKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ) -> None: ...
    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None: ...
    def send(
        self,
        kv_indices: npt.NDArray[np.int32],
        state_indices: list[Any] | None = None,
        num_kv_tokens: int | None = None,
    ) -> None: ...
    def pop_decode_prefix_len(self) -> int: ...
    def get_max_transfer_tokens(self) -> int | None: ...
    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool: ...
    def get_transfer_metric(self) -> KVTransferMetric: ...
    def poll(self) -> int: ...
    def failure_exception(self) -> None: ...
    def clear(self) -> None: ...
    def abort(self) -> None: ...

class BaseKVReceiver:
    @property
    def supports_host_destination(self) -> bool: ...
    def is_abort_release_safe(self) -> bool: ...
    def __init__(
        self, mgr: BaseKVManager, bootstrap_addr: str, bootstrap_room: int | None = None
    ) -> None: ...
    def init(self, prefill_dp_rank: int) -> None: ...
    def send_metadata(
        self,
        kv_indices: npt.NDArray[np.int32],
        aux_index: int | None = None,
        state_indices: list[Any] | None = None,
        decode_prefix_len: int | None = None,
        destination: KVTransferDestination = ...,
    ) -> None: ...
    def poll(self) -> int: ...
    def failure_exception(self) -> None: ...
    def clear(self) -> None: ...
    def abort(self) -> None: ...

class BaseKVBootstrapServer:
    def __init__(self, host: str, port: int) -> None: ...
