"""Sans-IO decode endpoint: the protocol of one decode rank, driven by inputs, answering with effects.

Owns: registration with prefill ranks, the receiver rooms of one rank, their abort handshakes and
the rank's deadlines. Must not do I/O, start threads or read a clock: every input carries ``now``;
the driver calls ``tick(now)`` at ``next_deadline()``.

Inputs: ``connect(route_table)`` (register with every prefill rank of an instance), ``receive``
(messages), the scheduler's ``open_room`` (``receiver.init``), ``abort_room``, ``close_room`` and
the queries ``poll`` / ``failure`` / ``release_ready``.

Safety rules this module enforces (DESIGN section 8):
- a failed room's pages are reusable only after every prefill rank that was told the destinations
  acknowledged the abort (after its in-flight writes ended). The Abort is resent with backoff until
  then (``abort_resend``, doubling, ``MAX_ABORT_RESENDS`` times) and again whenever a rank registers
  again. Past ``abort_ack`` the room is quarantined: its pages stay held (``release_ready`` False,
  counted in ``statistics()``) until the missing ranks acknowledge, or until the long
  ``quarantine`` bound, the only unsafe release, counted and reported. Each release is counted by
  what proves it (``ReleaseKind``): the acks alone when every write completed (ACKED); a quarantined
  room's acks and then a cut of the connections from those ranks' hosts (``CutConnections``,
  ``connections_cut``) when this rank can (``cuts_connections``): proven (CUT); otherwise, and
  whenever an ack cannot prove the connections empty (a rank's write failed: its AbortAck says
  ``fenced``, which proves its engine queue drained, not its connections; or it restarted after it
  was told the destinations), ``quarantine_settle`` after the last AbortAck (SETTLED: a time bound,
  not a proof, counted as such);
- Success only when every required (non-dummy) prefill rank reported Success;
- every non-terminal room and every pending abort has a deadline;
- liveness of prefill ranks: a Heartbeat goes to every registered prefill rank each
  ``heartbeat_interval``, and any message of its current epoch is a sign of life. A rank silent for
  ``heartbeat_timeout`` fails every room that targets it and is registered with again (its socket
  rebuilt first: ``ForgetPeer``). Silence is not proof that the rank stopped writing, so those rooms'
  pages still wait for its AbortAck (resent when it registers again) or the counted ``abort_ack``
  timeout. A newer epoch means the old process is gone: its rooms fail, the new incarnation is
  registered with at once, and the rooms' pages wait for the new incarnation's AbortAck (a request
  sent to the address may have reached it) or the same counted timeout.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from pdkv.errors import InvalidArgumentError, LocalProtocolError
from pdkv.mapping.layout import BufferKind, BufferLayout
from pdkv.protocol import arguments
from pdkv.protocol._deadlines import DeadlineQueue, Tombstones
from pdkv.protocol._rooms import Heartbeats, RoomKeeper
from pdkv.protocol.config import Timeouts
from pdkv.protocol.effects import (
    CutConnections,
    Effect,
    Failure,
    FailureCause,
    ForgetPeer,
    Notice,
    NoticeLevel,
    PeerKey,
    ReleaseKind,
    ReleasePages,
    RoomFinished,
    Send,
    Target,
)
from pdkv.protocol.ids import Endpoint, Epoch, RoomId, SessionId
from pdkv.protocol.machines import (
    DecodeAbortMachine,
    DecodeAbortState,
    DecodeAbortTrigger,
    PeerMachine,
    PeerState,
    PeerTrigger,
    ReceiverRoomMachine,
    ReceiverRoomState,
    ReceiverRoomTrigger,
)
from pdkv.protocol.messages import (
    MAX_REASON_CHARS,
    Abort,
    AbortAck,
    Heartbeat,
    HeartbeatAck,
    IntArray,
    Message,
    Origin,
    Outcome,
    Register,
    RegisterAck,
    RegisterReject,
    RouteTable,
    StateIndices,
    TransferMetricData,
    TransferRequest,
    TransferStatus,
    index_array,
)
from pdkv.protocol.poll import KVPoll

_POLL = {
    ReceiverRoomState.BOOTSTRAPPING: KVPoll.Bootstrapping,
    ReceiverRoomState.WAITING_FOR_INPUT: KVPoll.WaitingForInput,
    ReceiverRoomState.TRANSFERRING: KVPoll.Transferring,
    ReceiverRoomState.SUCCESS: KVPoll.Success,
    ReceiverRoomState.FAILED: KVPoll.Failed,
}


@attrs.define(eq=False)
class _PrefillPeer:
    key: PeerKey
    epoch: Epoch
    endpoint: Endpoint
    session: SessionId
    machine: PeerMachine = attrs.field(init=False)
    reason: str = ""
    register_due: float = 0.0
    last_heard: float = 0.0  # meaningful while READY: set when the registration was acknowledged

    def __attrs_post_init__(self) -> None:
        self.machine = PeerMachine(f"prefill rank {self.key[0]}:{self.key[1]} epoch {self.epoch}")

    @property
    def state(self) -> PeerState:
        return self.machine.state


@attrs.frozen(kw_only=True)
class DecodeStatistics:
    """Counters of one decode endpoint since it started."""

    rooms_open: int
    rooms_succeeded: int
    rooms_failed: int
    aborts_sent: int
    aborts_acked: int
    unsafe_releases: int
    """Pages released after the quarantine bound with an AbortAck still missing."""
    rooms_quarantined: int
    """Rooms whose pages are held now because a prefill rank has not acknowledged their abort."""
    pages_quarantined: int
    """Destination pages of those rooms."""
    quarantines: int
    """Rooms ever quarantined (the abort-ack wait timed out)."""
    quarantines_released: int
    """Quarantined rooms whose pages came back safely (every rank acknowledged in the end)."""
    quarantines_proven: int
    """Of those, released proven: acknowledged after fences, then the prefill hosts' connections cut."""
    releases_acked: int = 0
    """Failed rooms released on the acks alone (every write of the room had completed): proven."""
    releases_cut: int = 0
    """Failed rooms released after acks and a cut of the prefill hosts' connections: proven."""
    releases_settled: int = 0
    """Failed rooms released ``quarantine_settle`` after the acks, without a cut: not proven."""
    releases_nothing_sent: int = 0
    """Failed rooms whose destinations no prefill rank was told: nothing could land."""
    aborts_resent: int
    late_messages: int
    stale_messages: int
    unexpected_messages: int
    aborts_unknown_room: int
    """Abort from a prefill rank for a room this rank does not hold (logged with the room id)."""
    peers_lost: int
    """Prefill ranks that went silent for ``heartbeat_timeout`` (registered with again)."""
    peer_restarts: int
    """Prefill ranks seen with a newer epoch."""


