"""The committed diagrams and protocol.md blocks are exactly what the code renders and runs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdkv import diagrams
from pdkv.diagrams import embed, file_stem, render, sequences
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


def _copy_specs(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "specs" / "diagrams", tmp_path / "specs" / "diagrams")
    shutil.copy(ROOT / "specs" / "protocol.md", tmp_path / "specs" / "protocol.md")


def test_check_fails_when_a_diagram_drifts(tmp_path: Path) -> None:
    (tmp_path / "specs" / "diagrams").mkdir(parents=True)
    ok = subprocess.run(
        [sys.executable, "-m", "pdkv", "diagram"], cwd=tmp_path, capture_output=True, timeout=120
    )
    assert ok.returncode == 0
    target = tmp_path / "specs" / "diagrams" / "chunk.dot"
    target.write_text(target.read_text().replace("SKIPPED", "GONE"))
    stray = tmp_path / "specs" / "diagrams" / "seq_retired_story.mmd"
    stray.write_text("sequenceDiagram\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pdkv", "diagram", "--check"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "out of date" in proc.stderr and "chunk.dot" in proc.stderr
    assert "not generated any more" in proc.stderr and "seq_retired_story.mmd" in proc.stderr


def test_check_fails_when_a_scenario_exchange_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The AbortAck is no longer lost: the recorded exchange (no resent Abort) differs from the
    committed one, so the check fails on the scenario's file and its protocol.md block."""
    _copy_specs(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert diagrams.main(check=True) == 0

    def ack_not_lost() -> sequences.Recorder:
        r = sequences.decode_abort()  # an abort whose acknowledgement arrives the first time
        return r

    changed = tuple(
        sequences.Scenario(name=s.name, title=s.title, story=s.story, script=ack_not_lost)
        if s.name == "lost_abort_ack"
        else s
        for s in sequences.SCENARIOS
    )
    monkeypatch.setattr(sequences, "SCENARIOS", changed)
    capsys.readouterr()
    assert diagrams.main(check=True) == 1
    err = capsys.readouterr().err
    assert "seq_lost_abort_ack.mmd" in err and "protocol.md" in err
    assert "seq_decode_abort.mmd" not in err  # only the story that changed


def test_every_edge_appears_in_both_renderings_with_its_trigger() -> None:
    for spec in ALL_MACHINES:
        dot = render(spec, "graphviz")
        mermaid = render(spec, "mermaid")
        assert dot.startswith(f"digraph {spec.name} {{")
        assert f"title: {spec.name}" in mermaid
        for (source, trigger), dest in spec.table.items():
            assert f'  {source.name} -> {dest.name} [label="{trigger.value}' in dot
            assert f"  {source.name} --> {dest.name}: {trigger.value}" in mermaid


def test_edges_carry_guard_and_effects() -> None:
    """A row's edge reads ``input [guard] / effects`` with the names of the functions that run."""
    by_name = {spec.name: spec for spec in ALL_MACHINES}
    sender = render(by_name["SenderRoom"], "mermaid")
    assert (
        "  TRANSFERRING --> SUCCESS: chunk_done<br/>[complete]<br/>/ account, succeed, after_write\n"
        in sender
    )
    assert (
        "  TRANSFERRING --> COMPLETING: chunk_done<br/>[layers_still_writing]<br/>/ account, drop_layers"
        in sender
    )
    prefill_abort = render(by_name["PrefillAbort"], "graphviz")
    assert (
        '  DRAINING -> ACKED [label="writes_ended\\l/ answer_every_asker, forget_if_idle\\l"];'
        in prefill_abort
    )


def test_styling_is_neutral() -> None:
    for spec in ALL_MACHINES:
        mermaid, dot = render(spec, "mermaid"), render(spec, "graphviz")
        assert "classDef" not in mermaid and "Class " not in mermaid
        assert "active" not in mermaid + dot
        assert "color=" not in dot and "fillcolor" not in dot and "style=filled" not in dot


def test_protocol_md_embeds_every_machine_and_every_scenario() -> None:
    text = (ROOT / "specs" / "protocol.md").read_text()
    for spec in ALL_MACHINES:
        assert f"<!-- diagram:{file_stem(spec)} -->" in text
    for scenario in sequences.SCENARIOS:
        assert f"<!-- sequence:{scenario.name} -->" in text
        assert scenario.story in " ".join(text.split())  # wrapped in the file
    assert embed(text) == text


def test_embed_refuses_an_unknown_block() -> None:
    with pytest.raises(KeyError, match="unknown sequence 'nope'"):
        embed("<!-- sequence:nope -->\n<!-- /sequence -->\n")
