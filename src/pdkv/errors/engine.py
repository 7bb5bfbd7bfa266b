"""Errors of the transfer backends (``pdkv.engine``), all ``TransferError``s.

Owns: the exception classes ``pdkv.engine`` raises (``pdkv.engine.backend``, ``.mooncake`` and
``.sockets`` re-export them). Must not import anything from pdkv but ``pdkv.errors``: a batch's
outcome is described by the ``BatchOutcomeLike`` protocol, which ``pdkv.engine.backend.BatchOutcome``
satisfies.

    TransferError
      RegistrationError                a region could not be (un)registered (also a ValueError)
        UnregisteredMemoryError        ... a block's source lies outside every registered region
      InvalidBatchError                a malformed batch or peer (also a ValueError)
      BackendClosedError               the backend was closed
      ForeignHandleError               another backend's handle or registration (also a ValueError)
      BatchFailedError                 a batch ended FAILED
      BatchTimedOutError               a batch did not finish in time (it may still be in flight)
      EngineInitError                  the Mooncake engine's set-up call returned a failure code
      PeerMetadataError                a peer's engine metadata is malformed or the engine refused it
      ConnectionCutUnavailableError    sockets cannot be destroyed here (no CAP_NET_ADMIN, ...)
"""

from __future__ import annotations

from typing import Protocol

from pdkv.errors import TransferError


class _HandleLike(Protocol):
    @property
    def serial(self) -> int: ...

    @property
    def peer(self) -> str: ...

    @property
    def entries(self) -> int: ...

    @property
    def total_bytes(self) -> int: ...


class BatchOutcomeLike(Protocol):
    """What the batch errors report of a batch (``pdkv.engine.backend.BatchOutcome``)."""

    @property
    def handle(self) -> _HandleLike: ...

    @property
    def reason(self) -> str: ...


class RegistrationError(TransferError, ValueError):
    """A memory region could not be registered or unregistered (overlap, zero length, engine refusal)."""


class UnregisteredMemoryError(RegistrationError):
    """A block's local source range lies outside every region registered with this backend."""

    def __init__(self, message: str, *, block: int, address: int, length: int) -> None:
        super().__init__(message)
        self.block = block
        self.address = address
        self.length = length


class InvalidBatchError(TransferError, ValueError):
    """The batch or peer given to ``submit_write`` is malformed (a caller bug; nothing was submitted)."""


class BackendClosedError(TransferError):
    """The backend was closed; it accepts no more registrations or batches."""


class ForeignHandleError(TransferError, ValueError):
    """A handle or registration made by another backend was passed to this one."""


def _batch(outcome: BatchOutcomeLike, what: str) -> str:
    handle = outcome.handle
    return (
        f"batch {handle.serial} to {handle.peer!r} ({handle.entries} blocks, {handle.total_bytes} B) "
        f"{what}: {outcome.reason}"
    )


class BatchFailedError(TransferError):
    """A batch ended FAILED (raised by the synchronous ``write`` and ``WaitResult.raise_for_status``)."""

    def __init__(self, outcome: BatchOutcomeLike) -> None:
        super().__init__(_batch(outcome, "failed"))
        self.outcome = outcome


class BatchTimedOutError(TransferError):
    """A batch did not finish in time; it may still be in flight (see ``pdkv.engine.backend``)."""

    def __init__(self, outcome: BatchOutcomeLike) -> None:
        super().__init__(_batch(outcome, "timed out"))
        self.outcome = outcome


class EngineInitError(TransferError):
    """``TransferEngine.initialize`` (or another setup call) returned a failure code."""


class PeerMetadataError(TransferError, ValueError):
    """A peer's engine metadata (``TransferBackend.add_peer``) is malformed, names another session, or
    the engine refused to load it; nothing about the peer changed."""


class ConnectionCutUnavailableError(TransferError):
    """Sockets cannot be destroyed here (no ``CAP_NET_ADMIN``, a kernel without ``INET_DIAG_DESTROY``,
    not Linux): nothing was cut; the caller must fall back to a time bound."""
