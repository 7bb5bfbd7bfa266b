"""A synthetic model for end-to-end runs: buffers as torch tensors, and bytes anyone can recompute.

Owns: ``ModelSpec`` (layers, page size, bytes per token, MLA or MHA, NSA-style index state on some
layers only, a draft model), ``RankMemory`` (one rank's tensors and its ``BufferLayout``) and the
content rule: every page, state slot and aux row holds ``pattern(salt, id)``, a deterministic
function of what it is (model, kind, layer, TP rank for MHA) and of its logical id. A prefill rank
fills its memory from the rule; the decode side verifies what landed by recomputing it, so a byte
written to the wrong page, layer or position shows up as a mismatch, and untouched memory (zero:
patterns are never zero) shows a missing write.

MHA/GQA with ``ModelSpec.kv_heads`` (heads described in the layout, any TP split): the rule is per
model head and token instead of per TP rank. A K or V page of the whole model is the item
``pattern(salt(model, kind, layer), id)`` laid out ``[token][head][head_bytes]`` over all
``kv_heads`` heads; a rank's page item holds the columns of its own heads (``head_range``), in its
own ``ItemLayout``. So the decode side of any TP size verifies its heads against the prefill full
layout, whichever prefill ranks wrote them, and a head landing at another head's offset shows.

``simulate_forward`` stands in for a prefill forward: layer after layer (target, then draft), each
taking a configurable compute time, optionally writing that layer's KV of the chunk's pages (so a
layer sent before its write would land as zeros), then reporting it (``on_layer_end``), as a model
wired to ``PerLayerTransferManager`` does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import torch

from pdkv.mapping import (
    AttentionKind,
    BufferKind,
    BufferLayout,
    HeadGeometry,
    ItemLayout,
    ModelRole,
    OwnershipPolicy,
    PageInterleaved,
    rank_heads,
)

U8 = npt.NDArray[np.uint8]
IntArray = npt.NDArray[np.int64]

_KIND_INDEX = {kind: i for i, kind in enumerate(BufferKind)}
_MODEL_INDEX = {model: i for i, model in enumerate(ModelRole)}


@attrs.frozen(kw_only=True)
class ModelSpec:
    """The shape of a synthetic model, identical on every rank of both sides."""

    attention: AttentionKind = AttentionKind.MLA
    layers: int = 4
    page_size: int = 16
    kv_bytes_per_token: int = 64
    """Per layer and buffer (MLA latent; MHA: K or V of this TP rank's heads; MHA with ``kv_heads``:
    K or V of all the model's heads, ``kv_heads x head_bytes``)."""
    kv_heads: int | None = None
    """MHA/GQA: the model's KV head count; the layout then describes each rank's heads
    (``HeadGeometry``) and TP sizes may differ between prefill and decode. None: heads not described."""
    item_layout: ItemLayout = ItemLayout.TOKEN_HEAD
    """Byte order inside a K/V page item when ``kv_heads`` is set (a ``RankMemory`` may override it)."""
    state_layers: tuple[int, ...] = (0, 2)
    """Layers that keep NSA-style index state; the others skip it (compact state buffers)."""
    state_kinds: tuple[BufferKind, ...] = (BufferKind.INDEX_K, BufferKind.INDEX_SCALE)
    state_item_bytes: int = 32
    draft_layers: int = 1
    draft_state_layers: tuple[int, ...] = ()
    """Draft-model layers that keep index state (the draft model's NSA state buffers, registered beside
    the target's); none by default. A prefill and a decode that differ here are a rolling deployment."""
    aux_item_bytes: int = 64

    def __attrs_post_init__(self) -> None:
        if self.kv_heads is None:
            return
        if self.attention is not AttentionKind.MHA:
            raise ValueError(
                f"kv_heads={self.kv_heads} given for {self.attention.value} (only MHA has heads)"
            )
        if self.kv_heads <= 0 or self.kv_bytes_per_token % self.kv_heads:
            raise ValueError(
                f"kv_bytes_per_token {self.kv_bytes_per_token} is not a whole number of bytes for each of "
                f"{self.kv_heads} KV heads"
            )

    @classmethod
    def kv_only(cls, **fields: Any) -> ModelSpec:
        """A model of KV buffers and the aux row alone (no index state, no draft model): what the
        benchmarks move. ``fields`` as for the constructor."""
        return cls(state_layers=(), state_kinds=(), draft_layers=0, **fields)

    @property
    def kv_item_bytes(self) -> int:
        """Bytes of one K/V (or MLA) page item: of the whole model when ``kv_heads`` is set."""
        return self.page_size * self.kv_bytes_per_token

    @property
    def head_bytes(self) -> int:
        """Bytes of one KV head of one token (``kv_heads`` set only)."""
        if self.kv_heads is None:
            raise ValueError("a model without kv_heads describes no heads")
        return self.kv_bytes_per_token // self.kv_heads

    def rank_kv_item_bytes(self, tp_size: int) -> int:
        """Bytes of one K/V page item on a rank of a TP ``tp_size`` instance (every rank alike)."""
        if self.kv_heads is None:
            return self.kv_item_bytes
        return self.page_size * max(1, self.kv_heads // tp_size) * self.head_bytes

    def kv_keys(self) -> list[tuple[ModelRole, BufferKind, int]]:
        kinds = [BufferKind.KV] if self.attention is AttentionKind.MLA else [BufferKind.K, BufferKind.V]
        keys = [(ModelRole.TARGET, kind, layer) for kind in kinds for layer in range(self.layers)]
        keys += [(ModelRole.DRAFT, kind, layer) for kind in kinds for layer in range(self.draft_layers)]
        return keys

    def state_keys(self) -> list[tuple[ModelRole, BufferKind, int]]:
        keys = [(ModelRole.TARGET, kind, layer) for kind in self.state_kinds for layer in self.state_layers]
        keys += [
            (ModelRole.DRAFT, kind, layer) for kind in self.state_kinds for layer in self.draft_state_layers
        ]
        return keys


@attrs.frozen(kw_only=True)
class Capacity:
    kv_pages: int
    state_slots: int
    aux_rows: int


def salt(model: ModelRole, kind: BufferKind, layer: int, tp_rank: int = 0) -> int:
    """A number naming one buffer (MHA buffers differ per TP rank: each holds other heads)."""
    return ((_MODEL_INDEX[model] * 16 + _KIND_INDEX[kind]) * 4096 + layer) * 1024 + tp_rank


def pattern(salt_value: int, ids: IntArray, item_bytes: int) -> U8:
    """The bytes of items ``ids`` of a buffer: shape (len(ids), item_bytes), never 0.

    Every byte depends on the item id, the buffer (salt) and the column, so a misplaced page, a
    wrong layer or a shifted offset shows. int32 arithmetic in row blocks keeps multi-GB fills cheap.
    """
    return pattern_columns(salt_value, ids, np.arange(item_bytes, dtype=np.int64))


def pattern_columns(salt_value: int, ids: IntArray, columns: IntArray) -> U8:
    """Columns ``columns`` of ``pattern(salt_value, ids, n)`` (any n above them), in that order."""
    ids64 = np.asarray(ids, dtype=np.int64).reshape(-1)
    row_a = ((ids64 * 2654435761 + salt_value * 40503) % 251).astype(np.int32)[:, None]
    row_b = ((ids64 >> 7) % 251 + 1).astype(np.int32)[:, None]
    cols = np.asarray(columns, dtype=np.int64).reshape(-1)
    item_bytes = cols.size
    col_a = ((cols * 97) % 251).astype(np.int32)[None, :]
    col_b = (cols % 251).astype(np.int32)[None, :]
    out = np.empty((ids64.size, item_bytes), dtype=np.uint8)
    step = max(1, (8 << 20) // max(1, item_bytes))  # about 32 MB of int32 per block
    for start in range(0, ids64.size, step):
        rows = slice(start, start + step)
        block = row_b[rows] * col_b
        block += row_a[rows]
        block += col_a
        block %= 251
        block += 1
        out[rows] = block
    return out


def head_columns(heads: HeadGeometry, page_size: int) -> IntArray:
    """Where each byte of a rank's K/V page item sits in the whole model's item (``[token][head][byte]``
    over ``kv_heads`` heads): the rank's heads only, in the rank's ``item_layout`` order."""
    token = np.arange(page_size, dtype=np.int64)
    head = np.arange(heads.head_start, heads.head_stop, dtype=np.int64)
    byte = np.arange(heads.head_bytes, dtype=np.int64)
    if heads.item_layout is ItemLayout.TOKEN_HEAD:
        t, h, b = token[:, None, None], head[None, :, None], byte[None, None, :]
    else:
        h, t, b = head[:, None, None], token[None, :, None], byte[None, None, :]
    columns: IntArray = ((t * heads.kv_heads + h) * heads.head_bytes + b).reshape(-1)
    return columns


class RankMemory:
    """The buffers of one rank as CPU uint8 tensors (one per buffer), and their layout.

    ``tp_size`` / ``tp_rank``: the rank's place in its instance. With ``spec.kv_heads`` they pick the
    heads its K/V buffers hold (and ``item_layout`` overrides the model's byte order for this rank);
    otherwise ``tp_rank`` is the default salt of MHA content (``fill_prefill`` and friends).
    """

    def __init__(
        self,
        spec: ModelSpec,
        capacity: Capacity,
        *,
        tp_size: int = 1,
        tp_rank: int = 0,
        item_layout: ItemLayout | None = None,
    ) -> None:
        self.spec = spec
        self.capacity = capacity
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.heads: HeadGeometry | None = None
        self._columns: IntArray | None = None
        if spec.kv_heads is not None:
            self.heads = rank_heads(
                kv_heads=spec.kv_heads,
                tp_size=tp_size,
                tp_rank=tp_rank,
                head_bytes=spec.head_bytes,
                item_layout=spec.item_layout if item_layout is None else item_layout,
            )
            self._columns = head_columns(self.heads, spec.page_size)
        self.kv_item_bytes = spec.rank_kv_item_bytes(tp_size)
        self.tensors: dict[tuple[ModelRole, BufferKind, int], torch.Tensor] = {}
        entries = []
        for key in spec.kv_keys():
            entries.append((key, capacity.kv_pages, self.kv_item_bytes))
        for key in spec.state_keys():
            entries.append((key, capacity.state_slots, spec.state_item_bytes))
        entries.append(((ModelRole.TARGET, BufferKind.AUX, 0), capacity.aux_rows, spec.aux_item_bytes))
        for key, items, item_bytes in entries:
            self.tensors[key] = torch.zeros((items, item_bytes), dtype=torch.uint8)
        self.layout = BufferLayout.from_tensors(
            attention=spec.attention,
            page_size=spec.page_size,
            tensors=[
                (kind, model, layer, tensor, tensor.shape[1])
                for (model, kind, layer), tensor in self.tensors.items()
            ],
            heads=None if self.heads is None else dict.fromkeys(ModelRole, self.heads),
        )

    def view(self, key: tuple[ModelRole, BufferKind, int]) -> U8:
        """The buffer as a (items, item_bytes) numpy view (shares memory with the tensor)."""
        return self.tensors[key].numpy()

    def kv_kinds(self) -> tuple[BufferKind, ...]:
        return (BufferKind.KV,) if self.spec.attention is AttentionKind.MLA else (BufferKind.K, BufferKind.V)

    def kv_content(
        self, model: ModelRole, kind: BufferKind, layer: int, logical: IntArray, *, tp_rank: int | None = None
    ) -> U8:
        """What this rank's KV buffer holds for logical pages ``logical``: shape (len, item bytes).

        With heads described: this rank's heads of the whole model's item (per model head and token,
        whatever the TP split). Otherwise the item salted per TP rank under MHA (``tp_rank``, default
        the memory's own), and per buffer only under MLA.
        """
        if self._columns is not None:
            return pattern_columns(salt(model, kind, layer), logical, self._columns)
        rank = self.tp_rank if tp_rank is None else tp_rank
        mha = self.spec.attention is AttentionKind.MHA
        return pattern(salt(model, kind, layer, rank if mha else 0), logical, self.kv_item_bytes)

    def clear_pages(self, physical: IntArray) -> None:
        """Zero KV pages in every KV buffer: what a forward has not written yet."""
        for key in self.spec.kv_keys():
            self.view(key)[physical] = 0

    def write_layer(
        self,
        model: ModelRole,
        layer: int,
        physical: IntArray,
        *,
        cp_rank: int,
        policy: OwnershipPolicy,
        tp_rank: int | None = None,
    ) -> None:
        """Write one layer's KV of physical pages ``physical`` from the content rule (a forward's write)."""
        logical = policy.logical(cp_rank, np.asarray(physical, dtype=np.int64))
        for kind in self.kv_kinds():
            content = self.kv_content(model, kind, layer, logical, tp_rank=tp_rank)
            self.view((model, kind, layer))[physical] = content

    def fill_prefill(self, *, cp_rank: int, policy: OwnershipPolicy, tp_rank: int | None = None) -> None:
        """Fill every buffer from the content rule, as the prefill forward would have written it."""
        physical = np.arange(self.capacity.kv_pages, dtype=np.int64)
        logical = policy.logical(cp_rank, physical)
        for key in self.spec.kv_keys():
            model, kind, layer = key
            self.view(key)[:] = self.kv_content(model, kind, layer, logical, tp_rank=tp_rank)
        slots = np.arange(self.capacity.state_slots, dtype=np.int64)
        for key in self.spec.state_keys():
            self.view(key)[:] = pattern(salt(*key), slots, self.spec.state_item_bytes)
        rows = np.arange(self.capacity.aux_rows, dtype=np.int64)
        aux = (ModelRole.TARGET, BufferKind.AUX, 0)
        self.view(aux)[:] = pattern(salt(*aux), rows, self.spec.aux_item_bytes)


def forward_layers(spec: ModelSpec) -> list[tuple[ModelRole, int]]:
    """The order a forward computes layers in: the target model's, then the draft model's."""
    return [(ModelRole.TARGET, layer) for layer in range(spec.layers)] + [
        (ModelRole.DRAFT, layer) for layer in range(spec.draft_layers)
    ]


def simulate_forward(
    spec: ModelSpec,
    *,
    layer_compute_s: float,
    on_layer_end: Callable[[ModelRole, int], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """Run a synthetic forward: every layer takes ``layer_compute_s``, then ``on_layer_end(model, layer)``.

    Layer ``i`` ends ``(i + 1) * layer_compute_s`` after the start, whatever the callbacks cost (no
    drift over 61 layers). Returns the clock at the end of the forward.
    """
    started = clock()
    for i, (model, layer) in enumerate(forward_layers(spec)):
        if layer_compute_s > 0:
            delay = started + (i + 1) * layer_compute_s - clock()
            if delay > 0:
                sleep(delay)
        if on_layer_end is not None:
            on_layer_end(model, layer)
    return clock()


@attrs.frozen(kw_only=True)
class Mismatch:
    """Where decode memory differs from what the prefill full layout says it must hold."""

    what: str
    index: int
    expected_zero: bool


def verify_room(
    memory: RankMemory,
    *,
    logical_ids: IntArray,
    dst_pages: IntArray,
    prefix_pages: int,
    state_src: dict[BufferKind, IntArray],
    state_dst: dict[BufferKind, IntArray],
    aux_src: int | None,
    aux_dst: int | None,
    tp_rank: int | None = None,
    limit: int = 8,
    left_out: Collection[tuple[ModelRole, BufferKind, int]] = (),
) -> tuple[int, list[Mismatch]]:
    """Compare one room's decode memory with the content rule; returns (bytes checked, mismatches).

    Positions before ``prefix_pages`` were already on the decode side: they must be untouched (zero).
    ``tp_rank``: the MHA salt when heads are not described (default: the memory's own TP rank).
    ``left_out``: buffers of this memory no prefill rank may write for the room (draft buffers the
    prefill side lacks): their destination pages and slots must still be zero (a write shows).
    """
    spec = memory.spec
    mismatches: list[Mismatch] = []
    checked = 0
    sent = slice(prefix_pages, None)
    untouched = set(left_out)
    for key in sorted(untouched, key=str):
        if key not in memory.tensors:
            raise ValueError(f"left_out names {key}, which this memory does not hold")
        model, kind, layer = key
        rows = dst_pages if kind.is_kv else state_dst.get(kind, np.zeros(0, dtype=np.int64))
        got = memory.view(key)[rows]
        checked += got.nbytes
        mismatches += [
            Mismatch(
                what=f"{model.value}/{kind.value}/L{layer} left out, written at",
                index=int(i),
                expected_zero=True,
            )
            for i in np.flatnonzero(got.any(axis=1))[:limit]
        ]
    for key in spec.kv_keys():
        if key in untouched:
            continue
        model, kind, layer = key
        got = memory.view(key)[dst_pages]
        want = memory.kv_content(model, kind, layer, logical_ids, tp_rank=tp_rank)
        checked += got.nbytes
        bad = np.flatnonzero((got[sent] != want[sent]).any(axis=1)) + prefix_pages
        stray = np.flatnonzero(got[:prefix_pages].any(axis=1))
        mismatches += [
            Mismatch(what=f"{model.value}/{kind.value}/L{layer} position", index=int(i), expected_zero=False)
            for i in bad[:limit]
        ]
        mismatches += [
            Mismatch(
                what=f"{model.value}/{kind.value}/L{layer} prefix position", index=int(i), expected_zero=True
            )
            for i in stray[:limit]
        ]
    for key in spec.state_keys():
        if key in untouched:
            continue
        model, kind, layer = key
        src, dst = state_src.get(kind), state_dst.get(kind)
        if src is None or dst is None:
            continue
        n = min(len(src), len(dst))
        got = memory.view(key)[dst[:n]]
        checked += got.nbytes
        bad = np.flatnonzero((got != pattern(salt(*key), src[:n], spec.state_item_bytes)).any(axis=1))
        mismatches += [
            Mismatch(what=f"{model.value}/{kind.value}/L{layer} slot", index=int(i), expected_zero=False)
            for i in bad[:limit]
        ]
    if aux_src is not None and aux_dst is not None:
        aux = (ModelRole.TARGET, BufferKind.AUX, 0)
        got = memory.view(aux)[aux_dst]
        checked += got.nbytes
        if not np.array_equal(got, pattern(salt(*aux), np.array([aux_src]), spec.aux_item_bytes)[0]):
            mismatches.append(Mismatch(what="aux row", index=aux_dst, expected_zero=False))
    return checked, mismatches[:limit]


CANARY = 0xA5


def write_canary(memory: RankMemory, dst_pages: IntArray) -> None:
    """Fill released KV pages with a canary byte; a late write shows as a changed canary."""
    for key in memory.spec.kv_keys():
        memory.view(key)[dst_pages] = CANARY


def canary_intact(memory: RankMemory, dst_pages: IntArray) -> bool:
    return all(bool((memory.view(key)[dst_pages] == CANARY).all()) for key in memory.spec.kv_keys())


def default_policy(cp_size: int) -> OwnershipPolicy:
    return PageInterleaved(cp_size=cp_size)
