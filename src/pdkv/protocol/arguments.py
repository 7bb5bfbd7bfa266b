"""Checks of what a scheduler hands to pdkv, at the call, before anything changes.

Owns: turning the arguments of the scheduler-facing calls (``sender.init/send``, ``receiver.init``,
``transport.sender/receiver``, ``per_layer.register``) into validated values, and the errors that
say which argument of which room was wrong and with what value. Must not hold state: a call that
fails here has changed nothing, so the scheduler can correct it and call again.

Type and range problems raise ``InvalidArgumentError`` (both a ``ValueError`` and a ``TypeError``);
page lists that would corrupt KV if moved (duplicates) raise ``MappingError`` with a compact summary.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Final

import numpy as np

from pdkv.errors import InvalidArgumentError, MappingError
from pdkv.mapping._arrays import IntArray, device_of, int_bounds, summarize
from pdkv.protocol.ids import MAX_ROOM_ID, RoomId
from pdkv.protocol.messages import MAX_INDEX, StateIndices

_SHOWN: Final = 60  # characters of a bad value's repr in an error message


def describe(value: object) -> str:
    """``int 5`` / ``str '5'`` / ``ndarray shape (2, 2) float64``: a bad value, short enough to log."""
    if isinstance(value, np.ndarray):
        return f"ndarray shape {value.shape} {value.dtype}"
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype"):
        return f"{type(value).__name__} shape {tuple(shape)} {value.dtype}"
    text = repr(value)
    if len(text) > _SHOWN:
        text = text[: _SHOWN - 3] + "..."
    return f"{type(value).__name__} {text}"


def _bad(text: str, room: int | None, argument: str, value: object) -> InvalidArgumentError:
    return InvalidArgumentError(text, room=room, argument=argument, value=value)


def _where(room: int | None) -> str:
    return "" if room is None else f"room {room}: "


def seconds(value: object, *, argument: str, positive: bool = False) -> float:
    """A duration a call takes: a finite number of seconds >= 0 (``positive``: > 0), not a bool. A NaN
    deadline never passes and an infinite one never ends, so both are refused with the argument's name."""
    bad = (
        isinstance(value, (bool, np.bool_))
        or not isinstance(value, (int, float, np.integer, np.floating))
        or not math.isfinite(value)
        or value < 0
        or (positive and value == 0)
    )
    if bad:
        bound = "> 0" if positive else ">= 0"
        raise _bad(
            f"{argument} must be a finite number of seconds {bound}, got {describe(value)}",
            None,
            argument,
            value,
        )
    return float(value)  # type: ignore[arg-type]  # checked above: a real number


def checked_room(value: object) -> RoomId:
    """A room id as the router gives it: an int in 1 .. 2**63-1 (bool, str, None refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(
            f"room id must be an int in 1..2**63-1, got {describe(value)}", argument="room", value=value
        )
    out = int(value)
    if not 0 < out <= MAX_ROOM_ID:
        raise InvalidArgumentError(f"room id must be in 1..2**63-1, got {out}", argument="room", value=value)
    return RoomId(out)


def count(
    value: object, *, room: int | None, argument: str, minimum: int = 0, maximum: int = MAX_INDEX - 1
) -> int:
    """A plain int (numpy integers accepted; bool, float and str refused) in ``minimum..maximum``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise _bad(f"{_where(room)}{argument} must be an int, got {describe(value)}", room, argument, value)
    out = int(value)
    if not minimum <= out <= maximum:
        raise _bad(
            f"{_where(room)}{argument} must be in {minimum}..{maximum}, got {out}", room, argument, value
        )
    return out


def optional_row(value: object, *, room: int | None, argument: str, rows: int | None = None) -> int | None:
    """None, or a row index below ``rows`` (when the local buffers say how many there are)."""
    if value is None:
        return None
    if rows is not None and rows == 0:
        raise _bad(
            f"{_where(room)}{argument} is {describe(value)} but no aux buffer is registered",
            room,
            argument,
            value,
        )
    return count(value, room=room, argument=argument, maximum=(rows - 1) if rows else MAX_INDEX - 1)


