"""Sender room: one room on one prefill rank (DESIGN sections 5 and 8).

Every rule that moves a sender room is a row below; ``PrefillEndpoint`` finds the room, steps the
record an input is about first (a chunk, a per-layer context, a fence) and then the room.

    BOOTSTRAPPING      waiting for all ``required_dst_info_num`` TransferRequests (deadline: bootstrap)
    WAITING_FOR_INPUT  destinations known; the scheduler may run the forward (deadline: inflight)
    TRANSFERRING       at least one chunk queued (deadline: inflight, counted from WAITING_FOR_INPUT)
    COMPLETING         every chunk is done, but a per-layer context that was never sent still writes,
                       or a fence is owed (a write of the room failed and its bytes may be queued):
                       Success waits for them; no new per-layer context may start
    SUCCESS            the last chunk landed at every destination, statuses sent
    FAILED             abort, engine error, no destination, bad request, timeout, lost or restarted peer

Inputs: ``request`` (a TransferRequest from a registered decode rank), ``open`` (``sender.init``),
``queue_chunk`` (``sender.send``, the chunk checked against the page contract already),
``chunk_done`` / ``chunk_failed`` (a worker's answer, the chunk stepped first), ``layer_writes_started``
/ ``layer_writes_ended`` (a per-layer context of the endpoint's book: its first write, the end of its
writes), ``fence_done`` (a fence Success waited for completed),
``peer_abort`` (an Abort from a decode rank), ``abort`` (the scheduler's), ``fail`` (decided by the
endpoint: a deadline, a lost or restarted rank), ``status_resend_due`` (a Failed status unanswered).

A failed room's Failed status to its decode ranks has its own rows (``FAILURE_NOTICE``, one per room
that told a rank; a status may be lost, so it goes again until that rank's Abort answers it):

    TELLING            told Failed; resent (backoff) to the ranks that have not answered
    ANSWERED           every rank told has answered with an Abort: nothing more is resent

Inputs: ``heard`` (an Abort from a decode rank of the room), ``resend_due`` (the interval passed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from pdkv.mapping._arrays import int_max, summarize
from pdkv.mapping.landing import grant_problem
from pdkv.mapping.layout import BufferKind, BufferLayout
from pdkv.protocol import arguments
from pdkv.protocol.effects import (
    DecodePeer,
    Destination,
    FailureCause,
    Notice,
    NoticeLevel,
    PeerKey,
    RoomFinished,
    Send,
    SubmitChunk,
)
from pdkv.protocol.machines._base import MachineSpec, Row, StateMachine, row
from pdkv.protocol.machines._prefill_side import (
    AbortStep,
    Chunk,
    ChunkInput,
    ChunkState,
    ChunkStep,
    FailureNotice,
    FailureNoticeInput,
    FailureNoticeState,
    FenceInput,
    FenceState,
    FenceStep,
    PrefillAbortInput,
    RoomStep,
    SenderRoom,
    SenderRoomInput,
    SenderRoomState,
    peer_order,
    peer_text,
)
from pdkv.protocol.machines.abort import PrefillAbortMachine
from pdkv.protocol.machines.chunk import ChunkMachine
from pdkv.protocol.messages import (
    MAX_REASON_CHARS,
    Outcome,
    TransferMetricData,
    TransferRequest,
    TransferStatus,
)
from pdkv.protocol.poll import KVPoll

_S = SenderRoomState
_I = SenderRoomInput
_LIVE = (_S.BOOTSTRAPPING, _S.WAITING_FOR_INPUT, _S.TRANSFERRING, _S.COMPLETING)
_ASKED = (_S.WAITING_FOR_INPUT, _S.TRANSFERRING)  # every request in: the destinations are known
_ENDED = (_S.SUCCESS, _S.FAILED)

# ------------------------------------------------------------------------------------------ guards


def duplicate(s: RoomStep) -> bool:
    """The same request again from the same rank (its first answer may have been lost)."""
    return s.sender is not None and s.room.requests.get(s.sender) == s.request


def conflicting(s: RoomStep) -> bool:
    """Another request from a rank that already asked for this room."""
    return s.sender in s.room.requests


def request_invalid(s: RoomStep) -> bool:
    """The destination checks before any byte moves (DESIGN section 4); the problem is kept for the
    failure's reason."""
    assert s.request is not None and s.sender is not None
    peer = s.side.registered(s.sender)
    assert peer is not None  # the endpoint routes requests of registered ranks only
    s.problem = _destination_problem(s.request, peer, s.room) or _grant_problem(
        s.request, peer, s.side.layout
    )
    return s.problem is not None


