# Only the name the plugin's hook must rebind (imported here with ``from ... import get_kv_class``).
# What tests/adapters drive of SGLang's own decode code (stand-in scheduler, one-rank gloo group).
from typing import Any

from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator, TransferBackend
from sglang.srt.disaggregation.utils import get_kv_class as get_kv_class
from sglang.srt.managers.schedule_batch import Req

class DecodeRequest:
    req: Req
    kv_receiver: Any
    metadata_buffer_index: int
    waiting_for_input: bool

class DecodeTransferQueue:
    queue: list[DecodeRequest]
    def __init__(
        self,
        req_to_metadata_buffer_idx_allocator: ReqToMetadataIdxAllocator,
        metadata_buffers: MetadataBuffers,
        scheduler: object,
        tree_cache: object,
    ) -> None: ...
    def extend(self, decode_reqs: list[DecodeRequest]) -> None: ...
    def pop_transferred(self, rids_to_check: list[str] | None = None) -> list[Req]: ...

class DecodePreallocQueue:
    queue: list[DecodeRequest]
    kv_manager: Any
    def __init__(
        self,
        req_to_token_pool: object,
        token_to_kv_pool_allocator: object,
        draft_token_to_kv_pool: object,
        req_to_metadata_buffer_idx_allocator: ReqToMetadataIdxAllocator,
        metadata_buffers: MetadataBuffers,
        scheduler: object,
        transfer_queue: DecodeTransferQueue,
        tree_cache: object,
        gpu_id: int,
        bootstrap_port: int,
        max_total_num_tokens: int,
        num_reserved_decode_tokens: int,
        transfer_backend: TransferBackend,
    ) -> None: ...
    def add(self, req: Req, is_retracted: bool = False, is_rebootstrap: bool = False) -> None: ...
    def pop_preallocated(
        self,
        rids_to_check: list[str] | None = None,
        pp_good_rids: list[str] | None = None,
        pp_bad_rids: list[str] | None = None,
    ) -> tuple[list[DecodeRequest], list[DecodeRequest]]: ...
