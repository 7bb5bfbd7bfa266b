import enum
from collections.abc import Callable
from typing import Any, NamedTuple

class HookSource(NamedTuple):
    plugin_name: str
    dist_name: str | None

class HookType(enum.Enum):
    BEFORE = "before"
    AFTER = "after"
    AROUND = "around"
    REPLACE = "replace"

class HookRegistry:
    _hooks: dict[str, list[tuple[HookType, Callable[..., Any], HookSource | None]]]
    _patched: set[str]
    @classmethod
    def register(
        cls,
        target: str,
        hook: Callable[..., Any],
        hook_type: HookType = ...,
        *,
        source: HookSource | None = None,
    ) -> None: ...
    @classmethod
    def apply_hooks(cls) -> None: ...
    @classmethod
    def reset(cls) -> None: ...
