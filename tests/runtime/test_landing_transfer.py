"""The landing zone through real transports (zmq on 127.0.0.1, loopback bytes): decode TP below prefill
TP, MHA heads of several prefill ranks per decode page. Each prefill rank writes its page items whole
into the decode's landing lease (grant in its TransferRequest); the decode scatters them into its pages
before it reports Success, and every decode head byte is checked against the content rule. A control
that skips the scatter must be caught by the same check. The lease comes back after Success and after
an abort; a pool smaller than two rooms makes the second wait in Bootstrapping, then succeed; a room
larger than the pool goes grant-less."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import numpy as np
import pytest

from pdkv.engine.loopback import LoopbackFaults
from pdkv.mapping import AttentionKind
from pdkv.metrics import TransportCounter, TransportGauge
from pdkv.protocol.effects import FailureCause
from pdkv.protocol.ids import RoomId
from pdkv.protocol.messages import StateIndices
from pdkv.protocol.poll import KVPoll
from pdkv.runtime.decode import DecodeTransport, KVReceiver
from pdkv.runtime.landing import LandingConfig, LandingPool
from pdkv.runtime.prefill import KVSender
from pdkv.testing.synthetic import ModelSpec, verify_room
from tests.runtime.rig import TIMEOUTS, Rig, wait_for

# 8 KV heads of 4 bytes: prefill TP 4 holds 2 heads a rank, decode TP 2 holds 4 (from 2 prefill ranks).
HEADS8 = ModelSpec(
    attention=AttentionKind.MHA,
    layers=2,
    page_size=16,
    kv_bytes_per_token=8 * 4,
    kv_heads=8,
    state_layers=(0,),
    draft_layers=1,
)
# GQA, 2 KV heads: prefill TP 4 holds one head a rank (ranks 0, 1 head 0; 2, 3 head 1); a decode rank
# of TP 1 holds both, from prefill ranks 0 and 2 (1 and 3 are dummies).
GQA2 = attrs.evolve(HEADS8, kv_bytes_per_token=2 * 8, kv_heads=2)
PAGES = 14  # a room's positions
PREFIX = 2


class Request:
    """One room on every rank: every decode rank's receiver opened, every prefill rank's sender."""

    def __init__(self, rig: Rig, room: int, *, open_senders: bool = True) -> None:
        rng = np.random.default_rng(room)
        self.rig = rig
        self.room = RoomId(room)
        self.logical = rng.choice(np.arange(40), size=PAGES, replace=False).astype(np.int64)
        window = np.arange(20 * room, 20 * room + 20)  # rooms never share a destination page
        run = window[8:14]  # a run of destination pages: blocks merge
        others = rng.choice(np.setdiff1d(window, run), size=PAGES - run.size, replace=False)
        self.dst = np.concatenate([others[:3], run, others[3:]]).astype(np.int64)
        self.aux = room % 8
        self.dst_slots = np.array([room % 4, room % 4 + 1])
        self.src_slots = np.array([1, 6])
        self.receivers: list[KVReceiver] = []
        for d in rig.decodes:
            receiver = d.receiver(self.room, rig.prefill_instance)
            receiver.init(
                self.dst,
                self.aux,
                [StateIndices(kind=k, indices=self.dst_slots) for k in rig.spec.state_kinds],
                prefix_pages=PREFIX,
            )
            self.receivers.append(receiver)
        self.senders: list[KVSender] = []
        if open_senders:
            self.open_senders()

    def open_senders(self) -> None:
        self.senders = [p.sender(self.room) for p in self.rig.prefills]
        for sender in self.senders:
            sender.init(PAGES, 2)

    def send(self) -> None:
        wait_for(lambda: all(s.poll() is KVPoll.WaitingForInput for s in self.senders))
        state = [StateIndices(kind=k, indices=self.src_slots) for k in self.rig.spec.state_kinds]
        for sender in self.senders:
            sender.send(self.logical[PREFIX:8], start_token=PREFIX * self.rig.spec.page_size, last=False)
            sender.send(
                self.logical[8:], start_token=8 * self.rig.spec.page_size, last=True, state_indices=state
            )

    def wait_success(self) -> None:
        wait_for(lambda: all(r.poll() is KVPoll.Success for r in self.receivers))
        wait_for(lambda: all(s.poll() is KVPoll.Success for s in self.senders))

    def mismatches(self) -> list[str]:
        found: list[str] = []
        for d, memory in enumerate(self.rig.decode_memory):
            checked, bad = verify_room(
                memory,
                logical_ids=self.logical,
                dst_pages=self.dst,
                prefix_pages=PREFIX,
                state_src={k: self.src_slots for k in self.rig.spec.state_kinds},
                state_dst={k: self.dst_slots for k in self.rig.spec.state_kinds},
                aux_src=2,
                aux_dst=self.aux,
            )
            # Every K/V byte of every position of this rank's heads, plus state and aux.
            kv = memory.spec.kv_keys()
            assert checked >= PAGES * memory.kv_item_bytes * len(kv)
            found += [f"decode {d}: {m}" for m in bad]
        return found

    def clear(self) -> None:
        for r in self.receivers:
            wait_for(r.release_ready)
            r.clear()
        ended = (KVPoll.Success, KVPoll.Failed)
        wait_for(lambda: all(s.poll() in ended for s in self.senders))
        for s in self.senders:
            s.clear()


def landing_rig(
    factory: Callable[..., Rig], spec: ModelSpec, prefill_tp: int, decode_tp: int, **kw: object
) -> Rig:
    rig = factory(spec=spec, prefill_tp=prefill_tp, decode_tp=decode_tp, **kw)
    rig.start_registered()
    return rig


def pools(rig: Rig) -> list[LandingPool]:
    return [d.landing for d in rig.decodes]


def gauge(decode: DecodeTransport, which: TransportGauge) -> int:
    return decode.metrics.snapshot().gauges[which]


@pytest.mark.parametrize(
    ("spec", "prefill_tp", "decode_tp"), [(HEADS8, 4, 2), (GQA2, 4, 1)], ids=["mha-tp4-to-2", "gqa2-tp4-to-1"]
)
def test_heads_land_and_are_scattered_byte_for_byte(
    rig_factory: Callable[..., Rig], spec: ModelSpec, prefill_tp: int, decode_tp: int
) -> None:
    rig = landing_rig(rig_factory, spec, prefill_tp, decode_tp)
    assert all(d.uses_landing(rig.prefill_instance) for d in rig.decodes)
    for room in (1, 2):
        request = Request(rig, room)
        request.send()
        request.wait_success()
        assert request.mismatches() == []
        request.clear()
    for pool in pools(rig):
        stats = pool.statistics()
        assert stats.leases == 2 and stats.scatters == 2 and stats.fallbacks == 0
        assert stats.in_use_bytes == 0 and stats.waiting == 0  # every lease came back after Success
    assert all(d.statistics().endpoint.rooms_landed == 2 for d in rig.decodes)
    # Each byte once: every decode rank's K/V pages of the sent positions (whole decode items, all
    # heads, from the real sources only: dummies write nothing), plus its state slots and aux row.
    item = spec.page_size * spec.kv_bytes_per_token // decode_tp
    state = len(spec.state_kinds) * len(spec.state_layers) * 2 * spec.state_item_bytes
    per_room = decode_tp * ((PAGES - PREFIX) * len(spec.kv_keys()) * item + state + spec.aux_item_bytes)
    assert rig.bytes_sent() == 2 * per_room


def test_control_a_skipped_scatter_is_caught(
    rig_factory: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same room with the scatter skipped reaches Success (nothing else checks the bytes) and the
    byte check finds the decode's K/V pages not written: the check above can fail."""
    rig = landing_rig(rig_factory, HEADS8, 4, 2)
    monkeypatch.setattr(LandingPool, "scatter", lambda self, effect: None)
    request = Request(rig, 3)
    request.send()
    request.wait_success()
    bad = request.mismatches()
    assert bad and all("k/L" in m or "v/L" in m for m in bad), bad


