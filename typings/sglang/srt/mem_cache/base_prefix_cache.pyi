import torch
from sglang.srt.mem_cache.radix_cache import RadixKey

class InsertParams:
    def __init__(self, key: RadixKey | None = None, value: torch.Tensor | None = None) -> None: ...
