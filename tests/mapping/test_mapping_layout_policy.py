"""The layout policy: what a registration accepts under STRICT and DEGRADE_DRAFT, what each side leaves
out, and the planning view that keeps blocks off the buffers left out.

The expected decisions are restated here from how each pair of layouts was generated (which draft
lists were cut, which target field was changed), never read back from ``compatibility``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdkv.errors import LayoutError, LayoutMismatchError
from pdkv.mapping import (
    AttentionKind,
    BufferKey,
    BufferKind,
    BufferLayout,
    BufferSpec,
    LayoutCompatibility,
    LayoutPolicy,
    ModelRole,
    PageRuns,
    compatibility,
    layer_blocks,
    state_blocks,
    transfer_view,
)
from pdkv.mapping.layout_policy import plan_view

T, D = ModelRole.TARGET, ModelRole.DRAFT
KV, IK, IS = BufferKind.KV, BufferKind.INDEX_K, BufferKind.INDEX_SCALE
SWA, AUX = BufferKind.SWA, BufferKind.AUX
STATE_KINDS = (IK, IS, SWA)
ITEMS = 8

Groups = Mapping[tuple[ModelRole, BufferKind], list[int]]


def build(
    groups: Groups,
    *,
    item_bytes: Mapping[tuple[ModelRole, BufferKind], int] | None = None,
    base: int = 1 << 20,
    page_size: int = 16,
) -> BufferLayout:
    """An MLA layout with the given layer ids per (model, kind), buffers laid out one after another."""
    sizes = item_bytes or {}
    specs: list[BufferSpec] = []
    address = base
    for (model, kind), layers in groups.items():
        item = sizes.get((model, kind), 64 if kind is KV else 32)
        for layer in layers:
            specs.append(
                BufferSpec(
                    kind=kind,
                    model=model,
                    layer_id=layer,
                    base_ptr=address,
                    length=ITEMS * item,
                    item_bytes=item,
                )
            )
            address += ITEMS * item
    return BufferLayout.build(attention=AttentionKind.MLA, page_size=page_size, buffers=specs)


def keys(layout: BufferLayout) -> set[BufferKey]:
    return {BufferKey.of(b) for b in layout.buffers}


layer_lists = st.lists(st.integers(0, 9), max_size=4, unique=True).map(sorted)


@st.composite
def target_groups(draw: st.DrawFn) -> dict[tuple[ModelRole, BufferKind], list[int]]:
    groups: dict[tuple[ModelRole, BufferKind], list[int]] = {
        (T, KV): sorted(draw(st.lists(st.integers(0, 9), min_size=1, max_size=4, unique=True)))
    }
    for kind in STATE_KINDS:
        groups[(T, kind)] = draw(layer_lists)
    groups[(T, AUX)] = [0]
    return groups


@st.composite
def rollout_pairs(draw: st.DrawFn) -> tuple[Groups, Groups, dict[BufferKind, tuple[list[int], list[int]]]]:
    """Two layouts with one target model and draft lists of which, per kind, one starts the other:
    (mine, theirs, kind -> (my draft ids left out, their draft ids left out))."""
    target = draw(target_groups())
    mine: dict[tuple[ModelRole, BufferKind], list[int]] = dict(target)
    theirs: dict[tuple[ModelRole, BufferKind], list[int]] = dict(target)
    tails: dict[BufferKind, tuple[list[int], list[int]]] = {}
    for kind in (KV, *STATE_KINDS):
        full = draw(layer_lists)
        cut = draw(st.integers(0, len(full)))
        if draw(st.booleans()):
            mine[(D, kind)], theirs[(D, kind)] = full, full[:cut]
            tails[kind] = (full[cut:], [])
        else:
            mine[(D, kind)], theirs[(D, kind)] = full[:cut], full
            tails[kind] = ([], full[cut:])
    return mine, theirs, tails


def draft_keys(tails: Mapping[BufferKind, tuple[list[int], list[int]]], side: int) -> tuple[BufferKey, ...]:
    out = [
        BufferKey(model=D, kind=kind, layer_id=layer)
        for kind in BufferKind
        if kind in tails
        for layer in tails[kind][side]
    ]
    return tuple(out)


# ---------------------------------------------------------------- the decision


@given(target_groups(), st.sampled_from(LayoutPolicy))
def test_equal_layouts_are_accepted_with_nothing_left_out(groups: Groups, policy: LayoutPolicy) -> None:
    decision = compatibility(build(groups), build(groups, base=1 << 30), policy)
    assert decision.accepted and not decision.degraded
    assert decision.left_out_mine == decision.left_out_theirs == ()


@given(rollout_pairs())
def test_degrade_draft_leaves_out_exactly_the_tails(
    pair: tuple[Groups, Groups, dict[BufferKind, tuple[list[int], list[int]]]],
) -> None:
    mine_groups, theirs_groups, tails = pair
    mine, theirs = build(mine_groups), build(theirs_groups, base=1 << 30)
    decision = compatibility(mine, theirs, LayoutPolicy.DEGRADE_DRAFT)
    assert decision.accepted, decision.refusal
    assert decision.left_out_mine == draft_keys(tails, 0)
    assert decision.left_out_theirs == draft_keys(tails, 1)
    assert all(k.model is D for k in decision.left_out_mine + decision.left_out_theirs)
    # What is kept pairs exactly, key for key.
    assert keys(mine) - set(decision.left_out_mine) == keys(theirs) - set(decision.left_out_theirs)
    # Seen from the other side, the same decision.
    assert compatibility(theirs, mine, LayoutPolicy.DEGRADE_DRAFT) == decision.swapped()


@given(rollout_pairs())
def test_strict_refuses_any_draft_difference_naming_both_lists(
    pair: tuple[Groups, Groups, dict[BufferKind, tuple[list[int], list[int]]]],
) -> None:
    mine_groups, theirs_groups, tails = pair
    mine, theirs = build(mine_groups), build(theirs_groups, base=1 << 30)
    decision = compatibility(mine, theirs, LayoutPolicy.STRICT)
    differs = [kind for kind, (a, b) in tails.items() if a or b]
    assert decision.accepted is (not differs)
    assert decision.left_out_mine == decision.left_out_theirs == ()
    for kind in differs:
        assert decision.refusal is not None
        here, there = mine_groups[(D, kind)], theirs_groups[(D, kind)]
        listed = f"draft {kind.value} layer ids differ: {here} vs {there}"
        assert listed in decision.refusal


@st.composite
def target_changes(draw: st.DrawFn) -> tuple[Groups, Groups, str]:
    """Two layouts that differ in the target model (layer ids or bytes per item of one kind), with
    any draft lists: (mine, theirs, the text the refusal must contain)."""
    mine_groups, theirs_groups, _ = draw(rollout_pairs())
    kind = draw(st.sampled_from([KV, *STATE_KINDS]))
    ids = mine_groups[(T, kind)]
    other = sorted(set(ids) ^ {draw(st.integers(0, 9))})
    if kind is KV and not other:
        other = [ids[0] + 10]
    theirs = dict(theirs_groups)
    theirs[(T, kind)] = other
    return mine_groups, theirs, f"target {kind.value} layer ids differ: {ids} vs {other}"


@given(target_changes(), st.sampled_from(LayoutPolicy))
def test_a_target_difference_is_refused_under_every_policy(
    change: tuple[Groups, Groups, str], policy: LayoutPolicy
) -> None:
    mine_groups, theirs_groups, text = change
    decision = compatibility(build(mine_groups), build(theirs_groups, base=1 << 30), policy)
    assert not decision.accepted
    assert decision.refusal is not None and text in decision.refusal
    assert decision.left_out_mine == decision.left_out_theirs == ()


@given(target_groups(), st.sampled_from([KV, *STATE_KINDS, AUX]), st.sampled_from(LayoutPolicy))
def test_target_bytes_per_item_differ_is_refused_under_every_policy(
    groups: Groups, kind: BufferKind, policy: LayoutPolicy
) -> None:
    if not groups[(T, kind)]:
        groups = {**groups, (T, kind): [0]}
    wide = {(T, kind): 128}
    decision = compatibility(build(groups), build(groups, item_bytes=wide, base=1 << 30), policy)
    assert decision.refusal is not None
    assert f"target {kind.value} bytes per item differ" in decision.refusal


def test_draft_lists_that_do_not_start_one_another_are_another_draft_model() -> None:
    mine = build({(T, KV): [0, 1], (D, IK): [0, 1]})
    theirs = build({(T, KV): [0, 1], (D, IK): [1]}, base=1 << 30)
    for policy in LayoutPolicy:
        decision = compatibility(mine, theirs, policy)
        assert decision.refusal is not None
        assert "draft index_k layer ids differ: [0, 1] vs [1]" in decision.refusal


def test_draft_buffers_with_other_bytes_per_item_are_refused() -> None:
    mine = build({(T, KV): [0], (D, IK): [0, 1]})
    theirs = build({(T, KV): [0], (D, IK): [0]}, item_bytes={(D, IK): 48}, base=1 << 30)
    decision = compatibility(mine, theirs, LayoutPolicy.DEGRADE_DRAFT)
    assert decision.refusal == "draft index_k bytes per item differ: [32] vs [48]"


def test_attention_or_page_size_differences_are_refused_under_every_policy() -> None:
    mine = build({(T, KV): [0], (D, KV): [0]})
    for policy in LayoutPolicy:
        other_pages = compatibility(mine, build({(T, KV): [0]}, page_size=32, base=1 << 30), policy)
        assert other_pages.refusal == "page sizes differ: 16 vs 32"


def test_policy_parse_and_bad_arguments() -> None:
    assert LayoutPolicy.parse(" Degrade_Draft ") is LayoutPolicy.DEGRADE_DRAFT
    assert LayoutPolicy.parse("strict") is LayoutPolicy.STRICT
    with pytest.raises(ValueError, match="choose from"):
        LayoutPolicy.parse("lenient")
    layout = build({(T, KV): [0]})
    with pytest.raises(LayoutError, match="policy must be a LayoutPolicy") as caught:
        compatibility(layout, layout, "strict")  # type: ignore[arg-type]  # the wrong type on purpose
    assert caught.value.field == "policy"
    with pytest.raises(LayoutError, match="leaves nothing out"):
        LayoutCompatibility(
            policy=LayoutPolicy.STRICT, refusal="x", left_out_mine=(BufferKey(model=D, kind=KV, layer_id=0),)
        )


# ---------------------------------------------------------------- the planning view


@given(rollout_pairs(), st.integers(1, ITEMS))
def test_planned_blocks_never_touch_a_buffer_left_out(
    pair: tuple[Groups, Groups, dict[BufferKind, tuple[list[int], list[int]]]], pages: int
) -> None:
    mine_groups, theirs_groups, tails = pair
    src, dst = build(mine_groups), build(theirs_groups, base=1 << 30)
    view = transfer_view(src, dst)
    assert transfer_view(src, dst) is view  # one view per registration
    runs = PageRuns(src_start=[0], dst_start=[ITEMS - pages], length=[pages])
    blocks = view.restore(layer_blocks(runs, view.src, view.dst))
    slots = np.arange(pages, dtype=np.int64)
    for kind in STATE_KINDS:
        if view.src.select(kind) and view.dst.select(kind):
            blocks = type(blocks).concat(
                [blocks, view.restore(state_blocks(kind, slots, slots, view.src, view.dst))]
            )
    left_src, left_dst = set(draft_keys(tails, 0)), set(draft_keys(tails, 1))
    # Every block lies inside a kept buffer on both sides, and its index names its source buffer.
    for s, d, n, i in zip(blocks.src, blocks.dst, blocks.length, blocks.buffer, strict=True):
        source = src.buffers[int(i)]
        assert BufferKey.of(source) not in left_src
        assert source.base_ptr <= s and s + n <= source.base_ptr + source.length
        target = [b for b in dst.buffers if b.base_ptr <= d < b.base_ptr + b.length]
        assert len(target) == 1 and BufferKey.of(target[0]) == BufferKey.of(source)
        assert BufferKey.of(target[0]) not in left_dst
    # Every kept KV buffer got its pages.
    kept_kv = [b for b in src.buffers if b.kind is KV and BufferKey.of(b) not in left_src]
    written_kv = {int(i) for i in blocks.buffer if src.buffers[int(i)].kind is KV}
    assert written_kv == {src.buffers.index(b) for b in kept_kv}


def test_plan_view_of_refused_layouts_is_whole_so_the_builders_refuse() -> None:
    src = build({(T, KV): [0, 1], (D, KV): [0]})
    dst = build({(T, KV): [0]}, base=1 << 30)
    view = plan_view(src, dst)
    assert view.src is src and view.dst is dst and not view.leaves_out
    with pytest.raises(LayoutMismatchError):
        layer_blocks(PageRuns(src_start=[0], dst_start=[0], length=[1]), view.src, view.dst)


def test_plan_view_without_differences_is_the_identity() -> None:
    src = build({(T, KV): [0], (D, KV): [0]})
    view = plan_view(src, build({(T, KV): [0], (D, KV): [0]}, base=1 << 30))
    assert view.src is src and view.src_index is None
    blocks = layer_blocks(PageRuns(src_start=[0], dst_start=[0], length=[1]), view.src, view.dst)
    assert view.restore(blocks) is blocks
