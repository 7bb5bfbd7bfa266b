"""pdkv.mapping: which bytes go where (DESIGN section 6).

Pure, vectorised numpy functions from "pages the scheduler knows" to "bytes the engine moves":

- ``layout``: buffer layouts (kind, model, layer id, base, length, bytes per item) of one rank;
- ``layout_policy``: what a registration accepts (``compatibility`` under a ``LayoutPolicy``) and the
  layouts a pair of ranks plans on when draft-model buffers are left out (``transfer_view``);
- ``ownership`` and ``pages``: CP shared-KV ownership, chunk offsets (``chunk_page_start``), the
  pages a CP rank owns (``cp_owned``), and the exact position -> destination contract;
- ``runs``: (src, dst) page pairs coalesced into runs contiguous on both sides;
- ``buffers``: runs turned into byte blocks per paired buffer (KV, state slots, aux rows);
- ``batches``: blocks sliced and cut into batches within the engine's limits;
- ``state``: state index clipping and state-layer compaction for index-skip models;
- ``fanout``: TP fan-out (targets, dummy ranks, required_dst_info_num, statuses to wait for);
- ``heads``: MHA/GQA across unequal TP: head ranges per rank, the head plan of a topology, and the
  strided byte blocks (``head_blocks``; ``kv_blocks`` picks it or ``layer_blocks``);
- ``staging``: the staged gather (decode TP above prefill TP): scattered blocks whose destinations
  are contiguous, cut into staging pieces, each a gather plan and a few large blocks;
- ``landing``: the landing zone (decode TP below prefill TP): a decode's landing lease per source
  rank and the scatter plan from it into the decode's pages (``pdkv.runtime.landing`` runs them).

Inputs may be numpy arrays, integer sequences or CPU torch tensors; a tensor on an accelerator is a
``MappingError`` (never a hidden device-to-host copy). Every contract violation is a typed error
with compact summaries; nothing is clipped silently. Must not do I/O, start threads, read clocks or
import torch; imports only ``pdkv.errors``. The formulas and worked examples: specs/mapping.md.
"""

from pdkv.mapping.batches import batch_bounds, shape_batches, slice_blocks
from pdkv.mapping.blocks import TransferBlocks
from pdkv.mapping.buffers import (
    BufferPairs,
    aux_blocks,
    layer_blocks,
    pair_buffers,
    runs_to_blocks,
    state_blocks,
)
from pdkv.mapping.fanout import (
    DecodeFanout,
    PrefillFanout,
    PrefillTarget,
    Topology,
    TopologyError,
    decode_fanout,
    prefill_fanout,
    required_dst_info_num,
)
from pdkv.mapping.heads import (
    HeadPairs,
    HeadPlan,
    HeadRange,
    head_blocks,
    head_plan,
    head_range,
    kv_blocks,
    layout_kv_heads,
    pair_head_buffers,
    rank_heads,
)
from pdkv.mapping.landing import LandingPlan, ScatterPlan, landing_slots, plan_landing, plan_scatter
from pdkv.mapping.layout import (
    AttentionKind,
    BufferKind,
    BufferLayout,
    BufferSpec,
    HeadGeometry,
    ItemLayout,
    ModelRole,
)
from pdkv.mapping.layout_policy import (
    DEFAULT_LAYOUT_POLICY,
    BufferKey,
    LayoutCompatibility,
    LayoutPolicy,
    TransferView,
    compatibility,
    transfer_view,
)
from pdkv.mapping.ownership import BlockCyclic, OwnershipPolicy, PageInterleaved
from pdkv.mapping.pages import (
    MappedChunk,
    OwnedPages,
    check_page_counts,
    chunk_page_start,
    cp_owned,
    dst_for_positions,
    map_chunk,
)
from pdkv.mapping.runs import PagePairs, PageRuns, coalesce, expand
from pdkv.mapping.staging import (
    GatherPlan,
    StagedPiece,
    StagingSources,
    plan_staged_pieces,
    staged_entries,
)
from pdkv.mapping.state import (
    ClippedState,
    LayerKey,
    StateLayerDifference,
    StateLayerMap,
    clip_state,
    compare_state_layers,
    state_layer_keys,
)

__all__ = [
    "DEFAULT_LAYOUT_POLICY",
    "AttentionKind",
    "BlockCyclic",
    "BufferKey",
    "BufferKind",
    "BufferLayout",
    "BufferPairs",
    "BufferSpec",
    "ClippedState",
    "DecodeFanout",
    "GatherPlan",
    "HeadGeometry",
    "HeadPairs",
    "HeadPlan",
    "HeadRange",
    "ItemLayout",
    "LandingPlan",
    "LayerKey",
    "LayoutCompatibility",
    "LayoutPolicy",
    "MappedChunk",
    "ModelRole",
    "OwnedPages",
    "OwnershipPolicy",
    "PageInterleaved",
    "PagePairs",
    "PageRuns",
    "PrefillFanout",
    "PrefillTarget",
    "ScatterPlan",
    "StagedPiece",
    "StagingSources",
    "StateLayerDifference",
    "StateLayerMap",
    "Topology",
    "TopologyError",
    "TransferBlocks",
    "TransferView",
    "aux_blocks",
    "batch_bounds",
    "check_page_counts",
    "chunk_page_start",
    "clip_state",
    "coalesce",
    "compare_state_layers",
    "compatibility",
    "cp_owned",
    "decode_fanout",
    "dst_for_positions",
    "expand",
    "head_blocks",
    "head_plan",
    "head_range",
    "kv_blocks",
    "landing_slots",
    "layer_blocks",
    "layout_kv_heads",
    "map_chunk",
    "pair_buffers",
    "pair_head_buffers",
    "plan_landing",
    "plan_scatter",
    "plan_staged_pieces",
    "prefill_fanout",
    "rank_heads",
    "required_dst_info_num",
    "runs_to_blocks",
    "shape_batches",
    "slice_blocks",
    "staged_entries",
    "state_blocks",
    "state_layer_keys",
    "transfer_view",
]
