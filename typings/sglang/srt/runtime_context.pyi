# Process-wide config SGLang's schedulers publish before building their queues.
from typing import Any

from sglang.srt.server_args import ServerArgs

class SpawnRanks:
    world_rank: int
    dp_rank: int | None
    gpu_id: int | None
    def __init__(self, world_rank: int, dp_rank: int | None = None, gpu_id: int | None = None) -> None: ...

def publish(
    server_args: ServerArgs, *, role: str, hf_config: Any = None, ranks: SpawnRanks | None = None
) -> Any: ...

class ParallelContext:
    def override_permanently(self, **values: Any) -> None: ...

def get_parallel() -> ParallelContext: ...
