"""Buffer layouts: which registered regions a rank holds, described as plain data.

Owns: ``BufferSpec`` / ``BufferLayout`` (kind, model, layer id, base address, length, bytes per item)
and the layout comparison used at registration. Must not import torch or do I/O: ``from_tensors``
accepts anything with ``data_ptr()``, ``numel()`` and ``element_size()`` (torch tensors qualify).

Items: for KV buffers an item is one page (``page_size`` tokens); for state buffers one state slot
(page-indexed state such as SWA or NSA index K/scale uses its own index space); for aux one row.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence
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
class BufferSpec:
    """One registered region. ``length`` is a whole number of items of ``item_bytes`` each."""

    kind: BufferKind = attrs.field(validator=attrs.validators.instance_of(BufferKind))
    model: ModelRole = attrs.field(validator=attrs.validators.instance_of(ModelRole))
    layer_id: int = attrs.field(validator=_non_negative)
    base_ptr: int = attrs.field(validator=_non_negative)
    length: int = attrs.field(validator=_non_negative)
    item_bytes: int = attrs.field(validator=_positive)

    def __attrs_post_init__(self) -> None:
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

    def __attrs_post_init__(self) -> None:
        keys = [(b.model, b.kind, b.layer_id) for b in self.buffers]
        if len(set(keys)) != len(keys):
            raise ValueError("a layout lists the same (model, kind, layer) twice")
        if keys != sorted(keys, key=_canonical_key):
            raise ValueError("buffers must be in canonical order (use BufferLayout.build)")

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
    ) -> BufferLayout:
        """Build from ``(kind, model, layer_id, tensor, item_bytes)`` entries (torch tensors work)."""
        specs = [
            BufferSpec(
                kind=kind,
                model=model,
                layer_id=layer_id,
                base_ptr=t.data_ptr(),
                length=t.numel() * t.element_size(),
                item_bytes=item_bytes,
            )
            for kind, model, layer_id, t, item_bytes in tensors
        ]
        return cls.build(attention=attention, page_size=page_size, buffers=specs)

    def select(self, *kinds: BufferKind, model: ModelRole | None = None) -> tuple[BufferSpec, ...]:
        """Buffers of the given kinds (all kinds if none given), optionally of one model, in order."""
        wanted = frozenset(kinds) if kinds else frozenset(BufferKind)
        return tuple(b for b in self.buffers if b.kind in wanted and (model is None or b.model is model))

    @property
    def kv_buffers(self) -> tuple[BufferSpec, ...]:
        return tuple(b for b in self.buffers if b.kind.is_kv)

    @property
    def state_buffers(self) -> tuple[BufferSpec, ...]:
        return tuple(b for b in self.buffers if b.kind.is_state)

    @property
    def aux_buffers(self) -> tuple[BufferSpec, ...]:
        return tuple(b for b in self.buffers if b.kind is BufferKind.AUX)

    @property
    def signature(self) -> tuple[tuple[str, str, int, int], ...]:
        return tuple(b.signature for b in self.buffers)

    def digest(self) -> str:
        """Short stable hash of the signature: cheap equality check carried in announcements."""
        text = f"{self.attention.value}/{self.page_size}/" + ";".join(
            ",".join(map(str, s)) for s in self.signature
        )
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
                mine_b = [b.item_bytes for b in self.buffers if b.kind is kind and b.model is model]
                theirs_b = [b.item_bytes for b in other.buffers if b.kind is kind and b.model is model]
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


_KIND_ORDER = {kind: i for i, kind in enumerate(BufferKind)}
_MODEL_ORDER = {model: i for i, model in enumerate(ModelRole)}


def _canonical_key(key: tuple[ModelRole, BufferKind, int]) -> tuple[int, int, int]:
    model, kind, layer = key
    return (_MODEL_ORDER[model], _KIND_ORDER[kind], layer)
