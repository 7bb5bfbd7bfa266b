# Stubs for the parts of vLLM 0.33.0 pdkv's adapter and its tests use (typing only; see README).
from collections.abc import Sequence
from typing import Any

from vllm.config import KVTransferConfig
from vllm.inputs import TokensPrompt
from vllm.sampling_params import SamplingParams as SamplingParams

class CompletionOutput:
    token_ids: Sequence[int]

class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    num_cached_tokens: int | None
    kv_transfer_params: dict[str, Any] | None

class LLM:
    def __init__(
        self,
        model: str,
        *,
        load_format: str = ...,
        enforce_eager: bool = ...,
        skip_tokenizer_init: bool = ...,
        block_size: int | None = ...,
        dtype: str = ...,
        max_model_len: int | None = ...,
        seed: int | None = ...,
        kv_transfer_config: KVTransferConfig | None = ...,
        **kwargs: Any,
    ) -> None: ...
    def generate(
        self,
        prompts: Sequence[TokensPrompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = ...,
        *,
        use_tqdm: bool = ...,
    ) -> list[RequestOutput]: ...
