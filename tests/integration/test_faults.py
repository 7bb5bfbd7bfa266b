"""Faults injected into real rank processes over real Mooncake TCP on 127.0.0.1 (DESIGN section 8).
The process cases (the decode killed, the prefill restarted, a partition) run over NIXL too.

Every case checks the three promises: every room on every live rank is terminal within its bound
(``Cluster.run`` returns only then, and each outcome's time is checked), every decode page is back
in its pool at shutdown, and no byte landed in a decode page after that room's release (canaries
written into released pages, checked at shutdown). Timeouts are seconds, not minutes, so a
wedged room shows up as a failure here rather than as a hang.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import pytest

from pdkv.protocol.config import Timeouts
from pdkv.protocol.ids import RoomId
from pdkv.protocol.messages import RankCoord
from pdkv.protocol.poll import KVPoll
from pdkv.testing.cluster import (
    AbortPlan,
    Cluster,
    ClusterSpec,
    RankReport,
    RequestPlan,
    RoomOutcome,
    TimedAction,
)
from pdkv.testing.faults import (
    BackendFaults,
    ChannelFaults,
    MessageRule,
    RankFaults,
    garbage_frames,
    netns_unavailable,
    send_frames,
    send_frames_to_registry,
    send_messages,
    stale_heartbeat,
    veth_namespaces,
)
from pdkv.testing.synthetic import Capacity, ModelSpec

pytestmark = pytest.mark.slow

MODEL = ModelSpec(layers=2, page_size=16, kv_bytes_per_token=64, state_layers=(0,), draft_layers=0)
FAST = Timeouts(
    bootstrap=5,
    waiting=5,
    inflight=5,
    transfer=5,
    abort_ack=2,
    quarantine=3,
    quarantine_settle=1,
    abort_resend=0.3,
    register_retry=0.3,
    heartbeat_interval=0.3,
    heartbeat_timeout=1.0,
)
PARTITION_S = 7.0  # past the engine's transfer timeout (5 s) and every protocol deadline
BOUND_S = 14.0  # the longest any room may take here: a deadline (5 s), the ack wait and quarantine, slack


# The process cases run over both engines; "nixl" is UCX's default transports (cma writes, tcp for the rest).
ENGINES = {"mooncake": ("mooncake", None), "nixl": ("nixl", None), "nixl-tcp": ("nixl", "tcp")}


def spec(
    *,
    prefill_cp: int = 1,
    faults: tuple[RankFaults, ...] = (),
    timeouts: Timeouts = FAST,
    stable_addresses: bool = False,
    engine: str = "mooncake",
) -> ClusterSpec:
    backend, ucx_tls = ENGINES[engine]
    return ClusterSpec(
        backend=backend,
        ucx_tls=ucx_tls,
        model=MODEL,
        prefill_cp=prefill_cp,
        timeouts=timeouts,
        faults=faults,
        stable_addresses=stable_addresses,
        prefill_capacity=Capacity(kv_pages=256, state_slots=32, aux_rows=16),
        decode_capacity=Capacity(kv_pages=512, state_slots=64, aux_rows=32),
        startup_timeout_s=60,
        room_timeout_s=30,
        consensus_timeout_s=5,
    )


def room(n: int, *, chunks: int = 1, forward_s: float = 0.0, abort: AbortPlan | None = None) -> RequestPlan:
    return RequestPlan(
        room=RoomId(n),
        tokens=16 * 8 * chunks,
        chunk_tokens=(16 * 8,) * chunks,
        forward_s=forward_s,
        abort=abort,
    )


def check_promises(
    outcomes: list[RoomOutcome],
    reports: list[RankReport],
    *,
    decode_alive: bool = True,
    bound_s: float = BOUND_S,
) -> None:
    """Terminal within the bound, correct bytes where Success, pages back, no write after release."""
    for o in outcomes:
        assert o.poll in (KVPoll.Success, KVPoll.Failed), o
        assert o.seconds <= bound_s, (o.room, o.rank, o.seconds)
        assert o.mismatches == (), (o.room, o.mismatches)
        if o.side == "decode" and o.poll == KVPoll.Success:
            assert o.bytes_checked > 0
    decode = [r for r in reports if r.side == "decode"]
    assert len(decode) == (1 if decode_alive else 0)
    for r in decode:
        assert r.canary_violations == 0, r
        assert r.pages_in_use == 0, r
    assert all(r.worker_errors == 0 for r in reports)


def by_side(outcomes: list[RoomOutcome], side: str) -> dict[int, list[RoomOutcome]]:
    out: dict[int, list[RoomOutcome]] = {}
    for o in outcomes:
        if o.side == side:
            out.setdefault(o.room, []).append(o)
    return out


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_decode_killed_in_the_middle_of_a_transfer(engine: str) -> None:
    """Case 1: the prefill rank's rooms all end (heartbeat loss or engine failure), none stays stuck."""
    plans = [room(n, chunks=3, forward_s=0.4) for n in range(1, 5)]
    with Cluster(spec(engine=engine)) as cluster:
        outcomes = cluster.run(
            plans, max_active=4, actions=[TimedAction(after_s=0.6, action=_kill("decode"))]
        )
        reports = cluster.close()
    prefill = by_side(outcomes, "prefill")
    assert set(prefill) == {1, 2, 3, 4}
    assert all(o.poll == KVPoll.Failed for os_ in prefill.values() for o in os_)
    check_promises(outcomes, reports, decode_alive=False)
    assert [r.rank for r in reports] == ["prefill tp0/cp0"]