def test_control_a_pool_registered_after_the_register_went_out_fails_its_rooms(
    rig_factory: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rig's loopback engine writes only into the regions the decode's Register announced (as
    NIXL's does): the first landing zone, registered lazily by the first room after the Register had
    gone out, passed every loopback test and failed every landing write over NIXL. Put back, the
    rooms fail here too, naming the region; registered at connect() (the test above), they land."""
    monkeypatch.setattr(DecodeTransport, "_prepare_landing", lambda self, prefill: None)
    rig = landing_rig(rig_factory, HEADS8, 4, 2)
    request = Request(rig, 4)
    request.send()
    wait_for(lambda: all(r.poll() is KVPoll.Failed for r in request.receivers))
    reasons = [str(r.failure()) for r in request.receivers]
    assert all("not inside a region" in reason and "announced" in reason for reason in reasons), reasons
    assert all(pool.statistics().leases == 1 for pool in pools(rig))  # the lease was granted, lazily
    # The prefill's fence for the decode's Abort writes into the same unannounced zone and fails too,
    # so no AbortAck comes: the decodes close without the ack timeout's wait (10 s), their memory
    # left registered as for any room whose writes are not proven over. Only a prefill rank whose
    # own write failed owes a fence: one that learnt of the failure first skipped its write.
    wait_for(lambda: all(s.poll() is KVPoll.Failed for s in request.senders))
    failed_writes = {
        i: str(f)
        for i, f in enumerate(s.failure() for s in request.senders)
        if f is not None and f.cause is FailureCause.ENGINE
    }
    assert failed_writes and all("announced" in reason for reason in failed_writes.values()), failed_writes
    wrote = [rig.prefills[i] for i in failed_writes]
    wait_for(lambda: all(p.statistics().endpoint.fences_failed >= 1 for p in wrote))
    for decode in rig.decodes:
        decode.close(timeout_s=0.1)


def test_with_checksums_the_pages_are_verified_after_the_scatter(rig_factory: Callable[..., Rig]) -> None:
    rig = landing_rig(rig_factory, HEADS8, 4, 2, kv_checksum=True)
    request = Request(rig, 4)
    request.send()
    request.wait_success()
    assert request.mismatches() == []
    assert all(d.statistics().endpoint.rooms_verified == 1 for d in rig.decodes)


def test_abort_mid_room_releases_the_lease_after_the_acks(rig_factory: Callable[..., Rig]) -> None:
    rig = landing_rig(rig_factory, HEADS8, 4, 2)
    request = Request(rig, 5)
    wait_for(lambda: all(r.poll() is KVPoll.WaitingForInput for r in request.receivers))
    assert all(p.statistics().in_use_bytes > 0 for p in pools(rig))  # leased, requests sent
    first = request.logical[PREFIX:8]
    wait_for(lambda: all(s.poll() is KVPoll.WaitingForInput for s in request.senders))
    for sender in request.senders:  # the first chunk only: the room is mid-transfer
        sender.send(first, start_token=PREFIX * rig.spec.page_size, last=False)
    for r in request.receivers:
        r.abort("test: abort mid-room")
    for r in request.receivers:
        wait_for(r.release_ready)
        assert r.poll() is KVPoll.Failed and r.release_was_safe()
    assert all(p.statistics().in_use_bytes == 0 for p in pools(rig))
    # The pool serves the next room as before.
    request.clear()
    again = Request(rig, 6)
    again.send()
    again.wait_success()
    assert again.mismatches() == []


def test_an_engine_failure_fails_the_room_and_the_lease_comes_back_with_its_pages(
    rig_factory: Callable[..., Rig],
) -> None:
    """Every prefill rank's first batch fails (half of its blocks landed first, as a real engine may):
    the room fails on every decode rank without a scatter, and its lease returns only with its pages."""
    rig = landing_rig(rig_factory, HEADS8, 4, 2, faults=LoopbackFaults(fail_batches={1}))
    request = Request(rig, 10)
    wait_for(lambda: all(s.poll() is KVPoll.WaitingForInput for s in request.senders))
    state = [StateIndices(kind=k, indices=request.src_slots) for k in rig.spec.state_kinds]
    for sender in request.senders:  # one chunk: nothing is sent after the failure
        sender.send(
            request.logical[PREFIX:], start_token=PREFIX * rig.spec.page_size, last=True, state_indices=state
        )
    wait_for(lambda: all(r.poll() is KVPoll.Failed for r in request.receivers))
    for r in request.receivers:
        wait_for(r.release_ready)
        assert r.release_was_safe()
    assert all(p.statistics().scatters == 0 and p.statistics().in_use_bytes == 0 for p in pools(rig))
    assert all(d.metrics.value(TransportCounter.ROOMS_LANDED) == 0 for d in rig.decodes)
    request.clear()
    again = Request(rig, 11)  # the faults were for the first batches only: the pool serves it
    again.send()
    again.wait_success()
    assert again.mismatches() == []
    assert all(p.statistics().leases == 2 and p.statistics().scatters == 1 for p in pools(rig))


def test_a_pool_smaller_than_two_rooms_makes_the_second_wait(rig_factory: Callable[..., Rig]) -> None:
    # One room's lease per decode rank: 2 sources x 6 K/V buffers x 12 slots x 16 tokens x 2 heads x 4
    # bytes (each source's region a multiple of 256 bytes already).
    one_room = 2 * len(HEADS8.kv_keys()) * (PAGES - PREFIX) * HEADS8.page_size * 2 * 4
    # The gauges are refreshed at every heartbeat round: every 0.2 s here (5 s by default).
    beats = attrs.evolve(TIMEOUTS, heartbeat_interval=0.2)
    rig = landing_rig(
        rig_factory, HEADS8, 4, 2, landing=LandingConfig(capacity_bytes=one_room + 1024), timeouts=beats
    )
    first = Request(rig, 7)
    second = Request(rig, 8)
    wait_for(lambda: all(r.poll() is KVPoll.WaitingForInput for r in first.receivers))
    assert all(r.poll() is KVPoll.Bootstrapping for r in second.receivers)  # waits for space
    assert all(p.statistics().waiting == 1 for p in pools(rig))
    # What an operator sees meanwhile: one room waiting, the first room's lease in use.
    wait_for(lambda: all(gauge(d, TransportGauge.ROOMS_WAITING_FOR_LANDING) == 1 for d in rig.decodes))
    assert all(gauge(d, TransportGauge.LANDING_BYTES_IN_USE) == one_room for d in rig.decodes)
    first.send()
    first.wait_success()
    second.send()  # its requests went once the first room's lease came back
    second.wait_success()
    assert first.mismatches() == [] and second.mismatches() == []
    assert all(p.statistics().waits == 1 and p.statistics().in_use_bytes == 0 for p in pools(rig))
    assert all(d.metrics.value(TransportCounter.ROOMS_LANDED) == 2 for d in rig.decodes)
    wait_for(lambda: all(gauge(d, TransportGauge.ROOMS_WAITING_FOR_LANDING) == 0 for d in rig.decodes))
    wait_for(lambda: all(gauge(d, TransportGauge.LANDING_BYTES_IN_USE) == 0 for d in rig.decodes))


def test_a_room_larger_than_the_pool_goes_grant_less(rig_factory: Callable[..., Rig]) -> None:
    rig = landing_rig(rig_factory, HEADS8, 4, 2, landing=LandingConfig(capacity_bytes=4096))
    request = Request(rig, 9)
    request.send()
    request.wait_success()
    assert request.mismatches() == []
    assert all(p.statistics().fallbacks == 1 and p.statistics().leases == 0 for p in pools(rig))
    assert all(d.statistics().endpoint.landing_fallbacks == 1 for d in rig.decodes)


def test_equal_tp_and_replicas_need_no_landing(rig_factory: Callable[..., Rig]) -> None:
    """GQA replicas (2 KV heads, TP 4 -> 2: one real source per decode rank) move whole pages grant-less."""
    rig = landing_rig(rig_factory, GQA2, 4, 2)
    assert not any(d.uses_landing(rig.prefill_instance) for d in rig.decodes)
    request = Request(rig, 10)
    request.send()
    request.wait_success()
    assert request.mismatches() == []
    assert all(p.statistics().leases == 0 for p in pools(rig))
