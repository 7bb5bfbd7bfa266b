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
    RECEIVER_ROOM,
    SENDER_ROOM,
    ChunkState,
    ChunkTrigger,
    DecodeAbortState,
    DecodeAbortTrigger,
    MachineSpec,
    PeerState,
    PeerTrigger,
    PerLayerState,
    PerLayerTrigger,
    PrefillAbortState,
    PrefillAbortTrigger,
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
    "ReceiverRoom": {
        (R.BOOTSTRAPPING, RT.REQUESTS_SENT): R.WAITING_FOR_INPUT,
        (R.WAITING_FOR_INPUT, RT.PROGRESS): R.TRANSFERRING,
        (R.TRANSFERRING, RT.PROGRESS): R.TRANSFERRING,
        (R.WAITING_FOR_INPUT, RT.ALL_SUCCEEDED): R.SUCCESS,
        (R.TRANSFERRING, RT.ALL_SUCCEEDED): R.SUCCESS,
        (R.BOOTSTRAPPING, RT.FAIL): R.FAILED,
        (R.WAITING_FOR_INPUT, RT.FAIL): R.FAILED,
        (R.TRANSFERRING, RT.FAIL): R.FAILED,
    },
    "Chunk": {
        (C.REGISTERED, CT.START): C.TRANSFERRING,
        (C.TRANSFERRING, CT.COMPLETE): C.DONE,
        (C.TRANSFERRING, CT.FAIL): C.FAILED,
        (C.REGISTERED, CT.SKIP): C.SKIPPED,
    },
    "DecodeAbort": {
        (DA.REQUESTED, DAT.ALL_ACKED): DA.RELEASED,
        (DA.REQUESTED, DAT.ACKED_UNPROVEN): DA.SETTLING,
        (DA.QUARANTINED, DAT.ACKED_UNPROVEN): DA.SETTLING,
        (DA.QUARANTINED, DAT.ACKED_AFTER_QUARANTINE): DA.CUTTING,
        (DA.CUTTING, DAT.CUT): DA.RELEASED,
        (DA.CUTTING, DAT.CUT_FAILED): DA.SETTLING,
        (DA.CUTTING, DAT.SETTLED): DA.RELEASED,
        (DA.SETTLING, DAT.SETTLED): DA.RELEASED,
        (DA.REQUESTED, DAT.ACK_TIMEOUT): DA.QUARANTINED,
        (DA.QUARANTINED, DAT.QUARANTINE_TIMEOUT): DA.TIMED_OUT,
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
TERMINAL: dict[str, set[Any]] = {
    "SenderRoom": {S.SUCCESS, S.FAILED},
    "ReceiverRoom": {R.SUCCESS, R.FAILED},
    "Chunk": {C.DONE, C.FAILED, C.SKIPPED},
    "DecodeAbort": {DA.RELEASED, DA.TIMED_OUT},
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


@pytest.mark.parametrize("spec", ALL_MACHINES, ids=lambda s: s.name)
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


@pytest.mark.parametrize("spec", ALL_MACHINES, ids=lambda s: s.name)
def test_is_terminal_follows_every_move(spec: MachineSpec[Any, Any]) -> None:
    """``is_terminal`` is kept beside the state, not recomputed: it must agree after every legal move."""
    terminal = TERMINAL[spec.name]
    assert StateMachine(spec, "test").is_terminal is False
    for (source, trigger), dest in EXPECTED[spec.name].items():
        m = _at(spec, source)
        assert m.is_terminal is (source in terminal)
        m.fire(trigger)
        assert m.is_terminal is (dest in terminal)


def test_all_machines_are_listed() -> None:
    assert {s.name for s in ALL_MACHINES} == set(EXPECTED)
    assert (SENDER_ROOM, RECEIVER_ROOM, CHUNK, DECODE_ABORT, PREFILL_ABORT, PER_LAYER, PEER) == ALL_MACHINES


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
