from collections.abc import Callable
from typing import Any

def get_hash_fn_by_name(hash_fn_name: str) -> Callable[[Any], bytes]: ...
