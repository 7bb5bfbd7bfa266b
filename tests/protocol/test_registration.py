"""The prefill's answer to a Register under each layout policy: what the reply carries and says."""

from __future__ import annotations

import attrs
import pytest

from pdkv.mapping import BufferKey, BufferKind, LayoutPolicy, ModelRole
from pdkv.protocol import codec
from pdkv.protocol.effects import NoticeLevel
from pdkv.protocol.ids import Endpoint, Epoch, InstanceId, SessionId
from pdkv.protocol.messages import Origin, RankCoord, Register, RegisterAck, RegisterReject
from pdkv.protocol.registration import answer_register
from pdkv.testing.synthetic import Capacity, ModelSpec, RankMemory

PREFILL = Origin(instance=InstanceId("p"), epoch=Epoch(1), rank=RankCoord(tp=0))
DECODE = Origin(instance=InstanceId("d"), epoch=Epoch(2), rank=RankCoord(tp=0))
CAPACITY = Capacity(kv_pages=8, state_slots=4, aux_rows=2)
WITH = ModelSpec(layers=2, state_layers=(0, 1), draft_layers=1, draft_state_layers=(0,))
WITHOUT = attrs.evolve(WITH, draft_state_layers=())
DRAFT_STATE = tuple(BufferKey(model=ModelRole.DRAFT, kind=k, layer_id=0) for k in WITH.state_kinds)


def register(spec: ModelSpec) -> Register:
    layout = RankMemory(spec, CAPACITY).layout
    return Register(origin=DECODE, tp_size=1, endpoint=Endpoint("e"), session=SessionId("s"), layout=layout)


@pytest.mark.parametrize("policy", list(LayoutPolicy))
def test_matching_layouts_get_a_plain_ack(policy: LayoutPolicy) -> None:
    answer = answer_register(PREFILL, RankMemory(WITH, CAPACITY).layout, register(WITH), policy)
    assert answer.accepted and answer.reply == RegisterAck(origin=PREFILL) and answer.warning is None


@pytest.mark.parametrize(
    ("prefill", "decode", "prefill_left_out", "decode_left_out"),
    [(WITH, WITHOUT, DRAFT_STATE, ()), (WITHOUT, WITH, (), DRAFT_STATE)],
)
def test_degrade_draft_acks_naming_what_each_side_leaves_out(
    prefill: ModelSpec,
    decode: ModelSpec,
    prefill_left_out: tuple[BufferKey, ...],
    decode_left_out: tuple[BufferKey, ...],
) -> None:
    answer = answer_register(
        PREFILL, RankMemory(prefill, CAPACITY).layout, register(decode), LayoutPolicy.DEGRADE_DRAFT
    )
    assert answer.reply == RegisterAck(
        origin=PREFILL, prefill_left_out=prefill_left_out, decode_left_out=decode_left_out
    )
    assert codec.decode(codec.encode(answer.reply)) == answer.reply  # it crosses the wire as it is
    assert answer.compatibility.left_out_count == 2
    assert answer.warning is not None and answer.warning.level is NoticeLevel.WARNING
    text = answer.warning.text
    listed = "[draft index_k layer 0, draft index_scale layer 0]"
    side = "this prefill" if prefill_left_out else "that decode"
    assert f"decode rank {DECODE}" in text and f"{side} {listed}" in text


def test_strict_refuses_naming_both_lists() -> None:
    prefill = RankMemory(WITH, CAPACITY).layout
    answer = answer_register(PREFILL, prefill, register(WITHOUT), LayoutPolicy.STRICT)
    assert not answer.accepted and answer.warning is None
    assert isinstance(answer.reply, RegisterReject) and not answer.reply.retry
    assert answer.reply.reason == (
        f"layout mismatch with prefill {PREFILL}: draft index_k layer ids differ: [0] vs []; "
        "draft index_scale layer ids differ: [0] vs []"
    )


@pytest.mark.parametrize("policy", list(LayoutPolicy))
def test_a_target_state_difference_is_refused_under_every_policy(policy: LayoutPolicy) -> None:
    other_target = attrs.evolve(WITHOUT, state_layers=(0,))
    answer = answer_register(PREFILL, RankMemory(WITH, CAPACITY).layout, register(other_target), policy)
    assert isinstance(answer.reply, RegisterReject)
    assert "target index_k layer ids differ: [0, 1] vs [0]" in answer.reply.reason
    assert answer.compatibility.left_out_mine == answer.compatibility.left_out_theirs == ()


def test_the_decision_is_kept_from_the_prefill_side() -> None:
    answer = answer_register(
        PREFILL, RankMemory(WITH, CAPACITY).layout, register(WITHOUT), LayoutPolicy.DEGRADE_DRAFT
    )
    assert answer.compatibility.left_out_mine == DRAFT_STATE
    assert answer.compatibility.left_out_theirs == ()
    assert all(k.kind in (BufferKind.INDEX_K, BufferKind.INDEX_SCALE) for k in DRAFT_STATE)
