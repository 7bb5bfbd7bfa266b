"""What a cluster run is: ``ClusterSpec``, ``RequestPlan``, ``AbortPlan``, the per-side room descriptions
``plan_requests`` derives from them, and the records rank processes report (``RoomOutcome``,
``RankReport``). Must not start processes or transports.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt

from pdkv.alloc import PagePool
from pdkv.mapping import (
    DEFAULT_LAYOUT_POLICY,
    BufferKind,
    LayoutPolicy,
    OwnershipPolicy,
    PageInterleaved,
    chunk_page_start,
)
from pdkv.protocol.config import Timeouts
from pdkv.protocol.ids import RoomId
from pdkv.protocol.messages import Side
from pdkv.runtime.landing import LandingConfig
from pdkv.runtime.staging import StagingConfig
from pdkv.testing.faults import (
    FaultCounts,
    NetnsLayout,
    RankFaults,
)
from pdkv.testing.synthetic import (
    Capacity,
    ModelSpec,
)

IntArray = npt.NDArray[np.int64]
log = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class ClusterSpec:
    model: ModelSpec = attrs.Factory(ModelSpec)
    decode_model: ModelSpec | None = None
    """The decode ranks' model when it differs from the prefill's (None: the same). Draft-model
    differences only make a rolling deployment: the layout policies below decide on it; the decode
    then checks that nothing wrote its draft buffers the prefill lacks."""
    prefill_layout_policy: LayoutPolicy = DEFAULT_LAYOUT_POLICY
    decode_layout_policy: LayoutPolicy = DEFAULT_LAYOUT_POLICY
    prefill_tp: int = 1
    prefill_cp: int = 1
    decode_tp: int = 1
    prefill_capacity: Capacity = attrs.Factory(lambda: Capacity(kv_pages=2048, state_slots=256, aux_rows=256))
    decode_capacity: Capacity = attrs.Factory(lambda: Capacity(kv_pages=4096, state_slots=256, aux_rows=256))
    timeouts: Timeouts = attrs.Factory(
        lambda: Timeouts(bootstrap=60, waiting=60, inflight=60, transfer=60, abort_ack=10)
    )
    state_slots_per_room: int = 2
    startup_timeout_s: float = 120.0
    room_timeout_s: float = 120.0
    per_layer: bool = False
    """Default transfer mode of a request (``RequestPlan.per_layer`` overrides it per request)."""
    forward_writes_kv: bool = False
    """The simulated forward zeroes the pages it computes and writes each layer's KV as it ends."""
    verify_bytes: bool = True
    """Decode ranks zero each room's pages before it and check every byte after Success. Off only for
    control-plane benchmarks of tiny rooms, where that check would be most of the decode's work."""
    consensus: bool = True
    """Prefill ranks MIN-reduce their room polls over a gloo group (only with more than one rank)."""
    consensus_timeout_s: float = 30.0
    """gloo's timeout for the group (its default is 30 min: a dead rank would hang the others)."""
    faults: tuple[RankFaults, ...] = ()
    stable_addresses: bool = False
    """Prefill ranks bind their control sockets on ports chosen by the parent, so ``restart`` brings a
    rank back behind the same address."""
    engine_transfer_timeout_s: int | None = None
    """``MC_TRANSFER_TIMEOUT`` of every rank's engine (None: the engine's default, 30 s)."""
    engine_tcp_queue: int | None = None
    """``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` of every rank's engine, with pdkv's entry budget per
    peer kept at the engine's default queue (2,048): headroom for the engine. Under load (many ranks
    on few cores) a stream of small entries (MHA head slices, one per token) met "TCP lane
    queue-full" rejections with the budget equal to the queue. None: the engine's defaults."""
    kv_checksum: bool = False
    """Every rank runs with ``PDKV_KV_CHECKSUM``: a decode rank checks each room's pages against the
    prefill ranks' checksums before Success (the byte check after it still runs)."""
    backend: str = "mooncake"
    """The transfer engine of every rank (``pdkv.engine.BackendKind``: mooncake or nixl)."""
    ucx_tls: str | None = None
    """NIXL only: ``UCX_TLS`` of every rank (None: UCX's default, cma and tcp on one host)."""
    staging: StagingConfig | None = None
    """Each prefill rank's executor gathers scattered writes (MHA/GQA head slices towards a decode rank
    of a higher TP) into a staging pool of this shape (``pdkv.runtime.staging``); None: no pool."""
    landing: LandingConfig | None = None
    """Each decode rank's landing pool (MHA/GQA heads from prefill ranks of a larger TP land whole and
    are scattered into the pages, ``pdkv.runtime.landing``); None: ``DecodeConfig``'s default pool;
    ``capacity_bytes=0``: off (the head slices are written into the pages one by one)."""
    netns: NetnsLayout | None = None
    """Run prefill ranks (and the registry) in one network namespace and decode ranks in another,
    joined by a veth pair, so a test can partition them (``NetnsLayout.partition``)."""

    def host(self, side: Side) -> str:
        """The address ranks of ``side`` bind and advertise."""
        if self.netns is None:
            return "127.0.0.1"
        return self.netns.prefill_ip if side is Side.PREFILL else self.netns.decode_ip

    def namespace(self, side: Side) -> str | None:
        if self.netns is None:
            return None
        return self.netns.prefill_ns if side is Side.PREFILL else self.netns.decode_ns

    @property
    def policy(self) -> OwnershipPolicy:
        return PageInterleaved(cp_size=self.prefill_cp)

    @property
    def decode_spec(self) -> ModelSpec:
        return self.model if self.decode_model is None else self.decode_model