def _grant_problem(msg: TransferRequest, peer: DecodePeer, layout: BufferLayout) -> str | None:
    """A landing grant (decode TP below prefill TP) is checked like pages (``mapping.landing``)."""
    grant = msg.landing
    if grant is None:
        return None
    return grant_problem(peer.layout, layout, address=grant.address, nbytes=grant.nbytes, slots=grant.slots)


def requests_disagree(s: RoomStep) -> bool:
    """The decode ranks of the room disagree on the prefix they hold or on how many ranks ask."""
    assert s.request is not None
    asked = [*s.room.requests.values(), s.request]
    prefixes = {q.prefix_pages for q in asked if not q.dummy}
    if len(prefixes) > 1:
        s.problem = f"decode ranks disagree on the prefix they hold: {sorted(prefixes)} pages"
        return True
    required = {q.required_dst_info_num for q in asked}
    if len(required) != 1:
        s.problem = f"decode ranks disagree on required_dst_info_num: {sorted(required)}"
        return True
    return False


def all_requests_in(s: RoomStep) -> bool:
    assert s.request is not None
    return len(s.room.requests) + 1 == s.request.required_dst_info_num


def refused_id(s: RoomStep) -> bool:
    """``sender.init`` of a room id the decode side failed already (aborted before it was opened, or
    reused too soon): the room opens Failed with that reason, a peer's doing, not the caller's error."""
    refusal = s.side.refusal(s.room.room)
    if refusal is None:
        return False
    s.reason, s.cause = refusal
    return True


def page_count_differs(s: RoomStep) -> bool:
    """A decode rank gave another number of destination pages than the scheduler's request has."""
    for q in s.room.real_requests:
        if q.dst_pages.size != s.num_pages:
            s.problem = (
                f"request has {s.num_pages} pages but {q.origin} gave {q.dst_pages.size} destination pages"
            )
            return True
    return False


def destination_gone(s: RoomStep) -> bool:
    """A decode rank the room writes to is no longer registered (lost, restarted, refused)."""
    gone = [key for key, q in s.room.requests.items() if not q.dummy and s.side.registered(key) is None]
    if not gone:
        return False
    names = ", ".join(peer_text(k) for k in sorted(gone, key=peer_order))
    s.problem = f"no transfer destination: decode rank {names} is no longer registered"
    return True


def nothing_to_write(s: RoomStep) -> bool:
    """Every request of the room is a dummy's (this rank is a replica): the room still advances."""
    return not s.room.real_requests


def opened(s: RoomStep) -> bool:
    return s.room.opened


def complete(s: RoomStep) -> bool:
    """The last chunk is queued, every chunk Done, no per-layer write can still land, and no fence is
    owed: the room's bytes are all where they belong."""
    return _chunks_done(s.room) and not s.side.layer_writes(s.room.room) and not _fences_pending(s)


def layers_still_writing(s: RoomStep) -> bool:
    """Every chunk is Done, but a per-layer context (whose chunk was never sent) still writes."""
    return _chunks_done(s.room) and bool(s.side.layer_writes(s.room.room))


def fences_owed(s: RoomStep) -> bool:
    """Every chunk is Done and no per-layer write runs, but a write of the room failed: its bytes may
    still be queued in the engine, so Success waits for a fence to each such rank."""
    return _chunks_done(s.room) and not s.side.layer_writes(s.room.room) and _fences_pending(s)


def quiet_with_fences_owed(s: RoomStep) -> bool:
    """No per-layer write runs any more and a fence Success waits for is owed."""
    return not s.side.layer_writes(s.room.room) and _fences_pending(s)


def registered_sender(s: RoomStep) -> bool:
    """The Abort comes from a decode rank registered now: it gets an AbortAck (a forgotten one is
    answered if it registers again and asks again)."""
    return s.sender is not None and s.side.registered(s.sender) is not None


# ------------------------------------------------------------------------------------------ effects


def record_request(s: RoomStep) -> None:
    assert s.sender is not None and s.request is not None
    s.room.requests[s.sender] = s.request


def arm_inflight(s: RoomStep) -> None:
    s.side.set_deadline(s.room, s.now + s.side.timeouts.inflight)


