"""Structured log of the transports: one JSON object per line, the input of ``pdkv trace``.

Owns: ``describe`` (one message as a short label, shared with the generated sequence diagrams),
``JsonFormatter`` (a ``logging.Formatter`` writing a record, and the fields a caller passed as
``extra={"pdkv": {...}}``, as one JSON object),
``MessageTrace`` (what a transport's host hands it: each message received, each effect carried
out, and each room state change, logged on ``pdkv.trace`` at DEBUG with room, rank, message and
state as fields) and ``install`` / ``install_from_env`` (a JSON file handler; ``PDKV_LOG_JSON=PATH``
turns it on for every transport of the process, PATH a file or an existing folder).

Must not change what the transports do: with no JSON log installed, ``pdkv.trace`` is at WARNING
and each hook returns after one level check. Times are the records' wall clock (``time.time``):
ranks on one host compare directly; across hosts they are only as good as the clocks' sync.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, assert_never

from pdkv import config
from pdkv.errors import ConfigError
from pdkv.protocol.effects import (
    CutConnections,
    DropLayers,
    Effect,
    ForgetPeer,
    LeaseLanding,
    Notice,
    NoticeLevel,
    ReleasePages,
    RoomFinished,
    ScatterLanding,
    Send,
    SubmitChunk,
    SubmitFence,
    VerifyChecksums,
)
from pdkv.protocol.ids import RoomId
from pdkv.protocol.messages import (
    Abort,
    AbortAck,
    Heartbeat,
    HeartbeatAck,
    Message,
    Origin,
    Outcome,
    RegisterAck,
    RegisterReject,
    TransferRequest,
    TransferStatus,
)
from pdkv.protocol.poll import KVPoll

TRACE_LOGGER = "pdkv.trace"
ENV = config.declare(
    "PDKV_LOG_JSON", "A file or folder: one JSON line per message, state change and release (pdkv trace)"
).name
FIELDS = ("event", "room", "rank", "epoch", "addr", "peer", "peer_addr", "msg", "state", "detail")
"""The fields a record may carry, as ``extra={"pdkv": {...}}`` (one key: no clash with the
attributes of a ``LogRecord``); ``JsonFormatter`` writes those present beside the record's own."""

_NOTICE_LEVELS = {
    NoticeLevel.DEBUG: logging.DEBUG,
    NoticeLevel.INFO: logging.INFO,
    NoticeLevel.WARNING: logging.WARNING,
}
_STATES_KEPT = 65536
"""Rooms whose last logged state a trace remembers (a forgotten room may log its state again)."""

_trace = logging.getLogger(TRACE_LOGGER)
_trace.setLevel(logging.WARNING)  # off until a JSON log is installed: never floods text logs
_trace.propagate = False
_installed: dict[str, logging.Handler] = {}
_install_lock = threading.Lock()


def describe(message: Message) -> str:
    """``TransferRequest(8 pages, prefix 2)``, ``TransferStatus(Success)``, ``Abort`` ...

    Short and without addresses, epochs or reasons, so a generated diagram changes only when the
    exchange does.
    """
    name = type(message).__name__
    if isinstance(message, TransferRequest):
        if message.dummy:
            return f"{name}(dummy)"
        prefix = f", prefix {message.prefix_pages}" if message.prefix_pages else ""
        return f"{name}({message.dst_pages.size} pages{prefix})"
    if isinstance(message, TransferStatus):
        return f"{name}({'Success' if message.outcome is Outcome.SUCCESS else 'Failed'})"
    if isinstance(message, RegisterReject):
        return f"{name}({'retry' if message.retry else 'fatal'})"
    if isinstance(message, RegisterAck) and message.leaves_out:
        left = len(message.prefill_left_out), len(message.decode_left_out)
        return f"{name}(leaves out {left[0]} prefill + {left[1]} decode buffers)"
    if isinstance(message, Heartbeat | HeartbeatAck):
        return f"{name}({message.seq})"
    return name


def room_of(message: Message) -> RoomId | None:
    return message.room if isinstance(message, TransferRequest | TransferStatus | Abort | AbortAck) else None


