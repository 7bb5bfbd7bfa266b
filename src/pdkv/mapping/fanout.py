"""TP fan-out: which prefill ranks a decode rank receives from, and who waits for how many messages.

Owns: ``Topology`` (prefill TP x CP, decode TP, attention kind) and the answers derived from it:
``decode_fanout`` (targets of one decode rank, dummy flags, statuses to wait for), ``prefill_fanout``
and ``required_dst_info_num`` (TransferRequests one prefill rank waits for per room). Pure integer
arithmetic. Must not touch sockets or rooms; the runtime turns these answers into messages.

Rules (SGLang's semantics, with every CP rank of the real TP source sending its owned pages):
- Equal TP: decode rank d receives from prefill TP rank d.
- Decode TP > prefill TP by ratio r: prefill TP rank p serves decode ranks p*r .. p*r + r - 1, each
  a full copy (MLA); it waits for r TransferRequests per room (``required_dst_info_num = r``).
- Decode TP < prefill TP by ratio r: decode rank d addresses prefill TP ranks d*r .. d*r + r - 1.
  Under MLA (KV replicated across TP) only the first is real; the other r - 1 get dummy requests so
  their rooms advance, and send no status.
- MHA/GQA splits the model's ``kv_heads`` KV heads across TP (``pdkv.mapping.heads`` has the head
  ranges and byte slices). Equal TP needs nothing more; unequal TP needs ``kv_heads``. Who addresses
  whom is the same as under MLA; only the dummies differ: with decode TP < prefill TP, the r prefill
  ranks a decode rank addresses hold ``r / copies`` distinct head ranges, each held by ``copies =
  min(r, max(1, prefill_tp // kv_heads))`` of them (GQA replicas when kv_heads < prefill tp); the
  first rank of each replica group is real, the others are dummies (MLA is ``copies = r``).
- Prefill CP C: each TP target stands for C ranks (tp, 0..C-1); a decode rank waits for one status
  from every CP rank of each of its real TP sources.
"""

from __future__ import annotations

import attrs

from pdkv.errors.mapping import TopologyError as TopologyError
from pdkv.mapping.layout import AttentionKind


