import enum
from collections.abc import Callable
from typing import Any

from vllm.sampling_params import SamplingParams

class RequestStatus(enum.IntEnum):
    WAITING = ...
    WAITING_FOR_REMOTE_KVS = ...
    RUNNING = ...
    FINISHED_STOPPED = ...
    FINISHED_LENGTH_CAPPED = ...
    FINISHED_ABORTED = ...
    FINISHED_IGNORED = ...
    FINISHED_ERROR = ...

class Request:
    request_id: str
    status: RequestStatus
    kv_transfer_params: dict[str, Any] | None
    num_computed_tokens: int
    num_prompt_tokens: int
    num_output_tokens: int
    prompt_token_ids: list[int] | None
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int] | None,
        sampling_params: SamplingParams | None,
        pooling_params: object | None,
        *,
        block_hasher: Callable[[Request], list[Any]] | None = ...,
    ) -> None: ...
    def is_finished(self) -> bool: ...
