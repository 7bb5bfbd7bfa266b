"""Sequence diagrams recorded from scenarios: they show what the protocol does, in order."""

from __future__ import annotations

import re

import pytest

from pdkv.diagrams import sequences
from pdkv.diagrams.sequences import SCENARIOS, render
from pdkv.errors import DiagramScenarioError

_BY_NAME = {s.name: s for s in SCENARIOS}


def lines_of(name: str) -> list[str]:
    return render(_BY_NAME[name]).splitlines()


def index(lines: list[str], pattern: str, start: int = 0) -> int:
    """The first line at or after ``start`` matching ``pattern`` (a regex)."""
    for i in range(start, len(lines)):
        if re.search(pattern, lines[i]):
            return i
    raise AssertionError(f"no line matches {pattern!r} after line {start}:\n" + "\n".join(lines))


def time_of(line: str) -> float:
    match = re.search(r": (\d+\.\d{3})s ", line)
    assert match, line
    return float(match.group(1))


def test_scenarios_cover_the_issue_and_render_deterministically() -> None:
    assert set(_BY_NAME) >= {
        "happy_path_cp2",
        "chunked_prefix",
        "decode_abort",
        "prefill_abort",
        "lost_abort_ack",
        "restarted_prefill",
        "silent_decode",
    }
    scenario = _BY_NAME["decode_abort"]
    assert render(scenario) == render(scenario)


def test_happy_path_cp2_registers_requests_both_ranks_and_succeeds_after_both() -> None:
    lines = lines_of("happy_path_cp2")
    assert lines[:4] == ["---", "title: Happy path, prefill CP 2", "---", "sequenceDiagram"]
    for cp in (0, 1):
        register = index(lines, rf"D->>P{cp}: .* Register$")
        ack = index(lines, rf"P{cp}->>D: .* RegisterAck$", register)
        request = index(lines, rf"D->>P{cp}: .* TransferRequest\(4 pages\)$", ack)
        write = index(lines, rf"P{cp}-->>D: .* KV writes of chunk 0$", request)
        index(lines, rf"P{cp}->>D: .* TransferStatus\(Success\)$", write)
    last_status = max(i for i, line in enumerate(lines) if "TransferStatus(Success)" in line)
    index(lines, r"Note over D: .*R SUCCESS", last_status)
    assert not any("Heartbeat" in line for line in lines)


def test_cached_prefix_is_in_the_request_and_two_chunks_follow() -> None:
    lines = lines_of("chunked_prefix")
    request = index(lines, r"D->>P0: .* TransferRequest\(10 pages, prefix 4\)$")
    chunk1 = index(
        lines, r"P0-->>D: .* KV writes of chunk 1$", index(lines, r"KV writes of chunk 0$", request)
    )
    index(lines, r"P0->>D: .* TransferStatus\(Success\)$", chunk1)


def test_decode_abort_acks_only_after_the_writes_drained_then_releases() -> None:
    lines = lines_of("decode_abort")
    failed = index(lines, r"Note over D: .*R FAILED \(aborted_here\)")
    abort = index(lines, r"D->>P0: .* Abort$", failed)
    ack = index(lines, r"P0->>D: .* AbortAck$", abort)
    started = [i for i, line in enumerate(lines) if re.search(r"P0-->>D: .* KV writes of chunk \d$", line)]
    done = [i for i, line in enumerate(lines) if re.search(r"Note over P0: .*C\d DONE", line)]
    assert started and len(done) == len(started)
    assert max(done) < ack  # every write that started ended before the AbortAck
    release = index(lines, r"Note over D: .*ReleasePages\(acked\)", ack)
    assert time_of(lines[release]) >= time_of(lines[ack])


def test_prefill_abort_tells_decode_which_answers_with_abort() -> None:
    lines = lines_of("prefill_abort")
    failed = index(lines, r"Note over P0: .*R FAILED \(aborted_here\)")
    status = index(lines, r"P0->>D: .* TransferStatus\(Failed\)$", failed)
    abort = index(lines, r"D->>P0: .* Abort$", index(lines, r"Note over D: .*aborted_by_peer", status))
    index(lines, r"Note over D: .*ReleasePages\(acked\)", index(lines, r"P0->>D: .* AbortAck$", abort))


