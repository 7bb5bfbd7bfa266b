"""State clipping (reported, never silent) and state-layer compaction (bijection, exact difference)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdkv.errors import MappingError
from pdkv.mapping import (
    AttentionKind,
    BufferKind,
    BufferLayout,
    BufferSpec,
    LayerKey,
    ModelRole,
    StateLayerMap,
    clip_state,
    compare_state_layers,
    state_layer_keys,
)

T, D = ModelRole.TARGET, ModelRole.DRAFT


# ---------------------------------------------------------------- clipping


@given(st.lists(st.integers(0, 999), max_size=30), st.lists(st.integers(0, 999), max_size=30))
def test_clip_state_keeps_the_common_head_and_reports_the_rest(src: list[int], dst: list[int]) -> None:
    clipped = clip_state(src, dst)
    common = min(len(src), len(dst))
    assert clipped.src.tolist() == src[:common]
    assert clipped.dst.tolist() == dst[:common]
    assert clipped.clipped_src == len(src) - common
    assert clipped.clipped_dst == len(dst) - common
    assert clipped.clipped == (len(src) != len(dst))


def test_clip_state_describes_what_it_dropped() -> None:
    clipped = clip_state([4, 5, 6, 7], [1, 2, 3])
    assert (clipped.clipped_src, clipped.clipped_dst) == (1, 0)
    assert clipped.describe() == "state indices clipped: dropped the last 1 source entries, kept 3"
    assert clip_state([1], [2]).describe() == ""
    assert (
        clip_state([1], [2, 3, 4])
        .describe()
        .startswith("state indices clipped: dropped the last 2 destination")
    )


# ---------------------------------------------------------------- compaction map


@given(
    st.integers(0, 80).flatmap(
        lambda n: st.tuples(st.just(n), st.lists(st.booleans(), min_size=n, max_size=n))
    )
)
def test_compaction_maps_are_bijections(case: tuple[int, list[bool]]) -> None:
    num_layers, flags = case
    layer_map = StateLayerMap.from_mask(np.asarray(flags, dtype=np.bool_))
    with_state = [i for i, f in enumerate(flags) if f]
    assert layer_map.num_slots == len(with_state)
    slots = np.arange(layer_map.num_slots)
    assert layer_map.layer_of(slots).tolist() == with_state
    assert layer_map.slot_of(layer_map.layer_of(slots)).tolist() == slots.tolist()
    assert layer_map.layer_of(layer_map.slot_of(with_state)).tolist() == with_state
    assert layer_map.has_state(np.arange(num_layers)).tolist() == flags


def test_index_skip_hand_example() -> None:
    # 8 layers, the index is kept on every other layer starting at 1 (layers 1, 3, 5, 7)
    layer_map = StateLayerMap.from_layer_ids([7, 1, 5, 3], num_layers=8)
    assert layer_map.state_layers.tolist() == [1, 3, 5, 7]
    assert layer_map.slot_of([1, 3, 5, 7]).tolist() == [0, 1, 2, 3]
    assert layer_map.layer_of([2, 0]).tolist() == [5, 1]
    with pytest.raises(
        MappingError, match=r"2 layer\(s\) keep no state; layers without state: n=2 runs=2 \[2 4\]"
    ):
        layer_map.slot_of([2, 3, 4])
    with pytest.raises(MappingError, match=r"state slots must lie in 0\.\.3"):
        layer_map.layer_of([4])
    with pytest.raises(MappingError, match=r"layer ids must lie in 0\.\.7"):
        layer_map.slot_of([8])


def test_compaction_map_rejects_bad_layer_lists() -> None:
    with pytest.raises(MappingError, match="listed twice"):
        StateLayerMap.from_layer_ids([1, 3, 1], num_layers=4)
    with pytest.raises(MappingError, match=r"must lie in 0\.\.3"):
        StateLayerMap.from_layer_ids([4], num_layers=4)
    with pytest.raises(MappingError, match="1-D bool array"):
        StateLayerMap.from_mask([0, 1])


# ---------------------------------------------------------------- comparison


keys = st.lists(st.builds(LayerKey, model=st.sampled_from([T, D]), layer_id=st.integers(0, 20)), unique=True)


@given(keys, keys)
def test_compare_state_layers_returns_the_exact_difference(
    mine: list[LayerKey], theirs: list[LayerKey]
) -> None:
    diff = compare_state_layers(mine, theirs)
    if set(mine) == set(theirs):
        assert diff is None
        return
    assert diff is not None
    assert set(diff.missing_here) == set(theirs) - set(mine)
    assert set(diff.missing_there) == set(mine) - set(theirs)
    assert set(diff.mine) == set(mine)
    assert set(diff.theirs) == set(theirs)


def test_compare_state_layers_message_names_both_lists() -> None:
    mine = [LayerKey(model=T, layer_id=i) for i in (1, 3, 5)] + [LayerKey(model=D, layer_id=0)]
    theirs = [LayerKey(model=T, layer_id=i) for i in (5, 3, 2)]
    diff = compare_state_layers(mine, theirs)
    assert str(diff) == (
        "state layers differ: missing here [target:2], missing at the peer [target:1, draft:0]; "
        "here [target:1, target:3, target:5, draft:0] vs peer [target:2, target:3, target:5]"
    )
    assert compare_state_layers(reversed(theirs), theirs) is None


def test_compare_state_layers_rejects_duplicates() -> None:
    twice = [LayerKey(model=T, layer_id=1), LayerKey(model=T, layer_id=1)]
    with pytest.raises(MappingError, match="local state layers list target:1 more than once"):
        compare_state_layers(twice, [])


def test_state_layer_keys_of_a_layout() -> None:
    def spec(kind: BufferKind, model: ModelRole, layer: int) -> BufferSpec:
        return BufferSpec(kind=kind, model=model, layer_id=layer, base_ptr=0, length=64, item_bytes=8)

    layout = BufferLayout.build(
        attention=AttentionKind.MLA,
        page_size=64,
        buffers=[
            spec(BufferKind.KV, T, 0),
            spec(BufferKind.INDEX_K, T, 3),
            spec(BufferKind.INDEX_SCALE, T, 3),
            spec(BufferKind.INDEX_K, D, 0),
            spec(BufferKind.SWA, T, 1),
        ],
    )
    assert state_layer_keys(layout, BufferKind.INDEX_K) == (
        LayerKey(model=T, layer_id=3),
        LayerKey(model=D, layer_id=0),
    )
    assert state_layer_keys(layout) == (
        LayerKey(model=T, layer_id=1),
        LayerKey(model=T, layer_id=3),
        LayerKey(model=D, layer_id=0),
    )
    with pytest.raises(MappingError, match="not a state buffer kind"):
        state_layer_keys(layout, BufferKind.KV)


def test_clipped_state_does_not_alias_the_inputs() -> None:
    src = np.array([1, 2, 3], dtype=np.int64)
    dst = np.array([4, 5], dtype=np.int64)
    clipped = clip_state(src, dst)
    src[:] = 0
    dst[:] = 0
    assert clipped.src.tolist() == [1, 2]
    assert clipped.dst.tolist() == [4, 5]
