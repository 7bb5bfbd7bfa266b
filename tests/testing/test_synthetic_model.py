"""``ModelSpec.kv_only``: the benchmarks' model registers KV buffers and the aux row, nothing else."""

from __future__ import annotations

from pdkv.mapping import AttentionKind, BufferKind
from pdkv.testing.synthetic import Capacity, ModelSpec, RankMemory


def test_a_kv_only_model_registers_one_kv_buffer_per_layer_and_the_aux_row() -> None:
    model = ModelSpec.kv_only(layers=3, page_size=8, kv_bytes_per_token=16)
    layout = RankMemory(model, Capacity(kv_pages=4, state_slots=1, aux_rows=2)).layout
    assert [(b.kind, b.layer_id) for b in layout.kv_buffers] == [(BufferKind.KV, layer) for layer in range(3)]
    assert layout.state_buffers == () and len(layout.aux_buffers) == 1
    assert {b.item_bytes for b in layout.kv_buffers} == {8 * 16}


def test_kv_only_keeps_the_other_fields_it_is_given() -> None:
    model = ModelSpec.kv_only(attention=AttentionKind.MHA, layers=2, kv_bytes_per_token=32, kv_heads=4)
    assert (model.attention, model.kv_heads, model.draft_layers, model.state_layers) == (
        AttentionKind.MHA,
        4,
        0,
        (),
    )