def test_lost_abort_ack_is_answered_again_after_the_resend() -> None:
    lines = lines_of("lost_abort_ack")
    first = index(lines, r"D->>P0: .* Abort$")
    lost = index(lines, r"P0-xD: .* AbortAck \(lost\)$", first)
    resent = index(lines, r"D->>P0: .* Abort$", lost)
    assert time_of(lines[resent]) - time_of(lines[first]) == pytest.approx(1.0, abs=0.002)  # abort_resend
    assert not any("ReleasePages" in line for line in lines[:resent])  # pages held meanwhile
    index(lines, r"Note over D: .*ReleasePages\(acked\)", index(lines, r"P0->>D: .* AbortAck$", resent))


def test_restarted_prefill_fails_the_room_registers_again_and_gets_the_ack() -> None:
    lines = lines_of("restarted_prefill")
    failed = index(lines, r"Note over D: .*R FAILED \(peer_restart\).*ForgetPeer\(P0\)")
    register = index(lines, r"D->>P0: .* Register$", failed)
    abort = index(lines, r"D->>P0: .* Abort$", index(lines, r"P0->>D: .* RegisterAck$", register))
    ack = index(lines, r"P0->>D: .* AbortAck$", abort)
    # The new process's ack says nothing of the old one's sockets: the pages settle, then come back.
    settling = index(lines, r"Note over D: .*A SETTLING", ack)
    release = index(lines, r"Note over D: .*ReleasePages\(settled\)", settling)
    assert time_of(lines[release]) - time_of(lines[settling]) == pytest.approx(1.0, abs=0.01)


def test_silent_decode_is_forgotten_after_the_heartbeat_timeout() -> None:
    lines = lines_of("silent_decode")
    hang = index(lines, r"Note over D: .*process hangs")
    beats = [i for i, line in enumerate(lines) if re.search(r"P0-xD: .* Heartbeat\(\d+\) \(lost\)$", line)]
    assert len(beats) >= 3 and min(beats) > hang
    forgotten = index(lines, r"Note over P0: .*R FAILED \(peer_silent\)<br/>ForgetPeer\(D\)")
    assert 3.0 <= time_of(lines[forgotten]) - time_of(lines[hang]) <= 3.0 + 1.0 + 0.01  # timeout + a round
    index(lines, r"P0-xD: .* TransferStatus\(Failed\) \(lost\)$", forgotten)
    assert not any(line.startswith("  D-") for line in lines[hang:])  # the hung rank sends nothing


def test_per_layer_success_waits_for_the_layer_writes() -> None:
    lines = lines_of("per_layer")
    ended = [i for i, line in enumerate(lines) if re.search(r"Note over P0: .*L @\d+ ended", line)]
    success = index(lines, r"Note over P0: .*R SUCCESS")
    assert len(ended) == 2 and min(ended) < success and max(ended) <= success


def test_a_scenario_that_no_longer_ends_as_its_story_says_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every write fails: the happy path's room now fails, and the scenario says so.
    make = sequences._pair

    def failing_pair(**kw: object) -> sequences.Recorder:
        r = make(**kw)  # type: ignore[arg-type]  # _pair's own keywords, passed through
        r.fail_write = lambda room, chunk, rank: True
        return r

    monkeypatch.setattr(sequences, "_pair", failing_pair)
    with pytest.raises(DiagramScenarioError, match="'happy_path_cp2': decode ended Failed, expected Success"):
        render(_BY_NAME["happy_path_cp2"])


def test_failed_write_is_fenced_then_acknowledged_then_released() -> None:
    lines = lines_of("failed_write_fenced")
    failed = index(lines, r"P0->>D: .* TransferStatus\(Failed\)$")
    abort = index(lines, r"D->>P0: .* Abort$", failed)
    fence = index(lines, r"P0-->>D: .* fence: ", abort)
    ack = index(lines, r"P0->>D: .* AbortAck$", fence)
    assert time_of(lines[ack]) > time_of(lines[fence])  # the ack waited for the fence write
    settling = index(lines, r"Note over D: .*A SETTLING", ack)  # the fence drained the queue only
    index(lines, r"Note over D: .*ReleasePages\(settled\)", settling)
    assert not any("ReleasePages" in line for line in lines[:settling])