def answer_again(s: RoomStep) -> None:
    """A finished room's final word to the rank that asked again (the first may have been lost)."""
    assert s.sender is not None
    _status_to(s, s.sender)


def ignore_conflict(s: RoomStep) -> None:
    assert s.request is not None
    s.side.emit(
        Notice(
            level=NoticeLevel.WARNING,
            text=f"ignored conflicting TransferRequest from {s.request.origin} "
            f"for finished room {s.room.room}",
            room=s.room.room,
        )
    )


def refuse_reused(s: RoomStep) -> None:
    """Another (or a restarted) decode rank asks for a room that succeeded: it stays Success for the
    ranks that got it; this one is told, and nothing is written to it."""
    assert s.request is not None and s.sender is not None
    s.side.count("requests_refused")
    reason = f"room {s.room.room} already finished on prefill {s.side.origin}; room id reused?"
    s.side.emit(
        Notice(
            level=NoticeLevel.WARNING,
            text=f"refused TransferRequest from {s.request.origin}: {reason}",
            room=s.room.room,
        )
    )
    peer = s.side.registered(s.sender)
    assert peer is not None
    failed = TransferStatus(origin=s.side.origin, room=s.room.room, outcome=Outcome.FAILED, reason=reason)
    s.side.emit(Send(to=peer.endpoint, message=failed))


def name_conflict(s: RoomStep) -> None:
    assert s.request is not None
    s.reason, s.cause = f"conflicting TransferRequests from {s.request.origin}", FailureCause.INVALID


def name_extra_request(s: RoomStep) -> None:
    assert s.request is not None
    was = s.room.machine.history[-2].name  # the state before this row moved it
    s.reason = f"unexpected extra TransferRequest from {s.request.origin} in state {was}"
    s.cause = FailureCause.INVALID


def name_problem(s: RoomStep) -> None:
    """The problem a guard found is the failure's reason (the request's sender caused it)."""
    assert s.problem is not None
    s.reason, s.cause = s.problem, FailureCause.INVALID


def name_disagreement(s: RoomStep) -> None:
    """As ``name_problem``, but no single rank is to blame."""
    assert s.problem is not None
    s.reason, s.cause, s.sender = s.problem, FailureCause.INVALID, None


def name_lost_destination(s: RoomStep) -> None:
    assert s.problem is not None
    s.reason, s.cause, s.sender = s.problem, FailureCause.NO_DESTINATION, None


def record_open(s: RoomStep) -> None:
    s.room.opened, s.room.num_pages, s.room.aux_row = True, s.num_pages, s.aux_row


def record_chunk(s: RoomStep) -> None:
    """The chunk joins the room (REGISTERED); the room's next chunk must start where it ends."""
    assert s.spec is not None
    r = s.room
    r.next_position = s.start + int(s.spec.pages.size)
    if s.spec.pages.size:
        r.src_pages.append(s.spec.pages)
    index = len(r.chunks)
    r.chunks.append(Chunk(index=index, spec=s.spec, machine=ChunkMachine(f"room {r.room} chunk {index}")))
    r.last_queued = s.spec.last
    s.chunk = index


def skip_chunk(s: RoomStep) -> None:
    chunk = s.room.chunks[s.chunk]
    chunk.machine.step(ChunkInput.SKIP, ChunkStep(s.side, s.room, chunk, s.now))


def submit_chunk(s: RoomStep) -> None:
    """Its writes go to every real destination (a worker starts the chunk, or skips it if the room
    fails first)."""
    assert s.spec is not None
    destinations = []
    for key, q in s.room.requests.items():
        if not q.dummy:
            peer = s.side.registered(key)
            assert peer is not None  # destination_gone did not hold
            destinations.append(Destination(peer=peer, request=q))
    s.side.emit(
        SubmitChunk(
            room=s.room.room,
            chunk=s.chunk,
            spec=s.spec,
            num_pages=s.room.num_pages or 0,
            src_aux_row=s.room.aux_row,
            destinations=tuple(destinations),
        )
    )


def write_nothing(s: RoomStep) -> None:
    """A replica's chunk is done at once (nothing to write), as if a worker wrote it."""
    chunk = s.room.chunks[s.chunk]
    step = ChunkStep(s.side, s.room, chunk, s.now)
    chunk.machine.step(ChunkInput.START, step)
    chunk.machine.step(ChunkInput.COMPLETE, step)
    done = RoomStep(s.side, s.room, s.now, chunk=s.chunk, metric=TransferMetricData())
    s.room.machine.step(_I.CHUNK_DONE, done)


