import torch

class KVCacheSpec:
    block_size: int

class FullAttentionSpec(KVCacheSpec):
    def __init__(self, *, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype) -> None: ...

class MLAAttentionSpec(FullAttentionSpec): ...

class SlidingWindowSpec(KVCacheSpec):
    def __init__(
        self, *, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype, sliding_window: int
    ) -> None: ...

class KVCacheTensor: ...

class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: KVCacheSpec
    def __init__(self, layer_names: list[str], kv_cache_spec: KVCacheSpec) -> None: ...

class KVCacheConfig:
    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list[KVCacheGroupSpec]
    def __init__(
        self, num_blocks: int, kv_cache_tensors: list[KVCacheTensor], kv_cache_groups: list[KVCacheGroupSpec]
    ) -> None: ...