@attrs.define(eq=False)
class _Counters:
    rooms_succeeded: int = 0
    rooms_failed: int = 0
    aborts_sent: int = 0
    aborts_acked: int = 0
    unsafe_releases: int = 0
    quarantines: int = 0
    quarantines_released: int = 0
    quarantines_proven: int = 0
    releases_acked: int = 0
    releases_cut: int = 0
    releases_settled: int = 0
    releases_nothing_sent: int = 0
    aborts_resent: int = 0
    late_messages: int = 0
    stale_messages: int = 0
    unexpected_messages: int = 0
    aborts_unknown_room: int = 0
    peers_lost: int = 0
    peer_restarts: int = 0


@attrs.define(eq=False)
class _ReceiverRoom:
    room: RoomId
    machine: ReceiverRoomMachine
    targets: tuple[Target, ...]
    dst_pages: IntArray
    dst_aux_row: int | None
    dst_state: tuple[StateIndices, ...]
    required_dst_info_num: int
    deadline: float | None
    prefix_pages: int = 0  # positions this rank already holds (its prefix cache): never written
    armed: set[PeerKey] = attrs.Factory(set)
    succeeded: set[PeerKey] = attrs.Factory(set)
    metric: dict[PeerKey, TransferMetricData] = attrs.Factory(dict)
    failure: str | None = None
    cause: FailureCause | None = None
    failure_peer: PeerKey | None = None
    abort: DecodeAbortMachine | None = None
    must_ack: set[PeerKey] = attrs.Factory(set)
    acked: set[PeerKey] = attrs.Factory(set)
    # Ranks whose ack proves nothing about their connections: one acked after a fence (a write of it
    # to us failed), or restarted after it was told the destinations (the old process's bytes in
    # kernel sockets outlive it, and the new one acks a room it never knew).
    unproven: set[PeerKey] = attrs.Factory(set)
    release: ReleaseKind | None = None  # how the pages came back (a record for statistics and logs)
    tell_later: set[PeerKey] = attrs.Factory(set)  # failed before these ranks were registered
    resend_at: float | None = None  # next Abort resend to the ranks that have not acknowledged
    resends: int = 0
    # Its prefill ranks (all, and those whose Success it waits for), fixed with its targets. Derived
    # once: every status and every peer event asks, and scanning the targets each time made a room
    # cost O(ranks^2) on the decode (`pdkv bench scale`).
    target_keys: frozenset[PeerKey] = attrs.field(init=False)
    required: frozenset[PeerKey] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.target_keys = frozenset(t.key for t in self.targets)
        self.required = frozenset(t.key for t in self.targets if not t.dummy)

    @property
    def state(self) -> ReceiverRoomState:
        return self.machine.state

    @property
    def terminal(self) -> bool:
        return self.machine.is_terminal