def account(s: RoomStep) -> None:
    """What the chunk's writes moved: the room's totals and each decode rank's own share (without
    ``per_peer`` the whole metric is each real destination's share, exact for one destination)."""
    metric = s.metric if s.metric is not None else TransferMetricData()
    r = s.room
    r.pages += metric.pages
    r.bytes += metric.bytes
    r.seconds += metric.seconds
    shares = (
        s.per_peer if s.per_peer is not None else {k: metric for k, q in r.requests.items() if not q.dummy}
    )
    for key, share in shares.items():
        known = r.peer_metric.get(key)
        r.peer_metric[key] = share if known is None else _combined(known, share)


def succeed(s: RoomStep) -> None:
    """Success to every real destination that is registered; the scheduler is told."""
    r = s.room
    r.deadline = None
    s.side.count("rooms_succeeded")
    for key, q in r.requests.items():
        if not q.dummy:
            _status_to(s, key)
    s.side.stop_layers(r.room, "room succeeded without this chunk")  # only contexts that never wrote
    s.side.emit(RoomFinished(room=r.room, poll=KVPoll.Success))


def drop_layers(s: RoomStep) -> None:
    """Per-layer contexts whose chunk was never sent stop; Success waits for the writes they
    submitted (the runtime drains them)."""
    held = s.side.layer_writes(s.room.room)
    s.side.stop_layers(s.room.room, f"room complete; per-layer chunk(s) @{held} were never sent")
    s.side.emit(
        Notice(
            level=NoticeLevel.WARNING,
            text=f"room {s.room.room}: every chunk is done but per-layer context(s) @{held} (never sent) "
            "still write; Success waits for them",
            room=s.room.room,
        )
    )


def submit_owed_fences(s: RoomStep) -> None:
    """A fence to each rank a failed write of the room went to (it is on its way, or written when that
    rank is registered again)."""
    for key, fence in s.side.fences_of(s.room.room):
        if fence.machine.state is FenceState.OWED and s.side.registered(key) is not None:
            fence.machine.step(FenceInput.SUBMIT, FenceStep(s.side, fence, s.room.room, key, s.now))


def consent_layer_writes(s: RoomStep) -> None:
    """The context may write: from its first write on it counts as a write in flight of the room."""
    s.consented = True


def name_chunk_failure(s: RoomStep) -> None:
    s.reason = _clip(f"transfer of chunk {s.chunk} failed: {s.reason}")
    s.cause = FailureCause.ENGINE
    s.sender = None


def fail_room(s: RoomStep) -> None:
    """The room failed: its reason for the scheduler (``sender``: the decode rank it came from or
    concerns), no deadline; chunks no worker picked yet are skipped (nothing of them lands in pages
    the decode may reuse); the scheduler is told; every registered decode rank of the room is told
    Failed, again (backoff) until its Abort answers (a status may be lost), unless one of them caused
    it (``notify`` False). A room never opened is freed once this input is handled."""
    r = s.room
    assert s.cause is not None
    r.failure, r.cause, r.failure_peer = s.reason, s.cause, s.sender
    r.deadline = None
    s.side.count("rooms_failed")
    if not r.opened:
        s.side.note_unopened_failed(r.room)
    for chunk in r.chunks:
        if chunk.machine.state is ChunkState.REGISTERED:
            chunk.machine.step(ChunkInput.SKIP, ChunkStep(s.side, r, chunk, s.now))
    s.side.stop_layers(r.room, s.reason or "room failed")
    s.side.emit(RoomFinished(room=r.room, poll=KVPoll.Failed, reason=s.reason, cause=s.cause))
    s.side.emit(
        Notice(
            level=NoticeLevel.WARNING,
            text=f"room {r.room} failed on prefill {s.side.origin}: {s.reason}",
            room=r.room,
        )
    )
    if not s.notify:
        return
    told = set()
    for key in r.requests:
        if s.side.registered(key) is not None:
            _status_to(s, key)
            told.add(key)
    if told:
        r.notice = FailureNotice(machine=FailureNoticeMachine(f"room {r.room}"), unanswered=told)
        s.side.schedule_status_resend(r, s.now)


