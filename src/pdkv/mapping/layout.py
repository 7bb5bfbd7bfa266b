"""Buffer layouts: which registered regions a rank holds, described as plain data.

Owns: ``BufferSpec`` / ``BufferLayout`` (kind, model, layer id, base address, length, bytes per item)
and the layout comparison used at registration. Must not import torch or do I/O: ``from_tensors``
accepts anything with ``data_ptr()``, ``numel()`` and ``element_size()`` (torch tensors qualify).

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

from pdkv.errors import LayoutMismatchError


class BufferKind(enum.Enum):
    """What a registered region holds. The order of kinds is the canonical order of a layout."""

    KV = "kv"  # MLA latent KV: one buffer per layer
    K = "k"  # MHA keys: one buffer per layer
    V = "v"  # MHA values: one buffer per layer
    INDEX_K = "index_k"  # NSA/DSA indexer keys (state, only on layers that keep an index)
    INDEX_SCALE = "index_scale"  # NSA/DSA indexer scales
    SWA = "swa"  # sliding-window attention state pages
    AUX = "aux"  # per-request metadata rows (first token, room stamp ...)

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


_MAX = 2**63 - 1  # addresses and sizes are signed 64-bit on the wire and in numpy


def _non_negative(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX:
        raise ValueError(f"{attribute.name} must be an int in [0, 2**63), got {value!r}")


def _positive(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= _MAX:
        raise ValueError(f"{attribute.name} must be an int in [1, 2**63), got {value!r}")


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
            raise ValueError(
                f"heads {self.head_start}..{self.head_start + self.head_count - 1} are outside the "
                f"model's {self.kv_heads} KV heads"
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
            raise ValueError(f"{self.kind.value} layer {self.layer_id}: only K and V buffers describe heads")
        if self.length % self.item_bytes:
            raise ValueError(
                f"{self.kind.value} layer {self.layer_id}: length {self.length} is not a multiple of "
                f"item_bytes {self.item_bytes}"
            )

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
            raise ValueError("a layout lists the same (model, kind, layer) twice")
        if keys != sorted(keys, key=_canonical_key):
            raise ValueError("buffers must be in canonical order (use BufferLayout.build)")
        for b in self.buffers:
            if b.heads is None:
                continue
            if self.attention is not AttentionKind.MHA:
                raise ValueError(f"{b.kind.value} layer {b.layer_id}: only MHA layouts describe heads")
            if b.item_bytes != b.heads.item_bytes(self.page_size):
                raise ValueError(
                    f"{b.model.value} {b.kind.value} layer {b.layer_id}: item_bytes {b.item_bytes} != "
                    f"page_size {self.page_size} x {b.heads.head_count} heads x {b.heads.head_bytes} "
                    "bytes per head"
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
        tensors: Sequence[tuple[BufferKind, ModelRole, int, TensorLike, int]],
        heads: Mapping[ModelRole, HeadGeometry] | None = None,
    ) -> BufferLayout:
        """Build from ``(kind, model, layer_id, tensor, item_bytes)`` entries (torch tensors work).

        ``heads`` (MHA/GQA): the head geometry of each model's K and V buffers on this rank.
        """
        per_model = {} if heads is None else dict(heads)
        specs = [
            BufferSpec(
                kind=kind,
                model=model,
                layer_id=layer_id,
                base_ptr=t.data_ptr(),
                length=t.numel() * t.element_size(),
                item_bytes=item_bytes,
                heads=per_model.get(model) if kind in (BufferKind.K, BufferKind.V) else None,
            )
            for kind, model, layer_id, t, item_bytes in tensors
        ]
        return cls.build(attention=attention, page_size=page_size, buffers=specs)

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
                mine = [b.layer_id for b in self.buffers if b.kind is kind and b.model is model]
                theirs = [b.layer_id for b in other.buffers if b.kind is kind and b.model is model]
                if mine != theirs:
                    problems.append(f"{model.value} {kind.value} layer ids differ: {mine} vs {theirs}")
                    continue
                mine_s = [b for b in self.buffers if b.kind is kind and b.model is model]
                theirs_s = [b for b in other.buffers if b.kind is kind and b.model is model]
                heads = _head_difference(mine_s, theirs_s)
                if heads is not None:
                    problems.append(f"{model.value} {kind.value} {heads}")
                    continue
                if any(b.heads is not None for b in mine_s):
                    continue  # same model heads: bytes per item follow each rank's own head range
                mine_b = [b.item_bytes for b in mine_s]
                theirs_b = [b.item_bytes for b in theirs_s]
                if mine_b != theirs_b:
                    problems.append(
                        f"{model.value} {kind.value} bytes per item differ: {sorted(set(mine_b))} "
                        f"vs {sorted(set(theirs_b))}"
                    )
        return "; ".join(problems) if problems else None

    def check_compatible(self, other: BufferLayout) -> None:
        diff = self.difference(other)
        if diff is not None:
            raise LayoutMismatchError(f"buffer layouts are incompatible: {diff}")


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
