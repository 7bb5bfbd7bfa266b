"""The per-layer contexts' rules, sans-IO (``pdkv.protocol.layers.LayerBook``): dedup, the FIFO of a
room's chunks, the endpoint's consent before the first write, finish with its deadline, cancel, and
the end of a context's writes reported exactly once. A stateful test drives every input in any
order against an independent model of what each context may submit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdkv.errors import LocalProtocolError
from pdkv.mapping import LayerKey, ModelRole
from pdkv.protocol.ids import RoomId
from pdkv.protocol.layers import LayerBook, LayerContext, Verdict
from pdkv.protocol.machines import PerLayerState, PerLayerTrigger

L0, L1, L2 = (LayerKey(model=ModelRole.TARGET, layer_id=i) for i in range(3))
LAYERS = frozenset({L0, L1, L2})
ROOM = RoomId(7)
S = PerLayerState


def book(timeout_s: float = 10.0) -> LayerBook[str]:
    return LayerBook(finish_timeout_s=timeout_s)


def register(b: LayerBook[str], start: int, *, room: RoomId = ROOM, now: float = 0.0) -> LayerContext[str]:
    context = b.register(
        room,
        start,
        pages=np.arange(start, start + 2, dtype=np.int64),
        peers=("decode-a",),
        expected=LAYERS,
        work=f"work@{start}",
        now=now,
    )
    assert context is not None
    return context


def state(context: LayerContext[str]) -> PerLayerState:
    return context.state


def submit_all(b: LayerBook[str], context: LayerContext[str], *layers: LayerKey) -> None:
    for layer in layers:
        assert b.first_write(context, True, 1.0)
        b.submitted(context, layer, "decode-a")


def test_a_chunk_registers_once() -> None:
    b = book()
    first = register(b, 0)
    again = b.register(ROOM, 0, pages=np.arange(2), peers=("decode-a",), expected=LAYERS, work="x", now=1.0)
    assert again is None
    assert b.context(ROOM, 0) is first and first.work == "work@0"
    assert b.statistics().registered == 1 and b.statistics().duplicates == 1


def test_a_layer_goes_to_the_oldest_chunk_of_each_room_still_waiting_for_it() -> None:
    b = book()
    chunk0, chunk1 = register(b, 0), register(b, 32)
    other = register(b, 0, room=RoomId(8))
    assert b.layer_ready(L0) == [chunk0, other]
    assert b.layer_ready(L0) == [chunk1]  # chunk 0 had it: the next forward's layer is chunk 1's
    assert b.layer_ready(L0) == []  # nobody waits for it any more


def test_a_broken_chunk_keeps_taking_its_own_layers_so_the_next_chunk_never_gets_an_unwritten_one() -> None:
    b = book()
    chunk0, chunk1 = register(b, 0), register(b, 32)
    b.broken(chunk0, "waiting for layer target:0 failed")
    assert state(chunk0) is S.FAILING
    # Chunk 0's forward reports its layer 1: it is consumed by chunk 0 (which submits nothing), not
    # handed to chunk 1, whose own forward has not written it.
    assert b.layer_ready(L1) == []
    assert b.layer_ready(L1) == [chunk1]


def test_the_first_write_needs_the_endpoints_consent() -> None:
    b = book()
    refused = register(b, 0)
    assert not b.first_write(refused, False, 1.0)
    assert state(refused) is S.CANCELLING and refused.stop_reason == "the room can no longer be written"
    assert not refused.writing
    assert not b.ended(refused, PerLayerTrigger.DROP)  # it never wrote: nothing to report


def test_a_context_the_endpoint_counted_reports_its_end_even_if_cancelled_before_it_wrote() -> None:
    b = book()
    context = register(b, 0)
    b.cancel(ROOM, "aborted by decode")
    # The endpoint said yes just before the cancel landed: it counts the context in flight.
    assert not b.first_write(context, True, 1.0)  # nothing is submitted ...
    assert context.writing
    assert b.ended(context, PerLayerTrigger.DROP)  # ... but its end is reported
    with pytest.raises(LocalProtocolError):
        b.ended(context, PerLayerTrigger.DROP)  # and only once: an ended context cannot end again


def test_every_layer_submitted_then_send_completes() -> None:
    b = book()
    context = register(b, 0)
    submit_all(b, context, L0, L1, L2)
    assert state(context) is S.LAYERS_SUBMITTED
    assert b.begin_finish(context, context.pages, 2.0) is Verdict.COMPLETE
    assert state(context) is S.COMPLETING
    assert b.ended(context, PerLayerTrigger.COMPLETE)
    assert state(context) is S.DONE and b.context(ROOM, 0) is None


def test_send_before_the_last_layer_waits_until_its_deadline_then_fails_after_draining() -> None:
    b = book(timeout_s=5.0)
    context = register(b, 0)
    submit_all(b, context, L0)
    assert b.begin_finish(context, None, 10.0) is Verdict.WAIT
    assert b.finish_check(context, 14.9, job_failed=False) is Verdict.WAIT
    assert b.finish_check(context, 15.0, job_failed=False) is Verdict.DRAIN_FAIL
    assert state(context) is S.FAILING
    assert context.stop_reason.startswith("2 of 3 layers never ended within 5 s (first: target:1, target:2)")
    assert b.layer_ready(L1) == []  # a failing context submits nothing more
    assert b.ended(context, PerLayerTrigger.FAIL)
    assert state(context) is S.FAILED


def test_the_last_layer_after_send_completes_the_wait() -> None:
    b = book()
    context = register(b, 0)
    submit_all(b, context, L0, L1)
    assert b.begin_finish(context, None, 1.0) is Verdict.WAIT
    submit_all(b, context, L2)
    assert b.finish_check(context, 2.0, job_failed=False) is Verdict.COMPLETE


def test_a_write_failing_while_the_forward_runs_breaks_the_waiting_context() -> None:
    b = book()
    context = register(b, 0)
    submit_all(b, context, L0)
    assert b.begin_finish(context, None, 1.0) is Verdict.WAIT
    assert b.finish_check(context, 1.5, job_failed=True) is Verdict.DRAIN_FAIL
    assert context.stop_reason == "a write failed while the forward ran"


def test_send_with_other_pages_than_registered_fails_the_chunk() -> None:
    b = book()
    context = register(b, 0)
    submit_all(b, context, L0, L1, L2)
    assert b.begin_finish(context, np.array([9, 10]), 1.0) is Verdict.DRAIN_FAIL
    assert "differ from the 2 registered" in context.stop_reason


def test_send_twice_is_refused() -> None:
    b = book()
    context = register(b, 0)
    b.begin_finish(context, None, 1.0)
    with pytest.raises(LocalProtocolError, match="finished twice"):
        b.begin_finish(context, None, 1.0)


def test_cancel_leaves_a_completing_chunk_to_its_finisher() -> None:
    b = book()
    completing, collecting = register(b, 0), register(b, 32)
    submit_all(b, completing, L0, L1, L2)
    assert b.begin_finish(completing, None, 1.0) is Verdict.COMPLETE
    assert b.cancel(ROOM, "aborted by decode") == [completing, collecting]
    assert state(completing) is S.COMPLETING and state(collecting) is S.CANCELLING
    assert b.layer_ready(L0) == []


def test_a_chunk_dropped_before_send_answers_send_with_dropped() -> None:
    b = book()
    context = register(b, 0)
    submit_all(b, context, L0)
    b.cancel(ROOM, "aborted by decode")
    assert b.ended(context, PerLayerTrigger.DROP)
    assert b.context(ROOM, 0) is context  # kept: send() must learn it was dropped
    assert b.begin_finish(context, None, 2.0) is Verdict.DROPPED
    assert b.context(ROOM, 0) is None and b.rooms() == []


def test_a_cancelled_chunk_that_send_finds_is_drained_and_dropped() -> None:
    b = book()
    context = register(b, 0)
    b.cancel(ROOM, "room failed")
    assert b.begin_finish(context, None, 1.0) is Verdict.DRAIN_DROP


def test_forget_discards_ended_contexts_and_the_rest_once_they_end() -> None:
    b = book()
    ended, running = register(b, 0), register(b, 32)
    b.cancel(ROOM, "aborted")
    b.ended(ended, PerLayerTrigger.DROP)
    b.forget(ROOM)
    assert b.contexts(ROOM) == [running]
    b.ended(running, PerLayerTrigger.DROP)
    assert b.rooms() == []


# ------------------------------------------------------------------------------ stateful


class LayerBookMachine(RuleBasedStateMachine):
    """Registration, layer events, lane submissions (with or without the endpoint's consent), send(),
    deadlines, cancel, the end of drains and of finishers, in any order. The model keeps, per room,
    the chunks in registration order and the layers each forward reported to each chunk."""

    def __init__(self) -> None:
        super().__init__()
        self.book: LayerBook[str] = LayerBook(finish_timeout_s=5.0)
        self.now = 0.0
        self.queued: list[tuple[LayerContext[str], LayerKey]] = []  # routed, not yet submitted
        self.finishing: dict[int, Verdict] = {}  # id(context) -> the finisher's verdict
        self.reports: dict[int, int] = {}  # id(context) -> end reports
        self.contexts: list[LayerContext[str]] = []
        self.ended: set[int] = set()
        self.counted: set[int] = set()  # contexts the endpoint counts in flight (it said yes)

    @rule(room=st.sampled_from([RoomId(1), RoomId(2)]), chunk=st.integers(0, 2))
    def register(self, room: RoomId, chunk: int) -> None:
        context = self.book.register(
            room, chunk * 32, pages=np.arange(2), peers=("p",), expected=LAYERS, work="w", now=self.now
        )
        if context is not None:
            self.contexts.append(context)

    @rule(layer=st.sampled_from(sorted(LAYERS, key=lambda k: k.sort_key)))
    def layer_ready(self, layer: LayerKey) -> None:
        # FIFO, computed independently: per room, the first context (in registration order) that
        # still waits for layers and lacks this one.
        expected = []
        for room in self.book.rooms():
            for c in self.book.contexts(room):
                if c.state in (S.COLLECTING, S.AWAITING_LAYERS, S.FAILING) and layer not in c.seen:
                    if c.state is not S.FAILING:
                        expected.append(c)
                    break
        targets = self.book.layer_ready(layer)
        assert targets == expected
        self.queued += [(c, layer) for c in targets]

    @precondition(lambda self: bool(self.queued))
    @rule(allowed=st.booleans(), data=st.data())
    def lane_submits(self, allowed: bool, data: st.DataObject) -> None:
        context, layer = self.queued.pop(data.draw(st.integers(0, len(self.queued) - 1)))
        was_writing = context.writing
        if allowed and not was_writing:
            self.counted.add(id(context))  # asked before a cancel landed, or not: it counts now
        if self.book.first_write(context, allowed, self.now):
            assert allowed or was_writing
            self.book.submitted(context, layer, "p")

    @precondition(lambda self: any(c.finish_deadline is None for c in self.contexts))
    @rule(data=st.data())
    def send(self, data: st.DataObject) -> None:
        options = [c for c in self.contexts if c.finish_deadline is None]
        context = data.draw(st.sampled_from(options))
        verdict = self.book.begin_finish(context, None, self.now)
        self.finishing[id(context)] = verdict
        if verdict is Verdict.DROPPED:
            del self.finishing[id(context)]

    @rule(seconds=st.sampled_from([0.5, 3.0, 6.0]), job_failed=st.booleans())
    def time_passes(self, seconds: float, job_failed: bool) -> None:
        self.now += seconds
        for context in self.contexts:
            if self.finishing.get(id(context)) is Verdict.WAIT:
                self.finishing[id(context)] = self.book.finish_check(context, self.now, job_failed=job_failed)

    @rule(room=st.sampled_from([RoomId(1), RoomId(2)]))
    def cancel(self, room: RoomId) -> None:
        self.book.cancel(room, "room failed")
        for context in self.contexts:
            if self.finishing.get(id(context)) is Verdict.WAIT and context.room == room:
                self.finishing[id(context)] = self.book.finish_check(context, self.now, job_failed=False)

    @precondition(lambda self: bool(self.finishing))
    @rule(data=st.data(), ok=st.booleans())
    def finisher_ends(self, data: st.DataObject, ok: bool) -> None:
        context = data.draw(st.sampled_from([c for c in self.contexts if id(c) in self.finishing]))
        key = id(context)
        verdict = self.finishing[key]
        if verdict is Verdict.WAIT:
            verdict = self.book.finish_check(context, self.now, job_failed=False)
            self.finishing[key] = verdict
            if verdict is Verdict.WAIT:
                return
        del self.finishing[key]
        trigger = {
            Verdict.COMPLETE: PerLayerTrigger.COMPLETE if ok else PerLayerTrigger.FAIL,
            Verdict.DRAIN_FAIL: PerLayerTrigger.FAIL,
            Verdict.DRAIN_DROP: PerLayerTrigger.DROP,
        }[verdict]
        self._end(context, trigger)

    @rule(data=st.data())
    def drainer_ends(self, data: st.DataObject) -> None:
        unclaimed = [
            c
            for c in self.contexts
            if c.state in (S.CANCELLING, S.FAILING) and c.finish_deadline is None and id(c) not in self.ended
        ]
        if unclaimed:
            self._end(data.draw(st.sampled_from(unclaimed)), PerLayerTrigger.DROP)

    def _end(self, context: LayerContext[str], trigger: PerLayerTrigger) -> None:
        assert id(context) not in self.ended
        if self.book.ended(context, trigger):
            self.reports[id(context)] = self.reports.get(id(context), 0) + 1
        self.ended.add(id(context))
        self.queued = [(c, k) for c, k in self.queued if c is not context]

    @invariant()
    def layers_are_routed_before_submitted_and_never_beyond_the_model(self) -> None:
        for c in self.contexts:
            assert c.submitted <= c.seen <= c.expected

    @invariant()
    def every_layer_submitted_exactly_when_the_table_says_so(self) -> None:
        for c in self.contexts:
            if c.state in (S.LAYERS_SUBMITTED, S.COMPLETING):
                assert c.submitted == c.expected
            if c.state in (S.COLLECTING, S.AWAITING_LAYERS):
                assert c.submitted != c.expected

    @invariant()
    def terminal_only_through_the_end_of_its_writes(self) -> None:
        for c in self.contexts:
            assert c.terminal == (id(c) in self.ended)

    @invariant()
    def the_end_is_reported_once_and_only_for_a_context_that_wrote(self) -> None:
        for c in self.contexts:
            reports = self.reports.get(id(c), 0)
            assert reports == (1 if id(c) in self.counted and c.terminal else 0)


LayerBookMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_layer_book_stateful = LayerBookMachine.TestCase
