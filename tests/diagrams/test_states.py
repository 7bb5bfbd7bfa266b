"""State diagrams: edge labels from the notes beside a table, found without a registry."""

from __future__ import annotations

import enum

import pytest

from pdkv.diagrams.states import notes_for, render
from pdkv.protocol.machines import ALL_MACHINES
from pdkv.protocol.machines._base import MachineSpec, edges
from pdkv.protocol.machines._notes import EdgeNote, EdgeNotes


class Lamp(enum.Enum):
    OFF = "off"
    ON = "on"
    BROKEN = "broken"


class Switch(enum.Enum):
    PRESS = "press"
    BREAK = "break"


LAMP = MachineSpec(
    name="Lamp",
    states=Lamp,
    triggers=Switch,
    initial=Lamp.OFF,
    edges=(
        edges(Switch.PRESS, [Lamp.OFF], Lamp.ON),
        edges(Switch.PRESS, [Lamp.ON], Lamp.OFF),
        edges(Switch.BREAK, [Lamp.OFF, Lamp.ON], Lamp.BROKEN),
    ),
)
# Beside the table, as in pdkv's machine modules: only one PRESS row and the BREAK row annotated.
LAMP_NOTES = EdgeNotes(
    LAMP,
    {
        (Switch.PRESS, Lamp.ON): EdgeNote(guard="power present", effects=("light", "start timer")),
        (Switch.BREAK, Lamp.BROKEN): EdgeNote(effects=("call the electrician",)),
    },
)


def test_a_new_machine_renders_its_notes_and_bare_triggers_without_code_changes() -> None:
    assert notes_for(LAMP) is LAMP_NOTES
    mermaid = render(LAMP, "mermaid")
    assert "  OFF --> ON: press<br/>[power present]<br/>/ light, start timer\n" in mermaid
    assert "  ON --> OFF: press\n" in mermaid  # a row without a note: its trigger only
    assert "  OFF --> BROKEN: break<br/>/ call the electrician\n" in mermaid
    assert "  ON --> BROKEN: break<br/>/ call the electrician\n" in mermaid
    assert "  [*] --> OFF\n" in mermaid and "  BROKEN --> [*]\n" in mermaid
    dot = render(LAMP, "graphviz")
    assert '  OFF -> ON [label="press\\l[power present]\\l/ light, start timer\\l"];' in dot
    assert '  ON -> OFF [label="press"];' in dot
    assert '  OFF -> BROKEN [label="break\\l/ call the electrician\\l"];' in dot
    assert '  BROKEN [label="BROKEN", peripheries=2];' in dot


def test_notes_for_an_edge_the_table_lacks_are_refused_when_drawn(monkeypatch: pytest.MonkeyPatch) -> None:
    stale = EdgeNotes(LAMP, {(Switch.BREAK, Lamp.OFF): EdgeNote(guard="never")})  # builds: imports never fail
    assert stale.stale() == ["break -> OFF"]
    monkeypatch.setattr(f"{__name__}.LAMP_NOTES", stale)
    with pytest.raises(
        ValueError, match=r"Lamp: notes for edges the table does not have: \['break -> OFF'\]"
    ):
        render(LAMP, "mermaid")


def test_the_protocol_machines_have_notes_and_none_is_stale() -> None:
    # Notes are prose for rows without named guards or effects (a machine whose rows name them draws
    # those names and needs no notes); these machines are still annotated edge by edge, and a note
    # must never outlive its edge.
    annotated = {"PerLayer"}
    for spec in ALL_MACHINES:
        notes = notes_for(spec)
        if spec.name in annotated:
            assert notes is not None and notes.notes, spec.name
        assert notes is None or notes.stale() == [], spec.name


def test_mermaid_special_characters_are_escaped_once() -> None:
    from pdkv.diagrams._mermaid import mermaid_text

    assert mermaid_text("a;b #1") == "a#59;b #35;1"
