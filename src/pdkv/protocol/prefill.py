"""Sans-IO prefill endpoint: the protocol of one prefill rank, driven by inputs, answering with effects.

Owns: the sender rooms of one rank, their chunks and abort handshakes, the table of registered
decode ranks, request validation and the rank's deadlines. Must not do I/O, start threads or read a
clock: every input carries ``now``; the driver calls ``tick(now)`` at ``next_deadline()``.

Inputs come from three places:
- the network: ``receive(message, now)`` (any message from a registered decode rank, with its
  current epoch, is a sign of life);
- the scheduler: ``open_room`` (``sender.init``), ``queue_chunk`` (``sender.send``), ``abort_room``,
  ``close_room``, and the queries ``poll`` / ``failure`` / ``metric``;
- transfer workers: ``start_chunk`` (may answer "skip"), ``chunk_done``, ``chunk_failed``;
- per-layer transfer: ``layer_writes_started`` (may answer "skip") before a per-layer context's
  first write, ``layer_writes_ended`` once every write it submitted ended. A context writing counts
  as a chunk in flight: AbortAck, the RegisterAck of a restarted decode rank, Success and
  ``may_write`` all wait for it.

Safety rules this module enforces (DESIGN section 8):
- Success only when the room's positions were all submitted and written: after the first chunk's
  start (past 0 when the decode already holds a cached prefix) chunks are contiguous and
  non-overlapping, the last one ends exactly at ``num_pages``, and no page id repeats in the room's
  source pages or in a decode rank's destination pages. A scheduler's chunk that breaks the rule is
  refused at the call (``MappingError``, nothing changed); a request that breaks it fails the room;
- a chunk of a failed room is never started (Skipped), so nothing lands in pages the decode side may
  have reused; AbortAck is sent only when no chunk of the room is in flight;
- a TransferRequest for a room that was aborted or closed is refused (tombstones) and answered
  Failed with the reason at once (aborted, or "room id reused"), so a reordered request cannot
  revive a room after its AbortAck and a reused id costs the decode no deadline;
- a remote input never raises: it is a counted, logged fault or a state change;
- a room that the scheduler never opened is freed once it failed (its id stays a tombstone);
- every non-terminal room has a deadline;
- liveness of decode ranks: a Heartbeat goes to every registered decode rank each
  ``heartbeat_interval``; one that sent nothing for ``heartbeat_timeout`` is forgotten (its live
  rooms fail, its socket is rebuilt: ``ForgetPeer``) until it registers again. A message from a
  decode rank with a newer epoch means it restarted: its rooms fail and it is forgotten likewise.
  A forgotten rank that registers again gets its RegisterAck only once every write to it that was
  in flight when it was forgotten has ended (a restarted process may reuse that memory).
  A room that would write to a decode rank that is no longer registered fails loudly.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

import attrs
import numpy as np

from pdkv.errors import InvalidArgumentError, LocalProtocolError, MappingError
from pdkv.mapping import OwnershipPolicy, chunk_page_start, cp_owned
from pdkv.mapping._arrays import summarize
from pdkv.mapping.layout import BufferKind, BufferLayout
from pdkv.protocol import arguments
from pdkv.protocol._deadlines import DeadlineQueue, Tombstones
from pdkv.protocol._rooms import Heartbeats, RoomKeeper
from pdkv.protocol.config import Timeouts
from pdkv.protocol.effects import (
    ChunkSpec,
    DecodePeer,
    Destination,
    DropLayers,
    PrefillEffect,
    Failure,
    FailureCause,
    FenceWrite,
    ForgetPeer,
    Notice,
    NoticeLevel,
    PeerKey,
    RoomFinished,
    Send,
    SubmitChunk,
    SubmitFence,
)
from pdkv.protocol.ids import Epoch, RoomId
from pdkv.protocol.machines import (
    ChunkMachine,
    ChunkState,
    ChunkTrigger,
    PeerMachine,
    PeerState,
    PeerTrigger,
    PrefillAbortMachine,
    PrefillAbortState,
    PrefillAbortTrigger,
    SenderRoomMachine,
    SenderRoomState,
    SenderRoomTrigger,
)
from pdkv.protocol.messages import (
    MAX_REASON_CHARS,
    Abort,
    AbortAck,
    Heartbeat,
    HeartbeatAck,
    Message,
    Origin,
    Outcome,
    Register,
    RegisterAck,
    RegisterReject,
    TransferMetricData,
    TransferRequest,
    TransferStatus,
)
from pdkv.protocol.poll import KVPoll

_POLL = {
    SenderRoomState.BOOTSTRAPPING: KVPoll.Bootstrapping,
    SenderRoomState.WAITING_FOR_INPUT: KVPoll.WaitingForInput,
    SenderRoomState.TRANSFERRING: KVPoll.Transferring,
    SenderRoomState.SUCCESS: KVPoll.Success,
    SenderRoomState.FAILED: KVPoll.Failed,
}


@attrs.frozen(kw_only=True)
class PrefillStatistics:
    """Counters of one prefill endpoint since it started."""

    rooms_open: int
    rooms_succeeded: int
    rooms_failed: int
    chunks_skipped: int
    aborts_received: int
    aborts_unknown_room: int
    requests_refused: int
    registrations_rejected: int
    stale_messages: int
    unexpected_messages: int
    peers_registered: int
    peers_lost: int
    """Decode ranks forgotten after ``heartbeat_timeout`` seconds of silence."""
    peer_restarts: int
    """Decode ranks seen with a newer epoch."""
    unopened_rooms_freed: int
    """Rooms requested by a decode rank that this rank's scheduler never opened, freed once failed."""
    statuses_resent: int
    """Failed statuses sent again because no Abort answered them (a lost status or Abort)."""
    told_to_register: int
    """Heartbeats from decode ranks this rank does not know, answered "register again" at once."""
    fences_submitted: int = 0
    """Fence writes made before an AbortAck, because a write of the room to that rank had failed."""
    fences_failed: int = 0
    """Fence writes that failed (the AbortAck waits for the decode's next Abort, which fences again)."""


@attrs.define(eq=False)
class _Counters:
    rooms_succeeded: int = 0
    rooms_failed: int = 0
    chunks_skipped: int = 0
    aborts_received: int = 0
    aborts_unknown_room: int = 0
    requests_refused: int = 0
    registrations_rejected: int = 0
    stale_messages: int = 0
    unexpected_messages: int = 0
    peers_lost: int = 0
    peer_restarts: int = 0
    unopened_rooms_freed: int = 0
    statuses_resent: int = 0
    told_to_register: int = 0
    fences_submitted: int = 0
    fences_failed: int = 0


@attrs.frozen
class _Tombstone:
    """Why a room id is refused (until its entry in ``Tombstones`` expires), for whoever asks about it."""

    reason: str
    cause: FailureCause


class FenceState(enum.Enum):
    """A fence owed to one decode rank for one room (a write of the room to it failed)."""

    OWED = "owed"  # not written yet (or written and failed: retried at ``retry_at`` or the next Abort)
    RUNNING = "running"  # the fence write is on its way
    DONE = "done"  # completed: the engine queue to that rank drained; acks to it say ``fenced``


@attrs.define(eq=False)
class _Fence:
    """A fence owed to a decode rank before the room's AbortAck (or Success) to it; kept, DONE, while
    the room's id is a tombstone, so every later AbortAck for the room says it was fenced."""

    write: FenceWrite
    state: FenceState = FenceState.OWED
    retry_at: float | None = None  # a failed fence is written again then, without waiting for an Abort


@attrs.define(eq=False)
class _Chunk:
    index: int
    spec: ChunkSpec
    machine: ChunkMachine


