"""The machinery shared by every pdkv state machine: rows declared once, run from a compiled table.

Owns: ``Row`` (one rule of a machine: on an input, in some states, when a guard holds, move to a state
and run effects), ``MachineSpec`` (a machine's Enum states and inputs and its rows, declared to
``transitions`` as conditions and callbacks and compiled from the library's machine), and
``StateMachine`` (one instance's state, stepped on the spec's table). Must not know any particular
machine, do I/O or read clocks.

Every rule of the protocol is a row. A row names its guard and its effects: plain functions of one
argument, the machine's step context (a small object that carries the record, the input and the
endpoint's services), defined in the machine's module beside its rows. The endpoint's job is to build
the context, find the row and run it: ``StateMachine.step(input, context)``. Rows for one (state,
input) are tried in order; the first whose guard holds is taken. A row with ``dest=None`` keeps the
state (an internal transition: its effects run, the state does not change).

Why a table at run time: a ``transitions.Machine`` per instance costs about 75 us and 16 KB to build
and 9 us per trigger, and pdkv makes several per room. So each spec builds one ``transitions.Machine``
when it is defined, with every row as a transition (its guard a condition, its effects ``after``
callbacks, named), reads the table back *from that machine*, and checks that the library holds
exactly the declared rows in the declared order: the library decides, the rows must agree, and a
mismatch is an import-time error. Instances look the rows up (a dict access and a guard call per
move). Diagrams are drawn from the same rows: every edge reads ``input [guard] / effects``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import attrs
from transitions import Machine

from pdkv.errors import LocalProtocolError

if TYPE_CHECKING:
    from transitions.core import TransitionConfigDict


S = TypeVar("S", bound=enum.Enum)
T = TypeVar("T", bound=enum.Enum)
C = TypeVar("C")


class MachineEnum(enum.Enum):
    """The base of every machine's states and inputs. A member hashes by identity, in C: the table's
    keys and every machine's state are these members, looked up on each step, and ``enum.Enum``'s own
    ``__hash__`` is a Python function (a call per lookup). Members are singletons compared by
    identity, so the two hashes agree on what is equal."""

    __hash__ = object.__hash__


def always(_: object) -> bool:
    """The guard of a row that holds whenever its input comes (drawn without a guard)."""
    return True


@attrs.frozen(eq=False)
class Row(Generic[S, T, C]):
    """One rule: ``input`` in any of ``sources``, when ``guard(context)`` holds, moves the machine to
    ``dest`` (None: it stays) and then runs each of ``effects(context)`` in order."""

    input: T
    sources: tuple[S, ...]
    dest: S | None
    guard: Callable[[C], bool] = always
    effects: tuple[Callable[[C], None], ...] = ()

    @property
    def trigger(self) -> T:
        """The input (the word ``transitions`` uses)."""
        return self.input

    @property
    def guard_name(self) -> str | None:
        """The guard's name, None for ``always``."""
        return None if self.guard is always else self.guard.__name__

    @property
    def effect_names(self) -> tuple[str, ...]:
        return tuple(effect.__name__ for effect in self.effects)

    def label(self) -> tuple[str, ...]:
        """``(input, "[guard]", "/ effect, effect")``, the empty ones left out: a diagram edge's lines."""
        parts = [self.input.value]
        if self.guard_name is not None:
            parts.append(f"[{self.guard_name}]")
        if self.effects:
            parts.append("/ " + ", ".join(self.effect_names))
        return tuple(parts)


Edge = Row  # the rows of a machine without guards or effects read as its edges


def row(
    input: T,
    sources: Iterable[S] | S,
    dest: S | None,
    *,
    when: Callable[[C], bool] = always,
    then: Sequence[Callable[[C], None]] = (),
) -> Row[S, T, C]:
    """One row of a machine table (``dest=None``: the state stays, the effects run)."""
    source_tuple = (sources,) if isinstance(sources, enum.Enum) else tuple(sources)
    return Row(input, source_tuple, dest, when, tuple(then))


