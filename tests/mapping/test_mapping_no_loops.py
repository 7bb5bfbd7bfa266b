"""No Python loop over pages or layers in the hot mapping functions (checked on the source's AST).

A hot function may contain no ``for`` / ``while`` statement and no comprehension or generator.
The two exceptions loop once per *batch* (``batch_bounds``'s cut loop and ``shape_batches``'s list
of batches); they are listed with their exact loop count so a new loop anywhere fails this test.
Layout pairing (a loop over buffers, and the per-buffer segment templates of ``heads``) is
registration-time work behind an identity cache; the last tests show the hot path does not redo it.
"""

from __future__ import annotations

import ast
import inspect
from types import ModuleType

import pytest

import pdkv.mapping.buffers as buffers_module
from pdkv.mapping import (
    AttentionKind,
    BufferKind,
    BufferLayout,
    BufferSpec,
    ModelRole,
    PageRuns,
    _arrays,
    batches,
    buffers,
    heads,
    landing,
    layer_blocks,
    layout,
    ownership,
    pages,
    runs,
    staging,
    state,
)

LOOP_NODES = (ast.For, ast.AsyncFor, ast.While, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)

HOT: dict[ModuleType, dict[str, int]] = {
    _arrays: {
        "as_index_array": 0,
        "as_non_negative_index_array": 0,
        "count_runs": 0,
        "device_of": 0,
        "int_min": 0,
        "int_max": 0,
        "int_bounds": 0,
        "int_sum": 0,
        "any_true": 0,
        "all_true": 0,
    },
    ownership: {
        "PageInterleaved.owner": 0,
        "PageInterleaved.physical": 0,
        "PageInterleaved.logical": 0,
        "BlockCyclic.owner": 0,
        "BlockCyclic.physical": 0,
        "BlockCyclic.logical": 0,
    },
    pages: {
        "chunk_page_start": 0,
        "cp_owned": 0,
        "dst_for_positions": 0,
        "check_page_counts": 0,
        "map_chunk": 0,
    },
    runs: {"coalesce": 0, "expand": 0},
    buffers: {
        "BufferPairs.select": 0,
        "_check_capacity": 0,
        "runs_to_blocks": 0,
        "layer_blocks": 0,
        "state_blocks": 0,
        "aux_blocks": 0,
        "cached_pairs": 0,
    },
    batches: {"slice_blocks": 0, "batch_bounds": 1, "shape_batches": 1},
    heads: {
        "head_range": 0,
        "head_plan": 0,
        "_ranges": 0,
        "HeadPairs.select": 0,
        "cached_head_pairs": 0,
        "_check_head_capacity": 0,
        "head_pairs_to_blocks": 0,
        "head_blocks": 0,
        "describes_heads": 0,
        "layout_kv_heads": 0,
        "kv_blocks": 0,
    },
    # the staged gather (per write): one loop iteration per piece in plan_staged_pieces
    staging: {
        "dst_merge_starts": 0,
        "staged_entries": 0,
        "stageable": 0,
        "non_empty": 0,
        "_element_bytes": 0,
        "plan_piece": 0,
        "piece_bounds": 0,
        "plan_staged_pieces": 1,
    },
    # the landing zone's per-room work (plan_landing is layout work: a loop over sources and buffers)
    landing: {"landing_slots": 0, "scatter_groups": 0, "plan_scatter": 0},
    # read per request and per chunk: derived once when the layout is built
    layout: {
        "BufferLayout.kv_buffers": 0,
        "BufferLayout.state_buffers": 0,
        "BufferLayout.aux_buffers": 0,
        "BufferLayout.min_items": 0,
        "BufferLayout.min_kv_items": 0,
    },
    state: {
        "clip_state": 0,
        "StateLayerMap.from_layer_ids": 0,
        "StateLayerMap.has_state": 0,
        "StateLayerMap.slot_of": 0,
        "StateLayerMap.layer_of": 0,
        "StateLayerMap._check_layers": 0,
    },
}


def _functions(module: ModuleType) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(inspect.getsource(module))
    found: dict[str, ast.FunctionDef] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    found[f"{node.name}.{item.name}"] = item
    return found


@pytest.mark.parametrize("module", list(HOT), ids=lambda m: m.__name__)
def test_hot_functions_have_no_python_loops(module: ModuleType) -> None:
    functions = _functions(module)
    for name, allowed in HOT[module].items():
        assert name in functions, f"{module.__name__}.{name} is listed as hot but does not exist"
        loops = [type(n).__name__ for n in ast.walk(functions[name]) if isinstance(n, LOOP_NODES)]
        assert len(loops) == allowed, f"{module.__name__}.{name} has loops {loops}, allowed {allowed}"


def test_block_building_does_not_repeat_the_layout_pairing(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = buffers_module.pair_buffers

    def counting(*args: object, **kwargs: object) -> buffers_module.BufferPairs:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]  # forwarded unchanged

    monkeypatch.setattr(buffers_module, "pair_buffers", counting)
    layout = BufferLayout.build(
        attention=AttentionKind.MLA,
        page_size=64,
        buffers=[
            BufferSpec(
                kind=BufferKind.KV,
                model=ModelRole.TARGET,
                layer_id=i,
                base_ptr=i << 20,
                length=640,
                item_bytes=64,
            )
            for i in range(61)
        ],
    )
    run = PageRuns(src_start=[0], dst_start=[1], length=[2])
    for _ in range(5):
        assert len(layer_blocks(run, layout, layout)) == 61
    assert len(calls) == 1


def test_head_blocks_do_not_repeat_the_head_pairing(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = heads.pair_head_buffers

    def counting(local: BufferLayout, peer: BufferLayout) -> heads.HeadPairs:
        calls.append(1)
        return real(local, peer)

    monkeypatch.setattr(heads, "pair_head_buffers", counting)

    def layout(tp_rank: int) -> BufferLayout:
        geometry = heads.rank_heads(kv_heads=8, tp_size=4, tp_rank=tp_rank, head_bytes=128)
        return BufferLayout.build(
            attention=AttentionKind.MHA,
            page_size=16,
            buffers=[
                BufferSpec(
                    kind=kind,
                    model=ModelRole.TARGET,
                    layer_id=i,
                    base_ptr=(i * 2 + (kind is BufferKind.V)) << 20,
                    length=4 * 4096,
                    item_bytes=4096,
                    heads=geometry,
                )
                for i in range(61)
                for kind in (BufferKind.K, BufferKind.V)
            ],
        )

    local, peer = layout(1), layout(1)
    run = PageRuns(src_start=[0], dst_start=[1], length=[2])
    for _ in range(5):
        assert len(heads.head_blocks(run, local, peer)) == 122
    assert len(calls) == 1