@attrs.define(eq=False)
class _SenderRoom:
    room: RoomId
    machine: SenderRoomMachine
    deadline: float | None
    opened: bool = False
    num_pages: int | None = None
    aux_row: int | None = None
    requests: dict[PeerKey, TransferRequest] = attrs.Factory(dict)
    chunks: list[_Chunk] = attrs.Factory(list)
    last_queued: bool = False
    next_position: int | None = None  # where the next chunk must start (None before the first)
    src_pages: list[np.ndarray] = attrs.Factory(list)  # every queued chunk's pages, for duplicates
    failure: str | None = None
    cause: FailureCause | None = None
    failure_peer: PeerKey | None = None
    pages: int = 0
    bytes: int = 0
    seconds: float = 0.0
    abort: PrefillAbortMachine | None = None
    ack_to: set[PeerKey] = attrs.Factory(set)
    closed: bool = False
    layer_writes: set[int] = attrs.Factory(set)  # per-layer contexts (by start token) writing now
    success_held: bool = False  # every chunk Done, but per-layer writes still in flight
    peer_metric: dict[PeerKey, TransferMetricData] = attrs.Factory(dict)  # what each decode rank got
    unanswered: set[PeerKey] = attrs.Factory(set)  # told Failed, no Abort back yet (resent)
    status_resend_at: float | None = None
    status_resends: int = 0

    @property
    def state(self) -> SenderRoomState:
        return self.machine.state

    @property
    def terminal(self) -> bool:
        return self.machine.is_terminal

    @property
    def in_flight(self) -> int:
        """Chunks and per-layer contexts whose writes may still land."""
        chunks = sum(1 for c in self.chunks if c.machine.state is ChunkState.TRANSFERRING)
        return chunks + len(self.layer_writes)

    @property
    def real_requests(self) -> list[TransferRequest]:
        return [r for r in self.requests.values() if not r.dummy]