def rank_name(origin: Origin) -> str:
    """``prefill-0 tp0 cp1``: a rank across its restarts (the epoch is a field of its own)."""
    return f"{origin.instance} tp{origin.rank.tp} cp{origin.rank.cp}"


class JsonFormatter(logging.Formatter):
    """A record as one JSON line: time, level, logger, process, text, and the ``FIELDS`` it carries."""

    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "t": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "proc": self.process,
            "text": record.getMessage(),
        }
        fields = record.__dict__.get("pdkv")
        if isinstance(fields, dict):
            out.update((key, fields[key]) for key in FIELDS if fields.get(key) is not None)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"))


def install(path: str, *, process: str | None = None, level: int = logging.INFO) -> logging.Handler:
    """Write the process's log records (``level`` and up) and the transports' trace as JSON lines to
    ``path`` (appended; a folder gets ``pdkv-<pid>.jsonl``). Installing one path twice changes nothing."""
    if os.path.isdir(path):
        path = os.path.join(path, f"pdkv-{os.getpid()}.jsonl")
    with _install_lock:
        if path in _installed:
            return _installed[path]
        handler = logging.FileHandler(path, mode="a", encoding="utf-8")
        handler.setFormatter(JsonFormatter(process or f"pid {os.getpid()}"))
        handler.setLevel(logging.DEBUG)
        root = logging.getLogger()
        # The root handler gets only `level` and up (the trace logger does not propagate).
        handler.addFilter(lambda record: record.name == TRACE_LOGGER or record.levelno >= level)
        root.addHandler(handler)
        _trace.addHandler(handler)
        _trace.setLevel(logging.DEBUG)
        _installed[path] = handler
        return handler


def uninstall(handler: logging.Handler) -> None:
    """Undo ``install`` (tests; a process that stops tracing): detach and close the handler."""
    with _install_lock:
        for path, installed in list(_installed.items()):
            if installed is handler:
                del _installed[path]
        logging.getLogger().removeHandler(handler)
        _trace.removeHandler(handler)
        if not _installed:
            _trace.setLevel(logging.WARNING)
        handler.close()


def install_from_env() -> logging.Handler | None:
    """``install(os.environ["PDKV_LOG_JSON"])`` when it is set (every transport calls this);
    ``ConfigError`` naming the variable when that path cannot be written."""
    path = os.environ.get(ENV)
    if not path:
        return None
    try:
        return install(path)
    except OSError as exc:
        raise ConfigError(f"{ENV}={path!r}: cannot write the JSON log there: {exc}") from exc


class TracedEndpoint(Protocol):
    """What ``MessageTrace`` reads of a sans-IO endpoint (both sides have it)."""

    origin: Origin

    def poll(self, room: RoomId) -> KVPoll: ...


