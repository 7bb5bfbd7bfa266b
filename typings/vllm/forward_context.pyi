from contextlib import AbstractContextManager
from typing import Any

from vllm.config import VllmConfig

class ForwardContext: ...

def set_forward_context(attn_metadata: Any, vllm_config: VllmConfig) -> AbstractContextManager[None]: ...
