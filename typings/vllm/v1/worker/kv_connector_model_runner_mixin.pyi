from contextlib import AbstractContextManager

from vllm.config import VllmConfig
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

class KVConnectorModelRunnerMixin:
    @staticmethod
    def kv_connector_no_forward(scheduler_output: SchedulerOutput, vllm_config: VllmConfig) -> ModelRunnerOutput: ...
    @staticmethod
    def _get_kv_connector_output(
        scheduler_output: SchedulerOutput, defer_finalize: bool = ...
    ) -> AbstractContextManager[KVConnectorOutput]: ...