@attrs.frozen(kw_only=True)
class AbortPlan:
    side: Side = attrs.field(converter=Side)
    after_chunks: int = 1  # abort once this many chunks were sent (prefill) / seen sent (decode: seconds)
    after_s: float = 0.0  # decode side: seconds after init
    after_layers: int | None = None  # prefill side: abort in the middle of that chunk's forward instead


@attrs.frozen(kw_only=True)
class RequestPlan:
    room: RoomId
    tokens: int
    chunk_tokens: tuple[int, ...]
    prefix_tokens: int = 0
    abort: AbortPlan | None = None
    forward_s: float = 0.0
    layer_compute_s: float = 0.0
    """Compute time of each layer of the simulated forward (target and draft layers)."""
    per_layer: bool | None = None
    """Per-layer transfer for this request (None: the cluster's default)."""
    resident_tokens: int = 0
    """Tokens at the start of the first chunk whose KV the prefill side already holds (its own
    prefix cache): the forward does not compute them; per-layer sends them at registration."""

    def __attrs_post_init__(self) -> None:
        if sum(self.chunk_tokens) + self.prefix_tokens != self.tokens:
            raise ValueError(
                f"room {self.room}: chunks {self.chunk_tokens} + prefix {self.prefix_tokens} != {self.tokens}"
            )
        if self.resident_tokens and (self.resident_tokens > self.chunk_tokens[0]):
            raise ValueError(f"room {self.room}: {self.resident_tokens} resident tokens > first chunk")


@attrs.frozen(kw_only=True)
class _PrefillRoom:
    room: RoomId
    num_pages: int
    chunks: tuple[tuple[IntArray, int, bool], ...]  # (logical page ids, start token, last)
    state_src: tuple[tuple[BufferKind, IntArray], ...]
    aux_src: int
    abort_before_chunk: int | None
    abort_after_layers: int | None
    forward_s: float
    layer_compute_s: float
    per_layer: bool
    resident_pages: int


@attrs.frozen(kw_only=True)
class _DecodeRoom:
    room: RoomId
    num_pages: int
    prefix_pages: int
    logical_ids: IntArray
    state_src: tuple[tuple[BufferKind, IntArray], ...]
    aux_src: int
    abort_after_s: float | None


@attrs.frozen(kw_only=True)
class RoomOutcome:
    """One room on one rank."""

    room: int
    side: Side = attrs.field(converter=Side)
    rank: str
    poll: int
    failure: str
    seconds: float
    bytes_checked: int = 0
    mismatches: tuple[str, ...] = ()
    bytes_reported: int = 0
    released_safe: bool = True
    forward_end_at: float = 0.0
    """Prefill: ``time.monotonic()`` when the last chunk's forward ended (one clock for all processes)."""
    finished_at: float = 0.0
    """``time.monotonic()`` when this rank saw the room terminal."""
    mode: str = ""
    """Prefill: how its chunks went: ``per_layer``, ``monolithic`` or ``mixed``."""
    draft_skipped: str = ""
    """Decode: ``receiver.draft_skipped()`` of a successful room, as text ("" when nothing was left out)."""


