"""The vLLM adapter's pure parts (no vLLM needed): KV tensors -> layout, transfer params, settings."""

from __future__ import annotations

import hashlib

import pytest
import torch

from pdkv import AttentionKind, BufferKind, ConfigError
from pdkv.adapters.vllm import AdapterSettings, ConsumerParams, layer_index, layout_from_kv_caches, room_for
from pdkv.adapters.vllm.params import producer_transfer_id

BLOCKS, HEADS, BS, HD = 8, 2, 16, 64
ITEM = 2 * HEADS * BS * HD * 4  # K and V of one block, float32


def test_cpu_layout_is_one_kv_item_per_block_per_layer() -> None:
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(BLOCKS, 2, HEADS, BS, HD) for i in (1, 0)}
    layout, ids = layout_from_kv_caches(caches, num_blocks=BLOCKS, block_size=BS)
    assert ids == {"model.layers.1.self_attn.attn": 1, "model.layers.0.self_attn.attn": 0}
    assert layout.attention is AttentionKind.MLA and layout.page_size == BS
    assert [(b.kind, b.layer_id, b.item_bytes, b.length) for b in layout.buffers] == [
        (BufferKind.KV, 0, 16384, 8 * 16384),
        (BufferKind.KV, 1, 16384, 8 * 16384),
    ]
    assert layout.buffers[0].base_ptr == caches["model.layers.0.self_attn.attn"].data_ptr()


def test_split_kv_layout_is_a_k_and_a_v_buffer_per_layer() -> None:
    t = torch.zeros(2, BLOCKS, BS, HEADS, HD, dtype=torch.float16)
    layout, _ = layout_from_kv_caches({"model.layers.0.attn": t}, num_blocks=BLOCKS, block_size=BS)
    k, v = layout.buffers
    half = BLOCKS * BS * HEADS * HD * 2
    assert (k.kind, v.kind) == (BufferKind.K, BufferKind.V) and layout.attention is AttentionKind.MHA
    assert (k.base_ptr, v.base_ptr) == (t.data_ptr(), t.data_ptr() + half)
    assert k.item_bytes == v.item_bytes == BS * HEADS * HD * 2 and k.length == half


def test_a_permuted_view_counts_by_its_physical_order() -> None:
    # stored head-major (blocks, 2, heads, block, dim), shown token-major: a block is still one item
    physical = torch.zeros(BLOCKS, 2, HEADS, BS, HD)
    logical = physical.permute(0, 1, 3, 2, 4)
    layout, _ = layout_from_kv_caches({"layers.0": logical}, num_blocks=BLOCKS, block_size=BS)
    assert layout.buffers[0].item_bytes == ITEM and layout.buffers[0].base_ptr == physical.data_ptr()


def test_layers_interleaved_in_one_allocation_are_refused() -> None:
    shared = torch.zeros(BLOCKS, 2, 2, HEADS, BS, HD)  # (blocks, layers, K/V, ...): block stride = 2 items
    with pytest.raises(ConfigError, match="not a dense tensor"):
        layout_from_kv_caches({"layers.0": shared[:, 0]}, num_blocks=BLOCKS, block_size=BS)


def test_a_tensor_without_the_block_dimension_outermost_is_refused() -> None:
    t = torch.zeros(4, BLOCKS, BS, HD)  # heads outermost
    with pytest.raises(ConfigError, match="outermost physical dimension"):
        layout_from_kv_caches({"layers.0": t}, num_blocks=BLOCKS, block_size=BS)


def test_layer_names_need_exactly_one_index() -> None:
    assert layer_index("model.layers.31.self_attn.attn") == 31
    for bad in ("model.attn", "model.layers.1.experts.2.attn"):
        with pytest.raises(ConfigError, match="exactly one layer index"):
            layer_index(bad)
    with pytest.raises(ConfigError, match="same layer id 3"):
        t = torch.zeros(BLOCKS, 2, HEADS, BS, HD)
        layout_from_kv_caches({"a.3": t, "b.3": t.clone()}, num_blocks=BLOCKS, block_size=BS)


def test_room_ids_from_transfer_ids() -> None:
    assert room_for(12345) == 12345 and room_for(2**63 - 1) == 2**63 - 1
    digest = hashlib.blake2b(b"req-7", digest_size=8).digest()
    assert room_for("req-7") == int.from_bytes(digest, "little") & (2**63 - 1)
    for odd in (0, -5, 2**63, True):
        assert 0 < room_for(odd) < 2**63 and room_for(odd) != odd


def test_consumer_params() -> None:
    assert ConsumerParams.parse(None, None) is None
    assert ConsumerParams.parse({"do_remote_prefill": False, "transfer_id": "x"}, None) is None
    given = {"do_remote_prefill": True, "transfer_id": "x", "remote_registry": "tcp://10.0.0.1:9"}
    assert ConsumerParams.parse(given, "tcp://other:1") == ConsumerParams(
        transfer_id="x", registry="tcp://10.0.0.1:9"
    )
    default = ConsumerParams.parse({"do_remote_prefill": True, "transfer_id": 7}, "tcp://10.0.0.2:9")
    assert default == ConsumerParams(transfer_id=7, registry="tcp://10.0.0.2:9")
    with pytest.raises(ConfigError, match="transfer_id"):
        ConsumerParams.parse({"do_remote_prefill": True}, "tcp://h:1")
    with pytest.raises(ConfigError, match="prefill registry"):
        ConsumerParams.parse({"do_remote_prefill": True, "transfer_id": "x"}, None)
    assert producer_transfer_id({"do_remote_decode": True}, "req-1") == "req-1"
    assert producer_transfer_id({"do_remote_decode": True, "transfer_id": 9}, "req-1") == 9
    assert producer_transfer_id({"do_remote_prefill": True}, "req-1") is None


def test_settings_refuse_unknown_keys() -> None:
    assert AdapterSettings.from_extra_config({"registry_port": 8998}).registry_port == 8998
    with pytest.raises(ConfigError, match="registy_port"):
        AdapterSettings.from_extra_config({"registy_port": 8998})


def test_settings_take_the_checksum_switch() -> None:
    assert AdapterSettings.from_extra_config({}).kv_checksum is None  # PDKV_KV_CHECKSUM decides
    assert AdapterSettings.from_extra_config({"kv_checksum": True}).kv_checksum is True
    with pytest.raises(ConfigError, match="kv_checksum"):
        AdapterSettings.from_extra_config({"kv_checksum": "yes"})


def test_settings_choose_the_transfer_engine() -> None:
    assert AdapterSettings.from_extra_config({}).backend is None  # PDKV_BACKEND, else Mooncake
    assert AdapterSettings.from_extra_config({"backend": "nixl"}).backend == "nixl"
    with pytest.raises(ConfigError, match="backend"):
        AdapterSettings.from_extra_config({"backend": "ucx"})
