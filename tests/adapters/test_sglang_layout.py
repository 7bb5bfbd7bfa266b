"""layout_from_kv_args against recorded SGLang KVArgs (plain dicts and objects; SGLang not needed)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from pdkv.adapters.sglang import layout_from_kv_args, state_kind_for
from pdkv.errors import ConfigError
from pdkv.mapping import AttentionKind, BufferKey, BufferKind, LayoutPolicy, ModelRole, compatibility

PAGE = 64
MLA_ITEM = PAGE * 576 * 2  # DeepSeek latent (512 + 64) in bf16, one page
PAGES = 100


def _aux() -> dict[str, list[int]]:
    # As MetadataBuffers.get_buf_infos reports them for a 64-row buffer: output ids, cached tokens,
    # logprob values/indices, top logprobs, topk p/index, hidden states, bootstrap_room.
    rows = [64, 4, 4, 4, 8 * 4, 8 * 4, 8 * 4, 8 * 4, 7168 * 2, 8 * 8]
    return {
        "aux_data_ptrs": [0x9000_0000 + i * 0x10_0000 for i in range(len(rows))],
        "aux_data_lens": [r * 64 for r in rows],
        "aux_item_lens": rows,
    }


def mla_kv_args(
    layers: int = 61, draft: int = 0, start: int = 0, layer_ids: list[int] | None = None
) -> dict[str, Any]:
    n = layers + draft
    return {
        "engine_rank": 0,
        "page_size": PAGE,
        "prefill_start_layer": start,
        "kv_data_ptrs": [0x1_0000_0000 + i * 0x1000_0000 for i in range(n)],
        "kv_data_lens": [MLA_ITEM * PAGES] * n,
        "kv_item_lens": [MLA_ITEM] * n,
        "kv_layer_ids": layer_ids or [],
        "num_draft_entries": draft,
        "state_types": [],
        "state_data_ptrs": [],
        "state_data_lens": [],
        "state_item_lens": [],
        "state_layer_ids": [],
        **_aux(),
    }


def mha_kv_args(layers: int = 4, draft_layers: int = 0, item: int = PAGE * 8 * 128 * 2) -> dict[str, Any]:
    target = [0x1_0000_0000 + i * 0x100_0000 for i in range(2 * layers)]
    draft = [0x2_0000_0000 + i * 0x100_0000 for i in range(2 * draft_layers)]
    ptrs = target + draft
    return {
        "page_size": PAGE,
        "prefill_start_layer": 0,
        "kv_data_ptrs": ptrs,
        "kv_data_lens": [item * PAGES] * len(ptrs),
        "kv_item_lens": [item] * len(ptrs),
        "kv_layer_ids": [],
        "num_draft_entries": len(draft),
        "kv_head_num": 8,
        "total_kv_head_num": 8,
        "state_types": [],
        **_aux(),
    }


def test_mla_one_kv_buffer_per_layer_and_aux_rows() -> None:
    layout = layout_from_kv_args(mla_kv_args(), is_mla=True)
    assert layout.attention is AttentionKind.MLA
    assert layout.page_size == PAGE
    kv = layout.select(BufferKind.KV, model=ModelRole.TARGET)
    assert [b.layer_id for b in kv] == list(range(61))
    assert all(b.item_bytes == MLA_ITEM and b.num_items == PAGES for b in kv)
    assert kv[0].base_ptr == 0x1_0000_0000 and kv[60].base_ptr == 0x1_0000_0000 + 60 * 0x1000_0000
    aux = layout.aux_buffers
    assert [b.layer_id for b in aux] == list(range(10))
    assert [b.item_bytes for b in aux] == _aux()["aux_item_lens"]
    assert all(b.num_items == 64 for b in aux)
    assert layout.state_buffers == ()


def test_draft_entries_are_the_last_ones_and_number_from_zero() -> None:
    layout = layout_from_kv_args(mla_kv_args(layers=61, draft=1, start=0), is_mla=True)
    draft = layout.select(BufferKind.KV, model=ModelRole.DRAFT)
    assert [(b.layer_id, b.base_ptr) for b in draft] == [(0, 0x1_0000_0000 + 61 * 0x1000_0000)]
    assert len(layout.select(BufferKind.KV, model=ModelRole.TARGET)) == 61


def test_prefill_start_layer_offsets_target_ids_only() -> None:
    layout = layout_from_kv_args(mla_kv_args(layers=4, draft=2, start=30), is_mla=True)
    assert [b.layer_id for b in layout.select(BufferKind.KV, model=ModelRole.TARGET)] == [30, 31, 32, 33]
    assert [b.layer_id for b in layout.select(BufferKind.KV, model=ModelRole.DRAFT)] == [0, 1]


def test_explicit_kv_layer_ids_win_over_positions() -> None:
    ids = [1, 3, 5, 7, 61]  # hybrid pool: attention layers only; draft remapped into a band above
    layout = layout_from_kv_args(mla_kv_args(layers=4, draft=1, start=0, layer_ids=ids), is_mla=True)
    assert [b.layer_id for b in layout.select(BufferKind.KV, model=ModelRole.TARGET)] == [1, 3, 5, 7]
    assert [b.layer_id for b in layout.select(BufferKind.KV, model=ModelRole.DRAFT)] == [61]


def test_mha_k_then_v_halves_per_model() -> None:
    args = mha_kv_args(layers=4, draft_layers=1)
    layout = layout_from_kv_args(args, is_mla=False)
    assert layout.attention is AttentionKind.MHA
    k = layout.select(BufferKind.K, model=ModelRole.TARGET)
    v = layout.select(BufferKind.V, model=ModelRole.TARGET)
    assert [b.layer_id for b in k] == [0, 1, 2, 3] == [b.layer_id for b in v]
    assert [b.base_ptr for b in k] == args["kv_data_ptrs"][:4]
    assert [b.base_ptr for b in v] == args["kv_data_ptrs"][4:8]
    dk = layout.select(BufferKind.K, model=ModelRole.DRAFT)
    dv = layout.select(BufferKind.V, model=ModelRole.DRAFT)
    assert [(b.layer_id, b.base_ptr) for b in dk] == [(0, args["kv_data_ptrs"][8])]
    assert [(b.layer_id, b.base_ptr) for b in dv] == [(0, args["kv_data_ptrs"][9])]


def test_mha_odd_entry_count_is_refused() -> None:
    args = mha_kv_args(layers=2)
    for key in ("kv_data_ptrs", "kv_data_lens", "kv_item_lens"):
        args[key] = args[key][:3]
    with pytest.raises(ConfigError, match="must be even"):
        layout_from_kv_args(args, is_mla=False)


def test_swa_and_dsa_state_become_pdkv_state_buffers() -> None:
    args = mla_kv_args(layers=4)
    index_item = PAGE * (128 + 4)  # index K (fp8, 128) and its scale (fp32) packed per token
    args.update(
        state_types=[SimpleNamespace(value="dsa"), "swa"],
        state_data_ptrs=[[0x5_0000_0000 + i * 0x100_0000 for i in range(4)], [0x6_0000_0000, 0x6_1000_0000]],
        state_data_lens=[[index_item * 50] * 4, [4096 * 10] * 2],
        state_item_lens=[[index_item] * 4, [4096] * 2],
        state_layer_ids=[[], []],
    )
    layout = layout_from_kv_args(args, is_mla=True)
    index = layout.select(BufferKind.INDEX_K)
    assert [(b.layer_id, b.item_bytes, b.num_items) for b in index] == [(i, index_item, 50) for i in range(4)]
    swa = layout.select(BufferKind.SWA)
    assert [(b.layer_id, b.base_ptr) for b in swa] == [(0, 0x6_0000_0000), (1, 0x6_1000_0000)]


def test_state_layer_ids_are_used_when_given() -> None:
    args = mla_kv_args(layers=4)
    args.update(
        state_types=["dsa"],
        state_data_ptrs=[[0x5_0000_0000, 0x5_1000_0000]],
        state_data_lens=[[1024, 1024]],
        state_item_lens=[[128, 128]],
        state_layer_ids=[[1, 3]],
    )
    assert [b.layer_id for b in layout_from_kv_args(args, is_mla=True).state_buffers] == [1, 3]


@pytest.mark.parametrize(
    "state_type", ["mamba", "qsa_pending", "dsa_tail", "swa_ring", "c128_state", "request_row", "block_scale"]
)
def test_other_state_types_are_refused_by_name(state_type: str) -> None:
    args = mla_kv_args(layers=2)
    args.update(
        state_types=[state_type],
        state_data_ptrs=[[1 << 20]],
        state_data_lens=[[64]],
        state_item_lens=[[64]],
        state_layer_ids=[[]],
    )
    with pytest.raises(ConfigError, match=f"state type '{state_type}' is not supported by pdkv"):
        layout_from_kv_args(args, is_mla=True)
    with pytest.raises(ConfigError):
        state_kind_for(state_type)


def test_objects_with_attributes_work_like_mappings() -> None:
    as_dict = mla_kv_args(layers=3, draft=1)
    assert layout_from_kv_args(SimpleNamespace(**as_dict), is_mla=True) == layout_from_kv_args(
        as_dict, is_mla=True
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"kv_data_lens": [MLA_ITEM * PAGES] * 2}, "kv_data_ptrs has 3 entries but kv_data_lens has 2"),
        ({"kv_layer_ids": [0, 1]}, "kv_layer_ids has 2 ids for 3 KV entries"),
        ({"num_draft_entries": 3}, "num_draft_entries is 3 for 3 KV entries"),
        ({"kv_item_lens": [1000] * 3}, "not a multiple of item_bytes"),
        ({"kv_data_ptrs": []}, "kv_data_lens has 3"),
        ({"mla_compression_ratios": [0, 4, 128]}, "compressed-MLA"),
        ({"page_size": "64"}, "page_size must be an int"),
        ({"kv_layer_ids": [0, 0, 1]}, "same \\(model, kind, layer\\) twice"),
    ],
)
def test_inconsistent_kv_args_are_refused_with_the_field_named(change: dict[str, Any], message: str) -> None:
    args = mla_kv_args(layers=3)
    args.update(change)
    with pytest.raises(ConfigError, match=message):
        layout_from_kv_args(args, is_mla=True)


def test_missing_required_field_is_named() -> None:
    args = mla_kv_args(layers=2)
    del args["page_size"]
    with pytest.raises(ConfigError, match=r"KVArgs\.page_size is not set"):
        layout_from_kv_args(args, is_mla=True)


def test_both_sides_built_from_their_own_kv_args_are_compatible() -> None:
    prefill = layout_from_kv_args(mla_kv_args(layers=61, draft=1), is_mla=True)
    decode_args = mla_kv_args(layers=61, draft=1)
    decode_args["kv_data_ptrs"] = [p + 0x100 * 4096 for p in decode_args["kv_data_ptrs"]]
    decode_args["kv_data_lens"] = [MLA_ITEM * 7] * 62
    decode = layout_from_kv_args(decode_args, is_mla=True)
    prefill.check_compatible(decode)
    assert prefill.digest() == decode.digest()


def test_importing_pdkv_or_the_layout_never_imports_sglang() -> None:
    code = (
        "import sys, pdkv, pdkv.adapters.sglang; "
        "assert not any(m == 'sglang' or m.startswith('sglang.') for m in sys.modules), 'sglang imported'; "
        "assert 'pdkv.adapters' not in sys.modules or 'pdkv.adapters.sglang' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    code = "import sys, pdkv; assert not any(m.startswith('pdkv.adapters') for m in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---------------------------------------------------------------- the draft model's NSA state


def dsa_kv_args(target: int = 4, draft: int = 1, **draft_fields: Any) -> dict[str, Any]:
    """A DSA/NSA model with MTP: the draft pool's index buffers appended to the DSA component, as
    SGLang appends ``draft_token_to_kv_pool.get_state_buf_infos()``."""
    args = mla_kv_args(layers=target, draft=draft)
    item = PAGE * (128 + 4)
    n = target + draft
    args.update(
        state_types=["dsa"],
        state_data_ptrs=[[0x5_0000_0000 + i * 0x100_0000 for i in range(n)]],
        state_data_lens=[[item * 50] * n],
        state_item_lens=[[item] * n],
        state_layer_ids=[[]],
        **draft_fields,
    )
    return args


def test_draft_state_entries_are_the_draft_models_numbered_from_zero() -> None:
    with_draft = dsa_kv_args(draft_state_buffer_start=4, draft_state_buffer_count=1)
    layout = layout_from_kv_args(with_draft, is_mla=True)
    index = [(b.model, b.layer_id) for b in layout.select(BufferKind.INDEX_K)]
    assert index == [(ModelRole.TARGET, i) for i in range(4)] + [(ModelRole.DRAFT, 0)]
    per_type = dsa_kv_args(draft_state_buffer_start=[4], draft_state_buffer_count=[1])
    assert layout_from_kv_args(per_type, is_mla=True) == layout


def test_without_the_fields_appended_draft_state_reads_as_target_layers() -> None:
    """SGLang 0.5.23 sets neither field: nothing is guessed, the fifth entry is a target layer."""
    layout = layout_from_kv_args(dsa_kv_args(), is_mla=True)
    assert [(b.model, b.layer_id) for b in layout.select(BufferKind.INDEX_K)] == [
        (ModelRole.TARGET, i) for i in range(5)
    ]


def test_a_decode_without_draft_state_is_a_rolling_deployment_not_another_model() -> None:
    with_draft = dsa_kv_args(draft_state_buffer_start=4, draft_state_buffer_count=1)
    prefill = layout_from_kv_args(with_draft, is_mla=True)
    decode = layout_from_kv_args(dsa_kv_args(draft=1) | _without_draft_state(), is_mla=True)
    decision = compatibility(prefill, decode, LayoutPolicy.DEGRADE_DRAFT)
    draft_index = BufferKey(model=ModelRole.DRAFT, kind=BufferKind.INDEX_K, layer_id=0)
    assert decision.left_out_mine == (draft_index,)
    strict = compatibility(prefill, decode, LayoutPolicy.STRICT)
    assert strict.refusal == "draft index_k layer ids differ: [0] vs []"


def _without_draft_state() -> dict[str, Any]:
    item = PAGE * (128 + 4)
    return {
        "state_data_ptrs": [[0x5_0000_0000 + i * 0x100_0000 for i in range(4)]],
        "state_data_lens": [[item * 50] * 4],
        "state_item_lens": [[item] * 4],
    }


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"draft_state_buffer_start": 4}, "come together"),
        ({"draft_state_buffer_start": 4, "draft_state_buffer_count": 2}, r"\(4, 2\) do not name entries"),
        ({"draft_state_buffer_start": -1, "draft_state_buffer_count": 1}, "do not name entries"),
        ({"draft_state_buffer_start": [4, 0], "draft_state_buffer_count": [1, 0]}, "2/2 values for 1 state"),
    ],
)
def test_bad_draft_state_fields_are_refused_naming_them(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        layout_from_kv_args(dsa_kv_args(**fields), is_mla=True)


def test_single_int_fields_need_exactly_one_dsa_component() -> None:
    args = dsa_kv_args(draft_state_buffer_start=0, draft_state_buffer_count=1)
    args.update(state_types=["swa"])
    with pytest.raises(ConfigError, match="name the DSA/NSA state component, but state_types has 0"):
        layout_from_kv_args(args, is_mla=True)
