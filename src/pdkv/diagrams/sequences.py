"""Sequence diagrams of the protocol's scenarios, recorded from executions on the fake clock.

Owns: ``SCENARIOS`` (each a short script over ``pdkv.testing.EndpointPair``: the real endpoints,
the real codec, a loss-free link unless the story drops a message), the ``Recorder`` that watches
one run, and ``chart`` / ``render``, which run a scenario and write what crossed the wire and what
changed on each rank as a sequence chart (Mermaid ``sequenceDiagram``, or DOT). Nothing here is
drawn by hand: a change to the protocol changes the recorded exchange, and the committed
diagrams then differ (``pdkv diagram --check``).

Must not change the endpoints' behaviour: the recorder only looks (public queries, the effects the
harness carries out). Each scenario checks that its room ended as the story says
(``pdkv.DiagramScenarioError`` otherwise), so a diagram never shows a story that no longer happens.

Reading a diagram (Mermaid; the DOT form of ``pdkv.diagrams._chart`` draws the same steps):
``->>`` a control message, ``-x`` one lost on the wire, ``-->>`` the KV
writes of a chunk (data plane) as they start; notes are state changes of the room (R), its abort
handshake (A), its chunks (C<n>) and the per-layer contexts of the harness (L @<token>); times are
fake-clock seconds when the event happened.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

import attrs

from pdkv.diagrams._chart import Chart, Step, StepKind
from pdkv.errors import DiagramScenarioError
from pdkv.protocol.config import Timeouts
from pdkv.protocol.effects import Effect, FailureCause, ForgetPeer, ReleasePages, Send, SubmitFence
from pdkv.protocol.ids import Endpoint, RoomId
from pdkv.protocol.messages import AbortAck, Heartbeat, HeartbeatAck, Message
from pdkv.protocol.poll import KVPoll
from pdkv.protocol.prefill import PrefillEndpoint
from pdkv.runtime.json_log import describe
from pdkv.testing.endpoint_pair import EndpointPair, LinkFaults, RoomPlan, context_chunk

ROOM = RoomId(7)
"""The one room every scenario follows."""

_QUIET = (Heartbeat, HeartbeatAck)


def _failed(scenario: str, what: str) -> DiagramScenarioError:
    """``DiagramScenarioError`` naming the scenario and what went otherwise than its story."""
    return DiagramScenarioError(f"scenario {scenario!r}: {what}", scenario=scenario)


@attrs.frozen(kw_only=True)
class Arrow:
    time: float
    sender: str
    receiver: str
    text: str
    kind: StepKind
    """``MESSAGE``, ``LOST`` or ``DATA``."""


@attrs.frozen(kw_only=True)
class NoteEvent:
    time: float
    who: str
    text: str


Event = Arrow | NoteEvent


class Recorder(EndpointPair):
    """An ``EndpointPair`` that writes down, in order, what happens to ``ROOM``.

    ``recording`` off: set-up (registration) runs unrecorded. ``hung``: participants that neither
    act nor are heard (a hung process): what they would send is dropped, what they would note is
    not written.
    """

    def __init__(
        self,
        *,
        cp_size: int,
        timeouts: Timeouts,
        transfer_time: float,
        show: Sequence[type[Message]] = (),
        fail_write: Callable[[RoomId, int, int], bool] | None = None,
    ) -> None:
        super().__init__(
            cp_size=cp_size,
            timeouts=timeouts,
            transfer_time=transfer_time,
            faults=LinkFaults(latency=0.001),
            fail_write=fail_write,
        )
        self.events: list[Event] = []
        self.recording = True
        self.hung: set[str] = set()
        self._show = tuple(show)
        self._seen: dict[str, tuple[object, list[str]]] = {}
        self._layered: set[tuple[int, int]] = set()  # (id of the incarnation, chunk index) sent per layer

    # ---------------------------------------------------------------- names

    def participants(self) -> list[tuple[str, str]]:
        """``(id, label)`` of each lane: the decode rank, then the prefill CP ranks."""
        lanes = [("D", "decode rank")]
        lanes += [(f"P{cp}", f"prefill cp{cp}") for cp in range(len(self.prefills))]
        return lanes

    def _lane(self, who: str) -> str:
        return "D" if who == "decode" else "P" + who.removeprefix("prefill")

    def _lane_of(self, address: Endpoint) -> str:
        if address == self.decode_endpoint:
            return "D"
        return f"P{self.prefill_endpoints.index(address)}"

    # ---------------------------------------------------------------- recording

    def note(self, who: str, text: str) -> None:
        """A line of the story (``who``: ``decode`` or ``prefill<cp>``), e.g. what the scheduler did."""
        if self.recording:
            self.events.append(NoteEvent(time=self.clock.now, who=self._lane(who), text=text))

    def _apply(self, who: str, effects: Sequence[Effect]) -> None:
        self._look()
        for effect in effects:
            if who in self.hung and isinstance(effect, Send):
                continue
            dropped = self.link.statistics().dropped
            super()._apply(who, [effect])
            if not self.recording or who in self.hung:
                continue
            if isinstance(effect, Send) and not (
                isinstance(effect.message, _QUIET) and not isinstance(effect.message, self._show)
            ):
                lost = self.link.statistics().dropped > dropped
                receiver = self._lane_of(effect.to)
                if receiver in {self._lane(h) for h in self.hung}:
                    lost = True
                self.events.append(
                    Arrow(
                        time=self.clock.now,
                        sender=self._lane(who),
                        receiver=receiver,
                        text=describe(effect.message) + (" (lost)" if lost else ""),
                        kind=StepKind.LOST if lost else StepKind.MESSAGE,
                    )
                )
            elif isinstance(effect, SubmitFence) and effect.room == ROOM:
                self.events.append(
                    Arrow(
                        time=self.clock.now,
                        sender=self._lane(who),
                        receiver="D",
                        text="fence: a block of the failed write, through the same engine queue",
                        kind=StepKind.DATA,
                    )
                )
            elif isinstance(effect, ReleasePages) and effect.room == ROOM:
                self.note(who, f"ReleasePages({effect.kind.value})")
            elif isinstance(effect, ForgetPeer):
                self.note(who, f"ForgetPeer({self._lane_of(effect.endpoint)})")
            self._look()

    def step(self) -> None:
        super().step()
        self._look()

    def _look(self) -> None:
        """Note every state change of ``ROOM`` seen on each rank since the last look."""
        if not self.recording:
            return
        snapshots: list[tuple[str, object, list[str]]] = []
        if "decode" not in self.hung:
            snapshots.append(("decode", self.decode, self._decode_view()))
        for cp, p in enumerate(self.prefills):
            if f"prefill{cp}" not in self.hung:
                snapshots.append((f"prefill{cp}", p, self._prefill_view(p)))
        for who, endpoint, view in snapshots:
            before_endpoint, before = self._seen.get(who, (endpoint, []))
            if before_endpoint is not endpoint:
                before = []  # a new incarnation: it starts from nothing
            self._seen[who] = (endpoint, view)
            changed = [line for line in view if line not in before]
            contexts_now = {line.split()[1] for line in view if line.startswith("L ")}
            gone = {line.split()[1] for line in before if line.startswith("L ")} - contexts_now
            changed += [f"L {tag} ended" for tag in sorted(gone)]
            for line in changed:
                if line.startswith("W "):  # a chunk's writes started: the data plane
                    self.events.append(
                        Arrow(
                            time=self.clock.now,
                            sender=self._lane(who),
                            receiver="D",
                            text=line[2:],
                            kind=StepKind.DATA,
                        )
                    )
                else:
                    self.note(who, line)

    def _decode_view(self) -> list[str]:
        if not self.decode.has_room(ROOM):
            return []
        view = _room_view(self.decode.room_history(ROOM), self.decode.failure_cause(ROOM))
        abort = self.decode.abort_state(ROOM)
        if abort is not None:
            view.append(f"A {abort.name}")
        return view

    def _prefill_view(self, p: PrefillEndpoint) -> list[str]:
        if not p.has_room(ROOM):
            return []
        view = _room_view(p.room_history(ROOM), p.failure_cause(ROOM))
        # This incarnation's per-layer contexts (the real LayerBook): their state, and their layer
        # writes while they land. A per-layer chunk has no write of its own.
        contexts = p.layers.contexts(ROOM) if p in self.prefills else []
        self._layered.update((id(p), context_chunk(c)) for c in contexts)
        for i, chunk in enumerate(p.chunk_states(ROOM)):
            view.append(f"C{i} {chunk.name}")
            if chunk.name not in ("REGISTERED", "SKIPPED") and (id(p), i) not in self._layered:
                view.append(f"W KV writes of chunk {i}")
        for context in contexts:
            view.append(f"L @{context.start_token} {context.state.name}")
            if any(w.context is context for w in self._layer_writes):
                view.append(f"W per-layer KV writes of chunk @{context.start_token}")
        return view


def _room_view(history: Sequence[enum.Enum], cause: FailureCause | None) -> list[str]:
    view = [f"R {i}: {state.name}" for i, state in enumerate(history)]
    if cause is not None and history[-1].name == "FAILED":
        view[-1] += f" ({cause.value})"
    return view


def _pretty(line: str) -> str:
    """``R 2: TRANSFERRING`` -> ``R TRANSFERRING`` (the index only keeps repeated states apart)."""
    if line.startswith("R ") and ": " in line:
        head, state = line.split(": ", 1)
        return f"R {state}" if head[2:].isdigit() else line
    return line


# -------------------------------------------------------------------- scenarios


@attrs.frozen(kw_only=True)
class Scenario:
    name: str
    """File stem and protocol.md block name: ``seq_<name>``."""
    title: str
    story: str
    """One paragraph for protocol.md: what happens and what to look at."""
    script: Callable[[], Recorder]


def _pair(
    *,
    cp: int = 1,
    timeouts: Timeouts | None = None,
    transfer_time: float = 0.01,
    show: Sequence[type[Message]] = (),
    fail_write: Callable[[RoomId, int, int], bool] | None = None,
) -> Recorder:
    return Recorder(
        cp_size=cp,
        # The settle time is short here (real default: 300 s) so that the stories show the release.
        timeouts=timeouts or Timeouts(quarantine_settle=1.0),
        transfer_time=transfer_time,
        show=show,
        fail_write=fail_write,
    )


def _registered(r: Recorder) -> Recorder:
    """Register every rank before recording: the stories start with a registered pair."""
    r.recording = False
    r.connect()
    r.run(until=0.1)
    if not all(r.decode.peer_ready(t) for t in r.targets()):
        raise _failed("set-up", "the ranks did not register")
    r.recording = True
    return r


def _settle(r: Recorder, name: str, *, expect: KVPoll, safe: bool | None = None) -> Recorder:
    r.settle(limit=120.0)
    if r.decode.poll(ROOM) is not expect:
        raise _failed(name, f"decode ended {r.decode.poll(ROOM).name}, expected {expect.name}")
    if safe is not None and r.decode.release_was_safe(ROOM) is not safe:
        raise _failed(name, f"release safe={not safe}, expected safe={safe}")
    if r.violations:
        raise _failed(name, f"abort safety violated: {r.violations}")
    return r


def happy_path_cp2() -> Recorder:
    r = _pair(cp=2)
    r.connect()
    r.note("decode", "scheduler: receiver.init (4 pages)")
    r.add_room(RoomPlan(room=ROOM, num_pages=4, chunk_pages=(4,)))
    return _settle(r, "happy_path_cp2", expect=KVPoll.Success)


def chunked_prefix() -> Recorder:
    r = _registered(_pair())
    r.note("decode", "scheduler: receiver.init (10 pages, 4 cached)")
    r.add_room(RoomPlan(room=ROOM, num_pages=10, chunk_pages=(3, 3), prefix_pages=4))
    return _settle(r, "chunked_prefix", expect=KVPoll.Success)


def decode_abort() -> Recorder:
    r = _registered(_pair(transfer_time=0.02))
    start = r.clock.now
    r.add_room(RoomPlan(room=ROOM, num_pages=8, chunk_pages=(4, 4), abort_decode_at=start + 0.01))
    return _settle(r, "decode_abort", expect=KVPoll.Failed, safe=True)


def prefill_abort() -> Recorder:
    r = _registered(_pair(transfer_time=0.02))
    start = r.clock.now
    r.add_room(RoomPlan(room=ROOM, num_pages=8, chunk_pages=(4, 4), abort_prefill_at=start + 0.01))
    return _settle(r, "prefill_abort", expect=KVPoll.Failed, safe=True)


def lost_abort_ack() -> Recorder:
    r = _registered(_pair(transfer_time=0.02))
    lost: list[Message] = []

    def drop_first_ack(to: Endpoint, message: Message) -> bool:
        if isinstance(message, AbortAck) and not lost:
            lost.append(message)
            return True
        return False

    r.link.drop_if = drop_first_ack
    start = r.clock.now
    r.add_room(RoomPlan(room=ROOM, num_pages=4, chunk_pages=(4,), abort_decode_at=start + 0.005))
    r = _settle(r, "lost_abort_ack", expect=KVPoll.Failed, safe=True)
    if not lost:
        raise _failed("lost_abort_ack", "no AbortAck was dropped")
    return r


def failed_write_fenced() -> Recorder:
    r = _registered(_pair(transfer_time=0.02, fail_write=lambda room, chunk, rank: chunk == 0))
    r.add_room(RoomPlan(room=ROOM, num_pages=8, chunk_pages=(4, 4)))
    r = _settle(r, "failed_write_fenced", expect=KVPoll.Failed, safe=True)
    if r.fences_completed != 1:
        raise _failed("failed_write_fenced", f"{r.fences_completed} fences completed, expected 1")
    return r


def restarted_prefill() -> Recorder:
    r = _registered(_pair(transfer_time=1.0))
    r.add_room(RoomPlan(room=ROOM, num_pages=4, chunk_pages=(4,)))
    r.run(until=0.5)
    r.note("prefill0", "process restarts (epoch 2), its writes gone, route table announces it")
    r.restart_prefill(0, announce=True)
    return _settle(r, "restarted_prefill", expect=KVPoll.Failed, safe=True)


_LIVENESS = Timeouts(heartbeat_interval=1.0, heartbeat_timeout=3.0)


def silent_decode() -> Recorder:
    r = _registered(_pair(timeouts=_LIVENESS, transfer_time=5.0, show=_QUIET))
    r.add_room(RoomPlan(room=ROOM, num_pages=4, chunk_pages=(4,)))
    r.run(until=0.5)
    r.note("decode", "process hangs: reads and sends nothing")
    r.hung.add("decode")
    r.link.cut.add(r.decode_endpoint)
    r.run(until=6.0)
    p = r.prefills[0]
    if p.poll(ROOM) is not KVPoll.Failed or p.in_flight(ROOM):
        raise _failed("silent_decode", f"prefill room {p.poll(ROOM).name}, expected Failed and idle")
    return r


def per_layer() -> Recorder:
    """Hook for the per-layer path: each chunk's KV also goes layer by layer during its forward."""
    r = _registered(_pair(transfer_time=0.01))
    r.add_room(RoomPlan(room=ROOM, num_pages=8, chunk_pages=(4, 4), per_layer=True))
    return _settle(r, "per_layer", expect=KVPoll.Success)


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        name="happy_path_cp2",
        title="Happy path, prefill CP 2",
        story="The decode rank registers with both CP ranks of the prefill instance, sends one "
        "TransferRequest per rank (the full page list; each rank writes the pages it owns) and "
        "succeeds when both report Success. Registration is shown here only.",
        script=happy_path_cp2,
    ),
    Scenario(
        name="chunked_prefix",
        title="Chunked prefill with a cached prefix",
        story="The decode rank holds the first 4 of 10 pages (prefix cache): its request says so, "
        "and the prefill side sends two chunks of 3 pages from position 4; Success after the last.",
        script=chunked_prefix,
    ),
    Scenario(
        name="decode_abort",
        title="Decode abort mid-transfer",
        story="The decode scheduler aborts (`aborted_here`) while chunk 0 is being written: Abort goes "
        "out at once; the prefill rank fails the room, lets the writes already in flight end, and only "
        "then sends AbortAck; the decode rank releases the pages (safe) on the ack, not before.",
        script=decode_abort,
    ),
    Scenario(
        name="prefill_abort",
        title="Prefill abort",
        story="The prefill scheduler aborts mid-transfer: TransferStatus(Failed) tells the decode rank, "
        "which fails the room and answers with Abort; the AbortAck waits for the writes in flight; "
        "then the pages are released (acked).",
        script=prefill_abort,
    ),
    Scenario(
        name="lost_abort_ack",
        title="A lost AbortAck",
        story="The first AbortAck is lost on the wire. The decode rank keeps the pages and resends "
        "the Abort after `abort_resend` (1 s); the prefill rank, already acked, answers again at once; "
        "only then are the pages released.",
        script=lost_abort_ack,
    ),
    Scenario(
        name="failed_write_fenced",
        title="A failed write is fenced before the AbortAck",
        story="The engine fails chunk 0's write: the prefill rank fails the room and says so; the "
        "decode rank answers with Abort. Bytes of a failed batch may still sit in the engine's queue, "
        "so before acknowledging, the prefill rank writes one block of it again through the same "
        "queue (a fence) and sends AbortAck only once that write completed, saying it was fenced. "
        "The fence drained the engine's queue, not the connection that carried the failed write, "
        "so the decode rank lets the pages settle (quarantine_settle, 1 s here) before they come "
        "back: a time bound, counted as settled, not a proof.",
        script=failed_write_fenced,
    ),
    Scenario(
        name="restarted_prefill",
        title="A restarted prefill rank",
        story="The prefill process restarts behind the same address (epoch 2) while it writes; the "
        "route table announces it. The decode rank fails the room (peer_restart), rebuilds the socket "
        "(ForgetPeer), registers again, and the new process acknowledges the Abort of a room it never "
        "had. That ack says nothing of the bytes the old process left in its sockets: the pages "
        "settle (1 s here) before they come back.",
        script=restarted_prefill,
    ),
    Scenario(
        name="silent_decode",
        title="A silent decode rank",
        story="The decode process hangs mid-transfer (heartbeat 1 s, timeout 3 s here). The prefill "
        "rank's heartbeats go unanswered; after `heartbeat_timeout` it forgets the rank "
        "(ForgetPeer), fails the room (peer_silent) and tells it Failed, which nobody reads.",
        script=silent_decode,
    ),
    Scenario(
        name="per_layer",
        title="Per-layer transfer (harness view)",
        story="Each chunk goes layer by layer while its forward runs: its context (L) registers before "
        "the forward, each layer is written when the forward reports it, and the chunk's send() at the "
        "forward's end finishes the context (no chunk write of its own); the room succeeds once the "
        "last context's writes ended.",
        script=per_layer,
    ),
)


