from array import array

from sglang.srt.mem_cache.base_prefix_cache import InsertParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams

class RadixKey:
    def __init__(self, token_ids: array[int], extra_key: str | None = None) -> None: ...

class RadixCache:
    def __init__(self, params: CacheInitParams) -> None: ...
    def insert(self, params: InsertParams) -> object: ...
