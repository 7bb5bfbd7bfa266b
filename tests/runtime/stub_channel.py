"""A ``MessageChannel`` for tests of the control loop alone: it delivers one batch once, then only
waits; it records what it was asked to send (one entry per call)."""

from __future__ import annotations

import threading
from typing import Any

from pdkv.protocol.messages import Message


class StubChannel:
    address = "inproc://stub"

    def __init__(self, batch: list[Message] | None = None) -> None:
        self._batch = list(batch or [])
        self.calls: list[tuple[str, list[Message]]] = []

    def send(self, to: str, message: Message) -> None:
        self.calls.append((to, [message]))

    def wait(self, timeout_s: float | None) -> list[Message]:
        batch, self._batch = self._batch, []
        if not batch:
            threading.Event().wait(min(timeout_s or 0.01, 0.01))
        return batch

    def wake(self) -> None:
        pass

    def forget(self, endpoint: str) -> None:
        pass

    def close(self, *, flush_s: float = 0.0) -> None:
        pass

    def statistics(self) -> Any:
        return None
