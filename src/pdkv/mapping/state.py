"""State buffers: length clipping for paged state, and state-layer compaction for index-skip models.

Owns: ``clip_state`` / ``ClippedState``; ``StateLayerMap`` (logical layer id <-> compact state
slot); ``LayerKey``, ``state_layer_keys`` and ``compare_state_layers`` / ``StateLayerDifference``
(the registration check). Pure and vectorised over slots and layers. Must not clip silently: a
clip is returned as data so the caller logs or counts it; must not guess a pairing of state layers
(two sides that keep state on different layers are rejected with both lists).

Index-skip models (for example NSA/DSA variants that reuse the previous layer's index) keep state
only on some layers. Their state pools are compact: slot j holds the state of the j-th layer that
has state. Buffers in a ``BufferLayout`` carry the *logical* layer id, so pairing by (model, kind,
layer id) is unaffected by compaction; ``StateLayerMap`` is the translation both ways.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from pdkv.errors import MappingError
from pdkv.mapping._arrays import IntArray, as_index_array, check_int, summarize
from pdkv.mapping.layout import BufferKind, BufferLayout, ModelRole

BoolArray = npt.NDArray[np.bool_]


def _array_eq() -> Any:
    return attrs.cmp_using(eq=np.array_equal)


# ---------------------------------------------------------------- clipping


@attrs.frozen(kw_only=True)
class ClippedState:
    """State indices cut to a common length; ``clipped_*`` count the entries dropped from each side.

    At most one of ``clipped_src`` / ``clipped_dst`` is non-zero.
    """

    src: IntArray = attrs.field(eq=_array_eq())
    dst: IntArray = attrs.field(eq=_array_eq())
    clipped_src: int
    clipped_dst: int

    @property
    def clipped(self) -> bool:
        return bool(self.clipped_src or self.clipped_dst)

    def describe(self) -> str:
        """One line for the caller's warning log (empty when nothing was clipped)."""
        if not self.clipped:
            return ""
        side, dropped = (
            ("source", self.clipped_src) if self.clipped_src else ("destination", self.clipped_dst)
        )
        return f"state indices clipped: dropped the last {dropped} {side} entries, kept {self.src.size}"


def clip_state(src_idx: object, dst_idx: object) -> ClippedState:
    """Cut the longer of two state index lists to the common length, keeping the leading entries.

    For paged state that tolerates a small drift (SWA, NSA index K / scale): the result says what
    was dropped. Positional state kinds must not be clipped: use ``check_page_counts`` for those.
    """
    src = as_index_array(src_idx, "src_state")
    dst = as_index_array(dst_idx, "dst_state")
    common = min(src.size, dst.size)
    return ClippedState(
        src=src[:common].copy(),  # copies: the caller's arrays may be reused for the next room
        dst=dst[:common].copy(),
        clipped_src=int(src.size - common),
        clipped_dst=int(dst.size - common),
    )


# ---------------------------------------------------------------- compaction


@attrs.frozen(kw_only=True)
class StateLayerMap:
    """Logical layer id <-> compact state slot for a model that keeps state on ``state_layers`` only.

    Slot j belongs to ``state_layers[j]`` (increasing logical ids). Both directions are vectorised
    lookups; asking for the slot of a layer without state, or for a slot that does not exist, is a
    ``MappingError`` (never a default slot).
    """

    num_layers: int
    state_layers: IntArray = attrs.field(eq=_array_eq())
    # slot_table[layer] = compact slot, or -1 where the layer keeps no state
    slot_table: IntArray = attrs.field(eq=False, repr=False)

    @classmethod
    def from_layer_ids(cls, layer_ids: object, *, num_layers: int) -> StateLayerMap:
        """From the logical ids of the layers that keep state (any order, no duplicates)."""
        total = check_int(num_layers, "num_layers", minimum=0)
        ids = as_index_array(layer_ids, "state_layer_ids")
        ordered = np.sort(ids)
        if ordered.size and (int(ordered[0]) < 0 or int(ordered[-1]) >= total):
            raise MappingError(
                f"state layer ids must lie in 0..{total - 1}; {summarize(ordered, 'state_layer_ids')}"
            )
        if ordered.size > 1 and bool(np.any(ordered[1:] == ordered[:-1])):
            duplicated = np.unique(ordered[1:][ordered[1:] == ordered[:-1]])
            raise MappingError(f"state layer ids listed twice: {summarize(duplicated, 'duplicates')}")
        table = np.full(total, -1, dtype=np.int64)
        table[ordered] = np.arange(ordered.size, dtype=np.int64)
        return cls(num_layers=total, state_layers=ordered, slot_table=table)

    @classmethod
    def from_mask(cls, has_state: object) -> StateLayerMap:
        """From one flag per logical layer (True where the layer keeps state)."""
        mask = np.asarray(has_state)
        if mask.ndim != 1 or mask.dtype != np.bool_:
            raise MappingError(f"has_state is a 1-D bool array, got dtype {mask.dtype} shape {mask.shape}")
        return cls.from_layer_ids(np.flatnonzero(mask), num_layers=int(mask.size))

    @property
    def num_slots(self) -> int:
        return int(self.state_layers.size)

    def has_state(self, layer_ids: object) -> BoolArray:
        ids = self._check_layers(layer_ids)
        out: BoolArray = self.slot_table[ids] >= 0
        return out

    def slot_of(self, layer_ids: object) -> IntArray:
        """Compact slots of logical layers; every layer given must keep state."""
        ids = self._check_layers(layer_ids)
        slots: IntArray = self.slot_table[ids]
        if slots.size and int(slots.min()) < 0:
            missing = ids[slots < 0]
            raise MappingError(
                f"{missing.size} layer(s) keep no state; {summarize(missing, 'layers without state')}; "
                f"{summarize(self.state_layers, 'state layers')}"
            )
        return slots

    def layer_of(self, slots: object) -> IntArray:
        """Logical layer ids of compact slots."""
        idx = as_index_array(slots, "state_slots")
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= self.num_slots):
            raise MappingError(
                f"state slots must lie in 0..{self.num_slots - 1}; {summarize(idx, 'state_slots')}"
            )
        out: IntArray = self.state_layers[idx]
        return out

    def _check_layers(self, layer_ids: object) -> IntArray:
        ids = as_index_array(layer_ids, "layer_ids")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_layers):
            raise MappingError(
                f"layer ids must lie in 0..{self.num_layers - 1}; {summarize(ids, 'layer_ids')}"
            )
        return ids


