from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

class Scheduler:
    connector: KVConnectorBase_V1 | None
    kv_cache_manager: KVCacheManager
    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        structured_output_manager: StructuredOutputManager,
        block_size: int,
        *,
        log_stats: bool = ...,
    ) -> None: ...
    def add_request(self, request: Request) -> None: ...
    def schedule(self) -> SchedulerOutput: ...
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, Any]: ...
    def finish_requests(self, request_ids: str | list[str], finished_status: RequestStatus) -> Any: ...
    def has_requests(self) -> bool: ...
