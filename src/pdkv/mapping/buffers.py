"""Byte blocks: page (or slot, or row) runs turned into addresses in every paired buffer.

Owns: ``BufferPairs`` / ``pair_buffers`` (which local buffer writes into which peer buffer) and the
block builders ``layer_blocks`` (KV), ``state_blocks`` (state slots, per state kind) and
``aux_blocks`` (one metadata row). Pure and vectorised over runs and buffers (an outer sum of
bases and offsets, no Python loop over layers or pages on the hot path). Must not pair buffers by
position: buffers pair by (model, kind, layer id), and any difference between the two layouts in
those keys or in bytes per item is a ``LayoutMismatchError`` naming it.

Addresses: item ``p`` of a buffer starts at ``base_ptr + p * item_bytes``; a run of ``n`` items is
one block of ``n * item_bytes`` bytes. Blocks come buffer-major, in the local layout's canonical
order (target before draft; KV, or K then V for MHA, then state kinds; layer ascending), and
``TransferBlocks.buffer`` is the buffer's index in the local ``layout.buffers``.

Pairing is computed once per (local layout, peer layout, kinds) and cached by object identity, so
repeated calls for the same registration pay only the vectorised part.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Collection
from typing import Any, Final

import attrs
import numpy as np
import numpy.typing as npt

from pdkv.errors import LayoutMismatchError, MappingError
from pdkv.mapping._arrays import IntArray, as_index_array, check_int, int_max
from pdkv.mapping.blocks import TransferBlocks
from pdkv.mapping.layout import BufferKind, BufferLayout, BufferSpec, ModelRole
from pdkv.mapping.runs import PageRuns, coalesce
from pdkv.mapping.state import LayerKey, compare_state_layers

BoolArray = npt.NDArray[np.bool_]

KV_KINDS: Final = frozenset({BufferKind.KV, BufferKind.K, BufferKind.V})
_AUX_KINDS: Final = frozenset({BufferKind.AUX})


def _array_eq() -> Any:
    return attrs.cmp_using(eq=np.array_equal)


@attrs.frozen(kw_only=True)
class BufferPairs:
    """Struct of arrays, one entry per local buffer of the selected kinds, in local layout order.

    Entry i: local buffer ``buffer[i]`` (index into the local ``layout.buffers``) at ``src_base[i]``
    with ``src_items[i]`` items writes into the peer buffer ``peer_buffer[i]`` at ``dst_base[i]``
    with ``dst_items[i]`` items; both use ``item_bytes[i]`` bytes per item.
    """

    buffer: IntArray = attrs.field(eq=_array_eq())
    peer_buffer: IntArray = attrs.field(eq=_array_eq())
    layer_id: IntArray = attrs.field(eq=_array_eq())
    draft: BoolArray = attrs.field(eq=_array_eq())
    src_base: IntArray = attrs.field(eq=_array_eq())
    dst_base: IntArray = attrs.field(eq=_array_eq())
    item_bytes: IntArray = attrs.field(eq=_array_eq())
    src_items: IntArray = attrs.field(eq=_array_eq())
    dst_items: IntArray = attrs.field(eq=_array_eq())
    # The smallest buffer on each side, derived once: every chunk's capacity check compares against
    # them and looks for the short buffers only when one is too short.
    min_src_items: int = attrs.field(init=False, eq=False, repr=False)
    min_dst_items: int = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "min_src_items", int(self.src_items.min()) if self.src_items.size else 0)
        object.__setattr__(self, "min_dst_items", int(self.dst_items.min()) if self.dst_items.size else 0)

    def __len__(self) -> int:
        return int(self.buffer.size)

    def where(self, keep: BoolArray) -> BufferPairs:
        columns = (f.name for f in attrs.fields(BufferPairs) if f.init)
        return BufferPairs(**{name: getattr(self, name)[keep] for name in columns})

    def select(self, *, layers: object | None = None, model: ModelRole | None = None) -> BufferPairs:
        """The pairs of some logical layers and/or one model (for per-layer transfer)."""
        if layers is None and model is None:
            return self
        keep = np.ones(len(self), dtype=np.bool_)
        if layers is not None:
            keep &= np.isin(self.layer_id, as_index_array(layers, "layers"))
        if model is not None:
            keep &= self.draft == (model is ModelRole.DRAFT)
        return self.where(keep)


def _key(spec: BufferSpec) -> tuple[ModelRole, BufferKind, int]:
    return (spec.model, spec.kind, spec.layer_id)


def _describe_key(key: tuple[ModelRole, BufferKind, int]) -> str:
    model, kind, layer = key
    return f"{model.value} {kind.value} layer {layer}"


def _layer_id_difference(
    mine: list[tuple[ModelRole, BufferKind, int]], theirs: list[tuple[ModelRole, BufferKind, int]]
) -> list[str]:
    problems: list[str] = []
    kinds = sorted({k[1] for k in mine} | {k[1] for k in theirs}, key=lambda k: list(BufferKind).index(k))
    for kind in kinds:
        diff = compare_state_layers(
            (LayerKey(model=m, layer_id=layer) for m, k, layer in mine if k is kind),
            (LayerKey(model=m, layer_id=layer) for m, k, layer in theirs if k is kind),
        )
        if diff is not None:
            problems.append(diff.describe(f"{kind.value} layers"))
    return problems


def pair_buffers(local: BufferLayout, peer: BufferLayout, kinds: Collection[BufferKind]) -> BufferPairs:
    """Pair every local buffer of ``kinds`` with the peer buffer of the same (model, kind, layer id).

    Raises ``LayoutMismatchError`` when the two sides list different keys (both lists and what each
    lacks are named), differ in bytes per item, or (for KV kinds) differ in page size or attention
    kind. Registration-time work; the block builders call it through an identity cache.
    """
    wanted = frozenset(kinds)
    if wanted & KV_KINDS:
        if local.attention is not peer.attention:
            raise LayoutMismatchError(
                f"attention kinds differ: {local.attention.value} here vs {peer.attention.value} at the peer"
            )
        if local.page_size != peer.page_size:
            raise LayoutMismatchError(
                f"page sizes differ: {local.page_size} here vs {peer.page_size} at the peer"
            )
    mine = [(i, b) for i, b in enumerate(local.buffers) if b.kind in wanted]
    theirs = {_key(b): (j, b) for j, b in enumerate(peer.buffers) if b.kind in wanted}
    if {_key(b) for _, b in mine} != set(theirs):
        problems = _layer_id_difference([_key(b) for _, b in mine], list(theirs))
        raise LayoutMismatchError("buffer layouts are incompatible: " + "; ".join(problems))
    sizes = [
        f"{_describe_key(_key(b))}: {b.item_bytes} vs {theirs[_key(b)][1].item_bytes} bytes per item"
        for _, b in mine
        if b.item_bytes != theirs[_key(b)][1].item_bytes
    ]
    if sizes:
        raise LayoutMismatchError("buffer layouts are incompatible: " + "; ".join(sizes))
    peers = [theirs[_key(b)] for _, b in mine]

    def column(values: list[int]) -> IntArray:
        return np.asarray(values, dtype=np.int64).reshape(-1)

    return BufferPairs(
        buffer=column([i for i, _ in mine]),
        peer_buffer=column([j for j, _ in peers]),
        layer_id=column([b.layer_id for _, b in mine]),
        draft=np.asarray([b.model is ModelRole.DRAFT for _, b in mine], dtype=np.bool_).reshape(-1),
        src_base=column([b.base_ptr for _, b in mine]),
        dst_base=column([p.base_ptr for _, p in peers]),
        item_bytes=column([b.item_bytes for _, b in mine]),
        src_items=column([b.num_items for _, b in mine]),
        dst_items=column([p.num_items for _, p in peers]),
    )


# ---------------------------------------------------------------- identity cache

_CACHE_LIMIT: Final = 256
_cache_lock = threading.Lock()
_cache: dict[
    tuple[int, int, frozenset[BufferKind]],
    tuple[weakref.ref[BufferLayout], weakref.ref[BufferLayout], BufferPairs],
] = {}


def cached_pairs(local: BufferLayout, peer: BufferLayout, kinds: frozenset[BufferKind]) -> BufferPairs:
    """``pair_buffers`` memoised on the identity of both layouts (weak references: a layout that is
    gone can never be confused with a new one at the same address)."""
    key = (id(local), id(peer), kinds)
    hit = _cache.get(key)
    if hit is not None and hit[0]() is local and hit[1]() is peer:
        return hit[2]
    pairs = pair_buffers(local, peer, kinds)
    with _cache_lock:
        if len(_cache) >= _CACHE_LIMIT:
            _cache.clear()
        _cache[key] = (weakref.ref(local), weakref.ref(peer), pairs)
    return pairs


# ---------------------------------------------------------------- block builders


def _check_capacity(runs: PageRuns, pairs: BufferPairs, what: str) -> None:
    src_end = int_max(runs.src_start + runs.length)
    dst_end = int_max(runs.dst_start + runs.length)
    _check_ends(src_end, dst_end, pairs, what, runs=len(runs), asked=runs.num_pages)


def _check_ends(src_end: int, dst_end: int, pairs: BufferPairs, what: str, *, runs: int, asked: int) -> None:
    """Every buffer of ``pairs`` holds items up to ``src_end`` here and ``dst_end`` at the peer
    (exclusive): else a ``MappingError`` naming the first short buffer; ``runs`` and ``asked`` (the
    items they cover) describe what was asked for."""
    if src_end <= pairs.min_src_items and dst_end <= pairs.min_dst_items:
        return
    short_src = np.flatnonzero(pairs.src_items < src_end)
    short_dst = np.flatnonzero(pairs.dst_items < dst_end)
    if short_src.size or short_dst.size:
        side, short, end, items = (
            ("local", short_src, src_end, pairs.src_items)
            if short_src.size
            else ("peer", short_dst, dst_end, pairs.dst_items)
        )
        first = int(short[0])
        raise MappingError(
            f"{what} {end - 1} is past the end of {short.size} {side} buffer(s); first: buffer "
            f"#{int(pairs.buffer[first])} (layer {int(pairs.layer_id[first])}) holds {int(items[first])} "
            f"{what}s; runs: {runs} covering {asked} {what}s"
        )


def runs_to_blocks(runs: PageRuns, pairs: BufferPairs, *, what: str = "page") -> TransferBlocks:
    """One block per (buffer pair, run), buffer-major: the vectorised core of the builders."""
    if len(runs) == 0 or len(pairs) == 0:
        return TransferBlocks.empty()
    _check_capacity(runs, pairs, what)
    if len(runs) == 1:  # a 1-page chunk, say
        return _one_run_blocks(pairs, int(runs.src_start[0]), int(runs.dst_start[0]), int(runs.length[0]))
    item = pairs.item_bytes[:, None]
    # int64 arithmetic on checked runs (lengths >= 1) and buffer pairs (item bytes >= 1), each result
    # a fresh contiguous array: the blocks' rules hold by construction, so they are not checked again.
    return TransferBlocks._holding(
        (pairs.src_base[:, None] + runs.src_start[None, :] * item).ravel(),
        (pairs.dst_base[:, None] + runs.dst_start[None, :] * item).ravel(),
        (runs.length[None, :] * item).ravel(),
        np.repeat(pairs.buffer, len(runs)),
    )


def _one_run_blocks(pairs: BufferPairs, src: int, dst: int, length: int) -> TransferBlocks:
    """``runs_to_blocks`` of one checked run: the same blocks, without broadcasting."""
    return TransferBlocks._holding(
        pairs.src_base + src * pairs.item_bytes,
        pairs.dst_base + dst * pairs.item_bytes,
        length * pairs.item_bytes,
        pairs.buffer.copy(),
    )


def _require_buffers(pairs: BufferPairs, items: int, what: str) -> None:
    if items and len(pairs) == 0:
        raise MappingError(f"{items} {what}(s) to send but the layouts have no buffer for them")


def layer_blocks(
    runs: PageRuns,
    src_layout: BufferLayout,
    dst_layout: BufferLayout,
    *,
    layers: object | None = None,
    model: ModelRole | None = None,
) -> TransferBlocks:
    """Blocks moving ``runs`` of KV pages in every KV buffer (MLA: KV per layer; MHA: K, V per layer;
    draft-model buffers after the target's), or only in ``layers`` / ``model`` when given."""
    pairs = cached_pairs(src_layout, dst_layout, KV_KINDS)
    _require_buffers(pairs, runs.num_pages, "KV page")
    return runs_to_blocks(runs, pairs.select(layers=layers, model=model))


def state_blocks(
    kind: BufferKind,
    src_slots: object,
    dst_slots: object,
    src_layout: BufferLayout,
    dst_layout: BufferLayout,
    *,
    layers: object | None = None,
    model: ModelRole | None = None,
) -> TransferBlocks:
    """Blocks moving state slots ``src_slots[i] -> dst_slots[i]`` in every buffer of one state kind.

    The slot lists must be equally long (clip first with ``clip_state`` where the kind allows it).
    State buffers exist only on the layers that keep state (compaction) and pair by logical layer
    id, so a layer without state simply contributes no block.
    """
    if not kind.is_state:
        raise MappingError(f"{kind.value} is not a state buffer kind")
    runs = coalesce(src_slots, dst_slots)
    pairs = cached_pairs(src_layout, dst_layout, frozenset({kind}))
    _require_buffers(pairs, runs.num_pages, f"{kind.value} slot")
    return runs_to_blocks(runs, pairs.select(layers=layers, model=model), what="slot")


def aux_blocks(
    src_row: int, dst_row: int, src_layout: BufferLayout, dst_layout: BufferLayout
) -> TransferBlocks:
    """One block per aux buffer: row ``src_row`` here to row ``dst_row`` at the peer."""
    src = check_int(src_row, "src_row", minimum=0)
    dst = check_int(dst_row, "dst_row", minimum=0)
    pairs = cached_pairs(src_layout, dst_layout, _AUX_KINDS)
    _require_buffers(pairs, 1, "aux row")
    _check_ends(src + 1, dst + 1, pairs, "row", runs=1, asked=1)
    return _one_run_blocks(pairs, src, dst, 1)
