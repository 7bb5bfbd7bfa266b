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
    PEER,
    PER_LAYER,
    PREFILL_ABORT,
    PREFILL_RANK,
    RECEIVER_ROOM,
    SENDER_ROOM,
    ChunkState,
    ChunkTrigger,
    DecodeAbortInput,
    DecodeAbortState,
    DecodeAbortTrigger,
    MachineSpec,
    PeerState,
    PeerTrigger,
    PerLayerState,
    PerLayerTrigger,
    PrefillAbortState,
    PrefillAbortTrigger,
    PrefillRankInput,
    PrefillRankState,
    ReceiverRoomInput,
    ReceiverRoomState,
    ReceiverRoomTrigger,
    SenderRoomState,
    SenderRoomTrigger,
    StateMachine,
)

# The protocol as written in DESIGN section 5, restated independently of the machine modules:
# (machine, source, trigger) -> destination. Anything absent must be rejected.
S, R, C = SenderRoomState, ReceiverRoomState, ChunkState
ST, RT, CT = SenderRoomTrigger, ReceiverRoomTrigger, ChunkTrigger
DA, DAT, PA, PAT = DecodeAbortState, DecodeAbortTrigger, PrefillAbortState, PrefillAbortTrigger
PL, PLT = PerLayerState, PerLayerTrigger
P, PT = PeerState, PeerTrigger
EXPECTED: dict[str, dict[tuple[Any, Any], Any]] = {
    "SenderRoom": {
        (S.BOOTSTRAPPING, ST.ALL_REQUESTS_IN): S.WAITING_FOR_INPUT,
        (S.WAITING_FOR_INPUT, ST.QUEUE_CHUNK): S.TRANSFERRING,
        (S.TRANSFERRING, ST.QUEUE_CHUNK): S.TRANSFERRING,
        (S.TRANSFERRING, ST.LAST_CHUNK_DONE): S.SUCCESS,
        (S.BOOTSTRAPPING, ST.FAIL): S.FAILED,
        (S.WAITING_FOR_INPUT, ST.FAIL): S.FAILED,
        (S.TRANSFERRING, ST.FAIL): S.FAILED,
    },
    "Chunk": {
        (C.REGISTERED, CT.START): C.TRANSFERRING,
        (C.TRANSFERRING, CT.COMPLETE): C.DONE,
        (C.TRANSFERRING, CT.FAIL): C.FAILED,
        (C.REGISTERED, CT.SKIP): C.SKIPPED,
    },
    "PrefillAbort": {
        (PA.RECEIVED, PAT.DRAIN): PA.DRAINING,
        (PA.DRAINING, PAT.DRAINED): PA.ACKED,
    },
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
    "Peer": {
        (P.REGISTERING, PT.ACKNOWLEDGED): P.READY,
        (P.FORGOTTEN, PT.ACKNOWLEDGED): P.READY,
        (P.REGISTERING, PT.REFUSED): P.REJECTED,
        (P.READY, PT.REFUSED): P.REJECTED,
        (P.REJECTED, PT.REFUSED): P.REJECTED,
        (P.FORGOTTEN, PT.REFUSED): P.REJECTED,
        (P.DRAINING, PT.REFUSED): P.REJECTED,
        (P.READY, PT.SILENCE): P.REGISTERING,
        (P.READY, PT.FORGET): P.FORGOTTEN,
        (P.DRAINING, PT.FORGET): P.FORGOTTEN,
        (P.REGISTERING, PT.REGISTERED_WHILE_DRAINING): P.DRAINING,
        (P.FORGOTTEN, PT.REGISTERED_WHILE_DRAINING): P.DRAINING,
        (P.DRAINING, PT.DRAINED): P.READY,
    },
}
# Machines whose rows have guards: which (state, input) pairs have rows, and where they may lead
# (None: the state stays). Restated from DESIGN sections 5, 7 and 8, not read from the modules.
RS, RI = ReceiverRoomState, ReceiverRoomInput
DAI = DecodeAbortInput
PR, PRI = PrefillRankState, PrefillRankInput
_R_LIVE = (RS.BOOTSTRAPPING, RS.WAITING_FOR_INPUT, RS.TRANSFERRING, RS.VERIFYING)
_R_END = (RS.SUCCESS, RS.FAILED)
MOVES: dict[str, dict[tuple[Any, Any], set[Any]]] = {
    "ReceiverRoom": {
        (RS.BOOTSTRAPPING, RI.TARGETS_READY): {RS.WAITING_FOR_INPUT},
        **{(s, RI.SUCCESS): {None} for s in (*_R_END, RS.BOOTSTRAPPING, RS.VERIFYING)},
        # The last required Success: Success, or (checksums on) the check of the pages first.
        (RS.WAITING_FOR_INPUT, RI.SUCCESS): {None, RS.SUCCESS, RS.VERIFYING, RS.TRANSFERRING},
        (RS.TRANSFERRING, RI.SUCCESS): {None, RS.SUCCESS, RS.VERIFYING},
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
        (PR.REGISTERING, PRI.REGISTER_ACK): {PR.READY},
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
    "Peer": set(),  # a peer always has a way on (a new registration, a re-acknowledgement)
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
def test_every_row_names_its_guard_and_effects_and_the_diagrams_draw_them(spec: MachineSpec[Any, Any]) -> None:
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
    assert (SENDER_ROOM, RECEIVER_ROOM, CHUNK, DECODE_ABORT, PREFILL_ABORT, PER_LAYER, PEER, PREFILL_RANK) == ALL_MACHINES


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
