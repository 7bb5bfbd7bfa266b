from sglang.srt.mem_cache.cache_init_params import CacheInitParams

class RadixCache:
    def __init__(self, params: CacheInitParams) -> None: ...