@pytest.mark.parametrize("engine", ["mooncake"])  # NIXL passed it too (14 s); the test budget keeps one kill
def test_prefill_cp_rank_killed_in_the_middle_of_a_transfer(engine: str) -> None:
    """Case 2: decode fails the rooms (heartbeat, statuses), the surviving CP rank fails them when its
    consensus group breaks; pages come back (unsafe releases allowed: the dead rank never acks)."""
    plans = [room(n, chunks=3, forward_s=0.4) for n in range(1, 5)]
    with Cluster(spec(prefill_cp=2, engine=engine)) as cluster:
        outcomes = cluster.run(
            plans, max_active=4, actions=[TimedAction(after_s=0.6, action=_kill("prefill", cp=1))]
        )
        reports = cluster.close()
    decode = by_side(outcomes, "decode")
    assert set(decode) == {1, 2, 3, 4}
    assert all(o.poll == KVPoll.Failed for os_ in decode.values() for o in os_)
    survivor = by_side(outcomes, "prefill")
    assert all(
        o.poll == KVPoll.Failed and o.rank == "prefill tp0/cp0" for os_ in survivor.values() for o in os_
    )
    assert [r.consensus_lost != "" for r in reports if r.side == "prefill"] == [True]
    check_promises(outcomes, reports)


def test_lost_abort_and_lost_abort_ack_are_recovered_by_the_resent_abort() -> None:
    """Cases 3 and 4: room 1's Abort is dropped, room 2's AbortAck is dropped; the decode resends the
    Abort (backoff from ``abort_resend``), the prefill acknowledges it, and both rooms' pages come back
    safely, before the ack wait ends; no late byte lands, later rooms succeed."""
    faults = (
        RankFaults(side="decode", channel=ChannelFaults(drop=(MessageRule(message="Abort", times=1),))),
        RankFaults(side="prefill", channel=ChannelFaults(drop=(MessageRule(message="AbortAck", times=1),))),
    )
    plans = [
        room(1, abort=AbortPlan(side="decode", after_s=0.0)),
        room(2, chunks=2, forward_s=0.3, abort=AbortPlan(side="decode", after_s=0.1)),
        room(3),
        room(4, chunks=2),
    ]
    with Cluster(spec(faults=faults)) as cluster:
        outcomes = cluster.run(plans, max_active=1)
        reports = cluster.close()
    decode = {o.room: o for o in outcomes if o.side == "decode"}
    assert decode[1].poll == KVPoll.Failed and decode[2].poll == KVPoll.Failed
    assert decode[3].poll == KVPoll.Success and decode[4].poll == KVPoll.Success
    (d,) = [r for r in reports if r.side == "decode"]
    (p,) = [r for r in reports if r.side == "prefill"]
    assert d.unsafe_releases == 0  # before the resend, both were released unsafely after abort_ack
    assert d.faults.dropped == 1 and p.faults.dropped == 1
    check_promises(outcomes, reports)


def test_engine_failure_on_the_nth_batch_fails_the_room_on_every_cp_rank() -> None:
    """Case 5: CP rank 1's second batch fails; that room fails on decode and, through rank consensus,
    on CP rank 0 too; every other room succeeds byte for byte."""
    faults = (RankFaults(side="prefill", cp=1, backend=BackendFaults(fail_batch=2)),)
    plans = [room(n) for n in range(1, 5)]
    with Cluster(spec(prefill_cp=2, faults=faults)) as cluster:
        outcomes = cluster.run(plans, max_active=1)
        reports = cluster.close()
    failed_decode = {o.room for o in outcomes if o.side == "decode" and o.poll == KVPoll.Failed}
    assert failed_decode == {2}
    prefill = by_side(outcomes, "prefill")
    assert [o.poll for o in sorted(prefill[2], key=lambda o: o.rank)] == [KVPoll.Failed, KVPoll.Failed]
    assert all(o.poll == KVPoll.Success for n in (1, 3, 4) for o in prefill[n])
    assert sum(r.faults.failed_batches for r in reports) == 1
    check_promises(outcomes, reports)


