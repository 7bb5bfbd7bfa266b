"""Per-layer contexts of one prefill rank, sans-IO: every rule that decides what a context writes and
how it ends (DESIGN sections 5 and 7). No threads, no clock reads (``now`` is a parameter), no I/O.

Owns: ``LayerBook`` (the contexts of every room, a FIFO per room keyed by the chunk's start token),
``LayerContext`` (one (room, chunk): its ``PerLayer`` machine, the layers routed to it and submitted,
why it stopped), the finish verdicts and the counters. ``pdkv.runtime.per_layer`` holds the book
under its lock and carries its decisions out: it plans blocks, runs the submission lanes, waits for
ready events and for the engine, and feeds every outcome back here. The room-level consequences
(in flight from the first write, AbortAck, Success) are the prefill endpoint's
(``layer_writes_started`` / ``layer_writes_ended``); this book says when to call them.

Rules:

- Dedup: a (room, start token) registers once; a second registration is a duplicate and changes
  nothing.
- FIFO: a layer event goes, per room, to the oldest context still waiting for that layer (chunk N+1
  may register while chunk N's forward runs). A context that stopped (FAILING) still takes its
  events, so a later chunk never receives a layer its own forward has not written; a cancelled
  room's contexts take none (the whole room stopped).
- Fan-out: a context has one or several destinations (decode TP above prefill TP); each layer goes
  to every one, and a layer counts as submitted once it went to all of them.
- Submitting: only COLLECTING, LAYERS_SUBMITTED and AWAITING_LAYERS contexts submit. The first
  submission of a context needs the endpoint's consent (``first_write``): refused, the context is
  cancelled before any byte of it is written.
- Finish (``send()``): a context ends only after every write it submitted ended. Until every layer
  was submitted the finisher waits, at most ``finish_timeout_s`` from ``send()``; a layer that never
  came, a write that failed meanwhile or pages other than the registered ones break the context
  (FAILING: nothing more is submitted; FAILED once drained).
- Cancel (the room failed, was aborted, or completed without the chunk): every submitting context
  stops (CANCELLING) and is dropped once drained; a COMPLETING one is left to its finisher.
- A context that wrote reports the end of its writes exactly once (``ended``), whatever way it ended.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import Final, Generic, TypeVar

import attrs
import numpy as np

from pdkv.errors import LocalProtocolError
from pdkv.mapping import LayerKey
from pdkv.protocol.ids import RoomId
from pdkv.protocol.machines import PerLayerMachine, PerLayerState, PerLayerTrigger
from pdkv.protocol.machines.per_layer import SUBMITTING
from pdkv.protocol.messages import IntArray

DEFAULT_FINISH_TIMEOUT_S: Final = 60.0
"""From ``send()`` of a per-layer chunk until every layer was submitted and written
(``PDKV_PER_LAYER_FINISH_TIMEOUT``)."""

W = TypeVar("W")
"""What the runtime keeps beside a context (its engine job, planned blocks ...): opaque here."""

_S = PerLayerState
_T = PerLayerTrigger

# Contexts a layer event may be routed to: those still waiting for layers (a FAILING one keeps
# taking its own layers' events, which are then discarded).
_ROUTABLE = frozenset({_S.COLLECTING, _S.AWAITING_LAYERS, _S.FAILING})


@attrs.define(eq=False)
class LayerContext(Generic[W]):
    """One (room, chunk) sent layer by layer. Read its fields; change it only through the book."""

    room: RoomId
    start_token: int
    pages: IntArray
    peers: tuple[str, ...]  # destination sessions (decode ranks), each with its submission lane
    expected: frozenset[LayerKey]
    registered_at: float
    work: W
    machine: PerLayerMachine
    seen: set[LayerKey] = attrs.Factory(set)  # layer events routed to this context
    submitted_to: dict[str, set[LayerKey]] = attrs.Factory(dict)  # per peer: layers handed to the engine
    stop_reason: str = ""  # why it is CANCELLING/FAILING (or ended so)
    first_submit_at: float | None = None  # when its first write was consented (None: it never wrote)
    finish_deadline: float | None = None  # set by send(): the finisher gives up at this time

    @property
    def writing(self) -> bool:
        """Has the endpoint consented to its first write? From then on the context counts as a write
        of the room in flight until it ends (terminal)."""
        return self.first_submit_at is not None

    @property
    def state(self) -> PerLayerState:
        return self.machine.state

    @property
    def terminal(self) -> bool:
        return self.machine.is_terminal

    @property
    def submitting(self) -> bool:
        """May layers of this context still be submitted?"""
        return self.machine.state in SUBMITTING

    @property
    def submitted(self) -> frozenset[LayerKey]:
        """Layers submitted to every destination."""
        sets = [self.submitted_to.get(peer, set()) for peer in self.peers]
        return frozenset(set.intersection(*sets)) if sets else frozenset()

    def missing(self) -> list[LayerKey]:
        return sorted(self.expected - self.submitted, key=lambda k: k.sort_key)


class Verdict(enum.Enum):
    """What the finisher of a context (``send()``) does next."""

    WAIT = "wait"  # layers still missing: wait (until the deadline) for the next change
    COMPLETE = "complete"  # every layer submitted: wait for the engine, then ``ended`` COMPLETE or FAIL
    DRAIN_FAIL = "drain_fail"  # broken: wait for the submitted writes, then ``ended`` FAIL
    DRAIN_DROP = "drain_drop"  # cancelled: wait for the submitted writes, then ``ended`` DROP
    DROPPED = "dropped"  # dropped before send(): nothing to wait for (the record is gone)


@attrs.frozen(kw_only=True)
class LayerBookStatistics:
    """The book's counters since it was made."""

    registered: int
    duplicates: int
    fallbacks: int
    layer_events: int
    layers_submitted: int
    finished: int
    failed: int
    dropped: int
    open_contexts: int


