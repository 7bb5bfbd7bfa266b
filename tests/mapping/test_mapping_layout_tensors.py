"""``BufferLayout.from_tensors`` refuses tensors that do not describe their bytes (seams issue, item 1).

A strided view used to be accepted: the engine moves raw memory from the view's data pointer, so both
sides reported Success with bytes the scheduler never wrote there. Each rule below is a typed
``LayoutError`` naming the buffer and the rule, raised before anything is registered.
"""

from __future__ import annotations

import pytest
import torch

from pdkv.errors import LayoutError, PdkvError
from pdkv.mapping.layout import AttentionKind, BufferKind, BufferLayout, ModelRole

PAGE = 16


def _layout(*entries: tuple[BufferKind, int, torch.Tensor, int]) -> BufferLayout:
    return BufferLayout.from_tensors(
        attention=AttentionKind.MLA,
        page_size=PAGE,
        tensors=[(kind, ModelRole.TARGET, layer, t, item) for kind, layer, t, item in entries],
    )


def test_a_contiguous_token_pool_is_accepted_with_its_page_item() -> None:
    pool = torch.zeros((PAGE * 8, 576), dtype=torch.bfloat16)
    layout = _layout((BufferKind.KV, 0, pool, PAGE * 576 * 2))
    assert layout.kv_buffers[0].num_items == 8
    assert layout.kv_buffers[0].base_ptr == pool.data_ptr()


def test_a_strided_view_is_refused_naming_the_buffer_and_the_rule() -> None:
    base = torch.zeros((PAGE * 8, 128), dtype=torch.uint8)
    view = base[:, :64]  # what a scheduler slicing a wider pool would hand in
    with pytest.raises(LayoutError, match=r"target kv layer 3: .*not contiguous") as info:
        _layout((BufferKind.KV, 3, view, PAGE * 64))
    assert isinstance(info.value, PdkvError) and info.value.field == "tensors"


def test_a_zero_size_tensor_is_refused() -> None:
    with pytest.raises(LayoutError, match="holds no bytes"):
        _layout((BufferKind.KV, 0, torch.zeros((0, 64), dtype=torch.uint8), PAGE * 64))


def test_overlapping_tensors_are_refused_naming_both() -> None:
    pool = torch.zeros((PAGE * 8, 64), dtype=torch.uint8)
    first, second = pool[: PAGE * 4], pool[PAGE * 2 : PAGE * 6]  # each contiguous, sharing 2 pages
    with pytest.raises(LayoutError, match=r"target kv layer 0 .* and target kv layer 1 .* overlap"):
        _layout((BufferKind.KV, 0, first, PAGE * 64), (BufferKind.KV, 1, second, PAGE * 64))


def test_a_buffer_inside_a_larger_one_is_an_overlap_too() -> None:
    pool = torch.zeros((PAGE * 8, 64), dtype=torch.uint8)
    aux = torch.zeros((4, 64), dtype=torch.uint8)
    inner = pool[PAGE : PAGE * 2]
    with pytest.raises(LayoutError, match="overlap"):
        _layout(
            (BufferKind.KV, 0, pool, PAGE * 64),
            (BufferKind.KV, 1, inner, PAGE * 64),
            (BufferKind.AUX, 0, aux, 64),
        )


def test_bytes_per_page_that_disagree_with_the_dtype_are_refused() -> None:
    # A bf16 pool declared with the page size of an fp32 one: 576 x 4 bytes per token is neither one
    # row (1,152 B) nor a page of them.
    pool = torch.zeros((PAGE * 8, 576), dtype=torch.bfloat16)
    with pytest.raises(LayoutError, match=r"item_bytes 2304 disagrees with the tensor.*1152 B per row"):
        _layout((BufferKind.KV, 0, pool, 576 * 4))


def test_a_length_that_is_not_whole_items_is_refused() -> None:
    pool = torch.zeros((PAGE * 8 + 1, 64), dtype=torch.uint8)
    with pytest.raises(LayoutError, match="not a whole number of items"):
        _layout((BufferKind.KV, 0, pool, PAGE * 64))


def test_state_and_aux_rows_may_be_whole_items_or_several_per_item() -> None:
    kv = torch.zeros((PAGE * 4, 64), dtype=torch.uint8)
    aux = torch.zeros((6, 16), dtype=torch.int32)  # one row = one item of 64 B
    state = torch.zeros((32, 8), dtype=torch.uint8)  # items of 16 B span two rows
    layout = _layout(
        (BufferKind.KV, 0, kv, PAGE * 64), (BufferKind.AUX, 0, aux, 64), (BufferKind.SWA, 0, state, 16)
    )
    assert layout.min_items(BufferKind.AUX) == 6 and layout.min_items(BufferKind.SWA) == 16
    with pytest.raises(LayoutError, match="disagrees"):  # 96 B items over 64 B rows: 1.5 rows each
        _layout((BufferKind.KV, 0, kv, PAGE * 64), (BufferKind.AUX, 0, aux, 96))
