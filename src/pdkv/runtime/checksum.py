"""Per-(buffer, item) checksums of the KV pages, state slots and aux rows a room moves (issue 33).

Owns: the checksum (defined below, normative: both sides compute it alike; ``PageChecksums`` carries
it), the region of an item it covers on each side (``Region``: the whole item, or the KV heads a
prefill rank shares with a decode rank), ``BufferViews`` (one uint8 tensor per registered buffer,
over its registered bytes, on its device), ``Checksummer`` (the kernel: one gather and one block
reduction per buffer, tiled on a CPU to stay in the last-level cache), what a prefill rank computes
for one chunk to one destination (``chunk_checksums``; ``kv_checksums`` for a subset of layers, the
seam for the per-layer path), what a decode rank checks (``verify_room``), and the switch
``PDKV_KV_CHECKSUM``. Pure: no I/O, no threads, no clock. It reads memory the caller says is stable
(a prefill rank's after the forward, or after a layer's ready event; a decode rank's after every
required Success), and never writes it. Must not decide anything about a room: the decode endpoint
fails the room with what ``verify_room`` found.

The checksum of one item
------------------------
An item (a KV page, a state slot, an aux row) is read as rows of bytes, in a canonical order that
does not depend on either side's item layout:

- a whole item (MLA, K/V buffers that describe no heads, state, aux): one row, the item's bytes;
- K/V buffers that describe heads: the heads ``lo .. hi-1`` both ranks hold; one row per token
  ``t`` of the page: heads ``lo .. hi-1`` of token ``t``, one after the other (``head_bytes`` each),
  whether the item is token-major or head-major on either side.

Each row is zero-padded to a multiple of 4 bytes and read as little-endian uint32 words. With ``K``
words per row, a row splits into blocks of ``B = gcd(K, 256)`` words; block ``j`` (numbered over the
item, row after row) sums to ``b_j`` (mod 2**32). With ``m_j = ((2j + 1) * 2654435761) mod 2**31``
(odd), ``S = sum_j m_j * b_j mod 2**32``, and the item's checksum at position ``p`` is
``C = (S + ((p + 1) mod 2**32) * 0x5BD1E995) mod 2**32``. ``p`` is the page's position in the request
(KV), the slot's index in the room's state list (state), 0 (aux).

What it detects: any single flipped bit, always (it moves one ``b_j`` by ``2**k``, so ``S`` by
``2**k * m_j``, never 0 mod 2**32 as ``m_j`` is odd); a zeroed page, another request's page (a stale
write, a wrong view) and two swapped pages, unless both contents have the same checksum (2**-32);
blocks moved inside an item (other ``m_j``). The same bytes at another position check differently.
What it costs: one read of the bytes (a gather into a reused scratch tile and an int32 block sum);
``pdkv bench checksum`` measures the kernel, ``pdkv bench transfer|latency --checksum`` the room.

On a GPU (``device="cuda:N"``): the views wrap the registered device memory
(``__cuda_array_interface__``), each buffer is one gather and one reduction over all the chunk's
pages on the current stream (after ``wait_event(ready)`` when a layer's ready event is given), and
the results come back with one device-to-host copy per call.
"""

from __future__ import annotations

import ctypes
import math
import threading
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Final

import attrs
import numpy as np
import numpy.typing as npt
import torch

from pdkv import config
from pdkv.errors import ConfigError, MappingError
from pdkv.mapping import BufferKey, BufferKind, BufferLayout, BufferSpec, ItemLayout
from pdkv.protocol.effects import ChecksumMismatch, PeerKey
from pdkv.protocol.messages import IntArray, PageChecksums, StateChecksums, StateIndices, SumArray

KV_CHECKSUM: Final = config.declare(
    "PDKV_KV_CHECKSUM",
    "1: checksums per (buffer, page) of what the prefill sends, verified by the decode before Success",
    config.parse_flag,
    "0 or 1",
)


def checksums_from_env(env: Mapping[str, str] | None = None) -> bool:
    """``PDKV_KV_CHECKSUM`` as a bool (unset: False); a ``ConfigError`` naming it for other text."""
    import os

    source = os.environ if env is None else env
    raw = source.get(KV_CHECKSUM.name)
    if raw is None:
        return False
    try:
        return config.parse_flag(raw)
    except ValueError:
        raise ConfigError(f"{KV_CHECKSUM.name}={raw!r} is not {KV_CHECKSUM.unit}") from None