class MessageTrace:
    """The trace hooks of one transport host (lock held by the caller, as for the endpoint).

    ``received(message)`` before the endpoint handles a message; ``effects(effects)`` with what the
    endpoint answered to any input, before the host carries it out (the endpoint's state is then
    already the one after the input). Logs the room's new poll state, once per change.
    """

    def __init__(self, endpoint: TracedEndpoint, address: Callable[[], str]) -> None:
        install_from_env()
        self._endpoint = endpoint
        self._address = address
        self._states: dict[RoomId, str] = {}
        self._pending: RoomId | None = None

    def _fields(self, **fields: object) -> dict[str, object]:
        origin = self._endpoint.origin
        fields.update(rank=rank_name(origin), epoch=int(origin.epoch), addr=self._address())
        return {"pdkv": fields}

    def received(self, message: Message) -> None:
        if not _trace.isEnabledFor(logging.DEBUG):
            return
        try:
            self._received(message)
        except Exception:  # a diagnostic must never fail the transport it watches
            self._broken()

    def effects(self, effects: Sequence[Effect]) -> None:
        if not _trace.isEnabledFor(logging.DEBUG):
            return
        try:
            self._effects(effects)
        except Exception:  # a diagnostic must never fail the transport it watches
            self._broken()

    def _broken(self) -> None:
        logging.getLogger(__name__).exception("JSON trace of %s failed; tracing stops", self._endpoint.origin)
        _trace.setLevel(logging.WARNING)

    def _received(self, message: Message) -> None:
        room = room_of(message)
        self._pending = room
        text = describe(message)
        _trace.debug(
            "recv %s from %s",
            text,
            message.origin,
            extra=self._fields(
                event="recv", room=room, msg=text, peer=rank_name(message.origin), detail=_reason(message)
            ),
        )

    def _effects(self, effects: Sequence[Effect]) -> None:
        rooms: list[RoomId] = [] if self._pending is None else [self._pending]
        self._pending = None
        for effect in effects:
            room = room_of(effect.message) if isinstance(effect, Send) else getattr(effect, "room", None)
            if isinstance(room, int) and room not in rooms:
                rooms.append(RoomId(room))
        for room in rooms:
            self._state(room)
        for effect in effects:
            self._effect(effect)

    def _state(self, room: RoomId) -> None:
        name = self._endpoint.poll(room).name
        if self._states.get(room) == name:
            return
        self._states[room] = name
        if len(self._states) > _STATES_KEPT:  # bounded: forget the room seen longest ago
            del self._states[next(iter(self._states))]
        _trace.debug("room %s %s", room, name, extra=self._fields(event="state", room=room, state=name))

    def _effect(self, effect: Effect) -> None:
        match effect:
            case Send():
                text = describe(effect.message)
                room = room_of(effect.message)
                extra = self._fields(
                    event="send",
                    room=room,
                    msg=text,
                    peer_addr=str(effect.to),
                    detail=_reason(effect.message),
                )
                _trace.debug("send %s to %s", text, effect.to, extra=extra)
            case SubmitChunk():
                detail = f"chunk {effect.chunk}, {effect.spec.pages.size} pages"
                extra = self._fields(event="write", room=effect.room, detail=detail)
                _trace.debug("room %s: submit %s", effect.room, detail, extra=extra)
            case RoomFinished():
                cause = "" if effect.cause is None else effect.cause.value
                extra = self._fields(event="finished", room=effect.room, state=effect.poll.name, detail=cause)
                _trace.debug("room %s finished %s %s", effect.room, effect.poll.name, cause, extra=extra)
            case ReleasePages():
                detail = effect.kind.value
                extra = self._fields(event="release", room=effect.room, detail=detail)
                _trace.debug("room %s: pages released (%s)", effect.room, detail, extra=extra)
            case Notice():
                if effect.room is not None:
                    # At the notice's own level, with its text as the host logs it (a reader can pair them).
                    extra = self._fields(event="notice", room=effect.room)
                    _trace.log(_NOTICE_LEVELS[effect.level], "%s", effect.text, extra=extra)
            case ForgetPeer():
                _trace.debug("%s", effect, extra=self._fields(event="forget"))
            case DropLayers():
                _trace.debug("%s", effect, extra=self._fields(event="drop_layers", room=effect.room))
            case SubmitFence():
                _trace.debug("%s", effect, extra=self._fields(event="fence", room=effect.room))
            case CutConnections():
                _trace.debug("%s", effect, extra=self._fields(event="cut", room=effect.room))
            case VerifyChecksums():
                detail = f"{effect.dst_pages.size} pages, {len(effect.reports)} prefill rank(s)"
                extra = self._fields(event="verify", room=effect.room, detail=detail)
                _trace.debug("room %s: verify checksums of %s", effect.room, detail, extra=extra)
            case LeaseLanding():
                detail = (
                    f"{effect.dst_pages.size - effect.prefix_pages} slots, {len(effect.sources)} source(s)"
                )
                extra = self._fields(event="lease_landing", room=effect.room, detail=detail)
                _trace.debug("room %s: lease landing space for %s", effect.room, detail, extra=extra)
            case ScatterLanding():
                detail = f"{len(effect.grants)} source(s)"
                extra = self._fields(event="scatter", room=effect.room, detail=detail)
                _trace.debug("room %s: scatter the landing lease of %s", effect.room, detail, extra=extra)
            case _:
                assert_never(effect)


def _reason(message: Message) -> str | None:
    reason = getattr(message, "reason", None)
    return reason if isinstance(reason, str) and reason else None
