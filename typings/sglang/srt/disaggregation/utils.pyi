import enum

import torch

class DisaggregationMode(enum.Enum):
    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"

class TransferBackend(enum.Enum):
    MOONCAKE = "mooncake"
    MORI = "mori"
    NIXL = "nixl"
    ASCEND = "ascend"
    FAKE = "fake"

class KVClassType(enum.Enum):
    KVARGS = "kvargs"
    MANAGER = "manager"
    SENDER = "sender"
    RECEIVER = "receiver"
    BOOTSTRAP_SERVER = "bootstrap_server"

def get_kv_class(transfer_backend: TransferBackend, class_type: KVClassType) -> type | None: ...

class MetadataBuffers:
    bootstrap_room: torch.Tensor
    output_ids: torch.Tensor
    def __init__(
        self,
        size: int,
        hidden_size: int,
        hidden_states_dtype: torch.dtype,
        max_sampling_mask_tokens: int,
        max_top_logprobs_num: int = 128,
        custom_mem_pool: object = None,
        output_dsa_topk_indices_dim: int = 0,
        *,
        kv_checksum_enabled: bool = False,
    ) -> None: ...
    def get_buf_infos(self) -> tuple[list[int], list[int], list[int]]: ...

def setup_state_kv_args(
    kv_args: object,
    token_to_kv_pool: object,
    draft_token_to_kv_pool: object = None,
    total_kv_layers: int | None = None,
    req_to_token_pool: object = None,
) -> None: ...

class ReqToMetadataIdxAllocator:
    def __init__(self, size: int) -> None: ...
    def available_size(self) -> int: ...
    def alloc(self) -> int | None: ...

def poll_and_all_reduce_attn_cp_tp_group(
    pollers: list[object], attn_cp_cpu_group: object, attn_tp_cpu_group: object
) -> list[int]: ...
