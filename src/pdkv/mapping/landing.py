"""Landing zone: decode TP below prefill TP, where a prefill rank's share of a decode page is strided.

Owns: ``LandingPlan`` / ``plan_landing`` (one decode rank's landing space for one room: a region per
real source TP rank, each laid out as that rank's own K/V page items, one slot per position),
``source_region`` (the same region as the prefill rank computes it from a grant: its own head
geometry, no topology), ``landing_wanted`` (whether a decode rank needs a landing zone at all),
``landing_slots`` (positions -> slots), and ``ScatterPlan`` / ``plan_scatter`` (the copy from one
source's landing region into the decode's pages). Pure and vectorised (numpy over blocks; a loop over
buffers or source ranks only where a layout is built). Must not allocate, copy, or know rooms and
messages: the grant travels in ``TransferRequest.landing`` (specs/mapping.md section 15), the decode
runtime leases and scatters (``pdkv.runtime.landing``), the prefill's ``plan_chunk`` writes into it.

Why: with decode TP below prefill TP (``--tp 4 --decode-tp 2``), decode rank ``d`` holds the heads of
several prefill ranks, so in a token-major decode page each prefill rank's heads are one slice per
token. A gather on the prefill cannot make them contiguous at the destination; instead each prefill
rank writes its own page items, unchanged and whole, into a landing region the decode registered
(a run of its pages is one block, exactly as between equal TP), and the decode scatters them into its
pages before it reports Success.

Layout of a landing lease (specs/mapping.md, section 15): sources in ``head_plan`` order (the real
prefill TP ranks of the decode rank, ascending), each region 256-byte aligned. Inside a region come
the decode layout's K/V buffers in canonical order, buffer ``i`` holding ``slots`` items of the source
rank's ``item_bytes`` for that buffer (``page_size x its head count x head_bytes``, in the source
rank's item layout); the decode's other buffers are listed with no items (state and aux rows are not
split by heads: they keep going straight to the decode's buffers). Slot ``j`` holds position
``first_position + j``. The landing region of a source is itself a ``BufferLayout`` with the source
rank's ``HeadGeometry``, so the prefill's blocks into it are ``kv_blocks(coalesce(physical, slots),
local_layout, region_layout)`` (whole items: the head ranges are equal) and the decode's scatter is
``head_blocks`` from it into the decode layout, grouped into one ``index_copy`` per run of blocks that
are contiguous in landing and lie in one decode region.
"""

from __future__ import annotations

from typing import Any, Final

import attrs
import numpy as np

from pdkv.errors import LayoutMismatchError, MappingError
from pdkv.mapping._arrays import IntArray, as_index_array, check_int
from pdkv.mapping.blocks import TransferBlocks
from pdkv.mapping.fanout import Topology
from pdkv.mapping.heads import head_blocks, head_plan, rank_heads
from pdkv.mapping.layout import BufferKind, BufferLayout, BufferSpec, ItemLayout
from pdkv.mapping.layout_policy import transfer_view
from pdkv.mapping.runs import PageRuns, coalesce
from pdkv.mapping.staging import StagingSources, non_empty, stageable

LANDING_ALIGNMENT: Final = 256
"""Every source region of a landing lease starts on a multiple of this many bytes."""


def _array_eq() -> Any:
    return attrs.cmp_using(eq=np.array_equal)


def _int64(value: object) -> IntArray:
    return np.ascontiguousarray(np.asarray(value, dtype=np.int64).reshape(-1))


