"""A deadline queue with lazy invalidation: O(log n) per change, no scan over all rooms per tick.

Owns: ``DeadlineQueue``. The owner keeps the authoritative deadline of each key; the queue may hold
stale entries, which ``pop_due`` skips by asking the owner for the current deadline.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class DeadlineQueue(Generic[K]):
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, K]] = []
        self._order = itertools.count()  # ties broken by insertion order: deterministic

    def push(self, key: K, deadline: float) -> None:
        heapq.heappush(self._heap, (deadline, next(self._order), key))

    def pop_due(self, now: float, current: Callable[[K], float | None]) -> list[K]:
        """Keys whose current deadline is <= now, each once, in deadline order; stale entries are dropped.

        A key may sit in the heap twice with the same deadline (set again at the same instant): it is
        still returned once, so the owner acts once per key and tick.
        """
        due: list[K] = []
        seen: set[K] = set()
        while self._heap and self._heap[0][0] <= now:
            deadline, _, key = heapq.heappop(self._heap)
            if key not in seen and current(key) == deadline:
                seen.add(key)
                due.append(key)
        return due

    def next_deadline(self, current: Callable[[K], float | None]) -> float | None:
        """Earliest live deadline (drops stale entries from the top)."""
        while self._heap:
            deadline, _, key = self._heap[0]
            if current(key) == deadline:
                return deadline
            heapq.heappop(self._heap)
        return None

    def __len__(self) -> int:
        return len(self._heap)


V = TypeVar("V")


class Tombstones(Generic[K, V]):
    """Keys refused until they expire, each with what to say about it: a dict plus its expiry queue.

    Both endpoints keep cleared room ids this way (a late message for an id must never reach a room
    that reuses it). ``put`` replaces an entry and its expiry; ``expire(now)`` drops the due ones."""

    def __init__(self) -> None:
        self._values: dict[K, tuple[float, V]] = {}
        self._expiry: DeadlineQueue[K] = DeadlineQueue()

    def put(self, key: K, value: V, expiry: float) -> None:
        self._values[key] = (expiry, value)
        self._expiry.push(key, expiry)

    def get(self, key: K) -> V | None:
        entry = self._values.get(key)
        return None if entry is None else entry[1]

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __len__(self) -> int:
        return len(self._values)

    def next_expiry(self) -> float | None:
        return self._expiry.next_deadline(self._expiry_of)

    def expire(self, now: float) -> list[K]:
        """Drop the entries due at ``now``; returns their keys."""
        due = self._expiry.pop_due(now, self._expiry_of)
        for key in due:
            del self._values[key]
        return due

    def _expiry_of(self, key: K) -> float | None:
        entry = self._values.get(key)
        return None if entry is None else entry[0]
