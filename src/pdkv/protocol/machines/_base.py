"""The machinery shared by every pdkv state machine: a declarative spec and a typed runner.

Owns: ``Edge``/``MachineSpec`` (the single source of truth of a machine: Enum states, Enum
triggers, edges) and ``StateMachine`` (one instance's state, run on the spec's compiled table).
Must not know any particular machine, do I/O or read clocks.

Why a table at run time: a ``transitions.Machine`` per instance costs about 75 us and 16 KB to build
and 9 us per trigger; pdkv makes several per room (sender room, chunks, receiver room, aborts), which
was the largest single cost of a small room's control path (``pdkv bench control``). So each spec
builds one ``transitions.Machine`` when it is defined and compiles its table *from that machine*
(``MachineSpec.table``): the library decides every (state, trigger) -> state pair, the spec's edges
must say the same (checked at definition, a mismatch is an import-time error), and instances look
the pair up (0.3 us). ``transitions`` binds triggers dynamically (typed ``Any``), so pdkv never calls
them by attribute: ``StateMachine.fire(trigger)`` is the one typed entry point, and an invalid
trigger is a ``LocalProtocolError`` naming machine, instance, state and trigger. Diagrams are drawn
from the same machine (``pdkv.diagrams``).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Generic, TypeVar

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
    terminal: frozenset[S] = attrs.field(init=False, eq=False, repr=False)
    """States with no way out (derived from ``table`` once: ``is_terminal`` reads it on every poll)."""
    # ``table`` with each destination's terminal flag beside it, and the initial state's flag: what
    # ``StateMachine`` keeps per instance, read here so that no move hashes a state a second time.
    _steps: dict[tuple[S, T], tuple[S, bool]] = attrs.field(init=False, eq=False, repr=False)
    _initial_terminal: bool = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        declared: dict[tuple[S, T], S] = {}
        for edge in self.edges:
            for source in edge.sources:
                key = (source, edge.trigger)
                if key in declared:
                    raise ValueError(f"{self.name}: two edges for {source.name} + {edge.trigger.value}")
                declared[key] = edge.dest
        unused = set(self.triggers) - {e.trigger for e in self.edges}
        if unused:
            raise ValueError(f"{self.name}: triggers without an edge: {sorted(t.value for t in unused)}")
        table = self._compile()
        if table != declared:  # the library reads the edges differently: a bug in pdkv or transitions
            differ = sorted(
                f"{s.name}+{t.value}: library {table.get((s, t))}, edges {declared.get((s, t))}"
                for (s, t) in set(table) ^ set(declared) | {k for k in table if table[k] != declared.get(k)}
            )
            raise ValueError(f"{self.name}: transitions compiled another table: {differ}")
        object.__setattr__(self, "table", table)
        sources = {s for (s, _t) in table}
        terminal = frozenset(s for s in self.states if s not in sources)
        object.__setattr__(self, "terminal", terminal)
        object.__setattr__(self, "_steps", {key: (dest, dest in terminal) for key, dest in table.items()})
        object.__setattr__(self, "_initial_terminal", self.initial in terminal)

    def library_machine(self) -> Machine:
        """A ``transitions.Machine`` of this spec (its own model), as the library builds it."""
        return Machine(
            states=self.states,
            transitions=self.transition_config(),
            initial=self.initial,
            auto_transitions=False,
            send_event=False,
        )

    def _compile(self) -> dict[tuple[S, T], S]:
        """(state, trigger) -> state, read from the library's machine: every transition it holds."""
        machine = self.library_machine()
        by_name = {s.name: s for s in self.states}
        table: dict[tuple[S, T], S] = {}
        for trigger in self.triggers:
            event = machine.events[trigger.value]
            for source_name, transitions in event.transitions.items():
                for transition in transitions:
                    table[(by_name[source_name], trigger)] = by_name[str(transition.dest)]
        return table

    def transition_config(self) -> list[TransitionConfigDict]:
        """The edges in the form ``transitions.Machine`` takes (triggers named by their values)."""
        return [
            {"trigger": edge.trigger.value, "source": list(edge.sources), "dest": edge.dest}
            for edge in self.edges
        ]

    def allowed(self, state: S) -> tuple[T, ...]:
        return tuple(t for t in self.triggers if (state, t) in self.table)


class StateMachine(Generic[S, T]):
    """One instance of a machine (a room, a chunk, an abort), with its state history."""

    __slots__ = ("_state", "_terminal", "history", "label", "spec")

    def __init__(self, spec: MachineSpec[S, T], label: str) -> None:
        self.spec = spec
        self.label = label
        self._state = spec.initial
        # Kept beside the state (set wherever it changes) because schedulers poll ``is_terminal``
        # far more often than machines move: a bool read instead of an Enum hash per poll.
        self._terminal = spec._initial_terminal
        self.history: list[S] = [spec.initial]

    @property
    def state(self) -> S:
        return self._state

    @property
    def is_terminal(self) -> bool:
        return self._terminal

    def can_fire(self, trigger: T) -> bool:
        return (self.state, trigger) in self.spec.table

    def fire(self, trigger: T) -> S:
        """Perform ``trigger``; raise LocalProtocolError if the current state does not allow it."""
        state = self.state
        step = self.spec._steps.get((state, trigger))
        if step is None:
            allowed = ", ".join(t.value for t in self.spec.allowed(state)) or "none (terminal)"
            raise LocalProtocolError(
                f"{self.spec.name} {self.label}: trigger {trigger.value!r} is not allowed in state "
                f"{state.name} (allowed: {allowed})",
                machine=self.spec.name,
                state=state.name,
                trigger=trigger.value,
            )
        dest, self._terminal = step
        self._state = dest
        self.history.append(dest)
        return dest

    def __repr__(self) -> str:
        return f"<{self.spec.name} {self.label} {self.state.name}>"


def edges(trigger: T, sources: Iterable[S], dest: S) -> Edge[S, T]:
    """Shorthand for one row of a machine table."""
    return Edge(trigger, tuple(sources), dest)