def flag(value: object, *, room: int | None, argument: str) -> bool:
    """A real bool (numpy bool accepted): ``last="yes"`` or ``last=1`` is a mistake, not a truth value."""
    if not isinstance(value, (bool, np.bool_)):
        raise _bad(f"{_where(room)}{argument} must be a bool, got {describe(value)}", room, argument, value)
    return bool(value)


def page_list(value: object, *, room: int | None, argument: str, limit: int | None = None) -> IntArray:
    """A 1-D list of distinct non-negative page (or slot) ids, as a fresh read-only int64 array.

    Accepts integer sequences, numpy arrays and CPU torch tensors; refuses None, strings, floats,
    bools, other shapes and accelerator tensors (``InvalidArgumentError``), ids at or past ``limit``
    (the local buffers' capacity, when known) and duplicates (``MappingError``: two positions would
    share one page, and the last write would win).
    """
    bad = _page_list_type_problem(value)
    if bad is not None:
        raise _bad(
            f"{_where(room)}{argument} must be a 1-D list of non-negative int page ids; {bad}",
            room,
            argument,
            value,
        )
    given = np.asarray(value)
    arr = given.astype(np.int64, copy=True) if given.size else np.zeros(0, np.int64)
    if arr.size:
        lo, hi = int_bounds(arr)
        ceiling = MAX_INDEX if limit is None else min(limit, MAX_INDEX)
        if lo < 0 or hi >= ceiling:
            what = "negative" if lo < 0 else f"past the {ceiling} registered pages"
            raise _bad(
                f"{_where(room)}{argument} holds ids {what} (min {lo}, max {hi}); {summarize(arr, argument)}",
                room,
                argument,
                value,
            )
        duplicates = repeated_ids(arr)
        if duplicates.size:
            raise MappingError(
                f"{_where(room)}{argument} repeats ids {duplicates[:6].tolist()}"
                f"{' ...' if duplicates.size > 6 else ''} ({duplicates.size} repeated): two positions "
                f"would share one page; {summarize(arr, argument)}"
            )
    arr.flags.writeable = False
    return arr


def state_list(value: object, *, room: int | None, argument: str) -> tuple[StateIndices, ...]:
    """None or a sequence of ``StateIndices`` with distinct kinds and distinct slots per kind."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes, StateIndices)) or not isinstance(value, Iterable):
        raise _bad(
            f"{_where(room)}{argument} must be a sequence of StateIndices, got {describe(value)}",
            room,
            argument,
            value,
        )
    items = tuple(value)
    for item in items:
        if not isinstance(item, StateIndices):
            raise _bad(
                f"{_where(room)}{argument} holds StateIndices, got {describe(item)}", room, argument, value
            )
    kinds = [s.kind for s in items]
    if len(set(kinds)) != len(kinds):
        repeated = sorted({k.value for k in kinds if kinds.count(k) > 1})
        raise _bad(
            f"{_where(room)}{argument} names state kind(s) {repeated} more than once", room, argument, value
        )
    for item in items:
        page_list(item.indices, room=room, argument=f"{argument}[{item.kind.value}]")
    return items


def _page_list_type_problem(value: object) -> str | None:
    if value is None or isinstance(value, (str, bytes, bool, int, float)):
        return f"got {describe(value)}"
    device = device_of(value)
    if device != "cpu":
        return f"got a tensor on {device!r} (index lists live on the CPU: copy them where you sync)"
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as exc:
        return f"got {describe(value)} ({exc})"
    if arr.ndim != 1:
        return f"got {describe(value)} with {arr.ndim} dimensions"
    if arr.size and arr.dtype.kind not in "iu":
        return f"got {describe(value)} (dtype {arr.dtype})"
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) >= MAX_INDEX:
        return f"got an id of {int(arr.max())}, past 2**62"
    return None


def repeated_ids(arr: IntArray) -> IntArray:
    """The ids that occur more than once in ``arr``, each once, sorted."""
    if arr.size < 2:  # the common small case, on every scheduler call: no sort, no unique
        return arr[:0]
    ordered = np.sort(arr, kind="stable")
    same = ordered[1:] == ordered[:-1]
    if not same.any():
        return ordered[:0]
    return np.unique(ordered[1:][same])


__all__ = [
    "checked_room",
    "count",
    "describe",
    "flag",
    "optional_row",
    "page_list",
    "repeated_ids",
    "state_list",
]
