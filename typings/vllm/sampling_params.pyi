from typing import Any

class SamplingParams:
    def __init__(
        self,
        *,
        max_tokens: int | None = ...,
        temperature: float = ...,
        ignore_eos: bool = ...,
        detokenize: bool = ...,
        extra_args: dict[str, Any] | None = ...,
    ) -> None: ...
