"""Every (state, trigger) pair of every machine: legal pairs move to the table's state, illegal ones
raise LocalProtocolError naming machine, state and trigger. This is how we know every state and
every trigger is exercised: the test enumerates them from the Enums, not from the table."""

from __future__ import annotations

from typing import Any

import pytest

from pdkv.errors import LocalProtocolError
from pdkv.protocol.machines import (
    ALL_MACHINES,
    CHUNK,
    DECODE_ABORT,
    DECODE_RANK,
    FAILURE_NOTICE,
    FENCE,
    PER_LAYER,
    PREFILL_ABORT,
    PREFILL_RANK,
    RECEIVER_ROOM,
    SENDER_ROOM,
    ChunkInput,
    ChunkState,
    ChunkTrigger,
    DecodeAbortInput,
    DecodeAbortState,
    DecodeAbortTrigger,
    DecodeRankInput,
    DecodeRankState,
    FailureNoticeInput,
    FailureNoticeState,
    FenceInput,
    FenceState,
    MachineSpec,
    PerLayerState,
    PerLayerTrigger,
    PrefillAbortInput,
    PrefillAbortState,
    PrefillRankInput,
    PrefillRankState,
    ReceiverRoomInput,
    ReceiverRoomState,
    ReceiverRoomTrigger,
    SenderRoomInput,
    SenderRoomState,
    StateMachine,
)
from pdkv.protocol.machines._base import MachineEnum

