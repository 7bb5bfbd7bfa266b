"""Layout policy: which differences between two ranks' layouts a registration accepts, and what the
transfer between them then leaves out.

Owns: ``LayoutPolicy`` (``STRICT``, ``DEGRADE_DRAFT``), ``BufferKey`` (a buffer named by model, kind and
layer id), ``LayoutCompatibility`` and ``compatibility(mine, theirs, policy)`` (the registration's
decision: accepted or refused with the reason, and which buffers of each side are left out), and
``TransferView`` / ``transfer_view(src, dst)``: the two layouts a chunk's blocks are planned on for one
pair of ranks (the buffers left out removed), with the block indices put back into the source layout's
numbering. Pure: no I/O, no clock; imports only ``pdkv.errors`` and ``pdkv.mapping``.

The rule (DESIGN section 6, rolling deployments). The target model's buffers (KV, state, aux) must
match exactly under every policy: the same layer ids, bytes per item (or model heads) per kind. Under
``STRICT`` so must the draft model's (any difference refuses, ``BufferLayout.difference``). Under
``DEGRADE_DRAFT`` the draft model's buffers of each kind pair by their leading layer ids: when one
side's list is the start of the other's (an empty list included: one side registers no draft buffer
of that kind), the common start is transferred and the rest of the longer list is left out, for that
pair of ranks only. Two lists of which neither starts the other (other layer ids), or a common start
with other bytes per item or other heads, are a mismatch of the same model, not a rollout: refused.
So a prefill upgraded to register its draft model's state keeps serving a decode that is not yet,
and the reverse, while a decode with another target model, or another draft model, is refused.

Nothing is left out silently: the registration answer names both sides' left-out buffers, the
endpoints warn once per pair of ranks and tell the scheduler per room, and ``transfer_view`` plans
on exactly the buffers ``compatibility`` kept, so no byte goes to a buffer the peer did not register
and none is read from a buffer the peer cannot take.
"""

from __future__ import annotations

import enum
import threading
import weakref
from collections.abc import Sequence
from typing import Final

import attrs
import numpy as np

from pdkv.errors import LayoutError
from pdkv.mapping._arrays import IntArray
from pdkv.mapping.blocks import TransferBlocks
from pdkv.mapping.layout import BufferKind, BufferLayout, BufferSpec, ModelRole, group_difference


class LayoutPolicy(enum.Enum):
    """How a registration treats a difference between the two sides' layouts (the value is the
    ``PDKV_LAYOUT_POLICY`` spelling)."""

    STRICT = "strict"
    """Any difference refuses the registration."""
    DEGRADE_DRAFT = "degrade_draft"
    """Target buffers match exactly; draft buffers only one side registers (or the tail of the longer
    draft list of a kind) are left out for that pair of ranks."""

    @classmethod
    def parse(cls, text: str) -> LayoutPolicy:
        """The policy spelled ``text`` (``strict`` or ``degrade_draft``, any case); ``ValueError`` naming
        the choices otherwise."""
        wanted = text.strip().lower() if isinstance(text, str) else text
        for policy in cls:
            if policy.value == wanted:
                return policy
        raise ValueError(f"{text!r} is not a layout policy (choose from {[p.value for p in cls]})")


DEFAULT_LAYOUT_POLICY: Final = LayoutPolicy.DEGRADE_DRAFT
"""What a transport uses unless told otherwise (README, "Rolling deployments": why)."""


