class KVTransferError(Exception):
    bootstrap_room: int
    failure_reason: str
    is_from_another_rank: bool
    def __init__(
        self, bootstrap_room: int, failure_reason: str, is_from_another_rank: bool = False
    ) -> None: ...