_MASK32: Final = 0xFFFFFFFF
_POSITION_MIX: Final = 0x5BD1E995
_BLOCK_MIX: Final = 2654435761
MAX_BLOCK_WORDS: Final = 256
CPU_TILE_BYTES: Final = 8 << 20
"""A CPU gathers this many bytes of items at a time (the tile stays in the last-level cache for the sum)."""


# ---------------------------------------------------------------- regions


@attrs.frozen
class Region:
    """Which bytes of a buffer's items a checksum reads. ``heads`` None: the whole item. Otherwise the
    heads ``offset .. offset + count - 1`` (of the ``item_heads`` heads, ``head_bytes`` each, that an
    item of this buffer holds for each of ``page_size`` tokens, laid out as ``layout``)."""

    offset: int = 0
    count: int = 0
    item_heads: int = 0
    head_bytes: int = 0
    page_size: int = 0
    layout: ItemLayout = ItemLayout.TOKEN_HEAD
    heads: bool = False

    @classmethod
    def of_heads(cls, spec: BufferSpec, page_size: int, lo: int, hi: int) -> Region:
        """The model heads ``lo .. hi-1`` of ``spec``'s items (which must hold them)."""
        heads = spec.heads
        if heads is None:
            return WHOLE
        if not heads.head_start <= lo < hi <= heads.head_stop:
            raise MappingError(
                f"{spec.describe()} holds heads {heads.head_start}..{heads.head_stop - 1}, not {lo}..{hi - 1}"
            )
        return cls(
            offset=lo - heads.head_start,
            count=hi - lo,
            item_heads=heads.head_count,
            head_bytes=heads.head_bytes,
            page_size=page_size,
            layout=heads.item_layout,
            heads=True,
        )


WHOLE: Final = Region()


def _shared(a: BufferSpec, lo: int, hi: int) -> tuple[int, int]:
    assert a.heads is not None
    return max(a.heads.head_start, lo), min(a.heads.head_stop, hi)


@attrs.frozen
class KvPair:
    """One KV buffer of the destination's layout (``row``: its index among the destination's KV
    buffers) and where a side reads it: buffer ``buffer`` of that side's layout, ``region``."""

    row: int
    buffer: int
    region: Region
    spec: BufferSpec  # the destination's buffer (for names)


def _kv_index(layout: BufferLayout) -> dict[tuple[object, object, int], int]:
    return {(b.model, b.kind, b.layer_id): i for i, b in enumerate(layout.buffers) if b.kind.is_kv}


def sender_kv_pairs(src: BufferLayout, dst: BufferLayout) -> tuple[KvPair, ...]:
    """Every KV buffer of ``dst`` (layout order) with the prefill's buffer that feeds it and the
    region of its items the prefill reads (the heads both hold). Cached per pair of layouts."""
    pairs: tuple[KvPair, ...] = _cached(src, dst, _sender_pairs)
    return pairs


def _sender_pairs(src: BufferLayout, dst: BufferLayout) -> tuple[KvPair, ...]:
    mine = _kv_index(src)
    pairs = []
    for row, spec in enumerate(dst.kv_buffers):
        key = (spec.model, spec.kind, spec.layer_id)
        if key not in mine:
            raise MappingError(f"{spec.describe()} of the destination has no buffer here")
        i = mine[key]
        local = src.buffers[i]
        region = WHOLE
        if local.heads is not None and spec.heads is not None:
            lo, hi = _shared(local, spec.heads.head_start, spec.heads.head_stop)
            region = Region.of_heads(local, src.page_size, lo, hi)
        pairs.append(KvPair(row=row, buffer=i, region=region, spec=spec))
    return tuple(pairs)


def receiver_kv_pairs(layout: BufferLayout, prefill_heads: tuple[int, int] | None) -> tuple[KvPair, ...]:
    """Every KV buffer of this decode rank's ``layout`` and the region a prefill rank holding model
    heads ``prefill_heads = (lo, hi)`` wrote into its items (None: it holds them all / no heads)."""
    pairs = []
    index = _kv_index(layout)
    for row, spec in enumerate(layout.kv_buffers):
        region = WHOLE
        if spec.heads is not None:
            lo, hi = (spec.heads.head_start, spec.heads.head_stop) if prefill_heads is None else prefill_heads
            lo, hi = _shared(spec, lo, hi)
            region = Region.of_heads(spec, layout.page_size, lo, hi)
        pairs.append(
            KvPair(row=row, buffer=index[(spec.model, spec.kind, spec.layer_id)], region=region, spec=spec)
        )
    return tuple(pairs)


_cache_lock = threading.Lock()
_cache: dict[tuple[int, int], tuple[weakref.ref[BufferLayout], weakref.ref[BufferLayout], Any]] = {}


