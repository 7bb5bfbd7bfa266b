"""``pdkv diagram``: render every state machine as Mermaid and Graphviz DOT text for reviews.

Owns: turning ``pdkv.protocol.machines.ALL_MACHINES`` into ``specs/diagrams/<machine>.mmd`` and
``.dot`` and into the marked Mermaid blocks of ``specs/protocol.md``; ``--check`` reports drift
between those files and the code (CI runs it through a test). Needs no ``dot`` binary: both
engines of ``transitions`` produce text.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from typing import Any, Literal

from transitions.extensions import GraphMachine

from pdkv.protocol.machines import ALL_MACHINES, MachineSpec

_BLOCK = re.compile(r"(<!-- diagram:(?P<name>[a-z_]+) -->\n)(?P<body>.*?)(<!-- /diagram -->)", re.DOTALL)


def file_stem(spec: MachineSpec[Any, Any]) -> str:
    """``SenderRoom`` -> ``sender_room``."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", spec.name).lower()


def render(spec: MachineSpec[Any, Any], engine: Literal["mermaid", "graphviz"]) -> str:
    """The machine as Mermaid (``engine="mermaid"``) or DOT (``engine="graphviz"``) source text."""
    # transitions warns and silently falls back to another engine when one is missing: refuse that.
    logging.getLogger("transitions.extensions.diagrams").setLevel(logging.ERROR)
    machine = GraphMachine(
        states=spec.states,
        transitions=spec.transition_config(),
        initial=spec.initial,
        auto_transitions=False,
        title=spec.name,
        graph_engine=engine,
        show_conditions=False,
    )
    graph = machine.get_combined_graph()
    source = getattr(graph, "source", None)
    if not isinstance(source, str):
        raise RuntimeError(f"graph engine {engine!r} produced no text (is the 'graphviz' package installed?)")
    if engine == "graphviz" and not source.lstrip().startswith("digraph"):
        raise RuntimeError("the 'graphviz' Python package is missing: pip install 'pdkv[diagrams]'")
    return source.rstrip() + "\n"


def expected_files(out: Path) -> dict[Path, str]:
    files: dict[Path, str] = {}
    for spec in ALL_MACHINES:
        stem = file_stem(spec)
        files[out / f"{stem}.mmd"] = render(spec, "mermaid")
        files[out / f"{stem}.dot"] = render(spec, "graphviz")
    return files


def embed(markdown: str) -> str:
    """Refresh every ``<!-- diagram:NAME -->`` block of a markdown text with the current Mermaid."""
    mermaid = {file_stem(spec): render(spec, "mermaid") for spec in ALL_MACHINES}

    def replace(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in mermaid:
            raise KeyError(f"protocol.md embeds unknown diagram {name!r}; known: {sorted(mermaid)}")
        return f"{match.group(1)}```mermaid\n{mermaid[name]}```\n{match.group(4)}"

    return _BLOCK.sub(replace, markdown)


def main(*, check: bool = False, out: str | None = None) -> int:
    root = Path.cwd()
    folder = Path(out) if out is not None else root / "specs" / "diagrams"
    files = expected_files(folder)
    protocol_md = root / "specs" / "protocol.md"
    if protocol_md.exists():
        files[protocol_md] = embed(protocol_md.read_text())
    stale = [path for path, text in files.items() if not path.exists() or path.read_text() != text]
    if check:
        for path in stale:
            print(f"out of date: {path} (run `pdkv diagram`)", file=sys.stderr)
        return 1 if stale else 0
    folder.mkdir(parents=True, exist_ok=True)
    for path in stale:
        path.write_text(files[path])
        print(f"wrote {path}", file=sys.stderr)
    return 0
