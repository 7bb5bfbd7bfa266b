"""A prefill rank process: ``_prefill_rank`` runs a real ``PrefillTransport`` under a simple scheduler
(the example of embedding pdkv on the prefill side: open each room, run a simulated forward per
chunk, ``send`` it whole or layer by layer, poll, clear), with rank consensus over a gloo group.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from multiprocessing.connection import Connection
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from pdkv.mapping import ModelRole, cp_owned
from pdkv.protocol.ids import InstanceId
from pdkv.protocol.messages import RankCoord, Side, StateIndices
from pdkv.protocol.poll import KVPoll
from pdkv.testing.cluster._rank import _RankArgs, _wire, cpu_since, pause, thread_cpu
from pdkv.testing.cluster.messages import RankFinal, RankReady, RoomResults, RunRooms, Stop
from pdkv.testing.cluster.spec import RankReport, RoomOutcome, _PrefillRoom
from pdkv.testing.synthetic import (
    RankMemory,
    simulate_forward,
)

IntArray = npt.NDArray[np.int64]
log = logging.getLogger(__name__)


class _RankConsensus:
    """The prefill ranks' gloo group: agree on the rooms every rank holds, then MIN-reduce their polls."""

    def __init__(self, address: str, rank: int, world: int, timeout_s: float) -> None:
        import datetime

        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=address,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        self.lost = ""

    def agree(self, arrived: int, done: bool) -> tuple[int, bool]:
        """(rooms every rank has received, whether every rank is stopping with nothing left)."""
        import torch
        import torch.distributed as dist

        values = torch.tensor([arrived, int(done)], dtype=torch.int64)
        dist.all_reduce(values, op=dist.ReduceOp.MIN)
        return int(values[0]), bool(values[1])

    def reduce(self, polls: list[KVPoll]) -> list[KVPoll]:
        from pdkv.runtime.consensus import all_reduce_polls

        # The lengths were agreed by ``agree`` in this iteration: no second length check.
        return all_reduce_polls(polls, check_lengths=False)

    def close(self) -> None:
        import torch.distributed as dist

        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _prefill_rank(args: _RankArgs, conn: Connection) -> None:
    from pdkv.runtime.prefill import PrefillConfig, PrefillTransport

    spec = args.spec
    memory = RankMemory(spec.model, spec.prefill_capacity, tp_size=spec.prefill_tp, tp_rank=args.tp)
    memory.fill_prefill(cp_rank=args.cp, policy=spec.policy)
    wiring = _wire(args, Side.PREFILL)
    backend = wiring.backend
    config = PrefillConfig.from_env(  # executor and per-layer settings: PDKV_* variables, if set
        instance=InstanceId("prefill-0"),
        rank=RankCoord(tp=args.tp, cp=args.cp),
        tp_size=spec.prefill_tp,
        cp_size=spec.prefill_cp,
        layout=memory.layout,
        registry=args.registry,
        host=spec.host(Side.PREFILL),
        timeouts=spec.timeouts,
        kv_checksum=spec.kv_checksum,
        layout_policy=spec.prefill_layout_policy,
    )
    staging = None
    if spec.staging is not None:
        from pdkv.runtime.staging import StagingPool

        sources = [memory.tensors[(b.model, b.kind, b.layer_id)] for b in memory.layout.buffers]
        staging = StagingPool(backend, memory.layout, sources, spec.staging)
    transport = PrefillTransport(config, backend, channel_factory=wiring.channel_factory, staging=staging)
    name = f"prefill tp{args.tp}/cp{args.cp}"
    consensus: _RankConsensus | None = None
    try:
        transport.start()
        gc.freeze()  # as serving engines do after start-up: the start-up heap is never scanned again
        if args.consensus_address is not None:
            consensus = _RankConsensus(
                args.consensus_address,
                rank=args.tp * spec.prefill_cp + args.cp,
                world=spec.prefill_tp * spec.prefill_cp,
                timeout_s=spec.consensus_timeout_s,
            )
        conn.send(RankReady(name=name, address=transport.address))
        cpu_at_start = thread_cpu()
        active: dict[int, tuple[_PrefillRoom, Any, _Progress]] = {}
        order: list[int] = []  # rooms in arrival order (the same on every rank) not yet retired by consensus
        agreed: dict[int, KVPoll] = {}  # the consensus of retired rooms still finishing here
        stopping = False
        while True:
            while conn.poll(0 if active else 0.05):
                command = conn.recv()
                if isinstance(command, Stop):
                    stopping = True
                    break
                assert isinstance(command, RunRooms)
                for room in command.rooms:
                    assert isinstance(room, _PrefillRoom)
                    sender = transport.sender(room.room)
                    sender.init(room.num_pages, room.aux_src)
                    active[room.room] = (room, sender, _Progress(started=time.monotonic()))
                    order.append(room.room)
            grouped = consensus is not None and not consensus.lost
            if not grouped:
                order.clear()
                if stopping and not active:
                    break
            seen = transport.progress()  # before the polls: a change during them ends the wait below
            ended: list[RoomOutcome] = []  # sent together after the pass
            for key in list(active):
                room, sender, progress = active[key]
                poll = sender.poll()
                ready = poll in (KVPoll.WaitingForInput, KVPoll.Transferring)
                if ready and progress.next_chunk < len(room.chunks):
                    _prefill_chunk(args, memory, transport, room, sender, progress)
                elif poll in (KVPoll.Success, KVPoll.Failed) and (not grouped or key in agreed):
                    final = min(poll, agreed.pop(key, poll))
                    failure = str(sender.failure() or "")
                    if final is KVPoll.Failed and not failure:
                        failure = "rank consensus: another prefill rank failed the room"
                    metric = sender.metric()
                    modes = progress.modes
                    ended.append(
                        RoomOutcome(
                            room=room.room,
                            side=Side.PREFILL,
                            rank=name,
                            poll=int(final),
                            failure=failure,
                            seconds=time.monotonic() - progress.started,
                            bytes_reported=metric.bytes,
                            forward_end_at=progress.forward_end_at,
                            finished_at=time.monotonic(),
                            mode=modes.pop() if len(modes) == 1 else ("mixed" if modes else ""),
                        )
                    )
                    sender.clear()
                    del active[key]
            if ended:
                conn.send(RoomResults(outcomes=tuple(ended)))
            if consensus is not None and grouped:
                if _consensus_round(consensus, name, active, order, agreed, done=stopping and not active):
                    break
            elif active:
                pause(transport, seen)
        stats = transport.statistics()
        cpu = cpu_since(cpu_at_start)
        conn.send(
            RankFinal(
                report=RankReport(
                    side=Side.PREFILL,
                    rank=name,
                    rooms=stats.endpoint.rooms_succeeded + stats.endpoint.rooms_failed,
                    canary_violations=0,
                    unsafe_releases=0,
                    bytes_written=stats.metrics.counters.bytes_sent,
                    worker_errors=stats.worker_errors,
                    malformed=stats.channel.malformed,
                    stale_messages=stats.endpoint.stale_messages,
                    peers_lost=stats.endpoint.peers_lost,
                    peer_restarts=stats.endpoint.peer_restarts,
                    fences=stats.endpoint.fences_submitted,
                    writes=stats.metrics.counters.writes,
                    write_jobs=stats.metrics.counters.write_jobs,
                    staged_writes=staging.statistics().staged_writes if staging is not None else 0,
                    staging_leased_at_end=(
                        staging.statistics().in_use_bytes + staging.statistics().quarantined_bytes
                        if staging is not None
                        else 0
                    ),
                    cpu_s=cpu,
                    consensus_lost=consensus.lost if consensus is not None else "",
                    faults=wiring.fault_counts(),
                ),
            )
        )
    finally:
        if consensus is not None:
            consensus.close()
        transport.close()
        if staging is not None:
            staging.close()
        backend.close()