@attrs.frozen(kw_only=True)
class RankReport:
    side: Side = attrs.field(converter=Side)
    rank: str
    rooms: int
    canary_violations: int
    """Decode: pages of safely released rooms that something wrote into after the release (must be 0)."""
    unsafe_releases: int
    bytes_written: int
    worker_errors: int
    unsafe_canary_violations: int = 0
    """Decode: the same for rooms released after the abort-ack timeout (the risk that release counts)."""
    malformed: int = 0
    """Inbound frame sets the rank's control channel rejected."""
    stale_messages: int = 0
    late_messages: int = 0
    peers_lost: int = 0
    peer_restarts: int = 0
    consensus_lost: str = ""
    """Why the rank's consensus group broke ("" if it never did or there was none)."""
    faults: FaultCounts = attrs.Factory(FaultCounts)
    pages_in_use: int = 0
    """Decode: KV pages, state slots and aux rows still allocated at shutdown (leaked: must be 0)."""
    quarantines: int = 0
    """Decode: rooms quarantined (no AbortAck within ``abort_ack``)."""
    quarantines_proven: int = 0
    """Decode: quarantined rooms released proven (acks after fences, then connections cut)."""
    rooms_verified: int = 0
    """Decode, ``kv_checksum``: rooms whose pages matched the prefill ranks' checksums before Success."""
    checksum_failures: int = 0
    """Decode, ``kv_checksum``: rooms failed on a checksum mismatch."""
    fences: int = 0
    """Prefill: fence writes made before AbortAcks of rooms whose writes failed."""
    writes: int = 0
    """Prefill: chunk writes to decode ranks (one per chunk and destination with bytes)."""
    write_jobs: int = 0
    """Prefill: transfer jobs those writes went in (``writes / write_jobs`` rooms shared a job on average)."""
    staged_writes: int = 0
    """Prefill: writes its staging pool gathered (``ClusterSpec.staging``); 0 without a pool."""
    staging_leased_at_end: int = 0
    """Prefill: staging bytes still leased or quarantined at its final report (must be 0)."""
    rooms_landed: int = 0
    """Decode: rooms whose KV landed in its landing pool and was scattered before Success."""
    landing_leased_at_end: int = 0
    """Decode: landing bytes still leased (or rooms still waiting for a lease) at its final report
    (must be 0)."""
    cpu_s: dict[str, float] = attrs.Factory(dict)
    """CPU seconds from the end of the rank's start-up to its final report, by thread group
    (``_rank.thread_cpu``)."""


class ClusterError(RuntimeError):
    """A rank process failed to start, died, or a room did not finish in time."""


def plan_requests(
    spec: ClusterSpec,
    plans: Sequence[RequestPlan],
    pool: PagePool,
) -> tuple[list[_PrefillRoom], list[_DecodeRoom], list[IntArray]]:
    """Logical page ids (from the prefill instance's CP-aware pool) and per-side room descriptions."""
    page = spec.model.page_size
    prefill_rooms, decode_rooms, allocations = [], [], []
    for i, plan in enumerate(plans):
        num_pages = -(-plan.tokens // page)
        if plan.prefix_tokens % page or plan.resident_tokens % page:
            raise ValueError(f"room {plan.room}: cached prefixes must be page-aligned")
        logical = pool.allocate(num_pages)
        allocations.append(logical)
        chunks = []
        token = plan.prefix_tokens
        for n, size in enumerate(plan.chunk_tokens):
            last = n == len(plan.chunk_tokens) - 1
            end = token + size
            if not last and end % page:
                raise ValueError(f"room {plan.room}: non-last chunk must end on a page boundary")
            first_page = chunk_page_start(token, page)
            end_page = num_pages if last else end // page
            chunks.append((logical[first_page:end_page], token, last))
            token = end
        k = spec.state_slots_per_room
        slots = (np.arange(k, dtype=np.int64) + i * k) % spec.prefill_capacity.state_slots
        state_src = tuple((kind, slots) for kind in spec.model.state_kinds)
        aux_src = i % spec.prefill_capacity.aux_rows
        abort = plan.abort
        prefill_rooms.append(
            _PrefillRoom(
                room=plan.room,
                num_pages=num_pages,
                chunks=tuple(chunks),
                state_src=state_src,
                aux_src=aux_src,
                abort_before_chunk=abort.after_chunks
                if abort is not None and abort.side is Side.PREFILL
                else None,
                abort_after_layers=None
                if abort is None or abort.side is not Side.PREFILL
                else abort.after_layers,
                forward_s=plan.forward_s,
                layer_compute_s=plan.layer_compute_s,
                per_layer=spec.per_layer if plan.per_layer is None else plan.per_layer,
                resident_pages=plan.resident_tokens // page,
            )
        )
        decode_rooms.append(
            _DecodeRoom(
                room=plan.room,
                num_pages=num_pages,
                prefix_pages=plan.prefix_tokens // page,
                logical_ids=logical,
                state_src=state_src,
                aux_src=aux_src,
                abort_after_s=abort.after_s if abort is not None and abort.side is Side.DECODE else None,
            )
        )
    return prefill_rooms, decode_rooms, allocations


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the gloo group and stable addresses)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