def edges(trigger: T, sources: Iterable[S], dest: S) -> Row[S, T, Any]:
    """A row without guard or effects (a plain move)."""
    return Row(trigger, tuple(sources), dest)


@attrs.frozen
class _Step(Generic[S, C]):
    guard: Callable[[C], bool]
    effects: tuple[Callable[[C], None], ...]
    dest: S | None
    dest_terminal: bool


@attrs.frozen(kw_only=True)
class MachineSpec(Generic[S, T]):
    """A machine's definition: its rows are the protocol's rules for it, read them as its table."""

    name: str
    states: type[S]
    triggers: type[T]
    initial: S
    edges: tuple[Row[S, T, Any], ...]
    table: dict[tuple[S, T], S] = attrs.field(init=False, eq=False, repr=False)
    """(state, input) -> the state the first row moves to (rows that keep the state included): the
    plain table of a machine whose rows have no guards."""
    terminal: frozenset[S] = attrs.field(init=False, eq=False, repr=False)
    """States with no row out of them (derived once: ``is_terminal`` reads it on every poll)."""
    _compiled: dict[tuple[S, T], tuple[_Step[S, Any], ...]] = attrs.field(init=False, eq=False, repr=False)
    _initial_terminal: bool = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        used = {r.input for r in self.edges}
        unused = set(self.triggers) - used
        if unused:
            raise ValueError(f"{self.name}: inputs without a row: {sorted(t.value for t in unused)}")
        functions = self._functions()
        declared: dict[tuple[S, T], list[Row[S, T, Any]]] = {}
        for r in self.edges:
            for source in r.sources:
                rows = declared.setdefault((source, r.input), [])
                if rows and rows[-1].guard is always:
                    raise ValueError(
                        f"{self.name}: a row for {source.name} + {r.input.value} after one that always holds"
                    )
                rows.append(r)
        library = self._compile()
        by_name = {s.name: s for s in self.states}
        mine = {
            key: [(r.guard_name, r.effect_names, None if r.dest is None else r.dest.name) for r in rows]
            for key, rows in declared.items()
        }
        if library != mine:  # the library reads the rows differently: a bug in pdkv or transitions
            differ = sorted(
                f"{s.name}+{t.value}: library {library.get((s, t))}, rows {mine.get((s, t))}"
                for (s, t) in set(library) | set(mine)
                if library.get((s, t)) != mine.get((s, t))
            )
            raise ValueError(f"{self.name}: transitions compiled other rows: {differ}")
        # Terminal: no row moves out of it. A row that keeps the state (dest None) may answer an input
        # there (a duplicate request to a finished room), and the state stays terminal.
        moves = {source for (source, _t), rows in declared.items() for r in rows if r.dest is not None}
        terminal = frozenset(s for s in self.states if s not in moves)
        compiled: dict[tuple[S, T], tuple[_Step[S, Any], ...]] = {}
        for (source, trigger), entries in library.items():
            steps = []
            for guard_name, effect_names, dest_name in entries:
                dest = None if dest_name is None else by_name[dest_name]
                steps.append(
                    _Step(
                        guard=always if guard_name is None else functions[guard_name],
                        effects=tuple(functions[name] for name in effect_names),
                        dest=dest,
                        dest_terminal=(source in terminal) if dest is None else dest in terminal,
                    )
                )
            compiled[(source, trigger)] = tuple(steps)
        object.__setattr__(self, "_compiled", compiled)
        object.__setattr__(
            self,
            "table",
            {key: (rows[0].dest or key[0]) for key, rows in declared.items()},
        )
        object.__setattr__(self, "terminal", terminal)
        object.__setattr__(self, "_initial_terminal", self.initial in terminal)

    def _functions(self) -> dict[str, Callable[[Any], Any]]:
        """Every guard and effect by name; a name stands for one function only."""
        found: dict[str, Callable[[Any], Any]] = {}
        for r in self.edges:
            for fn in (r.guard, *r.effects):
                name = fn.__name__
                if name == "<lambda>":
                    raise ValueError(f"{self.name}: a row of {r.input.value} refers to a lambda; name it")
                known = found.setdefault(name, fn)
                if known is not fn:
                    raise ValueError(f"{self.name}: two functions are named {name!r}")
        return found

    def library_machine(self) -> Machine:
        """A ``transitions.Machine`` of this spec (its own model), as the library builds it."""
        return Machine(
            states=self.states,
            transitions=self.transition_config(),
            initial=self.initial,
            auto_transitions=False,
            send_event=False,
        )

    def _compile(self) -> dict[tuple[S, T], list[tuple[str | None, tuple[str, ...], str | None]]]:
        """(state, input) -> [(guard name, effect names, destination name)], read from the library's
        machine in its order: every transition it holds."""
        machine = self.library_machine()
        by_name = {s.name: s for s in self.states}
        table: dict[tuple[S, T], list[tuple[str | None, tuple[str, ...], str | None]]] = {}
        for trigger in self.triggers:
            event = machine.events[trigger.value]
            for source_name, transitions in event.transitions.items():
                for transition in transitions:
                    guards = [str(c.func) for c in transition.conditions]
                    dest = None if transition.dest is None else str(transition.dest)
                    table.setdefault((by_name[source_name], trigger), []).append(
                        (guards[0] if guards else None, tuple(str(a) for a in transition.after), dest)
                    )
        return table

    def transition_config(self) -> list[TransitionConfigDict]:
        """The rows in the form ``transitions.Machine`` takes: inputs by their values, guards as
        conditions, effects as ``after`` callbacks, all by name; a row that keeps the state is an
        internal transition (``dest: None``)."""
        config: list[TransitionConfigDict] = []
        for r in self.edges:
            entry: dict[str, Any] = {
                "trigger": r.input.value,
                "source": [s.name for s in r.sources],
                "dest": None if r.dest is None else r.dest.name,
            }
            if r.guard_name is not None:
                entry["conditions"] = [r.guard_name]
            if r.effects:
                entry["after"] = list(r.effect_names)
            config.append(entry)  # type: ignore[arg-type]  # the keys transitions documents
        return config

    def allowed(self, state: S) -> tuple[T, ...]:
        return tuple(t for t in self.triggers if (state, t) in self._compiled)

    def rows_for(self, state: S, trigger: T) -> tuple[Row[S, T, Any], ...]:
        """The rows tried for ``trigger`` in ``state``, in order."""
        return tuple(r for r in self.edges if r.input is trigger and state in r.sources)