def _consensus_round(
    consensus: _RankConsensus,
    name: str,
    active: dict[int, tuple[_PrefillRoom, Any, _Progress]],
    order: list[int],
    agreed: dict[int, KVPoll],
    *,
    done: bool,
) -> bool:
    """One iteration's collectives; True when every rank is stopping with nothing left (leave the loop).

    Rooms whose consensus is terminal leave ``order`` on every rank in this same iteration (so the
    lists stay aligned); a rank whose own poll is not terminal yet aborts the room: another rank failed.
    """
    try:
        arrived, all_done = consensus.agree(len(order), done)
        if all_done:
            return True
        window = order[:arrived]
        local = [active[key][1].poll() for key in window]
        reduced = consensus.reduce(local) if window else []
    except Exception as exc:  # a dead rank or a broken group: every room of this rank fails
        consensus.lost = f"{type(exc).__name__}: {exc}"
        log.warning("%s: rank consensus lost (%s); failing every room of this rank", name, consensus.lost)
        for key in order:
            sender = active[key][1]
            if sender.poll() not in (KVPoll.Success, KVPoll.Failed):
                sender.abort(f"rank consensus lost: {consensus.lost}")
        order.clear()
        return False
    retired = set()
    for key, mine, together in zip(window, local, reduced, strict=True):
        if together not in (KVPoll.Success, KVPoll.Failed):
            continue
        retired.add(key)
        agreed[key] = together
        if mine not in (KVPoll.Success, KVPoll.Failed):
            active[key][1].abort("rank consensus: another prefill rank failed the room")
    if retired:
        order[:] = [key for key in order if key not in retired]
    return False