# The protocol as written in DESIGN section 5, restated independently of the machine modules:
# (machine, source, trigger) -> destination. Anything absent must be rejected.
S, R, C = SenderRoomState, ReceiverRoomState, ChunkState
RT = ReceiverRoomTrigger
DA, DAT = DecodeAbortState, DecodeAbortTrigger
PL, PLT = PerLayerState, PerLayerTrigger
EXPECTED: dict[str, dict[tuple[Any, Any], Any]] = {
    # DESIGN section 7, per-layer path: layers submitted while the forward runs, send() finishes,
    # a drop (room failed) is possible until the finisher waits only for the engine.
    "PerLayer": {
        (PL.COLLECTING, PLT.ALL_LAYERS_SUBMITTED): PL.LAYERS_SUBMITTED,
        (PL.COLLECTING, PLT.FINISH): PL.AWAITING_LAYERS,
        (PL.LAYERS_SUBMITTED, PLT.FINISH): PL.COMPLETING,
        (PL.AWAITING_LAYERS, PLT.ALL_LAYERS_SUBMITTED): PL.COMPLETING,
        (PL.COMPLETING, PLT.COMPLETE): PL.DONE,
        (PL.COLLECTING, PLT.CANCEL): PL.CANCELLING,
        (PL.LAYERS_SUBMITTED, PLT.CANCEL): PL.CANCELLING,
        (PL.AWAITING_LAYERS, PLT.CANCEL): PL.CANCELLING,
        (PL.COLLECTING, PLT.BREAK): PL.FAILING,
        (PL.LAYERS_SUBMITTED, PLT.BREAK): PL.FAILING,
        (PL.AWAITING_LAYERS, PLT.BREAK): PL.FAILING,
        (PL.FAILING, PLT.FAIL): PL.FAILED,
        (PL.COMPLETING, PLT.FAIL): PL.FAILED,
        (PL.CANCELLING, PLT.DROP): PL.DROPPED,
        (PL.FAILING, PLT.DROP): PL.DROPPED,
    },
}
# Machines whose rows have guards: which (state, input) pairs have rows, and where they may lead
# (None: the state stays). Restated from DESIGN sections 5, 7 and 8, not read from the modules.
RS, RI = ReceiverRoomState, ReceiverRoomInput
DAI = DecodeAbortInput
PR, PRI = PrefillRankState, PrefillRankInput
SI, CI, PA, PAI = SenderRoomInput, ChunkInput, PrefillAbortState, PrefillAbortInput
DR, DRI, F, FI = DecodeRankState, DecodeRankInput, FenceState, FenceInput
_S_LIVE = (S.BOOTSTRAPPING, S.WAITING_FOR_INPUT, S.TRANSFERRING, S.COMPLETING)
_S_END = (S.SUCCESS, S.FAILED)
_DR_OFF = (DR.NEW, DR.FORGOTTEN, DR.REJECTED)
_R_LIVE = (RS.BOOTSTRAPPING, RS.WAITING_FOR_INPUT, RS.TRANSFERRING, RS.SCATTERING, RS.VERIFYING)
_R_END = (RS.SUCCESS, RS.FAILED)
MOVES: dict[str, dict[tuple[Any, Any], set[Any]]] = {
    # Completing: every chunk Done, Success waits for per-layer writes of a chunk never sent, or fences.
    "SenderRoom": {
        (S.BOOTSTRAPPING, SI.REQUEST): {None, S.FAILED, S.WAITING_FOR_INPUT},
        **{(s, SI.REQUEST): {None, S.FAILED} for s in _S_LIVE[1:]},
        **{(s, SI.REQUEST): {None} for s in _S_END},
        (S.BOOTSTRAPPING, SI.OPEN): {None, S.FAILED},
        (S.WAITING_FOR_INPUT, SI.OPEN): {None, S.FAILED},
        (S.FAILED, SI.OPEN): {None},
        (S.WAITING_FOR_INPUT, SI.QUEUE_CHUNK): {S.FAILED, S.TRANSFERRING},
        (S.TRANSFERRING, SI.QUEUE_CHUNK): {S.FAILED, S.TRANSFERRING},
        (S.FAILED, SI.QUEUE_CHUNK): {None},
        (S.TRANSFERRING, SI.CHUNK_DONE): {None, S.COMPLETING, S.SUCCESS},
        (S.COMPLETING, SI.CHUNK_DONE): {None, S.SUCCESS},
        (S.FAILED, SI.CHUNK_DONE): {None},
        **{(s, SI.CHUNK_FAILED): {S.FAILED} for s in _S_LIVE},
        (S.FAILED, SI.CHUNK_FAILED): {None},
        **{(s, SI.LAYER_WRITES_STARTED): {None} for s in SenderRoomState},
        (S.TRANSFERRING, SI.LAYER_WRITES_ENDED): {None, S.COMPLETING, S.SUCCESS},
        (S.COMPLETING, SI.LAYER_WRITES_ENDED): {None, S.SUCCESS},
        **{(s, SI.LAYER_WRITES_ENDED): {None} for s in (S.BOOTSTRAPPING, S.WAITING_FOR_INPUT, *_S_END)},
        (S.COMPLETING, SI.FENCE_DONE): {None, S.SUCCESS},
        **{(s, i): {S.FAILED} for s in _S_LIVE for i in (SI.PEER_ABORT, SI.ABORT, SI.FAIL)},
        **{(s, i): {None} for s in _S_END for i in (SI.PEER_ABORT, SI.ABORT)},
        (S.FAILED, SI.STATUS_RESEND_DUE): {None},
    },
    "Chunk": {
        (C.REGISTERED, CI.START): {C.SKIPPED, C.TRANSFERRING},
        (C.SKIPPED, CI.START): {None},
        (C.TRANSFERRING, CI.COMPLETE): {C.DONE},
        (C.TRANSFERRING, CI.FAIL): {C.FAILED},
        (C.REGISTERED, CI.FAIL): {C.FAILED},  # the worker's guard, before the chunk started
        (C.REGISTERED, CI.SKIP): {C.SKIPPED},
    },
    "PrefillAbort": {
        (PA.DRAINING, PAI.ASKED): {None, PA.ACKED},
        (PA.ACKED, PAI.ASKED): {None},
        (PA.DRAINING, PAI.WRITES_ENDED): {None, PA.ACKED},
        (PA.ACKED, PAI.WRITES_ENDED): {None},
        (PA.DRAINING, PAI.FENCED): {None},
        (PA.ACKED, PAI.FENCED): {None},
    },
    "DecodeRank": {
        (DR.DRAINING, DRI.REGISTER): {None, DR.REJECTED},
        **{(s, DRI.REGISTER): {None, DR.REJECTED, DR.DRAINING, DR.READY} for s in (*_DR_OFF, DR.READY)},
        **{(s, i): {DR.FORGOTTEN} for s in (DR.READY, DR.DRAINING) for i in (DRI.SILENCE, DRI.RESTART)},
        (DR.DRAINING, DRI.DRAINED): {DR.READY},
        **{(s, DRI.DRAINED): {None} for s in (*_DR_OFF, DR.READY)},
        **{(s, DRI.HEARTBEAT): {None} for s in DecodeRankState},
    },
    # A Failed status goes again until every decode rank told has answered with an Abort.
    "FailureNotice": {
        (FailureNoticeState.TELLING, FailureNoticeInput.HEARD): {None, FailureNoticeState.ANSWERED},
        (FailureNoticeState.ANSWERED, FailureNoticeInput.HEARD): {None},
        (FailureNoticeState.TELLING, FailureNoticeInput.RESEND_DUE): {None},
        (FailureNoticeState.ANSWERED, FailureNoticeInput.RESEND_DUE): {None},
    },
    "Fence": {
        (F.OWED, FI.SUBMIT): {F.RUNNING},
        (F.RUNNING, FI.SUBMIT): {None},
        (F.DONE, FI.SUBMIT): {None},
        (F.OWED, FI.ACK_WANTED): {F.RUNNING},
        (F.RUNNING, FI.ACK_WANTED): {None},
        (F.DONE, FI.ACK_WANTED): {None},
        (F.RUNNING, FI.COMPLETED): {F.DONE},
        (F.RUNNING, FI.FAILED): {F.OWED},
    },
    "ReceiverRoom": {
        # A landing room's requests wait for its lease as well as for its ranks.
        (RS.BOOTSTRAPPING, RI.TARGETS_READY): {None, RS.WAITING_FOR_INPUT},
        (RS.BOOTSTRAPPING, RI.LANDING_GRANTED): {None, RS.WAITING_FOR_INPUT},
        (RS.FAILED, RI.LANDING_GRANTED): {None},
        **{(s, RI.SUCCESS): {None} for s in (*_R_END, RS.BOOTSTRAPPING, RS.SCATTERING, RS.VERIFYING)},
        # The last required Success: Success, or the scatter of a landing lease first, or (checksums
        # on) the check of the pages first.
        (RS.WAITING_FOR_INPUT, RI.SUCCESS): {None, RS.SUCCESS, RS.SCATTERING, RS.VERIFYING, RS.TRANSFERRING},
        (RS.TRANSFERRING, RI.SUCCESS): {None, RS.SUCCESS, RS.SCATTERING, RS.VERIFYING},
        (RS.SCATTERING, RI.SCATTERED): {RS.SUCCESS, RS.VERIFYING},
        (RS.SCATTERING, RI.SCATTER_FAILED): {RS.FAILED},
        **{(RS.FAILED, i): {None} for i in (RI.SCATTERED, RI.SCATTER_FAILED)},  # after an abort
        (RS.VERIFYING, RI.VERIFIED): {RS.SUCCESS},
        (RS.VERIFYING, RI.CORRUPT): {RS.FAILED},
        **{(RS.FAILED, i): {None} for i in (RI.VERIFIED, RI.CORRUPT)},  # a verdict after an abort
        **{(s, i): {None} for s in _R_END for i in (RI.FAILED, RI.PEER_ABORT, RI.ABORT, RI.FAIL)},
        **{(s, RI.FAILED): {None, RS.FAILED} for s in _R_LIVE},
        **{(s, i): {RS.FAILED} for s in _R_LIVE for i in (RI.PEER_ABORT, RI.ABORT, RI.FAIL)},
    },
    "DecodeAbort": {
        (DA.REQUESTED, DAI.NOTHING_SENT): {DA.RELEASED},
        (DA.REQUESTED, DAI.ABORT_ACK): {None, DA.RELEASED, DA.SETTLING},
        (DA.QUARANTINED, DAI.ABORT_ACK): {None, DA.CUTTING, DA.SETTLING},
        **{(s, DAI.ABORT_ACK): {None} for s in (DA.CUTTING, DA.SETTLING, DA.RELEASED, DA.TIMED_OUT)},
        (DA.REQUESTED, DAI.DEADLINE): {DA.QUARANTINED},
        (DA.QUARANTINED, DAI.DEADLINE): {DA.TIMED_OUT},
        (DA.CUTTING, DAI.DEADLINE): {DA.RELEASED},
        (DA.SETTLING, DAI.DEADLINE): {DA.RELEASED},
        (DA.CUTTING, DAI.CUT): {DA.RELEASED},
        (DA.CUTTING, DAI.CUT_FAILED): {DA.SETTLING},
        (DA.REQUESTED, DAI.RESEND_DUE): {None},
        (DA.QUARANTINED, DAI.RESEND_DUE): {None},
        **{(s, DAI.RANK_READY): {None} for s in DecodeAbortState},
    },
    "PrefillRank": {
        # REJECTED: a strict decode refuses an ack that leaves draft buffers out
        (PR.REGISTERING, PRI.REGISTER_ACK): {PR.READY, PR.REJECTED},
        (PR.READY, PRI.REGISTER_ACK): {None},
        (PR.REJECTED, PRI.REGISTER_ACK): {None},
        **{(s, PRI.REFUSED): {PR.REJECTED} for s in PrefillRankState},
        (PR.READY, PRI.NOT_KNOWN): {PR.REGISTERING},
        (PR.REGISTERING, PRI.NOT_KNOWN): {None},
        (PR.REJECTED, PRI.NOT_KNOWN): {None},
        (PR.READY, PRI.SILENCE): {PR.REGISTERING},
        (PR.REGISTERING, PRI.REGISTER_DUE): {None},
    },
}
TERMINAL: dict[str, set[Any]] = {
    "SenderRoom": {S.SUCCESS, S.FAILED},
    "ReceiverRoom": {R.SUCCESS, R.FAILED},
    "Chunk": {C.DONE, C.FAILED, C.SKIPPED},
    "DecodeAbort": {DA.RELEASED, DA.TIMED_OUT},
    "PrefillRank": set(),  # a rank can always be registered with again
    "PrefillAbort": {PA.ACKED},
    "PerLayer": {PL.DONE, PL.FAILED, PL.DROPPED},
    "DecodeRank": set(),  # a decode rank can always register again
    "Fence": {F.DONE},  # a later failed write owes a new fence
    "FailureNotice": {FailureNoticeState.ANSWERED},
}


