class CacheInitParams:
    def __init__(
        self, *, disable: bool, req_to_token_pool: object, token_to_kv_pool_allocator: object, page_size: int
    ) -> None: ...