class DecodeEndpoint(RoomKeeper[_ReceiverRoom]):
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
    ) -> None:
        """``cuts_connections``: the driver can end every engine connection from a host and will
        answer ``CutConnections`` with ``connections_cut`` (a quarantined room is then released as
        soon as it is proven safe, instead of after ``quarantine_settle``)."""
        self.origin = origin
        self.cuts_connections = cuts_connections
        self.timeouts = timeouts if timeouts is not None else Timeouts()
        self._register = Register(
            origin=origin, tp_size=tp_size, endpoint=endpoint, session=session, layout=layout
        )
        self._peers: dict[PeerKey, _PrefillPeer] = {}
        self._keep_rooms()
        self._resends: DeadlineQueue[RoomId] = DeadlineQueue()
        # Registrations to resend, by when: a tick or a deadline query touches only the due ones, not
        # every peer (at hundreds of prefill ranks a scan per control-loop pass adds up).
        self._register_resends: DeadlineQueue[PeerKey] = DeadlineQueue()
        self._quarantined: dict[RoomId, int] = {}  # room -> destination pages held
        # Cleared room ids, refused until they expire: a late status of the room that had the id
        # must never complete a new room that reuses it.
        self._tombstones: Tombstones[RoomId, None] = Tombstones()
        self._heartbeats = Heartbeats(self.timeouts.heartbeat_interval)  # due while a rank is READY
        self._counters = _Counters()

    # ------------------------------------------------------------------ registration

    def set_engine_metadata(self, metadata: bytes) -> None:
        """What every Register sent from now on carries for the prefill's engine (the backend's
        ``engine_metadata`` once this rank's buffers are registered)."""
        self._register = attrs.evolve(self._register, engine_metadata=metadata)

    def connect(self, route: RouteTable, now: float) -> list[Effect]:
        """Register with every prefill rank of ``route`` (idempotent for ranks already registered)."""
        effects: list[Effect] = []
        for rank in route.ranks:
            key = (route.origin.instance, rank.rank)
            known = self._peers.get(key)
            if known is not None and rank.epoch < known.epoch:
                continue
            if known is not None and rank.epoch == known.epoch and known.state is not PeerState.REJECTED:
                continue
            peer = _PrefillPeer(key=key, epoch=rank.epoch, endpoint=rank.endpoint, session=rank.session)
            if known is not None and rank.epoch > known.epoch:
                effects += self._peer_restarted(known, peer, now)
            else:
                self._peers[key] = peer
                effects += self._send_register(peer, now)
        return effects

    def peer_ready(self, target: Target) -> bool:
        peer = self._peers.get(target.key)
        return peer is not None and peer.state is PeerState.READY

    def peer_refusal(self, target: Target) -> str | None:
        """The reason ``target``'s prefill rank refused our registration (None unless it did)."""
        peer = self._peers.get(target.key)
        return peer.reason if peer is not None and peer.state is PeerState.REJECTED else None

    def peer_session(self, target: Target) -> SessionId | None:
        peer = self._peers.get(target.key)
        return None if peer is None else peer.session

    def _send_register(self, peer: _PrefillPeer, now: float) -> list[Effect]:
        peer.register_due = now + self.timeouts.register_retry
        self._register_resends.push(peer.key, peer.register_due)
        return [Send(to=peer.endpoint, message=self._register)]

    def _register_deadline(self, key: PeerKey) -> float | None:
        """When the registration with ``key``'s current incarnation is resent (None: not registering)."""
        peer = self._peers.get(key)
        return peer.register_due if peer is not None and peer.state is PeerState.REGISTERING else None

    # ------------------------------------------------------------------ network input

    def receive(self, message: Message, now: float) -> list[Effect]:
        """Handle one decoded message from a prefill rank."""
        key = (message.origin.instance, message.origin.rank)
        peer = self._peers.get(key)
        if peer is not None and message.origin.epoch > peer.epoch:
            # The rank restarted behind the same address: its old rooms can never complete; the new
            # incarnation is registered with at once. A RegisterAck/Reject of the new epoch answers
            # a Register we sent to that address, so it counts; anything else of the new epoch
            # belongs to no room of ours.
            reborn = _PrefillPeer(
                key=key, epoch=message.origin.epoch, endpoint=peer.endpoint, session=peer.session
            )
            answer = isinstance(message, (RegisterAck, RegisterReject))
            effects = self._peer_restarted(peer, reborn, now, register=not answer)
            if isinstance(message, RegisterAck):
                effects += self._on_register_ack(reborn, now)
            elif isinstance(message, RegisterReject):
                effects += self._on_register_reject(reborn, message, now)
            return effects
        if peer is None or message.origin.epoch != peer.epoch:
            self._counters.stale_messages += 1
            return [
                Notice(
                    level=NoticeLevel.INFO,
                    text=f"dropped {type(message).__name__} from stale or unknown {message.origin}",
                )
            ]
        peer.last_heard = now
        if isinstance(message, RegisterAck):
            return self._on_register_ack(peer, now)
        if isinstance(message, RegisterReject):
            return self._on_register_reject(peer, message, now)
        if isinstance(message, TransferStatus):
            return self._on_status(peer, message, now)
        if isinstance(message, AbortAck):
            return self._on_abort_ack(peer, message, now)
        if isinstance(message, Abort):
            r = self._rooms.get(message.room)
            if r is None:
                self._counters.aborts_unknown_room += 1
                return [
                    Notice(
                        level=NoticeLevel.WARNING,
                        text=f"abort for unknown room {message.room} from {message.origin}: {message.reason}",
                        room=message.room,
                    )
                ]
            if r.terminal:
                return self._late(message, message.room)
            return self._fail(
                r,
                _clip(f"aborted by prefill {message.origin}: {message.reason}"),
                FailureCause.ABORTED_BY_PEER,
                now,
                by=peer.key,
            )
        if isinstance(message, Heartbeat):
            return [Send(to=peer.endpoint, message=HeartbeatAck(origin=self.origin, seq=message.seq))]
        if isinstance(message, HeartbeatAck):
            return []
        self._counters.unexpected_messages += 1
        return [
            Notice(
                level=NoticeLevel.WARNING,
                text=f"decode got unexpected {type(message).__name__} from {message.origin}",
            )
        ]

    def _on_register_ack(self, peer: _PrefillPeer, now: float) -> list[Effect]:
        if peer.state is not PeerState.REGISTERING:
            return []  # a duplicate ack, or one that comes after a refusal: nothing to change
        peer.machine.fire(PeerTrigger.ACKNOWLEDGED)
        peer.last_heard = now
        self._heartbeats.arm(now)
        effects: list[Effect] = []
        for r in list(self._rooms.values()):
            if (
                r.state is ReceiverRoomState.BOOTSTRAPPING
                and peer.key in r.target_keys  # only its own ranks' acks can complete its registration
                and all(self.peer_ready(t) for t in r.targets)
            ):
                effects += self._send_requests(r, now)
            elif peer.key in r.tell_later:
                r.tell_later.discard(peer.key)
                self._counters.aborts_sent += 1
                abort = Abort(origin=self.origin, room=r.room, reason=r.failure or "failed")
                effects.append(Send(to=peer.endpoint, message=abort))
            elif r.abort is not None and r.abort.state in _AWAITING_ACKS and peer.key in r.must_ack - r.acked:
                # Registered again after silence: the same process may still hold the room, and its
                # ack is the only safe way to release the pages; the first Abort may have been lost.
                self._counters.aborts_sent += 1
                abort = Abort(origin=self.origin, room=r.room, reason=r.failure or "failed")
                effects.append(Send(to=peer.endpoint, message=abort))
        return effects

    def _on_register_reject(self, peer: _PrefillPeer, message: RegisterReject, now: float) -> list[Effect]:
        if message.retry:
            # Not a refusal of our layout: the rank no longer knows us (it forgot us after silence,
            # or restarted) and says so in answer to a heartbeat. Registered with again at once,
            # rather than after our own heartbeat timeout; our rooms with it cannot complete.
            if peer.state is not PeerState.READY:
                return []  # registering already: the next Register answers it
            return self._peer_silent(
                peer, now, reason=f"prefill rank {peer.key[0]}:{peer.key[1]} no longer knows this rank"
            )
        reason = message.reason
        peer.machine.fire(PeerTrigger.REFUSED)
        peer.reason = reason
        effects: list[Effect] = [
            Notice(
                level=NoticeLevel.WARNING,
                text=f"prefill rank {peer.key[0]}:{peer.key[1]} rejected registration: {reason}",
            )
        ]
        for r in list(self._rooms.values()):
            if not r.terminal and peer.key in r.target_keys:
                effects += self._fail(
                    r,
                    _clip(f"registration rejected by {peer.key[0]}:{peer.key[1]}: {reason}"),
                    FailureCause.INVALID,
                    now,
                    by=peer.key,
                )
        return effects

    def _on_status(self, peer: _PrefillPeer, msg: TransferStatus, now: float) -> list[Effect]:
        r = self._rooms.get(msg.room)
        if r is None or r.terminal:
            return self._late(msg, msg.room)
        if peer.key not in r.armed:
            return self._late(msg, msg.room)
        if msg.outcome is Outcome.FAILED:
            return self._fail(
                r,
                _clip(f"prefill {msg.origin} failed: {msg.reason}"),
                FailureCause.ABORTED_BY_PEER,
                now,
                by=peer.key,
            )
        if peer.key not in r.required:
            # A dummy target has nothing to report; its success message is harmless but unexpected.
            return [
                Notice(level=NoticeLevel.DEBUG, text=f"success from dummy target {msg.origin}", room=r.room)
            ]
        if peer.key in r.succeeded:
            return []
        r.succeeded.add(peer.key)
        r.metric[peer.key] = msg.metric
        # Only required ranks are added (above), so equal sizes mean every one succeeded: O(1) where
        # comparing the sets cost O(ranks) per status.
        if len(r.succeeded) == len(r.required):
            r.machine.fire(ReceiverRoomTrigger.ALL_SUCCEEDED)
            r.deadline = None
            self._counters.rooms_succeeded += 1
            return [RoomFinished(room=r.room, poll=KVPoll.Success)]
        if r.state is ReceiverRoomState.WAITING_FOR_INPUT:
            self._set_deadline(r, now + self.timeouts.transfer)
        r.machine.fire(ReceiverRoomTrigger.PROGRESS)
        return []

    def _on_abort_ack(self, peer: _PrefillPeer, msg: AbortAck, now: float) -> list[Effect]:
        room = msg.room
        r = self._rooms.get(room)
        if r is not None and r.abort is not None and r.abort.state in _ACKED_ALREADY:
            return []  # a duplicate while the connections are cut or the pages settle
        if r is None or r.abort is None or r.abort.state not in _AWAITING_ACKS:
            return self._late_room(room, f"AbortAck from {peer.key[0]}:{peer.key[1]}")
        r.acked.add(peer.key)
        if msg.fenced:
            r.unproven.add(peer.key)
        if not r.must_ack <= r.acked:
            return []
        return self._all_acked(r, now)

    def _all_acked(self, r: _ReceiverRoom, now: float) -> list[Effect]:
        """Every rank told the destinations acknowledged (their writes of the room all ended).

        Acks alone are the proof when every write completed (a completed write was applied at the
        destination). After a failed write (a fenced ack) or a writer's restart, an ack proves at
        most that the prefill engine's queue drained: bytes may still sit in a connection the writer
        closed (an orphan socket retransmitting; a process that died leaves its in-flight bytes in
        the kernel), so the pages settle for ``quarantine_settle`` (a bound, not a proof: counted as
        SETTLED). They are not cut here, since a cut fails every other write in flight on those
        connections. A quarantined room (a rank was silent or cut off, where late bytes are most
        likely: the measured landing came 19-30 s after a heal) is cut first when this rank can
        (proven), else settles too."""
        assert r.abort is not None
        r.resend_at = None
        quarantined = r.abort.state is DecodeAbortState.QUARANTINED
        if not quarantined and not r.unproven:
            r.abort.fire(DecodeAbortTrigger.ALL_ACKED)
            self._counters.aborts_acked += 1
            return self._release(r, ReleaseKind.ACKED, "all prefill ranks acknowledged the abort")
        self._set_deadline(r, now + self.timeouts.quarantine_settle)  # cutting or settling: bounded
        if quarantined and self.cuts_connections:
            r.abort.fire(DecodeAbortTrigger.ACKED_AFTER_QUARANTINE)
            hosts = sorted({_host_of(self._peers[k].session) for k in r.must_ack if k in self._peers})
            return [CutConnections(room=r.room, hosts=tuple(hosts))]
        r.abort.fire(DecodeAbortTrigger.ACKED_UNPROVEN)
        why = (
            "the room was quarantined and this rank cannot cut connections"
            if quarantined
            else "a write of the room failed or its writer restarted, so bytes may remain in a connection"
        )
        return [
            Notice(
                level=NoticeLevel.INFO,
                text=f"room {r.room}: every prefill rank acknowledged, but {why}: pages come back after "
                f"{self.timeouts.quarantine_settle:g} s of settling",
                room=r.room,
            )
        ]

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
        now: float,
    ) -> list[Effect]:
        """``receiver.init``: the room's destinations (by position) and the prefill ranks it needs;
        ``prefix_pages``: the first positions this rank already holds (no prefill rank writes them).

        Every argument is checked against this rank's own buffers first (``InvalidArgumentError``,
        or ``MappingError`` for repeated pages); a bad call creates nothing.
        """
        if room in self._rooms:
            raise LocalProtocolError(f"room {room} was already opened on decode {self.origin}")
        if len({t.key for t in targets}) != len(targets):
            raise LocalProtocolError(f"room {room}: a prefill rank is listed twice in targets")
        layout = self._register.layout
        pages = arguments.page_list(
            dst_pages,
            room=room,
            argument="dst_pages",
            limit=layout.min_kv_items,
        )
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
            return self._fail(
                r,
                f"room id reused: room {room} was cleared on decode {self.origin} less than "
                f"{self.timeouts.tombstone:g} s ago",
                FailureCause.INVALID,
                now,
            )
        r = _ReceiverRoom(
            room=room,
            machine=ReceiverRoomMachine(f"room {room}"),
            targets=tuple(targets),
            dst_pages=index_array(pages),
            dst_aux_row=aux_row,
            dst_state=state,
            required_dst_info_num=required,
            deadline=None,
            prefix_pages=prefix,
        )
        self._rooms[room] = r
        self._set_deadline(r, now + self.timeouts.bootstrap)
        if not r.required:
            why = "every target prefill rank is a dummy" if r.targets else "no target prefill rank was given"
            return self._fail(r, f"room has no transfer destination: {why}", FailureCause.NO_DESTINATION, now)
        for t in r.targets:
            peer = self._peers.get(t.key)
            if peer is None:
                return self._fail(
                    r,
                    f"target prefill rank {t.instance}:{t.rank} is unknown (connect() first)",
                    FailureCause.NO_DESTINATION,
                    now,
                )
            if peer.state is PeerState.REJECTED:
                return self._fail(
                    r,
                    _clip(f"target prefill rank {t.instance}:{t.rank} rejected registration: {peer.reason}"),
                    FailureCause.INVALID,
                    now,
                )
        if all(self.peer_ready(t) for t in r.targets):
            return self._send_requests(r, now)
        return []

    def abort_room(
        self, room: RoomId, reason: str, now: float, *, targets: Sequence[Target] = ()
    ) -> list[Effect]:
        """``receiver.abort``: fail the room and tell every prefill rank; pages wait for the acks.

        A room not opened yet is created Failed and its ``targets`` (the prefill ranks it would
        have asked) are told, so a prefill scheduler that opens it sees Failed at once; none of
        them was given a destination, so nothing waits for an ack.
        """
        r = self._rooms.get(room)
        if r is None:
            r = self._failed_room(room, targets)
        if r.terminal:
            return []
        return self._fail(r, _clip(f"aborted by decode: {reason}"), FailureCause.ABORTED_HERE, now)

    def close_room(self, room: RoomId, now: float) -> None:
        """``receiver.clear``: forget a room whose pages are no longer at risk; its id is refused for
        ``tombstone`` seconds so a late status of this room cannot complete a room that reuses it."""
        r = self._rooms.get(room)
        if r is None:
            return
        if not self.release_ready(room):
            raise LocalProtocolError(
                f"room {room} closed before its pages were safe to reuse ({r.state.name})"
            )
        del self._rooms[room]
        self._tombstones.put(room, None, now + self.timeouts.tombstone)

    def poll(self, room: RoomId) -> KVPoll:
        """The room's state; a room not opened yet (``receiver.init`` not called) is Bootstrapping."""
        r = self._rooms.get(room)
        return KVPoll.Bootstrapping if r is None else _POLL[r.state]

    def failure(self, room: RoomId) -> str | None:
        r = self._rooms.get(room)
        return None if r is None else r.failure

    def failure_cause(self, room: RoomId) -> FailureCause | None:
        r = self._rooms.get(room)
        return None if r is None else r.cause

    def failure_record(self, room: RoomId) -> Failure | None:
        """The room's failure as the scheduler reads it (None unless it failed)."""
        r = self._rooms.get(room)
        return None if r is None else self._failure_of(r)

    def release_ready(self, room: RoomId) -> bool:
        """True when no prefill rank can still write into the room's pages (or the ack wait timed out);
        True too before ``receiver.init``: no prefill rank was told any page of it."""
        r = self._rooms.get(room)
        return r is None or r.state is ReceiverRoomState.SUCCESS or r.release is not None

    def release_was_safe(self, room: RoomId) -> bool:
        """False only after the unsafe release (the quarantine bound passed with an ack missing)."""
        release = self._room(room).release
        return release is None or release.safe

    def release_kind(self, room: RoomId) -> ReleaseKind | None:
        """How the room's pages came back (None: not released, the room succeeded, or it is unknown)."""
        r = self._rooms.get(room)
        return None if r is None else r.release

    def metric(self, room: RoomId) -> dict[PeerKey, TransferMetricData]:
        """What each prefill rank reported writing (empty for a room not opened: nothing moved)."""
        r = self._rooms.get(room)
        return {} if r is None else dict(r.metric)

    def room_history(self, room: RoomId) -> list[ReceiverRoomState]:
        return list(self._room(room).machine.history)

    def abort_state(self, room: RoomId) -> DecodeAbortState | None:
        r = self._room(room)
        return None if r.abort is None else r.abort.state

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

    def tick(self, now: float) -> list[Effect]:
        """Heartbeat round when due (register again with silent ranks, greet the others); resend due
        registrations; fail rooms past their deadline; release after ack timeouts."""
        effects: list[Effect] = []
        if self._heartbeats.is_due(now):
            effects += self._heartbeat_round(now)
        for key in self._register_resends.pop_due(now, self._register_deadline):
            effects += self._send_register(self._peers[key], now)
        self._tombstones.expire(now)
        for room in self._resends.pop_due(now, self._resend_deadline):
            effects += self._resend_abort(self._rooms[room], now)
        for room in self._due_rooms(now):
            r = self._rooms[room]
            missing = sorted(f"{k[0]}:{k[1]}" for k in r.must_ack - r.acked)
            if r.abort is not None and r.abort.state is DecodeAbortState.REQUESTED:
                # A rank is silent or cut off: its writes may still land. The pages stay held.
                r.abort.fire(DecodeAbortTrigger.ACK_TIMEOUT)
                self._counters.quarantines += 1
                self._quarantined[room] = int(r.dst_pages.size)
                # Counted from when the ack wait ended, not from when this tick noticed it.
                self._set_deadline(r, (r.deadline or now) + self.timeouts.quarantine)
                effects.append(
                    Notice(
                        level=NoticeLevel.WARNING,
                        text=f"room {room} quarantined: no AbortAck from {missing} within "
                        f"{self.timeouts.abort_ack:g} s; its {r.dst_pages.size} pages stay held until "
                        f"they acknowledge (at most {self.timeouts.quarantine:g} s)",
                        room=room,
                    )
                )
                continue
            if r.abort is not None and r.abort.state in (DecodeAbortState.CUTTING, DecodeAbortState.SETTLING):
                # Settled: the acks came quarantine_settle ago (a cut that never reported counts so).
                r.abort.fire(DecodeAbortTrigger.SETTLED)
                self._counters.aborts_acked += 1
                effects.append(
                    Notice(
                        level=NoticeLevel.WARNING,
                        text=f"room {room} released after settling: every prefill rank acknowledged its "
                        f"abort {self.timeouts.quarantine_settle:g} s ago, without a cut of their "
                        f"connections (not proven; {r.dst_pages.size} pages back)",
                        room=room,
                    )
                )
                effects += self._release(r, ReleaseKind.SETTLED, "acknowledged, then settled (not proven)")
                continue
            if r.abort is not None and r.abort.state is DecodeAbortState.QUARANTINED:
                r.abort.fire(DecodeAbortTrigger.QUARANTINE_TIMEOUT)
                r.resend_at = None
                self._counters.unsafe_releases += 1
                effects.append(
                    Notice(
                        level=NoticeLevel.WARNING,
                        text=f"UNSAFE release of room {room}: no AbortAck from {missing} within the "
                        f"{self.timeouts.quarantine:g} s quarantine",
                        room=room,
                    )
                )
                effects += self._release(r, ReleaseKind.UNSAFE, f"quarantine timeout ({', '.join(missing)})")
                continue
            limit = {
                ReceiverRoomState.BOOTSTRAPPING: ("bootstrap", self.timeouts.bootstrap),
                ReceiverRoomState.WAITING_FOR_INPUT: ("waiting", self.timeouts.waiting),
                ReceiverRoomState.TRANSFERRING: ("transfer", self.timeouts.transfer),
            }[r.state]
            effects += self._fail(
                r, f"{limit[0]} timeout: still {r.state.name} after {limit[1]:g} s", FailureCause.TIMEOUT, now
            )
        return effects

    def _heartbeat_round(self, now: float) -> list[Effect]:
        effects: list[Effect] = []
        seq = self._heartbeats.next_seq()
        for peer in list(self._peers.values()):
            if peer.state is not PeerState.READY:
                continue
            if now - peer.last_heard >= self.timeouts.heartbeat_timeout:
                effects += self._peer_silent(peer, now)
            else:
                beat = Heartbeat(origin=self.origin, seq=seq, endpoint=self._register.endpoint)
                effects.append(Send(to=peer.endpoint, message=beat))
        ready = any(p.state is PeerState.READY for p in self._peers.values())
        self._heartbeats.reschedule(now, again=ready)
        return effects

    # ------------------------------------------------------------------ statistics

    def connections_cut(self, room: RoomId, ok: bool, reason: str, now: float) -> list[Effect]:
        """The driver ended (``ok``) every engine connection from the hosts of ``CutConnections``, and
        every socket of them is closed: nothing of the room's failed writes can land any more, so its
        pages come back, proven. A failed cut falls back to ``quarantine_settle``."""
        r = self._rooms.get(room)
        if r is None or r.abort is None or r.abort.state is not DecodeAbortState.CUTTING:
            return []
        if not ok:
            r.abort.fire(DecodeAbortTrigger.CUT_FAILED)
            self._set_deadline(r, now + self.timeouts.quarantine_settle)
            return [
                Notice(
                    level=NoticeLevel.WARNING,
                    text=f"room {room}: connections could not be cut ({reason}); pages come "
                    f"back after {self.timeouts.quarantine_settle:g} s of settling",
                    room=room,
                )
            ]
        r.abort.fire(DecodeAbortTrigger.CUT)
        self._counters.aborts_acked += 1
        return [
            Notice(
                level=NoticeLevel.INFO,
                text=f"room {room} released: every prefill rank acknowledged (after its fence, where a "
                f"write had failed) and its connections were cut ({r.dst_pages.size} pages back)",
                room=room,
            ),
            *self._release(r, ReleaseKind.CUT, "acknowledged after fences; connections cut"),
        ]

    def quarantine_figures(self) -> tuple[int, int, int, int, int]:
        """(rooms quarantined now, their pages, quarantines ever, released safely, of which proven):
        O(quarantined)."""
        return (
            len(self._quarantined),
            sum(self._quarantined.values()),
            self._counters.quarantines,
            self._counters.quarantines_released,
            self._counters.quarantines_proven,
        )

    def statistics(self) -> DecodeStatistics:
        return DecodeStatistics(
            rooms_open=sum(1 for r in self._rooms.values() if not r.terminal),
            rooms_quarantined=len(self._quarantined),
            pages_quarantined=sum(self._quarantined.values()),
            **attrs.asdict(self._counters),  # every counter field, by name
        )

    def peer_epoch(self, target: Target) -> Epoch | None:
        """The epoch this rank knows for ``target``'s prefill rank (None if unknown)."""
        peer = self._peers.get(target.key)
        return None if peer is None else peer.epoch

    # ------------------------------------------------------------------ internals

    def _send_requests(self, r: _ReceiverRoom, now: float) -> list[Effect]:
        # Every required rank gets the same request, every dummy the same dummy: one immutable message
        # each (its page array is read-only), built and validated once rather than once per rank.
        request = TransferRequest(
            origin=self.origin,
            room=r.room,
            dst_pages=r.dst_pages,
            dst_aux_row=r.dst_aux_row,
            dst_state=r.dst_state,
            required_dst_info_num=r.required_dst_info_num,
            prefix_pages=r.prefix_pages,
        )
        dummy: TransferRequest | None = None
        effects: list[Effect] = []
        for t in r.targets:
            peer = self._peers[t.key]
            message = request
            if t.dummy:
                if dummy is None:
                    dummy = TransferRequest(
                        origin=self.origin,
                        room=r.room,
                        dst_pages=(),
                        required_dst_info_num=r.required_dst_info_num,
                        dummy=True,
                        prefix_pages=r.prefix_pages,  # a replica's scheduler starts where the others do
                    )
                message = dummy
            r.armed.add(t.key)
            effects.append(Send(to=peer.endpoint, message=message))
        r.machine.fire(ReceiverRoomTrigger.REQUESTS_SENT)
        self._set_deadline(r, now + self.timeouts.waiting)
        return effects

    def _fail(
        self, r: _ReceiverRoom, reason: str, cause: FailureCause, now: float, *, by: PeerKey | None = None
    ) -> list[Effect]:
        """Fail the room and start the abort handshake with every prefill rank of the room (``by``:
        the prefill rank the failure came from or concerns, for the scheduler's ``Failure``)."""
        r.machine.fire(ReceiverRoomTrigger.FAIL)
        r.failure = reason
        r.cause = cause
        r.failure_peer = by
        self._counters.rooms_failed += 1
        r.abort = DecodeAbortMachine(f"room {r.room}")
        # Only a rank that was told the destinations can write; dummies never write.
        r.must_ack = {t.key for t in r.targets if not t.dummy and t.key in r.armed}
        effects: list[Effect] = [
            RoomFinished(room=r.room, poll=KVPoll.Failed, reason=reason, cause=cause),
            Notice(
                level=NoticeLevel.WARNING,
                text=f"room {r.room} failed on decode {self.origin}: {reason}",
                room=r.room,
            ),
        ]
        for t in r.targets:
            peer = self._peers.get(t.key)
            if peer is not None and peer.state is PeerState.READY:
                self._counters.aborts_sent += 1
                effects.append(
                    Send(to=peer.endpoint, message=Abort(origin=self.origin, room=r.room, reason=reason))
                )
            elif not t.dummy and peer is not None and peer.state is PeerState.REGISTERING:
                # Not registered yet (it would drop our message): told once it acknowledges, so a
                # prefill scheduler that opened the room learns of the abort instead of a deadline.
                r.tell_later.add(t.key)
        if not r.must_ack:
            r.abort.fire(DecodeAbortTrigger.ALL_ACKED)
            r.deadline = None
            return effects + self._release(r, ReleaseKind.NOTHING_SENT, "no prefill rank had the destinations")
        self._set_deadline(r, now + self.timeouts.abort_ack)
        self._schedule_resend(r, now)
        return effects

    def _schedule_resend(self, r: _ReceiverRoom, now: float) -> None:
        r.resend_at = self.timeouts.resend_at(now, r.resends)
        if r.resend_at is not None:
            self._resends.push(r.room, r.resend_at)

    def _resend_deadline(self, room: RoomId) -> float | None:
        r = self._rooms.get(room)
        if r is None or r.abort is None or r.abort.state not in _AWAITING_ACKS:
            return None
        return r.resend_at

    def _resend_abort(self, r: _ReceiverRoom, now: float) -> list[Effect]:
        """The Abort (or its AbortAck) may have been lost: tell the ranks that have not answered again."""
        effects: list[Effect] = []
        for key in sorted(r.must_ack - r.acked, key=lambda k: (k[0], k[1].tp, k[1].cp)):
            peer = self._peers.get(key)
            if peer is not None and peer.state is PeerState.READY:
                self._counters.aborts_resent += 1
                abort = Abort(origin=self.origin, room=r.room, reason=r.failure or "failed")
                effects.append(Send(to=peer.endpoint, message=abort))
        r.resends += 1
        self._schedule_resend(r, now)
        return effects

    def _failed_room(self, room: RoomId, targets: Sequence[Target]) -> _ReceiverRoom:
        """A room record for a room that fails before any request went out (nothing to wait for)."""
        r = _ReceiverRoom(
            room=room,
            machine=ReceiverRoomMachine(f"room {room}"),
            targets=tuple(targets),
            dst_pages=index_array(()),
            dst_aux_row=None,
            dst_state=(),
            required_dst_info_num=1,
            deadline=None,
        )
        self._rooms[room] = r
        return r

    def _release(self, r: _ReceiverRoom, kind: ReleaseKind, reason: str) -> list[Effect]:
        if self._quarantined.pop(r.room, None) is not None and kind.safe:
            self._counters.quarantines_released += 1
            if kind is ReleaseKind.CUT:
                self._counters.quarantines_proven += 1
        counter = _RELEASE_COUNTERS.get(kind)
        if counter is not None:
            setattr(self._counters, counter, getattr(self._counters, counter) + 1)
        r.release = kind
        r.deadline = None
        return [ReleasePages(room=r.room, kind=kind, reason=reason)]

    def _peer_restarted(
        self, old: _PrefillPeer, new: _PrefillPeer, now: float, *, register: bool = True
    ) -> list[Effect]:
        """Replace ``old`` by its new incarnation ``new``: fail the old one's rooms, register again
        (unless ``register`` is False: the new incarnation has just answered a Register)."""
        reason = f"prefill rank {old.key[0]}:{old.key[1]} restarted (epoch {old.epoch} -> {new.epoch})"
        self._counters.peer_restarts += 1
        # Replaced before the rooms fail, so their Abort waits until the new process acknowledged
        # registration (before that it would drop our messages as from an unregistered rank).
        self._peers[new.key] = new
        effects: list[Effect] = [ForgetPeer(endpoint=old.endpoint, reason=reason)]
        effects += self._peer_lost(old.key, reason, now)
        for r in self._rooms.values():
            if old.key in r.armed and r.state is not ReceiverRoomState.SUCCESS and r.release is None:
                r.unproven.add(old.key)  # the old process's writes may sit in sockets it left
        if register:
            effects += self._send_register(new, now)
        else:
            # It answered a Register of ours: until its answer makes it ready, it is a registering
            # rank whose resend is due now (the next tick sends one, as for any other).
            self._register_resends.push(new.key, new.register_due)
        return effects

    def _peer_silent(self, peer: _PrefillPeer, now: float, *, reason: str | None = None) -> list[Effect]:
        """``peer`` sent nothing for ``heartbeat_timeout``: fail the rooms that target it, register again.

        Its rooms go through the normal abort handshake (the Abort is sent while it is still READY,
        on the rebuilt socket): a silent process may still be writing, so only its AbortAck or the
        counted ``abort_ack`` timeout releases their pages.
        """
        if reason is None:
            reason = f"prefill rank {peer.key[0]}:{peer.key[1]} silent for {now - peer.last_heard:.3g} s"
        self._counters.peers_lost += 1
        effects: list[Effect] = [
            ForgetPeer(endpoint=peer.endpoint, reason=reason),
            Notice(level=NoticeLevel.WARNING, text=f"{reason}: failing its rooms and registering again"),
        ]
        for r in list(self._rooms.values()):
            if not r.terminal and peer.key in r.target_keys:
                effects += self._fail(r, reason, FailureCause.PEER_SILENT, now, by=peer.key)
        peer.machine.fire(PeerTrigger.SILENCE)
        effects += self._send_register(peer, now)
        return effects

    def _peer_lost(self, key: PeerKey, reason: str, now: float) -> list[Effect]:
        """A prefill rank restarted: every live room that targets it fails.

        Its pages still wait for an AbortAck from that rank, now from the new incarnation (the
        Abort is resent when it acknowledges registration): the old process is gone, but a
        TransferRequest sent to the address before the restart was known may have reached the new
        one, and only its ack (which also tombstones the room there) proves nothing is written.
        """
        effects: list[Effect] = [Notice(level=NoticeLevel.WARNING, text=reason)]
        for r in list(self._rooms.values()):
            if not r.terminal and key in r.target_keys:
                effects += self._fail(r, reason, FailureCause.PEER_RESTART, now, by=key)
        return effects

    def _late(self, msg: Message, room: RoomId) -> list[Effect]:
        return self._late_room(room, f"{type(msg).__name__} from {msg.origin}")

    def _late_room(self, room: RoomId, what: str) -> list[Effect]:
        self._counters.late_messages += 1
        return [Notice(level=NoticeLevel.DEBUG, text=f"late {what} for room {room}", room=room)]


_AWAITING_ACKS = (DecodeAbortState.REQUESTED, DecodeAbortState.QUARANTINED)
_ACKED_ALREADY = (DecodeAbortState.CUTTING, DecodeAbortState.SETTLING)

_RELEASE_COUNTERS = {
    ReleaseKind.ACKED: "releases_acked",
    ReleaseKind.CUT: "releases_cut",
    ReleaseKind.SETTLED: "releases_settled",
    ReleaseKind.NOTHING_SENT: "releases_nothing_sent",
}  # UNSAFE is counted as unsafe_releases


def _clip(text: str) -> str:
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


__all__ = ["DecodeEndpoint", "DecodeStatistics", "PeerState"]


def _host_of(session: SessionId) -> str:
    """The host of an engine session ``host:port`` (``[v6]:port`` too)."""
    host = session.rsplit(":", 1)[0] if ":" in session else session
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host
