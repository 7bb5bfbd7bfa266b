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