def _cached(a: BufferLayout, b: BufferLayout, make: Callable[[BufferLayout, BufferLayout], Any]) -> Any:
    key = (id(a), id(b))
    hit = _cache.get(key)
    if hit is not None and hit[0]() is a and hit[1]() is b:
        return hit[2]
    value = make(a, b)
    with _cache_lock:
        if len(_cache) >= 256:
            _cache.clear()
        _cache[key] = (weakref.ref(a), weakref.ref(b), value)
    return value


# ---------------------------------------------------------------- views of registered memory


class _CudaArray:
    """A raw device range as torch reads it (``torch.as_tensor`` takes ``__cuda_array_interface__``)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


class BufferViews:
    """Every buffer of ``layout`` as a uint8 tensor ``(num_items, item_bytes)`` over its registered
    bytes, on ``device`` (``"cpu"``, or ``"cuda:N"`` where the buffers live in that GPU's memory).

    Built from the layout's addresses (what the scheduler registered: ``BufferLayout.from_tensors``
    took them from its tensors, so a view indexes the same items the scheduler's tensor does), lazily,
    one buffer at a time. ``tensors`` (optional, by buffer index) gives the scheduler's own tensors
    instead; each must cover exactly its buffer's bytes."""

    def __init__(
        self, layout: BufferLayout, device: str = "cpu", *, tensors: Mapping[int, torch.Tensor] | None = None
    ) -> None:
        self.layout = layout
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"checksum device {device!r} is not a torch device: {exc}") from None
        if self.device.type not in ("cpu", "cuda"):
            raise ConfigError(f"checksum device {device!r}: only cpu and cuda buffers are read")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"checksum device {device!r}: torch has no CUDA here")
        self._views: dict[int, torch.Tensor] = {}
        self._keep: dict[int, object] = {}
        self._lock = threading.Lock()
        for index, tensor in (tensors or {}).items():
            spec = layout.buffers[index]
            nbytes = tensor.numel() * tensor.element_size()
            if tensor.data_ptr() != spec.base_ptr or nbytes != spec.length:
                raise ConfigError(f"{spec.describe()}: the tensor given is not the registered buffer")
            flat = tensor.detach().reshape(-1).view(torch.uint8)
            self._views[index] = flat.view(spec.num_items, spec.item_bytes)

    def __getitem__(self, index: int) -> torch.Tensor:
        view = self._views.get(index)
        if view is not None:
            return view
        with self._lock:
            view = self._views.get(index)
            if view is None:
                view = self._views[index] = self._wrap(index)
        return view

    def _wrap(self, index: int) -> torch.Tensor:
        spec = self.layout.buffers[index]
        if spec.length == 0:
            return torch.zeros((0, spec.item_bytes), dtype=torch.uint8, device=self.device)
        if self.device.type == "cuda":  # pragma: no cover - needs a GPU (pdkv bench checksum on one)
            raw = _CudaArray(spec.base_ptr, spec.length)
            flat = torch.as_tensor(raw, device=self.device)
        else:
            buffer = (ctypes.c_uint8 * spec.length).from_address(spec.base_ptr)
            self._keep[index] = buffer
            flat = torch.frombuffer(buffer, dtype=torch.uint8)
        return flat.view(spec.num_items, spec.item_bytes)


# ---------------------------------------------------------------- the kernel


