from collections.abc import Iterable

DISAGG_TRANSFER_BACKEND_CHOICES: list[str]

def add_disagg_transfer_backend_choices(values: Iterable[str], /) -> None: ...
