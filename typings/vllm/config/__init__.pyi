from contextlib import AbstractContextManager
from typing import Any

class ModelConfig:
    def __init__(
        self,
        model: str,
        *,
        skip_tokenizer_init: bool = ...,
        dtype: str = ...,
        max_model_len: int | None = ...,
        seed: int | None = ...,
    ) -> None: ...

class CacheConfig:
    block_size: int
    num_gpu_blocks: int | None
    def __init__(self, *, block_size: int = ..., enable_prefix_caching: bool = ...) -> None: ...

class SchedulerConfig:
    def __init__(
        self,
        *,
        max_num_seqs: int = ...,
        max_num_batched_tokens: int = ...,
        max_model_len: int = ...,
        enable_chunked_prefill: bool = ...,
        is_encoder_decoder: bool = ...,
    ) -> None: ...

class ParallelConfig:
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int

class DeviceConfig:
    def __init__(self, device: str = ...) -> None: ...

class KVTransferConfig:
    kv_connector: str | None
    kv_connector_module_path: str | None
    kv_role: str | None
    engine_id: str | None
    kv_connector_extra_config: dict[str, Any]
    kv_load_failure_policy: str
    def __init__(
        self,
        *,
        kv_connector: str | None = ...,
        kv_connector_module_path: str | None = ...,
        kv_role: str | None = ...,
        kv_load_failure_policy: str = ...,
        kv_connector_extra_config: dict[str, Any] = ...,
        engine_id: str | None = ...,
    ) -> None: ...

class VllmConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    kv_transfer_config: KVTransferConfig | None
    speculative_config: object | None
    def __init__(
        self,
        *,
        model_config: ModelConfig = ...,
        cache_config: CacheConfig = ...,
        scheduler_config: SchedulerConfig = ...,
        kv_transfer_config: KVTransferConfig | None = ...,
        device_config: DeviceConfig = ...,
        parallel_config: ParallelConfig = ...,
    ) -> None: ...

def set_current_vllm_config(vllm_config: VllmConfig) -> AbstractContextManager[None]: ...