def _positive(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TopologyError(f"{attribute.name} must be a positive int, got {value!r}")


@attrs.frozen(kw_only=True)
class Topology:
    """The parallel shape of one prefill instance and one decode instance."""

    prefill_tp: int = attrs.field(validator=_positive)
    decode_tp: int = attrs.field(validator=_positive)
    prefill_cp: int = attrs.field(default=1, validator=_positive)
    attention: AttentionKind = attrs.field(
        default=AttentionKind.MLA, validator=attrs.validators.instance_of(AttentionKind)
    )
    kv_heads: int | None = attrs.field(default=None, validator=attrs.validators.optional(_positive))
    """MHA/GQA: the model's KV head count (needed when the TP sizes differ); None under MLA."""

    def __attrs_post_init__(self) -> None:
        big, small = max(self.prefill_tp, self.decode_tp), min(self.prefill_tp, self.decode_tp)
        if big % small:
            raise TopologyError(
                f"prefill tp {self.prefill_tp} and decode tp {self.decode_tp}: one must divide the other"
            )
        if self.attention is AttentionKind.MLA:
            if self.kv_heads is not None:
                raise TopologyError(f"kv_heads={self.kv_heads} given for MLA (latent KV has no heads)")
            return
        if self.kv_heads is None:
            if self.prefill_tp != self.decode_tp:
                raise TopologyError(
                    f"MHA splits heads across TP ranks: prefill tp {self.prefill_tp} and decode tp "
                    f"{self.decode_tp} differ, so the topology needs kv_heads (the model's KV head count)"
                )
            return
        for side, tp in (("prefill", self.prefill_tp), ("decode", self.decode_tp)):
            if self.kv_heads % tp and tp % self.kv_heads:
                raise TopologyError(
                    f"{self.kv_heads} KV heads cannot be split over {side} tp {tp}: one must divide the "
                    "other (each rank holds kv_heads/tp heads, or one head replicated tp/kv_heads times)"
                )

    @property
    def ratio(self) -> int:
        """Larger TP size / smaller TP size (1 for equal TP)."""
        return max(self.prefill_tp, self.decode_tp) // min(self.prefill_tp, self.decode_tp)

    @property
    def copies(self) -> int:
        """With decode tp < prefill tp: how many of the ``ratio`` prefill ranks a decode rank addresses
        hold the same heads (one of each group is real). MLA: all of them; MHA: the GQA replicas."""
        if self.decode_tp >= self.prefill_tp:
            return 1
        if self.attention is AttentionKind.MLA:
            return self.ratio
        heads = self.prefill_tp if self.kv_heads is None else self.kv_heads  # equal-TP MHA never gets here
        return min(self.ratio, max(1, self.prefill_tp // heads))


@attrs.frozen(kw_only=True)
class PrefillTarget:
    """One prefill rank a decode rank sends a TransferRequest to; a dummy one gets no destination."""

    tp: int
    cp: int
    dummy: bool


@attrs.frozen(kw_only=True)
class DecodeFanout:
    """What one decode rank does per room: request every target, wait for ``required_statuses``."""

    decode_tp_rank: int
    targets: tuple[PrefillTarget, ...]
    required_statuses: int

    @property
    def real_targets(self) -> tuple[PrefillTarget, ...]:
        return tuple(t for t in self.targets if not t.dummy)


@attrs.frozen(kw_only=True)
class PrefillFanout:
    """What one prefill TP rank (any of its CP ranks) does per room.

    ``decode_ranks``: the decode TP ranks that send it a TransferRequest (its
    ``required_dst_info_num``); ``dummy``: those requests carry no destination and it sends nothing.
    """

    prefill_tp_rank: int
    decode_ranks: tuple[int, ...]
    dummy: bool

    @property
    def required_dst_info_num(self) -> int:
        return len(self.decode_ranks)


def _rank(value: int, size: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
        raise TopologyError(f"{name} must be an int in 0..{size - 1}, got {value!r}")
    return value


def decode_fanout(topology: Topology, decode_tp_rank: int) -> DecodeFanout:
    """The prefill ranks (tp, cp) decode rank ``decode_tp_rank`` requests, and how many statuses it needs.

    Targets are ordered by TP rank, then CP rank. Only real targets send a status, one per CP rank
    (under MHA with decode tp < prefill tp several TP ranks can be real: each holds other heads).
    """
    d = _rank(decode_tp_rank, topology.decode_tp, "decode_tp_rank")
    r, copies = topology.ratio, topology.copies
    tp_ranks = [d // r] if topology.decode_tp >= topology.prefill_tp else list(range(d * r, d * r + r))
    targets = tuple(
        PrefillTarget(tp=tp, cp=cp, dummy=tp % copies != 0)
        for tp in tp_ranks
        for cp in range(topology.prefill_cp)
    )
    real_tp = len(tp_ranks) // copies
    return DecodeFanout(decode_tp_rank=d, targets=targets, required_statuses=real_tp * topology.prefill_cp)


def prefill_fanout(topology: Topology, prefill_tp_rank: int) -> PrefillFanout:
    """The decode ranks that address prefill TP rank ``prefill_tp_rank``, and whether it is a dummy."""
    p = _rank(prefill_tp_rank, topology.prefill_tp, "prefill_tp_rank")
    r = topology.ratio
    if topology.decode_tp >= topology.prefill_tp:
        return PrefillFanout(prefill_tp_rank=p, decode_ranks=tuple(range(p * r, p * r + r)), dummy=False)
    return PrefillFanout(prefill_tp_rank=p, decode_ranks=(p // r,), dummy=p % topology.copies != 0)


def required_dst_info_num(topology: Topology, prefill_tp_rank: int) -> int:
    """How many TransferRequests prefill TP rank ``prefill_tp_rank`` waits for per room."""
    return prefill_fanout(topology, prefill_tp_rank).required_dst_info_num
