"""Process control: ``Cluster`` (the registry in its own process, one process per rank, requests fed
and outcomes collected, everything it started stopped by pid with timeouts, even on failure),
``TimedAction``, and the entry point every rank process runs (``_rank_main``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from pdkv.alloc import PagePool
from pdkv.protocol.ids import InstanceId
from pdkv.protocol.messages import Side
from pdkv.testing.cluster._rank import _RankArgs
from pdkv.testing.cluster.decode_rank import _decode_rank
from pdkv.testing.cluster.messages import (
    FromRank,
    RankCrashed,
    RankFinal,
    RankReady,
    RoomResults,
    RunRooms,
    Stop,
)
from pdkv.testing.cluster.prefill_rank import _prefill_rank
from pdkv.testing.cluster.spec import (
    ClusterError,
    ClusterSpec,
    RankReport,
    RequestPlan,
    RoomOutcome,
    free_port,
    plan_requests,
)
from pdkv.testing.faults import (
    enter_netns,
)

IntArray = npt.NDArray[np.int64]
log = logging.getLogger(__name__)


def _rank_main(args: _RankArgs, conn: Connection) -> None:
    namespace = args.spec.namespace(args.side)
    if namespace is not None:
        enter_netns(namespace)  # first: every socket and thread of this process lives there
    if args.log_dir is not None:
        # Everything this process writes to stderr (Python logging, the engine's glog) goes to a file.
        path = os.path.join(args.log_dir, f"{args.side}-tp{args.tp}-cp{args.cp}.log")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` dumps every stack
    logging.basicConfig(
        level=args.log_level,
        format=f"%(asctime)s {args.side}{args.tp}.{args.cp} %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.side is Side.PREFILL:
            _prefill_rank(args, conn)
        else:
            _decode_rank(args, conn)
    except BaseException:
        conn.send(RankCrashed(traceback=traceback.format_exc()))
        raise


@attrs.define(eq=False)
class _RankProcess:
    side: Side
    tp: int
    cp: int
    name: str
    proc: Any
    conn: Connection
    address: str = ""
    control_port: int = 0
    killed: bool = False


@attrs.frozen(kw_only=True)
class TimedAction:
    """``action(cluster)`` once ``after_s`` seconds of ``Cluster.run`` have passed (e.g. kill a rank)."""

    after_s: float
    action: Callable[[Cluster], None]


def _registry_main(spec: ClusterSpec, conn: Connection) -> None:
    """The bootstrap registry in its own process, inside the prefill namespace."""
    from pdkv.runtime.channels import start_registry

    namespace = spec.namespace(Side.PREFILL)
    if namespace is not None:
        enter_netns(namespace)
    service = start_registry(
        instance=InstanceId("prefill-0"),
        tp_size=spec.prefill_tp,
        cp_size=spec.prefill_cp,
        host=spec.host(Side.PREFILL),
    )
    try:
        conn.send(RankReady(name="registry", address=service.address))
        conn.recv()  # any message (or EOF) means stop
    except EOFError:
        pass
    finally:
        service.stop()


class _RegistryProcess:
    """A registry living in another process (namespaced clusters); ``address`` and ``stop`` as in-process."""

    def __init__(self, ctx: Any, spec: ClusterSpec, deadline: float) -> None:
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_registry_main, args=(spec, child), name="pdkv-registry", daemon=True)
        self._proc.start()
        child.close()
        while not self._conn.poll(0.2):
            if time.monotonic() > deadline or not self._proc.is_alive():
                self.stop()
                raise ClusterError("the registry process did not start")
        ready = self._conn.recv()
        if not isinstance(ready, RankReady):
            self.stop()
            raise ClusterError(f"the registry process answered {ready!r}")
        self.address: str = ready.address

    def statistics(self) -> Any:
        raise ClusterError("registry statistics are not available from a registry in another namespace")

    def stop(self) -> None:
        with contextlib.suppress(OSError, BrokenPipeError):
            self._conn.send(Stop())
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()


class Cluster:
    """Starts the registry and every rank; ``run`` feeds requests; ``close`` stops all it started."""

    def __init__(
        self, spec: ClusterSpec, *, log_level: int = logging.WARNING, log_dir: str | None = None
    ) -> None:
        """``log_dir``: each rank's stderr (logs, engine output) goes to a file there instead of ours."""
        self.spec = spec
        self.log_level = log_level
        self.log_dir = log_dir
        self._ctx = mp.get_context("spawn")
        self._ranks: list[_RankProcess] = []
        self._registry: Any = None
        self._consensus_address: str | None = None
        self.reports: list[RankReport] = []
        self._pending: dict[int, set[str]] = {}

    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    @property
    def prefill_conns(self) -> list[Connection]:
        return [r.conn for r in self._ranks if r.side is Side.PREFILL and not r.killed]

    @property
    def decode_conns(self) -> list[Connection]:
        return [r.conn for r in self._ranks if r.side is Side.DECODE and not r.killed]

    @property
    def registry_address(self) -> str:
        return str(self._registry.address)

    def registry_statistics(self) -> Any:
        """The bootstrap registry's counters (``RegistryStatistics``)."""
        return self._registry.statistics()

    def address(self, side: Side | str, tp: int = 0, cp: int = 0) -> str:
        """The control address of a rank (``tcp://host:port``)."""
        return self._rank(side, tp, cp).address

    def pid(self, side: Side | str, tp: int = 0, cp: int = 0) -> int:
        return int(self._rank(side, tp, cp).proc.pid)

    def _rank(self, side: Side | str, tp: int, cp: int) -> _RankProcess:
        side = Side(side)
        for r in self._ranks:
            if (r.side, r.tp, r.cp) == (side, tp, cp):
                return r
        raise ClusterError(f"no {side} rank tp{tp}/cp{cp}")

    def start(self) -> None:
        from pdkv.runtime.channels import start_registry

        spec = self.spec
        if spec.netns is None:
            self._registry = start_registry(
                instance=InstanceId("prefill-0"), tp_size=spec.prefill_tp, cp_size=spec.prefill_cp
            )
        else:
            self._registry = _RegistryProcess(self._ctx, spec, time.monotonic() + spec.startup_timeout_s)
        if spec.consensus and spec.prefill_tp * spec.prefill_cp > 1:
            self._consensus_address = f"tcp://127.0.0.1:{free_port()}"
        ranks = [(Side.PREFILL, tp, cp) for tp in range(spec.prefill_tp) for cp in range(spec.prefill_cp)]
        ranks += [(Side.DECODE, tp, 0) for tp in range(spec.decode_tp)]
        for side, tp, cp in ranks:
            port = free_port() if side is Side.PREFILL and spec.stable_addresses else 0
            self._ranks.append(self._spawn(side, tp, cp, port))
        deadline = time.monotonic() + spec.startup_timeout_s
        for rank in self._ranks:
            self._await_ready(rank, deadline)

    def _spawn(self, side: Side, tp: int, cp: int, port: int) -> _RankProcess:
        parent, child = self._ctx.Pipe()
        args = _RankArgs(
            side=side,
            tp=tp,
            cp=cp,
            spec=self.spec,
            registry=self._registry.address,
            log_level=self.log_level,
            log_dir=self.log_dir,
            consensus_address=self._consensus_address if side is Side.PREFILL else None,
            control_port=port,
        )
        proc = self._ctx.Process(
            target=_rank_main, args=(args, child), name=f"pdkv-{side}{tp}.{cp}", daemon=True
        )
        proc.start()
        child.close()
        name = f"prefill tp{tp}/cp{cp}" if side is Side.PREFILL else f"decode tp{tp}"
        return _RankProcess(side=side, tp=tp, cp=cp, name=name, proc=proc, conn=parent, control_port=port)

    def _await_ready(self, rank: _RankProcess, deadline: float) -> None:
        message = self._recv(rank.conn, rank.proc, deadline)
        if isinstance(message, RankCrashed):
            raise ClusterError(f"{rank.side} rank failed to start:\n{message.traceback}")
        if not isinstance(message, RankReady):
            raise ClusterError(f"{rank.side} rank sent {type(message).__name__} before it was ready")
        rank.address = message.address

    def kill(self, side: Side | str, tp: int = 0, cp: int = 0) -> None:
        """SIGKILL one rank process (no goodbye to anyone); its unfinished rooms are no longer awaited."""
        rank = self._rank(side, tp, cp)
        rank.killed = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank.proc.pid, signal.SIGKILL)
        rank.proc.join(10)
        for room in list(self._pending):
            self._pending[room].discard(rank.name)
            if not self._pending[room]:
                del self._pending[room]

    def restart(self, side: Side | str, tp: int = 0, cp: int = 0) -> None:
        """Kill a rank and start it again (a new epoch) behind the same control address; new rooms go
        to the new incarnation. Needs ``stable_addresses`` for a prefill rank, and no consensus group
        (a gloo group cannot take a rank back)."""
        side = Side(side)
        rank = self._rank(side, tp, cp)
        if side is Side.PREFILL and not rank.control_port:
            raise ClusterError("restart behind the same address needs ClusterSpec(stable_addresses=True)")
        if side is Side.PREFILL and self._consensus_address is not None:
            raise ClusterError("a rank of a consensus group cannot be restarted")
        if not rank.killed:
            self.kill(side, tp, cp)
        rank.conn.close()
        fresh = self._spawn(side, tp, cp, rank.control_port)
        self._ranks[self._ranks.index(rank)] = fresh
        self._await_ready(fresh, time.monotonic() + self.spec.startup_timeout_s)

    def run(
        self,
        plans: Sequence[RequestPlan],
        *,
        max_active: int = 8,
        progress: Callable[[RoomOutcome], None] | None = None,
        actions: Sequence[TimedAction] = (),
    ) -> list[RoomOutcome]:
        """Run every request; returns one outcome per room and live rank (prefill and decode).

        ``actions`` run from this loop at their times (a killed rank's rooms are no longer awaited)."""
        spec = self.spec
        pool = PagePool(pages_per_lane=spec.prefill_capacity.kv_pages, policy=spec.policy, tier="prefill")
        prefill_rooms, decode_rooms, _ = plan_requests(spec, plans, pool)
        outcomes: list[RoomOutcome] = []
        self._pending = {}
        results: queue.SimpleQueue[RoomOutcome] = queue.SimpleQueue()
        todo = sorted(actions, key=lambda a: a.after_s)
        next_room = 0
        started = time.monotonic()
        deadline = started + spec.room_timeout_s + spec.room_timeout_s * len(plans) / max(1, max_active)
        while next_room < len(plans) or self._pending or todo:
            while todo and time.monotonic() - started >= todo[0].after_s:
                todo.pop(0).action(self)
            admitted = next_room
            while next_room < len(plans) and len(self._pending) < max_active:
                self._pending[int(plans[next_room].room)] = {r.name for r in self._ranks if not r.killed}
                next_room += 1
            if next_room > admitted:
                for r in self._ranks:
                    if not r.killed:
                        rooms = prefill_rooms if r.side is Side.PREFILL else decode_rooms
                        r.conn.send(RunRooms(rooms=tuple(rooms[admitted:next_room])))
            self._collect(results, deadline)
            while not results.empty():
                outcome = results.get()
                outcomes.append(outcome)
                if progress is not None:
                    progress(outcome)
                waiting = self._pending.get(outcome.room)
                if waiting is not None:
                    waiting.discard(outcome.rank)
                    if not waiting:
                        del self._pending[outcome.room]
        return outcomes

    def _collect(self, results: queue.SimpleQueue[RoomOutcome], deadline: float) -> None:
        from multiprocessing.connection import wait

        live = [r for r in self._ranks if not r.killed]
        ready = wait([r.conn for r in live], timeout=0.1)
        for conn in ready:
            assert isinstance(conn, Connection)
            try:
                message = conn.recv()
            except (EOFError, OSError):
                continue  # a rank that died; reported below
            if isinstance(message, RoomResults):
                for outcome in message.outcomes:
                    results.put(outcome)
            elif isinstance(message, RankCrashed):
                raise ClusterError(f"a rank failed:\n{message.traceback}")
        if time.monotonic() > deadline:
            raise ClusterError(f"rooms did not finish in time: {sorted(self._pending)}")
        for r in live:
            if not r.proc.is_alive():
                raise ClusterError(f"{r.side} rank process {r.proc.name} died (exit code {r.proc.exitcode})")

    def close(self) -> list[RankReport]:
        """Stop every rank (gracefully, then by force) and the registry; returns the ranks' final reports."""
        deadline = time.monotonic() + 30
        for r in self._ranks:
            if r.proc.is_alive():
                with contextlib.suppress(BrokenPipeError, OSError):
                    r.conn.send(Stop())
        for r in self._ranks:
            try:
                while r.proc.is_alive() or r.conn.poll(0):
                    if not r.conn.poll(max(0.0, min(1.0, deadline - time.monotonic()))):
                        if time.monotonic() > deadline:
                            break
                        continue
                    message = r.conn.recv()
                    if isinstance(message, RankFinal):
                        self.reports.append(message.report)
                        break
            except (EOFError, OSError):
                pass
        for r in self._ranks:
            r.proc.join(max(0.1, deadline - time.monotonic()))
            if r.proc.is_alive():
                r.proc.terminate()
                r.proc.join(5)
            if r.proc.is_alive():
                r.proc.kill()
                r.proc.join(5)
            r.conn.close()
        self._ranks.clear()
        if self._registry is not None:
            self._registry.stop()
            self._registry = None
        return self.reports

    def _recv(self, conn: Connection, proc: Any, deadline: float) -> FromRank:
        while time.monotonic() < deadline:
            if conn.poll(0.2):
                message: FromRank = conn.recv()
                return message
            if not proc.is_alive():
                raise ClusterError(
                    f"rank process {proc.name} died during start-up (exit code {proc.exitcode})"
                )
        raise ClusterError(f"rank process {proc.name} did not start within {self.spec.startup_timeout_s:g} s")


__all__ = ["Cluster", "TimedAction"]
