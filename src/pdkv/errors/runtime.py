"""Errors of the transports' runtime (``pdkv.runtime`` re-exports them where they are raised).

Owns: exception classes only. Must not import anything from pdkv but ``pdkv.errors``.

    PdkvError
      ConsensusError        ranks disagree on what they reduce (different room counts)
    TransferError
      JobFinishedError      ``submit`` on a transfer job whose ``finish`` already ran
    MappingError
      UnknownLayerError     ``on_layer_end`` named a layer the rank's layout has no KV buffer for
"""

from __future__ import annotations

from pdkv.errors import MappingError, PdkvError, TransferError


class ConsensusError(PdkvError):
    """Ranks disagree on what they are reducing (different room counts)."""


class JobFinishedError(TransferError):
    """``submit`` was called on a job whose ``finish`` already ran."""


class UnknownLayerError(MappingError):
    """``on_layer_end`` named a layer the rank's layout has no KV buffer for (a wiring bug)."""