def _layer_id(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise LayoutError(
            f"{attribute.name} must be an int in [0, 2**63), got {value!r}", field=attribute.name
        )


_KIND_ORDER: Final = {kind: i for i, kind in enumerate(BufferKind)}
_MODEL_ORDER: Final = {model: i for i, model in enumerate(ModelRole)}


@attrs.frozen(kw_only=True)
class BufferKey:
    """One registered buffer as both sides name it: (model, kind, logical layer id)."""

    model: ModelRole = attrs.field(validator=attrs.validators.instance_of(ModelRole))
    kind: BufferKind = attrs.field(validator=attrs.validators.instance_of(BufferKind))
    layer_id: int = attrs.field(validator=_layer_id)

    @classmethod
    def of(cls, spec: BufferSpec) -> BufferKey:
        return cls(model=spec.model, kind=spec.kind, layer_id=spec.layer_id)

    @property
    def sort_key(self) -> tuple[int, int, int]:
        """The canonical order of layouts: model, then kind, then layer."""
        return (_MODEL_ORDER[self.model], _KIND_ORDER[self.kind], self.layer_id)

    def describe(self) -> str:
        """``draft index_k layer 0``: as ``BufferSpec.describe`` names the buffer."""
        return f"{self.model.value} {self.kind.value} layer {self.layer_id}"


def describe_keys(keys: Sequence[BufferKey]) -> str:
    """``[draft index_k layer 0, draft index_k layer 1]`` (``[]`` when empty)."""
    return "[" + ", ".join(k.describe() for k in keys) + "]"


def _key_tuple(value: Sequence[BufferKey]) -> tuple[BufferKey, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class LayoutCompatibility:
    """The registration's decision for one pair of ranks, seen from ``mine``'s side.

    ``refusal`` is None when the pair may transfer; then ``left_out_mine`` are this side's buffers the
    transfer leaves out (the peer registers no counterpart) and ``left_out_theirs`` the peer's buffers
    it leaves out (nothing of this side writes them or is read for them); both empty unless
    the policy degrades. A refused pair leaves nothing out: it transfers nothing.
    """

    policy: LayoutPolicy = attrs.field(validator=attrs.validators.instance_of(LayoutPolicy))
    refusal: str | None = None
    left_out_mine: tuple[BufferKey, ...] = attrs.field(default=(), converter=_key_tuple)
    left_out_theirs: tuple[BufferKey, ...] = attrs.field(default=(), converter=_key_tuple)

    def __attrs_post_init__(self) -> None:
        if self.refusal is not None and (self.left_out_mine or self.left_out_theirs):
            raise LayoutError("a refused registration leaves nothing out", field="refusal")

    @property
    def accepted(self) -> bool:
        return self.refusal is None

    @property
    def degraded(self) -> bool:
        """Accepted with buffers left out on either side."""
        return self.refusal is None and bool(self.left_out_mine or self.left_out_theirs)

    @property
    def left_out_count(self) -> int:
        """Buffers left out on both sides together (what ``pdkv_draft_buffers_skipped`` adds up)."""
        return len(self.left_out_mine) + len(self.left_out_theirs)

    def swapped(self) -> LayoutCompatibility:
        """The same decision seen from the peer's side."""
        return LayoutCompatibility(
            policy=self.policy,
            refusal=self.refusal,
            left_out_mine=self.left_out_theirs,
            left_out_theirs=self.left_out_mine,
        )

    def describe(self, here: str = "here", there: str = "at the peer") -> str:
        """One line for logs: the refusal, or what is left out on each side."""
        if self.refusal is not None:
            return f"refused ({self.policy.value}): {self.refusal}"
        if not self.degraded:
            return "layouts match"
        return (
            f"draft buffers left out of the transfer ({self.policy.value}): {here} "
            f"{describe_keys(self.left_out_mine)} (no counterpart {there}), {there} "
            f"{describe_keys(self.left_out_theirs)} (no counterpart {here})"
        )


def compatibility(mine: BufferLayout, theirs: BufferLayout, policy: LayoutPolicy) -> LayoutCompatibility:
    """Whether ``mine`` and ``theirs`` may transfer under ``policy``, and what is then left out.

    Refused with ``BufferLayout.difference``'s text (both lists) under ``STRICT``; under
    ``DEGRADE_DRAFT`` refused for any target-model difference (and for attention kind or page
    size), or for draft buffers of one kind whose layer ids are not one the start of the other, or
    whose common start differs in bytes per item or heads, each problem naming both lists. A typed
    ``LayoutError`` names a ``policy`` that is not a ``LayoutPolicy``.
    """
    for name, layout in (("mine", mine), ("theirs", theirs)):
        if not isinstance(layout, BufferLayout):
            raise LayoutError(f"{name} must be a BufferLayout, got {type(layout).__name__}", field=name)
    if not isinstance(policy, LayoutPolicy):
        raise LayoutError(f"policy must be a LayoutPolicy, got {policy!r}", field="policy")
    difference = mine.difference(theirs)
    if difference is None:
        return LayoutCompatibility(policy=policy)
    if (
        policy is LayoutPolicy.STRICT
        or mine.attention is not theirs.attention
        or mine.page_size != theirs.page_size
    ):
        return LayoutCompatibility(policy=policy, refusal=difference)
    problems: list[str] = []
    left_mine: list[BufferKey] = []
    left_theirs: list[BufferKey] = []
    for kind in BufferKind:
        target = group_difference(
            ModelRole.TARGET,
            kind,
            mine.select(kind, model=ModelRole.TARGET),
            theirs.select(kind, model=ModelRole.TARGET),
        )
        if target is not None:
            problems.append(target)
        here = mine.select(kind, model=ModelRole.DRAFT)
        there = theirs.select(kind, model=ModelRole.DRAFT)
        common = min(len(here), len(there))
        if [b.layer_id for b in here[:common]] != [b.layer_id for b in there[:common]]:
            problems.append(
                f"draft {kind.value} layer ids differ: {[b.layer_id for b in here]} vs "
                f"{[b.layer_id for b in there]} (neither list starts the other: another draft model, "
                "not a rollout)"
            )
            continue
        draft = group_difference(ModelRole.DRAFT, kind, here[:common], there[:common])
        if draft is not None:
            problems.append(draft)
            continue
        left_mine += (BufferKey.of(b) for b in here[common:])
        left_theirs += (BufferKey.of(b) for b in there[common:])
    if problems:
        return LayoutCompatibility(policy=policy, refusal="; ".join(problems))
    return LayoutCompatibility(policy=policy, left_out_mine=left_mine, left_out_theirs=left_theirs)


# ---------------------------------------------------------------- planning view


@attrs.frozen(eq=False)
class TransferView:
    """The layouts the blocks of one (source rank, destination rank) pair are planned on.

    ``src`` / ``dst``: the two layouts without the buffers ``compatibility`` left out (the layouts
    themselves when nothing is). Blocks planned on them index ``src.buffers``; ``restore`` puts the
    indices back into the source layout's own ``buffers`` numbering, which the rest of the runtime
    (batch shaping, the per-layer path) reads.
    """

    src: BufferLayout
    dst: BufferLayout
    left_out_src: tuple[BufferKey, ...]
    left_out_dst: tuple[BufferKey, ...]
    src_index: IntArray | None
    """``src.buffers[j]`` is the source layout's ``buffers[src_index[j]]``; None: the identity."""

    @property
    def leaves_out(self) -> bool:
        return bool(self.left_out_src or self.left_out_dst)

    def restore(self, blocks: TransferBlocks) -> TransferBlocks:
        """``blocks`` (planned on ``src``) with ``buffer`` indices into the source layout's buffers."""
        if self.src_index is None or not len(blocks):
            return blocks
        return TransferBlocks(
            src=blocks.src, dst=blocks.dst, length=blocks.length, buffer=self.src_index[blocks.buffer]
        )


def _without(layout: BufferLayout, left_out: tuple[BufferKey, ...]) -> tuple[BufferLayout, IntArray]:
    gone = set(left_out)
    kept = [(i, b) for i, b in enumerate(layout.buffers) if BufferKey.of(b) not in gone]
    reduced = BufferLayout(
        attention=layout.attention, page_size=layout.page_size, buffers=tuple(b for _, b in kept)
    )
    return reduced, np.asarray([i for i, _ in kept], dtype=np.int64).reshape(-1)


def plan_view(src_layout: BufferLayout, dst_layout: BufferLayout) -> TransferView:
    """The ``TransferView`` of a pair of registered layouts (``transfer_view`` without the cache).

    Decided from the two layouts alone, as ``DEGRADE_DRAFT`` would leave buffers out: a pair that a
    ``STRICT`` registration accepted has identical keys, so nothing is left out for it. A pair that
    even ``DEGRADE_DRAFT`` refuses is returned whole: the block builders then refuse it with their
    own ``LayoutMismatchError`` (never a transfer of the buffers that happen to pair).
    """
    decision = compatibility(src_layout, dst_layout, LayoutPolicy.DEGRADE_DRAFT)
    if not decision.degraded:
        return TransferView(src=src_layout, dst=dst_layout, left_out_src=(), left_out_dst=(), src_index=None)
    src, index = _without(src_layout, decision.left_out_mine)
    dst, _ = _without(dst_layout, decision.left_out_theirs)
    return TransferView(
        src=src,
        dst=dst,
        left_out_src=decision.left_out_mine,
        left_out_dst=decision.left_out_theirs,
        src_index=index,
    )


_CACHE_LIMIT: Final = 256
_cache_lock = threading.Lock()
_cache: dict[tuple[int, int], tuple[weakref.ref[BufferLayout], weakref.ref[BufferLayout], TransferView]] = {}


def transfer_view(src_layout: BufferLayout, dst_layout: BufferLayout) -> TransferView:
    """``plan_view`` memoised on the identity of both layouts (weak references), so every chunk of a
    registration pays one dict lookup and the block builders' own caches see the same view layouts."""
    key = (id(src_layout), id(dst_layout))
    hit = _cache.get(key)
    if hit is not None and hit[0]() is src_layout and hit[1]() is dst_layout:
        return hit[2]
    view = plan_view(src_layout, dst_layout)
    with _cache_lock:
        if len(_cache) >= _CACHE_LIMIT:
            _cache.clear()
        _cache[key] = (weakref.ref(src_layout), weakref.ref(dst_layout), view)
    return view


__all__ = [
    "DEFAULT_LAYOUT_POLICY",
    "BufferKey",
    "LayoutCompatibility",
    "LayoutPolicy",
    "TransferView",
    "compatibility",
    "describe_keys",
    "plan_view",
    "transfer_view",
]
