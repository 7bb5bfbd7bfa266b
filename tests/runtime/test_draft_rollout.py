"""A rolling deployment over real transports (zmq on 127.0.0.1, the registry thread, the loopback
engine): one side registers the draft model's state buffers and the other does not.

Under ``degrade_draft`` the rooms succeed, every target byte (KV, state, aux) and the draft KV land as
the content rule says, the draft state moves nowhere (the decode's own draft state buffers stay zero),
the bytes the prefill reports are those of the buffers both sides have, and the decode receiver says
per room what it did not get (``draft_skipped()``), with a WARNING once per pair and the
``pdkv_draft_buffers_skipped`` gauge. Under ``strict`` (either side) the registration is refused
naming both lists; a target-state difference is refused under every policy.
The prefill's answer is its decode-rank row's (``machines.decode_rank``: ``registration_refused``
calls ``pdkv.protocol.registration.answer_register`` under the endpoint's ``layout_policy``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import attrs
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pdkv.errors import LayoutMismatchError
from pdkv.mapping import BufferKey, BufferKind, LayoutPolicy, ModelRole
from pdkv.metrics import PrometheusExporter, TransportCounter, TransportGauge
from pdkv.protocol.ids import RoomId
from pdkv.protocol.messages import StateIndices
from pdkv.protocol.poll import KVPoll
from pdkv.runtime.per_layer import PerLayerMode
from pdkv.testing.synthetic import ModelSpec, RankMemory, verify_room
from tests.runtime.rig import Rig, wait_for
from tests.runtime.test_per_layer import Room

WITH_DRAFT_STATE = ModelSpec(
    layers=3, page_size=16, state_layers=(1,), draft_layers=1, draft_state_layers=(0,)
)
WITHOUT_DRAFT_STATE = attrs.evolve(WITH_DRAFT_STATE, draft_state_layers=())
DRAFT_STATE = tuple(
    BufferKey(model=ModelRole.DRAFT, kind=k, layer_id=0) for k in WITH_DRAFT_STATE.state_kinds
)


def draft_state_keys(memory: RankMemory) -> list[tuple[ModelRole, BufferKind, int]]:
    return [k for k in memory.tensors if k[0] is ModelRole.DRAFT and k[1].is_state]


def run_one_room(rig: Rig, room: int, *, per_layer: bool = False) -> Room:
    """A 10-page room in two chunks after a 1-page decode prefix, on the rig's monolithic or per-layer
    path; returns it once every side reported Success."""
    logical = np.array([3, 9, 1, 4, 12, 6, 7, 20, 21, 22], dtype=np.int64)
    dst = np.arange(30, 40, dtype=np.int64)
    r = Room(rig, room, logical, dst, slots=2, aux=4, prefix_pages=1)
    start = 1
    for n, size in enumerate([4, 5]):
        pages = logical[start : start + size]
        if per_layer:
            assert r.register(pages, start) == [PerLayerMode.PER_LAYER]
        r.forward(pages)
        r.send(pages, start, last=n == 1)
        start += size
    r.wait_success()
    return r


def check_bytes(rig: Rig, r: Room, decode_spec: ModelSpec) -> None:
    """Every buffer both sides have holds the content rule; the decode's draft state the prefill lacks
    is untouched (zero: nothing wrote it)."""
    memory = rig.decode_memory[0]
    unsent = [k for k in draft_state_keys(memory) if k not in rig.prefill_memory[0].tensors]
    checked, mismatches = verify_room(
        memory,
        logical_ids=r.logical,
        dst_pages=r.dst,
        prefix_pages=1,
        state_src={k: r.src_slots for k in decode_spec.state_kinds},
        state_dst={k: r.dst_slots for k in decode_spec.state_kinds},
        aux_src=2,
        aux_dst=r.dst_aux,
        left_out=unsent,
    )
    assert mismatches == [] and checked > 0


def both_sides_bytes(spec: ModelSpec, pages: int, slots: int) -> int:
    """What a room moves in the buffers both sides have (``spec``: the model without draft state)."""
    kv = pages * spec.kv_item_bytes * (spec.layers + spec.draft_layers)
    state = slots * spec.state_item_bytes * len(spec.state_kinds) * len(spec.state_layers)
    return kv + state + spec.aux_item_bytes


@pytest.mark.parametrize("per_layer", [False, True], ids=["monolithic", "per-layer"])
def test_prefill_with_draft_state_serves_a_decode_without(
    rig_factory: Callable[..., Rig], caplog: pytest.LogCaptureFixture, per_layer: bool
) -> None:
    rig = rig_factory(spec=WITH_DRAFT_STATE, decode_spec=WITHOUT_DRAFT_STATE)
    with caplog.at_level(logging.WARNING):
        prefill = rig.start_registered()
        rooms = [run_one_room(rig, 10 + i, per_layer=per_layer) for i in range(2)]
    for r in rooms:
        check_bytes(rig, r, WITHOUT_DRAFT_STATE)
        receiver = r.receivers[0]
        skipped = receiver.draft_skipped()
        assert skipped is not None and skipped.not_sent == DRAFT_STATE and skipped.not_written == ()
        assert skipped.peers == ("p:tp0/cp0",)
        assert receiver.metric().bytes == both_sides_bytes(WITHOUT_DRAFT_STATE, pages=9, slots=2)
    assert rig.bytes_sent() == 2 * both_sides_bytes(WITHOUT_DRAFT_STATE, pages=9, slots=2)
    # One WARNING per pair on each side (two rooms, one registration), naming the buffers.
    warned = [(r.name, r.getMessage()) for r in caplog.records if "draft-model buffers" in r.getMessage()]
    assert sorted(name for name, _ in warned) == ["pdkv.runtime.decode", "pdkv.runtime.prefill"]
    assert all("[draft index_k layer 0, draft index_scale layer 0]" in text for _, text in warned)
    assert not [m for m in caplog.messages if "layout digest" in m]  # the difference is explained
    decode = rig.decode
    assert decode.statistics().endpoint.rooms_draft_skipped == 2
    assert decode.metrics.value(TransportCounter.ROOMS_DRAFT_SKIPPED) == 2
    wait_for(lambda: decode.metrics.snapshot().gauges[TransportGauge.DRAFT_BUFFERS_SKIPPED] == 2, timeout=15)
    registry = CollectorRegistry()
    PrometheusExporter(decode.metrics, registry=registry)
    text = generate_latest(registry).decode()
    assert "pdkv_draft_buffers_skipped 2.0" in text
    assert "pdkv_rooms_draft_skipped_total 2.0" in text
    assert prefill == rig.prefill_instance


def test_decode_with_draft_state_is_served_by_a_prefill_without(rig_factory: Callable[..., Rig]) -> None:
    rig = rig_factory(spec=WITHOUT_DRAFT_STATE, decode_spec=WITH_DRAFT_STATE)
    rig.start_registered()
    # The decode asks for its draft state slots too (its scheduler does not know the prefill's model).
    r = run_one_room(rig, 20)
    check_bytes(rig, r, WITH_DRAFT_STATE)
    skipped = r.receivers[0].draft_skipped()
    assert skipped is not None and skipped.not_written == DRAFT_STATE and skipped.not_sent == ()
    memory = rig.decode_memory[0]
    for key in draft_state_keys(memory):
        assert not memory.view(key).any(), key  # draft state absent: nothing wrote any slot


def test_the_absence_check_fails_when_draft_state_is_written(rig_factory: Callable[..., Rig]) -> None:
    """The control of the case above: with draft state on both sides it is written, and the check that
    the decode's draft state stayed untouched fails."""
    rig = rig_factory(spec=WITH_DRAFT_STATE, decode_spec=WITH_DRAFT_STATE)
    rig.start_registered()
    r = run_one_room(rig, 21)
    assert r.receivers[0].draft_skipped() is None
    memory = rig.decode_memory[0]
    assert all(memory.view(key)[r.dst_slots].any() for key in draft_state_keys(memory))
    _, mismatches = verify_room(
        memory,
        logical_ids=r.logical,
        dst_pages=r.dst,
        prefix_pages=1,
        state_src={k: r.src_slots for k in WITH_DRAFT_STATE.state_kinds},
        state_dst={k: r.dst_slots for k in WITH_DRAFT_STATE.state_kinds},
        aux_src=2,
        aux_dst=r.dst_aux,
        left_out=draft_state_keys(memory),
    )
    assert mismatches and all("left out, written at" in m.what for m in mismatches)


