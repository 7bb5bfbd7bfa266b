"""Command-line mistakes are errors with a message and a non-zero exit (seams issue, item 12): ``pdkv
demo --rooms -1`` printed "result OK", ``--cp 0`` raised ZeroDivisionError, ``pdkv trace`` on a garbage
file exited 0 in silence and ``pdkv bench --help`` said "unknown benchmark"."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdkv.cli import main


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["demo", "--rooms", "-1"], "--rooms: -1 is below the least allowed value 1"),
        (["demo", "--rooms", "0"], "--rooms: 0 is below"),
        (["demo", "--cp", "0"], "--cp: 0 is below"),
        (["demo", "--decode-tp", "x"], "--decode-tp: 'x' is not a whole number"),
        (["demo", "--aborts", "1.5"], "--aborts: 1.5 is not in [0, 1]"),
        (["demo", "--page-size", "-16"], "--page-size: -16 is below"),
        (["demo", "--protocol-only", "--cp", "0"], "--cp: 0 is below"),
    ],
)
def test_bad_demo_arguments_exit_2_naming_the_argument(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert needle in capsys.readouterr().err


def test_trace_of_a_file_with_no_log_record_fails_and_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("not json\n{also not\n")
    for room in ("list", "5"):
        assert main(["trace", room, str(garbage)]) == 1
        assert "no pdkv JSON log record in" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["trace", "list", str(empty)]) == 1
    assert "(no lines)" in capsys.readouterr().err


def test_bench_help_describes_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "pdkv bench list names them" in out and "unknown benchmark" not in out