def chart(scenario: Scenario) -> Chart:
    """Run ``scenario`` and return what happened as a ``Chart`` (notes of one lane at one instant
    merged into one note)."""
    recorder = scenario.script()
    steps: list[Step] = []
    pending: list[NoteEvent] = []

    def flush() -> None:
        if pending:
            lines = tuple(_pretty(n.text) for n in pending)
            steps.append(
                Step(kind=StepKind.NOTE, lane=pending[0].who, time=_stamp(pending[0].time), lines=lines)
            )
            pending.clear()

    for event in recorder.events:
        if isinstance(event, NoteEvent):
            if pending and (pending[0].who != event.who or pending[0].time != event.time):
                flush()
            pending.append(event)
            continue
        flush()
        steps.append(
            Step(
                kind=event.kind,
                lane=event.sender,
                to=event.receiver,
                time=_stamp(event.time),
                lines=(event.text,),
            )
        )
    flush()
    return Chart(title=scenario.title, lanes=tuple(recorder.participants()), steps=tuple(steps))


def render(scenario: Scenario) -> str:
    """Run ``scenario`` and return its Mermaid ``sequenceDiagram``."""
    return chart(scenario).mermaid()


def _stamp(time: float) -> str:
    return f"{time:.3f}s"


def file_stem(scenario: Scenario) -> str:
    return f"seq_{scenario.name}"


__all__ = ["ROOM", "SCENARIOS", "Recorder", "Scenario", "chart", "file_stem", "render"]