def hear_abort(s: RoomStep) -> None:
    """The decode rank heard of the failure (or failed first): its status is not resent; the room's
    failure is not told back to it."""
    assert s.sender is not None
    if s.room.notice is not None:
        s.room.notice.machine.step(FailureNoticeInput.HEARD, s)
    s.notify = False


def answer_abort(s: RoomStep) -> None:
    """The room's abort handshake with the rank that asked: an AbortAck once nothing of the room is
    in flight (``machines.abort``)."""
    r = s.room
    if r.abort is None:
        r.abort = PrefillAbortMachine(f"room {r.room}")
    r.abort.step(PrefillAbortInput.ASKED, AbortStep(s.side, r, s.now, s.sender))


def resend_status(s: RoomStep) -> None:
    if s.room.notice is not None:
        s.room.notice.machine.step(FailureNoticeInput.RESEND_DUE, s)


def after_write(s: RoomStep) -> None:
    """A write of the room ended: if it was the last in flight, the room's abort handshake may answer,
    a decode rank registered again while writes to its previous incarnation drained gets its
    RegisterAck, and a cleared room is forgotten."""
    r = s.room
    if s.side.writes_in_flight(r):
        return
    if r.abort is not None:
        r.abort.step(PrefillAbortInput.WRITES_ENDED, AbortStep(s.side, r, s.now))
    s.side.writes_ended(r.room, s.now)
    s.side.forget_if_idle(r)


def _completion_rows(
    what: SenderRoomInput, first: tuple[Callable[[RoomStep], None], ...] = ()
) -> tuple[Row[SenderRoomState, SenderRoomInput, RoomStep], ...]:
    """A write of the room ended (``what``; ``first``: effects every row of it runs first): the room
    may be complete, or wait only for per-layer writes or fences; then the writes' end is handled
    (``after_write``)."""
    live = (_S.TRANSFERRING, _S.COMPLETING)
    return (
        row(what, live, _S.SUCCESS, when=complete, then=[*first, succeed, after_write]),
        row(
            what,
            _S.TRANSFERRING,
            _S.COMPLETING,
            when=layers_still_writing,
            then=[*first, drop_layers, after_write],
        ),
        row(
            what,
            _S.TRANSFERRING,
            _S.COMPLETING,
            when=fences_owed,
            then=[*first, submit_owed_fences, after_write],
        ),
        row(
            what,
            _S.COMPLETING,
            None,
            when=quiet_with_fences_owed,
            then=[*first, submit_owed_fences, after_write],
        ),
        row(what, live, None, then=[*first, after_write]),
    )


# ------------------------------------------------------------------------------------------ rows

