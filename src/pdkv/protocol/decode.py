"""Sans-IO decode endpoint: the protocol of one decode rank, driven by inputs, answering with effects.

Owns: the records of one decode rank (a ``PrefillRank`` per prefill rank it registered with, a
``ReceiverRoom`` per room, each failed room's ``AbortRecord``), the rank's deadlines and tombstones,
and the routing of every input to its machine's rows. The rules themselves are those rows
(``machines.prefill_rank``, ``machines.room_receiver``, ``machines.decode_abort``): this module
finds the record, builds the step and runs the row; it holds no rule of its own beyond what an
input needs to reach its record (a stale epoch is dropped, a newer one is a new record, a
message for no room is counted). Must not do I/O, start threads or read a clock: every input
carries ``now``; the driver calls ``tick(now)`` at ``next_deadline()``.

Inputs: ``connect(route_table)`` (register with every prefill rank of an instance), ``receive``
(messages), the scheduler's ``open_room`` (``receiver.init``), ``abort_room``, ``close_room``, the
driver's ``connections_cut`` and ``checksums_verified`` (the verdict on a room's pages, after
``VerifyChecksums``), and the queries ``poll`` / ``failure`` / ``release_ready``.

Safety rules these rows enforce (DESIGN section 8):
- a failed room's pages are reusable only after every prefill rank that was told the destinations
  acknowledged the abort (after its in-flight writes ended), or the counted ``quarantine`` bound.
  Each release is counted by what proves it (``ReleaseKind``, ``machines.decode_abort``);
- Success only when every required (non-dummy) prefill rank reported Success, and, for a room
  opened with ``verify_checksums``, the driver found its pages equal to what those ranks sent
  (a mismatch fails the room with ``FailureCause.CHECKSUM``, naming the page);
- every non-terminal room and every pending abort has a deadline;
- liveness of prefill ranks: a Heartbeat goes to every registered prefill rank each
  ``heartbeat_interval``, and any message of its current epoch is a sign of life. A silent rank fails
  its rooms and is registered with again; silence is no proof that it stopped writing, so those
  rooms' pages still wait for its AbortAck. A newer epoch means the old process is gone: its rooms
  fail, the new incarnation is registered with at once, and the rooms' pages wait for the new
  incarnation's AbortAck (a request sent to the address may have reached it) and then settle (the old
  process's bytes may still be in the sockets it left).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import attrs

from pdkv.errors import InvalidArgumentError, LocalProtocolError
from pdkv.mapping.layout import BufferKind, BufferLayout
from pdkv.mapping.layout_policy import DEFAULT_LAYOUT_POLICY, LayoutPolicy
from pdkv.protocol import arguments
from pdkv.protocol._deadlines import DeadlineQueue, Tombstones
from pdkv.protocol._rooms import Counts, Heartbeats, RoomKeeper
from pdkv.protocol.config import Timeouts
from pdkv.protocol.effects import (
    ChecksumMismatch,
    DecodeEffect,
    Failure,
    FailureCause,
    ForgetPeer,
    LeaseLanding,
    Notice,
    NoticeLevel,
    PeerKey,
    ReleaseKind,
    Send,
    Target,
)
from pdkv.protocol.ids import Endpoint, Epoch, RoomId, SessionId
from pdkv.protocol.machines._decode_side import (
    AbortStep,
    DecodeAbortInput,
    DecodeAbortState,
    PrefillRank,
    PrefillRankInput,
    PrefillRankState,
    RankStep,
    ReceiverRoom,
    ReceiverRoomInput,
    ReceiverRoomState,
    RoomStep,
)
from pdkv.protocol.machines.prefill_rank import PrefillRankMachine
from pdkv.protocol.machines.room_receiver import ReceiverRoomMachine
from pdkv.protocol.messages import (
    MAX_REASON_CHARS,
    Abort,
    AbortAck,
    Heartbeat,
    HeartbeatAck,
    IntArray,
    LandingGrant,
    Message,
    Origin,
    Outcome,
    Register,
    RegisterAck,
    RegisterReject,
    RouteTable,
    StateIndices,
    TransferMetricData,
    TransferStatus,
    index_array,
)
from pdkv.protocol.poll import KVPoll
from pdkv.protocol.registration import DraftSkipped

_POLL = {
    ReceiverRoomState.BOOTSTRAPPING: KVPoll.Bootstrapping,
    ReceiverRoomState.WAITING_FOR_INPUT: KVPoll.WaitingForInput,
    ReceiverRoomState.TRANSFERRING: KVPoll.Transferring,
    ReceiverRoomState.SCATTERING: KVPoll.Transferring,
    ReceiverRoomState.VERIFYING: KVPoll.Transferring,
    ReceiverRoomState.SUCCESS: KVPoll.Success,
    ReceiverRoomState.FAILED: KVPoll.Failed,
}
_AWAITING_ACKS = (DecodeAbortState.REQUESTED, DecodeAbortState.QUARANTINED)
_RELEASED = (DecodeAbortState.RELEASED, DecodeAbortState.TIMED_OUT)

PeerState = PrefillRankState  # the name earlier code imported from here


@attrs.frozen(kw_only=True)
class DecodeStatistics:
    """Counters of one decode endpoint since it started (``rooms_open``, ``rooms_quarantined`` and
    ``pages_quarantined`` are levels, counted when asked). The one declaration of its counters."""

    rooms_open: int = 0
    rooms_succeeded: int = 0
    rooms_failed: int = 0
    aborts_sent: int = 0
    aborts_acked: int = 0
    unsafe_releases: int = 0
    """Pages released after the quarantine bound with an AbortAck still missing."""
    rooms_quarantined: int = 0
    """Rooms whose pages are held now because a prefill rank has not acknowledged their abort."""
    pages_quarantined: int = 0
    """Destination pages of those rooms."""
    quarantines: int = 0
    """Rooms ever quarantined (the abort-ack wait timed out)."""
    quarantines_released: int = 0
    """Quarantined rooms whose pages came back safely (every rank acknowledged in the end)."""
    quarantines_proven: int = 0
    """Of those, released proven: acknowledged after fences, then the prefill hosts' connections cut."""
    releases_acked: int = 0
    """Failed rooms released on the acks alone (every write of the room had completed): proven."""
    releases_cut: int = 0
    """Failed rooms released after acks and a cut of the prefill hosts' connections: proven."""
    releases_settled: int = 0
    """Failed rooms released ``quarantine_settle`` after the acks, without a cut: not proven."""
    releases_nothing_sent: int = 0
    """Failed rooms whose destinations no prefill rank was told: nothing could land."""
    aborts_resent: int = 0
    late_messages: int = 0
    stale_messages: int = 0
    unexpected_messages: int = 0
    aborts_unknown_room: int = 0
    """Abort from a prefill rank for a room this rank does not hold (logged with the room id)."""
    peers_lost: int = 0
    """Prefill ranks that went silent for ``heartbeat_timeout`` (registered with again)."""
    peer_restarts: int = 0
    """Prefill ranks seen with a newer epoch."""
    rooms_verified: int = 0
    """Rooms whose pages matched every prefill rank's checksums before Success (``PDKV_KV_CHECKSUM``)."""
    checksum_failures: int = 0
    """Rooms failed because a page differed from what a prefill rank sent (``FailureCause.CHECKSUM``)."""
    registrations_degraded: int = 0
    """RegisterAcks accepted that leave draft-model buffers out (once per pair of ranks)."""
    rooms_landed: int = 0
    """Rooms whose KV pages landed in a landing lease and were scattered into the pages before Success
    (decode TP below prefill TP)."""
    landing_fallbacks: int = 0
    """Landing rooms larger than the whole landing pool: their requests went grant-less (strided)."""
    rooms_draft_skipped: int = 0
    """Rooms that succeeded without some draft-model buffers (``receiver.draft_skipped()``)."""
    draft_buffers_skipped: int = 0
    """Draft buffers (both sides') left out, summed over the registered prefill ranks (a level)."""


