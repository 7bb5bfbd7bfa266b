"""Errors of the mapping layer beyond the base ``MappingError`` (``pdkv.mapping`` re-exports them).

Owns: exception classes only. Must not import anything from pdkv but ``pdkv.errors``.

    MappingError
      TopologyError    a prefill/decode parallel layout pdkv cannot (or does not yet) map
"""

from __future__ import annotations

from pdkv.errors import MappingError


class TopologyError(MappingError):
    """A prefill/decode parallel layout that pdkv cannot (or does not yet) map."""
