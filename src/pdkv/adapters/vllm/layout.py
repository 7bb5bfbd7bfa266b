"""vLLM's per-layer KV cache tensors -> a pdkv ``BufferLayout``: one item per block per layer.

Owns: ``layout_from_kv_caches`` (what ``register_kv_caches`` hands pdkv) and ``layer_index`` (the pdkv
layer id of a vLLM attention layer name). Must not import vLLM or torch: it reads ``shape``,
``stride()``, ``data_ptr()`` and ``element_size()``, so tests feed it plain torch tensors in the main
environment. Anything it cannot describe as whole blocks is a ``ConfigError`` with the layer, the shape
and the strides, never a guess.

How vLLM lays out a layer's cache: one tensor per attention layer, a view of that layer's allocation,
possibly permuted (``get_kv_cache_stride_order``). pdkv needs each block's bytes at ``base + block x
item_bytes``, so what counts is the physical order (dimensions by decreasing stride), not the logical shape:

- outermost physical dimension of size ``num_blocks`` (vLLM's CPU backend ``(blocks, 2, heads,
  block_size, head_dim)``, MLA ``(blocks, block_size, head_dim)``): K and V of a block are one contiguous
  item; the layer is one ``BufferKind.KV`` buffer and the layout is ``AttentionKind.MLA`` in pdkv's terms
  (one opaque buffer per layer; the adapter refuses TP > 1, so no replication is ever assumed);
- outermost of size 2 then ``num_blocks`` (FlashAttention ``(2, blocks, block_size, heads, head_dim)``):
  K and V halves are separate regions; the layer is a ``K`` and a ``V`` buffer (``AttentionKind.MHA``).

Every layer must use the same one of the two, and the tensor must be dense (no gaps, no overlap).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Protocol

from pdkv.errors import ConfigError
from pdkv.mapping import AttentionKind, BufferKind, BufferLayout, BufferSpec, ModelRole


class KVTensor(Protocol):
    """What the layout needs of a torch tensor (keeps this module free of torch)."""

    @property
    def shape(self) -> Sequence[int]: ...
    def stride(self) -> Sequence[int]: ...
    def data_ptr(self) -> int: ...
    def element_size(self) -> int: ...


_INT = re.compile(r"\d+")


def layer_index(layer_name: str) -> int:
    """The layer id of ``model.layers.7.self_attn.attn`` (7): the one integer in the name.

    Both sides derive ids from names, so a prefill and a decode of the same model agree; a name with no
    integer or several (a drafter's, an encoder-decoder's cross layers) is refused.
    """
    found = _INT.findall(layer_name)
    if len(found) != 1:
        raise ConfigError(
            f"vLLM layer name {layer_name!r} does not carry exactly one layer index: pdkv cannot give it a "
            "layer id both sides agree on"
        )
    return int(found[0])


def layout_from_kv_caches(
    kv_caches: Mapping[str, KVTensor], *, num_blocks: int, block_size: int
) -> tuple[BufferLayout, dict[str, int]]:
    """The layout of one worker's KV caches, and the pdkv layer id of each vLLM layer name."""
    if not kv_caches:
        raise ConfigError("register_kv_caches got no KV cache tensors: nothing for pdkv to transfer")
    if num_blocks < 1 or block_size < 1:
        raise ConfigError(f"num_blocks {num_blocks} and block_size {block_size} must be positive")
    layer_ids: dict[str, int] = {}
    seen: dict[int, str] = {}
    specs: list[BufferSpec] = []
    kinds: set[AttentionKind] = set()
    for name, tensor in kv_caches.items():
        layer = layer_index(name)
        if layer in seen:
            raise ConfigError(f"vLLM layers {seen[layer]!r} and {name!r} map to the same layer id {layer}")
        seen[layer] = name
        layer_ids[name] = layer
        attention, layer_specs = _layer_buffers(name, layer, tensor, num_blocks)
        kinds.add(attention)
        specs.extend(layer_specs)
    if len(kinds) != 1:
        raise ConfigError(
            "vLLM's layers mix a block-major KV layout with a K/V-split one: pdkv needs one layout for all"
        )
    return BufferLayout.build(attention=kinds.pop(), page_size=block_size, buffers=specs), layer_ids


def _layer_buffers(
    name: str, layer: int, tensor: KVTensor, num_blocks: int
) -> tuple[AttentionKind, list[BufferSpec]]:
    shape = [int(s) for s in tensor.shape]
    strides = [int(s) for s in tensor.stride()]
    size = tensor.element_size()
    described = f"layer {name!r}: shape {tuple(shape)}, strides {tuple(strides)}"
    # physical order: dimensions of size > 1 by decreasing stride
    dims = sorted((d for d in range(len(shape)) if shape[d] > 1), key=lambda d: -strides[d])
    numel = 1
    for s in shape:
        numel *= s
    span = 1 + sum((shape[d] - 1) * strides[d] for d in dims)
    if any(strides[d] <= 0 for d in dims) or span != numel:
        raise ConfigError(f"{described} is not a dense tensor: pdkv moves whole blocks of contiguous bytes")
    if not dims:
        raise ConfigError(f"{described} has no block dimension")
    outer = dims[0]
    base = tensor.data_ptr()
    if shape[outer] == num_blocks:
        item = strides[outer] * size
        spec = BufferSpec(
            kind=BufferKind.KV,
            model=ModelRole.TARGET,
            layer_id=layer,
            base_ptr=base,
            length=num_blocks * item,
            item_bytes=item,
        )
        return AttentionKind.MLA, [spec]
    if shape[outer] == 2 and len(dims) > 1 and shape[dims[1]] == num_blocks:
        item = strides[dims[1]] * size
        half = strides[outer] * size
        return AttentionKind.MHA, [
            BufferSpec(
                kind=kind,
                model=ModelRole.TARGET,
                layer_id=layer,
                base_ptr=base + i * half,
                length=num_blocks * item,
                item_bytes=item,
            )
            for i, kind in enumerate((BufferKind.K, BufferKind.V))
        ]
    raise ConfigError(
        f"{described}: the outermost physical dimension is neither the {num_blocks} blocks nor K/V "
        "followed by the blocks, so a block is not one contiguous item per buffer"
    )