class Checksummer:
    """Computes checksums of items of a layout's buffers (the definition in the module docstring).

    Thread-safe: each thread has its own scratch tile. On a CPU a buffer's items are gathered in
    tiles of at most ``CPU_TILE_BYTES`` (a loop over tiles, not pages: each tile is one gather and one
    reduction); on a GPU every buffer's items are one tile."""

    def __init__(self, views: BufferViews) -> None:
        self.views = views
        self.device = views.device
        self._local = threading.local()
        self._weights: dict[int, torch.Tensor] = {}

    @classmethod
    def of(cls, layout: BufferLayout, device: str = "cpu") -> Checksummer:
        return cls(BufferViews(layout, device))

    def sums(
        self,
        buffer: int,
        region: Region,
        items: IntArray,
        positions: IntArray,
        *,
        ready: Any = None,
    ) -> SumArray:
        """The checksums of items ``items`` of buffer ``buffer`` (read as ``region``) at ``positions``."""
        row: SumArray = self.many([(buffer, region)], items, positions, ready=ready)[0]
        return row

    def many(
        self,
        pairs: Sequence[tuple[int, Region]],
        items: IntArray,
        positions: IntArray,
        *,
        ready: Any = None,
    ) -> npt.NDArray[np.uint32]:
        """``(len(pairs), len(items))`` checksums: the same items and positions in every buffer of
        ``pairs``. ``ready``: a CUDA event the reads wait for (a layer's ready event)."""
        items = np.asarray(items, dtype=np.int64)
        positions = np.asarray(positions, dtype=np.int64)
        if items.shape != positions.shape or items.ndim != 1:
            raise MappingError(f"{items.size} items and {positions.size} positions for checksums")
        n = int(items.size)
        if not pairs or n == 0:
            return np.zeros((len(pairs), n), dtype=np.uint32)
        if self.device.type == "cuda" and ready is not None:  # pragma: no cover - needs a GPU
            torch.cuda.current_stream(self.device).wait_event(ready)
        index_all = torch.tensor(items, dtype=torch.int64, device=self.device)  # copies: may be read-only
        pos_all = torch.tensor(positions, dtype=torch.int64, device=self.device)
        lo, hi = int(items.min()), int(items.max())
        out = torch.empty((len(pairs), n), dtype=torch.int64, device=self.device)
        # Buffers whose items have the same size and region are reduced together: their items are
        # gathered into one tile (row g * n + i: buffer g's item i), one reduction per tile, so a room
        # of few pages costs one gather per buffer and a few reductions, not a reduction per buffer.
        groups: dict[tuple[int, Region], list[int]] = {}
        for row, (buffer, region) in enumerate(pairs):
            view = self.views[buffer]
            if lo < 0 or hi >= view.shape[0]:
                spec = self.views.layout.buffers[buffer]
                raise MappingError(f"{spec.describe()}: items {lo}..{hi} outside its {view.shape[0]} items")
            groups.setdefault((int(view.shape[1]), region), []).append(row)
        for (width, region), rows in groups.items():
            total = len(rows) * n
            step = total if self.device.type == "cuda" else max(1, CPU_TILE_BYTES // max(1, width))
            flat = torch.empty(total, dtype=torch.int64, device=self.device)
            for start in range(0, total, step):
                stop = min(total, start + step)
                tile = self._scratch(stop - start, width)
                for g in range(start // n, (stop - 1) // n + 1):  # each buffer's share of the tile
                    i, j = max(start, g * n) - g * n, min(stop, (g + 1) * n) - g * n
                    at = g * n + i - start
                    self._gather_into(self.views[pairs[rows[g]][0]], index_all[i:j], tile[at : at + j - i])
                where = torch.arange(start, stop, device=self.device) % n
                flat[start:stop] = self._checksum(_rows(tile, region), pos_all[where])
            out[torch.tensor(rows, device=self.device)] = flat.view(len(rows), n)
        sums: npt.NDArray[np.uint32] = out.cpu().numpy().astype(np.uint32)
        return sums

    def _scratch(self, n: int, width: int) -> torch.Tensor:
        """This thread's scratch tile as ``(n, width)`` (reused: no allocation per call, which on a
        CPU would fault fresh pages in at a fraction of memory bandwidth)."""
        need = n * width
        scratch = getattr(self._local, "scratch", None)
        if scratch is None or scratch.numel() < need or scratch.device != self.device:
            scratch = torch.empty(max(need, 1 << 16), dtype=torch.uint8, device=self.device)
            self._local.scratch = scratch
        return scratch[:need].view(n, width)

    @staticmethod
    def _gather_into(view: torch.Tensor, index: torch.Tensor, tile: torch.Tensor) -> None:
        """Items ``index`` of ``view`` into ``tile`` (whole 8-byte words when they fit: a memcpy per row)."""
        if view.shape[1] % 8 == 0:
            torch.index_select(view.view(torch.int64), 0, index, out=tile.view(torch.int64))
        else:
            torch.index_select(view, 0, index, out=tile)

    def _checksum(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The definition over ``rows`` (n, rows per item, bytes per row), uint8, any strides."""
        n, row_count, row_bytes = rows.shape
        if row_bytes % 4:
            padded = rows.new_zeros((n, row_count, row_bytes + 4 - row_bytes % 4))
            padded[:, :, :row_bytes] = rows
            rows = padded
        words = _words(rows)
        k = words.shape[2]
        block = math.gcd(k, MAX_BLOCK_WORDS)
        blocks = words.view(n, row_count, k // block, block).sum(-1, dtype=torch.int32)  # wraps mod 2**32
        b = blocks.reshape(n, -1).to(torch.int64) & _MASK32
        s = ((b * self._weight(b.shape[1])) & _MASK32).sum(-1) & _MASK32
        out: torch.Tensor = (s + ((positions + 1) & _MASK32) * _POSITION_MIX) & _MASK32
        return out

    def _weight(self, blocks: int) -> torch.Tensor:
        m = self._weights.get(blocks)
        if m is None:
            j = torch.arange(blocks, dtype=torch.int64)
            m = (((2 * j + 1) * _BLOCK_MIX) % (1 << 31)).to(self.device)
            self._weights[blocks] = m
        return m


def _rows(tile: torch.Tensor, region: Region) -> torch.Tensor:
    """The canonical rows of ``region`` in a tile of whole items ``(n, item_bytes)``."""
    n = tile.shape[0]
    if not region.heads:
        return tile.unsqueeze(1)
    t, h, c, hb = region.page_size, region.item_heads, region.count, region.head_bytes
    if region.layout is ItemLayout.TOKEN_HEAD:
        return tile.view(n, t, h * hb)[:, :, region.offset * hb : (region.offset + c) * hb]
    heads = tile.view(n, h, t, hb)[:, region.offset : region.offset + c]
    return heads.permute(0, 2, 1, 3).reshape(n, t, c * hb)


def _words(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (uint8, rows a multiple of 4 bytes) as int32 words, without a copy where the strides allow."""
    if rows.stride(2) == 1 and all(s % 4 == 0 for s in rows.stride()[:2]) and rows.storage_offset() % 4 == 0:
        try:
            return rows.view(torch.int32)
        except RuntimeError:
            pass
    return rows.contiguous().view(torch.int32)


# ---------------------------------------------------------------- what a prefill rank sends


@attrs.frozen(kw_only=True)
class ChunkSources:
    """What one chunk writes to one destination, as a checksum needs it (``ChunkPlan`` says it)."""

    kv_src: IntArray  # this rank's pages, by position
    kv_positions: IntArray
    state: tuple[tuple[BufferKind, IntArray], ...] = ()  # source slots written, per kind (clipped)
    aux_src: int | None = None  # the aux row written (None: none)


def kv_checksums(
    summer: Checksummer,
    src_layout: BufferLayout,
    dst_layout: BufferLayout,
    src_pages: IntArray,
    positions: IntArray,
    *,
    rows: Sequence[int] | None = None,
    ready: Any = None,
) -> npt.NDArray[np.uint32]:
    """KV checksums of ``src_pages`` at ``positions`` for the destination's KV buffers ``rows``
    (indices into its KV buffers; None: all), shape ``(len(rows), len(positions))``.

    The per-layer path's seam: after layer L's ready event, the rows of layer L's buffers
    (``kv_rows(dst_layout, model, layer)``), then ``chunk_checksums(..., kv=...)`` fills the rest."""
    pairs = sender_kv_pairs(src_layout, dst_layout)
    chosen = pairs if rows is None else [pairs[r] for r in rows]
    sums: npt.NDArray[np.uint32] = summer.many(
        [(p.buffer, p.region) for p in chosen], src_pages, positions, ready=ready
    )
    return sums


def kv_rows(layout: BufferLayout, model: object, layer: int) -> tuple[int, ...]:
    """Indices among ``layout``'s KV buffers of the buffers of one layer of one model."""
    return tuple(i for i, b in enumerate(layout.kv_buffers) if b.model is model and b.layer_id == layer)


def chunk_checksums(
    summer: Checksummer,
    sources: ChunkSources,
    src_layout: BufferLayout,
    dst_layout: BufferLayout,
    *,
    kv: npt.NDArray[np.uint32] | None = None,
) -> PageChecksums:
    """The checksums of one chunk to one destination: its KV pages in every KV buffer, the state
    slots and aux row it writes. ``kv``: the KV part already computed (the per-layer path), whole."""
    if kv is None:
        kv = kv_checksums(summer, src_layout, dst_layout, sources.kv_src, sources.kv_positions)
    state = []
    for kind, slots in sources.state:
        mine = {(b.model, b.layer_id): i for i, b in enumerate(src_layout.buffers) if b.kind is kind}
        buffers = [
            mine[(b.model, b.layer_id)] for b in dst_layout.select(kind) if (b.model, b.layer_id) in mine
        ]
        positions = np.arange(slots.size, dtype=np.int64)
        sums = summer.many([(i, WHOLE) for i in buffers], slots, positions)
        state.append(StateChecksums(kind=kind, count=int(slots.size), sums=sums.ravel()))
    aux: npt.NDArray[np.uint32] = np.zeros(0, dtype=np.uint32)
    if sources.aux_src is not None:
        mine = {
            (b.model, b.layer_id): i for i, b in enumerate(src_layout.buffers) if b.kind is BufferKind.AUX
        }
        buffers = [
            mine[(b.model, b.layer_id)] for b in dst_layout.aux_buffers if (b.model, b.layer_id) in mine
        ]
        row = np.array([sources.aux_src], dtype=np.int64)
        aux = summer.many([(i, WHOLE) for i in buffers], row, np.zeros(1, dtype=np.int64)).ravel()
    return PageChecksums(positions=sources.kv_positions, kv=kv.ravel(), state=state, aux=aux)


class ChecksumBook:
    """A prefill rank's checksums per (room, decode endpoint), chunk by chunk, until the room's
    Success status takes them (``status_checksums``; kept for a status sent again) and the room is
    forgotten (``forget``). Thread-safe (its own lock: transfer workers add, the control path reads).

    The per-layer seam: ``add_layer(room, endpoint, start_token, positions, rows, sums)`` records the
    KV rows of one layer of a per-layer chunk as its ready event passed (``kv_checksums(...,
    rows=kv_rows(dst_layout, model, layer), ready=event)``); ``layered_missing`` says which rows a
    finished chunk still lacks, and ``finish_layers`` turns the chunk's rows into its KV part."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._enabled: set[int] = set()  # rooms opened while checksums were on
        self._parts: dict[tuple[int, str], list[PageChecksums]] = {}
        self._layered: dict[
            tuple[int, str, int], tuple[IntArray, npt.NDArray[np.uint32], npt.NDArray[np.bool_]]
        ] = {}

    def enable(self, room: int) -> None:
        """Checksums for ``room`` (``sender.init`` while they are on): every chunk of it, whatever
        the switch says later, so a status never carries the checksums of only some chunks."""
        with self._lock:
            self._enabled.add(room)

    def enabled(self, room: int) -> bool:
        return room in self._enabled

    def add(self, room: int, endpoint: str, part: PageChecksums) -> None:
        with self._lock:
            self._parts.setdefault((room, endpoint), []).append(part)

    def add_layer(
        self,
        room: int,
        endpoint: str,
        start_token: int,
        positions: IntArray,
        rows: Sequence[int],
        sums: npt.NDArray[np.uint32],
        *,
        kv_buffers: int,
    ) -> None:
        key = (room, endpoint, start_token)
        with self._lock:
            entry = self._layered.get(key)
            if entry is None:
                matrix = np.zeros((kv_buffers, positions.size), dtype=np.uint32)
                entry = (np.asarray(positions, dtype=np.int64), matrix, np.zeros(kv_buffers, dtype=np.bool_))
                self._layered[key] = entry
            entry[1][list(rows)] = sums
            entry[2][list(rows)] = True

    def layered_missing(self, room: int, endpoint: str, start_token: int, kv_buffers: int) -> tuple[int, ...]:
        """KV rows (of the destination's KV buffers) not recorded for the chunk (all when none was)."""
        with self._lock:
            entry = self._layered.get((room, endpoint, start_token))
        if entry is None:
            return tuple(range(kv_buffers))
        return tuple(int(i) for i in np.flatnonzero(~entry[2]))

    def finish_layers(
        self,
        room: int,
        endpoint: str,
        start_token: int,
        positions: IntArray,
        rows: Sequence[int],
        sums: npt.NDArray[np.uint32],
        *,
        kv_buffers: int,
    ) -> None:
        """The chunk's last rows (computed now), and the whole chunk becomes one KV part."""
        if rows:
            self.add_layer(room, endpoint, start_token, positions, rows, sums, kv_buffers=kv_buffers)
        with self._lock:
            entry = self._layered.pop((room, endpoint, start_token), None)
        if entry is not None and entry[0].size:
            self.add(room, endpoint, PageChecksums(positions=entry[0], kv=entry[1].ravel()))

    def status_checksums(self, room: int, endpoint: str) -> PageChecksums | None:
        """Everything recorded for the room towards ``endpoint``, as one ``PageChecksums`` (positions
        in order whichever worker finished which chunk first); None when nothing was."""
        with self._lock:
            parts = list(self._parts.get((room, endpoint), ()))
        if not parts:
            return None
        return combine_parts(parts)

    def forget(self, room: int) -> None:
        with self._lock:
            self._enabled.discard(room)
            for key in [k for k in self._parts if k[0] == room]:
                del self._parts[key]
            for lkey in [k for k in self._layered if k[0] == room]:
                del self._layered[lkey]

    def rooms(self) -> int:
        with self._lock:
            return len({k[0] for k in self._parts})


def combine_parts(parts: Sequence[PageChecksums]) -> PageChecksums:
    """Chunks' checksums of one room to one destination as one, KV positions sorted (chunks may end
    in any order on several workers); ``ValueError`` when a position repeats."""
    with_kv = [p for p in parts if p.positions.size]
    if len({p.kv_buffers for p in with_kv}) > 1:
        raise ValueError(
            f"chunks checksum different numbers of KV buffers: {sorted({p.kv_buffers for p in with_kv})}"
        )
    if with_kv:
        positions = np.concatenate([p.positions for p in with_kv])
        matrix = np.concatenate([p.kv_matrix() for p in with_kv], axis=1)
        order = np.argsort(positions, kind="stable")
        positions, matrix = positions[order], matrix[:, order]
    else:
        positions, matrix = np.zeros(0, dtype=np.int64), np.zeros((0, 0), dtype=np.uint32)
    state = tuple(s for p in parts for s in p.state)
    aux = next((p.aux for p in reversed(parts) if p.aux.size), np.zeros(0, dtype=np.uint32))
    return PageChecksums(positions=positions, kv=matrix.ravel(), state=state, aux=aux)


# ---------------------------------------------------------------- what a decode rank checks


@attrs.frozen(kw_only=True)
class RoomPages:
    """A decode room's destinations, as ``verify_room`` reads them."""

    dst_pages: IntArray
    prefix_pages: int
    dst_state: tuple[StateIndices, ...] = ()
    dst_aux_row: int | None = None


def verify_room(
    summer: Checksummer,
    room: RoomPages,
    reports: Mapping[PeerKey, PageChecksums | None],
    *,
    prefill_heads: Callable[[PeerKey], tuple[int, int] | None],
    left_out: Mapping[PeerKey, Collection[BufferKey]] | None = None,
) -> ChecksumMismatch | None:
    """Check a room's pages against every required prefill rank's checksums; None when all agree.
    ``left_out``: per rank, this rank's buffers its registration leaves out (draft-model buffers a
    rolling deployment does not transfer): that rank wrote and checksummed the others only.

    For each rank: its KV positions (inside ``[prefix_pages, len(dst_pages))``) in every KV buffer,
    read as the heads it shares with this rank (``prefill_heads(rank)``: the model heads it holds,
    None for all), its state slots (the first ``count`` of this rank's slots of each kind) and the aux
    row. Then coverage: every position of the room must be in some rank's checksums. The first
    mismatch found (rank by rank, buffer by buffer, lowest position first) is returned, with how many
    entries differ in all.
    """
    layout = summer.views.layout
    first: ChecksumMismatch | None = None
    bad = 0
    covered = np.zeros(room.dst_pages.size, dtype=np.bool_)
    covered[: room.prefix_pages] = True
    for key in sorted(reports, key=_peer_order):
        report = reports[key]
        who = f"{key[0]}:{key[1]}"
        if report is None:
            return _structural(who, f"prefill {who} sent no checksums (is PDKV_KV_CHECKSUM set there?)")
        gone = set(left_out.get(key, ())) if left_out else set()

        def kept(specs: Sequence[BufferSpec], gone: set[BufferKey] = gone) -> list[BufferSpec]:
            return [b for b in specs if BufferKey.of(b) not in gone]

        pairs = [p for p in receiver_kv_pairs(layout, prefill_heads(key)) if BufferKey.of(p.spec) not in gone]
        problem = _shape_problem(layout, room, report, kv_buffers=len(pairs), kept=kept)
        if problem is not None:
            return _structural(who, f"checksums from prefill {who} do not fit this rank: {problem}")
        positions = report.positions
        covered[positions] = True
        got = summer.many([(p.buffer, p.region) for p in pairs], room.dst_pages[positions], positions)
        diff = got != report.kv_matrix()
        if diff.any():
            bad += int(diff.sum())
            row, col = _first_true(diff)
            if first is None:
                spec = pairs[row].spec
                first = _mismatch(
                    who, spec, "position", int(positions[col]), int(room.dst_pages[positions[col]])
                )
        wanted = {s.kind: s.indices for s in room.dst_state}
        for state in report.state:
            specs = kept(layout.select(state.kind))
            slots = wanted[state.kind][: state.count]
            got = summer.many(
                [(layout.buffers.index(s), WHOLE) for s in specs],
                slots,
                np.arange(state.count, dtype=np.int64),
            )
            diff = got.ravel() != state.sums
            if diff.any():
                bad += int(diff.sum())
                at = int(np.flatnonzero(diff)[0])
                row, col = divmod(at, state.count)
                if first is None:
                    first = _mismatch(who, specs[row], "state slot", col, int(slots[col]))
        if report.aux.size and room.dst_aux_row is not None:
            specs = kept(layout.aux_buffers)
            row_index = np.array([room.dst_aux_row], dtype=np.int64)
            got = summer.many(
                [(layout.buffers.index(s), WHOLE) for s in specs], row_index, np.zeros(1, np.int64)
            )
            diff = got.ravel() != report.aux
            if diff.any():
                bad += int(diff.sum())
                if first is None:
                    first = _mismatch(
                        who, specs[int(np.flatnonzero(diff)[0])], "aux row", None, room.dst_aux_row
                    )
    if first is not None:
        return attrs.evolve(first, entries=bad, detail=f"{first.detail} ({bad} checksum(s) differ in all)")
    missing = np.flatnonzero(~covered)
    if missing.size:
        p = int(missing[0])
        return ChecksumMismatch(
            prefill=None,
            buffer=None,
            layer=None,
            position=p,
            dst_index=int(room.dst_pages[p]),
            entries=int(missing.size),
            detail=(
                f"position {p} (decode page {int(room.dst_pages[p])}) is in no prefill rank's checksums "
                f"({missing.size} position(s) uncovered): a page that was never written"
            ),
        )
    return None


def _shape_problem(
    layout: BufferLayout,
    room: RoomPages,
    report: PageChecksums,
    *,
    kv_buffers: int,
    kept: Callable[[Sequence[BufferSpec]], list[BufferSpec]],
) -> str | None:
    """What makes ``report`` not a report for this rank's room (``kv_buffers``: the KV buffers the
    rank writes here; ``kept``: this rank's buffers of a kind that it writes), or None."""
    n = room.dst_pages.size
    positions = report.positions
    if positions.size and (int(positions[0]) < room.prefix_pages or int(positions[-1]) >= n):
        return (
            f"positions {int(positions[0])}..{int(positions[-1])} outside the room's "
            f"{room.prefix_pages}..{n - 1}"
        )
    if positions.size and report.kv_buffers != kv_buffers:
        return f"{report.kv_buffers} KV buffers checksummed, this rank receives {kv_buffers}"
    wanted = {s.kind: s.indices.size for s in room.dst_state}
    for state in report.state:
        if state.kind not in wanted or state.count > wanted[state.kind]:
            has = wanted.get(state.kind, 0)
            return f"{state.count} {state.kind.value} slots checksummed, the room has {has}"
        buffers = len(kept(layout.select(state.kind)))
        if state.count and state.sums.size != buffers * state.count:
            sent = state.sums.size // state.count
            return f"{sent} {state.kind.value} buffers checksummed, this rank has {buffers}"
    aux_buffers = len(kept(layout.aux_buffers))
    if report.aux.size and report.aux.size != aux_buffers:
        return f"{report.aux.size} aux buffers checksummed, this rank receives {aux_buffers}"
    return None


def _first_true(diff: npt.NDArray[np.bool_]) -> tuple[int, int]:
    """(row, column) of the lowest column with a True, then the lowest row there (positions first)."""
    cols = np.flatnonzero(diff.any(axis=0))
    col = int(cols[0])
    return int(np.flatnonzero(diff[:, col])[0]), col


def _mismatch(who: str, spec: BufferSpec, what: str, index: int | None, dst: int) -> ChecksumMismatch:
    where = f"{what} {index}" if index is not None else what
    return ChecksumMismatch(
        prefill=who,
        buffer=spec.describe(),
        layer=spec.layer_id,
        position=index,
        dst_index=dst,
        entries=1,
        detail=(
            f"checksum mismatch in {spec.describe()} at {where} (decode item {dst}) written by prefill {who}"
        ),
    )


def _structural(who: str, detail: str) -> ChecksumMismatch:
    return ChecksumMismatch(
        prefill=who, buffer=None, layer=None, position=None, dst_index=None, entries=0, detail=detail
    )


def _peer_order(key: PeerKey) -> tuple[str, int, int]:
    return (key[0], key[1].tp, key[1].cp)


__all__ = [
    "CPU_TILE_BYTES",
    "KV_CHECKSUM",
    "WHOLE",
    "BufferViews",
    "Checksummer",
    "ChunkSources",
    "KvPair",
    "Region",
    "RoomPages",
    "checksums_from_env",
    "chunk_checksums",
    "combine_parts",
    "kv_checksums",
    "kv_rows",
    "receiver_kv_pairs",
    "sender_kv_pairs",
    "verify_room",
]
