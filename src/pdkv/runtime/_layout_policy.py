"""The layout-policy setting both transports' configs carry (``PrefillConfig`` and ``DecodeConfig``).

Owns: ``LAYOUT_POLICY_ENV``, the field metadata of its ``PDKV_*`` variable, declared once through
``pdkv.config`` (both configs' ``layout_policy`` fields carry it, default ``DEFAULT_LAYOUT_POLICY``).
Must not hold the policy's rule (that is ``pdkv.mapping.layout_policy``) or read the environment
outside ``from_env``.
"""

from __future__ import annotations

from typing import Final

from pdkv import config
from pdkv.errors import ConfigError
from pdkv.mapping import LayoutPolicy


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


__all__ = ["LAYOUT_POLICY_ENV"]
