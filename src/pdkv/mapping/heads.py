"""MHA/GQA heads across unequal TP: which heads go where, and the strided byte blocks that move them.

Owns: the rank -> head range rule (``head_range``, ``rank_heads``), the head plan of a topology
(``head_plan`` / ``HeadPlan``: for every prefill TP rank and decode TP rank that exchange a request,
which model heads go from which head offset to which head offset, or a dummy), and the byte blocks
for pages whose K/V items hold different head ranges on the two sides (``head_blocks``, and
``kv_blocks`` which picks it or ``layer_blocks``). Pure and vectorised: integer arithmetic over
ranks, and over (buffer, page, segment) for blocks, no Python loop over pages or layers. Must not
decide who is a dummy on its own (``fanout`` does, ``head_plan`` follows it) and must not touch
rooms or sockets.

Head ranges (SGLang's GQA convention): over TP size ``T`` and ``H`` KV heads (``H % T == 0`` or
``T % H == 0``), rank ``r`` holds ``max(1, H // T)`` heads starting at model head ``r * H // T``;
with ``H < T`` each head sits on ``T / H`` consecutive ranks (replicas).

Bytes: a page item of a rank holding ``c`` heads of ``b`` bytes (per token) is ``page_size x c x b``
bytes, token-major (``[token][head][b]``) or head-major (``[head][token][b]``) as the buffer's
``HeadGeometry.item_layout`` says. A prefill rank sends the heads its range shares with the decode
rank's range. Each page becomes a per-buffer template of segments (one per token for token-major
slices, one per page for head-major ones), worked out once per pair of layouts and cached; where
the slice is the whole item on both sides, pages coalesce into runs exactly as ``layer_blocks`` does.
Every model of a layout (target, draft) must split the same ``kv_heads``: the fan-out picks the
dummies from that one count, and a model with fewer heads would be sent twice by two real ranks.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Final

import attrs
import numpy as np
import numpy.typing as npt

from pdkv.errors import LayoutMismatchError, MappingError
from pdkv.mapping._arrays import IntArray, as_index_array, check_int, int_max
from pdkv.mapping.blocks import TransferBlocks
from pdkv.mapping.buffers import KV_KINDS, layer_blocks
from pdkv.mapping.fanout import Topology, TopologyError
from pdkv.mapping.layout import (
    AttentionKind,
    BufferKind,
    BufferLayout,
    BufferSpec,
    HeadGeometry,
    ItemLayout,
    ModelRole,
)
from pdkv.mapping.runs import PageRuns, expand

BoolArray = npt.NDArray[np.bool_]

_HEAD_KINDS: Final = frozenset({BufferKind.K, BufferKind.V})


def _array_eq() -> Any:
    return attrs.cmp_using(eq=np.array_equal)


# ---------------------------------------------------------------- head ranges


@attrs.frozen(kw_only=True)
class HeadRange:
    """Model KV heads ``start .. start + count - 1``."""

    start: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.count


def _check_split(kv_heads: int, tp_size: int) -> None:
    if kv_heads % tp_size and tp_size % kv_heads:
        raise TopologyError(
            f"{kv_heads} KV heads cannot be split over tp {tp_size}: one must divide the other"
        )


def head_range(kv_heads: int, tp_size: int, tp_rank: int) -> HeadRange:
    """The model KV heads TP rank ``tp_rank`` of ``tp_size`` holds (one replicated head when fewer heads)."""
    heads = check_int(kv_heads, "kv_heads", minimum=1)
    size = check_int(tp_size, "tp_size", minimum=1)
    rank = check_int(tp_rank, "tp_rank", minimum=0)
    if rank >= size:
        raise TopologyError(f"tp_rank {rank} is outside tp_size {size}")
    _check_split(heads, size)
    return HeadRange(start=rank * heads // size, count=max(1, heads // size))


def rank_heads(
    *,
    kv_heads: int,
    tp_size: int,
    tp_rank: int,
    head_bytes: int,
    item_layout: ItemLayout = ItemLayout.TOKEN_HEAD,
) -> HeadGeometry:
    """The ``HeadGeometry`` a rank registers for its K and V buffers (named constructor)."""
    held = head_range(kv_heads, tp_size, tp_rank)
    return HeadGeometry(
        kv_heads=kv_heads,
        head_start=held.start,
        head_count=held.count,
        head_bytes=check_int(head_bytes, "head_bytes", minimum=1),
        item_layout=item_layout,
    )


# ---------------------------------------------------------------- head plan of a topology


@attrs.frozen(kw_only=True)
class HeadPlan:
    """Struct of arrays, one entry per (prefill TP rank, decode TP rank) pair that exchange a request.

    Entry i: prefill TP rank ``prefill_tp_rank[i]`` serves decode TP rank ``decode_tp_rank[i]``;
    unless ``dummy[i]``, it writes model heads ``head_start[i] .. + num_heads[i] - 1``, found at
    head offset ``src_head[i]`` of its own range, at head offset ``dst_head[i]`` of the decode
    rank's range. Dummy entries have ``num_heads == 0`` (and offsets 0). Sorted by decode rank, then
    prefill rank: the order of ``decode_fanout``'s targets.
    """

    prefill_tp_rank: IntArray = attrs.field(eq=_array_eq())
    decode_tp_rank: IntArray = attrs.field(eq=_array_eq())
    dummy: BoolArray = attrs.field(eq=_array_eq())
    head_start: IntArray = attrs.field(eq=_array_eq())
    num_heads: IntArray = attrs.field(eq=_array_eq())
    src_head: IntArray = attrs.field(eq=_array_eq())
    dst_head: IntArray = attrs.field(eq=_array_eq())

    def __len__(self) -> int:
        return int(self.prefill_tp_rank.size)


def _ranges(kv_heads: int, tp_size: int, ranks: IntArray) -> tuple[IntArray, int]:
    return ranks * kv_heads // tp_size, max(1, kv_heads // tp_size)


def head_plan(topology: Topology) -> HeadPlan:
    """Every (prefill, decode) TP pair of an MHA topology with its head slice (vectorised over ranks).

    Follows ``decode_fanout``: who addresses whom and who is a dummy. For every real pair the two
    head ranges overlap, and over the real prefill ranks of one decode rank the overlaps tile the
    decode rank's range exactly once (property-tested).
    """
    if topology.attention is not AttentionKind.MHA or topology.kv_heads is None:
        raise TopologyError(
            f"a head plan needs an MHA topology with kv_heads (got {topology.attention.value}, "
            f"kv_heads={topology.kv_heads})"
        )
    heads, p_tp, d_tp, r = topology.kv_heads, topology.prefill_tp, topology.decode_tp, topology.ratio
    if d_tp >= p_tp:
        decode = np.arange(d_tp, dtype=np.int64)
        prefill = decode // r
    else:
        decode = np.repeat(np.arange(d_tp, dtype=np.int64), r)
        prefill = np.arange(p_tp, dtype=np.int64)
    dummy = prefill % topology.copies != 0
    p_start, p_count = _ranges(heads, p_tp, prefill)
    d_start, d_count = _ranges(heads, d_tp, decode)
    lo = np.maximum(p_start, d_start)
    count = np.minimum(p_start + p_count, d_start + d_count) - lo
    if int(count[~dummy].min()) <= 0:  # cannot happen under the split rule; a guard, not a clip
        raise TopologyError(f"{topology}: a real prefill rank shares no head with its decode rank")
    real = ~dummy
    return HeadPlan(
        prefill_tp_rank=prefill,
        decode_tp_rank=decode,
        dummy=dummy,
        head_start=np.where(real, lo, 0),
        num_heads=np.where(real, count, 0),
        src_head=np.where(real, lo - p_start, 0),
        dst_head=np.where(real, lo - d_start, 0),
    )


# ---------------------------------------------------------------- buffer pairing with head templates


@attrs.frozen(kw_only=True)
class HeadPairs:
    """Struct of arrays over the local K/V buffers (local layout order), each with its segment template.

    Buffer entry i (local ``buffer[i]`` -> peer ``peer_buffer[i]``): page items of ``src_item_bytes[i]``
    here and ``dst_item_bytes[i]`` there. ``whole[i]``: the slice is the whole item on both sides, so
    the buffer moves coalesced page runs. Otherwise every page moves ``seg_count[i]`` segments: the
    segments ``seg_first[i] ..`` of the flat template arrays, each ``seg_bytes`` long at byte offset
    ``seg_src`` in the local item and ``seg_dst`` in the peer item.
    """

    buffer: IntArray = attrs.field(eq=_array_eq())
    peer_buffer: IntArray = attrs.field(eq=_array_eq())
    layer_id: IntArray = attrs.field(eq=_array_eq())
    draft: BoolArray = attrs.field(eq=_array_eq())
    src_base: IntArray = attrs.field(eq=_array_eq())
    dst_base: IntArray = attrs.field(eq=_array_eq())
    src_item_bytes: IntArray = attrs.field(eq=_array_eq())
    dst_item_bytes: IntArray = attrs.field(eq=_array_eq())
    src_items: IntArray = attrs.field(eq=_array_eq())
    dst_items: IntArray = attrs.field(eq=_array_eq())
    whole: BoolArray = attrs.field(eq=_array_eq())
    seg_first: IntArray = attrs.field(eq=_array_eq())
    seg_count: IntArray = attrs.field(eq=_array_eq())
    seg_src: IntArray = attrs.field(eq=_array_eq())
    seg_dst: IntArray = attrs.field(eq=_array_eq())
    seg_bytes: IntArray = attrs.field(eq=_array_eq())

    def __len__(self) -> int:
        return int(self.buffer.size)

    def where(self, keep: BoolArray) -> HeadPairs:
        """The buffer entries where ``keep``; the flat segment arrays are shared (``seg_first`` still
        points into them)."""
        picked = {name: getattr(self, name)[keep] for name in _PER_BUFFER}
        return attrs.evolve(self, **picked)

    def select(self, *, layers: object | None = None, model: ModelRole | None = None) -> HeadPairs:
        """The pairs of some logical layers and/or one model (for per-layer transfer)."""
        if layers is None and model is None:
            return self
        keep = np.ones(len(self), dtype=np.bool_)
        if layers is not None:
            keep &= np.isin(self.layer_id, as_index_array(layers, "layers"))
        if model is not None:
            keep &= self.draft == (model is ModelRole.DRAFT)
        return self.where(keep)


_PER_BUFFER: Final = (
    *(f.name for f in attrs.fields(HeadPairs) if not f.name.startswith("seg_")),
    "seg_first",
    "seg_count",
)


def _element_offsets(heads: HeadGeometry, page_size: int, token: IntArray, head: IntArray) -> IntArray:
    """Byte offset inside a page item of (token, head offset within the rank's range)."""
    if heads.item_layout is ItemLayout.TOKEN_HEAD:
        out: IntArray = (token * heads.head_count + head) * heads.head_bytes
    else:
        out = (head * page_size + token) * heads.head_bytes
    return out


def _template(src: HeadGeometry, dst: HeadGeometry, page_size: int) -> tuple[IntArray, IntArray, IntArray]:
    """Segments (src offset, dst offset, bytes) moving the shared heads of one page item.

    Built from one element per (token, shared head) of ``head_bytes`` bytes, in the local item's byte
    order, then merged where both sides advance together: token-major slices become one segment per
    token (one per page when the slice is every head of both items), head-major ones one per page.
    """
    lo, hi = max(src.head_start, dst.head_start), min(src.head_stop, dst.head_stop)
    shared = hi - lo
    token = np.repeat(np.arange(page_size, dtype=np.int64), shared)
    head = np.tile(np.arange(lo, hi, dtype=np.int64), page_size)
    src_off = _element_offsets(src, page_size, token, head - src.head_start)
    dst_off = _element_offsets(dst, page_size, token, head - dst.head_start)
    order = np.argsort(src_off, kind="stable")
    src_off, dst_off = src_off[order], dst_off[order]
    step = src.head_bytes
    breaks = np.flatnonzero((np.diff(src_off) != step) | (np.diff(dst_off) != step)) + 1
    starts = np.concatenate([np.zeros(1, dtype=np.int64), breaks])
    ends = np.concatenate([breaks, np.array([src_off.size], dtype=np.int64)])
    return src_off[starts], dst_off[starts], (ends - starts) * step


def _describe(spec: BufferSpec) -> str:
    return f"{spec.model.value} {spec.kind.value} layer {spec.layer_id}"


def _head_geometry(spec: BufferSpec, side: str) -> HeadGeometry:
    if spec.heads is None:
        raise LayoutMismatchError(
            f"{_describe(spec)} describes no heads {side}: head slicing needs the head geometry of every "
            "K and V buffer on both sides"
        )
    return spec.heads


def pair_head_buffers(local: BufferLayout, peer: BufferLayout) -> HeadPairs:
    """Pair every local K/V buffer with the peer's of the same (model, kind, layer id), with templates.

    Raises ``LayoutMismatchError`` when the layouts differ (``BufferLayout.difference``), a K/V
    buffer describes no heads, or a local buffer shares no head with its peer buffer (both ranges
    named: this rank does not serve that peer). Registration-time work (a loop over buffers).
    """
    for layout in (local, peer):
        if layout.attention is not AttentionKind.MHA:
            raise LayoutMismatchError(f"head slicing needs MHA layouts, got {layout.attention.value}")
    difference = local.difference(peer)
    if difference is not None:
        raise LayoutMismatchError(f"buffer layouts are incompatible: {difference}")
    if any(b.kind is BufferKind.KV for b in local.buffers):
        raise LayoutMismatchError("an MHA layout with a latent KV buffer: head slicing covers K and V only")
    theirs = {
        (b.model, b.kind, b.layer_id): (j, b) for j, b in enumerate(peer.buffers) if b.kind in _HEAD_KINDS
    }
    rows: list[tuple[int, int, BufferSpec, BufferSpec, tuple[IntArray, IntArray, IntArray]]] = []
    for i, mine in enumerate(local.buffers):
        if mine.kind not in _HEAD_KINDS:
            continue
        j, other = theirs[(mine.model, mine.kind, mine.layer_id)]
        src, dst = _head_geometry(mine, "here"), _head_geometry(other, "at the peer")
        if max(src.head_start, dst.head_start) >= min(src.head_stop, dst.head_stop):
            raise LayoutMismatchError(
                f"{_describe(mine)}: this rank holds heads {src.head_start}..{src.head_stop - 1}, the "
                f"peer heads {dst.head_start}..{dst.head_stop - 1}: no head to send (not a real source "
                "of that peer)"
            )
        rows.append((i, j, mine, other, _template(src, dst, local.page_size)))
    split = sorted({(a.model.value, a.heads.kv_heads) for _, _, a, _, _ in rows if a.heads is not None})
    if len({h for _, h in split}) > 1:
        raise LayoutMismatchError(
            f"K/V buffers split different KV head counts {split}: the TP fan-out (who is a dummy, how "
            "many statuses) follows one head count, so a replica could send its heads twice; every "
            "model of an MHA layout must have the same kv_heads"
        )

    def column(values: list[int]) -> IntArray:
        return np.asarray(values, dtype=np.int64).reshape(-1)

    counts = column([t[0].size for *_, t in rows])
    whole = np.asarray(
        [t[0].size == 1 and int(t[2][0]) == a.item_bytes == b.item_bytes for _, _, a, b, t in rows],
        dtype=np.bool_,
    ).reshape(-1)
    empty = np.zeros(0, dtype=np.int64)
    return HeadPairs(
        buffer=column([i for i, *_ in rows]),
        peer_buffer=column([j for _, j, *_ in rows]),
        layer_id=column([a.layer_id for _, _, a, _, _ in rows]),
        draft=np.asarray([a.model is ModelRole.DRAFT for _, _, a, _, _ in rows], dtype=np.bool_).reshape(-1),
        src_base=column([a.base_ptr for _, _, a, _, _ in rows]),
        dst_base=column([b.base_ptr for _, _, _, b, _ in rows]),
        src_item_bytes=column([a.item_bytes for _, _, a, _, _ in rows]),
        dst_item_bytes=column([b.item_bytes for _, _, _, b, _ in rows]),
        src_items=column([a.num_items for _, _, a, _, _ in rows]),
        dst_items=column([b.num_items for _, _, _, b, _ in rows]),
        whole=whole,
        seg_first=np.cumsum(counts) - counts,
        seg_count=counts,
        seg_src=np.concatenate([empty, *(t[0] for *_, t in rows)]),
        seg_dst=np.concatenate([empty, *(t[1] for *_, t in rows)]),
        seg_bytes=np.concatenate([empty, *(t[2] for *_, t in rows)]),
    )


_CACHE_LIMIT: Final = 256
_cache_lock = threading.Lock()
_cache: dict[tuple[int, int], tuple[weakref.ref[BufferLayout], weakref.ref[BufferLayout], HeadPairs]] = {}


def cached_head_pairs(local: BufferLayout, peer: BufferLayout) -> HeadPairs:
    """``pair_head_buffers`` memoised on the identity of both layouts (weak references)."""
    key = (id(local), id(peer))
    hit = _cache.get(key)
    if hit is not None and hit[0]() is local and hit[1]() is peer:
        return hit[2]
    pairs = pair_head_buffers(local, peer)
    with _cache_lock:
        if len(_cache) >= _CACHE_LIMIT:
            _cache.clear()
        _cache[key] = (weakref.ref(local), weakref.ref(peer), pairs)
    return pairs


# ---------------------------------------------------------------- byte blocks


def _check_head_capacity(runs: PageRuns, pairs: HeadPairs) -> None:
    src_end = int_max(runs.src_start + runs.length)
    dst_end = int_max(runs.dst_start + runs.length)
    short = np.flatnonzero((pairs.src_items < src_end) | (pairs.dst_items < dst_end))
    if short.size:
        first = int(short[0])
        raise MappingError(
            f"page {max(src_end, dst_end) - 1} is past the end of {short.size} buffer pair(s); first: buffer "
            f"#{int(pairs.buffer[first])} (layer {int(pairs.layer_id[first])}) holds "
            f"{int(pairs.src_items[first])} pages here, {int(pairs.dst_items[first])} at the peer; "
            f"runs: {len(runs)} covering {runs.num_pages} pages (last page here {src_end - 1}, "
            f"there {dst_end - 1})"
        )


def head_pairs_to_blocks(runs: PageRuns, pairs: HeadPairs) -> TransferBlocks:
    """Blocks for ``runs`` in every paired buffer: buffer-major, then page (or run), then segment.

    A whole-item buffer moves one block per run (``length x item`` bytes); a sliced one moves, for
    every page of every run, its template: ``src_base + page x src_item + seg_src``, ``seg_bytes``.
    """
    if len(runs) == 0 or len(pairs) == 0:
        return TransferBlocks.empty()
    _check_head_capacity(runs, pairs)
    pages = expand(runs)
    # Units: the runs first (for whole-item buffers), then the pages one by one (for sliced ones).
    unit_src = np.concatenate([runs.src_start, pages.src])
    unit_dst = np.concatenate([runs.dst_start, pages.dst])
    unit_len = np.concatenate([runs.length, np.ones(pages.src.size, dtype=np.int64)])
    unit_first = np.where(pairs.whole, 0, len(runs))
    unit_count = np.where(pairs.whole, len(runs), pages.src.size)
    # One row per (buffer, unit): the unit's item addresses in that buffer (small: buffers x pages).
    owner = np.repeat(np.arange(len(pairs), dtype=np.int64), unit_count)
    unit = (
        unit_first[owner]
        + np.arange(owner.size, dtype=np.int64)
        - np.repeat(np.cumsum(unit_count) - unit_count, unit_count)
    )
    row_src = pairs.src_base[owner] + unit_src[unit] * pairs.src_item_bytes[owner]
    row_dst = pairs.dst_base[owner] + unit_dst[unit] * pairs.dst_item_bytes[owner]
    row_segs = pairs.seg_count[owner]
    # Every row expands into its buffer's segments: seg = that buffer's seg_first + 0 .. seg_count - 1.
    first_block = np.cumsum(row_segs) - row_segs
    seg = np.arange(int(row_segs.sum()), dtype=np.int64) - np.repeat(
        first_block - pairs.seg_first[owner], row_segs
    )
    return TransferBlocks(
        src=np.repeat(row_src, row_segs) + pairs.seg_src[seg],
        dst=np.repeat(row_dst, row_segs) + pairs.seg_dst[seg],
        length=pairs.seg_bytes[seg] * np.repeat(unit_len[unit], row_segs),
        buffer=np.repeat(pairs.buffer[owner], row_segs),
    )


def head_blocks(
    runs: PageRuns,
    src_layout: BufferLayout,
    dst_layout: BufferLayout,
    *,
    layers: object | None = None,
    model: ModelRole | None = None,
) -> TransferBlocks:
    """Blocks moving ``runs`` of KV pages in every K and V buffer, for the heads both ranks share.

    Both layouts must describe the heads of every K/V buffer (``HeadGeometry``); the local rank
    must be a real source of the peer (``head_plan``), so the two ranges overlap. Order and
    ``buffer`` indices as ``layer_blocks``; with equal head ranges the result equals it.
    """
    pairs = cached_head_pairs(src_layout, dst_layout)
    if runs.num_pages and len(pairs) == 0:
        raise MappingError(f"{runs.num_pages} KV page(s) to send but the layouts have no K/V buffer")
    return head_pairs_to_blocks(runs, pairs.select(layers=layers, model=model))


def layout_kv_heads(layout: BufferLayout) -> int | None:
    """The model KV head count a layout describes (``Topology.kv_heads``), or None when it has none.

    Reads the first buffer (see ``describes_heads``); ``head_blocks`` refuses layouts whose K/V
    buffers split different head counts, so that one number is the whole layout's.
    """
    first = layout.buffers[0] if layout.buffers else None
    return first.heads.kv_heads if first is not None and first.heads is not None else None


def describes_heads(layout: BufferLayout) -> bool:
    """True when ``layout``'s K/V buffers carry a ``HeadGeometry``.

    Looks at the first buffer only (no loop over layers per chunk): in canonical order that is the
    target model's first K buffer of an MHA layout. A layout that describes heads there but not on
    every K/V buffer is refused by ``head_blocks`` with the buffer named.
    """
    first = layout.buffers[0] if layout.buffers else None
    return first is not None and first.kind in KV_KINDS and first.heads is not None


def kv_blocks(
    runs: PageRuns,
    src_layout: BufferLayout,
    dst_layout: BufferLayout,
    *,
    layers: object | None = None,
    model: ModelRole | None = None,
) -> TransferBlocks:
    """The KV blocks for ``runs``: ``head_blocks`` when either layout describes heads, else ``layer_blocks``.

    The one call the runtime needs for KV pages under MLA, equal-TP MHA and unequal-TP MHA/GQA.
    """
    if describes_heads(src_layout) or describes_heads(dst_layout):
        return head_blocks(runs, src_layout, dst_layout, layers=layers, model=model)
    return layer_blocks(runs, src_layout, dst_layout, layers=layers, model=model)
