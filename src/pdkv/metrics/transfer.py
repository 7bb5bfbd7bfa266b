"""One room's transfer as one side saw it: ``KVTransferMetric``, and the byte count it must carry.

Owns: the per-room record (room id, pages and bytes actually written, engine seconds, and the
queued / first-submit / last-completion timestamps) and ``bytes_written``, the one place that turns
"pages sent per buffer" into bytes. Must not read a clock (timestamps are monotonic-clock floats
the caller passes in), estimate bytes, or import anything above pdkv.errors.

Durations derived from timestamps are 0 when either end is unset, and can never be negative: the
record refuses timestamps out of order instead of clamping a difference that would hide a bug.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Final

import attrs

from pdkv.metrics.errors import MetricValueError

MAX_ROOM_ID: Final = 2**63 - 1
"""Room ids are 63-bit (DESIGN section 1), so they survive signed int64 columns."""

BYTES_PER_GB: Final = 1e9
"""Decimal gigabytes, as transfer engines and NIC datasheets quote them."""


def _count(name: str, value: object, upper: int = 2**63 - 1) -> int:
    # bool is an int subclass; a True page count is always a caller bug
    if isinstance(value, bool) or not isinstance(value, int):
        raise MetricValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not 0 <= value <= upper:
        raise MetricValueError(f"{name} must lie in [0, {upper}], got {value}")
    return value


def _room(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    _count(attribute.name, value, MAX_ROOM_ID)


def _non_negative_count(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    _count(attribute.name, value)


def _seconds(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MetricValueError(f"{attribute.name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise MetricValueError(f"{attribute.name} must be finite and >= 0 seconds, got {value!r}")


def _timestamp(_: object, attribute: attrs.Attribute[float | None], value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise MetricValueError(f"{attribute.name} must be a finite clock reading or None, got {value!r}")


def _span(start: float | None, end: float | None) -> float:
    """Seconds from ``start`` to ``end``; 0 when either is unset (ordering is checked at construction)."""
    if start is None or end is None:
        return 0.0
    return end - start


def _earliest(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


def _latest(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


def bytes_written(pages_per_buffer: Sequence[int], bytes_per_page_per_buffer: Sequence[int]) -> int:
    """Bytes actually moved: the sum over buffers of pages sent into that buffer x its bytes per page.

    Takes what was sent, never what was planned, so a skipped chunk or a clipped state buffer is not
    counted. Exact Python integers (no int64 overflow for very long requests).
    """
    if len(pages_per_buffer) != len(bytes_per_page_per_buffer):
        raise MetricValueError(
            f"{len(pages_per_buffer)} page counts for {len(bytes_per_page_per_buffer)} buffers: "
            "give one page count per buffer"
        )
    total = 0
    pairs = zip(pages_per_buffer, bytes_per_page_per_buffer, strict=True)
    for index, (pages, page_bytes) in enumerate(pairs):
        pages = _count(f"pages of buffer {index}", pages)
        total += pages * _count(f"bytes per page of buffer {index}", page_bytes)
    return total


@attrs.frozen(kw_only=True)
class KVTransferMetric:
    """What one side wrote for one room, and when.

    ``seconds`` is engine time (summed over the room's chunks), which excludes the gaps while later
    chunks were still being computed; ``transfer_span_seconds`` is wall time from the first submit to
    the last completion and includes them. Timestamps are ``None`` until the event happened.
    """

    room: int = attrs.field(validator=_room)
    pages: int = attrs.field(default=0, validator=_non_negative_count)
    """Pages written (counted per page position, not per buffer)."""
    bytes: int = attrs.field(default=0, validator=_non_negative_count)
    """Bytes written over every buffer (see ``bytes_written``)."""
    seconds: float = attrs.field(default=0.0, validator=_seconds)
    queued_at: float | None = attrs.field(default=None, validator=_timestamp)
    """When the first chunk was queued for transfer."""
    first_submit_at: float | None = attrs.field(default=None, validator=_timestamp)
    """When the first batch went to the engine."""
    last_completion_at: float | None = attrs.field(default=None, validator=_timestamp)
    """When the engine reported the last batch complete."""

    def __attrs_post_init__(self) -> None:
        # order only the events that happened: a room that failed before its first submit still
        # has a queue time, and must not be refused for it
        named = [
            ("queued_at", self.queued_at),
            ("first_submit_at", self.first_submit_at),
            ("last_completion_at", self.last_completion_at),
        ]
        happened = [(name, when) for name, when in named if when is not None]
        for (earlier_name, earlier), (later_name, later) in itertools.pairwise(happened):
            if later < earlier:
                raise MetricValueError(
                    f"room {self.room}: {later_name}={later!r} is before {earlier_name}={earlier!r}; "
                    "timestamps must come from one monotonic clock"
                )

    @classmethod
    def empty(cls, room: int) -> KVTransferMetric:
        """What a dummy rank or a fake sender reports: nothing written, no timestamps."""
        return cls(room=room)

    @property
    def is_empty(self) -> bool:
        """Nothing was written (a dummy rank, a fake sender, or a room that failed before any write)."""
        return self.pages == 0 and self.bytes == 0

    @property
    def gb_per_s(self) -> float:
        """Decimal GB per engine second; 0 when no engine time was recorded."""
        if self.seconds == 0:
            return 0.0
        return self.bytes / self.seconds / BYTES_PER_GB

    @property
    def queue_seconds(self) -> float:
        """Queued -> first submit; 0 when either is unset."""
        return _span(self.queued_at, self.first_submit_at)

    @property
    def transfer_span_seconds(self) -> float:
        """First submit -> last completion; 0 when either is unset."""
        return _span(self.first_submit_at, self.last_completion_at)

    @property
    def end_to_end_seconds(self) -> float:
        """Queued -> last completion; 0 when either is unset."""
        return _span(self.queued_at, self.last_completion_at)

    def combined_with(self, other: KVTransferMetric) -> KVTransferMetric:
        """This room's totals after another of its chunks: counts and seconds add up, the earliest
        queue and submit times and the latest completion are kept."""
        if other.room != self.room:
            raise MetricValueError(f"cannot combine the metrics of rooms {self.room} and {other.room}")
        return KVTransferMetric(
            room=self.room,
            pages=self.pages + other.pages,
            bytes=self.bytes + other.bytes,
            seconds=self.seconds + other.seconds,
            queued_at=_earliest(self.queued_at, other.queued_at),
            first_submit_at=_earliest(self.first_submit_at, other.first_submit_at),
            last_completion_at=_latest(self.last_completion_at, other.last_completion_at),
        )