def _at(spec: MachineSpec[Any, Any], state: Any) -> StateMachine[Any, Any]:
    """A machine driven (through legal triggers only) into ``state``."""
    m: StateMachine[Any, Any] = StateMachine(spec, "test")
    path = _path_to(spec, state)
    for trigger in path:
        m.fire(trigger)
    assert m.state is state
    return m


def _path_to(spec: MachineSpec[Any, Any], target: Any) -> list[Any]:
    frontier: list[tuple[Any, list[Any]]] = [(spec.initial, [])]
    seen = {spec.initial}
    while frontier:
        state, path = frontier.pop(0)
        if state is target:
            return path
        for (source, trigger), dest in EXPECTED[spec.name].items():
            if source is state and dest not in seen:
                seen.add(dest)
                frontier.append((dest, [*path, trigger]))
    raise AssertionError(f"{spec.name}: {target} unreachable")


PLAIN = tuple(spec for spec in ALL_MACHINES if spec.name in EXPECTED)
GUARDED = tuple(spec for spec in ALL_MACHINES if spec.name in MOVES)


@pytest.mark.parametrize("spec", PLAIN, ids=lambda s: s.name)
def test_every_state_and_trigger_pair(spec: MachineSpec[Any, Any]) -> None:
    expected = EXPECTED[spec.name]
    for state in spec.states:
        for trigger in spec.triggers:
            m = _at(spec, state)
            if (state, trigger) in expected:
                assert m.fire(trigger) is expected[(state, trigger)]
                assert m.state is expected[(state, trigger)]
                assert m.history[-1] is m.state
            else:
                with pytest.raises(LocalProtocolError) as info:
                    m.fire(trigger)
                err = info.value
                assert (err.machine, err.state, err.trigger) == (spec.name, state.name, trigger.value)
                assert spec.name in str(err) and state.name in str(err) and repr(trigger.value) in str(err)
                assert m.state is state  # an invalid trigger changes nothing