@pytest.mark.parametrize(
    ("prefill_spec", "decode_spec"),
    [(WITH_DRAFT_STATE, WITHOUT_DRAFT_STATE), (WITHOUT_DRAFT_STATE, WITH_DRAFT_STATE)],
    ids=["prefill-has-draft", "decode-has-draft"],
)
@pytest.mark.parametrize("per_layer", [False, True], ids=["monolithic", "per-layer"])
def test_checksums_cover_what_a_degraded_pair_transfers(
    rig_factory: Callable[..., Rig], prefill_spec: ModelSpec, decode_spec: ModelSpec, per_layer: bool
) -> None:
    """With PDKV_KV_CHECKSUM on both sides, a rollout pair's rooms are verified and succeed: the
    prefill checksums the buffers it writes to that rank and the decode checks those, not the draft
    state only one side has (which the prefill never wrote, so checking it would fail every room)."""
    rig = rig_factory(spec=prefill_spec, decode_spec=decode_spec, kv_checksum=True)
    rig.start_registered()
    r = run_one_room(rig, 40, per_layer=per_layer)
    check_bytes(rig, r, decode_spec)
    assert r.receivers[0].draft_skipped() is not None
    endpoint = rig.decode.statistics().endpoint
    assert (endpoint.rooms_verified, endpoint.checksum_failures) == (1, 0)


