"""Sans-IO prefill endpoint: the protocol of one prefill rank, driven by inputs, answering with effects.

Owns: the records of one prefill rank (a ``DecodeRank`` per decode rank it heard of, a ``SenderRoom``
per room with its chunks, abort handshake and fences), the rank's deadlines and tombstones, the page
contract checks of the scheduler's calls (``_contract``), and the routing of every input to its
machine's rows. The rules themselves are those rows (``machines.decode_rank``,
``machines.room_sender``, ``machines.chunk``, ``machines.abort``, ``machines.fence``): this module finds
the record, builds the step and runs the row; it holds no rule of its own beyond what an input needs to
reach its record (a stale epoch is dropped, a newer one restarts the rank's record, a request of an
unregistered rank or of a tombstoned id is refused, since there is no room to step). Must not do I/O,
start threads or read a clock: every input carries ``now``; the driver calls ``tick(now)`` at
``next_deadline()``.

Inputs come from three places:
- the network: ``receive(message, now)`` (any message from a registered decode rank, with its
  current epoch, is a sign of life);
- the scheduler: ``open_room`` (``sender.init``), ``queue_chunk`` (``sender.send``), ``abort_room``,
  ``close_room``, and the queries ``poll`` / ``failure`` / ``metric``;
- transfer workers: ``start_chunk`` (may answer "skip"), ``chunk_done``, ``chunk_failed``;
- per-layer transfer: the rank's ``LayerBook`` (``layers``) is the endpoint's; a chunk's context is
  ruled and registered here (``layer_destinations``, ``layer_register``), asks the room before its
  first write (``layer_first_write``, may answer "skip") and reports the end of its writes
  (``layer_ended``). A context writing counts as a chunk in flight: AbortAck, the RegisterAck of a
  restarted decode rank, Success and ``may_write`` all wait for it. When the room ends or completes
  without a context, the endpoint stops it and asks the runtime to drain it (``DropLayers``).

Safety rules these rows enforce (DESIGN section 8):
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

from collections.abc import Callable, Iterable, Mapping

import attrs
import numpy as np

from pdkv.errors import LocalProtocolError
from pdkv.mapping import DEFAULT_LAYOUT_POLICY, LayerKey, LayoutPolicy, OwnershipPolicy
from pdkv.mapping.layout import BufferKind, BufferLayout
from pdkv.protocol import _contract, arguments
from pdkv.protocol._deadlines import DeadlineQueue, Tombstones
from pdkv.protocol._rooms import Counts, Heartbeats, RoomKeeper
from pdkv.protocol.config import Timeouts
from pdkv.protocol.effects import (
    ChunkSpec,
    DecodePeer,
    Destination,
    DropLayers,
    Failure,
    FailureCause,
    FenceWrite,
    Notice,
    NoticeLevel,
    PeerKey,
    PrefillEffect,
    Send,
)
from pdkv.protocol.ids import RoomId
from pdkv.protocol.layers import DEFAULT_FINISH_TIMEOUT_S, LayerBook, LayerContext
from pdkv.protocol.machines import PerLayerTrigger
from pdkv.protocol.machines._prefill_side import (
    AbortStep,
    Chunk,
    ChunkInput,
    ChunkState,
    ChunkStep,
    DecodeRank,
    DecodeRankInput,
    FailureNoticeState,
    Fence,
    FenceInput,
    FenceState,
    FenceStep,
    PrefillAbortInput,
    PrefillAbortState,
    RankStep,
    RoomStep,
    SenderRoom,
    SenderRoomInput,
    SenderRoomState,
    peer_order,
)
from pdkv.protocol.machines.decode_rank import DecodeRankMachine
from pdkv.protocol.machines.fence import FenceMachine
from pdkv.protocol.machines.room_sender import SenderRoomMachine
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
    TransferMetricData,
    TransferRequest,
    TransferStatus,
)
from pdkv.protocol.poll import KVPoll

_POLL = {
    SenderRoomState.BOOTSTRAPPING: KVPoll.Bootstrapping,
    SenderRoomState.WAITING_FOR_INPUT: KVPoll.WaitingForInput,
    SenderRoomState.TRANSFERRING: KVPoll.Transferring,
    SenderRoomState.COMPLETING: KVPoll.Transferring,
    SenderRoomState.SUCCESS: KVPoll.Success,
    SenderRoomState.FAILED: KVPoll.Failed,
}
_ASKED = (SenderRoomState.WAITING_FOR_INPUT, SenderRoomState.TRANSFERRING, SenderRoomState.COMPLETING)
_LIMITS = {
    SenderRoomState.BOOTSTRAPPING: "bootstrap",
    SenderRoomState.WAITING_FOR_INPUT: "inflight",
    SenderRoomState.TRANSFERRING: "inflight",
    SenderRoomState.COMPLETING: "inflight",
}


@attrs.frozen(kw_only=True)
class PrefillStatistics:
    """Counters of one prefill endpoint since it started (``rooms_open`` and ``peers_registered`` are
    levels, counted when asked). The one declaration of its counters."""

    rooms_open: int = 0
    rooms_succeeded: int = 0
    rooms_failed: int = 0
    chunks_skipped: int = 0
    aborts_received: int = 0
    aborts_unknown_room: int = 0
    requests_refused: int = 0
    registrations_rejected: int = 0
    stale_messages: int = 0
    unexpected_messages: int = 0
    peers_registered: int = 0
    peers_lost: int = 0
    """Decode ranks forgotten after ``heartbeat_timeout`` seconds of silence."""
    peer_restarts: int = 0
    """Decode ranks seen with a newer epoch."""
    unopened_rooms_freed: int = 0
    """Rooms requested by a decode rank that this rank's scheduler never opened, freed once failed."""
    statuses_resent: int = 0
    """Failed statuses sent again because no Abort answered them (a lost status or Abort)."""
    told_to_register: int = 0
    """Heartbeats from decode ranks this rank does not know, answered "register again" at once."""
    fences_submitted: int = 0
    """Fence writes made before an AbortAck, because a write of the room to that rank had failed."""
    fences_failed: int = 0
    """Fence writes that failed (the AbortAck waits for the decode's next Abort, which fences again)."""


