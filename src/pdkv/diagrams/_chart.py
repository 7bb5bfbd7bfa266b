"""A sequence chart (lanes, then steps in order) written as Mermaid or as Graphviz DOT.

Owns: ``Chart`` / ``Step`` and their two writers, shared by the recorded scenarios
(``pdkv.diagrams.sequences``) and the traces of real runs (``pdkv.diagrams.trace``). Must not know
where the steps come from. The DOT form draws one column per lane, one row per step (a lane's
lifeline runs down its column; ``group`` keeps it straight), a message as an arrow across its row
and a note as a box on its lane, so ``dot -Tsvg`` gives reviewers without a Mermaid viewer a
sequence diagram.
"""

from __future__ import annotations

import enum

import attrs

from pdkv.diagrams._mermaid import mermaid_text


class StepKind(enum.Enum):
    MESSAGE = "message"  # a control message that arrived
    LOST = "lost"  # a control message that never arrived (or was never logged as received)
    DATA = "data"  # KV writes of a chunk (data plane)
    NOTE = "note"  # what changed on one lane


_MERMAID_ARROWS = {StepKind.MESSAGE: "->>", StepKind.LOST: "-x", StepKind.DATA: "-->>"}


@attrs.frozen(kw_only=True)
class Step:
    kind: StepKind
    lane: str
    """The sender of a message, the lane of a note."""
    to: str | None = None
    """The receiver of a message (None for a note)."""
    time: str
    """Already formatted (``0.012s``, ``3.4 ms``)."""
    lines: tuple[str, ...]
    """The label: one line for a message, one or more for a note."""


@attrs.frozen(kw_only=True)
class Chart:
    title: str
    lanes: tuple[tuple[str, str], ...]
    """``(id, label)`` of each lane, left to right; ids are Mermaid/DOT identifiers."""
    steps: tuple[Step, ...]

    def mermaid(self) -> str:
        out = ["---", f"title: {self.title}", "---", "sequenceDiagram"]
        out += [f"  participant {lane} as {mermaid_text(label)}" for lane, label in self.lanes]
        for step in self.steps:
            text = "<br/>".join(mermaid_text(line) for line in step.lines)
            if step.kind is StepKind.NOTE:
                out.append(f"  Note over {step.lane}: {step.time} {text}")
            else:
                out.append(f"  {step.lane}{_MERMAID_ARROWS[step.kind]}{step.to}: {step.time} {text}")
        return "\n".join(out) + "\n"

    def dot(self) -> str:
        lanes = [lane for lane, _ in self.lanes]
        out = [
            f"digraph {_dot_id(self.title)} {{",
            f"  label={_quote(self.title)}; labelloc=t;",
            "  rankdir=TB; nodesep=0.6; ranksep=0.25; newrank=true;",
            '  node [fontname="Helvetica", fontsize=10];',
            '  edge [fontname="Helvetica", fontsize=9];',
        ]
        rows = len(self.steps) + 1
        for lane, label in self.lanes:
            out.append(f"  {lane}_0 [shape=box, style=rounded, group={lane}, label={_quote(label)}];")
        for row, step in enumerate(self.steps, start=1):
            for lane in lanes:
                if step.kind is StepKind.NOTE and lane == step.lane:
                    text = f"{step.time} " + "\\l".join(_escape(line) for line in step.lines) + "\\l"
                    out.append(f'  {lane}_{row} [shape=note, group={lane}, label="{text}"];')
                else:
                    out.append(f'  {lane}_{row} [shape=point, width=0.03, group={lane}, label=""];')
        for lane in lanes:  # lifelines, which also keep the rows in order
            chain = " -> ".join(f"{lane}_{row}" for row in range(rows))
            out.append(f"  {chain} [style=dashed, arrowhead=none, color=gray];")
        for row in range(rows):  # one rank per row, lanes left to right
            members = "; ".join(f"{lane}_{row}" for lane in lanes)
            out.append(f"  {{ rank=same; {members}; }}")
            if len(lanes) > 1:
                order = " -> ".join(f"{lane}_{row}" for lane in lanes)
                out.append(f"  {order} [style=invis];")
        for row, step in enumerate(self.steps, start=1):
            if step.kind is StepKind.NOTE or step.to is None:
                continue
            style = {StepKind.MESSAGE: "solid", StepKind.LOST: "solid", StepKind.DATA: "dashed"}[step.kind]
            head = ', arrowhead=tee, color="gray40"' if step.kind is StepKind.LOST else ""
            label = _quote(f"{step.time} {' '.join(step.lines)}")
            attributes = f"label={label}, style={style}, constraint=false{head}"
            out.append(f"  {step.lane}_{row} -> {step.to}_{row} [{attributes}];")
        out.append("}")
        return "\n".join(out) + "\n"


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _quote(text: str) -> str:
    return f'"{_escape(text)}"'


def _dot_id(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text) or "sequence"
