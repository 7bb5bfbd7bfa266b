"""Buffer layouts: which registered regions a rank holds, described as plain data.

Owns: ``BufferSpec`` / ``BufferLayout`` (kind, model, layer id, base address, length, bytes per item)
and the layout comparison used at registration. Must not import torch or do I/O: ``from_tensors``
accepts anything with ``data_ptr()``, ``numel()``, ``element_size()``, ``is_contiguous()``, ``dim()`` and
``size(d)`` (torch tensors qualify) and refuses a tensor that does not describe its bytes truthfully.

Items: for KV buffers an item is one page (``page_size`` tokens); for state buffers one state slot
(page-indexed state such as SWA or NSA index K/scale uses its own index space); for aux one row.

Heads (MHA/GQA K and V buffers, optional): ``HeadGeometry`` says which of the model's KV heads a
rank's buffer holds and how a page item is laid out (``ItemLayout``): token-major
``[page_size][head_count][head_bytes]`` (SGLang's token pool, vLLM NHD) or head-major
``[head_count][page_size][head_bytes]`` (vLLM HND). With it, ``item_bytes`` must equal
``page_size * head_count * head_bytes``, and two layouts compare by model head count and bytes per
head instead of bytes per item, so prefill and decode instances of different TP sizes can register.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping, Sequence
from typing import Protocol

import attrs

from pdkv.errors import LayoutError, LayoutMismatchError


class BufferKind(enum.Enum):
    """What a registered region holds. The order of kinds is the canonical order of a layout."""

    KV = "kv"  # MLA latent KV: one buffer per layer
    K = "k"  # MHA keys: one buffer per layer
    V = "v"  # MHA values: one buffer per layer
    INDEX_K = "index_k"  # NSA/DSA indexer keys (state, only on layers that keep an index)
    INDEX_SCALE = "index_scale"  # NSA/DSA indexer scales
    SWA = "swa"  # sliding-window attention state pages
    AUX = "aux"  # per-request metadata rows (first token, room stamp ...)

    # Hashed by identity, in C (members are singletons): layouts look buffers up by kind on every
    # plan, and enum.Enum's own __hash__ is a Python call.
    __hash__ = object.__hash__

    @property
    def is_kv(self) -> bool:
        return self in _KV_KINDS

    @property
    def is_state(self) -> bool:
        return self in _STATE_KINDS


_KV_KINDS = frozenset({BufferKind.KV, BufferKind.K, BufferKind.V})
_STATE_KINDS = frozenset({BufferKind.INDEX_K, BufferKind.INDEX_SCALE, BufferKind.SWA})


class ModelRole(enum.Enum):
    """Target model, or the draft model of speculative decoding (its buffers come after the target's)."""

    TARGET = "target"
    DRAFT = "draft"

    __hash__ = object.__hash__  # as BufferKind's


class AttentionKind(enum.Enum):
    MLA = "mla"  # latent KV replicated across TP ranks
    MHA = "mha"  # K and V split by heads across TP ranks


class ItemLayout(enum.Enum):
    """Byte order inside one KV page item of an MHA/GQA buffer (``head_bytes`` = head_dim x dtype size)."""

    TOKEN_HEAD = "token_head"  # [page_size tokens][head_count heads][head_bytes]: token-major
    HEAD_TOKEN = "head_token"  # [head_count heads][page_size tokens][head_bytes]: head-major


class TensorLike(Protocol):
    """The part of a torch tensor that a layout needs (keeps this module free of torch)."""

    def data_ptr(self) -> int: ...
    def numel(self) -> int: ...
    def element_size(self) -> int: ...


class LayoutTensor(TensorLike, Protocol):
    """What ``BufferLayout.from_tensors`` reads of a tensor to check that it describes its bytes."""

    def is_contiguous(self) -> bool: ...
    def dim(self) -> int: ...
    def size(self, dim: int) -> int: ...


_MAX = 2**63 - 1  # addresses and sizes are signed 64-bit on the wire and in numpy


def _non_negative(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX:
        raise LayoutError(
            f"{attribute.name} must be an int in [0, 2**63), got {value!r}", field=attribute.name
        )


def _positive(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= _MAX:
        raise LayoutError(
            f"{attribute.name} must be an int in [1, 2**63), got {value!r}", field=attribute.name
        )


@attrs.frozen(kw_only=True)
class HeadGeometry:
    """The KV heads one rank's K or V buffer holds: model heads ``head_start .. head_start + head_count - 1``.

    ``kv_heads`` is the model's KV head count (all ranks); ``head_bytes`` the bytes of one head of one
    token (head_dim x dtype size); ``item_layout`` the byte order inside a page item. Under GQA with
    fewer KV heads than TP ranks a rank holds one head that other ranks hold too (a replica).
    """

    kv_heads: int = attrs.field(validator=_positive)
    head_start: int = attrs.field(validator=_non_negative)
    head_count: int = attrs.field(validator=_positive)
    head_bytes: int = attrs.field(validator=_positive)
    item_layout: ItemLayout = attrs.field(
        default=ItemLayout.TOKEN_HEAD, validator=attrs.validators.instance_of(ItemLayout)
    )

    def __attrs_post_init__(self) -> None:
        if self.head_start + self.head_count > self.kv_heads:
            raise LayoutError(
                f"heads {self.head_start}..{self.head_start + self.head_count - 1} are outside the "
                f"model's {self.kv_heads} KV heads",
                field="head_start",
            )

    @property
    def head_stop(self) -> int:
        return self.head_start + self.head_count

    def item_bytes(self, page_size: int) -> int:
        """Bytes of one page item holding these heads."""
        return page_size * self.head_count * self.head_bytes

    @property
    def model_signature(self) -> tuple[int, int]:
        """What both sides must agree on (the rank's own head range may differ): (kv_heads, head_bytes)."""
        return (self.kv_heads, self.head_bytes)

    def describe(self) -> str:
        return (
            f"{self.kv_heads} KV heads x {self.head_bytes} B, heads {self.head_start}..{self.head_stop - 1}, "
            f"{self.item_layout.value}"
        )


@attrs.frozen(kw_only=True)
class BufferSpec:
    """One registered region. ``length`` is a whole number of items of ``item_bytes`` each."""

    kind: BufferKind = attrs.field(validator=attrs.validators.instance_of(BufferKind))
    model: ModelRole = attrs.field(validator=attrs.validators.instance_of(ModelRole))
    layer_id: int = attrs.field(validator=_non_negative)
    base_ptr: int = attrs.field(validator=_non_negative)
    length: int = attrs.field(validator=_non_negative)
    item_bytes: int = attrs.field(validator=_positive)
    heads: HeadGeometry | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(HeadGeometry))
    )
    """MHA/GQA K and V buffers only: the heads this rank holds (None: not described, equal TP only)."""

    def __attrs_post_init__(self) -> None:
        if self.heads is not None and self.kind not in (BufferKind.K, BufferKind.V):
            raise LayoutError(f"{self.describe()}: only K and V buffers describe heads", field="heads")
        if self.length % self.item_bytes:
            raise LayoutError(
                f"{self.describe()}: length {self.length} is not a multiple of item_bytes {self.item_bytes}",
                field="length",
            )

    def describe(self) -> str:
        """``target kv layer 3``: how errors and logs name the buffer."""
        return f"{self.model.value} {self.kind.value} layer {self.layer_id}"

    @property
    def num_items(self) -> int:
        return self.length // self.item_bytes

    @property
    def signature(self) -> tuple[str, str, int, int]:
        """What both sides must agree on (addresses and capacities may differ)."""
        return (self.kind.value, self.model.value, self.layer_id, self.item_bytes)


def _spec_tuple(value: Sequence[BufferSpec]) -> tuple[BufferSpec, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class BufferLayout:
    """All regions of one rank, in canonical order: target before draft, then by kind, then layer."""

    attention: AttentionKind = attrs.field(validator=attrs.validators.instance_of(AttentionKind))
    page_size: int = attrs.field(validator=_positive)
    buffers: tuple[BufferSpec, ...] = attrs.field(converter=_spec_tuple)
    # Derived from ``buffers`` once, in __attrs_post_init__ (the layout is immutable, so they cannot go
    # stale): the transfer path reads them for every request and chunk, and rebuilding them meant a
    # pass over every buffer each time. Not part of equality, hashing or repr.
    _by_kind: Mapping[BufferKind, tuple[BufferSpec, ...]] = attrs.field(init=False, eq=False, repr=False)
    _kv: tuple[BufferSpec, ...] = attrs.field(init=False, eq=False, repr=False)
    _state: tuple[BufferSpec, ...] = attrs.field(init=False, eq=False, repr=False)
    _min_items: Mapping[BufferKind, int] = attrs.field(init=False, eq=False, repr=False)
    _min_kv_items: int = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        keys = [(b.model, b.kind, b.layer_id) for b in self.buffers]
        if len(set(keys)) != len(keys):
            twice = sorted(
                {f"{m.value} {k.value} layer {i}" for m, k, i in keys if keys.count((m, k, i)) > 1}
            )
            raise LayoutError(
                f"a layout lists the same (model, kind, layer) twice: {', '.join(twice)}", field="buffers"
            )
        if keys != sorted(keys, key=_canonical_key):
            raise LayoutError("buffers must be in canonical order (use BufferLayout.build)", field="buffers")
        for b in self.buffers:
            if b.heads is None:
                continue
            if self.attention is not AttentionKind.MHA:
                raise LayoutError(f"{b.describe()}: only MHA layouts describe heads", field="heads")
            if b.item_bytes != b.heads.item_bytes(self.page_size):
                raise LayoutError(
                    f"{b.describe()}: item_bytes {b.item_bytes} != page_size {self.page_size} x "
                    f"{b.heads.head_count} heads x {b.heads.head_bytes} bytes per head",
                    field="item_bytes",
                )
        self._derive_views()

    def _derive_views(self) -> None:
        """Fill the derived fields in one pass over the buffers (canonical order is kept in each)."""
        by_kind: dict[BufferKind, list[BufferSpec]] = {kind: [] for kind in BufferKind}
        kv: list[BufferSpec] = []
        state: list[BufferSpec] = []
        for b in self.buffers:
            by_kind[b.kind].append(b)
            if b.kind in _KV_KINDS:
                kv.append(b)
            elif b.kind in _STATE_KINDS:
                state.append(b)
        min_items = {kind: min((b.num_items for b in specs), default=0) for kind, specs in by_kind.items()}
        object.__setattr__(self, "_by_kind", {kind: tuple(specs) for kind, specs in by_kind.items()})
        object.__setattr__(self, "_kv", tuple(kv))
        object.__setattr__(self, "_state", tuple(state))
        object.__setattr__(self, "_min_items", min_items)
        object.__setattr__(self, "_min_kv_items", min((b.num_items for b in kv), default=0))

    @classmethod
    def build(
        cls, *, attention: AttentionKind, page_size: int, buffers: Sequence[BufferSpec]
    ) -> BufferLayout:
        """Named constructor that sorts buffers into canonical order."""
        ordered = sorted(buffers, key=lambda b: _canonical_key((b.model, b.kind, b.layer_id)))
        return cls(attention=attention, page_size=page_size, buffers=tuple(ordered))

    @classmethod
    def from_tensors(
        cls,
        *,
        attention: AttentionKind,
        page_size: int,
        tensors: Sequence[tuple[BufferKind, ModelRole, int, LayoutTensor, int]],
        heads: Mapping[ModelRole, HeadGeometry] | None = None,
    ) -> BufferLayout:
        """Build from ``(kind, model, layer_id, tensor, item_bytes)`` entries (torch tensors work).

        ``heads`` (MHA/GQA): the head geometry of each model's K and V buffers on this rank.

        Every tensor must describe its bytes truthfully, or ``LayoutError`` names it and the rule:
        contiguous (a strided view such as ``base[:, :64]`` would move bytes the scheduler never
        wrote there), not empty, a whole number of items, and for a tensor of two or more
        dimensions, an item that is one row of it or a whole number of rows (a KV item: one row, a
        page of ``page_size`` rows, or rows that ``heads`` describes); no two buffers may overlap.
        """
        per_model = {} if heads is None else dict(heads)
        specs = []
        for kind, model, layer_id, t, item_bytes in tensors:
            name = f"{model.value} {kind.value} layer {layer_id}"
            _check_tensor(name, kind, t, item_bytes, page_size)
            specs.append(
                BufferSpec(
                    kind=kind,
                    model=model,
                    layer_id=layer_id,
                    base_ptr=t.data_ptr(),
                    length=t.numel() * t.element_size(),
                    item_bytes=item_bytes,
                    heads=per_model.get(model) if kind in (BufferKind.K, BufferKind.V) else None,
                )
            )
        layout = cls.build(attention=attention, page_size=page_size, buffers=specs)
        layout.refuse_overlaps()
        return layout

    def refuse_overlaps(self) -> None:
        """``LayoutError`` naming two buffers that share bytes (one's writes would land in the other).

        ``from_tensors`` checks it; a layout built from raw addresses (an adapter's) should too. Not
        part of construction: protocol tests and decoded peers' layouts carry fictitious addresses."""
        _refuse_overlaps(self.buffers)

    def select(self, *kinds: BufferKind, model: ModelRole | None = None) -> tuple[BufferSpec, ...]:
        """Buffers of the given kinds (all kinds if none given), optionally of one model, in order."""
        if len(kinds) == 1 and model is None and kinds[0] in self._by_kind:
            return self._by_kind[kinds[0]]  # the common query (one kind, both models): precomputed
        wanted = frozenset(kinds) if kinds else frozenset(BufferKind)
        return tuple(b for b in self.buffers if b.kind in wanted and (model is None or b.model is model))

    @property
    def kv_buffers(self) -> tuple[BufferSpec, ...]:
        return self._kv

    @property
    def state_buffers(self) -> tuple[BufferSpec, ...]:
        return self._state

    @property
    def aux_buffers(self) -> tuple[BufferSpec, ...]:
        return self._by_kind[BufferKind.AUX]

    def min_items(self, kind: BufferKind) -> int:
        """The fewest items any buffer of ``kind`` holds (0 when there is none): the ids a peer may
        address in every buffer of that kind."""
        return self._min_items[kind]

    @property
    def min_kv_items(self) -> int:
        """The fewest pages any KV buffer (KV, K or V, either model) holds; 0 when there is none."""
        return self._min_kv_items

    @property
    def signature(self) -> tuple[tuple[str, str, int, int], ...]:
        return tuple(b.signature for b in self.buffers)

    def digest(self) -> str:
        """Short stable hash of the signature: cheap equality check carried in announcements.

        Equal for layouts that ``difference`` finds compatible where it can: a K/V buffer that
        describes heads enters by the model's heads (KV head count, bytes per head), not by its
        rank's head range, item bytes or item layout, so every rank of an instance announces the
        same digest (the registry requires it) and a decode instance of another TP size matches.
        Layouts without heads keep the digest they always had.
        """
        parts = []
        for b in self.buffers:
            if b.heads is None:
                parts.append(",".join(map(str, b.signature)))
            else:
                kv_heads, head_bytes = b.heads.model_signature
                parts.append(f"{b.kind.value},{b.model.value},{b.layer_id},heads {kv_heads}x{head_bytes}")
        text = f"{self.attention.value}/{self.page_size}/" + ";".join(parts)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def difference(self, other: BufferLayout) -> str | None:
        """None when compatible; otherwise a message naming the exact difference (both lists)."""
        if self.attention is not other.attention:
            return f"attention kinds differ: {self.attention.value} vs {other.attention.value}"
        if self.page_size != other.page_size:
            return f"page sizes differ: {self.page_size} vs {other.page_size}"
        problems: list[str] = []
        for model in ModelRole:
            for kind in BufferKind:
                mine = [b for b in self.buffers if b.kind is kind and b.model is model]
                theirs = [b for b in other.buffers if b.kind is kind and b.model is model]
                problem = group_difference(model, kind, mine, theirs)
                if problem is not None:
                    problems.append(problem)
        return "; ".join(problems) if problems else None

    def check_compatible(self, other: BufferLayout) -> None:
        diff = self.difference(other)
        if diff is not None:
            raise LayoutMismatchError(f"buffer layouts are incompatible: {diff}")


def group_difference(
    model: ModelRole, kind: BufferKind, mine: Sequence[BufferSpec], theirs: Sequence[BufferSpec]
) -> str | None:
    """None when two sides' buffers of one (model, kind) agree, else the difference naming both lists:
    the layer ids, then (for K/V buffers that describe heads) the model heads, else the bytes per item.

    ``mine`` and ``theirs`` are in canonical order (layer ascending); ``BufferLayout.difference`` is this
    over every (model, kind), and ``pdkv.mapping.layout_policy`` applies it to parts of a layout.
    """
    mine_ids = [b.layer_id for b in mine]
    theirs_ids = [b.layer_id for b in theirs]
    if mine_ids != theirs_ids:
        return f"{model.value} {kind.value} layer ids differ: {mine_ids} vs {theirs_ids}"
    heads = _head_difference(list(mine), list(theirs))
    if heads is not None:
        return f"{model.value} {kind.value} {heads}"
    if any(b.heads is not None for b in mine):
        return None  # same model heads: bytes per item follow each rank's own head range
    mine_b = [b.item_bytes for b in mine]
    theirs_b = [b.item_bytes for b in theirs]
    if mine_b != theirs_b:
        return (
            f"{model.value} {kind.value} bytes per item differ: {sorted(set(mine_b))} "
            f"vs {sorted(set(theirs_b))}"
        )
    return None


def _check_tensor(name: str, kind: BufferKind, t: LayoutTensor, item_bytes: int, page_size: int) -> None:
    """The rules ``from_tensors`` holds a tensor to (see there); ``LayoutError`` naming ``name``."""
    shape = tuple(t.size(d) for d in range(t.dim()))
    if not t.is_contiguous():
        raise LayoutError(
            f"{name}: the tensor (shape {shape}) is not contiguous: the engine moves raw memory from its "
            "data pointer, so a strided view would send bytes the scheduler never wrote there; register "
            "the whole pool tensor (or .contiguous() it before the scheduler writes into it)",
            field="tensors",
        )
    length = t.numel() * t.element_size()
    if length == 0:
        raise LayoutError(f"{name}: the tensor (shape {shape}) holds no bytes", field="tensors")
    if isinstance(item_bytes, bool) or not isinstance(item_bytes, int) or item_bytes <= 0:
        raise LayoutError(
            f"{name}: item_bytes must be a positive int, got {item_bytes!r}", field="item_bytes"
        )
    if length % item_bytes:
        raise LayoutError(
            f"{name}: the tensor holds {length} bytes (shape {shape} x {t.element_size()} B), not a whole "
            f"number of items of {item_bytes} B",
            field="item_bytes",
        )
    if len(shape) < 2:
        return  # a flat buffer: nothing more to compare
    row = length // shape[0]
    whole_rows = item_bytes % row == 0
    if kind.is_kv:
        # A KV item is one row (a pool indexed by page), a page of rows (indexed by token), or, for
        # MHA with ``heads``, rows of another width: only a whole number of rows is checked there.
        fits = whole_rows if kind is not BufferKind.KV else item_bytes in (row, page_size * row)
    else:
        fits = whole_rows or row % item_bytes == 0
    if not fits:
        raise LayoutError(
            f"{name}: item_bytes {item_bytes} disagrees with the tensor: shape {shape} with "
            f"{t.element_size()} B elements has {row} B per row"
            + (f" (a KV page is {row} or {page_size} x {row} B)" if kind is BufferKind.KV else ""),
            field="item_bytes",
        )


def _refuse_overlaps(buffers: Sequence[BufferSpec]) -> None:
    """Two buffers sharing bytes would let one's writes land in the other: ``LayoutError`` naming both."""
    spans = sorted((b for b in buffers if b.length), key=lambda b: b.base_ptr)
    reach: BufferSpec | None = None  # of the buffers so far, the one that ends last
    for b in spans:
        if reach is not None and b.base_ptr < reach.base_ptr + reach.length:
            raise LayoutError(
                f"{reach.describe()} [{reach.base_ptr:#x}, +{reach.length}) and {b.describe()} "
                f"[{b.base_ptr:#x}, +{b.length}) overlap",
                field="buffers",
            )
        if reach is None or b.base_ptr + b.length > reach.base_ptr + reach.length:
            reach = b


def _head_difference(mine: list[BufferSpec], theirs: list[BufferSpec]) -> str | None:
    """None when both sides describe no heads, or the same model heads (count, bytes per head) per layer.

    Head ranges and item layouts may differ (other TP size, other attention backend): the head
    mapping slices and reorders bytes for them. Described on one side only is a difference.
    """
    described = [b.heads is not None for b in mine], [b.heads is not None for b in theirs]
    if not any(described[0]) and not any(described[1]):
        return None
    if not all(described[0]) or not all(described[1]):
        here = "all" if all(described[0]) else ("some" if any(described[0]) else "no")
        there = "all" if all(described[1]) else ("some" if any(described[1]) else "no")
        return f"head geometry described on {here} buffers here vs {there} at the peer"
    mine_h = [b.heads.model_signature for b in mine if b.heads is not None]
    theirs_h = [b.heads.model_signature for b in theirs if b.heads is not None]
    if mine_h != theirs_h:
        return f"(KV heads, bytes per head) differ: {sorted(set(mine_h))} vs {sorted(set(theirs_h))}"
    return None


_KIND_ORDER = {kind: i for i, kind in enumerate(BufferKind)}
_MODEL_ORDER = {model: i for i, model in enumerate(ModelRole)}


def _canonical_key(key: tuple[ModelRole, BufferKind, int]) -> tuple[int, int, int]:
    model, kind, layer = key
    return (_MODEL_ORDER[model], _KIND_ORDER[kind], layer)