@pytest.mark.parametrize("spec", ALL_MACHINES, ids=lambda s: s.name)
def test_terminal_states_match_design(spec: MachineSpec[Any, Any]) -> None:
    assert set(spec.terminal) == TERMINAL[spec.name]
    assert spec.initial not in spec.terminal


@pytest.mark.parametrize("spec", PLAIN, ids=lambda s: s.name)
def test_is_terminal_follows_every_move(spec: MachineSpec[Any, Any]) -> None:
    """``is_terminal`` is kept beside the state, not recomputed: it must agree after every legal move."""
    terminal = TERMINAL[spec.name]
    assert StateMachine(spec, "test").is_terminal is False
    for (source, trigger), dest in EXPECTED[spec.name].items():
        m = _at(spec, source)
        assert m.is_terminal is (source in terminal)
        m.fire(trigger)
        assert m.is_terminal is (dest in terminal)


@pytest.mark.parametrize("spec", GUARDED, ids=lambda s: s.name)
def test_the_rows_allow_exactly_the_moves_of_the_design(spec: MachineSpec[Any, Any]) -> None:
    expected = MOVES[spec.name]
    for state in spec.states:
        for trigger in spec.triggers:
            rows = spec.rows_for(state, trigger)
            assert ((state, trigger) in expected) == bool(rows), (state, trigger)
            if rows:
                assert {r.dest for r in rows} == expected[(state, trigger)], (state, trigger)
                assert rows[-1].guard_name is None, (state, trigger)  # the last row always holds
            else:
                m: StateMachine[Any, Any] = StateMachine(spec, "test")
                m._state = state  # put there directly: no row leads here from the initial state alone
                with pytest.raises(LocalProtocolError) as info:
                    m.step(trigger, None)
                assert (info.value.machine, info.value.state, info.value.trigger) == (
                    spec.name,
                    state.name,
                    trigger.value,
                )