SENDER_ROOM = MachineSpec(
    name="SenderRoom",
    states=SenderRoomState,
    triggers=SenderRoomInput,
    initial=_S.BOOTSTRAPPING,
    edges=(
        # A request; the endpoint refuses those of unregistered ranks and of tombstoned ids first.
        row(_I.REQUEST, _LIVE, None, when=duplicate),
        row(_I.REQUEST, _ENDED, None, when=duplicate, then=[answer_again]),
        row(_I.REQUEST, _LIVE, _S.FAILED, when=conflicting, then=[name_conflict, fail_room]),
        row(_I.REQUEST, _ENDED, None, when=conflicting, then=[ignore_conflict]),
        row(
            _I.REQUEST,
            _S.BOOTSTRAPPING,
            _S.FAILED,
            when=request_invalid,
            then=[record_request, name_problem, fail_room],
        ),
        row(
            _I.REQUEST,
            _S.BOOTSTRAPPING,
            _S.FAILED,
            when=requests_disagree,
            then=[record_request, name_disagreement, fail_room],
        ),
        row(
            _I.REQUEST,
            _S.BOOTSTRAPPING,
            _S.WAITING_FOR_INPUT,
            when=all_requests_in,
            then=[record_request, arm_inflight],
        ),
        row(_I.REQUEST, _S.BOOTSTRAPPING, None, then=[record_request]),
        row(
            _I.REQUEST,
            (*_ASKED, _S.COMPLETING),
            _S.FAILED,
            then=[record_request, name_extra_request, fail_room],
        ),
        row(_I.REQUEST, _S.SUCCESS, None, then=[refuse_reused]),
        row(_I.REQUEST, _S.FAILED, None, then=[record_request, answer_again]),
        # The scheduler's sender.init.
        row(_I.OPEN, _S.BOOTSTRAPPING, _S.FAILED, when=refused_id, then=[record_open, fail_room]),
        row(
            _I.OPEN,
            (_S.BOOTSTRAPPING, _S.WAITING_FOR_INPUT),
            _S.FAILED,
            when=page_count_differs,
            then=[record_open, name_problem, fail_room],
        ),
        row(_I.OPEN, (_S.BOOTSTRAPPING, _S.WAITING_FOR_INPUT, _S.FAILED), None, then=[record_open]),
        # The scheduler's sender.send (the endpoint checked the chunk against the page contract).
        row(_I.QUEUE_CHUNK, _S.FAILED, None, then=[record_chunk, skip_chunk]),
        row(
            _I.QUEUE_CHUNK,
            _ASKED,
            _S.FAILED,
            when=destination_gone,
            then=[record_chunk, skip_chunk, name_lost_destination, fail_room],
        ),
        row(
            _I.QUEUE_CHUNK, _ASKED, _S.TRANSFERRING, when=nothing_to_write, then=[record_chunk, write_nothing]
        ),
        row(_I.QUEUE_CHUNK, _ASKED, _S.TRANSFERRING, then=[record_chunk, submit_chunk]),
        # Writes ending (the chunk, context or fence stepped first).
        *_completion_rows(_I.CHUNK_DONE, first=(account,)),
        row(_I.CHUNK_DONE, _S.FAILED, None, then=[account, after_write]),
        row(_I.CHUNK_FAILED, _LIVE, _S.FAILED, then=[name_chunk_failure, fail_room, after_write]),
        row(_I.CHUNK_FAILED, _S.FAILED, None, then=[after_write]),
        row(
            _I.LAYER_WRITES_STARTED,
            (_S.BOOTSTRAPPING, *_ASKED),
            None,
            when=opened,
            then=[consent_layer_writes],
        ),
        row(_I.LAYER_WRITES_STARTED, tuple(SenderRoomState), None),  # refused: the context writes nothing
        *_completion_rows(_I.LAYER_WRITES_ENDED),
        row(
            _I.LAYER_WRITES_ENDED, (_S.BOOTSTRAPPING, _S.WAITING_FOR_INPUT, *_ENDED), None, then=[after_write]
        ),
        row(_I.FENCE_DONE, _S.COMPLETING, _S.SUCCESS, when=complete, then=[succeed, after_write]),
        row(_I.FENCE_DONE, _S.COMPLETING, None),
        # Aborts and failures.
        row(
            _I.PEER_ABORT,
            _LIVE,
            _S.FAILED,
            when=registered_sender,
            then=[hear_abort, fail_room, answer_abort],
        ),
        row(_I.PEER_ABORT, _LIVE, _S.FAILED, then=[hear_abort, fail_room]),
        row(_I.PEER_ABORT, _ENDED, None, when=registered_sender, then=[hear_abort, answer_abort]),
        row(_I.PEER_ABORT, _ENDED, None, then=[hear_abort]),
        row(_I.ABORT, _LIVE, _S.FAILED, then=[fail_room]),
        row(_I.ABORT, _ENDED, None),  # aborting a finished room changes nothing
        row(_I.FAIL, _LIVE, _S.FAILED, then=[fail_room]),
        row(_I.STATUS_RESEND_DUE, _S.FAILED, None, then=[resend_status]),
    ),
)


class SenderRoomMachine(StateMachine[SenderRoomState, SenderRoomInput]):
    def __init__(self, label: str) -> None:
        super().__init__(SENDER_ROOM, label)


# ------------------------------------------------------------------------------------------ failure notice


def _told(s: RoomStep) -> FailureNotice:
    assert s.room.notice is not None  # its rows run only on the room's notice
    return s.room.notice


def last_to_answer(s: RoomStep) -> bool:
    """The Abort comes from the only rank told that had not answered yet."""
    return _told(s).unanswered <= {s.sender}


def drop_answered(s: RoomStep) -> None:
    assert s.sender is not None
    _told(s).unanswered.discard(s.sender)


def tell_again(s: RoomStep) -> None:
    """The Failed status again to each rank told that has not answered and is registered (a
    forgotten one hears of it when it registers and asks), and the next resend, twice as late."""
    notice = _told(s)
    for key in sorted(notice.unanswered, key=peer_order):
        if s.side.registered(key) is not None:
            s.side.count("statuses_resent")
            _status_to(s, key)
    notice.resends += 1
    s.side.schedule_status_resend(s.room, s.now)


