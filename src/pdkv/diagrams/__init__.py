"""``pdkv diagram``: the diagrams reviewers read, generated from the code so they cannot drift.

Owns: the set of generated files and the marked blocks of ``specs/protocol.md`` — every machine
of ``pdkv.protocol.machines.ALL_MACHINES`` as a state diagram (``<machine>.mmd`` / ``.dot``, edges
with guard and effects, ``pdkv.diagrams.states``) and every scenario of
``pdkv.diagrams.sequences.SCENARIOS`` as a sequence diagram recorded from an execution
(``seq_<name>.mmd`` / ``.dot``) — and ``--check``, which reports any difference between those
files and the code (CI runs it through a test). ``--image svg|png`` also draws each DOT file when
Graphviz's ``dot`` binary is installed (never checked: its output depends on the Graphviz version).
``pdkv.diagrams.trace`` (``pdkv trace``) draws one room of real runs from the transports' JSON logs.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from pdkv.diagrams import sequences
from pdkv.diagrams.states import file_stem, render
from pdkv.protocol.machines import ALL_MACHINES

_BLOCK = re.compile(
    r"(<!-- (?P<kind>diagram|sequence):(?P<name>[a-z0-9_]+) -->\n)(?P<body>.*?)(<!-- /(?P=kind) -->)",
    re.DOTALL,
)

_STORIES = {scenario.name: scenario.story for scenario in sequences.SCENARIOS}


def expected_files(out: Path) -> dict[Path, str]:
    """Every generated file under ``out`` with its text."""
    files: dict[Path, str] = {}
    for spec in ALL_MACHINES:
        stem = file_stem(spec)
        files[out / f"{stem}.mmd"] = render(spec, "mermaid")
        files[out / f"{stem}.dot"] = render(spec, "graphviz")
    for scenario in sequences.SCENARIOS:
        chart = sequences.chart(scenario)
        files[out / f"{sequences.file_stem(scenario)}.mmd"] = chart.mermaid()
        files[out / f"{sequences.file_stem(scenario)}.dot"] = chart.dot()
    return files


def embed(markdown: str, rendered: dict[str, str] | None = None) -> str:
    """Refresh every ``<!-- diagram:NAME -->`` (state) and ``<!-- sequence:NAME -->`` block of a
    markdown text with the current Mermaid; ``rendered`` maps names to Mermaid already made."""
    if rendered is None:
        rendered = _mermaid_by_name()

    def replace(match: re.Match[str]) -> str:
        kind, name = match.group("kind"), match.group("name")
        key = name if kind == "diagram" else f"seq_{name}"
        if key not in rendered:
            known = sorted(k for k in rendered if k.startswith("seq_") == (kind == "sequence"))
            raise KeyError(f"protocol.md embeds unknown {kind} {name!r}; known: {known}")
        story = f"{textwrap.fill(_STORIES[name], width=100)}\n\n" if kind == "sequence" else ""
        return f"{match.group(1)}{story}```mermaid\n{rendered[key]}```\n{match.group(5)}"

    return _BLOCK.sub(replace, markdown)


def _mermaid_by_name(files: dict[Path, str] | None = None) -> dict[str, str]:
    files = files if files is not None else expected_files(Path("."))
    return {path.stem: text for path, text in files.items() if path.suffix == ".mmd"}


IMAGE_FORMATS = ("svg", "png")


def draw(dot_source: str, image_format: str) -> bytes | None:
    """The DOT text drawn by Graphviz's ``dot`` (``svg`` or ``png``), or None when ``dot`` is not
    installed. A DOT text ``dot`` refuses raises ``subprocess.CalledProcessError`` with its stderr."""
    if image_format not in IMAGE_FORMATS:
        raise ValueError(f"image format {image_format!r}: one of {IMAGE_FORMATS}")
    dot = shutil.which("dot")
    if dot is None:
        return None
    done = subprocess.run(
        [dot, f"-T{image_format}"], input=dot_source.encode(), capture_output=True, timeout=60, check=True
    )
    return done.stdout


def main(*, check: bool = False, out: str | None = None, image: str | None = None) -> int:
    root = Path.cwd()
    folder = Path(out) if out is not None else root / "specs" / "diagrams"
    files = expected_files(folder)
    protocol_md = root / "specs" / "protocol.md"
    if protocol_md.exists():
        files[protocol_md] = embed(protocol_md.read_text(), _mermaid_by_name(files))
    stale = [path for path, text in files.items() if not path.exists() or path.read_text() != text]
    generated = sorted(folder.glob("*.mmd")) + sorted(folder.glob("*.dot")) if folder.exists() else []
    unknown = [path for path in generated if path not in files]
    if check:
        for path in stale:
            print(f"out of date: {path} (run `pdkv diagram`)", file=sys.stderr)
        for path in unknown:
            print(f"not generated any more: {path} (remove it, or run `pdkv diagram`)", file=sys.stderr)
        return 1 if stale or unknown else 0
    folder.mkdir(parents=True, exist_ok=True)
    for path in stale:
        path.write_text(files[path])
        print(f"wrote {path}", file=sys.stderr)
    for path in unknown:
        path.unlink()
        print(f"removed {path} (no longer generated)", file=sys.stderr)
    if image is not None:
        if shutil.which("dot") is None:
            print(
                f"--image {image}: Graphviz's `dot` is not installed (Debian: graphviz); text only",
                file=sys.stderr,
            )
            return 0
        for path, text in files.items():
            drawn = draw(text, image) if path.suffix == ".dot" else None
            if drawn is not None:
                path.with_suffix(f".{image}").write_bytes(drawn)
                print(f"drew {path.with_suffix(f'.{image}')}", file=sys.stderr)
    return 0


__all__ = ["IMAGE_FORMATS", "draw", "embed", "expected_files", "file_stem", "main", "render"]