def _aligned(nbytes: int) -> int:
    return -(-nbytes // LANDING_ALIGNMENT) * LANDING_ALIGNMENT


@attrs.frozen(kw_only=True)
class LandingPlan:
    """One decode rank's landing lease for one room: region ``i`` for source TP rank ``source_tp_rank[i]``
    starts ``offset[i]`` bytes into the lease and is ``nbytes[i]`` bytes; ``regions[i]`` is its layout
    (absolute addresses). ``slots`` positions from ``first_position``; ``total_bytes`` in all."""

    source_tp_rank: IntArray = attrs.field(converter=_int64, eq=_array_eq())
    offset: IntArray = attrs.field(converter=_int64, eq=_array_eq())
    nbytes: IntArray = attrs.field(converter=_int64, eq=_array_eq())
    regions: tuple[BufferLayout, ...]
    first_position: int
    slots: int
    total_bytes: int

    def region_of(self, source_tp_rank: int) -> BufferLayout:
        """The landing layout prefill TP rank ``source_tp_rank`` writes into (MappingError if none)."""
        found = np.flatnonzero(self.source_tp_rank == source_tp_rank)
        if not found.size:
            raise MappingError(
                f"prefill tp rank {source_tp_rank} has no landing region here (sources: "
                f"{self.source_tp_rank.tolist()})"
            )
        return self.regions[int(found[0])]


def _kv_with_heads(layout: BufferLayout) -> tuple[BufferSpec, ...]:
    kv = tuple(b for b in layout.buffers if b.kind in (BufferKind.K, BufferKind.V))
    if not kv or any(b.heads is None for b in kv):
        raise LayoutMismatchError(
            "a landing zone needs an MHA layout whose K and V buffers all describe their heads"
        )
    return kv


def plan_landing(
    decode_layout: BufferLayout,
    topology: Topology,
    decode_tp_rank: int,
    *,
    first_position: int,
    slots: int,
    base: int,
    source_item_layout: ItemLayout = ItemLayout.TOKEN_HEAD,
) -> LandingPlan:
    """The landing lease at ``base`` for ``slots`` positions from ``first_position`` of one room.

    One region per real source TP rank of ``decode_tp_rank`` (``head_plan``), laid out as that rank's
    K/V buffers (its head range per model, ``source_item_layout``: the prefill ranks' byte order, which
    the decode learns from the prefill's registration). Registration-time work: a loop over buffers.
    """
    slots = check_int(slots, "slots", minimum=1)
    first_position = check_int(first_position, "first_position", minimum=0)
    base = check_int(base, "base", minimum=0)
    kv = _kv_with_heads(decode_layout)
    plan = head_plan(topology)
    mine = (plan.decode_tp_rank == decode_tp_rank) & ~plan.dummy
    if not bool(mine.any()):
        raise MappingError(f"decode tp rank {decode_tp_rank} is outside {topology}")
    sources = plan.prefill_tp_rank[mine]
    regions: list[BufferLayout] = []
    offsets: list[int] = []
    sizes: list[int] = []
    cursor = 0
    for source in sources.tolist():  # a few source ranks, a loop over buffers each: layout work
        at = base + cursor
        # Buffers without heads (state, aux) stay in the region's layout with no items, so that it pairs
        # with the decode and prefill layouts key for key (they never land here: they go direct).
        specs = [attrs.evolve(b, base_ptr=at, length=0) for b in decode_layout.buffers if b not in kv]
        for spec in kv:
            assert spec.heads is not None  # checked by _kv_with_heads
            heads = rank_heads(
                kv_heads=spec.heads.kv_heads,
                tp_size=topology.prefill_tp,
                tp_rank=source,
                head_bytes=spec.heads.head_bytes,
                item_layout=source_item_layout,
            )
            item = heads.item_bytes(decode_layout.page_size)
            specs.append(attrs.evolve(spec, base_ptr=at, length=slots * item, item_bytes=item, heads=heads))
            at += slots * item
        size = at - (base + cursor)
        regions.append(
            BufferLayout.build(
                attention=decode_layout.attention, page_size=decode_layout.page_size, buffers=specs
            )
        )
        offsets.append(cursor)
        sizes.append(size)
        cursor += _aligned(size)
    return LandingPlan(
        source_tp_rank=sources,
        offset=offsets,
        nbytes=sizes,
        regions=tuple(regions),
        first_position=first_position,
        slots=slots,
        total_bytes=cursor,
    )


def landing_wanted(decode_layout: BufferLayout, topology: Topology, decode_tp_rank: int) -> bool:
    """Whether decode rank ``decode_tp_rank`` needs a landing zone: its K/V buffers describe heads in
    token-major items and its heads come from more than one real prefill TP rank (each share would
    be one slice per token). Equal TP, GQA replicas (one real source), MLA, head-major pages and
    decode TP above prefill TP (the staged gather's case) need none."""
    kv = [b for b in decode_layout.buffers if b.kind in (BufferKind.K, BufferKind.V)]
    if not kv or any(b.heads is None or b.heads.item_layout is not ItemLayout.TOKEN_HEAD for b in kv):
        return False
    if topology.kv_heads is None or topology.decode_tp >= topology.prefill_tp:
        return False
    plan = head_plan(topology)
    mine = (plan.decode_tp_rank == decode_tp_rank) & ~plan.dummy
    return int(mine.sum()) > 1


def source_region(
    decode_layout: BufferLayout, source_layout: BufferLayout, *, base: int, slots: int
) -> BufferLayout:
    """The landing region at ``base`` for ``slots`` positions as the prefill rank with ``source_layout``
    computes it from its grant: the decode layout's K/V buffers in canonical order, each holding
    ``slots`` items of the source's own buffer of that (model, kind, layer) (its head geometry and
    item bytes), the other buffers listed with no items. Equal to ``plan_landing(...).region_of(p)``
    for that source at ``base = lease + offset(p)`` (tested). LayoutMismatchError when a decode K/V
    buffer has no counterpart with heads in ``source_layout``."""
    slots = check_int(slots, "slots", minimum=1)
    base = check_int(base, "base", minimum=0)
    kv = _kv_with_heads(decode_layout)
    own = {(b.model, b.kind, b.layer_id): b for b in source_layout.buffers}
    specs = [attrs.evolve(b, base_ptr=base, length=0) for b in decode_layout.buffers if b not in kv]
    at = base
    for spec in kv:
        mine = own.get((spec.model, spec.kind, spec.layer_id))
        if mine is None or mine.heads is None:
            raise LayoutMismatchError(
                f"the landing region needs the source's {spec.model.value} {spec.kind.value} layer "
                f"{spec.layer_id} with its heads described"
            )
        item = mine.heads.item_bytes(decode_layout.page_size)
        specs.append(attrs.evolve(spec, base_ptr=at, length=slots * item, item_bytes=item, heads=mine.heads))
        at += slots * item
    return BufferLayout.build(
        attention=decode_layout.attention, page_size=decode_layout.page_size, buffers=specs
    )


def grant_problem(
    decode_layout: BufferLayout, source_layout: BufferLayout, *, address: int, nbytes: int, slots: int
) -> str | None:
    """Why a prefill rank with ``source_layout`` must refuse a landing grant of a decode rank with
    ``decode_layout`` (None: it may write into it). The region recomputed from the grant must be
    exactly ``nbytes``, lie clear of every registered decode buffer (the landing pool is separate
    memory), and the pair's transfers must leave no buffer out (both sides lay the region out over
    the whole decode layout)."""
    if transfer_view(source_layout, decode_layout).leaves_out:
        return "a landing grant for a pair of ranks whose transfers leave draft buffers out"
    try:
        region = source_region(decode_layout, source_layout, base=address, slots=slots)
    except (LayoutMismatchError, MappingError) as exc:
        return f"landing grant: {exc}"
    need = region_bytes(region)
    if need != nbytes:
        return f"landing grant of {nbytes} bytes, but {slots} slots of this rank's items need {need}"
    end = address + nbytes
    for b in decode_layout.buffers:
        if b.length and address < b.base_ptr + b.length and b.base_ptr < end:
            return (
                f"landing grant [{address:#x}, {end:#x}) overlaps the decode's {b.model.value} "
                f"{b.kind.value} layer {b.layer_id} buffer"
            )
    return None


def region_bytes(region: BufferLayout) -> int:
    """Bytes of a landing region (its K/V buffers' lengths)."""
    return sum(b.length for b in region.buffers)


def landing_slots(positions: object, plan: LandingPlan) -> IntArray:
    """The slots of request ``positions`` in ``plan`` (``position - first_position``); every position
    must lie in the plan's window, else ``MappingError`` (never clipped)."""
    pos = as_index_array(positions, "positions")
    slots = pos - plan.first_position
    if slots.size and (int(slots.min()) < 0 or int(slots.max()) >= plan.slots):
        raise MappingError(
            f"positions {int(pos.min())}..{int(pos.max())} are outside the landing window "
            f"{plan.first_position}..{plan.first_position + plan.slots - 1}"
        )
    return slots


@attrs.frozen(kw_only=True)
class ScatterPlan:
    """Struct of arrays, one entry per group: a run of blocks contiguous in landing, in one decode region.

    Group ``k`` copies ``count[k]`` elements of ``element_bytes[k]`` bytes, consecutive in landing from
    address ``landing_address[k]``, to rows ``index[first[k] : first[k] + count[k]]`` of decode region
    ``region[k]`` viewed as rows of ``element_bytes[k]`` bytes (row ``j`` = region bytes
    ``[j x e, (j + 1) x e)``): one ``index_copy`` per group.
    """

    region: IntArray = attrs.field(converter=_int64, eq=_array_eq())
    element_bytes: IntArray = attrs.field(converter=_int64, eq=_array_eq())
    first: IntArray = attrs.field(converter=_int64, eq=_array_eq())
    count: IntArray = attrs.field(converter=_int64, eq=_array_eq())
    landing_address: IntArray = attrs.field(converter=_int64, eq=_array_eq())
    index: IntArray = attrs.field(converter=_int64, eq=_array_eq())

    def __len__(self) -> int:
        return int(self.region.size)

    @property
    def total_bytes(self) -> int:
        return int((self.count * self.element_bytes).sum())


def scatter_groups(blocks: TransferBlocks, regions: StagingSources) -> ScatterPlan:
    """Group landing -> decode ``blocks`` (``src`` in landing, ``dst`` in decode buffers named by
    ``buffer``, as ``head_blocks`` gives them) into a ``ScatterPlan`` over the decode's ``regions``.

    A group is a maximal run of consecutive blocks in one region whose landing bytes follow each other;
    its element size is the gcd of its blocks' lengths and of their offsets in the region. Every block
    must lie in a readable buffer of ``regions`` (``MappingError`` otherwise).
    """
    kept = non_empty(blocks)
    if not len(kept):
        return ScatterPlan(region=[], element_bytes=[], first=[], count=[], landing_address=[], index=[])
    swapped = TransferBlocks(src=kept.dst, dst=kept.src, length=kept.length, buffer=kept.buffer)
    if not stageable(swapped, regions):  # the decode side of every block must be in a known region
        raise MappingError(f"{len(kept)} scatter blocks are not all inside the decode regions given")
    region = regions.buffer_region[kept.buffer]
    rel = kept.dst - regions.region_start[region]
    starts = np.ones(len(kept), dtype=np.bool_)
    starts[1:] = (region[1:] != region[:-1]) | (kept.src[1:] != kept.src[:-1] + kept.length[:-1])
    group_starts = np.flatnonzero(starts)
    sizes = np.diff(np.append(group_starts, len(kept)))
    element = np.gcd.reduceat(np.gcd(rel, kept.length), group_starts)
    e = np.repeat(element, sizes)
    per_block = kept.length // e
    block_first = np.cumsum(per_block) - per_block
    index = np.repeat(rel // e - block_first, per_block) + np.arange(int(per_block.sum()), dtype=np.int64)
    count = np.add.reduceat(per_block, group_starts)
    return ScatterPlan(
        region=region[group_starts],
        element_bytes=element,
        first=np.cumsum(count) - count,
        count=count,
        landing_address=kept.src[group_starts],
        index=index,
    )


def plan_scatter(
    plan: LandingPlan,
    source_tp_rank: int,
    decode_layout: BufferLayout,
    *,
    positions: object,
    dst_pages: object,
    regions: StagingSources,
) -> ScatterPlan:
    """The scatter of source ``source_tp_rank``'s landing region for ``positions`` (whose decode pages are
    ``dst_pages[positions]``) into the decode's pages: the shared heads of every slot, token and buffer.

    ``regions``: where the decode's buffers lie (``StagingSources`` over ``decode_layout``).
    """
    region_layout = plan.region_of(source_tp_rank)
    slots = landing_slots(positions, plan)
    pages = as_index_array(dst_pages, "dst_pages")
    pos = as_index_array(positions, "positions")
    if pos.size and int(pos.max()) >= pages.size:
        raise MappingError(f"position {int(pos.max())} is past dst_pages (n={pages.size})")
    runs: PageRuns = coalesce(slots, pages[pos])
    return scatter_groups(head_blocks(runs, region_layout, decode_layout), regions)
