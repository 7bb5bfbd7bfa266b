"""The sequence chart's two forms: Mermaid lines and a DOT grid (a column per lane, a row per step)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pdkv import diagrams
from pdkv.diagrams._chart import Chart, Step, StepKind

CHART = Chart(
    title="A story",
    lanes=(("D", "decode rank"), ("P0", "prefill cp0")),
    steps=(
        Step(kind=StepKind.MESSAGE, lane="D", to="P0", time="0.001s", lines=("Abort",)),
        Step(kind=StepKind.NOTE, lane="P0", time="0.002s", lines=("R FAILED", 'said "no"; #1')),
        Step(kind=StepKind.DATA, lane="P0", to="D", time="0.003s", lines=("KV writes of chunk 0",)),
        Step(kind=StepKind.LOST, lane="P0", to="D", time="0.004s", lines=("AbortAck (lost)",)),
    ),
)


def test_mermaid_form() -> None:
    assert CHART.mermaid().splitlines() == [
        "---",
        "title: A story",
        "---",
        "sequenceDiagram",
        "  participant D as decode rank",
        "  participant P0 as prefill cp0",
        "  D->>P0: 0.001s Abort",
        '  Note over P0: 0.002s R FAILED<br/>said "no"#59; #35;1',
        "  P0-->>D: 0.003s KV writes of chunk 0",
        "  P0-xD: 0.004s AbortAck (lost)",
    ]


def test_dot_form_is_a_grid_of_lanes_and_rows() -> None:
    dot = CHART.dot()
    assert dot.startswith("digraph A_story {\n") and dot.endswith("}\n")
    assert '  D_0 [shape=box, style=rounded, group=D, label="decode rank"];' in dot
    assert '  P0_2 [shape=note, group=P0, label="0.002s R FAILED\\lsaid \\"no\\"; #1\\l"];' in dot
    assert "  D_0 -> D_1 -> D_2 -> D_3 -> D_4 [style=dashed, arrowhead=none, color=gray];" in dot
    for row in range(5):
        assert f"  {{ rank=same; D_{row}; P0_{row}; }}" in dot
    assert '  D_1 -> P0_1 [label="0.001s Abort", style=solid, constraint=false];' in dot
    assert '  P0_3 -> D_3 [label="0.003s KV writes of chunk 0", style=dashed, constraint=false];' in dot
    assert 'P0_4 -> D_4 [label="0.004s AbortAck (lost)", style=solid, constraint=false, arrowhead=tee' in dot


def test_drawing_needs_graphviz(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert diagrams.draw(CHART.dot(), "svg") is None
    with pytest.raises(ValueError, match="image format 'gif'"):
        diagrams.draw(CHART.dot(), "gif")


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed here")
def test_dot_draws_every_generated_file() -> None:
    for path, text in diagrams.expected_files(Path("specs/diagrams")).items():
        if path.suffix == ".dot":
            drawn = diagrams.draw(text, "svg")
            assert drawn is not None and drawn.lstrip().startswith((b"<?xml", b"<svg")), path