_N = FailureNoticeState
_NI = FailureNoticeInput

FAILURE_NOTICE = MachineSpec(
    name="FailureNotice",
    states=FailureNoticeState,
    triggers=FailureNoticeInput,
    initial=_N.TELLING,
    edges=(
        row(_NI.HEARD, _N.TELLING, _N.ANSWERED, when=last_to_answer, then=[drop_answered]),
        row(_NI.HEARD, _N.TELLING, None, then=[drop_answered]),
        row(_NI.HEARD, _N.ANSWERED, None),
        row(_NI.RESEND_DUE, _N.TELLING, None, then=[tell_again]),
        row(_NI.RESEND_DUE, _N.ANSWERED, None),  # a resend queued before the last Abort came
    ),
)


class FailureNoticeMachine(StateMachine[FailureNoticeState, FailureNoticeInput]):
    def __init__(self, label: str) -> None:
        super().__init__(FAILURE_NOTICE, label)


SenderRoomTrigger = SenderRoomInput  # the name earlier code used

# ------------------------------------------------------------------------------------------ helpers


def _chunks_done(r: SenderRoom) -> bool:
    return r.last_queued and all(c.machine.state is ChunkState.DONE for c in r.chunks)


def _fences_pending(s: RoomStep) -> bool:
    return any(f.machine.state is not FenceState.DONE for _key, f in s.side.fences_of(s.room.room))


_NOTHING_WRITTEN: Final = TransferMetricData()
"""The metric of a peer this rank wrote nothing to (frozen: one object serves every status)."""


def _status_to(s: RoomStep, key: PeerKey) -> None:
    """The room's final word to one registered decode rank (dummy requesters expect none on success)."""
    r = s.room
    peer = s.side.registered(key)
    if peer is None:
        return
    q = r.requests.get(peer.key)
    if r.machine.state is _S.SUCCESS:
        if q is None or q.dummy:
            return
        metric = r.peer_metric.get(peer.key, _NOTHING_WRITTEN)
        status = TransferStatus(origin=s.side.origin, room=r.room, outcome=Outcome.SUCCESS, metric=metric)
    elif r.machine.state is _S.FAILED:
        status = TransferStatus(
            origin=s.side.origin, room=r.room, outcome=Outcome.FAILED, reason=r.failure or "failed"
        )
    else:
        return
    s.side.emit(Send(to=peer.endpoint, message=status))


def _destination_problem(msg: TransferRequest, peer: DecodePeer, r: SenderRoom) -> str | None:
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
    if msg.dst_pages.size and int_max(msg.dst_pages) >= capacity:
        return (
            f"destination page {int(msg.dst_pages.max())} outside the decode KV buffers "
            f"({capacity} pages) of {msg.origin}"
        )
    if r.num_pages is not None and msg.dst_pages.size != r.num_pages:
        return f"request has {r.num_pages} pages but {msg.origin} gave {msg.dst_pages.size} destination pages"
    if msg.dst_aux_row is not None:
        rows = peer.layout.min_items(BufferKind.AUX)
        if msg.dst_aux_row >= rows:
            return f"destination aux row {msg.dst_aux_row} outside the decode aux buffers ({rows} rows)"
    for state in msg.dst_state:
        if not peer.layout.select(state.kind):
            return f"destination names state kind {state.kind.value} that {msg.origin} did not register"
        slots = peer.layout.min_items(state.kind)
        if state.indices.size and int_max(state.indices) >= slots:
            return (
                f"destination {state.kind.value} slot {int(state.indices.max())} outside the decode "
                f"buffers ({slots} slots)"
            )
    return None


def _combined(a: TransferMetricData, b: TransferMetricData) -> TransferMetricData:
    return TransferMetricData(pages=a.pages + b.pages, bytes=a.bytes + b.bytes, seconds=a.seconds + b.seconds)


def _clip(text: str) -> str:
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


__all__ = [
    "FAILURE_NOTICE",
    "SENDER_ROOM",
    "FailureNoticeInput",
    "FailureNoticeMachine",
    "FailureNoticeState",
    "SenderRoomInput",
    "SenderRoomMachine",
    "SenderRoomState",
    "SenderRoomTrigger",
]