@pytest.mark.parametrize(
    ("prefill_spec", "decode_spec"),
    [(WITH_DRAFT_STATE, WITHOUT_DRAFT_STATE), (WITHOUT_DRAFT_STATE, WITH_DRAFT_STATE)],
    ids=["prefill-has-draft", "decode-has-draft"],
)
def test_a_strict_prefill_refuses_naming_both_lists(
    rig_factory: Callable[..., Rig], prefill_spec: ModelSpec, decode_spec: ModelSpec
) -> None:
    rig = rig_factory(spec=prefill_spec, decode_spec=decode_spec, prefill_policy=LayoutPolicy.STRICT)
    with pytest.raises(LayoutMismatchError) as refused:
        rig.start(timeout_s=10)
    here = "[0]" if prefill_spec.draft_state_layers else "[]"
    there = "[]" if prefill_spec.draft_state_layers else "[0]"
    assert f"draft index_k layer ids differ: {here} vs {there}" in str(refused.value)
    assert f"draft index_scale layer ids differ: {here} vs {there}" in str(refused.value)


def test_a_strict_decode_refuses_a_degraded_answer_naming_both_lists(rig_factory: Callable[..., Rig]) -> None:
    rig = rig_factory(
        spec=WITH_DRAFT_STATE, decode_spec=WITHOUT_DRAFT_STATE, decode_policy=LayoutPolicy.STRICT
    )
    with pytest.raises(LayoutMismatchError) as refused:
        rig.start(timeout_s=10)
    text = str(refused.value)
    assert "this decode's layout policy is strict" in text
    assert "its own [draft index_k layer 0, draft index_scale layer 0] (not registered here)" in text
    assert "this rank's [] (not registered there)" in text
    receiver = rig.decode.receiver(RoomId(30), rig.prefill_instance)
    receiver.init(np.arange(2), 0, [StateIndices(kind=BufferKind.INDEX_K, indices=[1])])
    wait_for(lambda: receiver.poll() is KVPoll.Failed)


@pytest.mark.parametrize("policy", list(LayoutPolicy))
def test_a_target_state_difference_is_refused_under_every_policy(
    rig_factory: Callable[..., Rig], policy: LayoutPolicy
) -> None:
    other_target = attrs.evolve(WITH_DRAFT_STATE, state_layers=(0, 1))
    rig = rig_factory(
        spec=WITH_DRAFT_STATE, decode_spec=other_target, prefill_policy=policy, decode_policy=policy
    )
    with pytest.raises(LayoutMismatchError, match=r"target index_k layer ids differ: \[1\] vs \[0, 1\]"):
        rig.start(timeout_s=10)
