"""The error hierarchy of pdkv: one small tree, every error carries what an operator needs to act.

Owns: exception classes only: the base tree here, and each area's branch in a submodule
(``pdkv.errors.alloc``, ``.control``, ``.engine``, ``.mapping``, ``.metrics``, ``.runtime``), which the
areas re-export where they raise them. Every error pdkv raises is defined under this package and
importable from ``pdkv``. Must not import anything from pdkv (it is the bottom layer).

    PdkvError
      ProtocolError            a rule of the protocol was broken
        LocalProtocolError     ... by us (invalid trigger for a machine's state)
        RemoteProtocolError    ... by the peer (undecodable or invalid message)
      InvalidArgumentError     a scheduler call got a value of the wrong type or range
      MappingError             page-count or layout contract violated (would corrupt KV)
      LayoutError              a buffer layout (or a tensor behind it) cannot be described
                               truthfully: not contiguous, overlapping, empty, sizes that disagree
      LayoutMismatchError      two sides' buffer layouts differ
      TransferError            the transfer engine failed or timed out
      EngineUnavailableError   the engine module or its system libraries are missing
      ConfigError              a configuration value is invalid
      RouteUnavailableError    the bootstrap registry did not answer, or its route table is unusable
        RegistryError          ... the registry refused an announcement or a query
      TransportClosedError     a call on a transport after close() (or before start())
      DiagramScenarioError     a scenario drawn by ``pdkv diagram`` did not end as its story says
      TraceLogError            ``pdkv trace``: the logs are missing or hold nothing for the room
"""

from __future__ import annotations


class PdkvError(Exception):
    """Base of every error pdkv raises on purpose.

    ``room`` and ``peer`` name the room and the other side (a rank ``instance:tpN/cpM`` or an address)
    the error concerns, where there is one; None otherwise. The message says the same in words."""

    room: int | None
    peer: str | None

    def __init__(self, *args: object, room: int | None = None, peer: str | None = None) -> None:
        super().__init__(*args)
        self.room = room
        self.peer = peer


class ProtocolError(PdkvError):
    """A rule of the pdkv protocol was broken; the room or connection concerned is terminal."""


class LocalProtocolError(ProtocolError):
    """This side tried something the protocol forbids in its current state (a bug in the caller)."""

    def __init__(self, message: str, *, machine: str = "", state: str = "", trigger: str = "") -> None:
        super().__init__(message)
        self.machine = machine
        self.state = state
        self.trigger = trigger


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes or a message that the protocol does not allow."""


class InvalidArgumentError(PdkvError, ValueError, TypeError):
    """A scheduler-facing call got an argument of the wrong type or outside its range.

    Raised before anything changes: the room (if any) is exactly as it was before the call. Both a
    ``ValueError`` and a ``TypeError``, so callers that caught the built-in errors keep working.
    """

    def __init__(self, message: str, *, room: int | None = None, argument: str = "", value: object = None):
        super().__init__(message, room=room)
        self.argument = argument
        self.value = value


class MappingError(PdkvError, ValueError):
    """A mapping contract was violated: moving these pages would write the wrong bytes."""


class LayoutError(PdkvError, ValueError):
    """A buffer layout that does not describe its memory truthfully: a non-contiguous tensor view, two
    buffers that overlap, an empty buffer, bytes per item that disagree with the tensor's shape, a field
    out of range. Raised while the layout is built, before any byte is registered or moved; the
    message names the buffer (kind, model, layer) and the rule. ``field``: the field or argument."""

    def __init__(self, message: str, *, field: str = "") -> None:
        super().__init__(message)
        self.field = field


class LayoutMismatchError(PdkvError, ValueError):
    """The two sides registered different buffer layouts; carries both descriptions."""


class TransferError(PdkvError):
    """The transfer engine reported a failure (or timed out) for a batch."""


class EngineUnavailableError(PdkvError, ImportError):
    """The transfer engine module, or a system library it links against, is not installed."""


class ConfigError(PdkvError, ValueError):
    """A configuration value (or its PDKV_* environment override) is invalid."""


class TransportClosedError(PdkvError):
    """A call on a transport that was closed (its rooms failed, their peers told)."""


class RouteUnavailableError(PdkvError):
    """The bootstrap registry did not answer in time, or its route table is incomplete or incompatible."""


class RegistryError(RouteUnavailableError):
    """The bootstrap registry refused an announcement or a query (the reason is in the message)."""


class DiagramScenarioError(PdkvError):
    """A scenario that ``pdkv diagram`` records did not end as its story says (the protocol changed)."""

    def __init__(self, message: str, *, scenario: str) -> None:
        super().__init__(message)
        self.scenario = scenario


class TraceLogError(PdkvError):
    """``pdkv trace``: a log file is missing, or the logs hold no record of the room asked for."""

    def __init__(self, message: str, *, room: int | None = None) -> None:
        super().__init__(message, room=room)
