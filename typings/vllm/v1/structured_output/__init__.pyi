from vllm.config import VllmConfig

class StructuredOutputManager:
    def __init__(self, vllm_config: VllmConfig) -> None: ...
