"""State diagrams of the machine tables, as Mermaid and Graphviz DOT text.

Owns: turning one ``MachineSpec`` (and the ``EdgeNotes`` written beside it, when its module has
them) into diagram source. Must not change or run a machine. Every edge is labelled
``trigger [guard] / effects``; a row without a note shows its trigger only. Styling is neutral:
no state is painted as current (a table has no current state), terminal states get a double
border in DOT and an arrow to ``[*]`` in Mermaid. Text only: no ``dot`` binary needed.
"""

from __future__ import annotations

import enum
import re
import sys
from typing import Any, Literal

from pdkv.diagrams._mermaid import mermaid_text
from pdkv.protocol.machines import MachineSpec
from pdkv.protocol.machines._notes import EdgeNotes

Engine = Literal["mermaid", "graphviz"]


def file_stem(spec: MachineSpec[Any, Any]) -> str:
    """``SenderRoom`` -> ``sender_room``."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", spec.name).lower()


def notes_for(spec: MachineSpec[Any, Any]) -> EdgeNotes[Any, Any] | None:
    """The ``EdgeNotes`` of ``spec`` defined in the module of its state Enum, if any.

    Found by looking, not by a registry, so a new machine module renders its notes with no change
    here; two notes objects for one machine are a mistake and refused.
    """
    module = sys.modules.get(spec.states.__module__)
    found = (
        [v for v in vars(module).values() if isinstance(v, EdgeNotes) and v.spec is spec] if module else []
    )
    if len(found) > 1:
        raise ValueError(f"{spec.name}: {len(found)} EdgeNotes in {spec.states.__module__}; keep one")
    if found and found[0].stale():
        raise ValueError(f"{spec.name}: notes for edges the table does not have: {found[0].stale()}")
    return found[0] if found else None


def edge_rows(spec: MachineSpec[Any, Any]) -> list[tuple[enum.Enum, enum.Enum, tuple[str, ...]]]:
    """``(source, dest, label lines)`` per table row and source, in table order (a row that keeps the
    state is a loop); the lines are the input, then ``[guard]`` and ``/ effects``: the names the row
    runs (or, for a row without either, its note's prose, where the machine has notes)."""
    notes = notes_for(spec)
    rows: list[tuple[enum.Enum, enum.Enum, tuple[str, ...]]] = []
    for edge in spec.edges:
        plain = edge.guard_name is None and not edge.effects and edge.dest is not None
        if notes is not None and plain and edge.dest is not None:
            parts = notes.parts(edge.trigger, edge.dest)
        else:
            parts = edge.label()  # the row's own guard and effects, by name: what runs
        rows.extend((source, source if edge.dest is None else edge.dest, parts) for source in edge.sources)
    return rows


def render(spec: MachineSpec[Any, Any], engine: Engine) -> str:
    """The machine as Mermaid (``engine="mermaid"``) or DOT (``engine="graphviz"``) source text."""
    if engine == "mermaid":
        return _mermaid(spec)
    if engine == "graphviz":
        return _dot(spec)
    raise ValueError(f"unknown diagram engine {engine!r}: 'mermaid' or 'graphviz'")


def _mermaid(spec: MachineSpec[Any, Any]) -> str:
    lines = ["---", f"title: {spec.name}", "---", "stateDiagram-v2", "  direction LR"]
    lines += [f'  state "{s.name}" as {s.name}' for s in spec.states]
    lines.append(f"  [*] --> {spec.initial.name}")
    for source, dest, parts in edge_rows(spec):
        label = "<br/>".join(mermaid_text(part) for part in parts)
        lines.append(f"  {source.name} --> {dest.name}: {label}")
    lines += [f"  {s.name} --> [*]" for s in spec.states if s in spec.terminal]
    return "\n".join(lines) + "\n"


def _dot(spec: MachineSpec[Any, Any]) -> str:
    lines = [
        f"digraph {spec.name} {{",
        "  rankdir=LR;",
        '  node [shape=box, style=rounded, fontname="Helvetica", fontsize=11];',
        '  edge [fontname="Helvetica", fontsize=9];',
        '  __initial__ [shape=point, width=0.15, label=""];',
    ]
    for s in spec.states:
        extra = ", peripheries=2" if s in spec.terminal else ""
        lines.append(f'  {s.name} [label="{s.name}"{extra}];')
    lines.append(f"  __initial__ -> {spec.initial.name};")
    for source, dest, parts in edge_rows(spec):
        lines.append(f"  {source.name} -> {dest.name} [label={_dot_label(parts)}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _dot_label(parts: tuple[str, ...]) -> str:
    """A quoted DOT label: one left-aligned line per part (a bare trigger stays centred)."""
    escaped = [part.replace("\\", "\\\\").replace('"', '\\"') for part in parts]
    if len(escaped) == 1:
        return f'"{escaped[0]}"'
    return '"' + "".join(f"{line}\\l" for line in escaped) + '"'