class StateMachine(Generic[S, T]):
    """One instance of a machine (a room, a chunk, an abort, a peer), with its state history."""

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
        return (self._state, trigger) in self.spec._compiled

    def step(self, trigger: T, context: object) -> S:
        """Take the first row for ``trigger`` in the current state whose guard holds for ``context``:
        move (unless the row keeps the state), then run its effects. ``LocalProtocolError`` naming
        machine, state and input when no row is allowed or none holds."""
        steps = self.spec._compiled.get((self._state, trigger))
        if steps is not None:
            for s in steps:
                if s.guard(context):
                    if s.dest is not None:
                        self._state = s.dest
                        self._terminal = s.dest_terminal
                        self.history.append(s.dest)
                    for effect in s.effects:
                        effect(context)
                    return self._state
        state = self._state
        if steps is None:
            allowed = ", ".join(t.value for t in self.spec.allowed(state)) or "none (terminal)"
            why = f"is not allowed in state {state.name} (allowed: {allowed})"
        else:
            guards = ", ".join(r.guard_name or "always" for r in self.spec.rows_for(state, trigger))
            why = f"matched no row in state {state.name} (guards: {guards})"
        raise LocalProtocolError(
            f"{self.spec.name} {self.label}: input {trigger.value!r} {why}",
            machine=self.spec.name,
            state=state.name,
            trigger=trigger.value,
        )

    def fire(self, trigger: T) -> S:
        """``step`` for a row without a guard or effects that read a context."""
        return self.step(trigger, None)

    def __repr__(self) -> str:
        return f"<{self.spec.name} {self.label} {self.state.name}>"
