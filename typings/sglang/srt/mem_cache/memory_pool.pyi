import torch

class MLATokenToKVPool:
    kv_buffer: list[torch.Tensor]
    page_size: int
    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        layer_num: int,
        device: str,
        enable_memory_saver: bool,
        start_layer: int | None = None,
        end_layer: int | None = None,
        use_dsa: bool = False,
        override_kv_cache_dim: int | None = None,
        dcp_replicated: bool = False,
    ) -> None: ...
    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]: ...

class ReqToTokenPool:
    req_to_token: torch.Tensor
    def __init__(self, size: int, max_context_len: int, device: str, enable_memory_saver: bool) -> None: ...
