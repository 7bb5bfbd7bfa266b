"""The waker never swallows a wake: a wake() that lands while the owner consumes must leave a byte to
read whenever it leaves the wake pending (otherwise every later wake() is ignored and the owner sleeps
through posted work until its poll times out)."""

from __future__ import annotations

import threading
from typing import Any

import zmq

from pdkv.control._sockets import Waker


class _RacingSocket:
    """Wraps the waker's PULL socket: the first drain lets another thread call wake() mid-consume."""

    def __init__(self, real: zmq.Socket[bytes], waker: Waker) -> None:
        self.real = real
        self.waker = waker
        self.racer: threading.Thread | None = None

    def recv(self, flags: int = 0) -> bytes:
        if self.racer is None:
            self.racer = threading.Thread(target=self.waker.wake)
            self.racer.start()
            self.racer.join(0.1)  # with the fix the racer waits on the wakers' lock until consume ends
        return self.real.recv(flags)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_a_wake_racing_with_consume_is_not_lost() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    waker = Waker(ctx)
    real = waker.socket
    try:
        waker.wake()
        assert real.poll(1000)
        racing = _RacingSocket(real, waker)
        waker.socket = racing  # type: ignore[assignment]  # a proxy with the socket's interface
        waker.consume()
        assert racing.racer is not None
        racing.racer.join(5)
        waker.socket = real
        if waker._pending:
            assert real.poll(1000), "a wake is pending but nothing will ever wake the owner"
        waker.consume()
        waker.wake()
        assert real.poll(1000), "a later wake must still reach the owner"
    finally:
        waker.socket = real
        waker.close()
        ctx.term()
