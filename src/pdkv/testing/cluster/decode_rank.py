"""A decode rank process: ``_decode_rank`` runs a real ``DecodeTransport`` under a simple scheduler
(allocate pages, ``receiver.init``, poll, verify every successful room byte for byte, and after an
aborted room's safe release write a canary into its pages, checked at shutdown).
"""

from __future__ import annotations

import gc
import logging
import time
from multiprocessing.connection import Connection
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from pdkv.alloc import PagePool
from pdkv.mapping import ModelRole
from pdkv.protocol.ids import InstanceId
from pdkv.protocol.messages import RankCoord, Side, StateIndices
from pdkv.protocol.poll import KVPoll
from pdkv.testing.cluster._rank import _RankArgs, _wire, cpu_since, pause, thread_cpu
from pdkv.testing.cluster.messages import RankFinal, RankReady, RoomResults, RunRooms, Stop
from pdkv.testing.cluster.spec import ClusterError, RankReport, RoomOutcome, _DecodeRoom
from pdkv.testing.synthetic import (
    RankMemory,
    canary_intact,
    verify_room,
    write_canary,
)

IntArray = npt.NDArray[np.int64]
log = logging.getLogger(__name__)


def _decode_rank(args: _RankArgs, conn: Connection) -> None:
    from pdkv.runtime.decode import DecodeConfig, DecodeTransport
    from pdkv.runtime.landing import LandingConfig

    spec = args.spec
    cap = spec.decode_capacity
    memory = RankMemory(spec.decode_spec, cap, tp_size=spec.decode_tp, tp_rank=args.tp)
    # Draft buffers of this rank the prefill's model lacks: nothing may write them (checked untouched).
    prefill_keys = set(spec.model.kv_keys()) | set(spec.model.state_keys())
    unsent = [k for k in memory.tensors if k[0] is ModelRole.DRAFT and k not in prefill_keys]
    wiring = _wire(attrs.evolve(args, control_port=0), Side.DECODE)  # the decode's port: any free one
    backend = wiring.backend
    config = DecodeConfig.from_env(  # PDKV_WAIT_RECEIVES and the like, if set (the rest is the spec's)
        instance=InstanceId("decode-0"),
        rank=RankCoord(tp=args.tp),
        tp_size=spec.decode_tp,
        layout=memory.layout,
        host=spec.host(Side.DECODE),
        timeouts=spec.timeouts,
        kv_checksum=spec.kv_checksum,
        layout_policy=spec.decode_layout_policy,
        landing=spec.landing or LandingConfig(),
    )
    transport = DecodeTransport(config, backend, channel_factory=wiring.channel_factory)
    name = f"decode tp{args.tp}"
    pages = PagePool(pages_per_lane=cap.kv_pages, tier="decode-device")
    state_slots = PagePool(pages_per_lane=cap.state_slots, tier="decode-state")
    aux_rows = PagePool(pages_per_lane=cap.aux_rows, tier="decode-aux")
    quarantined: list[tuple[IntArray, bool]] = []  # pages of failed rooms, released safely or not
    canary_violations = unsafe_canary_violations = 0
    try:
        transport.start()
        gc.freeze()  # as serving engines do after start-up: the start-up heap is never scanned again
        prefill = transport.connect(args.registry, timeout_s=spec.startup_timeout_s)
        if not transport.wait_registered(prefill, timeout_s=spec.startup_timeout_s):
            raise ClusterError("prefill ranks did not acknowledge registration")
        conn.send(RankReady(name=name, address=transport.address))
        cpu_at_start = thread_cpu()
        active: dict[int, tuple[_DecodeRoom, Any, IntArray, IntArray, IntArray, float]] = {}
        stopping = False
        while not stopping or active:
            while conn.poll(0 if active else 0.05):
                command = conn.recv()
                if isinstance(command, Stop):
                    stopping = True
                    break
                assert isinstance(command, RunRooms)
                for room in command.rooms:
                    assert isinstance(room, _DecodeRoom)
                    dst = pages.allocate(room.num_pages)
                    if spec.verify_bytes:
                        for buffer_key in memory.spec.kv_keys():
                            memory.view(buffer_key)[dst] = 0  # reused pages: start from "untouched"
                    slots = state_slots.allocate(spec.state_slots_per_room)
                    if spec.verify_bytes:
                        for buffer_key in unsent:
                            memory.view(buffer_key)[dst if buffer_key[1].is_kv else slots] = 0
                    aux = aux_rows.allocate(1)
                    receiver = transport.receiver(room.room, prefill)
                    receiver.init(
                        dst,
                        int(aux[0]),
                        [StateIndices(kind=kind, indices=slots) for kind in spec.model.state_kinds],
                        prefix_pages=room.prefix_pages,  # the positions this rank's cache already holds
                    )
                    active[room.room] = (room, receiver, dst, slots, aux, time.monotonic())
            seen = transport.progress()  # before the polls: a change during them ends the wait below
            ended: list[RoomOutcome] = []  # sent together after the pass
            for key in list(active):
                room, receiver, dst, slots, aux, started = active[key]
                poll = receiver.poll()
                observed = time.monotonic()
                elapsed = observed - started
                if poll not in (KVPoll.Success, KVPoll.Failed):
                    if room.abort_after_s is not None and elapsed >= room.abort_after_s:
                        receiver.abort("planned decode-side abort")
                    continue
                if poll is KVPoll.Failed and not receiver.release_ready():
                    continue
                checked, bad = 0, []
                if poll is KVPoll.Success and not spec.verify_bytes:
                    pages.free(dst)
                elif poll is KVPoll.Success:
                    checked, mismatches = verify_room(
                        memory,
                        logical_ids=room.logical_ids,
                        dst_pages=dst,
                        prefix_pages=room.prefix_pages,
                        state_src=dict(room.state_src),
                        state_dst={kind: slots for kind in spec.model.state_kinds},
                        aux_src=room.aux_src,
                        aux_dst=int(aux[0]),
                        left_out=unsent,
                    )
                    bad = [
                        f"{m.what} {m.index}" + (" (expected untouched)" if m.expected_zero else "")
                        for m in mismatches
                    ]
                    pages.free(dst)
                else:
                    write_canary(memory, dst)
                    quarantined.append((dst, receiver.release_was_safe()))
                state_slots.free(slots)
                aux_rows.free(aux)
                metric = receiver.metric()
                skipped = receiver.draft_skipped() if poll is KVPoll.Success else None
                ended.append(
                    RoomOutcome(
                        room=room.room,
                        side=Side.DECODE,
                        rank=name,
                        poll=int(poll),
                        failure=str(receiver.failure() or ""),
                        seconds=elapsed,
                        bytes_checked=checked,
                        mismatches=tuple(bad),
                        bytes_reported=metric.bytes,
                        finished_at=observed,
                        draft_skipped="" if skipped is None else str(skipped),
                    )
                )
                receiver.clear()
                del active[key]
            if ended:
                conn.send(RoomResults(outcomes=tuple(ended)))
            if active:
                pause(transport, seen)
        time.sleep(0.2)  # a late write, if any, would land now
        for dst, safe in quarantined:
            if not canary_intact(memory, dst):
                if safe:
                    canary_violations += 1
                else:
                    unsafe_canary_violations += 1
            pages.free(dst)
        stats = transport.statistics()
        landing = transport.landing.statistics()
        cpu = cpu_since(cpu_at_start)
        conn.send(
            RankFinal(
                report=RankReport(
                    side=Side.DECODE,
                    rank=name,
                    rooms=stats.endpoint.rooms_succeeded + stats.endpoint.rooms_failed,
                    canary_violations=canary_violations,
                    unsafe_canary_violations=unsafe_canary_violations,
                    unsafe_releases=stats.unsafe_releases,
                    bytes_written=0,
                    worker_errors=0,
                    malformed=stats.channel.malformed,
                    stale_messages=stats.endpoint.stale_messages,
                    late_messages=stats.endpoint.late_messages,
                    peers_lost=stats.endpoint.peers_lost,
                    peer_restarts=stats.endpoint.peer_restarts,
                    quarantines=stats.endpoint.quarantines,
                    quarantines_proven=stats.endpoint.quarantines_proven,
                    rooms_verified=stats.endpoint.rooms_verified,
                    checksum_failures=stats.endpoint.checksum_failures,
                    rooms_landed=stats.endpoint.rooms_landed,
                    landing_leased_at_end=landing.in_use_bytes + landing.waiting,
                    faults=wiring.fault_counts(),
                    pages_in_use=(pages.total_pages - pages.free_pages)
                    + (state_slots.total_pages - state_slots.free_pages)
                    + (aux_rows.total_pages - aux_rows.free_pages),
                    cpu_s=cpu,
                ),
            )
        )
    finally:
        transport.close()
        backend.close()
