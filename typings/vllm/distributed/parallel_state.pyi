def init_distributed_environment(
    world_size: int = ...,
    rank: int = ...,
    distributed_init_method: str = ...,
    local_rank: int = ...,
    backend: str = ...,
) -> None: ...
def initialize_model_parallel(
    tensor_model_parallel_size: int = ..., pipeline_model_parallel_size: int = ...
) -> None: ...