@attrs.define(eq=False)
class _Room(Generic[W]):
    contexts: dict[int, LayerContext[W]] = attrs.Factory(dict)  # by start token, in registration order
    pending_drains: int = 0  # drains queued on lanes and not yet run
    forgotten: bool = False  # the scheduler cleared the room: remove contexts once they end


class LayerBook(Generic[W]):
    """The per-layer contexts of one prefill rank (see the module docstring for the rules)."""

    def __init__(self, *, finish_timeout_s: float) -> None:
        self.finish_timeout_s = finish_timeout_s
        self._rooms: dict[RoomId, _Room[W]] = {}
        self._registered = self._duplicates = self._fallbacks = 0
        self._layer_events = self._layers_submitted = 0
        self._finished = self._failed = self._dropped = 0

    # ------------------------------------------------------------------ reading

    def context(self, room: RoomId, start_token: int) -> LayerContext[W] | None:
        r = self._rooms.get(room)
        return None if r is None else r.contexts.get(start_token)

    def contexts(self, room: RoomId) -> list[LayerContext[W]]:
        """The room's contexts in registration (chunk) order."""
        r = self._rooms.get(room)
        return [] if r is None else list(r.contexts.values())

    def all_contexts(self) -> Iterator[LayerContext[W]]:
        for r in self._rooms.values():
            yield from r.contexts.values()

    def rooms(self) -> list[RoomId]:
        return list(self._rooms)

    def writing(self, room: RoomId) -> list[int]:
        """Start tokens of the room's contexts whose writes may still land: the first write was
        consented and the context has not ended (it is terminal once its writes ended)."""
        r = self._rooms.get(room)
        if r is None:
            return []
        return [c.start_token for c in r.contexts.values() if c.writing and not c.terminal]

    def is_registered(self, room: RoomId, start_token: int) -> bool:
        return self.context(room, start_token) is not None

    def statistics(self) -> LayerBookStatistics:
        return LayerBookStatistics(
            registered=self._registered,
            duplicates=self._duplicates,
            fallbacks=self._fallbacks,
            layer_events=self._layer_events,
            layers_submitted=self._layers_submitted,
            finished=self._finished,
            failed=self._failed,
            dropped=self._dropped,
            open_contexts=sum(1 for c in self.all_contexts() if not c.terminal),
        )

    # ------------------------------------------------------------------ inputs

    def register(
        self,
        room: RoomId,
        start_token: int,
        *,
        pages: IntArray,
        peers: tuple[str, ...],
        expected: frozenset[LayerKey],
        work: W,
        now: float,
    ) -> LayerContext[W] | None:
        """A chunk registered for per-layer transfer; None when (room, start_token) already is."""
        if self.is_registered(room, start_token):
            self._duplicates += 1
            return None
        context = LayerContext(
            room=room,
            start_token=start_token,
            pages=pages,
            peers=peers,
            expected=expected,
            registered_at=now,
            work=work,
            machine=PerLayerMachine(f"room {room} chunk@{start_token}"),
        )
        self._rooms.setdefault(room, _Room()).contexts[start_token] = context
        self._registered += 1
        return context

    def duplicate(self) -> None:
        """A registration found (room, chunk) registered (counted)."""
        self._duplicates += 1

    def fallback(self) -> None:
        """A chunk went the monolithic way (counted)."""
        self._fallbacks += 1

    def layer_ready(self, key: LayerKey) -> list[LayerContext[W]]:
        """The forward wrote layer ``key``: per room, the oldest context still waiting for it takes the
        event. Returns those that are to submit it (a FAILING one takes it and submits nothing)."""
        self._layer_events += 1
        targets: list[LayerContext[W]] = []
        for r in self._rooms.values():
            for context in r.contexts.values():
                if context.machine.state in _ROUTABLE and key not in context.seen:
                    context.seen.add(key)
                    if context.submitting:
                        targets.append(context)
                    break
        return targets

    def first_write(self, context: LayerContext[W], allowed: bool, now: float) -> bool:
        """The endpoint's answer before the context's first write (``layer_writes_started``). With
        ``allowed`` the endpoint counts the context in flight from now on (its end is reported, even
        if it stopped meanwhile); refused, the context is cancelled. True: submit."""
        if not context.writing:
            if not allowed:
                if context.submitting:
                    self._stop(context, _T.CANCEL, "the room can no longer be written")
                return False
            context.first_submit_at = now
        return context.submitting

    def submitted(self, context: LayerContext[W], key: LayerKey | None, peer: str) -> None:
        """A layer's blocks (``key``; None: the pages resident before the forward) for destination
        ``peer`` went to the engine; once every layer went to every destination, the context has
        submitted everything."""
        if key is None:
            return
        if peer not in context.peers:
            raise LocalProtocolError(f"{context.machine.label}: {peer} is not a destination of it")
        done = context.submitted_to.setdefault(peer, set())
        if key in done:
            raise LocalProtocolError(f"{context.machine.label}: layer {key} submitted twice to {peer}")
        done.add(key)
        self._layers_submitted += 1
        if context.submitted >= context.expected and context.state in (_S.COLLECTING, _S.AWAITING_LAYERS):
            context.machine.fire(_T.ALL_LAYERS_SUBMITTED)

    def broken(self, context: LayerContext[W], reason: str) -> None:
        """A layer of the context cannot be written (its ready wait failed or timed out, the event
        queue is full, an internal error): it stops submitting, and fails once drained."""
        if context.submitting:
            self._stop(context, _T.BREAK, reason)

    def cancel(self, room: RoomId, reason: str) -> list[LayerContext[W]]:
        """The room failed, was aborted, or completed without these chunks: every submitting context
        stops. Returns the contexts that are not terminal (their writes must be awaited)."""
        r = self._rooms.get(room)
        if r is None:
            return []
        for context in r.contexts.values():
            if context.submitting:
                self._stop(context, _T.CANCEL, reason)
        return [c for c in r.contexts.values() if not c.terminal]

    def pending_drains(self, room: RoomId) -> int:
        r = self._rooms.get(room)
        return 0 if r is None else r.pending_drains

    def drain_queued(self, room: RoomId, count: int) -> None:
        """``count`` drains of the room were queued on submission lanes."""
        self._rooms[room].pending_drains += count

    def drain_ran(self, room: RoomId) -> None:
        r = self._rooms.get(room)
        if r is not None:
            r.pending_drains -= 1
            self._maybe_forget_room(room, r)

    def begin_finish(self, context: LayerContext[W], pages: IntArray | None, now: float) -> Verdict:
        """``send()`` of the context's chunk: its deadline starts now. ``pages``: the chunk as sent."""
        if context.finish_deadline is not None:
            raise LocalProtocolError(f"{context.machine.label}: finished twice")
        context.finish_deadline = now + self.finish_timeout_s
        if context.state is _S.DROPPED:
            self._remove(context)
            return Verdict.DROPPED
        if context.submitting:
            if pages is not None and not np.array_equal(pages, context.pages):
                self._stop(
                    context,
                    _T.BREAK,
                    f"send() gave {pages.size} pages that differ from the {context.pages.size} "
                    "registered for this chunk",
                )
            else:
                context.machine.fire(_T.FINISH)
        return self.finish_check(context, now, job_failed=False)

    def finish_check(self, context: LayerContext[W], now: float, *, job_failed: bool) -> Verdict:
        """The finisher's next step (``job_failed``: a write of the context already failed)."""
        state = context.state
        if state is _S.AWAITING_LAYERS:
            deadline = context.finish_deadline
            if job_failed:
                self._stop(context, _T.BREAK, "a write failed while the forward ran")
            elif deadline is not None and now >= deadline:
                missing = context.missing()
                self._stop(
                    context,
                    _T.BREAK,
                    f"{len(missing)} of {len(context.expected)} layers never ended within "
                    f"{self.finish_timeout_s:g} s (first: {', '.join(map(str, missing[:4]))})",
                )
            else:
                return Verdict.WAIT
            state = context.state
        if state is _S.COMPLETING:
            return Verdict.COMPLETE
        if state is _S.FAILING:
            return Verdict.DRAIN_FAIL
        if state is _S.CANCELLING:
            return Verdict.DRAIN_DROP
        raise LocalProtocolError(f"{context.machine.label}: finish in state {state.value}")

    def ended(self, context: LayerContext[W], trigger: PerLayerTrigger) -> bool:
        """Every write the context submitted has ended; ``trigger`` is COMPLETE, FAIL or DROP (the
        context is terminal after it, so this comes once). True when the room is owed the end of its
        writes (``layer_writes_ended``): only for a context that wrote."""
        if trigger is _T.FAIL and context.submitting:
            self._stop(context, _T.BREAK, context.stop_reason or "failed")
        context.machine.fire(trigger)
        if trigger is _T.COMPLETE:
            self._finished += 1
        elif trigger is _T.FAIL:
            self._failed += 1
        else:
            self._dropped += 1
        r = self._rooms.get(context.room)
        if context.finish_deadline is not None or (r is not None and r.forgotten):
            self._remove(context)  # a finisher had it, or nobody will ask any more
        return context.writing

    def forget(self, room: RoomId) -> None:
        """The scheduler cleared the room: discard its ended contexts (the rest go once they end)."""
        r = self._rooms.get(room)
        if r is None:
            return
        r.forgotten = True
        for context in [c for c in r.contexts.values() if c.terminal]:
            self._remove(context)

    # ------------------------------------------------------------------ internals

    def _stop(self, context: LayerContext[W], trigger: PerLayerTrigger, reason: str) -> None:
        context.machine.fire(trigger)
        context.stop_reason = reason

    def _remove(self, context: LayerContext[W]) -> None:
        r = self._rooms.get(context.room)
        if r is None:
            return
        if r.contexts.get(context.start_token) is context:
            del r.contexts[context.start_token]
        self._maybe_forget_room(context.room, r)

    def _maybe_forget_room(self, room: RoomId, r: _Room[W]) -> None:
        if not r.contexts and r.pending_drains == 0 and self._rooms.get(room) is r:
            del self._rooms[room]


__all__ = ["DEFAULT_FINISH_TIMEOUT_S", "LayerBook", "LayerBookStatistics", "LayerContext", "Verdict"]
