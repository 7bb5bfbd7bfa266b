"""The committed diagrams and protocol.md blocks are exactly what the machines render."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pdkv.diagrams import embed, file_stem, render
from pdkv.protocol.machines import ALL_MACHINES

ROOT = Path(__file__).resolve().parents[1]


def test_diagram_check_passes_on_the_committed_tree() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pdkv", "diagram", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


def test_check_fails_when_a_diagram_drifts(tmp_path: Path) -> None:
    (tmp_path / "specs" / "diagrams").mkdir(parents=True)
    ok = subprocess.run(
        [sys.executable, "-m", "pdkv", "diagram"], cwd=tmp_path, capture_output=True, timeout=120
    )
    assert ok.returncode == 0
    target = tmp_path / "specs" / "diagrams" / "chunk.dot"
    target.write_text(target.read_text().replace("SKIPPED", "GONE"))
    proc = subprocess.run(
        [sys.executable, "-m", "pdkv", "diagram", "--check"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "chunk.dot" in proc.stderr


def test_every_edge_appears_in_both_renderings() -> None:
    for spec in ALL_MACHINES:
        dot = render(spec, "graphviz")
        mermaid = render(spec, "mermaid")
        assert dot.startswith(f"digraph {spec.name}")
        for (source, trigger), dest in spec.table.items():
            assert f"{source.name} -> {dest.name} [label={trigger.value}]" in dot
            assert f"{source.name} --> {dest.name}: {trigger.value}" in mermaid


def test_protocol_md_embeds_every_machine() -> None:
    text = (ROOT / "specs" / "protocol.md").read_text()
    for spec in ALL_MACHINES:
        assert f"<!-- diagram:{file_stem(spec)} -->" in text
    assert embed(text) == text