@pytest.mark.parametrize("spec", ALL_MACHINES, ids=lambda s: s.name)
def test_every_row_names_its_guard_and_effects_and_the_diagrams_draw_them(
    spec: MachineSpec[Any, Any],
) -> None:
    """Every rule is a row whose guard and effects are named functions of its machine's module (or
    ``always``), and the diagram of the machine draws every row as ``input [guard] / effects``."""
    import sys

    from pdkv.diagrams.states import render
    from pdkv.protocol.machines._base import always

    home = next(
        m
        for m in sys.modules.values()
        if getattr(m, "__name__", "").startswith("pdkv.protocol.machines.") and spec in vars(m).values()
    )
    mermaid, dot = render(spec, "mermaid"), render(spec, "graphviz")
    for r in spec.edges:
        assert r.guard is always or vars(home).get(r.guard.__name__) is r.guard, (spec.name, r.guard)
        for effect in r.effects:
            assert vars(home).get(effect.__name__) is effect, (spec.name, effect)
        if r.guard is not always or r.effects:
            for part in r.label()[1:]:
                assert part in mermaid and part.replace('"', '\\"') in dot, (spec.name, part)


def test_all_machines_are_listed() -> None:
    assert {s.name for s in ALL_MACHINES} == set(EXPECTED) | set(MOVES)
    listed = (
        SENDER_ROOM,
        FAILURE_NOTICE,
        RECEIVER_ROOM,
        CHUNK,
        DECODE_ABORT,
        PREFILL_ABORT,
        PER_LAYER,
        DECODE_RANK,
        PREFILL_RANK,
        FENCE,
    )
    assert listed == ALL_MACHINES


def test_spec_rejects_ambiguous_and_unused() -> None:
    from pdkv.protocol.machines._base import edges

    # A second row for the same state and input after one that always holds could never be taken.
    with pytest.raises(ValueError, match="after one that always holds"):
        MachineSpec(
            name="Bad",
            states=ChunkState,
            triggers=ChunkTrigger,
            initial=ChunkState.REGISTERED,
            edges=(
                edges(ChunkTrigger.START, [ChunkState.REGISTERED], ChunkState.TRANSFERRING),
                edges(ChunkTrigger.START, [ChunkState.REGISTERED], ChunkState.DONE),
                edges(ChunkTrigger.COMPLETE, [ChunkState.TRANSFERRING], ChunkState.DONE),
                edges(ChunkTrigger.FAIL, [ChunkState.TRANSFERRING], ChunkState.FAILED),
                edges(ChunkTrigger.SKIP, [ChunkState.REGISTERED], ChunkState.SKIPPED),
            ),
        )
    with pytest.raises(ValueError, match="inputs without a row"):
        MachineSpec(
            name="Bad",
            states=ChunkState,
            triggers=ChunkTrigger,
            initial=ChunkState.REGISTERED,
            edges=(edges(ChunkTrigger.START, [ChunkState.REGISTERED], ChunkState.TRANSFERRING),),
        )


@pytest.mark.parametrize("spec", ALL_MACHINES, ids=lambda s: s.name)
def test_states_and_inputs_hash_by_identity_in_c(spec: MachineSpec[Any, Any]) -> None:
    # Every step looks its row up by (state, input): enum.Enum's own __hash__ is a Python call each.
    for members in (spec.states, spec.triggers):
        assert issubclass(members, MachineEnum), members
        assert vars(MachineEnum)["__hash__"] is object.__hash__ and "__hash__" not in vars(members)
        first = next(iter(members))
        assert {first: 1}[first] == 1 and hash(first) == object.__hash__(first)
