"""The layout-policy setting both transports' configs carry (``PrefillConfig`` and ``DecodeConfig``).

Owns: ``LAYOUT_POLICY_ENV``, the field metadata of its ``PDKV_*`` variable, declared once through
``pdkv.config`` (both configs' ``layout_policy`` fields carry it, default ``DEFAULT_LAYOUT_POLICY``),
and ``layout_policy_from_env`` for embedders that build their configs field by field.
Must not hold the policy's rule (that is ``pdkv.mapping.layout_policy``) or read the environment
outside ``from_env``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Final

from pdkv import config
from pdkv.errors import ConfigError
from pdkv.mapping import DEFAULT_LAYOUT_POLICY, LayoutPolicy


def _parse(text: str) -> LayoutPolicy:
    try:
        return LayoutPolicy.parse(text)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


LAYOUT_POLICY_ENV: Final = config.text_var(
    "PDKV_LAYOUT_POLICY",
    "Both sides: strict (any layout difference refuses the registration) or degrade_draft (draft-model "
    "buffers only one side registers are left out of that pair's transfers; target buffers must match)",
    _parse,
)


def layout_policy_from_env(env: Mapping[str, str] | None = None) -> LayoutPolicy:
    """``PDKV_LAYOUT_POLICY`` from ``env`` (``os.environ`` by default), else ``DEFAULT_LAYOUT_POLICY``;
    a value that names no policy is a ``ConfigError`` naming the variable and the choices."""
    (var,) = LAYOUT_POLICY_ENV.values()
    source = os.environ if env is None else env
    raw = source.get(var.name)
    if raw is None:
        return DEFAULT_LAYOUT_POLICY
    try:
        return _parse(raw)
    except ConfigError as exc:
        raise ConfigError(f"{var.name}={raw!r} is not valid: {exc}") from None


__all__ = ["LAYOUT_POLICY_ENV", "layout_policy_from_env"]