_LEVELS = ("rooms_open", "peers_registered")


@attrs.frozen
class _Tombstone:
    """Why a room id is refused (until its entry in ``Tombstones`` expires), for whoever asks about it."""

    reason: str
    cause: FailureCause


class PrefillEndpoint(RoomKeeper[SenderRoom]):
    """The protocol state of one prefill rank (sans-IO)."""

    side = "prefill"

    def __init__(
        self,
        *,
        origin: Origin,
        layout: BufferLayout,
        timeouts: Timeouts | None = None,
        policy: OwnershipPolicy | None = None,
        layout_policy: LayoutPolicy = DEFAULT_LAYOUT_POLICY,
        layer_finish_timeout_s: float = DEFAULT_FINISH_TIMEOUT_S,
    ) -> None:
        """``policy``: CP shared-KV ownership of this rank's instance (None: every page is this
        rank's, physical == logical), to check a chunk's source pages against this rank's own pool.
        ``layout_policy``: what a decode rank's layout may differ in (``degrade_draft``: draft buffers
        only one side registers are left out for that pair; ``strict``: nothing).
        ``layer_finish_timeout_s``: how long ``send()`` of a per-layer chunk waits for its layers."""
        self.origin = origin
        self.layout = layout
        self.policy = policy
        self.layout_policy = layout_policy
        self.timeouts = timeouts if timeouts is not None else Timeouts()
        self._ranks: dict[PeerKey, DecodeRank] = {}  # every decode rank heard of, across incarnations
        self._draining: set[PeerKey] = set()  # ranks whose ``draining`` rooms may still hold writes
        self._heartbeats = Heartbeats(self.timeouts.heartbeat_interval)  # due while a rank is registered
        self._keep_rooms()
        self._tombstones: Tombstones[RoomId, _Tombstone] = Tombstones()
        self._fences: dict[RoomId, dict[PeerKey, Fence]] = {}  # owed before an AbortAck (or Success)
        self._fence_retries: DeadlineQueue[tuple[RoomId, PeerKey]] = DeadlineQueue()
        self._unopened_failed: list[RoomId] = []  # freed at the end of the input that failed them
        self._status_resends: DeadlineQueue[RoomId] = DeadlineQueue()
        self._counts = Counts(PrefillStatistics, levels=_LEVELS)
        finish_s = arguments.seconds(layer_finish_timeout_s, argument="layer_finish_timeout_s", positive=True)
        self.layers: LayerBook[object] = LayerBook(finish_timeout_s=finish_s)
        """The rank's per-layer contexts (``pdkv.protocol.layers``): the runtime reads them and feeds
        them the outcomes of its lanes (layer routed, submitted, broken, finish verdicts) under the
        same lock as every other input; what reaches a room goes through ``layer_*`` below."""
        self._out: list[PrefillEffect] = []
        # What each message type does: its handler, given the sender's key.
        self._handlers: dict[type[Message], Callable[[PeerKey, Message, float], None]] = {
            Register: self._on_register,
            TransferRequest: self._on_request,
            Abort: self._on_abort,
            Heartbeat: self._on_heartbeat,
            HeartbeatAck: self._on_heartbeat_ack,
        }

    # ------------------------------------------------------------------ services of the rows

    def count(self, name: str, by: int = 1) -> None:
        self._counts.add(name, by)

    def emit(self, effect: PrefillEffect) -> None:
        self._out.append(effect)

    def registered(self, key: PeerKey) -> DecodePeer | None:
        rank = self._ranks.get(key)
        return None if rank is None else rank.peer

    def room_records(self) -> Iterable[SenderRoom]:
        return self._rooms.values()

    def set_deadline(self, room: SenderRoom, when: float) -> None:
        self._set_deadline(room, when)

    def refusal(self, room: RoomId) -> tuple[str, FailureCause] | None:
        tomb = self._tombstones.get(room)
        return None if tomb is None else (tomb.reason, tomb.cause)

    def note_unopened_failed(self, room: RoomId) -> None:
        self._unopened_failed.append(room)

    def schedule_status_resend(self, room: SenderRoom, now: float) -> None:
        """A Failed status may be lost: resent (backoff) until the decode rank's Abort answers."""
        notice = room.notice
        assert notice is not None  # scheduled for a room that told its ranks
        notice.resend_at = self.timeouts.resend_at(now, notice.resends)
        if notice.resend_at is not None:
            self._status_resends.push(room.room, notice.resend_at)

    def fences_of(self, room: RoomId) -> list[tuple[PeerKey, Fence]]:
        owed = self._fences.get(room)
        return [] if not owed else sorted(owed.items(), key=lambda item: peer_order(item[0]))

    def schedule_fence_retry(self, room: RoomId, key: PeerKey, when: float) -> None:
        self._fence_retries.push((room, key), when)

    def answer_abort(self, room: RoomId, key: PeerKey) -> None:
        peer = self.registered(key)
        if peer is None:
            return  # answered if it registers again and asks again
        fence = self._fences.get(room, {}).get(key)
        if fence is None:
            self.emit(Send(to=peer.endpoint, message=AbortAck(origin=self.origin, room=room)))
        else:
            fence.machine.step(FenceInput.ACK_WANTED, FenceStep(self, fence, room, key, 0.0))

    def writes_ended(self, room: RoomId, now: float) -> None:
        for key in sorted(self._draining, key=peer_order):
            rank = self._ranks[key]
            rank.draining.discard(room)
            if not rank.draining:
                self._draining.discard(key)
                rank.machine.step(DecodeRankInput.DRAINED, RankStep(self, rank, now))

    def watch_drain(self, key: PeerKey) -> None:
        self._draining.add(key)

    def forget_if_idle(self, room: SenderRoom) -> None:
        if (
            room.closed
            and not self.writes_in_flight(room)
            and (room.abort is None or room.abort.state is PrefillAbortState.ACKED)
        ):
            self._rooms.pop(room.room, None)

    def layer_writes(self, room: RoomId) -> list[int]:
        return self.layers.writing(room)

    def writes_in_flight(self, room: SenderRoom) -> int:
        return room.chunks_in_flight + len(self.layers.writing(room.room))

    def stop_layers(self, room: RoomId, reason: str) -> None:
        if any(not c.terminal for c in self.layers.cancel(room, reason)):
            self.emit(DropLayers(room=room, reason=reason))

    def arm_heartbeats(self, now: float) -> None:
        self._heartbeats.arm(now)

    def heartbeats_done_if_alone(self) -> None:
        if not any(rank.peer is not None for rank in self._ranks.values()):
            self._heartbeats.stop()

    def _effects(self) -> list[PrefillEffect]:
        """What the steps of the current input emitted, in order (and a fresh list for the next)."""
        out, self._out = self._out, []
        return out

    # ------------------------------------------------------------------ network input

    def receive(self, message: Message, now: float) -> list[PrefillEffect]:
        """Handle one decoded message from a decode rank (any message of a registered rank's current
        epoch is a sign of life)."""
        key = (message.origin.instance, message.origin.rank)
        rank = self._ranks.get(key)
        if rank is not None and rank.peer is not None and message.origin.epoch > rank.peer.epoch:
            # Whatever the message, the incarnation we knew is gone; a Register then registers the
            # new one, anything else is treated as coming from an unregistered rank.
            old = rank.peer
            new = message.origin.epoch
            reason = f"decode rank {old.instance}:{old.rank} restarted (epoch {old.epoch} -> {new})"
            rank.machine.step(
                DecodeRankInput.RESTART, RankStep(self, rank, now, origin=message.origin, reason=reason)
            )
        handler = self._handlers.get(type(message))
        if handler is None:
            self.count("unexpected_messages")
            self.emit(
                Notice(
                    level=NoticeLevel.WARNING,
                    text=f"prefill got unexpected {type(message).__name__} from {message.origin}",
                )
            )
        else:
            handler(key, message, now)
        rank = self._ranks.get(key)
        if rank is not None and rank.peer is not None and rank.peer.epoch == message.origin.epoch:
            rank.last_heard = now
        self._free_unopened(now)
        return self._effects()

    def _record(self, key: PeerKey) -> DecodeRank:
        rank = self._ranks.get(key)
        if rank is None:
            rank = self._ranks[key] = DecodeRank(
                key=key, machine=DecodeRankMachine(f"decode rank {key[0]}:{key[1]}")
            )
        return rank

    def _on_register(self, key: PeerKey, message: Message, now: float) -> None:
        assert isinstance(message, Register)
        rank = self._record(key)
        rank.machine.step(DecodeRankInput.REGISTER, RankStep(self, rank, now, register=message))

    def _on_heartbeat(self, key: PeerKey, message: Message, now: float) -> None:
        assert isinstance(message, Heartbeat)
        rank = self._record(key)
        step = RankStep(
            self,
            rank,
            now,
            origin=message.origin,
            heartbeat_seq=message.seq,
            heartbeat_endpoint=message.endpoint,
        )
        rank.machine.step(DecodeRankInput.HEARTBEAT, step)

    def _on_heartbeat_ack(self, key: PeerKey, message: Message, now: float) -> None:
        peer = self.registered(key)
        if peer is None or peer.epoch != message.origin.epoch:
            self._stale(message)  # its only news would be that the rank is alive (``receive``)

    def _on_request(self, key: PeerKey, message: Message, now: float) -> None:
        assert isinstance(message, TransferRequest)
        peer = self.registered(key)
        if peer is None or peer.epoch != message.origin.epoch:
            self.count("requests_refused")
            self.emit(
                Notice(
                    level=NoticeLevel.WARNING,
                    text=f"TransferRequest from unregistered decode rank {message.origin}",
                    room=message.room,
                )
            )
            return
        tomb = self._tombstones.get(message.room)
        if tomb is not None and message.room not in self._rooms:
            # No room to step: answered at once, an aborted room stays aborted and a reused id is
            # said to be one.
            self.count("requests_refused")
            self.emit(
                Notice(
                    level=NoticeLevel.WARNING,
                    text=f"refused TransferRequest for room {message.room} from {message.origin}: "
                    f"{tomb.reason}",
                    room=message.room,
                )
            )
            failed = TransferStatus(
                origin=self.origin, room=message.room, outcome=Outcome.FAILED, reason=tomb.reason
            )
            self.emit(Send(to=peer.endpoint, message=failed))
            return
        r = self._rooms.get(message.room) or self._new_room(message.room, now)
        r.machine.step(SenderRoomInput.REQUEST, RoomStep(self, r, now, key, request=message))

    def _on_abort(self, key: PeerKey, message: Message, now: float) -> None:
        assert isinstance(message, Abort)
        self.count("aborts_received")
        peer = self.registered(key)
        if peer is not None and message.origin.epoch < peer.epoch:
            self._stale(message)
            return
        r = self._rooms.get(message.room)
        if r is None:
            # Unknown (never seen, or closed): nothing of it is in flight. The id is remembered so
            # that a reordered TransferRequest cannot start writes after this acknowledgement.
            if message.room not in self._tombstones:
                self.count("aborts_unknown_room")
                self.emit(
                    Notice(
                        level=NoticeLevel.WARNING,
                        text=f"abort for unknown room {message.room} from {message.origin}: {message.reason}",
                        room=message.room,
                    )
                )
            self._tombstone(
                message.room,
                now,
                _clip(
                    f"aborted by decode {message.origin} before the prefill side opened it: {message.reason}"
                ),
                FailureCause.ABORTED_BY_PEER,
                keep_reason=True,
            )
            self.answer_abort(message.room, key)
            return
        reason = _clip(f"aborted by decode {message.origin}: {message.reason}")
        step = RoomStep(self, r, now, key, reason=reason, cause=FailureCause.ABORTED_BY_PEER)
        r.machine.step(SenderRoomInput.PEER_ABORT, step)

    def _stale(self, message: Message) -> None:
        self.count("stale_messages")
        self.emit(
            Notice(
                level=NoticeLevel.INFO,
                text=f"dropped {type(message).__name__} from stale or unknown {message.origin}",
            )
        )

    # ------------------------------------------------------------------ scheduler input

    def open_room(
        self, room: RoomId, *, num_pages: int, aux_row: int | None, now: float
    ) -> list[PrefillEffect]:
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
        r = r or self._new_room(room, now)
        r.machine.step(SenderRoomInput.OPEN, RoomStep(self, r, now, num_pages=num_pages, aux_row=aux_row))
        return self._effects()

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
        start = _contract.chunk_start(room, spec.start_token, self.layout.page_size)
        prefix = self.decode_prefix(room)
        _contract.check_window(
            r, start, int(spec.pages.size), prefix=prefix, last=spec.last, first=r.next_position is None
        )
        _contract.check_repeats(r, spec)
        _contract.check_sources(
            room, spec, start, layout=self.layout, policy=self.policy, cp=self.origin.rank.cp
        )
        return start

    def queue_chunk(self, room: RoomId, spec: ChunkSpec, now: float) -> list[PrefillEffect]:
        """``sender.send``: queue one chunk; returns SubmitChunk unless the room failed (then Skipped).

        The chunk must keep the room's page contract (``check_chunk``); a chunk that breaks it is
        refused with ``MappingError`` before anything changes.
        """
        r = self._opened(room)
        if r.machine.state is SenderRoomState.BOOTSTRAPPING:
            raise LocalProtocolError(
                f"room {room}: send() before the decode side asked for the room (poll() is "
                "Bootstrapping): wait until poll() is WaitingForInput, then start at decode_prefix_pages()"
            )
        start = self.check_chunk(room, spec)
        r.machine.step(SenderRoomInput.QUEUE_CHUNK, RoomStep(self, r, now, spec=spec, start=start))
        return self._effects()

    def abort_room(self, room: RoomId, reason: str, now: float) -> list[PrefillEffect]:
        """``sender.abort``: fail the room and tell every decode rank at once."""
        r = self._rooms.get(room)
        if r is None:
            # Not requested yet: the abort is remembered, so the decode's request (if it comes) is
            # answered Failed at once instead of starting a room that waits for its deadline.
            self._tombstone(room, now, _clip(f"aborted by prefill: {reason}"), FailureCause.ABORTED_HERE)
            self.emit(
                Notice(
                    level=NoticeLevel.INFO,
                    text=f"abort of room {room} before its request: {reason}",
                    room=room,
                )
            )
            return self._effects()
        step = RoomStep(
            self, r, now, reason=_clip(f"aborted by prefill: {reason}"), cause=FailureCause.ABORTED_HERE
        )
        r.machine.step(SenderRoomInput.ABORT, step)
        self._free_unopened(now)
        return self._effects()

    def close_room(self, room: RoomId, now: float) -> None:
        """``sender.clear``: the scheduler is done with a terminal room; its id becomes a tombstone."""
        r = self._rooms.get(room)
        if r is None:
            self.layers.forget(room)
            return
        if not r.terminal:
            raise LocalProtocolError(f"room {room} closed in state {r.machine.state.name}; abort it first")
        self.layers.forget(room)  # its contexts that ended go now, the others once they end
        r.closed = True
        self._tombstone(
            room,
            now,
            f"room id reused: room {room} finished and was cleared on prefill {self.origin} "
            f"less than {self.timeouts.tombstone:g} s ago",
            FailureCause.INVALID,
        )
        self.forget_if_idle(r)

    # ------------------------------------------------------------------ queries

    def poll(self, room: RoomId) -> KVPoll:
        """The room's state; a room this rank has not heard of yet is Bootstrapping (SGLang polls
        every sender from creation), one it refuses (aborted, reused id) is Failed."""
        r = self._rooms.get(room)
        if r is not None:
            return _POLL[r.machine.state]
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

    # ------------------------------------------------------------------ per-layer input

    def layer_destinations(
        self, room: RoomId, pages: np.ndarray, start_token: int
    ) -> tuple[Destination, ...] | str:
        """Per-layer registration of a chunk before its forward: the destinations its layers go to
        (several when decode TP > prefill TP: each layer goes to every one), or why the chunk goes
        the monolithic way (no destination yet, a dummy rank). A chunk that breaks the room's page
        contract as far as it is known before ``send()`` (inside the decode's prefix, past
        ``num_pages``, over chunks already queued; the room's first chunk, queued or registered,
        must start at the decode's prefix) is refused with ``MappingError``: its layers would write
        wrong positions."""
        first = not self.layers.contexts(room)
        dests = self.destinations(room)
        if dests is None:
            return "the room has no destinations yet (register once the sender polls WaitingForInput)"
        if not dests:
            return "this rank is a dummy for the room (nothing to send)"
        r = self._rooms[room]
        start = _contract.chunk_start(room, start_token, self.layout.page_size)
        _contract.check_window(
            r,
            start,
            int(pages.size),
            prefix=self.decode_prefix(room),
            last=None,
            first=first and r.next_position is None,
        )
        return dests

    def layer_register(
        self,
        room: RoomId,
        start_token: int,
        *,
        pages: np.ndarray,
        destinations: tuple[Destination, ...],
        expected: frozenset[LayerKey],
        work: object,
        now: float,
    ) -> LayerContext[object] | str | None:
        """A chunk planned for ``destinations`` (``layer_destinations``' ruling) takes a context, now
        that its layers may be routed to it. None: (room, start token) has one already (a duplicate,
        counted); a reason: the room's ruling changed while the chunk was planned (it failed, a
        destination went), and the chunk goes the monolithic way. ``MappingError`` as for
        ``layer_destinations``."""
        if self.layers.is_registered(room, start_token):
            self.layers.duplicate()
            return None
        if self.layer_destinations(room, pages, start_token) != destinations:
            return "the room changed while the chunk was planned"
        peers = tuple(d.peer.session for d in destinations)
        context = self.layers.register(
            room, start_token, pages=pages, peers=peers, expected=expected, work=work, now=now
        )
        assert context is not None  # not registered: checked above
        return context

    def layer_first_write(self, context: LayerContext[object], now: float) -> bool:
        """Before the context submits a write: True to submit it. Its first asks the room
        (LAYER_WRITES_STARTED): consented, the context counts as a write of the room in flight from
        now on (AbortAck, the RegisterAck of a restarted decode rank, Success and ``may_write`` wait
        for it); refused (the room failed, was aborted, or is complete without it), the context is
        cancelled before any byte of it moves."""
        if not context.submitting:
            return False
        if context.writing:
            return True
        r = self._rooms.get(context.room)
        consented = False
        if r is not None:
            step = RoomStep(self, r, now, start_token=context.start_token)
            r.machine.step(SenderRoomInput.LAYER_WRITES_STARTED, step)
            consented = step.consented
        return self.layers.first_write(context, consented, now)

    def layer_ended(
        self,
        context: LayerContext[object],
        trigger: PerLayerTrigger,
        now: float,
        *,
        fences: Mapping[PeerKey, FenceWrite] | None = None,
    ) -> list[PrefillEffect]:
        """Every write the context submitted has ended (``trigger``: COMPLETE, FAIL or DROP); for a
        context that wrote, the room hears it once (LAYER_WRITES_ENDED: it may release an AbortAck,
        a RegisterAck or the room's Success). ``fences`` as for ``chunk_failed``."""
        self._owe_fences(context.room, fences)
        if self.layers.ended(context, trigger):
            r = self._rooms.get(context.room)
            if r is not None:
                step = RoomStep(self, r, now, start_token=context.start_token)
                r.machine.step(SenderRoomInput.LAYER_WRITES_ENDED, step)
        return self._effects()

    def decode_prefix(self, room: RoomId) -> int | None:
        """Positions the decode side already holds (its prefix cache), once its requests are in (the
        first chunk starts there); None before that."""
        r = self._rooms.get(room)
        if r is None or r.machine.state not in _ASKED:
            return None
        asked = r.real_requests or list(r.requests.values())  # a dummy rank's request says it too
        return max((q.prefix_pages for q in asked), default=0)

    def destinations(self, room: RoomId) -> tuple[Destination, ...] | None:
        """Where the room's bytes go (its non-dummy requests and their registered decode ranks), once
        every request is in (WaitingForInput or Transferring); None before, after, or when a
        destination rank is no longer registered (``queue_chunk`` then fails the room loudly)."""
        r = self._rooms.get(room)
        if r is None or not r.opened or r.machine.state not in _ASKED:
            return None
        out = []
        for key, q in r.requests.items():
            if not q.dummy:
                peer = self.registered(key)
                if peer is None:
                    return None
                out.append(Destination(peer=peer, request=q))
        return tuple(out)

    def room_history(self, room: RoomId) -> list[SenderRoomState]:
        return list(self._room(room).machine.history)

    def chunk_states(self, room: RoomId) -> list[ChunkState]:
        return [c.machine.state for c in self._room(room).chunks]

    def abort_state(self, room: RoomId) -> PrefillAbortState | None:
        """The room's abort handshake (None: no decode rank aborted it)."""
        r = self._room(room)
        return None if r.abort is None else r.abort.state

    def notice_state(self, room: RoomId) -> FailureNoticeState | None:
        """The room's Failed status to its decode ranks (None: it told none)."""
        r = self._room(room)
        return None if r.notice is None else r.notice.machine.state

    def _deadline_of(self, r: SenderRoom) -> float | None:
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
        return c.machine.step(ChunkInput.START, ChunkStep(self, r, c, now)) is ChunkState.TRANSFERRING

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
        c.machine.step(ChunkInput.COMPLETE, ChunkStep(self, r, c, now))
        step = RoomStep(self, r, now, chunk=chunk, metric=metric, per_peer=per_peer)
        r.machine.step(SenderRoomInput.CHUNK_DONE, step)
        return self._effects()

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
        c.machine.step(ChunkInput.FAIL, ChunkStep(self, r, c, now))
        r.machine.step(SenderRoomInput.CHUNK_FAILED, RoomStep(self, r, now, chunk=chunk, reason=reason))
        self._free_unopened(now)
        return self._effects()

    def fence_done(
        self, room: RoomId, peer: PeerKey, ok: bool, reason: str, now: float
    ) -> list[PrefillEffect]:
        """The fence write of ``room`` to ``peer`` ended: COMPLETED (``ok``) lets its AbortAck go (or
        the Success that waited for it); a failure keeps it owed, and the fence is written again
        ``abort_resend`` later (or at the decode's next resent Abort, if that comes first)."""
        fence = self._fences.get(room, {}).get(peer)
        if fence is None or fence.machine.state is not FenceState.RUNNING:
            return []
        step = FenceStep(self, fence, room, peer, now, reason=reason)
        fence.machine.step(FenceInput.COMPLETED if ok else FenceInput.FAILED, step)
        if not ok:
            return self._effects()
        r = self._rooms.get(room)
        if r is None:
            self.answer_abort(room, peer)  # an Abort for a room already forgotten asked for it
        elif r.machine.state is SenderRoomState.COMPLETING:
            r.machine.step(SenderRoomInput.FENCE_DONE, RoomStep(self, r, now, peer))
        elif r.abort is not None:
            r.abort.step(PrefillAbortInput.FENCED, AbortStep(self, r, now, peer))
        return self._effects()

    def _owe_fences(self, room: RoomId, fences: Mapping[PeerKey, FenceWrite] | None) -> None:
        for key, write in (fences or {}).items():
            owed = self._fences.setdefault(room, {})
            known = owed.get(key)
            if known is None or known.machine.state is FenceState.DONE:  # a later failed write: fenced again
                owed[key] = Fence(
                    write=write, machine=FenceMachine(f"room {room} fence to {key[0]}:{key[1]}")
                )

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
        whose deadline passed; forget expired tombstones; resend unanswered statuses; retry fences."""
        if self._heartbeats.is_due(now):
            self._heartbeat_round(now)
        for room in self._due_rooms(now):
            r = self._rooms[room]
            name = _LIMITS[r.machine.state]
            limit = self.timeouts.bootstrap if name == "bootstrap" else self.timeouts.inflight
            reason = f"{name} timeout: still {r.machine.state.name} after {limit:g} s"
            r.machine.step(
                SenderRoomInput.FAIL, RoomStep(self, r, now, reason=reason, cause=FailureCause.TIMEOUT)
            )
        for room in self._tombstones.expire(now):
            self._fences.pop(room, None)  # the room's fences go with its tombstone
        for room in self._status_resends.pop_due(now, self._status_resend_deadline):
            r = self._rooms[room]
            r.machine.step(SenderRoomInput.STATUS_RESEND_DUE, RoomStep(self, r, now))
        for room, key in self._fence_retries.pop_due(now, self._fence_retry_deadline):
            fence = self._fences[room][key]
            fence.retry_at = None
            if self.registered(key) is not None:  # else written when the rank registers again and asks
                fence.machine.step(FenceInput.SUBMIT, FenceStep(self, fence, room, key, now))
        self._free_unopened(now)
        return self._effects()

    def _heartbeat_round(self, now: float) -> None:
        registered = sorted(
            (r for r in self._ranks.values() if r.peer is not None), key=lambda r: peer_order(r.key)
        )
        for rank in registered:
            silent = now - rank.last_heard
            if silent >= self.timeouts.heartbeat_timeout:
                assert rank.peer is not None
                reason = f"decode rank {rank.peer.instance}:{rank.peer.rank} silent for {silent:.3g} s"
                rank.machine.step(DecodeRankInput.SILENCE, RankStep(self, rank, now, reason=reason))
        seq = self._heartbeats.next_seq()
        alive = [rank for rank in registered if rank.peer is not None]
        for rank in alive:
            assert rank.peer is not None
            self.emit(Send(to=rank.peer.endpoint, message=Heartbeat(origin=self.origin, seq=seq)))
        self._heartbeats.reschedule(now, again=bool(alive))

    def _status_resend_deadline(self, room: RoomId) -> float | None:
        r = self._rooms.get(room)
        if r is None or r.machine.state is not SenderRoomState.FAILED:
            return None
        notice = r.notice
        if notice is None or notice.machine.state is not FailureNoticeState.TELLING:
            return None
        if not any(self.registered(key) is not None for key in notice.unanswered):
            return None  # nobody registered to tell (a forgotten rank hears of it when it registers)
        return notice.resend_at

    def _fence_retry_deadline(self, key: tuple[RoomId, PeerKey]) -> float | None:
        fence = self._fences.get(key[0], {}).get(key[1])
        return None if fence is None or fence.machine.state is not FenceState.OWED else fence.retry_at

    # ------------------------------------------------------------------ statistics

    def statistics(self) -> PrefillStatistics:
        return PrefillStatistics(
            rooms_open=sum(1 for r in self._rooms.values() if not r.terminal),
            peers_registered=sum(1 for r in self._ranks.values() if r.peer is not None),
            **self._counts.values(),
        )

    def draft_buffers_skipped(self) -> int:
        """Buffers the registered pairs' transfers leave out (both sides' lists, summed over the decode
        ranks registered now): 0 unless a rolling deployment left draft buffers out."""
        return sum(
            len(rank.ack.prefill_left_out) + len(rank.ack.decode_left_out)
            for rank in self._ranks.values()
            if rank.peer is not None and rank.ack is not None
        )

    def peers(self) -> list[DecodePeer]:
        """The decode ranks registered now."""
        return [rank.peer for rank in self._ranks.values() if rank.peer is not None]

    def in_flight(self, room: RoomId) -> int:
        """Chunks and per-layer contexts of ``room`` whose writes may still land (0 for unknown rooms)."""
        r = self._rooms.get(room)
        return 0 if r is None else self.writes_in_flight(r)

    def answers_owed(self) -> int:
        """Failed rooms' last words that registered decode ranks may still get without a retry: a rank
        told Failed whose Abort has not come back, or an Abort whose AbortAck waits for a write or a
        fence in flight (a fence that failed waits for its retry: not counted). What a closing rank
        keeps answering for (``PrefillTransport.close``)."""
        owed = 0
        for r in self._rooms.values():
            if r.notice is not None and r.notice.machine.state is FailureNoticeState.TELLING:
                owed += sum(1 for key in r.notice.unanswered if self.registered(key) is not None)
            if (
                r.abort is not None
                and r.abort.state is not PrefillAbortState.ACKED
                and self.writes_in_flight(r)
            ):
                owed += 1
            for key, fence in self._fences.get(r.room, {}).items():
                if fence.machine.state is FenceState.RUNNING and self.registered(key) is not None:
                    owed += 1
        return owed

    def may_write(self, room: RoomId) -> bool:
        """Could a write for ``room`` still land or start? (What abort safety is checked against.)"""
        r = self._rooms.get(room)
        if r is None:
            return False
        if self.writes_in_flight(r):
            return True
        return not r.terminal and any(c.machine.state is ChunkState.REGISTERED for c in r.chunks)

    # ------------------------------------------------------------------ internals

    def _new_room(self, room: RoomId, now: float) -> SenderRoom:
        r = SenderRoom(room=room, machine=SenderRoomMachine(f"room {room}"), deadline=None)
        self._rooms[room] = r
        self._set_deadline(r, now + self.timeouts.bootstrap)
        return r

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
            if r is None or r.opened or self.writes_in_flight(r) or not r.terminal:
                continue
            if r.abort is not None and r.abort.state is not PrefillAbortState.ACKED:
                continue
            del self._rooms[room]
            self.count("unopened_rooms_freed")
            self._tombstone(room, now, r.failure or "failed", r.cause or FailureCause.INVALID)

    def _opened(self, room: RoomId) -> SenderRoom:
        r = self._rooms.get(room)
        if r is None or not r.opened:
            raise LocalProtocolError(f"room {room}: send() before init() on prefill {self.origin}")
        return r

    def _chunk(self, room: RoomId, chunk: int) -> tuple[SenderRoom, Chunk]:
        r = self._rooms.get(room)
        if r is None or not 0 <= chunk < len(r.chunks):
            raise LocalProtocolError(f"unknown chunk {chunk} of room {room}")
        return r, r.chunks[chunk]


def _clip(text: str) -> str:
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


__all__ = ["PrefillEndpoint", "PrefillStatistics"]