def test_transfer_delayed_past_the_waiting_deadline_lands_before_the_release() -> None:
    """Case 6: the engine holds every batch 2.5 s; decode's waiting deadline (1 s) fails the room; the
    late bytes land while prefill drains, before its AbortAck, so the release is safe and canaries hold.

    One room at a time, so each room's write reaches the engine: with two at once the second one's
    write may still be queued behind the held one when the abort comes, and is then dropped and acked
    at once (also safe, and a different case: its release at 1 s is not a late one)."""
    faults = (RankFaults(side="prefill", backend=BackendFaults(hold_s=2.5)),)
    timeouts = attrs.evolve(FAST, waiting=1.0, abort_ack=6.0)
    with Cluster(spec(faults=faults, timeouts=timeouts)) as cluster:
        outcomes = cluster.run([room(1), room(2)], max_active=1)
        reports = cluster.close()
    decode = [o for o in outcomes if o.side == "decode"]
    assert [o.poll for o in decode] == [KVPoll.Failed, KVPoll.Failed]
    # released only after the held write ended
    assert all(o.seconds >= 2.0 for o in decode), [(o.room, o.seconds) for o in decode]
    (d,) = [r for r in reports if r.side == "decode"]
    (p,) = [r for r in reports if r.side == "prefill"]
    assert d.unsafe_releases == 0
    assert p.faults.held_batches == 2  # each room's write was in the engine when its abort came
    check_promises(outcomes, reports)


def test_garbage_duplicates_and_old_epochs_are_counted_and_rooms_keep_working() -> None:
    """Cases 7 and 8: garbage, truncated and wrong-version frames on every socket (both prefill ranks,
    decode, registry); every TransferRequest and TransferStatus duplicated; heartbeats from incarnations
    that no longer exist. Counted on each socket; every room still succeeds byte for byte."""
    twice = ChannelFaults(
        duplicate=(MessageRule(message="TransferRequest"), MessageRule(message="TransferStatus")),
    )
    faults = (
        RankFaults(side="decode", channel=twice),
        RankFaults(side="prefill", cp=0, channel=twice),
        RankFaults(side="prefill", cp=1, channel=twice),
    )
    garbage = garbage_frames(seed=7)
    with Cluster(spec(prefill_cp=2, faults=faults)) as cluster:
        for cp in (0, 1):
            send_frames(cluster.address("prefill", cp=cp), garbage)
        send_frames(cluster.address("decode"), garbage)
        send_frames_to_registry(cluster.registry_address, garbage)
        send_messages(cluster.address("prefill", cp=0), [stale_heartbeat("decode-0", RankCoord(tp=0))])
        send_messages(cluster.address("decode"), [stale_heartbeat("prefill-0", RankCoord(tp=0, cp=1))])
        outcomes = cluster.run([room(n, chunks=2) for n in range(1, 5)], max_active=4)
        registry_malformed = cluster.registry_statistics().malformed
        reports = cluster.close()
    assert all(o.poll == KVPoll.Success for o in outcomes)
    assert len(by_side(outcomes, "decode")) == 4
    assert registry_malformed == len(garbage)
    for r in reports:
        assert r.malformed == len(garbage), r
        assert r.faults.duplicated > 0, r
    assert [r.stale_messages >= 1 for r in reports if r.rank in ("prefill tp0/cp0", "decode tp0")] == [
        True,
        True,
    ]
    check_promises(outcomes, reports)


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_prefill_restarted_behind_the_same_address(engine: str) -> None:
    """Case 9: the old incarnation's rooms fail on decode; decode registers with the new one (same
    address, new epoch) and new rooms succeed."""
    with Cluster(spec(stable_addresses=True, engine=engine)) as cluster:
        address = cluster.address("prefill")
        first = cluster.run(
            [room(n, chunks=3, forward_s=0.4) for n in range(1, 4)],
            max_active=3,
            actions=[TimedAction(after_s=0.6, action=_restart("prefill"))],
        )
        assert cluster.address("prefill") == address
        second = cluster.run([room(n, chunks=2) for n in range(10, 14)], max_active=4)
        if engine == "nixl" and not all(o.poll == KVPoll.Success for o in second):
            # Over NIXL the new incarnation's first writes can meet the decode's UCX still tearing down
            # the dead one's connections (NIXL_ERR_REMOTE_DISCONNECT, once in three full runs here):
            # those rooms fail cleanly as any engine failure, the backend reloads the peer, and the
            # next rooms must all succeed.
            assert all("REMOTE_DISCONNECT" in o.failure for o in second if o.poll != KVPoll.Success)
            settled = cluster.run([room(n, chunks=2) for n in range(20, 24)], max_active=4)
            second = second + settled
        else:
            settled = second
        reports = cluster.close()
    old = [o for o in first if o.side == "decode"]
    assert len(old) == 3 and all(o.poll == KVPoll.Failed for o in old)
    assert all(o.poll == KVPoll.Success for o in settled)
    assert len(by_side(settled, "decode")) == 4 and len(by_side(settled, "prefill")) == 4
    (d,) = [r for r in reports if r.side == "decode"]
    assert d.peers_lost + d.peer_restarts >= 1
    check_promises(first + second, reports)