_LEVELS = ("rooms_open", "rooms_quarantined", "pages_quarantined", "draft_buffers_skipped")


class DecodeEndpoint(RoomKeeper[ReceiverRoom]):
    """The protocol state of one decode rank (sans-IO)."""

    side = "decode"

    def __init__(
        self,
        *,
        origin: Origin,
        tp_size: int,
        endpoint: Endpoint,
        session: SessionId,
        layout: BufferLayout,
        timeouts: Timeouts | None = None,
        cuts_connections: bool = False,
        layout_policy: LayoutPolicy = DEFAULT_LAYOUT_POLICY,
    ) -> None:
        """``cuts_connections``: the driver can end every engine connection from a host and will
        answer ``CutConnections`` with ``connections_cut`` (a quarantined room is then released as
        soon as it is proven safe, instead of after ``quarantine_settle``). ``layout_policy``:
        whether a RegisterAck that leaves draft buffers out is accepted (``STRICT``: refused)."""
        if not isinstance(layout_policy, LayoutPolicy):
            raise InvalidArgumentError(
                f"layout_policy must be a LayoutPolicy, got {layout_policy!r}",
                argument="layout_policy",
                value=layout_policy,
            )
        self.origin = origin
        self.layout_policy = layout_policy
        self.cuts_connections = cuts_connections
        self.timeouts = timeouts if timeouts is not None else Timeouts()
        self.register_message = Register(
            origin=origin, tp_size=tp_size, endpoint=endpoint, session=session, layout=layout
        )
        self._ranks: dict[PeerKey, PrefillRank] = {}
        self._keep_rooms()
        self._resends: DeadlineQueue[RoomId] = DeadlineQueue()
        # Registrations to resend, by when: a tick or a deadline query touches only the due ones, not
        # every rank (at hundreds of prefill ranks a scan per control-loop pass adds up).
        self._register_resends: DeadlineQueue[PeerKey] = DeadlineQueue()
        self._quarantined: dict[RoomId, int] = {}  # room -> destination pages held
        # Cleared room ids, refused until they expire: a late status of the room that had the id
        # must never complete a new room that reuses it.
        self._tombstones: Tombstones[RoomId, None] = Tombstones()
        self._heartbeats = Heartbeats(self.timeouts.heartbeat_interval)  # due while a rank is READY
        self._counts = Counts(DecodeStatistics, levels=_LEVELS)
        self._out: list[DecodeEffect] = []
        # What each message type does (aioquic's frame table): its handler, given the sender's
        # record of the current epoch.
        self._handlers: dict[type[Message], Callable[[PrefillRank, Message, float], None]] = {
            RegisterAck: self._on_register_ack,
            RegisterReject: self._on_register_reject,
            TransferStatus: self._on_status,
            AbortAck: self._on_abort_ack,
            Abort: self._on_abort,
            Heartbeat: self._on_heartbeat,
            HeartbeatAck: lambda rank, message, now: None,  # its only news: the rank is alive
        }

    # ------------------------------------------------------------------ services of the rows

    def count(self, name: str, by: int = 1) -> None:
        self._counts.add(name, by)

    def emit(self, effect: DecodeEffect) -> None:
        self._out.append(effect)

    def rank(self, key: PeerKey) -> PrefillRank | None:
        return self._ranks.get(key)

    def room_records(self) -> Iterable[ReceiverRoom]:
        return self._rooms.values()

    def set_deadline(self, room: ReceiverRoom, when: float) -> None:
        self._set_deadline(room, when)

    def schedule_register(self, rank: PrefillRank, now: float) -> None:
        rank.register_due = now + self.timeouts.register_retry
        self._register_resends.push(rank.key, rank.register_due)

    def schedule_abort_resend(self, room: ReceiverRoom, now: float) -> None:
        assert room.abort is not None
        room.abort.resend_at = self.timeouts.resend_at(now, room.abort.resends)
        if room.abort.resend_at is not None:
            self._resends.push(room.room, room.abort.resend_at)

    def arm_heartbeats(self, now: float) -> None:
        self._heartbeats.arm(now)

    def hold_quarantined(self, room: ReceiverRoom) -> None:
        self._quarantined[room.room] = int(room.dst_pages.size)

    def drop_quarantined(self, room: ReceiverRoom) -> bool:
        return self._quarantined.pop(room.room, None) is not None

    def _effects(self) -> list[DecodeEffect]:
        """What the steps of the current input emitted, in order (and a fresh list for the next)."""
        out, self._out = self._out, []
        return out

    # ------------------------------------------------------------------ registration

    def set_engine_metadata(self, metadata: bytes) -> None:
        """What every Register sent from now on carries for the prefill's engine (the backend's
        ``engine_metadata`` once this rank's buffers are registered)."""
        self.register_message = attrs.evolve(self.register_message, engine_metadata=metadata)

    def connect(self, route: RouteTable, now: float) -> list[DecodeEffect]:
        """Register with every prefill rank of ``route`` (idempotent for ranks already registered)."""
        for entry in route.ranks:
            key = (route.origin.instance, entry.rank)
            known = self._ranks.get(key)
            if known is not None and entry.epoch < known.epoch:
                continue
            if (
                known is not None
                and entry.epoch == known.epoch
                and known.machine.state is not PrefillRankState.REJECTED
            ):
                continue
            fresh = self._new_rank(key, entry.epoch, entry.endpoint, entry.session)
            if known is not None and entry.epoch > known.epoch:
                self._replace(known, fresh, now)
            else:
                self._ranks[key] = fresh
                self._step_rank(fresh, PrefillRankInput.REGISTER_DUE, now)
        return self._effects()

    def peer_ready(self, target: Target) -> bool:
        rank = self._ranks.get(target.key)
        return rank is not None and rank.machine.state is PrefillRankState.READY

    def peer_refusal(self, target: Target) -> str | None:
        """The reason ``target``'s prefill rank refused our registration (None unless it did)."""
        rank = self._ranks.get(target.key)
        return rank.reason if rank is not None and rank.machine.state is PrefillRankState.REJECTED else None

    def peer_ack(self, target: Target) -> RegisterAck | None:
        """The RegisterAck ``target``'s prefill rank registered this rank with (None before one): what
        their transfers leave out."""
        rank = self._ranks.get(target.key)
        return None if rank is None else rank.ack

    def peer_session(self, target: Target) -> SessionId | None:
        rank = self._ranks.get(target.key)
        return None if rank is None else rank.session

    def peer_epoch(self, target: Target) -> Epoch | None:
        """The epoch this rank knows for ``target``'s prefill rank (None if unknown)."""
        rank = self._ranks.get(target.key)
        return None if rank is None else rank.epoch

    def _register_deadline(self, key: PeerKey) -> float | None:
        """When the registration with ``key``'s current incarnation is resent (None: not registering)."""
        rank = self._ranks.get(key)
        return (
            rank.register_due
            if rank is not None and rank.machine.state is PrefillRankState.REGISTERING
            else None
        )

    # ------------------------------------------------------------------ network input

    def receive(self, message: Message, now: float) -> list[DecodeEffect]:
        """Handle one decoded message from a prefill rank."""
        key = (message.origin.instance, message.origin.rank)
        rank = self._ranks.get(key)
        if rank is not None and message.origin.epoch > rank.epoch:
            # The rank restarted behind the same address: a new record. A RegisterAck/Reject of the
            # new epoch answers a Register we sent to that address, so it counts; anything else of the
            # new epoch belongs to no room of ours.
            reborn = self._new_rank(key, message.origin.epoch, rank.endpoint, rank.session)
            answer = isinstance(message, (RegisterAck, RegisterReject))
            self._replace(rank, reborn, now, register=not answer)
            if answer:
                self._handlers[type(message)](reborn, message, now)
            return self._effects()
        if rank is None or message.origin.epoch != rank.epoch:
            self.count("stale_messages")
            self.emit(
                Notice(
                    level=NoticeLevel.INFO,
                    text=f"dropped {type(message).__name__} from stale or unknown {message.origin}",
                )
            )
            return self._effects()
        rank.last_heard = now
        handler = self._handlers.get(type(message))
        if handler is None:
            self.count("unexpected_messages")
            self.emit(
                Notice(
                    level=NoticeLevel.WARNING,
                    text=f"decode got unexpected {type(message).__name__} from {message.origin}",
                )
            )
        else:
            handler(rank, message, now)
        return self._effects()

    def _on_register_ack(self, rank: PrefillRank, message: Message, now: float) -> None:
        assert isinstance(message, RegisterAck)
        self._step_rank(rank, PrefillRankInput.REGISTER_ACK, now, ack=message)

    def _on_register_reject(self, rank: PrefillRank, message: Message, now: float) -> None:
        assert isinstance(message, RegisterReject)
        if message.retry:
            # Not a refusal of our layout: the rank no longer knows us (it forgot us after silence,
            # or restarted) and says so in answer to a heartbeat.
            reason = f"prefill rank {rank.name} no longer knows this rank"
            self._step_rank(rank, PrefillRankInput.NOT_KNOWN, now, reason=reason)
        else:
            self._step_rank(rank, PrefillRankInput.REFUSED, now, reason=message.reason)

    def _on_status(self, rank: PrefillRank, message: Message, now: float) -> None:
        assert isinstance(message, TransferStatus)
        room = self._rooms.get(message.room)
        if room is None:
            self._late(message, message.room)
            return
        if message.outcome is Outcome.FAILED:
            reason = _clip(f"prefill {message.origin} failed: {message.reason}")
            step = RoomStep(self, room, now, rank.key, reason, FailureCause.ABORTED_BY_PEER)
            room.machine.step(ReceiverRoomInput.FAILED, step)
        else:
            step = RoomStep(self, room, now, rank.key, metric=message.metric, checksums=message.checksums)
            room.machine.step(ReceiverRoomInput.SUCCESS, step)

    def _on_abort_ack(self, rank: PrefillRank, message: Message, now: float) -> None:
        assert isinstance(message, AbortAck)
        room = self._rooms.get(message.room)
        if room is None or room.abort is None:
            self._late(message, message.room)
            return
        step = AbortStep(self, room, room.abort, now, rank.key, fenced=message.fenced)
        room.abort.machine.step(DecodeAbortInput.ABORT_ACK, step)

    def _on_abort(self, rank: PrefillRank, message: Message, now: float) -> None:
        assert isinstance(message, Abort)
        room = self._rooms.get(message.room)
        if room is None:
            self.count("aborts_unknown_room")
            self.emit(
                Notice(
                    level=NoticeLevel.WARNING,
                    text=f"abort for unknown room {message.room} from {message.origin}: {message.reason}",
                    room=message.room,
                )
            )
            return
        reason = _clip(f"aborted by prefill {message.origin}: {message.reason}")
        room.machine.step(
            ReceiverRoomInput.PEER_ABORT,
            RoomStep(self, room, now, rank.key, reason, FailureCause.ABORTED_BY_PEER),
        )

    def _on_heartbeat(self, rank: PrefillRank, message: Message, now: float) -> None:
        assert isinstance(message, Heartbeat)
        self.emit(Send(to=rank.endpoint, message=HeartbeatAck(origin=self.origin, seq=message.seq)))

    # ------------------------------------------------------------------ scheduler input

    def open_room(
        self,
        room: RoomId,
        *,
        targets: Sequence[Target],
        dst_pages: IntArray | Sequence[int],
        dst_aux_row: int | None,
        dst_state: Sequence[StateIndices] = (),
        required_dst_info_num: int = 1,
        prefix_pages: int = 0,
        verify_checksums: bool = False,
        landing: bool = False,
        now: float,
    ) -> list[DecodeEffect]:
        """``receiver.init``: the room's destinations (by position) and the prefill ranks it needs;
        ``prefix_pages``: the first positions this rank already holds (no prefill rank writes them);
        ``verify_checksums``: Success waits for the driver's verdict on the pages (``VerifyChecksums``);
        ``landing``: the KV pages land in a landing lease first (decode TP below prefill TP): the
        driver is asked for one (``LeaseLanding``) and the requests wait for ``landing_granted``.

        Every argument is checked against this rank's own buffers first (``InvalidArgumentError``,
        or ``MappingError`` for repeated pages); a bad call creates nothing.
        """
        if room in self._rooms:
            raise LocalProtocolError(f"room {room} was already opened on decode {self.origin}")
        if len({t.key for t in targets}) != len(targets):
            raise LocalProtocolError(f"room {room}: a prefill rank is listed twice in targets")
        layout = self.register_message.layout
        pages = arguments.page_list(dst_pages, room=room, argument="dst_pages", limit=layout.min_kv_items)
        rows = layout.min_items(BufferKind.AUX)
        aux_row = arguments.optional_row(dst_aux_row, room=room, argument="aux_row", rows=rows)
        state = arguments.state_list(dst_state, room=room, argument="state_indices")
        for item in state:
            if not layout.select(item.kind):
                raise InvalidArgumentError(
                    f"room {room}: state_indices name kind {item.kind.value}, not registered on this rank",
                    room=room,
                    argument="state_indices",
                    value=item.kind,
                )
            arguments.page_list(
                item.indices,
                room=room,
                argument=f"state_indices[{item.kind.value}]",
                limit=layout.min_items(item.kind),
            )
        required = arguments.count(
            required_dst_info_num, room=room, argument="required_dst_info_num", minimum=1, maximum=1 << 16
        )
        prefix = arguments.count(prefix_pages, room=room, argument="prefix_pages", maximum=int(pages.size))
        if room in self._tombstones:
            # Reused too soon: no request goes out, so no prefill rank writes; the room fails at
            # once instead of waiting for a deadline (or taking a late status of the old room).
            r = self._failed_room(room, targets)
            reason = (
                f"room id reused: room {room} was cleared on decode {self.origin} less than "
                f"{self.timeouts.tombstone:g} s ago"
            )
            self._fail(r, reason, FailureCause.INVALID, now)
            return self._effects()
        r = self._new_room(
            room,
            targets,
            now,
            pages=index_array(pages),
            aux_row=aux_row,
            state=state,
            required=required,
            prefix=prefix,
        )
        r.verify = bool(verify_checksums)
        self._set_deadline(r, now + self.timeouts.bootstrap)
        wants_landing = bool(landing) and r.prefix_pages < r.dst_pages.size
        if not r.required:
            why = "every target prefill rank is a dummy" if r.targets else "no target prefill rank was given"
            self._fail(r, f"room has no transfer destination: {why}", FailureCause.NO_DESTINATION, now)
            return self._effects()
        for t in r.targets:
            rank = self._ranks.get(t.key)
            if rank is None:
                reason = f"target prefill rank {t.instance}:{t.rank} is unknown (connect() first)"
                self._fail(r, reason, FailureCause.NO_DESTINATION, now)
                return self._effects()
            if rank.machine.state is PrefillRankState.REJECTED:
                reason = _clip(
                    f"target prefill rank {t.instance}:{t.rank} rejected registration: {rank.reason}"
                )
                self._fail(r, reason, FailureCause.INVALID, now)
                return self._effects()
        if wants_landing:
            r.landing = True
            sources = tuple(t.key for t in r.targets if not t.dummy)
            self.emit(
                LeaseLanding(room=room, dst_pages=r.dst_pages, prefix_pages=r.prefix_pages, sources=sources)
            )
        if all(self.peer_ready(t) for t in r.targets):
            r.machine.step(ReceiverRoomInput.TARGETS_READY, RoomStep(self, r, now))
        return self._effects()

    def abort_room(
        self, room: RoomId, reason: str, now: float, *, targets: Sequence[Target] = ()
    ) -> list[DecodeEffect]:
        """``receiver.abort``: fail the room and tell every prefill rank; pages wait for the acks.

        A room not opened yet is created Failed and its ``targets`` (the prefill ranks it would
        have asked) are told, so a prefill scheduler that opens it sees Failed at once; none of
        them was given a destination, so nothing waits for an ack.
        """
        r = self._rooms.get(room) or self._failed_room(room, targets)
        step = RoomStep(
            self, r, now, reason=_clip(f"aborted by decode: {reason}"), cause=FailureCause.ABORTED_HERE
        )
        r.machine.step(ReceiverRoomInput.ABORT, step)
        return self._effects()

    def close_room(self, room: RoomId, now: float) -> None:
        """``receiver.clear``: forget a room whose pages are no longer at risk; its id is refused for
        ``tombstone`` seconds so a late status of this room cannot complete a room that reuses it."""
        r = self._rooms.get(room)
        if r is None:
            return
        if not self.release_ready(room):
            raise LocalProtocolError(
                f"room {room} closed before its pages were safe to reuse ({r.machine.state.name}); "
                "wait until release_ready() is True"
            )
        del self._rooms[room]
        self._tombstones.put(room, None, now + self.timeouts.tombstone)

    # ------------------------------------------------------------------ queries

    def poll(self, room: RoomId) -> KVPoll:
        """The room's state; a room not opened yet (``receiver.init`` not called) is Bootstrapping."""
        r = self._rooms.get(room)
        return KVPoll.Bootstrapping if r is None else _POLL[r.machine.state]

    def failure(self, room: RoomId) -> str | None:
        r = self._rooms.get(room)
        return None if r is None else r.failure

    def failure_cause(self, room: RoomId) -> FailureCause | None:
        r = self._rooms.get(room)
        return None if r is None else r.cause

    def failure_record(self, room: RoomId) -> Failure | None:
        """The room's failure as the scheduler reads it (None unless it failed); a checksum failure
        says where (``Failure.mismatch``)."""
        r = self._rooms.get(room)
        failure = None if r is None else self._failure_of(r)
        if failure is not None and r is not None and r.mismatch is not None:
            failure = attrs.evolve(failure, mismatch=r.mismatch)
        return failure

    def release_ready(self, room: RoomId) -> bool:
        """True when no prefill rank can still write into the room's pages (or the ack wait timed out);
        True too before ``receiver.init``: no prefill rank was told any page of it."""
        r = self._rooms.get(room)
        if r is None or r.machine.state is ReceiverRoomState.SUCCESS:
            return True
        return r.abort is not None and r.abort.machine.state in _RELEASED

    def release_was_safe(self, room: RoomId) -> bool:
        """False only after the unsafe release (the quarantine bound passed with an ack missing)."""
        kind = self.release_kind(room)
        return kind is None or kind.safe

    def release_kind(self, room: RoomId) -> ReleaseKind | None:
        """How the room's pages came back (None: not released, the room succeeded, or it is unknown)."""
        r = self._rooms.get(room)
        return None if r is None or r.abort is None else r.abort.release

    def draft_skipped(self, room: RoomId) -> DraftSkipped | None:
        """What of the draft model the room's transfer leaves out (None: nothing, or not opened yet);
        known once its requests went (WaitingForInput), final at Success."""
        r = self._rooms.get(room)
        return None if r is None else r.draft_skipped

    def draft_buffers_skipped(self) -> int:
        """Draft buffers of both sides left out, summed over the registered (READY) prefill ranks."""
        return sum(
            r.left_out_count for r in self._ranks.values() if r.machine.state is PrefillRankState.READY
        )

    def metric(self, room: RoomId) -> dict[PeerKey, TransferMetricData]:
        """What each prefill rank reported writing (empty for a room not opened: nothing moved)."""
        r = self._rooms.get(room)
        return {} if r is None else dict(r.metric)

    def room_history(self, room: RoomId) -> list[ReceiverRoomState]:
        return list(self._room(room).machine.history)

    def abort_state(self, room: RoomId) -> DecodeAbortState | None:
        r = self._room(room)
        return None if r.abort is None else r.abort.machine.state

    # ------------------------------------------------------------------ timers

    def next_deadline(self) -> float | None:
        room_deadline = self._next_room_deadline()
        resend = self._resends.next_deadline(self._resend_deadline)
        tombstone = self._tombstones.next_expiry()
        register = self._register_resends.next_deadline(self._register_deadline)
        candidates = [
            d for d in (room_deadline, resend, tombstone, register, self._heartbeats.due) if d is not None
        ]
        return min(candidates, default=None)

    def tick(self, now: float) -> list[DecodeEffect]:
        """Heartbeat round when due (register again with silent ranks, greet the others); resend due
        registrations and Aborts; the deadlines of rooms and aborts; expired tombstones."""
        if self._heartbeats.is_due(now):
            self._heartbeat_round(now)
        for key in self._register_resends.pop_due(now, self._register_deadline):
            self._step_rank(self._ranks[key], PrefillRankInput.REGISTER_DUE, now)
        self._tombstones.expire(now)
        for room in self._resends.pop_due(now, self._resend_deadline):
            r = self._rooms[room]
            assert r.abort is not None
            r.abort.machine.step(DecodeAbortInput.RESEND_DUE, AbortStep(self, r, r.abort, now))
        for room in self._due_rooms(now):
            r = self._rooms[room]
            if r.abort is not None:
                r.abort.machine.step(DecodeAbortInput.DEADLINE, AbortStep(self, r, r.abort, now))
                continue
            limit = {
                ReceiverRoomState.BOOTSTRAPPING: ("bootstrap", self.timeouts.bootstrap),
                ReceiverRoomState.WAITING_FOR_INPUT: ("waiting", self.timeouts.waiting),
                ReceiverRoomState.TRANSFERRING: ("transfer", self.timeouts.transfer),
                ReceiverRoomState.SCATTERING: ("transfer", self.timeouts.transfer),
                ReceiverRoomState.VERIFYING: ("transfer", self.timeouts.transfer),
            }[r.machine.state]
            reason = f"{limit[0]} timeout: still {r.machine.state.name} after {limit[1]:g} s"
            self._fail(r, reason, FailureCause.TIMEOUT, now)
        return self._effects()

    def _heartbeat_round(self, now: float) -> None:
        seq = self._heartbeats.next_seq()
        for rank in list(self._ranks.values()):
            if rank.machine.state is not PrefillRankState.READY:
                continue
            if now - rank.last_heard >= self.timeouts.heartbeat_timeout:
                reason = f"prefill rank {rank.name} silent for {now - rank.last_heard:.3g} s"
                self._step_rank(rank, PrefillRankInput.SILENCE, now, reason=reason)
            else:
                beat = Heartbeat(origin=self.origin, seq=seq, endpoint=self.register_message.endpoint)
                self.emit(Send(to=rank.endpoint, message=beat))
        ready = any(r.machine.state is PrefillRankState.READY for r in self._ranks.values())
        self._heartbeats.reschedule(now, again=ready)

    def _resend_deadline(self, room: RoomId) -> float | None:
        r = self._rooms.get(room)
        if r is None or r.abort is None or r.abort.machine.state not in _AWAITING_ACKS:
            return None
        return r.abort.resend_at

    # ------------------------------------------------------------------ the driver's answers

    def connections_cut(self, room: RoomId, ok: bool, reason: str, now: float) -> list[DecodeEffect]:
        """The driver ended (``ok``) every engine connection from the hosts of ``CutConnections``, and
        every socket of them is closed: nothing of the room's failed writes can land any more, so its
        pages come back, proven. A failed cut falls back to ``quarantine_settle``."""
        r = self._rooms.get(room)
        if r is None or r.abort is None or r.abort.machine.state is not DecodeAbortState.CUTTING:
            return []
        step = AbortStep(self, r, r.abort, now, reason=reason)
        r.abort.machine.step(DecodeAbortInput.CUT if ok else DecodeAbortInput.CUT_FAILED, step)
        return self._effects()

    def checksums_verified(
        self, room: RoomId, mismatch: ChecksumMismatch | None, now: float
    ) -> list[DecodeEffect]:
        """The driver's verdict on a ``VerifyChecksums``: None, every page matched (the room
        succeeds); else where it differs (the room fails with ``FailureCause.CHECKSUM`` and the
        prefill rank named, and its pages wait for the abort handshake). A verdict for a room that
        failed meanwhile, or is gone, changes nothing."""
        r = self._rooms.get(room)
        if r is None:
            return []
        if mismatch is None:
            r.machine.step(ReceiverRoomInput.VERIFIED, RoomStep(self, r, now))
        else:
            by = next((t.key for t in r.targets if f"{t.instance}:{t.rank}" == mismatch.prefill), None)
            step = RoomStep(
                self, r, now, by, _clip(mismatch.detail), FailureCause.CHECKSUM, mismatch=mismatch
            )
            r.machine.step(ReceiverRoomInput.CORRUPT, step)
        return self._effects()

    def landing_granted(
        self, room: RoomId, grants: Mapping[PeerKey, LandingGrant] | None, now: float
    ) -> list[DecodeEffect]:
        """The driver's answer to ``LeaseLanding``: the region of each source (None or empty: no lease,
        the room is larger than the pool and its requests go grant-less). The requests go once every
        target is registered too. For a room no longer waiting (failed, gone) it changes nothing: the
        driver releases the lease with the room (``ReleasePages``), or at once when it is gone."""
        r = self._rooms.get(room)
        if r is None or not r.landing or r.grants is not None:
            return []
        r.machine.step(ReceiverRoomInput.LANDING_GRANTED, RoomStep(self, r, now, grants=dict(grants or {})))
        return self._effects()

    def landing_scattered(self, room: RoomId, error: str | None, now: float) -> list[DecodeEffect]:
        """The driver's answer to ``ScatterLanding``: None, the landed heads are in the pages (the room
        moves on to Verifying or Success); else why not (the room fails, ``FailureCause.ENGINE``, and
        its pages and lease follow the abort handshake). A room that failed meanwhile stays failed."""
        r = self._rooms.get(room)
        if r is None:
            return []
        if error is None:
            r.machine.step(ReceiverRoomInput.SCATTERED, RoomStep(self, r, now))
        else:
            reason = _clip(f"landing scatter failed: {error}")
            r.machine.step(
                ReceiverRoomInput.SCATTER_FAILED, RoomStep(self, r, now, None, reason, FailureCause.ENGINE)
            )
        return self._effects()

    def wants_landing(self, room: RoomId) -> bool:
        """Whether the room waits for (or holds) a landing lease."""
        r = self._rooms.get(room)
        return r is not None and r.landing

    # ------------------------------------------------------------------ statistics

    def quarantine_figures(self) -> tuple[int, int, int, int, int]:
        """(rooms quarantined now, their pages, quarantines ever, released safely, of which proven):
        O(quarantined)."""
        return (
            len(self._quarantined),
            sum(self._quarantined.values()),
            self._counts["quarantines"],
            self._counts["quarantines_released"],
            self._counts["quarantines_proven"],
        )

    def statistics(self) -> DecodeStatistics:
        return DecodeStatistics(
            rooms_open=sum(1 for r in self._rooms.values() if not r.terminal),
            rooms_quarantined=len(self._quarantined),
            pages_quarantined=sum(self._quarantined.values()),
            draft_buffers_skipped=self.draft_buffers_skipped(),
            **self._counts.values(),
        )

    # ------------------------------------------------------------------ internals

    def _new_rank(self, key: PeerKey, epoch: Epoch, endpoint: Endpoint, session: SessionId) -> PrefillRank:
        label = f"prefill rank {key[0]}:{key[1]} epoch {epoch}"
        return PrefillRank(
            key=key, epoch=epoch, endpoint=endpoint, session=session, machine=PrefillRankMachine(label)
        )

    def _step_rank(
        self,
        rank: PrefillRank,
        what: PrefillRankInput,
        now: float,
        *,
        reason: str = "",
        ack: RegisterAck | None = None,
    ) -> None:
        rank.machine.step(what, RankStep(side=self, rank=rank, now=now, reason=reason, ack=ack))

    def _replace(self, old: PrefillRank, new: PrefillRank, now: float, *, register: bool = True) -> None:
        """A prefill rank restarted behind the same address: its record is replaced (before its rooms
        fail, so their Aborts wait until the new process acknowledged registration: before that it
        would drop our messages as from an unregistered rank), every live room that targets it fails,
        and every room it was told the destinations of can no longer be proven by an ack: the old
        process's bytes in the sockets it left outlive it, and the new one acks a room it never knew.
        The new incarnation is registered with at once, unless ``register`` is False: it has just
        answered a Register of ours (then its resend is due now, as for any registering rank)."""
        reason = f"prefill rank {old.name} restarted (epoch {old.epoch} -> {new.epoch})"
        self.count("peer_restarts")
        self._ranks[new.key] = new
        self.emit(ForgetPeer(endpoint=old.endpoint, reason=reason))
        self.emit(Notice(level=NoticeLevel.WARNING, text=reason))
        for r in list(self._rooms.values()):
            if not r.terminal and old.key in r.target_keys:
                self._fail(r, reason, FailureCause.PEER_RESTART, now, by=old.key)
            if r.abort is not None and old.key in r.armed and r.abort.machine.state in _AWAITING_ACKS:
                r.abort.unproven.add(old.key)
        if register:
            self._step_rank(new, PrefillRankInput.REGISTER_DUE, now)
        else:
            self._register_resends.push(new.key, new.register_due)

    def _new_room(
        self,
        room: RoomId,
        targets: Sequence[Target],
        now: float,
        *,
        pages: IntArray,
        aux_row: int | None,
        state: tuple[StateIndices, ...],
        required: int,
        prefix: int,
    ) -> ReceiverRoom:
        r = ReceiverRoom(
            room=room,
            machine=ReceiverRoomMachine(f"room {room}"),
            targets=tuple(targets),
            dst_pages=pages,
            dst_aux_row=aux_row,
            dst_state=state,
            required_dst_info_num=required,
            deadline=None,
            prefix_pages=prefix,
        )
        self._rooms[room] = r
        return r

    def _failed_room(self, room: RoomId, targets: Sequence[Target]) -> ReceiverRoom:
        """A room record for a room that fails before any request went out (nothing to wait for)."""
        return self._new_room(
            room, targets, 0.0, pages=index_array(()), aux_row=None, state=(), required=1, prefix=0
        )

    def _fail(
        self, r: ReceiverRoom, reason: str, cause: FailureCause, now: float, *, by: PeerKey | None = None
    ) -> None:
        """A failure decided here (a deadline, a restart, no destination): the room's ``fail`` row."""
        r.machine.step(ReceiverRoomInput.FAIL, RoomStep(self, r, now, by, reason, cause))

    def _late(self, msg: Message, room: RoomId) -> None:
        self.count("late_messages")
        self.emit(
            Notice(
                level=NoticeLevel.DEBUG,
                text=f"late {type(msg).__name__} from {msg.origin} for room {room}",
                room=room,
            )
        )


def _clip(text: str) -> str:
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


__all__ = ["DecodeEndpoint", "DecodeStatistics", "PeerState"]
