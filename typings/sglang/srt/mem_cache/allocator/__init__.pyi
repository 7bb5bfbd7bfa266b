import torch

class PagedTokenToKVPoolAllocator:
    page_size: int
    def __init__(
        self, size: int, page_size: int, dtype: torch.dtype, device: str, kvcache: object, need_sort: bool
    ) -> None: ...
    def alloc(self, need_size: int) -> torch.Tensor | None: ...