@attrs.define(eq=False)
class _Progress:
    """A prefill rank's scheduler state for one room."""

    started: float
    next_chunk: int = 0
    forward_end_at: float = 0.0
    modes: set[str] = attrs.Factory(set)


def _prefill_chunk(
    args: _RankArgs, memory: RankMemory, transport: Any, room: _PrefillRoom, sender: Any, progress: _Progress
) -> None:
    """One chunk: (register it for per-layer transfer,) run its forward, send it (or abort as planned)."""
    spec = args.spec
    index = progress.next_chunk
    progress.next_chunk += 1
    planned_abort = room.abort_before_chunk == index and args.cp == 0 and args.tp == 0
    if planned_abort and room.abort_after_layers is None:
        sender.abort("planned prefill-side abort")
        progress.next_chunk = len(room.chunks)
        return
    pages, start_token, last = room.chunks[index]
    resident = room.resident_pages if index == 0 else 0
    manager = transport.per_layer
    if room.per_layer:
        mode = manager.register(room.room, pages, start_token=start_token, resident_pages=resident)
        progress.modes.add(mode.value if mode.value != "duplicate" else "per_layer")
    else:
        progress.modes.add("monolithic")
    computed = cp_owned(pages[resident:], 0, args.cp, spec.policy).physical
    if spec.forward_writes_kv:
        memory.clear_pages(computed)
    ended = [0]
    abort_at = room.abort_after_layers if planned_abort else None

    def layer_end(model: ModelRole, layer: int) -> None:
        if spec.forward_writes_kv:
            memory.write_layer(model, layer, computed, cp_rank=args.cp, policy=spec.policy)
        if room.per_layer:
            manager.on_layer_end(layer, model=model)
        ended[0] += 1
        if abort_at is not None and ended[0] == abort_at:
            sender.abort("planned prefill-side abort in the middle of the forward")

    simulate_forward(spec.model, layer_compute_s=room.layer_compute_s, on_layer_end=layer_end)
    if room.forward_s:
        time.sleep(room.forward_s)
    progress.forward_end_at = time.monotonic()
    if abort_at is not None:
        progress.next_chunk = len(room.chunks)
        return
    state = [StateIndices(kind=kind, indices=slots) for kind, slots in room.state_src] if last else None
    sender.send(pages, start_token=start_token, last=last, state_indices=state)
