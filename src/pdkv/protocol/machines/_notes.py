"""Edge notes: the guard and the effects of a machine's edges, written beside its table, for reviews.

Owns: ``EdgeNote`` (one edge's guard and effects, as short review text) and ``EdgeNotes`` (a
machine's notes, keyed by ``(trigger, dest)``, checked against its table when drawn). The machines
never read them: ``fire()`` and the endpoints do not depend on this module, so a note can never
change behaviour. ``pdkv diagram`` finds every ``EdgeNotes`` of a machine module and writes its
edges as ``trigger [guard] / effect, effect``; an edge without a note shows its trigger only.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Generic, TypeVar

import attrs

from pdkv.protocol.machines._base import MachineSpec

S = TypeVar("S", bound=enum.Enum)
T = TypeVar("T", bound=enum.Enum)


@attrs.frozen(kw_only=True)
class EdgeNote:
    """What must hold for the edge (``guard``) and what the endpoint does as it fires (``effects``)."""

    guard: str = ""
    effects: tuple[str, ...] = ()

    def parts(self, trigger: str) -> tuple[str, ...]:
        """``(trigger, "[guard]", "/ effect, effect")``, the empty ones left out: the lines of a label."""
        parts = [trigger]
        if self.guard:
            parts.append(f"[{self.guard}]")
        if self.effects:
            parts.append("/ " + ", ".join(self.effects))
        return tuple(parts)


@attrs.frozen
class EdgeNotes(Generic[S, T]):
    """The notes of one machine, keyed by the ``(trigger, dest)`` of an edge of its table."""

    spec: MachineSpec[S, T]
    notes: Mapping[tuple[T, S], EdgeNote]

    def stale(self) -> list[str]:
        """Notes whose edge the table no longer has (``pdkv diagram`` refuses to draw with any).

        Checked there, not here: a stale note must never stop the protocol from importing."""
        rows = {(edge.trigger, edge.dest) for edge in self.spec.edges}
        return [f"{t.value} -> {d.name}" for (t, d) in self.notes if (t, d) not in rows]

    def parts(self, trigger: T, dest: S) -> tuple[str, ...]:
        """The label lines of the edge ``trigger`` -> ``dest``: its trigger alone when it has no note."""
        note = self.notes.get((trigger, dest))
        return (trigger.value,) if note is None else note.parts(trigger.value)