# ---------------------------------------------------------------- registration comparison


_MODEL_ORDER = {model: i for i, model in enumerate(ModelRole)}


@attrs.frozen(kw_only=True)
class LayerKey:
    """A layer of one model: what two sides' state layer lists are compared on."""

    model: ModelRole = attrs.field(validator=attrs.validators.instance_of(ModelRole))
    layer_id: int = attrs.field(validator=attrs.validators.instance_of(int))

    def __str__(self) -> str:
        return f"{self.model.value}:{self.layer_id}"

    @property
    def sort_key(self) -> tuple[int, int]:
        return (_MODEL_ORDER[self.model], self.layer_id)


def _sorted_keys(keys: Iterable[LayerKey], side: str) -> tuple[LayerKey, ...]:
    listed = list(keys)
    for key in listed:
        if not isinstance(key, LayerKey):
            raise MappingError(f"{side} state layers must be LayerKey records, got {type(key).__name__}")
    unique = sorted(set(listed), key=lambda k: k.sort_key)
    if len(unique) != len(listed):
        twice = sorted((k for k, n in Counter(listed).items() if n > 1), key=lambda k: k.sort_key)
        raise MappingError(f"{side} state layers list {', '.join(map(str, twice))} more than once")
    return tuple(unique)


def _show(keys: tuple[LayerKey, ...]) -> str:
    return "[" + ", ".join(map(str, keys)) + "]"


@attrs.frozen(kw_only=True)
class StateLayerDifference:
    """Two sides keep state on different (model, layer) sets: both lists and what each lacks."""

    mine: tuple[LayerKey, ...]
    theirs: tuple[LayerKey, ...]
    missing_here: tuple[LayerKey, ...]  # the peer has state on these layers, this side does not
    missing_there: tuple[LayerKey, ...]  # this side has state on these layers, the peer does not

    def describe(self, subject: str = "state layers") -> str:
        """``<subject> differ: missing here [..], missing at the peer [..]; here [..] vs peer [..]``."""
        return (
            f"{subject} differ: missing here {_show(self.missing_here)}, missing at the peer "
            f"{_show(self.missing_there)}; here {_show(self.mine)} vs peer {_show(self.theirs)}"
        )

    def __str__(self) -> str:
        return self.describe()


def compare_state_layers(mine: Iterable[LayerKey], theirs: Iterable[LayerKey]) -> StateLayerDifference | None:
    """None when both sides keep state on the same (model, layer id) set, else the exact difference.

    Order does not matter; a key listed twice on one side is a ``MappingError`` (no layout can do it).
    """
    here = _sorted_keys(mine, "local")
    there = _sorted_keys(theirs, "peer")
    if here == there:
        return None
    here_set, there_set = set(here), set(there)
    return StateLayerDifference(
        mine=here,
        theirs=there,
        missing_here=tuple(k for k in there if k not in here_set),
        missing_there=tuple(k for k in here if k not in there_set),
    )


def state_layer_keys(layout: BufferLayout, kind: BufferKind | None = None) -> tuple[LayerKey, ...]:
    """(model, layer id) of the layout's state buffers, of one state kind or of all of them."""
    if kind is not None and not kind.is_state:
        raise MappingError(f"{kind.value} is not a state buffer kind")
    wanted = (kind,) if kind is not None else tuple(k for k in BufferKind if k.is_state)
    keys = {LayerKey(model=b.model, layer_id=b.layer_id) for b in layout.select(*wanted)}
    return tuple(sorted(keys, key=lambda k: k.sort_key))
