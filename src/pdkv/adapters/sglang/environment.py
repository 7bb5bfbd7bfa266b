"""The ``PDKV_*`` variables the SGLang adapter reads (declared with pdkv's others: README, "Environment")."""

from __future__ import annotations

from typing import Final

from pdkv import config

ADVERTISE_HOST: Final = config.declare(
    "PDKV_ADVERTISE_HOST", "SGLang adapter: the address other ranks reach this rank's control socket at"
).name
