class KVConnectorOutput:
    finished_sending: set[str] | None
    finished_recving: set[str] | None
    invalid_block_ids: set[int]
    def __init__(
        self,
        *,
        finished_sending: set[str] | None = ...,
        finished_recving: set[str] | None = ...,
        invalid_block_ids: set[int] = ...,
    ) -> None: ...

class ModelRunnerOutput:
    kv_connector_output: KVConnectorOutput | None
    def __init__(
        self,
        *,
        req_ids: list[str],
        req_id_to_index: dict[str, int],
        sampled_token_ids: list[list[int]] = ...,
        kv_connector_output: KVConnectorOutput | None = ...,
    ) -> None: ...
