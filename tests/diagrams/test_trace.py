"""``pdkv trace``: JSON log lines of several ranks -> one room's sequence diagram."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdkv.cli import main as cli_main
from pdkv.diagrams.trace import read_logs, render, rooms
from pdkv.errors import TraceLogError

T0 = 1_800_000_000.0


def line(t: float, **fields: object) -> str:
    return json.dumps({"t": T0 + t, "level": "DEBUG", "logger": "pdkv.trace", "text": "", **fields})


DECODE = {"rank": "d tp0 cp0", "addr": "tcp://127.0.0.1:1", "proc": "pid 1"}
PREFILL = {"rank": "p tp0 cp0", "addr": "tcp://127.0.0.1:2", "proc": "pid 2"}


def write_logs(tmp_path: Path) -> Path:
    folder = tmp_path / "logs"
    folder.mkdir()
    decode = [
        line(
            0.000, event="send", room=9, msg="TransferRequest(4 pages)", peer_addr=PREFILL["addr"], **DECODE
        ),
        line(0.010, event="state", room=9, state="Failed", **DECODE),
        line(0.010, event="send", room=9, msg="Abort", peer_addr=PREFILL["addr"], **DECODE),
        line(0.0105, event="send", room=9, msg="Abort", peer_addr=PREFILL["addr"], **DECODE),
        line(0.030, event="recv", room=9, msg="AbortAck", peer=PREFILL["rank"], **DECODE),
        line(0.030, event="release", room=9, detail="safe", **DECODE),
        line(
            0.031, event="send", room=10, msg="TransferRequest(1 pages)", peer_addr=PREFILL["addr"], **DECODE
        ),
        "not json: the engine's glog line",
    ]
    prefill = [
        line(0.002, event="recv", room=9, msg="TransferRequest(4 pages)", peer=DECODE["rank"], **PREFILL),
        line(0.002, event="state", room=9, state="WaitingForInput", **PREFILL),
        line(0.012, event="recv", room=9, msg="Abort", peer=DECODE["rank"], **PREFILL),
        json.dumps(
            {
                "t": T0 + 0.013,
                "level": "WARNING",
                "logger": "pdkv.runtime",
                "proc": "pid 2",
                "text": "room 9 x",
            }
        ),
        line(0.029, event="send", room=9, msg="AbortAck", peer_addr=DECODE["addr"], **PREFILL),
    ]
    (folder / "d.jsonl").write_text("\n".join(decode) + "\n")
    (folder / "p.jsonl").write_text("\n".join(prefill) + "\n")
    (folder / "ignored.log").write_text("a text log is not read from a folder\n")
    return folder


def test_one_room_across_ranks_with_flight_times_losses_and_warnings(tmp_path: Path) -> None:
    logs = read_logs([write_logs(tmp_path)])
    assert logs.skipped == 1 and rooms(logs) == [9, 10]
    assert render(9, logs).splitlines() == [
        "---",
        "title: room 9",
        "---",
        "sequenceDiagram",
        "  participant R0 as d tp0 cp0",
        "  participant R1 as p tp0 cp0",
        "  R0->>R1: 2.0 ms TransferRequest(4 pages) (sent 0.0 ms)",
        "  Note over R1: 2.0 ms WaitingForInput",
        "  Note over R0: 10.0 ms Failed",
        "  R0-xR1: 10.5 ms Abort (no receive logged)",
        "  R0->>R1: 12.0 ms Abort (sent 10.0 ms)",
        "  Note over R1: 13.0 ms WARNING: room 9 x",
        "  R1->>R0: 30.0 ms AbortAck (sent 29.0 ms)",
        "  Note over R0: 30.0 ms pages released (safe)",
    ]


def test_unknown_room_and_missing_file_are_errors(tmp_path: Path) -> None:
    logs = read_logs([write_logs(tmp_path)])
    with pytest.raises(TraceLogError, match="no record of room 11"):
        render(11, logs)
    with pytest.raises(TraceLogError, match="no such log file"):
        read_logs([tmp_path / "nope.jsonl"])


def test_cli_prints_the_diagram_and_lists_rooms(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = write_logs(tmp_path)
    assert cli_main(["trace", "9", str(folder / "d.jsonl"), str(folder / "p.jsonl")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("---\ntitle: room 9\n") and "AbortAck" in out
    assert cli_main(["trace", "list", str(folder)]) == 0
    assert capsys.readouterr().out == "9\n10\n"
    assert cli_main(["trace", "12", str(folder)]) == 1
    assert "no record of room 12" in capsys.readouterr().err


def test_cli_writes_dot_and_refuses_an_image_without_graphviz(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = write_logs(tmp_path)
    out = tmp_path / "room9.dot"
    assert cli_main(["trace", "9", str(folder), "--dot", "--out", str(out)]) == 0
    dot = out.read_text()
    assert dot.startswith("digraph room_9 {") and 'label="30.0 ms AbortAck (sent 29.0 ms)"' in dot
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert cli_main(["trace", "9", str(folder), "--image", "svg"]) == 1
    assert "needs Graphviz's `dot`" in capsys.readouterr().err


def test_cli_reads_pdkv_log_json_when_no_log_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDKV_LOG_JSON", str(write_logs(tmp_path)))
    assert cli_main(["trace", "list"]) == 0
    assert capsys.readouterr().out == "9\n10\n"
    monkeypatch.delenv("PDKV_LOG_JSON")
    with pytest.raises(SystemExit):
        cli_main(["trace", "9"])
    assert "set PDKV_LOG_JSON" in capsys.readouterr().err