# Over NIXL with UCX_TLS=tcp it passed too (ENGINES["nixl-tcp"], 34 s): left out of the default run.
@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_network_partition_between_namespaces(engine: str) -> None:
    """Case 10: prefill and decode in two network namespaces joined by veth; the link goes down in
    the middle of a transfer. Both sides fail the rooms that span the partition (heartbeat silence,
    deadlines); the decode quarantines their pages (no AbortAck can cross the cut), and once the link
    is back the ranks register again, the prefill answers the resent Abort after a fence write (its
    engine queue drained), the decode cuts every engine connection from the prefill host (bytes stuck
    in the old TCP connections die with them) and the pages come back, proven, long before the
    settle time; new rooms succeed. Zero unsafe releases, zero canary violations."""
    reason = netns_unavailable()
    if reason is not None:
        pytest.skip(f"network partition via netns/veth: {reason}")
    # The quarantine outlasts the partition; the settle time (the fallback when connections cannot be
    # cut, and what a failed write's fenced ack waits: it proves the engine queue drained, not the
    # connections) is longer than the heal-to-cut time, so the quarantined rooms come back through the
    # proven release and only the rooms failed by the cut's after-effects settle. Here the cut came
    # 0.15 s after the heal and 6 s after the rooms failed: 10 s keeps 4 s over the longer of the two.
    timeouts = attrs.evolve(FAST, quarantine=90, quarantine_settle=10)
    with veth_namespaces("t10") as layout:
        partitioned = attrs.evolve(
            spec(timeouts=timeouts, engine=engine), netns=layout, engine_transfer_timeout_s=5
        )
        with Cluster(partitioned) as cluster:
            before = cluster.run([room(n, chunks=2) for n in (1, 2)], max_active=2)
            # Cut 0.6 s in, healed PARTITION_S later (long enough for the engine to give up on
            # anything stuck); the run ends once the rooms' pages came back out of quarantine.
            during = cluster.run(
                [room(n, chunks=3, forward_s=0.4) for n in (3, 4, 5)],
                max_active=3,
                actions=[
                    TimedAction(after_s=0.6, action=lambda _: layout.partition()),
                    TimedAction(after_s=0.6 + PARTITION_S, action=lambda _: layout.heal()),
                ],
            )
            # The cut also ends the prefill engine's idle lanes to this decode; Mooncake notices a dead
            # lane only when it writes on it, so the first batches after the release may fail (their
            # rooms fail cleanly, as any engine failure, and their pages settle: 10 s). Later rooms
            # run on fresh connections.
            settling = cluster.run([room(n, chunks=1) for n in range(20, 26)], max_active=1)
            after = cluster.run([room(n, chunks=2) for n in (10, 11)], max_active=2)
            reports = cluster.close()
    assert all(o.poll == KVPoll.Success for o in before)
    cut = [o for o in during if o.side == "decode"]
    assert len(cut) == 3 and all(o.poll == KVPoll.Failed for o in cut), cut
    assert all(o.poll == KVPoll.Success for o in after), after
    (d,) = [r for r in reports if r.side == "decode"]
    assert d.peers_lost >= 1
    # A write stuck in the cut link may land when it heals: the pages were quarantined meanwhile, so
    # no page the decode handed back was written after its release.
    assert d.unsafe_releases == 0 and d.unsafe_canary_violations == 0
    assert d.quarantines >= 1 and d.quarantines_proven == d.quarantines, d
    assert sum(r.fences for r in reports if r.side == "prefill") >= 1
    check_promises(before + during + settling + after, reports, bound_s=PARTITION_S + 30)


def _kill(side: str, tp: int = 0, cp: int = 0) -> Callable[[Cluster], None]:
    def act(cluster: Cluster) -> None:
        cluster.kill(side, tp, cp)

    return act


def _restart(side: str, tp: int = 0, cp: int = 0) -> Callable[[Cluster], None]:
    def act(cluster: Cluster) -> None:
        cluster.restart(side, tp, cp)

    return act
