# What pdkv's vLLM tests use of transformers (a tiny Llama config.json, no weights). The package is in
# the SGLang/vLLM closures, which `make test` installs after the type check.
from os import PathLike

class LlamaConfig:
    def __init__(
        self,
        *,
        hidden_size: int = ...,
        intermediate_size: int = ...,
        num_hidden_layers: int = ...,
        num_attention_heads: int = ...,
        num_key_value_heads: int | None = ...,
        head_dim: int | None = ...,
        vocab_size: int = ...,
        max_position_embeddings: int = ...,
        dtype: str | None = ...,
    ) -> None: ...
    def save_pretrained(self, save_directory: str | PathLike[str]) -> None: ...