class PrefillEndpoint(RoomKeeper[_SenderRoom]):
    """The protocol state of one prefill rank (sans-IO)."""

    side = "prefill"

    def __init__(
        self,
        *,
        origin: Origin,
        layout: BufferLayout,
        timeouts: Timeouts | None = None,
        policy: OwnershipPolicy | None = None,
    ) -> None:
        """``policy``: CP shared-KV ownership of this rank's instance (None: every page is this
        rank's, physical == logical), to check a chunk's source pages against this rank's own pool."""
        self.origin = origin
        self.layout = layout
        self.policy = policy
        self.timeouts = timeouts if timeouts is not None else Timeouts()
        self._peers: dict[PeerKey, DecodePeer] = {}
        self._last_heard: dict[PeerKey, float] = {}
        self._heartbeats = Heartbeats(self.timeouts.heartbeat_interval)  # due while a rank is registered
        self._draining: dict[PeerKey, set[RoomId]] = {}  # forgotten rank -> rooms still writing to it
        # Each decode rank's lifecycle (the Peer machine): READY, FORGOTTEN, DRAINING (its RegisterAck
        # waits for ``_draining``), REJECTED. Kept while the rank matters: registered or draining.
        self._lifecycle: dict[PeerKey, PeerMachine] = {}
        self._newest_epoch: dict[PeerKey, Epoch] = {}  # the latest epoch each decode rank registered with
        self._keep_rooms()
        self._tombstones: Tombstones[RoomId, _Tombstone] = Tombstones()
        self._fences: dict[tuple[RoomId, PeerKey], _Fence] = {}  # owed before an AbortAck
        self._fence_retries: DeadlineQueue[tuple[RoomId, PeerKey]] = DeadlineQueue()
        self._unopened_failed: list[RoomId] = []  # freed at the end of the input that failed them
        self._status_resends: DeadlineQueue[RoomId] = DeadlineQueue()
        self._counters = _Counters()

    # ------------------------------------------------------------------ network input

    def receive(self, message: Message, now: float) -> list[PrefillEffect]:
        """Handle one decoded message from a decode rank."""
        key = (message.origin.instance, message.origin.rank)
        effects: list[PrefillEffect] = []
        known = self._peers.get(key)
        if known is not None and message.origin.epoch > known.epoch:
            # Whatever the message, the incarnation we knew is gone; a Register then registers the
            # new one, anything else is treated as coming from an unregistered rank.
            effects += self._peer_restarted(key, message.origin)
        effects += self._dispatch(message, now)
        peer = self._peers.get(key)
        if peer is not None and peer.epoch == message.origin.epoch:
            self._last_heard[key] = now
        self._free_unopened(now)
        return effects

    def _dispatch(self, message: Message, now: float) -> list[PrefillEffect]:
        if isinstance(message, Register):
            return self._on_register(message, now)
        if isinstance(message, TransferRequest):
            return self._on_request(message, now)
        if isinstance(message, Abort):
            return self._on_abort(message, now)
        if isinstance(message, (Heartbeat, HeartbeatAck)):
            peer = self._peers.get((message.origin.instance, message.origin.rank))
            key = (message.origin.instance, message.origin.rank)
            newest = self._newest_epoch.get(key)
            if (
                peer is None
                and isinstance(message, Heartbeat)
                and message.endpoint is not None
                and (newest is None or message.origin.epoch >= newest)  # an old incarnation's: ignored
            ):
                # A decode rank we do not know (forgotten after silence, or this process restarted):
                # told at once, so it registers again instead of waiting for its heartbeat timeout.
                self._counters.told_to_register += 1
                reason = (
                    f"decode rank {message.origin} is not registered at prefill {self.origin} "
                    "(forgotten after silence, or this rank restarted): register again"
                )
                reject = RegisterReject(origin=self.origin, reason=_clip(reason), retry=True)
                return [Send(to=message.endpoint, message=reject)]
            if peer is None or peer.epoch != message.origin.epoch:
                # Not answered: an older incarnation's heartbeat changes nothing.
                return self._stale(message)
            if isinstance(message, HeartbeatAck):
                return []  # its only news is that the peer is alive (recorded by receive)
            return [Send(to=peer.endpoint, message=HeartbeatAck(origin=self.origin, seq=message.seq))]
        self._counters.unexpected_messages += 1
        return [
            _notice(
                NoticeLevel.WARNING, f"prefill got unexpected {type(message).__name__} from {message.origin}"
            )
        ]

    def _on_register(self, msg: Register, now: float) -> list[PrefillEffect]:
        key = (msg.origin.instance, msg.origin.rank)
        known = self._peers.get(key)
        effects: list[PrefillEffect] = []
        if known is not None and msg.origin.epoch < known.epoch:
            return self._stale(msg)
        difference = self.layout.difference(msg.layout)
        if difference is not None:
            self._counters.registrations_rejected += 1
            reason = _clip(f"layout mismatch with prefill {self.origin}: {difference}")
            if known is not None:
                # Registered before with another layout: its live rooms were validated against
                # buffers that no longer match, so none of them may write.
                effects += self._fail_rooms_of(
                    key,
                    f"decode rank {msg.origin} re-registered with a rejected layout",
                    FailureCause.INVALID,
                    now,
                )
                self._drop_peer(key)
            self._peer_machine(key).fire(PeerTrigger.REFUSED)
            if not self._draining.get(key):
                self._lifecycle.pop(key, None)  # nothing of it to remember
            effects.append(Send(to=msg.endpoint, message=RegisterReject(origin=self.origin, reason=reason)))
            effects.append(_notice(NoticeLevel.WARNING, f"rejected registration of {msg.origin}: {reason}"))
            return effects
        self._heartbeats.arm(now)
        self._peers[key] = DecodePeer(
            instance=msg.origin.instance,
            epoch=msg.origin.epoch,
            rank=msg.origin.rank,
            tp_size=msg.tp_size,
            endpoint=msg.endpoint,
            session=msg.session,
            layout=msg.layout,
        )
        self._newest_epoch[key] = max(msg.origin.epoch, self._newest_epoch.get(key, msg.origin.epoch))
        machine = self._peer_machine(key)
        if machine.state is PeerState.DRAINING:
            return effects  # registered again while still draining: the ack stays held
        if self._draining.get(key):
            # Writes to a forgotten incarnation of this rank are still in flight; until they end, a
            # new registration must not let it reuse the memory they may land in.
            if machine.state is PeerState.REJECTED:
                machine = self._lifecycle[key] = self._new_peer_machine(key)
            machine.fire(PeerTrigger.REGISTERED_WHILE_DRAINING)
            effects.append(
                _notice(
                    NoticeLevel.INFO,
                    f"registration of {msg.origin} acknowledged once writes of rooms "
                    f"{sorted(self._draining[key])} to its previous incarnation end",
                )
            )
            return effects
        if machine.state is PeerState.REJECTED:
            machine = self._lifecycle[key] = self._new_peer_machine(key)
        if machine.state is not PeerState.READY:  # a repeated Register of a READY rank is re-acked
            machine.fire(PeerTrigger.ACKNOWLEDGED)
        effects.append(Send(to=msg.endpoint, message=RegisterAck(origin=self.origin)))
        return effects

    def _peer_machine(self, key: PeerKey) -> PeerMachine:
        machine = self._lifecycle.get(key)
        if machine is None:
            machine = self._lifecycle[key] = self._new_peer_machine(key)
        return machine

    @staticmethod
    def _new_peer_machine(key: PeerKey) -> PeerMachine:
        return PeerMachine(f"decode rank {key[0]}:{key[1]}")

    def _note_draining(self, key: PeerKey) -> None:
        """Remember the rooms with writes in flight to ``key`` as it is forgotten (silence, restart)."""
        rooms = {r.room for r in self._rooms.values() if r.in_flight and key in r.requests}
        if rooms:
            self._draining.setdefault(key, set()).update(rooms)

    def _writes_ended(self, room: RoomId) -> list[PrefillEffect]:
        """``room`` may have had the last in-flight write to a forgotten rank: send deferred acks."""
        effects: list[PrefillEffect] = []
        if not self._draining or self.in_flight(room):
            return effects
        for key, rooms in list(self._draining.items()):
            rooms.discard(room)
            if rooms:
                continue
            del self._draining[key]
            peer = self._peers.get(key)
            machine = self._lifecycle.get(key)
            if machine is not None and machine.state is PeerState.DRAINING and peer is not None:
                machine.fire(PeerTrigger.DRAINED)
                effects.append(Send(to=peer.endpoint, message=RegisterAck(origin=self.origin)))
            elif machine is not None and machine.state is not PeerState.READY:
                self._lifecycle.pop(key, None)  # forgotten and drained: nothing left to remember
        return effects

    def _peer_restarted(self, key: PeerKey, new: Origin) -> list[PrefillEffect]:
        """A decode rank came back with a new epoch: its old rooms can never complete."""
        old = self._peers[key]
        self._note_draining(key)
        self._drop_peer(key)
        self._counters.peer_restarts += 1
        reason = f"decode rank {old.instance}:{old.rank} restarted (epoch {old.epoch} -> {new.epoch})"
        effects: list[PrefillEffect] = [
            ForgetPeer(endpoint=old.endpoint, reason=reason),
            _notice(NoticeLevel.WARNING, reason),
        ]
        for r in list(self._rooms.values()):
            if key in r.requests:
                if not r.terminal:
                    effects += self._fail(r, reason, FailureCause.PEER_RESTART, notify=False, by=key)
                # The old incarnation's pages are gone: nothing to acknowledge to it.
                r.requests.pop(key)
        return effects

    def _on_request(self, msg: TransferRequest, now: float) -> list[PrefillEffect]:
        key = (msg.origin.instance, msg.origin.rank)
        peer = self._peers.get(key)
        if peer is None or peer.epoch != msg.origin.epoch:
            self._counters.requests_refused += 1
            return [
                _notice(
                    NoticeLevel.WARNING,
                    f"TransferRequest from unregistered decode rank {msg.origin}",
                    msg.room,
                )
            ]
        tomb = self._tombstones.get(msg.room)
        if tomb is not None and msg.room not in self._rooms:
            # Answered at once: an aborted room stays aborted, and a reused id is said to be one.
            self._counters.requests_refused += 1
            failed = TransferStatus(
                origin=self.origin, room=msg.room, outcome=Outcome.FAILED, reason=tomb.reason
            )
            return [
                _notice(
                    NoticeLevel.WARNING,
                    f"refused TransferRequest for room {msg.room} from {msg.origin}: {tomb.reason}",
                    msg.room,
                ),
                Send(to=peer.endpoint, message=failed),
            ]
        r = self._rooms.get(msg.room) or self._new_room(msg.room, now)
        previous = r.requests.get(key)
        if previous is not None:
            if previous == msg:
                # A duplicate: answer a finished room again (the first status may have been lost).
                return self._status_to(r, peer) if r.terminal else []
            if r.terminal:
                return [
                    _notice(
                        NoticeLevel.WARNING,
                        f"ignored conflicting TransferRequest from {msg.origin} for finished room {msg.room}",
                        msg.room,
                    )
                ]
            return self._fail(
                r, f"conflicting TransferRequests from {msg.origin}", FailureCause.INVALID, now=now, by=key
            )
        if r.state is SenderRoomState.SUCCESS:
            # Another decode rank (or a restarted one) asks for a finished room: the room stays
            # Success for the ranks that got it; this one is told, and nothing is written to it.
            self._counters.requests_refused += 1
            reason = f"room {msg.room} already finished on prefill {self.origin}; room id reused?"
            failed = TransferStatus(origin=self.origin, room=msg.room, outcome=Outcome.FAILED, reason=reason)
            return [
                _notice(
                    NoticeLevel.WARNING, f"refused TransferRequest from {msg.origin}: {reason}", msg.room
                ),
                Send(to=peer.endpoint, message=failed),
            ]
        r.requests[key] = msg
        if r.state is SenderRoomState.FAILED:
            return self._status_to(r, peer)
        if r.state is not SenderRoomState.BOOTSTRAPPING:
            return self._fail(
                r,
                f"unexpected extra TransferRequest from {msg.origin} in state {r.state.name}",
                FailureCause.INVALID,
                now=now,
                by=key,
            )
        problem = self._validate(msg, peer, r)
        if problem is not None:
            return self._fail(r, problem, FailureCause.INVALID, now=now, by=key)
        prefixes = {q.prefix_pages for q in r.real_requests}
        if len(prefixes) > 1:
            return self._fail(
                r,
                f"decode ranks disagree on the prefix they hold: {sorted(prefixes)} pages",
                FailureCause.INVALID,
                now=now,
            )
        required = {q.required_dst_info_num for q in r.requests.values()}
        if len(required) != 1:
            return self._fail(
                r,
                f"decode ranks disagree on required_dst_info_num: {sorted(required)}",
                FailureCause.INVALID,
                now=now,
            )
        if len(r.requests) == required.pop():
            r.machine.fire(SenderRoomTrigger.ALL_REQUESTS_IN)
            self._set_deadline(r, now + self.timeouts.inflight)
        return []

    def _validate(self, msg: TransferRequest, peer: DecodePeer, r: _SenderRoom) -> str | None:
        """Destination checks before any byte moves (DESIGN section 4)."""
        if msg.dummy:
            return None
        if msg.dst_pages.size > 1:
            repeated = arguments.repeated_ids(msg.dst_pages)
            if repeated.size:
                return (
                    f"destination pages of {msg.origin} repeat page ids {repeated[:6].tolist()}: two "
                    f"positions would share one page; {summarize(msg.dst_pages, 'dst_pages')}"
                )
        capacity = peer.layout.min_kv_items
        if msg.dst_pages.size and int(msg.dst_pages.max()) >= capacity:
            return (
                f"destination page {int(msg.dst_pages.max())} outside the decode KV buffers "
                f"({capacity} pages) of {msg.origin}"
            )
        if r.num_pages is not None and msg.dst_pages.size != r.num_pages:
            given = msg.dst_pages.size
            return f"request has {r.num_pages} pages but {msg.origin} gave {given} destination pages"
        if msg.dst_aux_row is not None:
            rows = peer.layout.min_items(BufferKind.AUX)
            if msg.dst_aux_row >= rows:
                return f"destination aux row {msg.dst_aux_row} outside the decode aux buffers ({rows} rows)"
        for state in msg.dst_state:
            if not peer.layout.select(state.kind):
                return f"destination names state kind {state.kind.value} that {msg.origin} did not register"
            slots = peer.layout.min_items(state.kind)
            if state.indices.size and int(state.indices.max()) >= slots:
                return (
                    f"destination {state.kind.value} slot {int(state.indices.max())} outside the decode "
                    f"buffers ({slots} slots)"
                )
        return None

    def _on_abort(self, msg: Abort, now: float) -> list[PrefillEffect]:
        self._counters.aborts_received += 1
        key = (msg.origin.instance, msg.origin.rank)
        peer = self._peers.get(key)
        if peer is not None and msg.origin.epoch < peer.epoch:
            return self._stale(msg)
        r = self._rooms.get(msg.room)
        if r is None:
            # Unknown (never seen, or closed): nothing of it is in flight. Remember the id so a
            # reordered TransferRequest cannot start writes after this acknowledgement.
            effects: list[PrefillEffect] = []
            if msg.room not in self._tombstones:
                self._counters.aborts_unknown_room += 1
                effects.append(
                    _notice(
                        NoticeLevel.WARNING,
                        f"abort for unknown room {msg.room} from {msg.origin}: {msg.reason}",
                        msg.room,
                    )
                )
            self._tombstone(
                msg.room,
                now,
                _clip(f"aborted by decode {msg.origin} before the prefill side opened it: {msg.reason}"),
                FailureCause.ABORTED_BY_PEER,
                keep_reason=True,
            )
            return effects + self._abort_ack(msg.room, key)
        effects = []
        r.unanswered.discard(key)  # the decode rank heard of the failure (or failed first)
        if not r.terminal:
            effects += self._fail(
                r,
                _clip(f"aborted by decode {msg.origin}: {msg.reason}"),
                FailureCause.ABORTED_BY_PEER,
                notify=False,
                by=key,
            )
        if peer is None:
            return effects
        r.ack_to.add(key)
        if r.abort is None:
            r.abort = PrefillAbortMachine(f"room {r.room}")
            r.abort.fire(PrefillAbortTrigger.DRAIN)
        if r.abort.state is PrefillAbortState.ACKED:
            return effects + self._abort_ack(r.room, key)
        return effects + self._maybe_drained(r)

    def _peer_silent(self, key: PeerKey, now: float) -> list[PrefillEffect]:
        """A decode rank sent nothing for ``heartbeat_timeout``: fail its live rooms and forget it.

        Its rooms are told Failed (best effort, on a rebuilt socket) while it is still known, so a
        rank that is alive but was unheard can abort; AbortAcks still go to it if it registers
        again. Until then its messages are dropped, heartbeats included, so it notices the silence.
        """
        peer = self._peers[key]
        silent = now - self._last_heard.get(key, now)
        reason = f"decode rank {peer.instance}:{peer.rank} silent for {silent:.3g} s"
        self._counters.peers_lost += 1
        effects: list[PrefillEffect] = [
            ForgetPeer(endpoint=peer.endpoint, reason=reason),
            _notice(
                NoticeLevel.WARNING, f"{reason}: failing its rooms and forgetting it until it registers again"
            ),
        ]
        effects += self._fail_rooms_of(key, reason, FailureCause.PEER_SILENT, now)
        self._note_draining(key)
        self._drop_peer(key)
        return effects

    def _fail_rooms_of(self, key: PeerKey, reason: str, cause: FailureCause, now: float) -> list[PrefillEffect]:
        effects: list[PrefillEffect] = []
        for r in list(self._rooms.values()):
            if key in r.requests and not r.terminal:
                effects += self._fail(r, reason, cause, now=now, by=key)
        return effects

    def _drop_peer(self, key: PeerKey) -> None:
        """Forget a registered decode rank (silence, restart, refused layout): writes to it may still
        drain (``_note_draining`` first); it registers again to be served."""
        self._peers.pop(key, None)
        self._last_heard.pop(key, None)
        machine = self._lifecycle.get(key)
        if machine is not None and machine.can_fire(PeerTrigger.FORGET):
            machine.fire(PeerTrigger.FORGET)
        if machine is not None and not self._draining.get(key):
            self._lifecycle.pop(key, None)
        if not self._peers:
            self._heartbeats.stop()

    def _stale(self, msg: Message) -> list[PrefillEffect]:
        self._counters.stale_messages += 1
        return [_notice(NoticeLevel.INFO, f"dropped {type(msg).__name__} from stale or unknown {msg.origin}")]

    # ------------------------------------------------------------------ scheduler input

    def open_room(self, room: RoomId, *, num_pages: int, aux_row: int | None, now: float) -> list[PrefillEffect]:
        """``sender.init``: the request has ``num_pages`` pages; its aux row on this side is ``aux_row``.

        Arguments are checked first (``InvalidArgumentError``; nothing changes on a bad call). A
        room the decode side already failed (aborted before this call, or its id reused) opens
        Failed with that reason: a peer-caused condition is the room's state, not the caller's error.
        """
        num_pages = arguments.count(num_pages, room=room, argument="num_pages")
        rows = self.layout.min_items(BufferKind.AUX)
        aux_row = arguments.optional_row(aux_row, room=room, argument="aux_row", rows=rows)
        r = self._rooms.get(room)
        if r is not None and r.opened:
            raise LocalProtocolError(f"room {room} was already opened on prefill {self.origin}")
        if r is None:
            tomb = self._tombstones.get(room)
            r = self._new_room(room, now)
            if tomb is not None:
                r.opened, r.num_pages, r.aux_row = True, num_pages, aux_row
                return self._fail(r, tomb.reason, tomb.cause, now=now)
        r.opened, r.num_pages, r.aux_row = True, num_pages, aux_row
        if r.terminal:
            return []  # failed before the scheduler opened it: poll() says Failed, failure() why
        for q in r.real_requests:
            if q.dst_pages.size != num_pages:
                return self._fail(
                    r,
                    f"request has {num_pages} pages but {q.origin} gave {q.dst_pages.size} destination pages",
                    FailureCause.INVALID,
                    now=now,
                )
        return []

    def check_chunk(self, room: RoomId, spec: ChunkSpec) -> int:
        """The scheduler's chunk against the room's page contract; returns its first position.

        Raises ``MappingError`` (naming the room, the argument and both sides) when the chunk would
        leave a gap, overlap an earlier chunk, start anywhere but the decode's prefix (a first
        chunk), run past ``num_pages``, end a room short (a last chunk), or repeat a source page;
        ``InvalidArgumentError`` for source pages or state slots outside this rank's buffers.
        Changes nothing: ``queue_chunk`` and per-layer registration call it before any byte moves.
        """
        r = self._opened(room)
        if r.last_queued:
            raise LocalProtocolError(f"room {room}: chunk queued after the last chunk")
        start = self._chunk_start(room, spec.start_token)
        self._check_window(r, start, int(spec.pages.size), last=spec.last, first=r.next_position is None)
        if spec.pages.size > 1:
            repeated = arguments.repeated_ids(spec.pages)
            if repeated.size:
                raise MappingError(
                    f"room {room}: chunk_pages repeat page ids {repeated[:6].tolist()}: two positions "
                    f"would read one page; {summarize(spec.pages, 'chunk_pages')}",
                    room=room,
                )
        self._check_sources(room, spec, start)
        if r.src_pages and spec.pages.size:
            earlier = np.concatenate(r.src_pages)
            repeated = spec.pages[np.isin(spec.pages, earlier)]
            if repeated.size:
                raise MappingError(
                    f"room {room}: chunk_pages repeat page ids {repeated[:6].tolist()} of an earlier "
                    f"chunk; {summarize(spec.pages, 'chunk_pages')}; {summarize(earlier, 'earlier pages')}",
                    room=room,
                )
        return start

    def _chunk_start(self, room: RoomId, start_token: int) -> int:
        try:
            return chunk_page_start(start_token, self.layout.page_size)
        except MappingError as exc:
            raise MappingError(f"room {room}: start_token: {exc}", room=room) from None

    def _check_window(self, r: _SenderRoom, start: int, size: int, *, last: bool | None, first: bool) -> None:
        """The one chunk-window rule of a room, for ``send()`` and per-layer registration: a room
        covers exactly [decode prefix, ``num_pages``). ``last``: None for a per-layer registration
        (whether it is the last chunk is known at ``send()``), which may also come before the chunk
        ahead of it was sent (only an overlap with what was queued is refused then). ``first``: no
        earlier chunk of the room is known, so this one must start at the decode's prefix."""
        room, num_pages = r.room, r.num_pages or 0
        end = start + size
        where = f"chunk at positions {start}..{end - 1} of a {num_pages}-page room"
        prefix = self.decode_prefix(room)
        if prefix is not None and start < prefix:
            raise MappingError(
                f"room {room}: the {where} starts inside the decode's prefix (positions 0..{prefix - 1}, "
                f"which it already holds): start at position {prefix}",
                room=room,
            )
        if first and prefix is not None and start != prefix:
            held = f"positions 0..{prefix - 1}" if prefix else "no prefix"
            raise MappingError(
                f"room {room}: the first {where} starts past the decode's prefix (it holds {held}): "
                f"positions {prefix}..{start - 1} would never be written; start the first chunk at "
                f"decode_prefix_pages() = {prefix}",
                room=room,
            )
        following = r.next_position
        if following is not None and last is not None and start != following:
            gap = start - following
            what = (
                f"leaves positions {following}..{start - 1} unwritten"
                if gap > 0
                else f"overlaps {-gap} position(s) already queued"
            )
            raise MappingError(
                f"room {room}: chunk_pages {what} (the previous chunk ended at position {following}); {where}",
                room=room,
            )
        if following is not None and last is None and start < following:
            raise MappingError(
                f"room {room}: the {where} overlaps chunks already queued (up to {following - 1})", room=room
            )
        if end > num_pages:
            raise MappingError(f"room {room}: the {where} runs past the request's last page", room=room)
        if last and end != num_pages:
            raise MappingError(
                f"room {room}: the last chunk ends at position {end}, short of num_pages {num_pages}: "
                f"positions {end}..{num_pages - 1} would never be written; {where}",
                room=room,
            )
    def _check_sources(self, room: RoomId, spec: ChunkSpec, start: int) -> None:
        """The chunk's pages this rank owns, and its state slots, inside this rank's own buffers:
        a caller's bug is an ``InvalidArgumentError`` at the call, not a failed room later."""
        if spec.pages.size:
            cp = 0 if self.policy is None else self.origin.rank.cp
            owned = cp_owned(spec.pages, start, cp, self.policy).physical
            capacity = self.layout.min_kv_items
            if owned.size and int(owned.max()) >= capacity:
                bad = owned[owned >= capacity]
                raise InvalidArgumentError(
                    f"room {room}: chunk_pages hold page(s) {bad[:6].tolist()} (physical, on CP rank "
                    f"{self.origin.rank.cp}) outside this rank's KV buffers of {capacity} pages; "
                    f"{summarize(spec.pages, 'chunk_pages')}",
                    room=room,
                    argument="chunk_pages",
                    value=int(bad[0]),
                )
        for state in spec.state:
            if not self.layout.select(state.kind):
                raise InvalidArgumentError(
                    f"room {room}: state_indices name kind {state.kind.value}, which this rank did not register",
                    room=room,
                    argument="state_indices",
                    value=state.kind,
                )
            slots = self.layout.min_items(state.kind)
            if state.indices.size and int(state.indices.max()) >= slots:
                raise InvalidArgumentError(
                    f"room {room}: state_indices[{state.kind.value}] slot {int(state.indices.max())} is "
                    f"outside this rank's {state.kind.value} buffers of {slots} slots",
                    room=room,
                    argument=f"state_indices[{state.kind.value}]",
                    value=int(state.indices.max()),
                )

    def queue_chunk(self, room: RoomId, spec: ChunkSpec, now: float) -> list[PrefillEffect]:
        """``sender.send``: queue one chunk; returns SubmitChunk unless the room failed (then Skipped).

        The chunk must keep the room's page contract (``check_chunk``); a chunk that breaks it is
        refused with ``MappingError`` before anything changes.
        """
        r = self._opened(room)
        if r.state is SenderRoomState.BOOTSTRAPPING:
            raise LocalProtocolError(
                f"room {room}: send() before the decode side asked for the room (poll() is "
                "Bootstrapping): wait until poll() is WaitingForInput, then start at decode_prefix_pages()"
            )
        start = self.check_chunk(room, spec)
        failed = r.state is SenderRoomState.FAILED
        if not failed:
            r.machine.fire(SenderRoomTrigger.QUEUE_CHUNK)  # LocalProtocolError before all requests are in
        r.next_position = start + int(spec.pages.size)
        if spec.pages.size:
            r.src_pages.append(spec.pages)
        chunk = _Chunk(
            index=len(r.chunks), spec=spec, machine=ChunkMachine(f"room {room} chunk {len(r.chunks)}")
        )
        r.chunks.append(chunk)
        r.last_queued = spec.last
        if failed:
            self._skip(chunk)
            return []
        gone = [key for key, q in r.requests.items() if not q.dummy and key not in self._peers]
        if gone:
            # Never a KeyError on the control thread, never a silent drop: the room fails loudly.
            self._skip(chunk)
            names = ", ".join(f"{k[0]}:{k[1]}" for k in sorted(gone, key=_peer_order))
            return self._fail(
                r,
                f"no transfer destination: decode rank {names} is no longer registered",
                FailureCause.NO_DESTINATION,
                now=now,
            )
        destinations = tuple(
            Destination(peer=self._peers[key], request=q) for key, q in r.requests.items() if not q.dummy
        )
        if not destinations:
            # Dummy rank for this room (a replica): nothing to write, the room still advances.
            chunk.machine.fire(ChunkTrigger.START)
            return self.chunk_done(room, chunk.index, TransferMetricData(), now)
        return [
            SubmitChunk(
                room=room,
                chunk=chunk.index,
                spec=spec,
                num_pages=r.num_pages or 0,
                src_aux_row=r.aux_row,
                destinations=destinations,
            )
        ]

    def abort_room(self, room: RoomId, reason: str, now: float) -> list[PrefillEffect]:
        """``sender.abort``: fail the room and tell every decode rank at once."""
        r = self._rooms.get(room)
        if r is None:
            # Not requested yet: remember the abort, so the decode's request (if it comes) is
            # answered Failed at once instead of starting a room that waits for its deadline.
            self._tombstone(room, now, _clip(f"aborted by prefill: {reason}"), FailureCause.ABORTED_HERE)
            return [_notice(NoticeLevel.INFO, f"abort of room {room} before its request: {reason}", room)]
        if r.terminal:
            return []
        return self._fail(r, _clip(f"aborted by prefill: {reason}"), FailureCause.ABORTED_HERE, now=now)

    def close_room(self, room: RoomId, now: float) -> None:
        """``sender.clear``: the scheduler is done with a terminal room; its id becomes a tombstone."""
        r = self._rooms.get(room)
        if r is None:
            return
        if not r.terminal:
            raise LocalProtocolError(f"room {room} closed in state {r.state.name}; abort it first")
        r.closed = True
        self._tombstone(
            room,
            now,
            f"room id reused: room {room} finished and was cleared on prefill {self.origin} "
            f"less than {self.timeouts.tombstone:g} s ago",
            FailureCause.INVALID,
        )
        self._forget_if_idle(r)

    def poll(self, room: RoomId) -> KVPoll:
        """The room's state; a room this rank has not heard of yet is Bootstrapping (SGLang polls
        every sender from creation), one it refuses (aborted, reused id) is Failed."""
        r = self._rooms.get(room)
        if r is not None:
            return _POLL[r.state]
        return KVPoll.Failed if room in self._tombstones else KVPoll.Bootstrapping

    def failure(self, room: RoomId) -> str | None:
        r = self._rooms.get(room)
        if r is not None:
            return r.failure
        tomb = self._tombstones.get(room)
        return None if tomb is None else tomb.reason

    def failure_record(self, room: RoomId) -> Failure | None:
        """The room's failure as the scheduler reads it (None unless it failed; a cleared room's
        tombstone answers with its reason)."""
        r = self._rooms.get(room)
        if r is not None:
            return self._failure_of(r)
        tomb = self._tombstones.get(room)
        return None if tomb is None else Failure(cause=tomb.cause, reason=tomb.reason)

    def failure_cause(self, room: RoomId) -> FailureCause | None:
        r = self._rooms.get(room)
        if r is not None:
            return r.cause
        tomb = self._tombstones.get(room)
        return None if tomb is None else tomb.cause

    def metric(self, room: RoomId) -> TransferMetricData:
        """What this rank wrote for ``room`` (zeros for a room it holds no record of: nothing moved)."""
        r = self._rooms.get(room)
        if r is None:
            return TransferMetricData()
        return TransferMetricData(pages=r.pages, bytes=r.bytes, seconds=r.seconds)

    def layer_destinations(
        self, room: RoomId, pages: np.ndarray, start_token: int, *, first: bool = False
    ) -> tuple[Destination, ...] | str:
        """Per-layer registration of a chunk before its forward: the destinations its layers go to
        (several when decode TP > prefill TP: each layer goes to every one), or why the chunk goes
        the monolithic way (no destination yet, a dummy rank). A chunk that breaks the room's page
        contract as far as it is known before ``send()`` (inside the decode's prefix, past
        ``num_pages``, over chunks already queued; ``first``: no chunk of the room was queued or
        registered before, so it must start at the decode's prefix) is refused with
        ``MappingError``: its layers would write wrong positions."""
        dests = self.destinations(room)
        if dests is None:
            return "the room has no destinations yet (register once the sender polls WaitingForInput)"
        if not dests:
            return "this rank is a dummy for the room (nothing to send)"
        r = self._rooms[room]
        start = self._chunk_start(room, start_token)
        self._check_window(r, start, int(pages.size), last=None, first=first and r.next_position is None)
        return dests

    def decode_prefix(self, room: RoomId) -> int | None:
        """Positions the decode side already holds (its prefix cache), once its requests are in (the
        first chunk starts there or later); None before that."""
        r = self._rooms.get(room)
        if r is None or r.state not in (SenderRoomState.WAITING_FOR_INPUT, SenderRoomState.TRANSFERRING):
            return None
        asked = r.real_requests or list(r.requests.values())  # a dummy rank's request says it too
        return max((q.prefix_pages for q in asked), default=0)

    def destinations(self, room: RoomId) -> tuple[Destination, ...] | None:
        """Where the room's bytes go (its non-dummy requests and their registered decode ranks), once
        every request is in (WaitingForInput or Transferring); None before, after, or when a
        destination rank is no longer registered (``queue_chunk`` then fails the room loudly)."""
        r = self._rooms.get(room)
        if r is None or not r.opened:
            return None
        if r.state not in (SenderRoomState.WAITING_FOR_INPUT, SenderRoomState.TRANSFERRING):
            return None
        wanted = [(key, q) for key, q in r.requests.items() if not q.dummy]
        if any(key not in self._peers for key, _ in wanted):
            return None
        return tuple(Destination(peer=self._peers[key], request=q) for key, q in wanted)

    def room_history(self, room: RoomId) -> list[SenderRoomState]:
        return list(self._room(room).machine.history)

    def chunk_states(self, room: RoomId) -> list[ChunkState]:
        return [c.machine.state for c in self._room(room).chunks]

    def _deadline_of(self, r: _SenderRoom) -> float | None:
        return None if r.terminal else r.deadline

    # ------------------------------------------------------------------ transfer-worker input

    def start_chunk(self, room: RoomId, chunk: int, now: float) -> bool:
        """A worker is about to write ``chunk``: True to go ahead, False to skip (room failed)."""
        r = self._rooms.get(room)
        if r is None:
            # The room failed and was closed while this chunk waited in a queue: it was Skipped then.
            return False
        if not 0 <= chunk < len(r.chunks):
            raise LocalProtocolError(f"start of unknown chunk {chunk} of room {room}")
        c = r.chunks[chunk]
        if c.machine.state is ChunkState.SKIPPED:
            return False
        if r.state is SenderRoomState.FAILED:
            self._skip(c)
            return False
        c.machine.fire(ChunkTrigger.START)
        return True

    def chunk_done(
        self,
        room: RoomId,
        chunk: int,
        metric: TransferMetricData,
        now: float,
        *,
        per_peer: Mapping[PeerKey, TransferMetricData] | None = None,
    ) -> list[PrefillEffect]:
        """Every write of ``chunk`` completed; ``metric`` counts what was actually written, and
        ``per_peer`` what went to each decode rank (each is told only its own share). Without
        ``per_peer`` the whole metric is the share of each real destination (exact for the usual
        single destination)."""
        r, c = self._chunk(room, chunk)
        c.machine.fire(ChunkTrigger.COMPLETE)
        r.pages += metric.pages
        r.bytes += metric.bytes
        r.seconds += metric.seconds
        if per_peer is None:
            per_peer = {key: metric for key, q in r.requests.items() if not q.dummy}
        for key, share in per_peer.items():
            r.peer_metric[key] = _combined(r.peer_metric.get(key), share)
        effects = self._maybe_succeed(r)
        effects += self._maybe_drained(r)
        effects += self._writes_ended(room)
        self._forget_if_idle(r)
        return effects

    def layer_writes_started(self, room: RoomId, start_token: int, now: float) -> bool:
        """A per-layer context of ``room`` is about to submit its first write: True to go ahead,
        False when the room can no longer be written (failed, aborted, or complete without it)."""
        r = self._rooms.get(room)
        if r is None or not r.opened or r.terminal or r.success_held:
            return False
        r.layer_writes.add(start_token)
        return True

    def layer_writes_ended(
        self,
        room: RoomId,
        start_token: int,
        now: float,
        *,
        fences: Mapping[PeerKey, FenceWrite] | None = None,
    ) -> list[PrefillEffect]:
        """Every write the per-layer context ``start_token`` of ``room`` submitted has ended
        (``fences`` as for ``chunk_failed``, when one of them failed)."""
        self._owe_fences(room, fences)
        r = self._rooms.get(room)
        if r is None or start_token not in r.layer_writes:
            return []
        r.layer_writes.discard(start_token)
        effects = self._maybe_succeed(r)
        effects += self._maybe_drained(r)
        effects += self._writes_ended(room)
        self._forget_if_idle(r)
        return effects

    def _owe_fences(self, room: RoomId, fences: Mapping[PeerKey, FenceWrite] | None) -> None:
        for key, write in (fences or {}).items():
            known = self._fences.get((room, key))
            if known is None or known.state is FenceState.DONE:  # a later failed write: fenced again
                self._fences[(room, key)] = _Fence(write=write)

    def _maybe_succeed(self, r: _SenderRoom) -> list[PrefillEffect]:
        """Success once every chunk is Done and no per-layer write of the room can still land."""
        if not (
            r.state is SenderRoomState.TRANSFERRING
            and r.last_queued
            and all(x.machine.state is ChunkState.DONE for x in r.chunks)
        ):
            return []
        if r.layer_writes:
            if r.success_held:
                return []
            r.success_held = True
            held = sorted(r.layer_writes)
            return [
                DropLayers(room=r.room, reason=f"room complete; per-layer chunk(s) @{held} were never sent"),
                _notice(
                    NoticeLevel.WARNING,
                    f"room {r.room}: every chunk is done but per-layer context(s) @{held} (never sent) "
                    "still write; Success waits for them",
                    r.room,
                ),
            ]
        owed = [k for (room, k), f in self._fences.items() if room == r.room and f.state is not FenceState.DONE]
        if owed:
            # A write of the room failed (an orphan per-layer context's) and its bytes may still be
            # queued in the engine: Success waits until a fence to each such rank proved it drained.
            return [e for key in sorted(owed, key=_peer_order) for e in self._fence(r.room, key)]
        r.machine.fire(SenderRoomTrigger.LAST_CHUNK_DONE)
        r.deadline = None
        r.success_held = False
        self._counters.rooms_succeeded += 1
        effects: list[PrefillEffect] = []
        for key, q in r.requests.items():
            peer = self._peers.get(key)
            if not q.dummy and peer is not None:
                effects += self._status_to(r, peer)
        effects.append(RoomFinished(room=r.room, poll=KVPoll.Success))
        return effects

    def chunk_failed(
        self,
        room: RoomId,
        chunk: int,
        reason: str,
        now: float,
        *,
        fences: Mapping[PeerKey, FenceWrite] | None = None,
    ) -> list[PrefillEffect]:
        """The engine failed a write of ``chunk``; every write already submitted has ended. ``fences``:
        for each decode rank a write to which failed, one block of it to repeat as a fence before the
        room's AbortAck to that rank (bytes of a failed batch may still be queued in the engine)."""
        self._owe_fences(room, fences)
        r, c = self._chunk(room, chunk)
        c.machine.fire(ChunkTrigger.FAIL)
        effects: list[PrefillEffect] = []
        if not r.terminal:
            effects += self._fail(
                r, _clip(f"transfer of chunk {chunk} failed: {reason}"), FailureCause.ENGINE, now=now
            )
        effects += self._maybe_drained(r)
        effects += self._writes_ended(room)
        self._forget_if_idle(r)
        return effects

    # ------------------------------------------------------------------ timers

    def next_deadline(self) -> float | None:
        candidates = [
            d
            for d in (
                self._next_room_deadline(),
                self._tombstones.next_expiry(),
                self._status_resends.next_deadline(self._status_resend_deadline),
                self._fence_retries.next_deadline(self._fence_retry_deadline),
                self._heartbeats.due,
            )
            if d is not None
        ]
        return min(candidates, default=None)

    def tick(self, now: float) -> list[PrefillEffect]:
        """Heartbeat round when due (forget silent decode ranks, greet the others); fail every room
        whose deadline passed; forget expired tombstones."""
        effects: list[PrefillEffect] = []
        if self._heartbeats.is_due(now):
            effects += self._heartbeat_round(now)
        for room in self._due_rooms(now):
            r = self._rooms[room]
            limit = {
                SenderRoomState.BOOTSTRAPPING: ("bootstrap", self.timeouts.bootstrap),
                SenderRoomState.WAITING_FOR_INPUT: ("inflight", self.timeouts.inflight),
                SenderRoomState.TRANSFERRING: ("inflight", self.timeouts.inflight),
            }[r.state]
            effects += self._fail(
                r,
                f"{limit[0]} timeout: still {r.state.name} after {limit[1]:g} s",
                FailureCause.TIMEOUT,
                now=now,
            )
        for room in self._tombstones.expire(now):
            if self._fences:  # the room's fences go with its tombstone (one never asked for included)
                for key in [k for k in self._fences if k[0] == room]:
                    del self._fences[key]
        for room in self._status_resends.pop_due(now, self._status_resend_deadline):
            effects += self._resend_status(self._rooms[room], now)
        for fenced, peer_key in self._fence_retries.pop_due(now, self._fence_retry_deadline):
            self._fences[(fenced, peer_key)].retry_at = None
            effects += self._fence(fenced, peer_key)  # again (nothing if the rank is gone)
        self._free_unopened(now)
        return effects

    def _heartbeat_round(self, now: float) -> list[PrefillEffect]:
        effects: list[PrefillEffect] = []
        for key in sorted(self._peers, key=_peer_order):
            if now - self._last_heard.get(key, now) >= self.timeouts.heartbeat_timeout:
                effects += self._peer_silent(key, now)
        seq = self._heartbeats.next_seq()
        for key in sorted(self._peers, key=_peer_order):
            beat = Heartbeat(origin=self.origin, seq=seq)
            effects.append(Send(to=self._peers[key].endpoint, message=beat))
        self._heartbeats.reschedule(now, again=bool(self._peers))
        return effects

    # ------------------------------------------------------------------ statistics

    def statistics(self) -> PrefillStatistics:
        return PrefillStatistics(
            rooms_open=sum(1 for r in self._rooms.values() if not r.terminal),
            peers_registered=len(self._peers),
            **attrs.asdict(self._counters),  # every counter field, by name
        )

    def peers(self) -> list[DecodePeer]:
        """The decode ranks registered now."""
        return list(self._peers.values())

    def in_flight(self, room: RoomId) -> int:
        """Chunks of ``room`` whose writes may still land (0 for unknown rooms)."""
        r = self._rooms.get(room)
        return 0 if r is None else r.in_flight

    def may_write(self, room: RoomId) -> bool:
        """Could a write for ``room`` still land or start? (What abort safety is checked against.)"""
        r = self._rooms.get(room)
        if r is None:
            return False
        if r.in_flight:
            return True
        return not r.terminal and any(c.machine.state is ChunkState.REGISTERED for c in r.chunks)

    # ------------------------------------------------------------------ internals

    def _new_room(self, room: RoomId, now: float) -> _SenderRoom:
        r = _SenderRoom(room=room, machine=SenderRoomMachine(f"room {room}"), deadline=None)
        self._rooms[room] = r
        self._set_deadline(r, now + self.timeouts.bootstrap)
        return r

    def _fail(
        self,
        r: _SenderRoom,
        reason: str,
        cause: FailureCause,
        *,
        notify: bool = True,
        now: float | None = None,
        by: PeerKey | None = None,
    ) -> list[PrefillEffect]:
        """Fail the room (``by``: the decode rank the failure came from or concerns, for the
        scheduler's ``Failure``), skip its queued chunks and tell its decode ranks (``notify``)."""
        r.machine.fire(SenderRoomTrigger.FAIL)
        r.failure = reason
        r.cause = cause
        r.failure_peer = by
        r.deadline = None
        self._counters.rooms_failed += 1
        if not r.opened:
            self._unopened_failed.append(r.room)
        for c in r.chunks:
            if c.machine.state is ChunkState.REGISTERED:
                self._skip(c)
        effects: list[PrefillEffect] = [
            RoomFinished(room=r.room, poll=KVPoll.Failed, reason=reason, cause=cause),
            _notice(NoticeLevel.WARNING, f"room {r.room} failed on prefill {self.origin}: {reason}", r.room),
        ]
        if notify:
            for key in r.requests:
                peer = self._peers.get(key)
                if peer is not None:
                    effects += self._status_to(r, peer)
                    r.unanswered.add(key)
            if r.unanswered and now is not None:
                self._schedule_status_resend(r, now)
        return effects

    def _schedule_status_resend(self, r: _SenderRoom, now: float) -> None:
        """A Failed status may be lost: resend it (backoff) until the decode rank's Abort answers."""
        r.status_resend_at = self.timeouts.resend_at(now, r.status_resends)
        if r.status_resend_at is not None:
            self._status_resends.push(r.room, r.status_resend_at)

    def _status_resend_deadline(self, room: RoomId) -> float | None:
        r = self._rooms.get(room)
        if r is None or r.state is not SenderRoomState.FAILED:
            return None
        if not any(key in self._peers for key in r.unanswered):
            return None  # nobody registered to tell (a forgotten rank hears of it when it registers)
        return r.status_resend_at

    def _resend_status(self, r: _SenderRoom, now: float) -> list[PrefillEffect]:
        effects: list[PrefillEffect] = []
        for key in sorted(r.unanswered, key=_peer_order):
            peer = self._peers.get(key)
            if peer is not None:
                self._counters.statuses_resent += 1
                effects += self._status_to(r, peer)
        r.status_resends += 1
        self._schedule_status_resend(r, now)
        return effects

    def _status_to(self, r: _SenderRoom, peer: DecodePeer) -> list[PrefillEffect]:
        """The room's final word to one decode rank (dummy requesters expect none on success)."""
        q = r.requests.get(peer.key)
        if r.state is SenderRoomState.SUCCESS:
            if q is None or q.dummy:
                return []
            metric = r.peer_metric.get(peer.key, TransferMetricData())
            status = TransferStatus(origin=self.origin, room=r.room, outcome=Outcome.SUCCESS, metric=metric)
        elif r.state is SenderRoomState.FAILED:
            status = TransferStatus(
                origin=self.origin, room=r.room, outcome=Outcome.FAILED, reason=r.failure or "failed"
            )
        else:
            return []
        return [Send(to=peer.endpoint, message=status)]

    def _skip(self, c: _Chunk) -> None:
        c.machine.fire(ChunkTrigger.SKIP)
        self._counters.chunks_skipped += 1

    def _maybe_drained(self, r: _SenderRoom) -> list[PrefillEffect]:
        if r.abort is None or r.abort.state is not PrefillAbortState.DRAINING or r.in_flight:
            return []
        r.abort.fire(PrefillAbortTrigger.DRAINED)
        effects: list[PrefillEffect] = []
        for key in sorted(r.ack_to, key=_peer_order):
            effects += self._abort_ack(r.room, key)
        return effects

    def _abort_ack(self, room: RoomId, key: PeerKey) -> list[PrefillEffect]:
        """The AbortAck for ``room`` to ``key`` (writes of the room all ended), or first the fence it
        waits for when a write of the room to that rank failed (``SubmitFence``, ``fence_done``)."""
        peer = self._peers.get(key)
        if peer is None:
            return []
        owed = self._fences.get((room, key))
        if owed is None or owed.state is FenceState.DONE:
            # After a fence the decode must still cut its connections from us (or settle): it says so.
            ack = AbortAck(origin=self.origin, room=room, fenced=owed is not None)
            return [Send(to=peer.endpoint, message=ack)]
        return self._fence(room, key)

    def _fence(self, room: RoomId, key: PeerKey) -> list[PrefillEffect]:
        """Submit the fence owed to ``key`` for ``room`` (nothing if it is on its way already, or the
        rank is not registered: it is written when the rank registers again and asks)."""
        owed = self._fences[(room, key)]
        if owed.state is not FenceState.OWED or key not in self._peers:
            return []  # a resent Abort while the fence is on its way
        owed.state = FenceState.RUNNING
        self._counters.fences_submitted += 1
        return [SubmitFence(room=room, peer=key, fence=owed.write)]

    def fence_done(self, room: RoomId, peer: PeerKey, ok: bool, reason: str, now: float) -> list[PrefillEffect]:
        """The fence write of ``room`` to ``peer`` ended: COMPLETED (``ok``) lets its AbortAck go; a
        failure keeps it owed, and the fence is written again ``abort_resend`` later (or at the
        decode's next resent Abort, if that comes first). A write on an engine connection that died
        (a partition, the decode's cut) fails once before the engine reconnects, so the retry does
        not wait for the decode's doubling resend interval."""
        owed = self._fences.get((room, peer))
        if owed is None or owed.state is not FenceState.RUNNING:
            return []
        if not ok:
            owed.state = FenceState.OWED
            owed.retry_at = now + self.timeouts.abort_resend
            self._fence_retries.push((room, peer), owed.retry_at)
            self._counters.fences_failed += 1
            return [
                _notice(
                    NoticeLevel.WARNING,
                    f"room {room}: fence write to {peer[0]}:{peer[1]} failed ({reason}); written again "
                    f"in {self.timeouts.abort_resend:g} s or at the next Abort, its AbortAck waits",
                    room,
                )
            ]
        owed.state = FenceState.DONE
        r = self._rooms.get(room)
        if r is not None and r.state is SenderRoomState.TRANSFERRING:
            return self._maybe_succeed(r)  # the fence Success waited for
        return self._abort_ack(room, peer)

    def _fence_retry_deadline(self, key: tuple[RoomId, PeerKey]) -> float | None:
        owed = self._fences.get(key)
        return None if owed is None or owed.state is not FenceState.OWED else owed.retry_at

    def _forget_if_idle(self, r: _SenderRoom) -> None:
        if r.closed and not r.in_flight and (r.abort is None or r.abort.state is PrefillAbortState.ACKED):
            self._rooms.pop(r.room, None)

    def _tombstone(
        self, room: RoomId, now: float, reason: str, cause: FailureCause, *, keep_reason: bool = False
    ) -> None:
        """Refuse ``room`` until ``tombstone`` seconds from now (``keep_reason``: an earlier reason stays)."""
        known = self._tombstones.get(room)
        if keep_reason and known is not None:
            reason, cause = known.reason, known.cause
        self._tombstones.put(room, _Tombstone(reason=reason, cause=cause), now + self.timeouts.tombstone)

    def _free_unopened(self, now: float) -> None:
        """Rooms a decode rank asked for, failed before this rank's scheduler opened them: nothing
        of theirs can be in flight (a chunk needs an open room), so they are freed now and their ids
        kept as tombstones; a late ``sender.init`` then opens them Failed with the reason."""
        while self._unopened_failed:
            room = self._unopened_failed.pop()
            r = self._rooms.get(room)
            if r is None or r.opened or r.in_flight or not r.terminal:
                continue
            if r.abort is not None and r.abort.state is not PrefillAbortState.ACKED:
                continue
            del self._rooms[room]
            self._counters.unopened_rooms_freed += 1
            self._tombstone(room, now, r.failure or "failed", r.cause or FailureCause.INVALID)

    def _opened(self, room: RoomId) -> _SenderRoom:
        r = self._rooms.get(room)
        if r is None or not r.opened:
            raise LocalProtocolError(f"room {room}: send() before init() on prefill {self.origin}")
        return r

    def _chunk(self, room: RoomId, chunk: int) -> tuple[_SenderRoom, _Chunk]:
        r = self._rooms.get(room)
        if r is None or not 0 <= chunk < len(r.chunks):
            raise LocalProtocolError(f"unknown chunk {chunk} of room {room}")
        return r, r.chunks[chunk]


def _combined(a: TransferMetricData | None, b: TransferMetricData) -> TransferMetricData:
    if a is None:
        return b
    return TransferMetricData(pages=a.pages + b.pages, bytes=a.bytes + b.bytes, seconds=a.seconds + b.seconds)


def _notice(level: NoticeLevel, text: str, room: RoomId | None = None) -> Notice:
    return Notice(level=level, text=text, room=room)


def _clip(text: str) -> str:
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


def _peer_order(key: PeerKey) -> tuple[str, int, int]:
    return (key[0], key[1].tp, key[1].cp)


__all__ = ["PrefillEndpoint", "PrefillStatistics"]
