"""Connection cuts of one decode rank, coalesced: one cut per prefill host serves every room that
asked before it started.

Owns: ``HostCutter``. A quarantined room whose prefill ranks all acknowledged needs every engine
connection from their hosts cut before its pages come back (``CutConnections``); rooms acknowledged
together (a partition heals, and every room of it is acknowledged at once) need the same hosts cut.
One worker thread takes every request queued so far, cuts each host once, and reports each room;
requests that arrive during a cut wait for the next one (a cut that began before a room asked
proves nothing for it). Must not touch room state: ``report`` hands each outcome to the endpoint.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from pdkv.errors import PdkvError
from pdkv.protocol.effects import CutConnections

log = logging.getLogger(__name__)


class HostCutter:
    """``cut(host) -> connections cut`` runs on the worker; ``report(effect, ok, reason)`` per room."""

    def __init__(
        self,
        cut: Callable[[str], int],
        report: Callable[[CutConnections, bool, str], None],
        *,
        name: str = "pdkv-cut",
    ) -> None:
        self._cut = cut
        self._report = report
        self._name = name
        self._lock = threading.Lock()
        self._pending: list[CutConnections] = []
        self._worker: threading.Thread | None = None
        self.cuts = 0  # host cuts made (each may serve several rooms)

    def request(self, effect: CutConnections) -> None:
        """Queue a room's cut; never waits (the worker starts when none runs)."""
        with self._lock:
            self._pending.append(effect)
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._worker.start()

    def idle(self) -> bool:
        with self._lock:
            return self._worker is None

    def _run(self) -> None:
        while True:
            with self._lock:
                batch, self._pending = self._pending, []
                if not batch:
                    self._worker = None
                    return
            hosts = sorted({host for effect in batch for host in effect.hosts})
            ok, reason, cut = True, "", 0
            try:
                for host in hosts:
                    cut += self._cut(host)
                    self.cuts += 1
            except PdkvError as exc:
                ok, reason = False, str(exc)
            except Exception as exc:  # never leave a room waiting on a cut that died
                log.exception("cutting the connections of %s failed", hosts)
                ok, reason = False, f"internal error: {type(exc).__name__}: {exc}"
            if ok:
                rooms = ", ".join(str(effect.room) for effect in batch)
                log.warning(
                    "%d engine connection(s) from %s cut before releasing quarantined room(s) %s",
                    cut,
                    ", ".join(hosts),
                    rooms,
                )
            for effect in batch:
                self._report(effect, ok, reason)


__all__ = ["HostCutter"]
