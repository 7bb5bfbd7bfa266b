"""Landing pool: the decode rank's registered memory where prefill ranks of a larger TP write their KV
page items whole, and the scatter from it into the decode's pages (decode TP below prefill TP).

Owns: ``LandingConfig`` (``PDKV_LANDING_BYTES``), ``LandingPool`` (one registered tensor on the decode
buffers' device, a byte allocator of room-sized leases over it, the waiting rooms in arrival order, and
the scatter of a room's lease into its pages) and ``LandingStatistics``. Must not decide rules: the
receiver room's rows (``pdkv.protocol.machines.room_receiver``) say when a room waits, scatters and
succeeds; the decode transport (``pdkv.runtime.decode``) carries out their ``LeaseLanding`` and
``ScatterLanding`` effects through this pool and releases a lease when the room's pages are released
(its Success, or its ``ReleasePages``). The layout of a lease is ``pdkv.mapping.landing``'s.

Rules the pool keeps (specs/mapping.md section 15.3):

- Bounded and registered once: one tensor of ``capacity_bytes``, allocated and registered with the
  backend when the decode connects to a prefill instance whose rooms will land (``prepare``, before
  its Register messages carry the engine metadata: NIXL's prefill ranks write only into regions listed
  there), so a deployment of equal TP never pays for it; unregistered by ``close()`` once no lease is
  out.
- Back-pressure, never a failure for space: a room that finds no room in the pool waits (first come,
  first served: a later, smaller room does not overtake it), and is served as leases come back. A room
  larger than the whole pool is answered at once with no lease (its requests go grant-less).
- Released only with the room's pages: the transport calls ``release`` on the room's Success (every
  source reported Success after its writes ended, and the scatter ran) or its ``ReleasePages`` (after
  every AbortAck, the proof of a cut, or the quarantine bound): never while a prefill engine may still
  write into it.
- The scatter finishes before the room reports Success: one ``index_copy_`` per group on the buffers'
  device (``LandingRegions.scatter``), synchronised.

Thread-safety: none of its own; the decode transport calls it under its lock.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Mapping
from typing import Final

import attrs
import numpy as np
import torch

from pdkv import config
from pdkv.engine.backend import Registration, TransferBackend
from pdkv.mapping import BufferLayout, Topology
from pdkv.mapping.landing import LandingPlan, plan_landing, plan_scatter
from pdkv.protocol.effects import LeaseLanding, PeerKey, ScatterLanding
from pdkv.protocol.ids import RoomId
from pdkv.protocol.messages import LandingGrant
from pdkv.runtime.checksum import BufferViews
from pdkv.runtime.staging import DEFAULT_COPY_THREADS, FreeList, LandingRegions

log = logging.getLogger(__name__)

ALIGNMENT: Final = 256
DEFAULT_LANDING_BYTES: Final = 256 << 20
"""Room-sized leases: 256 MiB holds, for example, two rooms of 4,096 pages of 32 KiB per decode rank."""


@attrs.frozen(kw_only=True)
class LandingConfig:
    capacity_bytes: int = attrs.field(
        default=DEFAULT_LANDING_BYTES,
        validator=config.non_negative_int,
        metadata=config.int_var(
            "PDKV_LANDING_BYTES",
            "Landing: registered landing bytes per decode rank (decode TP below prefill TP; 0: off)",
        ),
    )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LandingConfig:
        return config.from_env(cls, env)


ENV_VARS: Final[Mapping[str, str]] = config.env_vars(LandingConfig)


@attrs.frozen(kw_only=True)
class LandingStatistics:
    capacity_bytes: int
    in_use_bytes: int
    peak_in_use_bytes: int
    leases: int  # rooms given a lease
    waits: int  # rooms that had to wait for space
    waiting: int  # rooms waiting now
    fallbacks: int  # rooms larger than the whole pool (sent grant-less)
    scatters: int
    scatter_seconds: float


@attrs.define(eq=False)
class _Lease:
    offset: int
    nbytes: int
    plan: LandingPlan


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


class LandingPool:
    """One decode rank's landing memory (see the module docstring)."""

    def __init__(
        self,
        backend: TransferBackend,
        layout: BufferLayout,
        decode_tp_rank: int,
        config: LandingConfig | None = None,
        *,
        device: str = "cpu",
    ) -> None:
        self.config = config or LandingConfig()
        self._backend = backend
        self._layout = layout
        self._rank = decode_tp_rank
        self._device = torch.device(device)
        self._tensor: torch.Tensor | None = None
        self._registration: Registration | None = None
        self._targets: LandingRegions | None = None
        self.address = 0
        self._free = FreeList(self.config.capacity_bytes)
        self._leases: dict[RoomId, _Lease] = {}
        # Rooms waiting for space, in arrival order, with the bytes their lease needs.
        self._waiting: collections.OrderedDict[RoomId, tuple[LeaseLanding, Topology, int]] = (
            collections.OrderedDict()
        )
        self._in_use = 0
        self._counts = dict.fromkeys(("peak", "leases", "waits", "fallbacks", "scatters"), 0)
        self._scatter_s = 0.0

    # ------------------------------------------------------------------ leases

    def holds(self, room: RoomId) -> bool:
        return room in self._leases or room in self._waiting

    def request(self, effect: LeaseLanding, topology: Topology) -> dict[PeerKey, LandingGrant] | None:
        """A room's lease: its grants now, ``{}`` when the room can never fit (grant-less), or None when
        it must wait (``release`` serves it later, through ``ready``)."""
        slots = int(effect.dst_pages.size) - effect.prefix_pages
        sizing = plan_landing(
            self._layout, topology, self._rank, first_position=effect.prefix_pages, slots=slots, base=0
        )
        if sizing.total_bytes > self.config.capacity_bytes:
            self._counts["fallbacks"] += 1
            log.info(
                "room %s: %d landing bytes exceed the pool (%d): sent grant-less",
                effect.room,
                sizing.total_bytes,
                self.config.capacity_bytes,
            )
            return {}
        if not self._waiting:
            grants = self._try(effect, topology, sizing.total_bytes)
            if grants is not None:
                return grants
        self._counts["waits"] += 1
        self._waiting[effect.room] = (effect, topology, sizing.total_bytes)
        return None

    def _try(
        self, effect: LeaseLanding, topology: Topology, nbytes: int
    ) -> dict[PeerKey, LandingGrant] | None:
        self.prepare()
        size = _aligned(nbytes)
        offset = self._free.take(size)
        if offset is None:
            return None
        slots = int(effect.dst_pages.size) - effect.prefix_pages
        plan = plan_landing(
            self._layout,
            topology,
            self._rank,
            first_position=effect.prefix_pages,
            slots=slots,
            base=self.address + offset,
        )
        self._leases[effect.room] = _Lease(offset=offset, nbytes=size, plan=plan)
        self._in_use += size
        self._counts["peak"] = max(self._counts["peak"], self._in_use)
        self._counts["leases"] += 1
        grants: dict[PeerKey, LandingGrant] = {}
        for key in effect.sources:
            index = int(np.flatnonzero(plan.source_tp_rank == key[1].tp)[0])
            grants[key] = LandingGrant(
                address=self.address + offset + int(plan.offset[index]),
                nbytes=int(plan.nbytes[index]),
                first_position=effect.prefix_pages,
                slots=slots,
            )
        return grants

    def release(self, room: RoomId) -> list[tuple[RoomId, dict[PeerKey, LandingGrant]]]:
        """The room's pages are released: its lease comes back (or it stops waiting). Returns the
        waiting rooms that now got their lease, in arrival order."""
        self._waiting.pop(room, None)
        lease = self._leases.pop(room, None)
        if lease is None:
            return []
        self._free.give(lease.offset, lease.nbytes)
        self._in_use -= lease.nbytes
        served: list[tuple[RoomId, dict[PeerKey, LandingGrant]]] = []
        while self._waiting:
            waiting_room, (effect, topology, nbytes) = next(iter(self._waiting.items()))
            grants = self._try(effect, topology, nbytes)
            if grants is None:
                break
            del self._waiting[waiting_room]
            served.append((waiting_room, grants))
        return served

    # ------------------------------------------------------------------ the scatter

    def scatter(self, effect: ScatterLanding) -> None:
        """Copy every source's landed heads of ``effect.room`` into its pages (positions from
        ``prefix_pages`` on), synchronised. Raises on a room without a lease or a copy that fails."""
        lease = self._leases.get(effect.room)
        if lease is None or self._tensor is None:
            raise RuntimeError(f"room {effect.room} holds no landing lease")
        started = time.perf_counter()
        targets = self._scatter_targets()
        positions = np.arange(effect.prefix_pages, effect.dst_pages.size, dtype=np.int64)
        for source in sorted({key[1].tp for key, _ in effect.grants}):
            plan = plan_scatter(
                lease.plan,
                source,
                self._layout,
                positions=positions,
                dst_pages=effect.dst_pages,
                regions=targets.sources,
            )
            targets.scatter(plan, self._tensor, copy_threads=DEFAULT_COPY_THREADS)
        self._counts["scatters"] += 1
        self._scatter_s += time.perf_counter() - started

    def _scatter_targets(self) -> LandingRegions:
        if self._targets is None:
            views = BufferViews(self._layout, str(self._device))
            tensors = [views[i] if b.length else None for i, b in enumerate(self._layout.buffers)]
            self._targets = LandingRegions(self._layout, tensors)
        return self._targets

    # ------------------------------------------------------------------ lifecycle

    def prepare(self) -> bool:
        """Allocate and register the memory now (before the registration that tells prefill engines
        about this rank's regions); True when this call registered it, False when it already was."""
        if self._tensor is not None:
            return False
        tensor = torch.zeros(self.config.capacity_bytes, dtype=torch.uint8, device=self._device)
        self._registration = self._backend.register(tensor)
        self._tensor = tensor
        self.address = int(tensor.data_ptr())
        return True

    def statistics(self) -> LandingStatistics:
        return LandingStatistics(
            capacity_bytes=self.config.capacity_bytes,
            in_use_bytes=self._in_use,
            peak_in_use_bytes=self._counts["peak"],
            leases=self._counts["leases"],
            waits=self._counts["waits"],
            waiting=len(self._waiting),
            fallbacks=self._counts["fallbacks"],
            scatters=self._counts["scatters"],
            scatter_seconds=self._scatter_s,
        )

    def close(self) -> None:
        """Unregister the memory when no lease is out; with leases out (a room whose writes may still
        come) it stays registered until the backend closes. Idempotent."""
        self._waiting.clear()
        if self._leases:
            log.warning(
                "landing pool closed with %d lease(s) out: left registered until the backend closes",
                len(self._leases),
            )
            return
        if self._registration is not None:
            self._registration.close()
            self._registration = None


__all__ = ["ENV_VARS", "LandingConfig", "LandingPool", "LandingStatistics"]
