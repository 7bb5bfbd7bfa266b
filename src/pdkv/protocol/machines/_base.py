"""The machinery shared by every pdkv state machine: a declarative spec and a typed runner.

Owns: ``Edge``/``MachineSpec`` (the single source of truth of a machine: Enum states, Enum
triggers, edges) and ``StateMachine`` (one instance's state, driven by ``transitions``). Must not
know any particular machine, do I/O or read clocks.

Why a wrapper: ``transitions`` binds triggers dynamically (typed ``Any``), so pdkv never calls them
by attribute. ``StateMachine.fire(trigger)`` checks the edge against the compiled table (an invalid
trigger is a ``LocalProtocolError`` naming machine, instance, state and trigger) and then lets the
``transitions.Machine`` perform it, so the table and the library can never disagree unnoticed.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Generic, TypeVar, cast

import attrs
from transitions import Machine

from pdkv.errors import LocalProtocolError

if TYPE_CHECKING:
    from transitions.core import TransitionConfigDict

# transitions logs a WARNING for every name it declines to bind under model_override, on every
# construction: that doubles construction time and floods logs. pdkv binds nothing by name.
logging.getLogger("transitions").setLevel(logging.ERROR)

S = TypeVar("S", bound=enum.Enum)
T = TypeVar("T", bound=enum.Enum)


@attrs.frozen
class Edge(Generic[S, T]):
    """``trigger`` moves the machine from any of ``sources`` to ``dest``."""

    trigger: T
    sources: tuple[S, ...]
    dest: S


@attrs.frozen(kw_only=True)
class MachineSpec(Generic[S, T]):
    """A machine's definition: read its ``edges`` as the table of the protocol."""

    name: str
    states: type[S]
    triggers: type[T]
    initial: S
    edges: tuple[Edge[S, T], ...]
    table: dict[tuple[S, T], S] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        table: dict[tuple[S, T], S] = {}
        for edge in self.edges:
            for source in edge.sources:
                key = (source, edge.trigger)
                if key in table:
                    raise ValueError(f"{self.name}: two edges for {source.name} + {edge.trigger.value}")
                table[key] = edge.dest
        unused = set(self.triggers) - {e.trigger for e in self.edges}
        if unused:
            raise ValueError(f"{self.name}: triggers without an edge: {sorted(t.value for t in unused)}")
        object.__setattr__(self, "table", table)

    @property
    def terminal(self) -> frozenset[S]:
        """States with no way out."""
        sources = {s for (s, _t) in self.table}
        return frozenset(s for s in self.states if s not in sources)

    def transition_config(self) -> list[TransitionConfigDict]:
        """The edges in the form ``transitions.Machine`` takes (triggers named by their values)."""
        return [
            {"trigger": edge.trigger.value, "source": list(edge.sources), "dest": edge.dest}
            for edge in self.edges
        ]

    def allowed(self, state: S) -> tuple[T, ...]:
        return tuple(t for t in self.triggers if (state, t) in self.table)


class _Model:
    """What ``transitions`` drives: it only sets ``state`` (model_override binds nothing else)."""

    state: enum.Enum


class StateMachine(Generic[S, T]):
    """One instance of a machine (a room, a chunk, an abort), with its state history."""

    __slots__ = ("_machine", "_model", "history", "label", "spec")

    def __init__(self, spec: MachineSpec[S, T], label: str) -> None:
        self.spec = spec
        self.label = label
        self.history: list[S] = [spec.initial]
        self._model = _Model()
        self._machine = Machine(
            model=self._model,
            states=spec.states,
            transitions=spec.transition_config(),
            initial=spec.initial,
            auto_transitions=False,
            model_override=True,
            send_event=False,
        )

    @property
    def state(self) -> S:
        return cast(S, self._model.state)  # set by transitions to one of spec.states

    @property
    def is_terminal(self) -> bool:
        return self.state in self.spec.terminal

    def can_fire(self, trigger: T) -> bool:
        return (self.state, trigger) in self.spec.table

    def fire(self, trigger: T) -> S:
        """Perform ``trigger``; raise LocalProtocolError if the current state does not allow it."""
        state = self.state
        dest = self.spec.table.get((state, trigger))
        if dest is None:
            allowed = ", ".join(t.value for t in self.spec.allowed(state)) or "none (terminal)"
            raise LocalProtocolError(
                f"{self.spec.name} {self.label}: trigger {trigger.value!r} is not allowed in state "
                f"{state.name} (allowed: {allowed})",
                machine=self.spec.name,
                state=state.name,
                trigger=trigger.value,
            )
        self._machine.events[trigger.value].trigger(self._model)
        if self._model.state is not dest:  # the library and the table disagree: a bug in pdkv
            raise AssertionError(
                f"{self.spec.name}: transitions went to {self._model.state}, table says {dest}"
            )
        self.history.append(dest)
        return dest

    def __repr__(self) -> str:
        return f"<{self.spec.name} {self.label} {self.state.name}>"


def edges(trigger: T, sources: Iterable[S], dest: S) -> Edge[S, T]:
    """Shorthand for one row of a machine table."""
    return Edge(trigger, tuple(sources), dest)
