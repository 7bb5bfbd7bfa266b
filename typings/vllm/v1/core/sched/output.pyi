from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

class NewRequestData:
    req_id: str
    prompt_token_ids: list[int] | None
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int

class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    preempted_req_ids: set[str] | None
    kv_connector_metadata: KVConnectorMetadata | None
