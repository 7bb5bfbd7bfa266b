# Only the name the plugin's hook must rebind (imported here with ``from ... import get_kv_class``).
# What tests/adapters drive of SGLang's own prefill code (stand-in scheduler, one-rank gloo group).
from typing import Any

from sglang.srt.disaggregation.base.conn import KVPoll as KVPoll
from sglang.srt.disaggregation.utils import (
    MetadataBuffers,
    ReqToMetadataIdxAllocator,
    TransferBackend,
)
from sglang.srt.disaggregation.utils import get_kv_class as get_kv_class
from sglang.srt.managers.schedule_batch import Req

class PrefillBootstrapQueue:
    queue: list[Req]
    kv_manager: Any
    def __init__(
        self,
        token_to_kv_pool: object,
        draft_token_to_kv_pool: object,
        req_to_metadata_buffer_idx_allocator: ReqToMetadataIdxAllocator,
        metadata_buffers: MetadataBuffers,
        gpu_id: int,
        bootstrap_port: int,
        max_total_num_tokens: int,
        scheduler: object,
        scheduler_stage_metrics: object,
        transfer_backend: TransferBackend,
    ) -> None: ...
    def add(self, req: Req, num_kv_heads: int) -> None: ...
    def pop_bootstrapped(self) -> list[Req]: ...
    def finalize_bootstrap(self, req: Req) -> bool: ...

class SchedulerDisaggregationPrefillMixin:
    def send_kv_chunk(self, req: Req, last_chunk: bool = False, end_idx: int | None = None) -> None: ...
